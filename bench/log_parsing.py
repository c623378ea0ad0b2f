"""How fast the monitor reads job logs for performance detection (M6), in lines per second.

    python -m bench.log_parsing [--lines 2000000] [--chunk 50] [--repeats 5]

Log chunks are built as agents ship them (JSON `LogChunk`s of `--chunk` lines) and pushed through
what the monitor does with each one of a watched job: decode it, then feed it to the job's windows
(services/monitor/performance/detector.py). Three mixes: every line an iteration line, one line in ten,
none (a chatty job that prints no timings). Chunks of jobs that are not watched are skipped by their
subject before decoding, which costs nothing worth measuring.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time

from libs.contracts.agent import LogChunk
from libs.contracts.codec import decode, encode
from libs.contracts.jobspec import PerformanceDetection
from services.monitor.performance.detector import PerformanceDetector

JOB = "job-0000000000b1"


def iteration_line(rng: random.Random) -> str:
    e2e = rng.uniform(3000, 3400)
    return f"this iteration hardware time is {e2e * rng.uniform(0.55, 0.75):.3f} and e2e time is {e2e!r} ms."


def other_line(rng: random.Random, step: int) -> str:
    return f"[rank 0] step {step} loss {rng.random():.4f} lr 0.000125 grad_norm {rng.random() * 3:.3f} tokens/s 18234"


def chunks(lines: int, per_chunk: int, share: float, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    made: list[bytes] = []
    for seq in range(lines // per_chunk):
        text = [iteration_line(rng) if rng.random() < share else other_line(rng, seq * per_chunk + i)
                for i in range(per_chunk)]
        made.append(encode(LogChunk(job_id=JOB, attempt=1, rank=0, node="node-a", seq=seq, lines=text)))
    return made


def run(payloads: list[bytes]) -> tuple[float, int]:
    detector = PerformanceDetector()
    # A threshold the mix never crosses for long: the windows work, incidents stay rare.
    detector.watch(JOB, 1, PerformanceDetection(threshold=0.7, window=10))
    started = time.perf_counter()
    incidents = 0
    for payload in payloads:
        incidents += len(detector.feed(decode(payload, LogChunk)))
    return time.perf_counter() - started, incidents


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=2_000_000)
    parser.add_argument("--chunk", type=int, default=50, help="lines per log chunk (agents ship up to 200)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print(f"python {platform.python_version()} on {platform.machine()}, {args.lines:,} lines in chunks of "
          f"{args.chunk}, median of {args.repeats} runs")
    print(f"{'mix':<26}{'lines/s':>14}{'chunks/s':>12}{'incidents':>11}")
    for label, share in (("every line an iteration", 1.0), ("one line in ten", 0.1), ("no iteration lines", 0.0)):
        payloads = chunks(args.lines, args.chunk, share, args.seed)
        timings = [run(payloads) for _ in range(args.repeats)]
        seconds = statistics.median(t for t, _ in timings)
        lines = len(payloads) * args.chunk
        print(f"{label:<26}{lines / seconds:>14,.0f}{len(payloads) / seconds:>12,.0f}{timings[0][1]:>11}")


if __name__ == "__main__":
    main()
