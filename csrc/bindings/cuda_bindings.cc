// Python access to the CUDA kernels on raw device addresses (integers, e.g.
// torch's data_ptr()) and streams (torch's cuda_stream); see
// bindings/cuda_bindings.h.
#include "bindings/cuda_bindings.h"

#include <pybind11/stl.h>

#include <cstdint>
#include <vector>

#include "bindings/convert.h"
#include "core/error.h"
#include "core/types.h"
#include "reduce/reduce.h"

#ifdef PYCOLL_WITH_CUDA
#include "cuda/check.h"
#include "cuda/kernels.h"
#endif

namespace py = pybind11;

namespace pyc {
namespace {

#ifdef PYCOLL_WITH_CUDA
constexpr bool kCudaBuilt = true;
#else
constexpr bool kCudaBuilt = false;
#endif

// Raises pyc::Error (PyCollectivesError) in a build without CUDA.
void require_cuda_build(const char* fn) {
  if (!kCudaBuilt) throw_built_without_cuda(fn);
}

}  // namespace

void bind_cuda(py::module_& m) {
  m.def(
      "cuda_built", []() { return kCudaBuilt; },
      "True when this build has the CUDA kernels (PYCOLL_CUDA and nvcc at build time).");
  m.def(
      "cuda_device_count",
      []() {
#ifdef PYCOLL_WITH_CUDA
        py::gil_scoped_release release;
        return cuda::device_count();
#else
        return 0;
#endif
      },
      "CUDA devices this process can use: 0 without CUDA support, driver or device. Never "
      "raises.");
  m.def(
      "_cuda_reduce",
      [](int dtype, int op, uintptr_t dst0, uintptr_t dst1, const std::vector<uintptr_t>& srcs,
         size_t count, uintptr_t stream) {
        constexpr const char* kFn = "_cuda_reduce";
        require_cuda_build(kFn);
        const DataType dt = checked_dtype(dtype, kFn);
        const ReduceOp kernel_op = checked_kernel_op(op, kFn);
        if (srcs.empty()) PYC_THROW(InvalidArgument, "pycollectives: " << kFn << ": srcs is empty");
        const std::vector<const void*> src_ptrs = addresses(srcs);
        const ReduceArgs args{dt,
                              kernel_op,
                              address(dst0),
                              address(dst1),
                              src_ptrs.data(),
                              static_cast<int>(src_ptrs.size()),
                              count};
#ifdef PYCOLL_WITH_CUDA
        py::gil_scoped_release release;
        cuda::reduce(args, reinterpret_cast<cudaStream_t>(stream));
#else
        (void)args;
        (void)stream;
#endif
      },
      py::arg("dtype"), py::arg("op"), py::arg("dst0"), py::arg("dst1"), py::arg("srcs"),
      py::arg("count"), py::arg("stream"),
      "Enqueues dst0 (and dst1 unless 0) = elementwise op over the device buffers at the "
      "addresses srcs on the CUDA stream `stream`.");
  m.def(
      "_cuda_scale_avg",
      [](uintptr_t x, int dtype, size_t count, int divisor, uintptr_t stream) {
        constexpr const char* kFn = "_cuda_scale_avg";
        require_cuda_build(kFn);
        const DataType dt = checked_dtype(dtype, kFn);
#ifdef PYCOLL_WITH_CUDA
        py::gil_scoped_release release;
        cuda::scale_avg(address(x), dt, count, divisor, reinterpret_cast<cudaStream_t>(stream));
#else
        (void)x, (void)dt, (void)count, (void)divisor, (void)stream;
#endif
      },
      py::arg("ptr"), py::arg("dtype"), py::arg("count"), py::arg("divisor"), py::arg("stream"),
      "Enqueues x[i] /= divisor on the device buffer at `ptr`, as for ReduceOp.AVG.");
  m.def(
      "_cuda_copy",
      [](uintptr_t dst0, uintptr_t dst1, uintptr_t src, size_t bytes, uintptr_t stream) {
        require_cuda_build("_cuda_copy");
#ifdef PYCOLL_WITH_CUDA
        py::gil_scoped_release release;
        cuda::copy(address(dst0), address(dst1), address(src), bytes,
                   reinterpret_cast<cudaStream_t>(stream));
#else
        (void)dst0, (void)dst1, (void)src, (void)bytes, (void)stream;
#endif
      },
      py::arg("dst0"), py::arg("dst1"), py::arg("src"), py::arg("bytes"), py::arg("stream"),
      "Enqueues dst0 (and dst1 unless 0) = the `bytes` bytes at src, on the CUDA stream `stream`.");
}

}  // namespace pyc
