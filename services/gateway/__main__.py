"""Run the gateway: `python -m services.gateway` (its address: TRAINYARD_HTTP_ADDRESS, default 127.0.0.1:8080)."""

from libs.skeleton.entrypoint import run
from services.gateway.service import Gateway

if __name__ == "__main__":
    run(Gateway.name, Gateway.started)
