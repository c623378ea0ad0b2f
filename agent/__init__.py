"""Node agent: one per compute host; registers, heartbeats, runs process groups, ships logs."""
