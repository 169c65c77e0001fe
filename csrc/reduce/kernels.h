// Internal: the entry points of each kernel implementation, which
// dispatch.cc chooses between. Arguments are already validated, count > 0 and
// nsrc >= 2 (nsrc == 1 is handled by copy()).
#pragma once

#include <cstddef>

#include "reduce/reduce.h"

#if defined(__x86_64__) || defined(__i386__)
#define PYC_X86_KERNELS 1
#else
#define PYC_X86_KERNELS 0
#endif

namespace pyc {
namespace kernels {

// Portable C++ (reduce_generic.cc); also handles integer scale_avg for the
// SIMD paths.
void reduce_generic(const ReduceArgs& args);
void scale_avg_generic(void* x, DataType dtype, size_t count, int divisor);

#if PYC_X86_KERNELS
// AVX2 + FMA + F16C (reduce_avx2.cc).
void reduce_avx2(const ReduceArgs& args);
void scale_avg_avx2(void* x, DataType dtype, size_t count, int divisor);
void copy_streaming_avx2(void* dst0, void* dst1, const void* src, size_t bytes);

// AVX-512 F/BW/VL (reduce_avx512.cc).
void reduce_avx512(const ReduceArgs& args);
void scale_avg_avx512(void* x, DataType dtype, size_t count, int divisor);
void copy_streaming_avx512(void* dst0, void* dst1, const void* src, size_t bytes);
#endif

}  // namespace kernels
}  // namespace pyc
