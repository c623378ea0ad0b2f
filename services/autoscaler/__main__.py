"""Run the autoscaler service: `python -m services.autoscaler`."""

from libs.skeleton.entrypoint import run
from services.autoscaler.service import Autoscaler

if __name__ == "__main__":
    run(Autoscaler.name, Autoscaler.started)
