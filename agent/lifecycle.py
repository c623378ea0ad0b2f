"""The command a rank's command runs under when its job has lifecycle scripts (SPEC J18):
`python3 -m agent.lifecycle [--before-start CMD] [--after-end CMD] -- COMMAND...`.

The launcher writes this module's path into every such launch plan (`LaunchPlanned`, kept for good in the
event log, and started again from there), so the path stays while the code lives with the rest of a rank's
life on its node: agent/ranks/lifecycle_scripts.py.
"""

from __future__ import annotations

from agent.ranks.lifecycle_scripts import main

if __name__ == "__main__":
    main()
