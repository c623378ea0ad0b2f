"""Benchmarks of the scheduler's decision logic; run them with `python -m bench.<name>`."""
