"""A DistributedDataParallel job that survives hardware faults (J12): it saves a checkpoint when
Trainyard sends the checkpoint signal and, started again on other nodes, resumes from it.

Trainyard tells the job which signal means "save now" (TRAINYARD_CHECKPOINT_SIGNAL) and where
checkpoints live (TRAINYARD_CHECKPOINT_DIR, kept in shared storage across attempts and nodes).
The handler only raises a flag: at the start of every step all ranks agree (an all-reduce of the
flag) on whether to save, so no rank is left waiting in a collective for one that already left.
When a whole node dies, its peers' collectives fail before any signal can come: a rank then saves
the last step it completed and exits non-zero, and the platform, seeing the node lost, resumes the
job all the same. Every rank writes its own file (they hold the same state), so the checkpoint
survives whichever node was lost; a new attempt loads the newest one.

Every step prints the line performance detection (M6) reads: `this iteration hardware time is H and
e2e time is E ms.` Options: --steps N (default 60), --step-seconds S (pause per step, default 0.2),
--slow-after N (from step N on, until the job is resumed, the hardware share of each iteration
rises from 0.5 to 0.9: a stand-in for a degrading board).
"""

import argparse
import os
import signal
import time
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist
from torch import nn

save_requested = False


def request_save(signum: int, frame: FrameType | None) -> None:
    global save_requested
    save_requested = True


def newest_checkpoint(folder: Path) -> dict | None:
    found = [torch.load(path) for path in sorted(folder.glob("rank-*.pt"))]
    return max(found, key=lambda c: c["step"], default=None)


def save(folder: Path, rank: int, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    partial = folder / f".rank-{rank}.pt.partial"
    torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()}, partial)
    partial.replace(folder / f"rank-{rank}.pt")  # never leave a half-written checkpoint behind


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--step-seconds", type=float, default=0.2)
    parser.add_argument("--slow-after", type=int, default=0)
    args, _ = parser.parse_known_args()  # torch.distributed.launch adds --local-rank

    folder = Path(os.environ.get("TRAINYARD_CHECKPOINT_DIR", "checkpoints"))
    folder.mkdir(parents=True, exist_ok=True)
    signal.signal(getattr(signal, os.environ.get("TRAINYARD_CHECKPOINT_SIGNAL", "SIGUSR1")), request_save)

    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    node = os.environ.get("TRAINYARD_NODE", "?")
    resumes = os.environ.get("TRAINYARD_RESUME_COUNT", "0")
    print(f"rank {rank}/{world} on {node} joined (resume {resumes})", flush=True)

    torch.manual_seed(1234 + rank)
    x = torch.rand(256, 1)
    points = torch.cat([x, 3 * x + 2], dim=1)
    model = nn.parallel.DistributedDataParallel(nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    first = 1
    checkpoint = newest_checkpoint(folder)
    if checkpoint is not None:
        model.module.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        first = checkpoint["step"] + 1
        print(f"rank {rank} resumed from step {checkpoint['step']}", flush=True)

    for step in range(first, args.steps + 1):
        started = time.perf_counter()
        try:
            flag = torch.tensor([1.0 if save_requested else 0.0])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() > 0:
                save(folder, rank, step - 1, model.module, optimizer)
                print(f"rank {rank} saved a checkpoint at step {step - 1} on {node}", flush=True)
                return
            batch = points[torch.randint(len(points), (64,))]
            loss = nn.functional.mse_loss(model(batch[:, :1]), batch[:, 1:])
            optimizer.zero_grad()
            loss.backward()  # DDP averages the gradients here: a vanished peer fails it
        except RuntimeError as error:  # the weights are still those of the last completed step
            save(folder, rank, step - 1, model.module, optimizer)
            print(f"rank {rank} saved a checkpoint at step {step - 1} on {node} (a peer is gone: "
                  f"{str(error).splitlines()[0][:120]})", flush=True)
            raise SystemExit(1) from None
        optimizer.step()
        time.sleep(args.step_seconds)
        e2e = (time.perf_counter() - started) * 1000
        degraded = 0 < args.slow_after <= step and resumes == "0"
        hardware = e2e * (0.9 if degraded else 0.5)
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        print(f"this iteration hardware time is {hardware:.3f} and e2e time is {e2e:.6f} ms.", flush=True)

    print(f"rank {rank} finished at step {args.steps}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
