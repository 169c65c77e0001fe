// CPU reduction and copy kernels. The algorithm layer calls these through a
// table chosen once at run time from the CPU's features (AVX-512, AVX2, or a
// portable fallback); no kernel is compiled with -march=native.
#pragma once

#include <cstddef>

#include "core/types.h"

namespace pyc {

// dst0[i] = srcs[0][i] op srcs[1][i] op ... op srcs[nsrc-1][i], folded left to
// right in that order, for i < count. When dst1 is not null the same result is
// also written to dst1 (one read of the inputs, two writes: NCCL's
// "reduce-copy"). nsrc >= 1 (nsrc == 1 is a copy). dst0/dst1 may alias any
// source exactly (same pointer), never partially. float16 and bfloat16 are
// accumulated in float32 across all sources and rounded once (round to nearest
// even). Integer arithmetic wraps (two's complement). op must not be kAvg: the
// caller sums, then calls scale_avg.
struct ReduceArgs {
  DataType dtype;
  ReduceOp op;
  void* dst0;
  void* dst1;
  const void* const* srcs;
  int nsrc;
  size_t count;
};
void reduce(const ReduceArgs& args);

// x[i] = x[i] / divisor, for ReduceOp::kAvg. Floating types divide in their
// own precision (float16/bfloat16 through float32); integer types truncate
// toward zero as C does.
void scale_avg(void* x, DataType dtype, size_t count, int divisor);

// How copy() writes dst0. kStreaming bypasses the caches (non-temporal
// stores, then a store fence): for a destination that is not read again soon,
// such as the caller's buffer in a collective larger than the caches, where
// it saves the read that an ordinary store makes of every line it writes.
enum class Store { kCached, kStreaming };

// dst0 (and dst1 when not null) = src, `bytes` bytes; non-overlapping. dst1
// is always written through the caches (a slot that a peer reads next).
void copy(void* dst0, void* dst1, const void* src, size_t bytes, Store dst0_store = Store::kCached);

// Which implementation the dispatcher chose: "avx512", "avx2" or "generic".
// PYCOLL_SIMD=generic|avx2|avx512 in the environment caps the choice (tests
// use it to exercise every path on one machine).
const char* simd_level();

}  // namespace pyc
