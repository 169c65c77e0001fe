// AVX-512 (F, BW, VL) reduction kernels: one format per dtype, run by the
// loops in simd_loop.h. Compiled for AVX-512 by the pragma below, without any
// special compiler flag; only called when cpu_features finds AVX-512.
#include "reduce/kernels.h"

#if PYC_X86_KERNELS

// GCC 12's AVX-512 headers trip -Wuninitialized on their own
// _mm512_undefined_*() (GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <cstddef>
#include <cstdint>
#include <cstring>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")

#include "reduce/simd_loop.h"

namespace pyc {
namespace kernels {
namespace {

// Arithmetic on 16 float32 lanes: float32 itself, and the accumulation type
// of float16 and bfloat16.
struct Float32Math {
  using Acc = __m512;
  static constexpr size_t W = 16;
  static Acc add(Acc a, Acc b) { return _mm512_add_ps(a, b); }
  static Acc mul(Acc a, Acc b) { return _mm512_mul_ps(a, b); }
  // _mm512_min_ps(a, b) is a < b ? a : b; NaN in a is then taken explicitly.
  static Acc min(Acc a, Acc b) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), _mm512_min_ps(a, b), a);
  }
  static Acc max(Acc a, Acc b) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), _mm512_max_ps(a, b), a);
  }
  static Acc div(Acc a, int divisor) {
    return _mm512_div_ps(a, _mm512_set1_ps(static_cast<float>(divisor)));
  }
  // Any NaN replaced by the canonical quiet NaN (see reduce_generic.cc).
  static Acc canonical(Acc v) {
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_blend_ps(nan, v, _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000)));
  }
};

struct Float32 : Float32Math {
  using Elem = float;
  static Acc load(const Elem* p) { return _mm512_loadu_ps(p); }
  static void store(Elem* p, Acc v) { _mm512_storeu_ps(p, canonical(v)); }
};

struct Float16 : Float32Math {
  using Elem = uint16_t;
  static Acc load(const Elem* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store(Elem* p, Acc v) {
    const __m256i h = _mm512_cvtps_ph(canonical(v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  }
};

// 32 bfloat16 per step, widened without shuffles: the even elements shifted
// up, the odd ones masked, each pair of 16 bits becoming a float32.
struct BFloat16 : simd::PairMath<Float32Math> {
  using Elem = uint16_t;
  static constexpr size_t W = 32;
  static Acc load(const Elem* p) {
    const __m512i v = _mm512_loadu_si512(p);
    return {_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)),
            _mm512_castsi512_ps(_mm512_and_si512(v, high_halves()))};
  }
  static void store(Elem* p, Acc v) {
    const __m512i even = _mm512_srli_epi32(round_to_high_half(v.even), 16);
    const __m512i odd = _mm512_and_si512(round_to_high_half(v.odd), high_halves());
    _mm512_storeu_si512(p, _mm512_or_si512(even, odd));
  }
  static __m512i high_halves() { return _mm512_set1_epi32(static_cast<int>(0xffff0000u)); }
  // The bfloat16 rounding of each lane, in its high 16 bits: round to nearest
  // even, u + 0x7fff + ((u >> 16) & 1); a NaN becomes the canonical NaN.
  static __m512i round_to_high_half(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_blend_epi32(nan, rounded, _mm512_set1_epi32(0x7fc00000));
  }
};

struct Float64 {
  using Elem = double;
  using Acc = __m512d;
  static constexpr size_t W = 8;
  static Acc load(const Elem* p) { return _mm512_loadu_pd(p); }
  static void store(Elem* p, Acc v) {
    const __mmask8 nan = _mm512_cmp_pd_mask(v, v, _CMP_UNORD_Q);
    const __m512d canonical_nan = _mm512_castsi512_pd(_mm512_set1_epi64(0x7ff8000000000000));
    _mm512_storeu_pd(p, _mm512_mask_blend_pd(nan, v, canonical_nan));
  }
  static Acc add(Acc a, Acc b) { return _mm512_add_pd(a, b); }
  static Acc mul(Acc a, Acc b) { return _mm512_mul_pd(a, b); }
  static Acc min(Acc a, Acc b) {
    return _mm512_mask_blend_pd(_mm512_cmp_pd_mask(a, a, _CMP_UNORD_Q), _mm512_min_pd(a, b), a);
  }
  static Acc max(Acc a, Acc b) {
    return _mm512_mask_blend_pd(_mm512_cmp_pd_mask(a, a, _CMP_UNORD_Q), _mm512_max_pd(a, b), a);
  }
  static Acc div(Acc a, int divisor) {
    return _mm512_div_pd(a, _mm512_set1_pd(static_cast<double>(divisor)));
  }
};

template <class T>
struct IntegerFormat {
  using Elem = T;
  using Acc = __m512i;
  static constexpr size_t W = 64 / sizeof(T);
  static Acc load(const Elem* p) { return _mm512_loadu_si512(p); }
  static void store(Elem* p, Acc v) { _mm512_storeu_si512(p, v); }
};

// Low 8 bits of each byte product, from 16-bit products of the even and of
// the odd bytes (the same for signed and unsigned bytes).
__m512i mul_bytes(__m512i a, __m512i b) {
  const __m512i even = _mm512_mullo_epi16(a, b);
  const __m512i odd = _mm512_mullo_epi16(_mm512_srli_epi16(a, 8), _mm512_srli_epi16(b, 8));
  return _mm512_mask_blend_epi8(0xaaaaaaaaaaaaaaaaull, even, _mm512_slli_epi16(odd, 8));
}

// Low 64 bits of a * b: lo*lo + ((hi*lo + lo*hi) << 32), without AVX512DQ.
__m512i mul_int64(__m512i a, __m512i b) {
  const __m512i low = _mm512_mul_epu32(a, b);
  const __m512i cross = _mm512_add_epi64(_mm512_mul_epu32(_mm512_srli_epi64(a, 32), b),
                                         _mm512_mul_epu32(a, _mm512_srli_epi64(b, 32)));
  return _mm512_add_epi64(low, _mm512_slli_epi64(cross, 32));
}

struct Int8 : IntegerFormat<int8_t> {
  static Acc add(Acc a, Acc b) { return _mm512_add_epi8(a, b); }
  static Acc mul(Acc a, Acc b) { return mul_bytes(a, b); }
  static Acc min(Acc a, Acc b) { return _mm512_min_epi8(a, b); }
  static Acc max(Acc a, Acc b) { return _mm512_max_epi8(a, b); }
};

struct UInt8 : IntegerFormat<uint8_t> {
  static Acc add(Acc a, Acc b) { return _mm512_add_epi8(a, b); }
  static Acc mul(Acc a, Acc b) { return mul_bytes(a, b); }
  static Acc min(Acc a, Acc b) { return _mm512_min_epu8(a, b); }
  static Acc max(Acc a, Acc b) { return _mm512_max_epu8(a, b); }
};

struct Int32 : IntegerFormat<int32_t> {
  static Acc add(Acc a, Acc b) { return _mm512_add_epi32(a, b); }
  static Acc mul(Acc a, Acc b) { return _mm512_mullo_epi32(a, b); }
  static Acc min(Acc a, Acc b) { return _mm512_min_epi32(a, b); }
  static Acc max(Acc a, Acc b) { return _mm512_max_epi32(a, b); }
};

struct Int64 : IntegerFormat<int64_t> {
  static Acc add(Acc a, Acc b) { return _mm512_add_epi64(a, b); }
  static Acc mul(Acc a, Acc b) { return mul_int64(a, b); }
  static Acc min(Acc a, Acc b) { return _mm512_min_epi64(a, b); }
  static Acc max(Acc a, Acc b) { return _mm512_max_epi64(a, b); }
};

// 64-byte registers for copy_streaming.
struct Bytes64 {
  using Reg = __m512i;
  static constexpr size_t B = 64;
  static Reg load(const void* p) { return _mm512_loadu_si512(p); }
  static void store(void* p, Reg r) { _mm512_storeu_si512(p, r); }
  static void stream(void* p, Reg r) { _mm512_stream_si512(static_cast<__m512i*>(p), r); }
  static void fence() { _mm_sfence(); }
};

}  // namespace

void reduce_avx512(const ReduceArgs& args) {
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

void copy_streaming_avx512(void* dst0, void* dst1, const void* src, size_t bytes) {
  simd::copy_streaming_loop<Bytes64>(dst0, dst1, src, bytes);
}

void scale_avg_avx512(void* x, DataType dtype, size_t count, int divisor) {
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
