/* What single-copy CMA would give pycollectives' 2-rank all-gather on plain
 * buffers: two processes, each gathers its input and its peer's into its
 * output, (a) with a memcpy of its own input and one process_vm_readv of the
 * peer's (OpenMPI's single-copy path), (b) with two copies through shared
 * memory (the schedule pycollectives' ring and one-shot paths follow). Best of
 * 5 trials of the mean time per call; sizes are the total output, as
 * nccl-tests counts them.
 *
 *   gcc -O2 benchmarks/collectives/cma_allgather.c -o /tmp/cma_allgather && /tmp/cma_allgather
 */
#define _GNU_SOURCE
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef struct {
  _Atomic long arrive[2], done[2];
  pid_t pid[2];
  char* in[2];
} ctl_t;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void wait_ge(_Atomic long* a, long v) {
  while (atomic_load(a) < v) __builtin_ia32_pause();
}

static void* xmap(size_t n) {
  void* p = mmap(0, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) perror("mmap"), exit(1);
  return p;
}

int main(void) {
  const size_t sizes[] = {64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20};
  ctl_t* ctl = xmap(4096);
  char* shm = xmap(64 << 20);
  pid_t child = fork();
  if (child < 0) return perror("fork"), 1;
  const int r = child == 0, p = 1 - r;
  ctl->pid[r] = getpid();
  long seq = 0;
  for (int si = 0; si < 6; si++) {
    const size_t total = sizes[si], bytes = total / 2;
    char *in = aligned_alloc(64, bytes), *out = aligned_alloc(64, total);
    if (!in || !out) return perror("aligned_alloc"), 1;
    memset(in, r + 1, bytes);
    memset(out, 0, total);
    ctl->in[r] = in;
    const int iters = total <= (1 << 20) ? 2000 : total <= (16 << 20) ? 50 : 10;
    double best_cma = 1e9, best_two = 1e9;
    for (int trial = 0; trial < 5; trial++) {
      seq++;
      atomic_store(&ctl->arrive[r], seq);
      wait_ge(&ctl->arrive[p], seq);
      double t0 = now();
      for (int it = 0; it < iters; it++) {
        seq++;
        atomic_store(&ctl->arrive[r], seq);
        wait_ge(&ctl->arrive[p], seq);
        memcpy(out + r * bytes, in, bytes);
        struct iovec l = {out + p * bytes, bytes}, rm = {ctl->in[p], bytes};
        if (process_vm_readv(ctl->pid[p], &l, 1, &rm, 1, 0) != (ssize_t)bytes)
          return perror("process_vm_readv"), 1;
        atomic_store(&ctl->done[r], seq);
        wait_ge(&ctl->done[p], seq);
      }
      double t = (now() - t0) / iters;
      if (t < best_cma) best_cma = t;
      seq++;
      atomic_store(&ctl->arrive[r], seq);
      wait_ge(&ctl->arrive[p], seq);
      t0 = now();
      for (int it = 0; it < iters; it++) {
        seq++;
        memcpy(out + r * bytes, in, bytes);
        memcpy(shm + r * bytes, in, bytes);
        atomic_store(&ctl->arrive[r], seq);
        wait_ge(&ctl->arrive[p], seq);
        memcpy(out + p * bytes, shm + p * bytes, bytes);
        atomic_store(&ctl->done[r], seq);
        wait_ge(&ctl->done[p], seq);
      }
      t = (now() - t0) / iters;
      if (t < best_two) best_two = t;
    }
    if (r == 0)
      printf("all-gather %6zu KiB: CMA %9.1f us, two copies %9.1f us (CMA / two copies %.2f)\n",
             total >> 10, best_cma * 1e6, best_two * 1e6, best_cma / best_two);
    free(in);
    free(out);
  }
  if (r == 1) return 0;
  waitpid(child, NULL, 0);
  return 0;
}
