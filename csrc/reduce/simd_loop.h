// Internal: the loops shared by the AVX2 and AVX-512 kernel files, written
// against a "format" F that each of those files defines per dtype:
//
//   using Elem = ...;                 element type in memory
//   using Acc = ...;                  register of W elements in the accumulation type
//   static constexpr size_t W = ...;
//   static Acc load(const Elem* p);   W elements, widened to Acc
//   static void store(Elem* p, Acc);  W elements, rounded to nearest even
//   static Acc add(Acc, Acc), mul(Acc, Acc), min(Acc, Acc), max(Acc, Acc);
//   static Acc div(Acc, int divisor);  floating formats only (scale_avg)
//
// with the semantics documented in reduce_generic.cc.
//
// Keeping ISAs apart: include this file after the `#pragma GCC target` and
// after every other header, so that no inline function shared with other
// files is compiled for the target. Every template here is instantiated only
// with formats from the including file's anonymous namespace, so its copies
// for different ISAs never share a symbol (the linker could otherwise pick an
// AVX-512 copy for the AVX2 path). For the same reason nothing here throws:
// that would emit shared inline code (exception classes, string streams)
// compiled for the target.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "reduce/kernels.h"

namespace pyc {
namespace kernels {
namespace simd {

struct Sum {
  template <class F>
  static typename F::Acc apply(typename F::Acc a, typename F::Acc b) {
    return F::add(a, b);
  }
};
struct Prod {
  template <class F>
  static typename F::Acc apply(typename F::Acc a, typename F::Acc b) {
    return F::mul(a, b);
  }
};
struct Min {
  template <class F>
  static typename F::Acc apply(typename F::Acc a, typename F::Acc b) {
    return F::min(a, b);
  }
};
struct Max {
  template <class F>
  static typename F::Acc apply(typename F::Acc a, typename F::Acc b) {
    return F::max(a, b);
  }
};

// The arithmetic of Math on a pair of registers, for formats that widen one
// load into two (bfloat16: even and odd elements).
template <class Math>
struct PairMath {
  struct Acc {
    typename Math::Acc even, odd;
  };
  static Acc add(Acc a, Acc b) { return {Math::add(a.even, b.even), Math::add(a.odd, b.odd)}; }
  static Acc mul(Acc a, Acc b) { return {Math::mul(a.even, b.even), Math::mul(a.odd, b.odd)}; }
  static Acc min(Acc a, Acc b) { return {Math::min(a.even, b.even), Math::min(a.odd, b.odd)}; }
  static Acc max(Acc a, Acc b) { return {Math::max(a.even, b.even), Math::max(a.odd, b.odd)}; }
  static Acc div(Acc a, int divisor) {
    return {Math::div(a.even, divisor), Math::div(a.odd, divisor)};
  }
};

// Registers per source per step: enough independent loads in flight to keep
// the memory system busy.
constexpr size_t kUnroll = 4;

// Reduces `rest` (< W) trailing elements from `begin` through a zero-padded
// buffer, so that they go through exactly the same vector code.
template <class F, class Op>
void reduce_tail(const ReduceArgs& a, size_t begin, size_t rest) {
  using Elem = typename F::Elem;
  const size_t bytes = rest * sizeof(Elem);
  Elem buf[F::W] = {};
  std::memcpy(buf, static_cast<const Elem*>(a.srcs[0]) + begin, bytes);
  typename F::Acc acc = F::load(buf);
  for (int k = 1; k < a.nsrc; ++k) {
    std::memcpy(buf, static_cast<const Elem*>(a.srcs[k]) + begin, bytes);
    acc = Op::template apply<F>(acc, F::load(buf));
  }
  F::store(buf, acc);
  std::memcpy(static_cast<Elem*>(a.dst0) + begin, buf, bytes);
  if (a.dst1 != nullptr) std::memcpy(static_cast<Elem*>(a.dst1) + begin, buf, bytes);
}

// kNsrc > 0 fixes the number of sources at compile time (the hot two-source
// case); 0 reads it from the arguments.
template <class F, class Op, int kNsrc>
void reduce_loop(const ReduceArgs& a) {
  using Elem = typename F::Elem;
  using Acc = typename F::Acc;
  constexpr size_t W = F::W;
  const int nsrc = kNsrc > 0 ? kNsrc : a.nsrc;
  const size_t n = a.count;
  Elem* dst0 = static_cast<Elem*>(a.dst0);
  Elem* dst1 = static_cast<Elem*>(a.dst1);
  size_t i = 0;
  for (; i + kUnroll * W <= n; i += kUnroll * W) {
    Acc acc[kUnroll];
    const Elem* first = static_cast<const Elem*>(a.srcs[0]) + i;
#pragma GCC unroll 4
    for (size_t u = 0; u < kUnroll; ++u) acc[u] = F::load(first + u * W);
    for (int k = 1; k < nsrc; ++k) {
      const Elem* src = static_cast<const Elem*>(a.srcs[k]) + i;
#pragma GCC unroll 4
      for (size_t u = 0; u < kUnroll; ++u)
        acc[u] = Op::template apply<F>(acc[u], F::load(src + u * W));
    }
#pragma GCC unroll 4
    for (size_t u = 0; u < kUnroll; ++u) F::store(dst0 + i + u * W, acc[u]);
    if (dst1 != nullptr) {
#pragma GCC unroll 4
      for (size_t u = 0; u < kUnroll; ++u) F::store(dst1 + i + u * W, acc[u]);
    }
  }
  for (; i + W <= n; i += W) {
    Acc acc = F::load(static_cast<const Elem*>(a.srcs[0]) + i);
    for (int k = 1; k < nsrc; ++k) {
      acc = Op::template apply<F>(acc, F::load(static_cast<const Elem*>(a.srcs[k]) + i));
    }
    F::store(dst0 + i, acc);
    if (dst1 != nullptr) F::store(dst1 + i, acc);
  }
  if (i < n) reduce_tail<F, Op>(a, i, n - i);
}

template <class F>
void reduce_format(const ReduceArgs& a) {
  switch (a.op) {
    case ReduceOp::kSum:
      return a.nsrc == 2 ? reduce_loop<F, Sum, 2>(a) : reduce_loop<F, Sum, 0>(a);
    case ReduceOp::kProd:
      return reduce_loop<F, Prod, 0>(a);
    case ReduceOp::kMin:
      return reduce_loop<F, Min, 0>(a);
    case ReduceOp::kMax:
      return reduce_loop<F, Max, 0>(a);
    case ReduceOp::kAvg:  // rejected by reduce() before it gets here
      return;
  }
}

// dst0 = src through non-temporal stores (and dst1 = src through ordinary
// ones, when not null), reading src once; a store fence at the end orders the
// streamed bytes before any later store, such as the flag that publishes them.
// V is a register of V::B bytes: load (unaligned), store (unaligned), stream
// (aligned: the bytes before dst0's first B-aligned address, and after its
// last, go through memcpy).
template <class V>
void copy_streaming_loop(void* dst0, void* dst1, const void* src, size_t bytes) {
  constexpr size_t B = V::B;
  char* d0 = static_cast<char*>(dst0);
  char* d1 = static_cast<char*>(dst1);
  const char* s = static_cast<const char*>(src);
  size_t i = (B - reinterpret_cast<uintptr_t>(d0) % B) % B;
  if (i > bytes) i = bytes;
  std::memcpy(d0, s, i);
  if (d1 != nullptr) std::memcpy(d1, s, i);
  for (; i + kUnroll * B <= bytes; i += kUnroll * B) {
    typename V::Reg r[kUnroll];
#pragma GCC unroll 4
    for (size_t u = 0; u < kUnroll; ++u) r[u] = V::load(s + i + u * B);
#pragma GCC unroll 4
    for (size_t u = 0; u < kUnroll; ++u) V::stream(d0 + i + u * B, r[u]);
    if (d1 != nullptr) {
#pragma GCC unroll 4
      for (size_t u = 0; u < kUnroll; ++u) V::store(d1 + i + u * B, r[u]);
    }
  }
  for (; i + B <= bytes; i += B) {
    const typename V::Reg r = V::load(s + i);
    V::stream(d0 + i, r);
    if (d1 != nullptr) V::store(d1 + i, r);
  }
  std::memcpy(d0 + i, s + i, bytes - i);
  if (d1 != nullptr) std::memcpy(d1 + i, s + i, bytes - i);
  V::fence();
}

// x[i] = x[i] / divisor for a floating format.
template <class F>
void scale_format(void* x, size_t count, int divisor) {
  using Elem = typename F::Elem;
  constexpr size_t W = F::W;
  Elem* p = static_cast<Elem*>(x);
  size_t i = 0;
  for (; i + W <= count; i += W) F::store(p + i, F::div(F::load(p + i), divisor));
  if (i < count) {
    const size_t bytes = (count - i) * sizeof(Elem);
    Elem buf[W] = {};
    std::memcpy(buf, p + i, bytes);
    F::store(buf, F::div(F::load(buf), divisor));
    std::memcpy(p + i, buf, bytes);
  }
}

}  // namespace simd
}  // namespace kernels
}  // namespace pyc
