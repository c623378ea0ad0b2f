"""Scheduler service: job commands, priority queue (S1), gang admission (S4), job states (S12)."""
