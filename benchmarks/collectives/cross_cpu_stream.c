/* How fast data written on one CPU is read on another: a thread on CPU A
 * fills 256 KiB chunks of 4 slots (with ordinary stores, then with
 * non-temporal ones), a thread on CPU B sums each chunk once it is posted and
 * frees its slot, as the ring's slots are passed; then the round trip of a
 * cache line between the two. Prints one line per round.
 *
 *   gcc -O2 -mavx512f -pthread benchmarks/collectives/cross_cpu_stream.c -o /tmp/xc && /tmp/xc [ROUNDS [A B]]
 *
 * On this project's VM the two levels of the round trip (~80 and ~400 ns, as
 * the host moves its vCPUs) come with 52-72 against 23-34 GB/s with ordinary
 * stores (docs/benchmarks.md, "Reading the CPU figures"). Needs AVX-512.
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CHUNK (256 * 1024)
#define NSLOTS 4
#define CHUNKS 4000
#define TRIPS 200000

static float* slots;
static float src[CHUNK / 4] __attribute__((aligned(64)));
static _Atomic long posted, consumed;
static _Atomic int ball;
static int streaming, cpu_a, cpu_b;
static volatile float sink;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  int err = pthread_setaffinity_np(pthread_self(), sizeof set, &set);
  if (err) fprintf(stderr, "pthread_setaffinity_np(CPU %d): %s\n", cpu, strerror(err)), exit(1);
}

static void* producer(void* arg) {
  (void)arg;
  pin(cpu_a);
  for (long i = 0; i < CHUNKS; i++) {
    while (i - atomic_load_explicit(&consumed, memory_order_acquire) >= NSLOTS) _mm_pause();
    float* d = slots + (i % NSLOTS) * (CHUNK / 4);
    if (streaming) {
      for (int k = 0; k < CHUNK / 4; k += 16) _mm512_stream_ps(d + k, _mm512_load_ps(src + k));
      _mm_sfence();
    } else {
      memcpy(d, src, CHUNK);
    }
    atomic_store_explicit(&posted, i + 1, memory_order_release);
  }
  return NULL;
}

static void* consumer(void* arg) {
  (void)arg;
  pin(cpu_b);
  __m512 acc = _mm512_setzero_ps();
  for (long i = 0; i < CHUNKS; i++) {
    while (atomic_load_explicit(&posted, memory_order_acquire) <= i) _mm_pause();
    const float* d = slots + (i % NSLOTS) * (CHUNK / 4);
    for (int k = 0; k < CHUNK / 4; k += 16) acc = _mm512_add_ps(acc, _mm512_load_ps(d + k));
    atomic_store_explicit(&consumed, i + 1, memory_order_release);
  }
  sink = _mm512_reduce_add_ps(acc);
  return NULL;
}

static void* pong(void* arg) {
  (void)arg;
  pin(cpu_b);
  for (int i = 0; i < TRIPS; i++) {
    while (atomic_load(&ball) != 2 * i + 1) _mm_pause();
    atomic_store(&ball, 2 * i + 2);
  }
  return NULL;
}

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? atoi(argv[1]) : 5;
  cpu_a = argc > 3 ? atoi(argv[2]) : 0;
  cpu_b = argc > 3 ? atoi(argv[3]) : 1;
  slots = aligned_alloc(4096, (size_t)CHUNK * NSLOTS);
  if (!slots) return fprintf(stderr, "aligned_alloc failed\n"), 1;
  memset(slots, 0, (size_t)CHUNK * NSLOTS);
  for (int r = 0; r < rounds; r++) {
    pthread_t a, b;
    double gbs[2];
    for (streaming = 0; streaming < 2; streaming++) {
      posted = consumed = 0;
      const double start = now();
      if (pthread_create(&a, NULL, producer, NULL) || pthread_create(&b, NULL, consumer, NULL))
        return fprintf(stderr, "pthread_create failed\n"), 1;
      pthread_join(a, NULL);
      pthread_join(b, NULL);
      gbs[streaming] = (double)CHUNKS * CHUNK / (now() - start) / 1e9;
    }
    ball = 0;
    if (pthread_create(&b, NULL, pong, NULL)) return fprintf(stderr, "pthread_create failed\n"), 1;
    pin(cpu_a);
    const double start = now();
    for (int i = 0; i < TRIPS; i++) {
      atomic_store(&ball, 2 * i + 1);
      while (atomic_load(&ball) != 2 * i + 2) _mm_pause();
    }
    const double trip_ns = (now() - start) / TRIPS * 1e9;
    pthread_join(b, NULL);
    printf("CPU %d -> %d: ordinary stores %.1f GB/s, non-temporal %.1f GB/s; round trip %.0f ns\n",
           cpu_a, cpu_b, gbs[0], gbs[1], trip_ns);
    fflush(stdout);
  }
  return 0;
}
