"""Looks around its node's /workspace and reports what it finds, one `probe:` line per fact."""

import argparse
import os
import signal
import subprocess
import time

parser = argparse.ArgumentParser()
parser.add_argument("--dataset", required=True)
parser.add_argument("--hostfile")
parser.add_argument("--hold", type=float, default=0.0, help="then start a child and wait this long")
parser.add_argument("--ignore-term", action="store_true", help="while holding, ignore SIGTERM (so does the child)")
args = parser.parse_args()

rank = os.environ.get("RANK", "0")
workspace = os.environ["TRAINYARD_WORKSPACE"]


def say(text: str) -> None:
    print(f"probe: {text}", flush=True)


say(f"backend {os.environ.get('TRAINYARD_WORKSPACE_BACKEND')} workspace {workspace} cwd {os.getcwd()}")
say("workspace holds " + " ".join(sorted(os.listdir(workspace))))
dataset = os.path.join(workspace, "dataset", "private", args.dataset)
with open(os.path.join(dataset, "hello.txt")) as f:
    say(f"dataset reads {f.read().strip()}")
try:
    with open(os.path.join(dataset, f"written-by-rank-{rank}.txt"), "w") as f:
        f.write("should not be here\n")
    say("dataset write allowed")
except OSError as exc:
    say(f"dataset write refused errno {exc.errno}")
with open(os.path.join(workspace, "outputs", f"rank-{rank}.txt"), "w") as f:
    f.write(f"written by rank {rank}\n")
say("outputs write done")
if args.hostfile:
    with open(args.hostfile) as f:
        for line in f.read().splitlines():
            say(f"hostfile {line}")
if args.hold:
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen(["sleep", str(args.hold)])
    say(f"holding pid {os.getpid()} child {child.pid}")
    time.sleep(args.hold)
say("done")
