"""Run the scheduler service: `python -m services.scheduler`."""

from libs.skeleton.entrypoint import run
from services.scheduler.service import Scheduler

if __name__ == "__main__":
    run(Scheduler.name, Scheduler.started)
