"""A rank's processes on the node: the environment they get, the holder that runs them so that they outlive
the agent, and the signals that stop them. Nothing here knows of NATS, caches or workspaces."""
