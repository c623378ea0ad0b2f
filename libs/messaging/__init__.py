"""NATS plumbing shared by services, agents and the client: connections, streams, RPC, followers."""
