"""Prints what a node of a job received: distributed-mode variables and generated files.

Under TensorFlow it behaves like a real cluster: a parameter server (task type "ps") listens on its
TF_CONFIG address until it is stopped, and a worker reaches every parameter server before it ends.
"""

import json
import os
import socket
import time

KEYS = ("TF_CONFIG", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "SLOTS", "OMPI_MCA_orte_default_hostfile",
        "HYDRA_HOST_FILE", "HYDRA_IFACE", "TRAINYARD_AUTH_SECRET_FILE", "TRAINYARD_TOKEN_FILE")
print("PROBE " + json.dumps({key: os.environ[key] for key in KEYS if key in os.environ}, sort_keys=True),
      flush=True)

config = json.loads(os.environ.get("TF_CONFIG", "{}"))
task = config.get("task", {})
if task.get("type") == "ps":
    host, port = config["cluster"]["ps"][task["index"]].rsplit(":", 1)
    server = socket.create_server(("", int(port)))
    print("parameter server serving", flush=True)
    while True:
        server.accept()[0].close()
for address in config.get("cluster", {}).get("ps", []):
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            print(f"reached parameter server {address}", flush=True)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
