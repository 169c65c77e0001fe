// The public entry points of reduce.h: argument checks, the copy fast path,
// and the choice, made once per process, between the generic, AVX2 and
// AVX-512 kernels.
#include <cstdint>
#include <cstring>

#include "core/error.h"
#include "reduce/cpu_features.h"
#include "reduce/kernels.h"
#include "reduce/reduce.h"

namespace pyc {
namespace {

struct KernelTable {
  SimdLevel level;
  void (*reduce)(const ReduceArgs& args);
  void (*scale_avg)(void* x, DataType dtype, size_t count, int divisor);
  void (*copy_streaming)(void* dst0, void* dst1, const void* src, size_t bytes);  // null: memcpy
};

KernelTable choose_kernels() {
  switch (selected_simd_level()) {
#if PYC_X86_KERNELS
    case SimdLevel::kAvx512:
      return {SimdLevel::kAvx512, kernels::reduce_avx512, kernels::scale_avg_avx512,
              kernels::copy_streaming_avx512};
    case SimdLevel::kAvx2:
      return {SimdLevel::kAvx2, kernels::reduce_avx2, kernels::scale_avg_avx2,
              kernels::copy_streaming_avx2};
#endif
    default:
      return {SimdLevel::kGeneric, kernels::reduce_generic, kernels::scale_avg_generic, nullptr};
  }
}

const KernelTable& active_kernels() {
  static const KernelTable table = choose_kernels();
  return table;
}

}  // namespace

void reduce(const ReduceArgs& args) {
  PYC_ASSERT(valid_dtype(static_cast<int32_t>(args.dtype)));
  PYC_ASSERT(valid_reduce_op(static_cast<int32_t>(args.op)) && args.op != ReduceOp::kAvg);
  PYC_ASSERT(args.nsrc >= 1);
  if (args.count == 0) return;
  PYC_ASSERT(args.dst0 != nullptr && args.srcs != nullptr);
  for (int k = 0; k < args.nsrc; ++k) PYC_ASSERT(args.srcs[k] != nullptr);
  if (args.nsrc == 1) {
    copy(args.dst0, args.dst1, args.srcs[0], args.count * dtype_size(args.dtype));
    return;
  }
  active_kernels().reduce(args);
}

void scale_avg(void* x, DataType dtype, size_t count, int divisor) {
  PYC_ASSERT(valid_dtype(static_cast<int32_t>(dtype)));
  PYC_ASSERT(divisor >= 1);
  if (count == 0) return;
  PYC_ASSERT(x != nullptr);
  active_kernels().scale_avg(x, dtype, count, divisor);
}

void copy(void* dst0, void* dst1, const void* src, size_t bytes, Store dst0_store) {
  if (bytes == 0) return;
  PYC_ASSERT(dst0 != nullptr && src != nullptr);
  if (dst0_store == Store::kStreaming && dst0 != src) {
    if (const auto streaming = active_kernels().copy_streaming) {  // null: memcpy below
      streaming(dst0, dst1 == src ? nullptr : dst1, src, bytes);
      return;
    }
  }
  if (dst0 != src) std::memcpy(dst0, src, bytes);
  if (dst1 != nullptr && dst1 != src) std::memcpy(dst1, src, bytes);
}

const char* simd_level() { return simd_level_name(active_kernels().level); }

}  // namespace pyc
