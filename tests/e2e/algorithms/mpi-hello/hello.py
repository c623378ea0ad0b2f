"""Reports the MPI rank and size this process was started with, and the node it runs on."""

import os

print(f"hello from rank {os.environ['OMPI_COMM_WORLD_RANK']} of {os.environ['OMPI_COMM_WORLD_SIZE']} "
      f"on {os.environ.get('TRAINYARD_NODE')}", flush=True)
