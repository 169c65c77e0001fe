// C++ exceptions of the core as Python exceptions (see errors.h).
#include "bindings/errors.h"

#include <pybind11/pybind11.h>

#include "core/error.h"

namespace py = pybind11;

namespace pyc {
namespace {

struct ErrorClasses {
  PyObject* timeout = nullptr;
  PyObject* peer = nullptr;
  PyObject* mismatch = nullptr;
  PyObject* aborted = nullptr;
  PyObject* revoked = nullptr;
  PyObject* base = nullptr;
};
ErrorClasses g_cls;  // strong references, kept for the life of the process

PyObject* error_class(const py::module_& errors, const char* name) {
  return py::object(errors.attr(name)).release().ptr();
}

}  // namespace

void init_error_classes() {
  if (g_cls.base != nullptr) return;
  py::module_ errors = py::module_::import("pycollectives.errors");
  g_cls.timeout = error_class(errors, "CollectiveTimeout");
  g_cls.peer = error_class(errors, "PeerFailure");
  g_cls.mismatch = error_class(errors, "CollectiveMismatch");
  g_cls.aborted = error_class(errors, "CommunicatorAborted");
  g_cls.revoked = error_class(errors, "CommunicatorRevoked");
  g_cls.base = error_class(errors, "PyCollectivesError");
}

void set_python_error(std::exception_ptr p) {
  try {
    std::rethrow_exception(p);
  } catch (const InvalidArgument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const TimeoutError& e) {
    PyErr_SetString(g_cls.timeout, e.what());
  } catch (const PeerFailure& e) {
    PyErr_SetString(g_cls.peer, e.what());
  } catch (const Mismatch& e) {
    PyErr_SetString(g_cls.mismatch, e.what());
  } catch (const Interrupted& e) {
    PyErr_SetString(PyExc_KeyboardInterrupt, e.what());
  } catch (const Revoked& e) {
    PyErr_SetString(g_cls.revoked, e.what());
  } catch (const Aborted& e) {
    PyErr_SetString(g_cls.aborted, e.what());
  } catch (const Error& e) {
    PyErr_SetString(g_cls.base, e.what());
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "pycollectives: unknown C++ exception");
  }
}

}  // namespace pyc
