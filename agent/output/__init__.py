"""What leaves the node for each rank: its output in numbered log chunks, its start and exit reports, its
metrics (R1) and its resource usage (L9), each published to JetStream so that retries are harmless."""
