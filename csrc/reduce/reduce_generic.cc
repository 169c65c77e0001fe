// Portable reduction kernels: plain C++ without intrinsics, for CPUs without
// AVX2 and for other architectures. They define the semantics that the SIMD
// paths reproduce bit for bit:
//  - sum and prod fold the sources left to right in the accumulation type:
//    the element type itself, or float32 for float16/bfloat16, which are
//    rounded once at the end (round to nearest even).
//  - a NaN result is stored as the canonical quiet NaN of its type (positive,
//    zero payload): which NaN x86 returns when two meet depends on operand
//    order, which compilers may swap, and every path must give the same bits.
//  - min(a, b) = (a < b || a is NaN) ? a : b and max(a, b) = (a > b || a is
//    NaN) ? a : b, so a NaN in any source gives a NaN (like torch.minimum);
//    between +0 and -0 the later source wins.
//  - integer sum and prod wrap (computed in the unsigned type).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "reduce/kernels.h"

namespace pyc {
namespace kernels {
namespace {

uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// The half conversions use masks rather than branches or ?: so that the
// compiler can vectorize them.
uint32_t mask_if(bool condition) { return 0u - static_cast<uint32_t>(condition); }
uint32_t select(uint32_t mask, uint32_t if_set, uint32_t if_clear) {
  return (if_set & mask) | (if_clear & ~mask);
}

// IEEE binary16 -> binary32, exact; like F16C's vcvtph2ps, a signaling NaN
// comes out quiet.
float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t shifted = static_cast<uint32_t>(h & 0x7fff) << 13;  // exponent, mantissa in place
  const uint32_t exponent = shifted & 0x0f800000;
  const uint32_t normal = shifted + ((127 - 15) << 23);
  const uint32_t quiet = mask_if((shifted & 0x7fffff) != 0) & 0x400000;
  const uint32_t inf_or_nan = (normal + ((128 - 16) << 23)) | quiet;
  // Zero or subnormal: (1 + m/1024) * 2^-14 - 2^-14 = m * 2^-24, exact.
  const uint32_t subnormal = float_bits(bits_float(normal + (1 << 23)) - 0x1p-14f);
  uint32_t magnitude = select(mask_if(exponent == 0), subnormal, normal);
  magnitude = select(mask_if(exponent == 0x0f800000), inf_or_nan, magnitude);
  return bits_float(sign | magnitude);
}

// binary32 -> binary16, round to nearest even, overflow to inf; a NaN becomes
// the canonical NaN.
uint16_t float_to_half(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000;
  const uint32_t magnitude = u & 0x7fffffff;
  // Normal half: rebias the exponent, then round the 13 dropped bits to even
  // (a carry out of the mantissa correctly bumps the exponent, up to inf).
  const uint32_t rebiased = magnitude - ((127 - 15) << 23);
  const uint32_t normal = (rebiased + 0xfff + ((rebiased >> 13) & 1)) >> 13;
  // Subnormal half (below 2^-14): adding 0.5 aligns the result's units
  // (2^-24) with the last mantissa bit of the sum, so the float addition does
  // the round to nearest even (in the default rounding mode).
  const uint32_t subnormal = float_bits(bits_float(magnitude) + 0.5f) - float_bits(0.5f);
  uint32_t result = select(mask_if(magnitude >= 0x38800000), normal, subnormal);
  result = select(mask_if(magnitude >= 0x47800000), 0x7c00, result);  // >= 2^16: inf
  result = select(mask_if(magnitude > 0x7f800000), 0x7e00, sign | result);
  return static_cast<uint16_t>(result);
}

float bfloat16_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

// Round to nearest even; a NaN becomes the canonical NaN.
uint16_t float_to_bfloat16(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffff) > 0x7f800000) return 0x7fc0;
  return static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

template <class A>
bool is_nan(A x) {
  if constexpr (std::is_floating_point_v<A>) {
    return std::isnan(x);
  } else {
    return false;
  }
}

// A format says how elements are stored (Elem) and accumulated (Acc).
template <class T>
struct Native {
  using Elem = T;
  using Acc = T;
  static Acc load(Elem x) { return x; }
  static Elem store(Acc x) { return is_nan(x) ? std::numeric_limits<T>::quiet_NaN() : x; }
};

struct Half {
  using Elem = uint16_t;
  using Acc = float;
  static Acc load(Elem x) { return half_to_float(x); }
  static Elem store(Acc x) { return float_to_half(x); }
};

struct BFloat16 {
  using Elem = uint16_t;
  using Acc = float;
  static Acc load(Elem x) { return bfloat16_to_float(x); }
  static Elem store(Acc x) { return float_to_bfloat16(x); }
};

struct Sum {
  template <class A>
  static A apply(A a, A b) {
    if constexpr (std::is_integral_v<A>) {
      using U = std::make_unsigned_t<A>;
      return static_cast<A>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
    } else {
      return a + b;
    }
  }
};

struct Prod {
  template <class A>
  static A apply(A a, A b) {
    if constexpr (std::is_integral_v<A>) {
      using U = std::make_unsigned_t<A>;
      return static_cast<A>(static_cast<U>(static_cast<U>(a) * static_cast<U>(b)));
    } else {
      return a * b;
    }
  }
};

struct Min {
  template <class A>
  static A apply(A a, A b) {
    return (a < b || is_nan(a)) ? a : b;
  }
};

struct Max {
  template <class A>
  static A apply(A a, A b) {
    return (a > b || is_nan(a)) ? a : b;
  }
};

// Elements per tile: the tile is reduced over all sources in a stack buffer of
// accumulators, so each source element is read once and each destination
// element written once.
constexpr size_t kTile = 256;

template <class F, class Op>
void reduce_tile(const ReduceArgs& a, size_t begin, size_t n) {
  using Elem = typename F::Elem;
  typename F::Acc acc[kTile];
  const Elem* first = static_cast<const Elem*>(a.srcs[0]) + begin;
  for (size_t j = 0; j < n; ++j) acc[j] = F::load(first[j]);
  for (int k = 1; k < a.nsrc; ++k) {
    const Elem* src = static_cast<const Elem*>(a.srcs[k]) + begin;
    for (size_t j = 0; j < n; ++j) acc[j] = Op::apply(acc[j], F::load(src[j]));
  }
  Elem* dst0 = static_cast<Elem*>(a.dst0) + begin;
  for (size_t j = 0; j < n; ++j) dst0[j] = F::store(acc[j]);
  if (a.dst1 != nullptr && a.dst1 != a.dst0) {
    std::memcpy(static_cast<Elem*>(a.dst1) + begin, dst0, n * sizeof(Elem));
  }
}

template <class F, class Op>
void reduce_tiles(const ReduceArgs& a) {
  size_t begin = 0;
  for (; begin + kTile <= a.count; begin += kTile) reduce_tile<F, Op>(a, begin, kTile);
  if (begin < a.count) reduce_tile<F, Op>(a, begin, a.count - begin);
}

template <class F>
void reduce_format(const ReduceArgs& a) {
  switch (a.op) {
    case ReduceOp::kSum:
      return reduce_tiles<F, Sum>(a);
    case ReduceOp::kProd:
      return reduce_tiles<F, Prod>(a);
    case ReduceOp::kMin:
      return reduce_tiles<F, Min>(a);
    case ReduceOp::kMax:
      return reduce_tiles<F, Max>(a);
    case ReduceOp::kAvg:  // rejected by reduce() before it gets here
      return;
  }
}

template <class F>
void scale(void* x, size_t count, int divisor) {
  auto* p = static_cast<typename F::Elem*>(x);
  using Acc = typename F::Acc;
  if constexpr (std::is_floating_point_v<Acc>) {
    const Acc d = static_cast<Acc>(divisor);
    for (size_t i = 0; i < count; ++i) p[i] = F::store(F::load(p[i]) / d);
  } else {
    for (size_t i = 0; i < count; ++i) p[i] = static_cast<Acc>(p[i] / divisor);
  }
}

}  // namespace

void reduce_generic(const ReduceArgs& args) {
  switch (args.dtype) {
    case DataType::kFloat32:
      return reduce_format<Native<float>>(args);
    case DataType::kFloat64:
      return reduce_format<Native<double>>(args);
    case DataType::kFloat16:
      return reduce_format<Half>(args);
    case DataType::kBFloat16:
      return reduce_format<BFloat16>(args);
    case DataType::kInt8:
      return reduce_format<Native<int8_t>>(args);
    case DataType::kUInt8:
      return reduce_format<Native<uint8_t>>(args);
    case DataType::kInt32:
      return reduce_format<Native<int32_t>>(args);
    case DataType::kInt64:
      return reduce_format<Native<int64_t>>(args);
  }
}

void scale_avg_generic(void* x, DataType dtype, size_t count, int divisor) {
  switch (dtype) {
    case DataType::kFloat32:
      return scale<Native<float>>(x, count, divisor);
    case DataType::kFloat64:
      return scale<Native<double>>(x, count, divisor);
    case DataType::kFloat16:
      return scale<Half>(x, count, divisor);
    case DataType::kBFloat16:
      return scale<BFloat16>(x, count, divisor);
    case DataType::kInt8:
      return scale<Native<int8_t>>(x, count, divisor);
    case DataType::kUInt8:
      return scale<Native<uint8_t>>(x, count, divisor);
    case DataType::kInt32:
      return scale<Native<int32_t>>(x, count, divisor);
    case DataType::kInt64:
      return scale<Native<int64_t>>(x, count, divisor);
  }
}

}  // namespace kernels
}  // namespace pyc
