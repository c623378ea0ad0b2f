"""Writes a file into the job's outputs and says where it wrote it."""

import os
import sys
from pathlib import Path

outputs = Path(os.environ.get("TRAINYARD_WORKSPACE", "/workspace")) / "outputs"
(outputs / "result.txt").write_text(f"written by {sys.argv[1]}\n")
print(f"wrote result.txt for {sys.argv[1]}", flush=True)
