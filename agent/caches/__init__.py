"""The node's caches on its local disk: datasets copied before a job's command (J14, D1, D2) and images
unpacked for it (J10), pinned while ranks use them and evicted by the administrator's policy."""
