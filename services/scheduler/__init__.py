"""Scheduler service: job commands, priority queue (S1), gang admission (S4), job states (S12).

Its parts, each standing only on those listed after it (pyproject.toml's import contracts hold them to it):
`service.py` wires them into the running service; `handlers/` answer the requests; `history/` (the scheduler
at a past instant, and what-if replays) and `rules/` (its decisions, as the events to record); `planning/` (its
cycle played forward, predictions, `why`); `domain/` (the state fold and the checks and views that read it).
"""
