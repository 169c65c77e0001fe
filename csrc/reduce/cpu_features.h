// Run-time detection of the CPU's SIMD features (and the OS's support for
// their register state), capped by the PYCOLL_SIMD environment variable.
#pragma once

namespace pyc {

// Ordered: each level implies the ones below it.
enum class SimdLevel : int { kGeneric = 0, kAvx2 = 1, kAvx512 = 2 };

// Best level this CPU and OS support: kAvx512 needs AVX-512 F, BW and VL with
// the ZMM state enabled by the OS; kAvx2 needs AVX2, FMA and F16C with the YMM
// state enabled.
SimdLevel cpu_simd_level();

// cpu_simd_level(), lowered to PYCOLL_SIMD=generic|avx2|avx512 when that is
// set. An unrecognized value is ignored with a warning on stderr.
SimdLevel selected_simd_level();

// "generic", "avx2" or "avx512".
const char* simd_level_name(SimdLevel level);

}  // namespace pyc
