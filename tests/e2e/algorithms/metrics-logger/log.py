"""A stand-in training loop that logs its loss into the job's run every step (R1), as a real one would."""

import argparse
import os
import time

from trainyard import run

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=50)
parser.add_argument("--step-seconds", type=float, default=0.05)
args, _ = parser.parse_known_args()  # torch's launcher adds --local-rank

rank = int(os.environ.get("RANK", "0"))
attempt = int(os.environ["TRAINYARD_ATTEMPT"])
print(f"started rank {rank} attempt {attempt} pid {os.getpid()}", flush=True)
if rank == 0:
    run.config({"steps": args.steps, "step_seconds": args.step_seconds})
for step in range(args.steps):
    run.log({"loss": 1.0 / (step + 1), "attempt": attempt}, step=step)
    time.sleep(args.step_seconds)
if rank == 0:
    run.summary({"final_loss": 1.0 / args.steps})
print(f"done rank {rank} attempt {attempt}", flush=True)
