"""Launcher service: launch plans per distributed mode (L1–L7) and process lifecycles on agents."""
