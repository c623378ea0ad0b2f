"""A small DistributedDataParallel job: fits y = 3x + 2 with gloo on CPU; rank 0 saves a checkpoint.

With --data, the samples come from a CSV file (x,y per line), read from the job's read-only dataset;
each rank takes its own share of them.

Launched by Trainyard's PyTorch mode through torch.distributed.launch, which sets RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for every process.
"""

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from trainyard import run  # the job's run: every rank logs into it (docs/runs.md)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--data", type=Path, help="CSV file of x,y samples (default: synthetic)")
    args, _ = parser.parse_known_args()  # torch.distributed.launch adds --local-rank

    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"rank {rank}/{world} on {os.environ.get('TRAINYARD_NODE', '?')} joined "
          f"(master {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']})", flush=True)

    torch.manual_seed(1234 + rank)
    if args.data:
        rows = [line.split(",") for line in args.data.read_text().splitlines()[1:] if line]
        points = torch.tensor([[float(x), float(y)] for x, y in rows])[rank::world]
        print(f"rank {rank} read {len(points)} of {len(rows)} samples from {args.data.name}", flush=True)
    else:
        x = torch.rand(256, 1)
        points = torch.cat([x, 3 * x + 2], dim=1)
    model = nn.parallel.DistributedDataParallel(nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if rank == 0:
        run.config({"lr": 0.1, "steps": args.steps, "world": world})
    for step in range(1, args.steps + 1):
        batch = points[torch.randint(len(points), (64,))]
        x, y = batch[:, :1], batch[:, 1:]
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.log({"loss": loss.item()}, step=step)
        if step % 10 == 0 or step == args.steps:
            print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        time.sleep(0.05)

    if rank == 0:
        outputs = Path(os.environ.get("TRAINYARD_WORKSPACE", "/workspace")) / "outputs"
        checkpoint = outputs / "checkpoint.pt"
        torch.save({"step": args.steps, "model": model.module.state_dict()}, checkpoint)
        weight, bias = model.module.weight.item(), model.module.bias.item()
        print(f"rank 0 saved {checkpoint.name}: weight {weight:.3f} bias {bias:.3f}", flush=True)
        run.summary({"weight": weight, "bias": bias})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
