/* Copy speed of cross-memory attach (process_vm_readv, OpenMPI's single-copy
 * path) against memcpy on this machine: a child holds SIZE MiB (default 8),
 * the parent reads it in chunks of 64 KiB to 4 MiB, into a buffer as large, or
 * with `cached` 1 into one chunk reused (a destination that stays in cache, as
 * the single-copy all-reduce's scratch). A SIZE past the caches (64, 512)
 * measures copies out of memory.
 *
 *   gcc -O2 benchmarks/collectives/cma_copy.c -o /tmp/cma_copy && /tmp/cma_copy [SIZE [cached]]
 */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
  const size_t size = (size_t)(argc > 1 ? atoi(argv[1]) : 8) << 20;
  const int cached = argc > 2 && atoi(argv[2]) != 0;
  if (size < (4u << 20)) return fprintf(stderr, "SIZE: at least 4 (MiB)\n"), 2;
  char* src = aligned_alloc(4096, size);
  char* dst = aligned_alloc(4096, size);
  if (!src || !dst) return perror("aligned_alloc"), 1;
  memset(src, 1, size);
  memset(dst, 0, size);
  pid_t pid = fork();
  if (pid < 0) return perror("fork"), 1;
  if (pid == 0) {
    sleep(60);
    return 0;
  }
  for (size_t chunk = 64 << 10; chunk <= (4u << 20); chunk *= 4) {
    double cma = 1e9, cpy = 1e9;
    for (int rep = 0; rep < 20; ++rep) {
      double t0 = now();
      for (size_t off = 0; off < size; off += chunk) {
        struct iovec l = {cached ? dst : dst + off, chunk}, r = {src + off, chunk};
        if (process_vm_readv(pid, &l, 1, &r, 1, 0) != (ssize_t)chunk) {
          perror("process_vm_readv");
          kill(pid, SIGKILL);
          return 1;
        }
      }
      double t = now() - t0;
      if (t < cma) cma = t;
      t0 = now();
      for (size_t off = 0; off < size; off += chunk)
        memcpy(cached ? dst : dst + off, src + off, chunk);
      t = now() - t0;
      if (t < cpy) cpy = t;
    }
    printf("chunk %4zu KiB: process_vm_readv %.1f GB/s, memcpy %.1f GB/s (bytes copied / s)\n",
           chunk >> 10, size / cma / 1e9, size / cpy / 1e9);
  }
  kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
  return 0;
}
