"""The scheduler's state and what it says: the fold of its own and its upstreams' events (state.py), the names it
records under, and the pure checks and views that read the state: access (J2) and what is hidden from whom,
shared storage's owners, spec checks, per-user limits, job arrays, training images, the cluster views.

Nothing here does I/O, reads a clock or imports the rest of the scheduler: every other part stands on it.
"""
