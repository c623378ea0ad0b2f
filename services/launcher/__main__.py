"""Run the launcher service: `python -m services.launcher`."""

from libs.skeleton.entrypoint import run
from services.launcher.service import Launcher

if __name__ == "__main__":
    run(Launcher.name, Launcher.started)
