// Internal to csrc/cuda/*kernels*.cu: the device formats, the reduction ops
// and the templated reduce kernel with its launcher. The semantics are those
// of reduce/reduce_generic.cc, bit for bit:
//  - left fold over the sources in the accumulation type (the element type,
//    float32 for float16/bfloat16), one rounding to nearest even at the end;
//  - a NaN result is stored as the canonical quiet NaN of its type;
//  - min(a, b) = (a < b || a is NaN) ? a : b, max likewise;
//  - integer sum and prod wrap (computed in the unsigned type).
// The build never passes --use_fast_math, -ftz=true or -prec-div=false: the
// float arithmetic here is IEEE (no contraction applies: no op mixes a
// multiply with an add).
//
// Work split of one launch: a 16-byte vector body [head, head + nvec * VEC)
// where every pointer is 16-byte aligned, and scalar head and tail elements
// (fewer than VEC each) done by the first threads of the grid. The body is
// walked grid-stride; each warp takes kUnroll * 32 consecutive vectors per
// step, vector u of lane l at u * 32 + l, so that every load and store
// instruction of a warp covers 512 contiguous bytes, and each thread has
// kUnroll independent loads per source in flight. The grid is as many blocks
// as fit on the device at once (occupancy x SMs), fewer for small counts.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "cuda/check.h"
#include "cuda/kernels.h"

namespace pyc::cuda::detail {

constexpr int kThreads = 512;
constexpr int kWarp = 32;
constexpr int kVectorBytes = 16;

// Kernel parameters of a reduction, passed by value: the source pointer array
// lives in the kernel's parameter space, not in device memory.
struct ReduceParams {
  const void* srcs[kMaxSrcs];
  void* dst0;
  void* dst1;    // null when not wanted (the host drops dst1 == dst0)
  int nsrc;      // 2..kMaxSrcs
  size_t count;  // elements
  size_t head;   // scalar elements before the vector body (0 without vectors)
  size_t nvec;   // vectors of VEC elements in the body
};

// The storage type of N bytes, for one load or store instruction.
template <int N>
struct Bytes;
template <>
struct Bytes<1> {
  using T = uint8_t;
};
template <>
struct Bytes<2> {
  using T = uint16_t;
};
template <>
struct Bytes<4> {
  using T = uint32_t;
};
template <>
struct Bytes<8> {
  using T = uint2;
};
template <>
struct Bytes<16> {
  using T = uint4;
};

// VEC elements moved as one access.
template <class Elem, int VEC>
union Pack {
  typename Bytes<static_cast<int>(sizeof(Elem)) * VEC>::T raw;
  Elem e[VEC];
};

// --- formats: how an element is stored (Elem) and accumulated (Acc) ----------

template <class T>
__device__ __forceinline__ T canonical_nan_or(T x) {
  if constexpr (std::is_same_v<T, float>) {
    return x != x ? __int_as_float(0x7fc00000) : x;
  } else if constexpr (std::is_same_v<T, double>) {
    return x != x ? __longlong_as_double(0x7ff8000000000000LL) : x;
  } else {
    return x;
  }
}

template <class T>
struct Native {
  using Elem = T;
  using Acc = T;
  static __device__ __forceinline__ Acc load(Elem x) { return x; }
  static __device__ __forceinline__ Elem store(Acc x) { return canonical_nan_or(x); }
};

// IEEE binary16 stored as its bits; the conversions are exact (to float) and
// round to nearest even (cvt.rn.f16.f32, no flush to zero).
struct Half {
  using Elem = uint16_t;
  using Acc = float;
  static __device__ __forceinline__ Acc load(Elem x) { return __half2float(__ushort_as_half(x)); }
  static __device__ __forceinline__ Elem store(Acc x) {
    return x != x ? static_cast<uint16_t>(0x7e00) : __half_as_ushort(__float2half_rn(x));
  }
};

// bfloat16 stored as its bits; the rounding is reduce_generic.cc's, verbatim.
struct BFloat16 {
  using Elem = uint16_t;
  using Acc = float;
  static __device__ __forceinline__ Acc load(Elem x) {
    return __uint_as_float(static_cast<uint32_t>(x) << 16);
  }
  static __device__ __forceinline__ Elem store(Acc x) {
    const uint32_t u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
};

// --- ops ----------------------------------------------------------------------

template <class A>
__device__ __forceinline__ bool is_nan(A x) {
  if constexpr (std::is_floating_point_v<A>) {
    return x != x;
  } else {
    return false;
  }
}

struct SumOp {
  template <class A>
  static __device__ __forceinline__ A apply(A a, A b) {
    if constexpr (std::is_integral_v<A>) {
      using U = std::make_unsigned_t<A>;
      return static_cast<A>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
    } else {
      return a + b;
    }
  }
};

struct ProdOp {
  template <class A>
  static __device__ __forceinline__ A apply(A a, A b) {
    if constexpr (std::is_integral_v<A>) {
      using U = std::make_unsigned_t<A>;
      return static_cast<A>(static_cast<U>(static_cast<U>(a) * static_cast<U>(b)));
    } else {
      return a * b;
    }
  }
};

struct MinOp {
  template <class A>
  static __device__ __forceinline__ A apply(A a, A b) {
    return (a < b || is_nan(a)) ? a : b;
  }
};

struct MaxOp {
  template <class A>
  static __device__ __forceinline__ A apply(A a, A b) {
    return (a > b || is_nan(a)) ? a : b;
  }
};

// --- the reduce kernel --------------------------------------------------------

// Vectors per source per thread per step: enough independent 16-byte loads in
// flight while the accumulators stay within 16 registers (so that two blocks
// of kThreads fit in 64 registers a thread without spilling).
template <class F, int VEC>
struct Unroll {
  static constexpr int kAccBytes = sizeof(typename F::Acc) < 4 ? 4 : sizeof(typename F::Acc);
  static constexpr int kAccRegs = VEC * kAccBytes / 4;
  static constexpr int value = kAccRegs >= 16 ? 1 : (16 / kAccRegs > 4 ? 4 : 16 / kAccRegs);
};

// One element i (head or tail).
template <class F, class Op>
__device__ __forceinline__ void reduce_element(const ReduceParams& p, int nsrc, size_t i) {
  using Elem = typename F::Elem;
  typename F::Acc acc = F::load(static_cast<const Elem*>(p.srcs[0])[i]);
#pragma unroll
  for (int k = 1; k < kMaxSrcs; ++k) {
    if (k >= nsrc) break;
    acc = Op::apply(acc, F::load(static_cast<const Elem*>(p.srcs[k])[i]));
  }
  const Elem out = F::store(acc);
  static_cast<Elem*>(p.dst0)[i] = out;
  if (p.dst1 != nullptr) static_cast<Elem*>(p.dst1)[i] = out;
}

// kUnroll vectors of every source from vector index v (lane's first), all
// loads of a source issued before any use. kGuarded: some vectors may lie
// past nvec.
template <class F, class Op, int kNsrc, int VEC, int kUnroll, bool kGuarded>
__device__ __forceinline__ void reduce_vectors(const ReduceParams& p, int nsrc, size_t v) {
  using Elem = typename F::Elem;
  using P = Pack<Elem, VEC>;
  using Raw = decltype(P::raw);
  typename F::Acc acc[kUnroll][VEC];
  P in[kUnroll];
  const Raw* src = reinterpret_cast<const Raw*>(static_cast<const Elem*>(p.srcs[0]) + p.head);
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    if (!kGuarded || v + u * kWarp < p.nvec) {
      in[u].raw = src[v + u * kWarp];
    } else {
      in[u].raw = Raw{};
    }
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[u][j] = F::load(in[u].e[j]);
  }
  // Unrolled to kMaxSrcs so that srcs[k] is read from the parameter space at
  // constant offsets (a run-time index would copy the parameters to local
  // memory).
#pragma unroll
  for (int k = 1; k < (kNsrc > 0 ? kNsrc : kMaxSrcs); ++k) {
    if (kNsrc == 0 && k >= nsrc) break;
    src = reinterpret_cast<const Raw*>(static_cast<const Elem*>(p.srcs[k]) + p.head);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (!kGuarded || v + u * kWarp < p.nvec) {
        in[u].raw = src[v + u * kWarp];
      } else {
        in[u].raw = Raw{};
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[u][j] = Op::apply(acc[u][j], F::load(in[u].e[j]));
    }
  }
  Raw* dst0 = reinterpret_cast<Raw*>(static_cast<Elem*>(p.dst0) + p.head);
  Raw* dst1 =
      p.dst1 != nullptr ? reinterpret_cast<Raw*>(static_cast<Elem*>(p.dst1) + p.head) : nullptr;
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    if (!kGuarded || v + u * kWarp < p.nvec) {
      P out;
#pragma unroll
      for (int j = 0; j < VEC; ++j) out.e[j] = F::store(acc[u][j]);
      dst0[v + u * kWarp] = out.raw;
      if (dst1 != nullptr) dst1[v + u * kWarp] = out.raw;
    }
  }
}

// kNsrc > 0 fixes the number of sources at compile time (the two-source ring
// step); 0 reads it from the parameters. VEC == 1 is the element-wise path
// (head == 0, nvec == count).
template <class F, class Op, int kNsrc, int VEC>
__global__ void __launch_bounds__(kThreads, 2) reduce_kernel(const ReduceParams p) {
  constexpr int kUnroll = Unroll<F, VEC>::value;
  const int nsrc = kNsrc > 0 ? kNsrc : p.nsrc;
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if constexpr (VEC > 1) {
    const size_t tail = p.head + p.nvec * VEC;
    if (tid < p.head) reduce_element<F, Op>(p, nsrc, tid);
    if (tid < p.count - tail) reduce_element<F, Op>(p, nsrc, tail + tid);
  }
  const size_t lane = threadIdx.x % kWarp;
  const size_t step = static_cast<size_t>(gridDim.x) * blockDim.x * kUnroll;
  for (size_t first = (tid - lane) * kUnroll; first < p.nvec; first += step) {
    if (first + static_cast<size_t>(kWarp) * kUnroll <= p.nvec) {
      reduce_vectors<F, Op, kNsrc, VEC, kUnroll, false>(p, nsrc, first + lane);
    } else {
      reduce_vectors<F, Op, kNsrc, VEC, kUnroll, true>(p, nsrc, first + lane);
    }
  }
}

// --- launching ----------------------------------------------------------------

// Blocks for `items` units of kThreads * unroll vectors: at most what is
// resident at once on the current device (occupancy of `kernel`, cached per
// kernel by the caller, times its multiprocessors), at least 1.
inline unsigned grid_blocks(int blocks_per_sm, size_t nvec, int unroll) {
  int device = 0;
  int sms = 0;
  PYC_CUDA_CHECK(cudaGetDevice(&device));
  PYC_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const size_t per_block = static_cast<size_t>(kThreads) * static_cast<size_t>(unroll);
  const size_t wanted = (nvec + per_block - 1) / per_block;
  const size_t resident =
      static_cast<size_t>(std::max(1, blocks_per_sm)) * static_cast<size_t>(std::max(1, sms));
  return static_cast<unsigned>(std::clamp<size_t>(wanted, 1, resident));
}

template <class Kernel>
int blocks_per_sm(Kernel kernel) {
  int n = 0;
  PYC_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, 0));
  return n;
}

template <class F, class Op, int kNsrc, int VEC>
void launch_reduce_kernel(const ReduceParams& p, cudaStream_t stream) {
  const auto kernel = reduce_kernel<F, Op, kNsrc, VEC>;
  static const int occupancy = blocks_per_sm(kernel);
  const unsigned blocks = grid_blocks(occupancy, p.nvec, Unroll<F, VEC>::value);
  kernel<<<blocks, kThreads, 0, stream>>>(p);
  PYC_CUDA_CHECK(cudaGetLastError());
}

template <class F, class Op>
void launch_reduce_op(const ReduceParams& p, bool vectorized, cudaStream_t stream) {
  constexpr int kVec = kVectorBytes / static_cast<int>(sizeof(typename F::Elem));
  if (!vectorized) return launch_reduce_kernel<F, Op, 0, 1>(p, stream);
  if (p.nsrc == 2) return launch_reduce_kernel<F, Op, 2, kVec>(p, stream);
  launch_reduce_kernel<F, Op, 0, kVec>(p, stream);
}

// Every op of one format; op is sum, prod, min or max (checked by the caller).
template <class F>
void launch_reduce(const ReduceParams& p, ReduceOp op, bool vectorized, cudaStream_t stream) {
  switch (op) {
    case ReduceOp::kSum:
      return launch_reduce_op<F, SumOp>(p, vectorized, stream);
    case ReduceOp::kProd:
      return launch_reduce_op<F, ProdOp>(p, vectorized, stream);
    case ReduceOp::kMin:
      return launch_reduce_op<F, MinOp>(p, vectorized, stream);
    case ReduceOp::kMax:
      return launch_reduce_op<F, MaxOp>(p, vectorized, stream);
    case ReduceOp::kAvg:
      break;
  }
  PYC_THROW(Error, "pycollectives internal error: reduce kernel op "
                       << static_cast<int>(op) << " is not sum, prod, min or max");
}

// One per dtype, each defined (instantiated) in one of the reduce_kernels_*.cu
// files so that nvcc compiles them in parallel.
void reduce_float32(const ReduceParams& p, ReduceOp op, bool vectorized, cudaStream_t stream);
void reduce_float64(const ReduceParams& p, ReduceOp op, bool vectorized, cudaStream_t stream);
void reduce_float16(const ReduceParams& p, ReduceOp op, bool vectorized, cudaStream_t stream);
void reduce_bfloat16(const ReduceParams& p, ReduceOp op, bool vectorized, cudaStream_t stream);
void reduce_int8(const ReduceParams& p, ReduceOp op, bool vectorized, cudaStream_t stream);
void reduce_uint8(const ReduceParams& p, ReduceOp op, bool vectorized, cudaStream_t stream);
void reduce_int32(const ReduceParams& p, ReduceOp op, bool vectorized, cudaStream_t stream);
void reduce_int64(const ReduceParams& p, ReduceOp op, bool vectorized, cudaStream_t stream);

}  // namespace pyc::cuda::detail
