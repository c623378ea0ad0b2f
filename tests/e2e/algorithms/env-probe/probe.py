"""Prints what a node of a job received: distributed-mode variables and generated files.

A TensorFlow parameter server (TF_CONFIG task type "ps") then serves until it is stopped, as a real
one would.
"""

import json
import os
import time

KEYS = ("TF_CONFIG", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "SLOTS", "OMPI_MCA_orte_default_hostfile",
        "HYDRA_HOST_FILE", "HYDRA_IFACE")
print("PROBE " + json.dumps({key: os.environ[key] for key in KEYS if key in os.environ}, sort_keys=True),
      flush=True)
if json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("type") == "ps":
    print("parameter server serving", flush=True)
    while True:
        time.sleep(1)
