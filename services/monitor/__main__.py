"""Run the monitor service: `python -m services.monitor`."""

from libs.skeleton.entrypoint import run
from services.monitor.service import Monitor

if __name__ == "__main__":
    run(Monitor.name, Monitor.started)
