"""Structured logs and traces (SPEC X3)."""
