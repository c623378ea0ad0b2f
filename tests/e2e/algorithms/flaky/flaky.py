"""Fails its first N attempts with exit code 3, then succeeds (for fault restart, J13)."""

import os
import sys

failures = int(sys.argv[1])
attempt = int(os.environ["TRAINYARD_ATTEMPT"])
print(f"attempt {attempt} on {os.environ.get('TRAINYARD_NODE')}", flush=True)
raise SystemExit(3 if attempt <= failures else 0)
