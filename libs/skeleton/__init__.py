"""The skeleton every service and agent process stands on: `runtime.py` (connections, schema, streams, outbox
relay), `eventsourced.py` (the state fold, the followers of upstream streams, recording, loops) and
`entrypoint.py` (the `__main__` of every process)."""
