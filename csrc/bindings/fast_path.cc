// Tensor introspection through the CPython C API (see fast_path.h).
#include "bindings/fast_path.h"

#include <vector>

namespace py = pybind11;

namespace pyc {
namespace {

std::vector<PyObject*> g_dtypes;  // torch.float32, ... (strong references)

PyObject* interned(const char* s) {
  PyObject* o = PyUnicode_InternFromString(s);
  if (o == nullptr) throw py::error_already_set();
  return o;
}

// Calls obj.name() with no arguments; nullptr (error cleared) on failure.
PyObject* call0(PyObject* obj, PyObject* name) {
  PyObject* r = PyObject_CallMethodNoArgs(obj, name);
  if (r == nullptr) PyErr_Clear();
  return r;
}

}  // namespace

void set_torch_dtypes(py::sequence dtypes) {
  for (PyObject* o : g_dtypes) Py_DECREF(o);
  g_dtypes.clear();
  for (py::handle d : dtypes) g_dtypes.push_back(d.inc_ref().ptr());
}

bool view_tensor(py::handle h, TensorView* out) {
  static PyObject* s_dtype = interned("dtype");
  static PyObject* s_is_cpu = interned("is_cpu");
  static PyObject* s_is_contiguous = interned("is_contiguous");
  static PyObject* s_data_ptr = interned("data_ptr");
  static PyObject* s_numel = interned("numel");
  PyObject* obj = h.ptr();
  if (g_dtypes.empty()) return false;
  PyObject* dt = PyObject_GetAttr(obj, s_dtype);
  if (dt == nullptr) {
    PyErr_Clear();
    return false;
  }
  int code = -1;
  for (size_t i = 0; i < g_dtypes.size(); ++i)
    if (g_dtypes[i] == dt) code = static_cast<int>(i);
  Py_DECREF(dt);
  if (code < 0) return false;
  PyObject* cpu = PyObject_GetAttr(obj, s_is_cpu);
  if (cpu == nullptr) PyErr_Clear();
  const bool is_cpu = cpu == Py_True;
  Py_XDECREF(cpu);
  if (!is_cpu) return false;
  PyObject* contig = call0(obj, s_is_contiguous);
  const bool is_contig = contig == Py_True;
  Py_XDECREF(contig);
  if (!is_contig) return false;
  PyObject* p = call0(obj, s_data_ptr);
  PyObject* n = call0(obj, s_numel);
  bool ok = p != nullptr && n != nullptr && PyLong_Check(p) && PyLong_Check(n);
  if (ok) {
    out->ptr = static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(p));
    out->numel = static_cast<size_t>(PyLong_AsSsize_t(n));
    out->dtype = code;
    if (PyErr_Occurred()) {
      PyErr_Clear();
      ok = false;
    }
  }
  Py_XDECREF(p);
  Py_XDECREF(n);
  return ok;
}

}  // namespace pyc
