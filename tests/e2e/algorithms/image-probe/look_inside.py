"""Reports what a node of a job sees of its image and of its workspace, one `probe:` line per fact."""

import os
import sys

rank = os.environ.get("RANK", "0")


def say(text: str) -> None:
    print(f"probe: {text}", flush=True)


def os_release() -> dict[str, str]:
    with open("/etc/os-release") as f:
        pairs = (line.strip().split("=", 1) for line in f if "=" in line)
        return {key: value.strip('"') for key, value in pairs}


with open("/etc/trainyard-test-image") as marker:
    say(f"variant {os_release().get('VARIANT_ID')} marker {marker.read().strip()}")
say(f"python {sys.executable} image var {os.environ.get('TRAINYARD_IMAGE_VAR')}")
say(f"host files visible {os.path.exists('/usr/sbin/nats-server') or os.path.exists('/usr/lib/postgresql')}")
say(f"cwd {os.getcwd()}")
say(f"mode RANK={rank} WORLD_SIZE={os.environ.get('WORLD_SIZE')} MASTER_PORT set {'MASTER_PORT' in os.environ}")
with open(os.path.join("/workspace/dataset/private", sys.argv[1], "hello.txt")) as f:
    say(f"dataset reads {f.read().strip()}")
try:
    with open(os.path.join("/workspace/dataset/private", sys.argv[1], f"by-{rank}.txt"), "w") as f:
        f.write("should not be here\n")
    say("dataset write allowed")
except OSError as exc:
    say(f"dataset write refused errno {exc.errno}")
with open(f"/workspace/outputs/rank-{rank}.txt", "w") as f:
    f.write(f"written in the image by rank {rank}\n")
if os.path.exists("/job/hostfile"):
    with open("/job/hostfile") as f:
        for line in f.read().splitlines():
            say(f"hostfile {line}")
sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
