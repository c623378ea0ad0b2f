"""The node as the monitor knows it: what the host offers, its registration, its heartbeats and the health
probes they carry (M1, M2)."""
