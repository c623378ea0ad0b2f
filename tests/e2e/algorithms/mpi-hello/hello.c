/* A small MPI program: every rank reports its rank, the world size and its node, then all ranks
 * sum their ranks with MPI_Allreduce, which only works if they really talk to each other. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
    int rank, size, sum = 0;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    const char *node = getenv("TRAINYARD_NODE");
    printf("hello from rank %d of %d on %s\n", rank, size, node ? node : "?");
    fflush(stdout);
    MPI_Allreduce(&rank, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0) {
        printf("sum of ranks %d\n", sum);
        fflush(stdout);
    }
    MPI_Finalize();
    return 0;
}
