"""The scheduler's request handlers: each class lists its `routes()` and, for every request, checks the
authenticated caller against J2, reads the state or calls the rules, and records what they return.

They use the scheduler through interfaces.py, never the service itself, so a test may give them anything that has
what those protocols name.
"""
