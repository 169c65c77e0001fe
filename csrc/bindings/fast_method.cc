// FastMethod (see fast_path.h): a communicator's method as a C callable, so
// that its synchronous call on a CPU tensor runs with no Python frame.
#include <pybind11/pybind11.h>  // Python.h, before any other header
#include <structmember.h>

#include <cstddef>

#include "bindings/fast_path.h"

namespace py = pybind11;

namespace pyc {
namespace {

// The Python method's frame, its argument defaults and its test of async_op
// and timeout took ~0.14 us a call, a sixth of a 2-rank 8-byte all-reduce
// (docs/benchmarks.md, "Small-message all-reduce").
struct FastMethodObject {
  PyObject ob_base;  // PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject* fast;         // the FastPath's bound method: fast(a, b) -> bool
  PyObject* method;       // the class's Python function: method(self, *args, **kwargs)
  PyObject* self_ref;     // a weak reference to the communicator (its __dict__ holds us)
  PyObject* default_arg;  // fast's second argument when the caller gave one
  PyObject* weakreflist;  // so that FastMethod objects are weakly referenceable too
};

// Calls method(self, *args, **kwargs): the Python method, which checks and
// raises as it always did.
PyObject* call_method(FastMethodObject* m, PyObject* const* args, Py_ssize_t nargs,
                      PyObject* kwnames) {
  PyObject* self = PyWeakref_GetObject(m->self_ref);  // borrowed
  if (self == nullptr) return nullptr;
  if (self == Py_None) {
    PyErr_SetString(PyExc_ReferenceError, "pycollectives: the communicator no longer exists");
    return nullptr;
  }
  const Py_ssize_t nkw = kwnames != nullptr ? PyTuple_GET_SIZE(kwnames) : 0;
  constexpr Py_ssize_t kMax = 16;
  if (nargs + nkw + 1 > kMax) {
    PyErr_SetString(PyExc_TypeError, "pycollectives: too many arguments");
    return nullptr;
  }
  PyObject* all[kMax];
  all[0] = self;
  for (Py_ssize_t i = 0; i < nargs + nkw; ++i) all[i + 1] = args[i];
  Py_INCREF(self);
  PyObject* r = PyObject_Vectorcall(m->method, all, static_cast<size_t>(nargs) + 1, kwnames);
  Py_DECREF(self);
  return r;
}

PyObject* fast_method_call(PyObject* callable, PyObject* const* args, size_t nargsf,
                           PyObject* kwnames) {
  auto* m = reinterpret_cast<FastMethodObject*>(callable);
  const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  if (kwnames == nullptr && (nargs == 1 || nargs == 2)) {
    PyObject* fargs[2] = {args[0], nargs == 2 ? args[1] : m->default_arg};
    PyObject* done = PyObject_Vectorcall(m->fast, fargs, 2, nullptr);
    if (done == nullptr) return nullptr;  // the operation ran and raised
    const bool ran = done == Py_True;
    Py_DECREF(done);
    if (ran) Py_RETURN_NONE;
  }
  return call_method(m, args, nargs, kwnames);
}

int fast_method_traverse(PyObject* self, visitproc visit, void* arg) {
  auto* m = reinterpret_cast<FastMethodObject*>(self);
  Py_VISIT(Py_TYPE(self));
  Py_VISIT(m->fast);
  Py_VISIT(m->method);
  Py_VISIT(m->self_ref);
  Py_VISIT(m->default_arg);
  return 0;
}

int fast_method_clear(PyObject* self) {
  auto* m = reinterpret_cast<FastMethodObject*>(self);
  Py_CLEAR(m->fast);
  Py_CLEAR(m->method);
  Py_CLEAR(m->self_ref);
  Py_CLEAR(m->default_arg);
  return 0;
}

void fast_method_dealloc(PyObject* self) {
  PyTypeObject* type = Py_TYPE(self);
  PyObject_GC_UnTrack(self);
  if (reinterpret_cast<FastMethodObject*>(self)->weakreflist != nullptr)
    PyObject_ClearWeakRefs(self);
  fast_method_clear(self);
  type->tp_free(self);
  Py_DECREF(type);
}

// __doc__: the Python method's.
PyObject* fast_method_doc(PyObject* self, void*) {
  return PyObject_GetAttrString(reinterpret_cast<FastMethodObject*>(self)->method, "__doc__");
}

PyGetSetDef g_getset[] = {{"__doc__", fast_method_doc, nullptr, nullptr, nullptr},
                          {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyMemberDef g_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(FastMethodObject, vectorcall), READONLY, nullptr},
    {"__weaklistoffset__", T_PYSSIZET, offsetof(FastMethodObject, weakreflist), READONLY, nullptr},
    {"__func__", T_OBJECT, offsetof(FastMethodObject, method), READONLY, nullptr},
    {nullptr, 0, 0, 0, nullptr}};

PyType_Slot g_slots[] = {{Py_tp_dealloc, reinterpret_cast<void*>(fast_method_dealloc)},
                         {Py_tp_traverse, reinterpret_cast<void*>(fast_method_traverse)},
                         {Py_tp_clear, reinterpret_cast<void*>(fast_method_clear)},
                         {Py_tp_call, reinterpret_cast<void*>(PyVectorcall_Call)},
                         {Py_tp_getset, g_getset},
                         {Py_tp_members, g_members},
                         {0, nullptr}};

PyType_Spec g_spec = {"pycollectives._C.FastMethod", sizeof(FastMethodObject), 0,
                      Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
                          Py_TPFLAGS_DISALLOW_INSTANTIATION,
                      g_slots};

}  // namespace

void bind_fast_method(py::module_& m) {
  PyObject* type = PyType_FromSpec(&g_spec);
  if (type == nullptr) throw py::error_already_set();
  auto type_obj = py::reinterpret_steal<py::object>(type);
  m.add_object("FastMethod", type_obj);
  m.def(
      "fast_method",
      [type_obj](py::object fast, py::object method, py::object self_ref, py::object default_arg) {
        if (!PyWeakref_CheckRef(self_ref.ptr()))
          throw py::type_error("fast_method: self_ref must be a weakref.ref");
        auto* tp = reinterpret_cast<PyTypeObject*>(type_obj.ptr());
        PyObject* self = tp->tp_alloc(tp, 0);
        if (self == nullptr) throw py::error_already_set();
        auto* f = reinterpret_cast<FastMethodObject*>(self);
        f->vectorcall = fast_method_call;
        f->fast = fast.release().ptr();
        f->method = method.release().ptr();
        f->self_ref = self_ref.release().ptr();
        f->default_arg = default_arg.release().ptr();
        return py::reinterpret_steal<py::object>(self);
      },
      "fast_method(fast, method, self_ref, default_arg): a callable that runs fast(a, b) (b: "
      "default_arg when the caller gives only a) and returns None when that returns True, and "
      "method(self_ref(), *args, **kwargs) otherwise (keywords, other argument counts, or "
      "False).");
}

}  // namespace pyc
