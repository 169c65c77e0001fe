// Python access to the CPU reduction kernels on raw addresses, for tests and
// for reporting which SIMD path is in use.
#include "bindings/reduce_bindings.h"

#include <pybind11/stl.h>

#include <cstdint>
#include <vector>

#include "bindings/convert.h"
#include "core/types.h"
#include "reduce/reduce.h"

namespace py = pybind11;

namespace pyc {

void bind_reduce(py::module_& m) {
  m.def(
      "_reduce",
      [](int dtype, int op, uintptr_t dst0, uintptr_t dst1, const std::vector<uintptr_t>& srcs,
         size_t count) {
        const DataType dt = checked_dtype(dtype, "_reduce");
        const ReduceOp kernel_op = checked_kernel_op(op, "_reduce");
        if (srcs.empty()) throw py::value_error("pycollectives: _reduce needs at least one source");
        if (count > 0 && dst0 == 0) throw py::value_error("pycollectives: _reduce: dst0 is null");
        for (uintptr_t s : srcs)
          if (count > 0 && s == 0)
            throw py::value_error("pycollectives: _reduce: a source is null");
        const std::vector<const void*> src_ptrs = addresses(srcs);
        const ReduceArgs args{dt,
                              kernel_op,
                              address(dst0),
                              address(dst1),
                              src_ptrs.data(),
                              static_cast<int>(src_ptrs.size()),
                              count};
        py::gil_scoped_release release;
        reduce(args);
      },
      py::arg("dtype"), py::arg("op"), py::arg("dst0"), py::arg("dst1"), py::arg("srcs"),
      py::arg("count"),
      "dst0 (and dst1 unless 0) = elementwise op over the buffers at the addresses srcs.");
  m.def(
      "_scale_avg",
      [](uintptr_t x, int dtype, size_t count, int divisor) {
        const DataType dt = checked_dtype(dtype, "_scale_avg");
        if (divisor < 1) throw py::value_error("pycollectives: _scale_avg: divisor must be >= 1");
        if (count > 0 && x == 0) throw py::value_error("pycollectives: _scale_avg: null address");
        py::gil_scoped_release release;
        scale_avg(address(x), dt, count, divisor);
      },
      py::arg("ptr"), py::arg("dtype"), py::arg("count"), py::arg("divisor"),
      "x[i] /= divisor in place, as for ReduceOp.AVG.");
  m.def(
      "_copy",
      [](uintptr_t dst0, uintptr_t dst1, uintptr_t src, size_t bytes, bool streaming) {
        if (bytes > 0 && (dst0 == 0 || src == 0))
          throw py::value_error("pycollectives: _copy: dst0 or src is null");
        py::gil_scoped_release release;
        copy(address(dst0), address(dst1), address(src), bytes,
             streaming ? Store::kStreaming : Store::kCached);
      },
      py::arg("dst0"), py::arg("dst1"), py::arg("src"), py::arg("bytes"), py::arg("streaming"),
      "dst0 (and dst1 unless 0) = the bytes at src; dst0 through non-temporal stores if "
      "streaming.");
  m.def("simd_level", &simd_level,
        "Which CPU reduction kernels are in use: \"avx512\", \"avx2\" or \"generic\".");
}

}  // namespace pyc
