"""Keeps one CPU busy until it is stopped, holding a known amount of memory."""

import sys

held = bytearray(int(sys.argv[1]) * 2**20 if len(sys.argv) > 1 else 0)
print(f"spinning with {len(held) // 2**20} MiB", flush=True)
while True:
    pass
