// CPUID/XGETBV based feature detection for choosing the reduction kernels.
#include "reduce/cpu_features.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace pyc {

#if defined(__x86_64__) || defined(__i386__)
namespace {

// XCR0: which register states the OS saves on context switch.
uint64_t read_xcr0() {
  uint32_t lo = 0;
  uint32_t hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return static_cast<uint64_t>(hi) << 32 | lo;
}

bool bit(uint32_t reg, int n) { return (reg >> n) & 1u; }

}  // namespace

SimdLevel cpu_simd_level() {
  uint32_t eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return SimdLevel::kGeneric;
  const bool osxsave = bit(ecx, 27);
  const bool avx = bit(ecx, 28);
  const bool fma = bit(ecx, 12);
  const bool f16c = bit(ecx, 29);
  if (!osxsave || !avx) return SimdLevel::kGeneric;

  const uint64_t xcr0 = read_xcr0();
  const bool os_ymm = (xcr0 & 0x6) == 0x6;    // SSE + AVX state
  const bool os_zmm = (xcr0 & 0xe6) == 0xe6;  // + opmask, ZMM0-15 high, ZMM16-31
  if (!os_ymm) return SimdLevel::kGeneric;

  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return SimdLevel::kGeneric;
  const bool avx2 = bit(ebx, 5);
  const bool avx512f = bit(ebx, 16);
  const bool avx512bw = bit(ebx, 30);
  const bool avx512vl = bit(ebx, 31);

  if (!(avx2 && fma && f16c)) return SimdLevel::kGeneric;
  if (os_zmm && avx512f && avx512bw && avx512vl) return SimdLevel::kAvx512;
  return SimdLevel::kAvx2;
}
#else
SimdLevel cpu_simd_level() { return SimdLevel::kGeneric; }
#endif

SimdLevel selected_simd_level() {
  const SimdLevel hw = cpu_simd_level();
  const char* env = std::getenv("PYCOLL_SIMD");
  if (env == nullptr || *env == '\0') return hw;
  SimdLevel cap = hw;
  if (std::strcmp(env, "generic") == 0) {
    cap = SimdLevel::kGeneric;
  } else if (std::strcmp(env, "avx2") == 0) {
    cap = SimdLevel::kAvx2;
  } else if (std::strcmp(env, "avx512") == 0) {
    cap = SimdLevel::kAvx512;
  } else {
    std::fprintf(
        stderr, "pycollectives: ignoring PYCOLL_SIMD=%s (expected generic, avx2 or avx512)\n", env);
  }
  return cap < hw ? cap : hw;
}

const char* simd_level_name(SimdLevel level) {
  switch (level) {
    case SimdLevel::kGeneric:
      return "generic";
    case SimdLevel::kAvx2:
      return "avx2";
    case SimdLevel::kAvx512:
      return "avx512";
  }
  return "generic";
}

}  // namespace pyc
