"""The operation catalogue: every request/reply exchange, declared once beside its request and reply.

One module per area (jobs, arrays, planning, cluster, runs, alerts, cache, autoscaler, images, agents);
`base.py` has the `Operation` declaration and what every reply shares; `catalogue.py` gathers them all.
"""
