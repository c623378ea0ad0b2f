"""A stand-in training script: announces itself, works for a while, exits with a chosen code."""

import argparse
import os
import time

parser = argparse.ArgumentParser()
parser.add_argument("--seconds", type=float, default=1.0)
parser.add_argument("--exit-code", type=int, default=0)
args = parser.parse_args()

rank = os.environ.get("RANK", "0")
print(f"started rank {rank} on {os.environ.get('TRAINYARD_NODE')} pid {os.getpid()}", flush=True)
deadline = time.monotonic() + args.seconds
while time.monotonic() < deadline:
    time.sleep(0.1)
print(f"done rank {rank}", flush=True)
raise SystemExit(args.exit_code)
