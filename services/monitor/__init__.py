"""Monitor service: node registration, heartbeats and fault patrol (M2)."""
