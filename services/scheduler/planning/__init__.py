"""How the scheduler looks ahead: what its decision logic sees of the state (decision_inputs.py), its own cycle
played forward in virtual time (simulation.py, playthrough.py), the backfill and rough plans past what a playthrough
covers, the predictions made from them (S6) and kept per state, how long jobs really run, and `why` a job waits.

All of it is pure but the worker thread that plans predictions off the event loop (thread.py). It stands on the
domain, and on the scheduler's metrics for how long its plans take.
"""
