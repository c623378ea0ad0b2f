"""Message types and subjects shared by every Trainyard process (SPEC X2).

Submodules: `jobspec` (the job spec and its validation), `cluster` (nodes, flavors), `events`
(domain events), `messages` (commands, queries, replies), `agent` (node agent protocol),
`subjects` (NATS subjects and streams), `codec` (JSON encoding).
"""
