// The host entry points of cuda/kernels.h: argument checks, the choice between
// the 16-byte vector and the element-wise paths, the copy and scale_avg
// kernels. The reduce kernels themselves are in reduce_kernels_*.cu.
#include <algorithm>
#include <cstdint>
#include <sstream>
#include <string>

#include "core/types.h"
#include "cuda/kernels_device.cuh"

namespace pyc::cuda {
namespace detail {
namespace {

uintptr_t addr(const void* p) { return reinterpret_cast<uintptr_t>(p); }

// [a, a + bytes) and [b, b + bytes) share a byte without being the same range.
bool partial_overlap(const void* a, const void* b, size_t bytes) {
  if (a == nullptr || b == nullptr || a == b) return false;
  const uintptr_t x = addr(a);
  const uintptr_t y = addr(b);
  return x < y ? y - x < bytes : x - y < bytes;
}

// --- copy -----------------------------------------------------------------

struct CopyParams {
  const unsigned char* src;
  unsigned char* dst0;
  unsigned char* dst1;  // null when not wanted
  size_t bytes;
  size_t head;  // bytes before the body of W-byte accesses
  size_t nvec;  // W-byte accesses in the body
};

constexpr int kCopyUnroll = 4;

template <int W, bool kGuarded>
__device__ __forceinline__ void copy_vectors(const CopyParams& p, size_t v) {
  using T = typename Bytes<W>::T;
  const T* src = reinterpret_cast<const T*>(p.src + p.head);
  T x[kCopyUnroll];
#pragma unroll
  for (int u = 0; u < kCopyUnroll; ++u) {
    if (!kGuarded || v + u * kWarp < p.nvec) x[u] = src[v + u * kWarp];
  }
  T* dst0 = reinterpret_cast<T*>(p.dst0 + p.head);
#pragma unroll
  for (int u = 0; u < kCopyUnroll; ++u) {
    if (!kGuarded || v + u * kWarp < p.nvec) dst0[v + u * kWarp] = x[u];
  }
  if (p.dst1 != nullptr) {
    T* dst1 = reinterpret_cast<T*>(p.dst1 + p.head);
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      if (!kGuarded || v + u * kWarp < p.nvec) dst1[v + u * kWarp] = x[u];
    }
  }
}

// W: bytes per access in the body, the widest that the pointers' common
// alignment allows (1 means the body is everything).
template <int W>
__global__ void __launch_bounds__(kThreads, 2) copy_kernel(const CopyParams p) {
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if constexpr (W > 1) {
    const size_t tail = p.head + p.nvec * W;
    if (tid < p.head) {
      p.dst0[tid] = p.src[tid];
      if (p.dst1 != nullptr) p.dst1[tid] = p.src[tid];
    }
    if (tid < p.bytes - tail) {
      p.dst0[tail + tid] = p.src[tail + tid];
      if (p.dst1 != nullptr) p.dst1[tail + tid] = p.src[tail + tid];
    }
  }
  const size_t lane = threadIdx.x % kWarp;
  const size_t step = static_cast<size_t>(gridDim.x) * blockDim.x * kCopyUnroll;
  for (size_t first = (tid - lane) * kCopyUnroll; first < p.nvec; first += step) {
    if (first + static_cast<size_t>(kWarp) * kCopyUnroll <= p.nvec) {
      copy_vectors<W, false>(p, first + lane);
    } else {
      copy_vectors<W, true>(p, first + lane);
    }
  }
}

template <int W>
void launch_copy(CopyParams p, cudaStream_t stream) {
  const size_t misalign = addr(p.src) % W;
  p.head = std::min(p.bytes, misalign == 0 ? 0 : W - misalign);
  p.nvec = (p.bytes - p.head) / W;
  const auto kernel = copy_kernel<W>;
  static const int occupancy = blocks_per_sm(kernel);
  kernel<<<grid_blocks(occupancy, p.nvec, kCopyUnroll), kThreads, 0, stream>>>(p);
  PYC_CUDA_CHECK(cudaGetLastError());
}

// --- scale_avg --------------------------------------------------------------

struct ScaleParams {
  void* x;
  size_t count;
  size_t head;
  size_t nvec;
  int divisor;
};

// x / divisor as reduce_generic.cc's scale(): floating formats divide in
// their accumulation type (IEEE division), integers truncate toward zero.
template <class F>
__device__ __forceinline__ typename F::Elem scale_one(typename F::Elem x, int divisor) {
  using Acc = typename F::Acc;
  if constexpr (std::is_floating_point_v<Acc>) {
    return F::store(F::load(x) / static_cast<Acc>(divisor));
  } else {
    return static_cast<Acc>(x / divisor);
  }
}

template <class F, int VEC>
__global__ void __launch_bounds__(kThreads, 2) scale_kernel(const ScaleParams p) {
  using Elem = typename F::Elem;
  using P = Pack<Elem, VEC>;
  using Raw = decltype(P::raw);
  Elem* x = static_cast<Elem*>(p.x);
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t tail = p.head + p.nvec * VEC;
  if (tid < p.head) x[tid] = scale_one<F>(x[tid], p.divisor);
  if (tid < p.count - tail) x[tail + tid] = scale_one<F>(x[tail + tid], p.divisor);
  Raw* body = reinterpret_cast<Raw*>(x + p.head);
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t v = tid; v < p.nvec; v += stride) {
    P pack;
    pack.raw = body[v];
#pragma unroll
    for (int j = 0; j < VEC; ++j) pack.e[j] = scale_one<F>(pack.e[j], p.divisor);
    body[v] = pack.raw;
  }
}

template <class F>
void launch_scale(ScaleParams p, cudaStream_t stream) {
  using Elem = typename F::Elem;
  constexpr int kVec = kVectorBytes / static_cast<int>(sizeof(Elem));
  const size_t misalign = addr(p.x) % kVectorBytes;  // a multiple of sizeof(Elem)
  p.head = std::min(p.count, misalign == 0 ? 0 : (kVectorBytes - misalign) / sizeof(Elem));
  p.nvec = (p.count - p.head) / kVec;
  const auto kernel = scale_kernel<F, kVec>;
  static const int occupancy = blocks_per_sm(kernel);
  kernel<<<grid_blocks(occupancy, p.nvec, 1), kThreads, 0, stream>>>(p);
  PYC_CUDA_CHECK(cudaGetLastError());
}

// `what`, with `index` >= 0 appended as "[index]": the name is formatted only
// when the check fails (this runs on every kernel launch).
void check_element_aligned(const void* p, size_t elem, const char* what, const char* op,
                           int index = -1) {
  if (addr(p) % elem != 0) {
    std::ostringstream name;
    name << what;
    if (index >= 0) name << "[" << index << "]";
    PYC_THROW(InvalidArgument, "pycollectives: " << op << ": " << name.str() << " (" << p
                                                 << ") is not aligned to the element size (" << elem
                                                 << " bytes)");
  }
}

}  // namespace
}  // namespace detail

void reduce(const ReduceArgs& args, cudaStream_t stream) {
  using namespace detail;
  constexpr const char* kOp = "cuda reduce";
  if (!valid_dtype(static_cast<int32_t>(args.dtype)))
    PYC_THROW(InvalidArgument,
              "pycollectives: " << kOp << ": invalid dtype code " << static_cast<int>(args.dtype));
  if (!valid_reduce_op(static_cast<int32_t>(args.op)) || args.op == ReduceOp::kAvg)
    PYC_THROW(InvalidArgument, "pycollectives: " << kOp << ": op code " << static_cast<int>(args.op)
                                                 << " is not sum, prod, min or max (avg is sum "
                                                    "followed by scale_avg)");
  if (args.nsrc < 1 || args.nsrc > kMaxSrcs)
    PYC_THROW(InvalidArgument, "pycollectives: " << kOp << ": nsrc is " << args.nsrc
                                                 << ", must be in 1.." << kMaxSrcs);
  if (args.srcs == nullptr)
    PYC_THROW(InvalidArgument, "pycollectives: " << kOp << ": srcs is null");
  require_device(kOp);
  if (args.count == 0) return;
  const size_t elem = dtype_size(args.dtype);
  if (args.count > SIZE_MAX / elem)
    PYC_THROW(InvalidArgument,
              "pycollectives: " << kOp << ": count " << args.count << " overflows the byte size");
  const size_t bytes = args.count * elem;
  if (args.dst0 == nullptr)
    PYC_THROW(InvalidArgument, "pycollectives: " << kOp << ": dst0 is null");
  check_element_aligned(args.dst0, elem, "dst0", kOp);
  if (args.dst1 != nullptr) check_element_aligned(args.dst1, elem, "dst1", kOp);
  if (partial_overlap(args.dst0, args.dst1, bytes))
    PYC_THROW(InvalidArgument, "pycollectives: " << kOp << ": dst0 and dst1 partially overlap");
  for (int k = 0; k < args.nsrc; ++k) {
    if (args.srcs[k] == nullptr)
      PYC_THROW(InvalidArgument, "pycollectives: " << kOp << ": srcs[" << k << "] is null");
    check_element_aligned(args.srcs[k], elem, "srcs", kOp, k);
    if (partial_overlap(args.dst0, args.srcs[k], bytes) ||
        partial_overlap(args.dst1, args.srcs[k], bytes)) {
      PYC_THROW(InvalidArgument, "pycollectives: " << kOp << ": srcs[" << k
                                                   << "] partially overlaps a destination (only "
                                                      "exact aliasing is allowed)");
    }
  }
  void* dst1 = args.dst1 == args.dst0 ? nullptr : args.dst1;
  if (args.nsrc == 1) return copy(args.dst0, dst1, args.srcs[0], bytes, stream);

  ReduceParams p{};
  for (int k = 0; k < args.nsrc; ++k) p.srcs[k] = args.srcs[k];
  p.dst0 = args.dst0;
  p.dst1 = dst1;
  p.nsrc = args.nsrc;
  p.count = args.count;
  // The vector body needs every pointer at the same offset from a 16-byte
  // boundary; the head brings them all to one.
  const size_t misalign = addr(args.dst0) % kVectorBytes;
  bool vectorized = dst1 == nullptr || addr(dst1) % kVectorBytes == misalign;
  for (int k = 0; k < args.nsrc; ++k) vectorized &= addr(args.srcs[k]) % kVectorBytes == misalign;
  if (vectorized) {
    const size_t vec = kVectorBytes / elem;
    p.head = std::min(args.count, misalign == 0 ? 0 : (kVectorBytes - misalign) / elem);
    p.nvec = (args.count - p.head) / vec;
  } else {
    p.head = 0;
    p.nvec = args.count;
  }
  switch (args.dtype) {
    case DataType::kFloat32:
      return reduce_float32(p, args.op, vectorized, stream);
    case DataType::kFloat64:
      return reduce_float64(p, args.op, vectorized, stream);
    case DataType::kFloat16:
      return reduce_float16(p, args.op, vectorized, stream);
    case DataType::kBFloat16:
      return reduce_bfloat16(p, args.op, vectorized, stream);
    case DataType::kInt8:
      return reduce_int8(p, args.op, vectorized, stream);
    case DataType::kUInt8:
      return reduce_uint8(p, args.op, vectorized, stream);
    case DataType::kInt32:
      return reduce_int32(p, args.op, vectorized, stream);
    case DataType::kInt64:
      return reduce_int64(p, args.op, vectorized, stream);
  }
}

void scale_avg(void* x, DataType dtype, size_t count, int divisor, cudaStream_t stream) {
  using namespace detail;
  constexpr const char* kOp = "cuda scale_avg";
  if (!valid_dtype(static_cast<int32_t>(dtype)))
    PYC_THROW(InvalidArgument,
              "pycollectives: " << kOp << ": invalid dtype code " << static_cast<int>(dtype));
  if (divisor < 1)
    PYC_THROW(InvalidArgument,
              "pycollectives: " << kOp << ": divisor is " << divisor << ", must be >= 1");
  require_device(kOp);
  if (count == 0) return;
  if (x == nullptr) PYC_THROW(InvalidArgument, "pycollectives: " << kOp << ": x is null");
  const size_t elem = dtype_size(dtype);
  if (count > SIZE_MAX / elem)
    PYC_THROW(InvalidArgument,
              "pycollectives: " << kOp << ": count " << count << " overflows the byte size");
  check_element_aligned(x, elem, "x", kOp);
  const ScaleParams p{x, count, 0, 0, divisor};
  switch (dtype) {
    case DataType::kFloat32:
      return launch_scale<Native<float>>(p, stream);
    case DataType::kFloat64:
      return launch_scale<Native<double>>(p, stream);
    case DataType::kFloat16:
      return launch_scale<Half>(p, stream);
    case DataType::kBFloat16:
      return launch_scale<BFloat16>(p, stream);
    case DataType::kInt8:
      return launch_scale<Native<int8_t>>(p, stream);
    case DataType::kUInt8:
      return launch_scale<Native<uint8_t>>(p, stream);
    case DataType::kInt32:
      return launch_scale<Native<int32_t>>(p, stream);
    case DataType::kInt64:
      return launch_scale<Native<int64_t>>(p, stream);
  }
}

void copy(void* dst0, void* dst1, const void* src, size_t bytes, cudaStream_t stream) {
  using namespace detail;
  constexpr const char* kOp = "cuda copy";
  require_device(kOp);
  if (bytes == 0) return;
  if (dst0 == nullptr) PYC_THROW(InvalidArgument, "pycollectives: " << kOp << ": dst0 is null");
  if (src == nullptr) PYC_THROW(InvalidArgument, "pycollectives: " << kOp << ": src is null");
  if (partial_overlap(dst0, src, bytes) || partial_overlap(dst1, src, bytes))
    PYC_THROW(InvalidArgument,
              "pycollectives: " << kOp << ": a destination partially overlaps src");
  if (partial_overlap(dst0, dst1, bytes))
    PYC_THROW(InvalidArgument, "pycollectives: " << kOp << ": dst0 and dst1 partially overlap");
  // A destination equal to src is already right; keep the others.
  if (dst1 == dst0 || dst1 == src) dst1 = nullptr;
  if (dst0 == src) {
    dst0 = dst1;
    dst1 = nullptr;
  }
  if (dst0 == nullptr) return;
  CopyParams p{static_cast<const unsigned char*>(src),
               static_cast<unsigned char*>(dst0),
               static_cast<unsigned char*>(dst1),
               bytes,
               0,
               0};
  // The widest access that every pointer can use after the same head.
  const uintptr_t diff = (addr(dst0) - addr(src)) | (dst1 != nullptr ? addr(dst1) - addr(src) : 0);
  if (diff % 16 == 0) return launch_copy<16>(p, stream);
  if (diff % 8 == 0) return launch_copy<8>(p, stream);
  if (diff % 4 == 0) return launch_copy<4>(p, stream);
  if (diff % 2 == 0) return launch_copy<2>(p, stream);
  launch_copy<1>(p, stream);
}

}  // namespace pyc::cuda
