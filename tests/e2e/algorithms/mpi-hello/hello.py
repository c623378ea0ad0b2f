"""Reports the MPI rank and size this process was started with, and the node it runs on."""

import os

# One write per line: mpirun merges every rank's output into the master's, and a line written in
# pieces could be split by another rank's.
line = (f"hello from rank {os.environ['OMPI_COMM_WORLD_RANK']} of {os.environ['OMPI_COMM_WORLD_SIZE']} "
        f"on {os.environ.get('TRAINYARD_NODE')}\n")
os.write(1, line.encode())
