"""What a job imports of Trainyard: `from trainyard import run` logs metrics into the job's run (SPEC R1).

Only the standard library is used here, so every job can import it without installing anything.
"""

from trainyard.run import Run, run

__all__ = ["Run", "run"]
