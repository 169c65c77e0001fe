/* OpenMPI's side of benchmarks/multihost/multihost.py: for each argument "coll:bytes:iters"
 * (coll: all_reduce, reduce_scatter or all_gather; bytes: the whole buffer, the
 * all-gather's output), times `iters` calls of float sums three times and prints
 * "coll bytes seconds-per-call" (the median of the three) on rank 0. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank, n;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  for (int a = 1; a < argc; ++a) {
    char coll[32];
    long bytes, iters;
    if (sscanf(argv[a], "%31[^:]:%ld:%ld", coll, &bytes, &iters) != 3) MPI_Abort(MPI_COMM_WORLD, 2);
    const int ar = strcmp(coll, "all_reduce") == 0, rs = strcmp(coll, "reduce_scatter") == 0;
    long count = bytes / 4 / (ar ? 1 : n);
    if (count < 1) count = 1;
    const long total = ar ? count : count * n;
    float* full = malloc(total * sizeof(float));
    float* part = malloc(count * sizeof(float));
    for (long i = 0; i < total; ++i) full[i] = 1.0f;
    for (long i = 0; i < count; ++i) part[i] = 1.0f;
    double t[3];
    for (int rep = -1; rep < 3; ++rep) {
      MPI_Barrier(MPI_COMM_WORLD);
      const double t0 = MPI_Wtime();
      for (long i = 0; i < (rep < 0 ? 1 : iters); ++i) {
        if (ar)
          MPI_Allreduce(MPI_IN_PLACE, full, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        else if (rs)
          MPI_Reduce_scatter_block(full, part, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        else
          MPI_Allgather(part, (int)count, MPI_FLOAT, full, (int)count, MPI_FLOAT, MPI_COMM_WORLD);
      }
      if (rep >= 0) t[rep] = (MPI_Wtime() - t0) / iters;
    }
    qsort(t, 3, sizeof(double), cmp);
    if (rank == 0) printf("%s %ld %.9f\n", coll, total * 4, t[1]);
    fflush(stdout);
    free(full);
    free(part);
  }
  MPI_Finalize();
  return 0;
}
