// AVX2 (+ FMA, F16C) reduction kernels: one format per dtype, run by the
// loops in simd_loop.h. Compiled for AVX2 by the pragma below, without any
// special compiler flag; only called when cpu_features finds AVX2.
#include "reduce/kernels.h"

#if PYC_X86_KERNELS

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

#include "reduce/simd_loop.h"

namespace pyc {
namespace kernels {
namespace {

// Arithmetic on 8 float32 lanes: float32 itself, and the accumulation type of
// float16 and bfloat16.
struct Float32Math {
  using Acc = __m256;
  static constexpr size_t W = 8;
  static Acc add(Acc a, Acc b) { return _mm256_add_ps(a, b); }
  static Acc mul(Acc a, Acc b) { return _mm256_mul_ps(a, b); }
  // _mm256_min_ps(a, b) is a < b ? a : b; NaN in a is then taken explicitly.
  static Acc min(Acc a, Acc b) {
    return _mm256_blendv_ps(_mm256_min_ps(a, b), a, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  }
  static Acc max(Acc a, Acc b) {
    return _mm256_blendv_ps(_mm256_max_ps(a, b), a, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  }
  static Acc div(Acc a, int divisor) {
    return _mm256_div_ps(a, _mm256_set1_ps(static_cast<float>(divisor)));
  }
  // Any NaN replaced by the canonical quiet NaN (see reduce_generic.cc).
  static Acc canonical(Acc v) {
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    return _mm256_blendv_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), nan);
  }
};

struct Float32 : Float32Math {
  using Elem = float;
  static Acc load(const Elem* p) { return _mm256_loadu_ps(p); }
  static void store(Elem* p, Acc v) { _mm256_storeu_ps(p, canonical(v)); }
};

struct Float16 : Float32Math {
  using Elem = uint16_t;
  static Acc load(const Elem* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store(Elem* p, Acc v) {
    const __m128i h = _mm256_cvtps_ph(canonical(v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  }
};

// 16 bfloat16 per step, widened without shuffles: the even elements shifted
// up, the odd ones masked, each pair of 16 bits becoming a float32.
struct BFloat16 : simd::PairMath<Float32Math> {
  using Elem = uint16_t;
  static constexpr size_t W = 16;
  static Acc load(const Elem* p) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)),
            _mm256_castsi256_ps(_mm256_and_si256(v, high_halves()))};
  }
  static void store(Elem* p, Acc v) {
    const __m256i even = _mm256_srli_epi32(round_to_high_half(v.even), 16);
    const __m256i odd = _mm256_and_si256(round_to_high_half(v.odd), high_halves());
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_or_si256(even, odd));
  }
  static __m256i high_halves() { return _mm256_set1_epi32(static_cast<int>(0xffff0000u)); }
  // The bfloat16 rounding of each lane, in its high 16 bits: round to nearest
  // even, u + 0x7fff + ((u >> 16) & 1); a NaN becomes the canonical NaN.
  static __m256i round_to_high_half(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc00000), nan);
  }
};

struct Float64 {
  using Elem = double;
  using Acc = __m256d;
  static constexpr size_t W = 4;
  static Acc load(const Elem* p) { return _mm256_loadu_pd(p); }
  static void store(Elem* p, Acc v) {
    const __m256d nan = _mm256_cmp_pd(v, v, _CMP_UNORD_Q);
    const __m256d canonical_nan = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7ff8000000000000));
    _mm256_storeu_pd(p, _mm256_blendv_pd(v, canonical_nan, nan));
  }
  static Acc add(Acc a, Acc b) { return _mm256_add_pd(a, b); }
  static Acc mul(Acc a, Acc b) { return _mm256_mul_pd(a, b); }
  static Acc min(Acc a, Acc b) {
    return _mm256_blendv_pd(_mm256_min_pd(a, b), a, _mm256_cmp_pd(a, a, _CMP_UNORD_Q));
  }
  static Acc max(Acc a, Acc b) {
    return _mm256_blendv_pd(_mm256_max_pd(a, b), a, _mm256_cmp_pd(a, a, _CMP_UNORD_Q));
  }
  static Acc div(Acc a, int divisor) {
    return _mm256_div_pd(a, _mm256_set1_pd(static_cast<double>(divisor)));
  }
};

template <class T>
struct IntegerFormat {
  using Elem = T;
  using Acc = __m256i;
  static constexpr size_t W = 32 / sizeof(T);
  static Acc load(const Elem* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static void store(Elem* p, Acc v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
};

// Low 8 bits of each byte product, from 16-bit products of the even and of
// the odd bytes (the same for signed and unsigned bytes).
__m256i mul_bytes(__m256i a, __m256i b) {
  const __m256i even = _mm256_mullo_epi16(a, b);
  const __m256i odd = _mm256_mullo_epi16(_mm256_srli_epi16(a, 8), _mm256_srli_epi16(b, 8));
  return _mm256_or_si256(_mm256_and_si256(even, _mm256_set1_epi16(0xff)),
                         _mm256_slli_epi16(odd, 8));
}

// Low 64 bits of a * b: lo*lo + ((hi*lo + lo*hi) << 32).
__m256i mul_int64(__m256i a, __m256i b) {
  const __m256i low = _mm256_mul_epu32(a, b);
  const __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), b),
                                         _mm256_mul_epu32(a, _mm256_srli_epi64(b, 32)));
  return _mm256_add_epi64(low, _mm256_slli_epi64(cross, 32));
}

struct Int8 : IntegerFormat<int8_t> {
  static Acc add(Acc a, Acc b) { return _mm256_add_epi8(a, b); }
  static Acc mul(Acc a, Acc b) { return mul_bytes(a, b); }
  static Acc min(Acc a, Acc b) { return _mm256_min_epi8(a, b); }
  static Acc max(Acc a, Acc b) { return _mm256_max_epi8(a, b); }
};

struct UInt8 : IntegerFormat<uint8_t> {
  static Acc add(Acc a, Acc b) { return _mm256_add_epi8(a, b); }
  static Acc mul(Acc a, Acc b) { return mul_bytes(a, b); }
  static Acc min(Acc a, Acc b) { return _mm256_min_epu8(a, b); }
  static Acc max(Acc a, Acc b) { return _mm256_max_epu8(a, b); }
};

struct Int32 : IntegerFormat<int32_t> {
  static Acc add(Acc a, Acc b) { return _mm256_add_epi32(a, b); }
  static Acc mul(Acc a, Acc b) { return _mm256_mullo_epi32(a, b); }
  static Acc min(Acc a, Acc b) { return _mm256_min_epi32(a, b); }
  static Acc max(Acc a, Acc b) { return _mm256_max_epi32(a, b); }
};

// AVX2 has no 64-bit min/max: select on a signed compare.
struct Int64 : IntegerFormat<int64_t> {
  static Acc add(Acc a, Acc b) { return _mm256_add_epi64(a, b); }
  static Acc mul(Acc a, Acc b) { return mul_int64(a, b); }
  static Acc min(Acc a, Acc b) { return _mm256_blendv_epi8(a, b, _mm256_cmpgt_epi64(a, b)); }
  static Acc max(Acc a, Acc b) { return _mm256_blendv_epi8(b, a, _mm256_cmpgt_epi64(a, b)); }
};

// 32-byte registers for copy_streaming.
struct Bytes32 {
  using Reg = __m256i;
  static constexpr size_t B = 32;
  static Reg load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  static void store(void* p, Reg r) { _mm256_storeu_si256(static_cast<__m256i*>(p), r); }
  static void stream(void* p, Reg r) { _mm256_stream_si256(static_cast<__m256i*>(p), r); }
  static void fence() { _mm_sfence(); }
};

}  // namespace

void reduce_avx2(const ReduceArgs& args) {
  switch (args.dtype) {
    case DataType::kFloat32:
      return simd::reduce_format<Float32>(args);
    case DataType::kFloat64:
      return simd::reduce_format<Float64>(args);
    case DataType::kFloat16:
      return simd::reduce_format<Float16>(args);
    case DataType::kBFloat16:
      return simd::reduce_format<BFloat16>(args);
    case DataType::kInt8:
      return simd::reduce_format<Int8>(args);
    case DataType::kUInt8:
      return simd::reduce_format<UInt8>(args);
    case DataType::kInt32:
      return simd::reduce_format<Int32>(args);
    case DataType::kInt64:
      return simd::reduce_format<Int64>(args);
  }
}

void copy_streaming_avx2(void* dst0, void* dst1, const void* src, size_t bytes) {
  simd::copy_streaming_loop<Bytes32>(dst0, dst1, src, bytes);
}

void scale_avg_avx2(void* x, DataType dtype, size_t count, int divisor) {
  switch (dtype) {
    case DataType::kFloat32:
      return simd::scale_format<Float32>(x, count, divisor);
    case DataType::kFloat64:
      return simd::scale_format<Float64>(x, count, divisor);
    case DataType::kFloat16:
      return simd::scale_format<Float16>(x, count, divisor);
    case DataType::kBFloat16:
      return simd::scale_format<BFloat16>(x, count, divisor);
    default:
      return scale_avg_generic(x, dtype, count, divisor);  // integer division
  }
}

}  // namespace kernels
}  // namespace pyc

#pragma GCC pop_options

#endif  // PYC_X86_KERNELS
