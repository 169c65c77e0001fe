// The synchronous fast path (see fast_path.h): tensor introspection through
// the CPython C API, and the FastPath type whose methods run it.
#include "bindings/fast_path.h"

#include <vector>

#include "bindings/convert.h"
#include "bindings/dlpack_abi.h"
#include "bindings/errors.h"
#include "comm/communicator.h"
#include "core/types.h"

namespace py = pybind11;

namespace pyc {
namespace {

// What the fast path reads of torch (strong references, set once by Python).
// An exact torch.Tensor is described by one call through DLPack's exchange
// table where torch publishes one (torch.Tensor.__dlpack_c_exchange_api__):
// no allocation, no Python objects. Otherwise five attributes per tensor:
// five calls into torch, each with its error and warning handlers, ~0.33 us a
// tensor on this VM: 0.66 us of a 2-rank 16-byte reduce-scatter's 1.6 us.
// For an exact torch.Tensor the descriptors found once on the type are called
// directly; anything else (a subclass, which may override them) goes through
// ordinary lookups.
struct TorchAttr {
  PyObject* name = nullptr;
  PyObject* descr = nullptr;  // torch.Tensor.<name>
};
struct Torch {
  PyObject* tensor_type = nullptr;
  TorchAttr dtype, is_cpu, is_contiguous, data_ptr, numel, is_neg;
  std::vector<PyObject*> dtypes;                  // torch.float32, ... in DataType order
  dlpack::TensorFromPyObject describe = nullptr;  // from the exchange table, if any
};
Torch g_torch;

// The exchange table's describe function, or null where `tensor_type` has no
// table of DLPack ABI major version 1 with one.
dlpack::TensorFromPyObject exchange_describe(PyObject* tensor_type) {
  PyObject* cap = PyObject_GetAttrString(tensor_type, "__dlpack_c_exchange_api__");
  void* api = cap != nullptr ? PyCapsule_GetPointer(cap, dlpack::kExchangeCapsule) : nullptr;
  Py_XDECREF(cap);  // the table lives as long as the process (DLPack requires it)
  if (api == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  const auto* t = static_cast<const dlpack::ExchangeApi*>(api);
  return t->header.version.major == dlpack::kMajor ? t->dltensor_from_py_object_no_sync : nullptr;
}

// DataType of a DLPack dtype, or -1.
int dlpack_dtype(dlpack::DataType d) {
  struct Entry {
    uint8_t code, bits;
    DataType type;
  };
  static constexpr Entry kTypes[] = {
      {dlpack::kFloat, 32, DataType::kFloat32}, {dlpack::kFloat, 64, DataType::kFloat64},
      {dlpack::kFloat, 16, DataType::kFloat16}, {dlpack::kBfloat, 16, DataType::kBFloat16},
      {dlpack::kInt, 8, DataType::kInt8},       {dlpack::kUInt, 8, DataType::kUInt8},
      {dlpack::kInt, 32, DataType::kInt32},     {dlpack::kInt, 64, DataType::kInt64}};
  if (d.lanes != 1) return -1;
  for (const Entry& e : kTypes)
    if (e.code == d.code && e.bits == d.bits) return static_cast<int>(e.type);
  return -1;
}

// view_tensor through the exchange table: false (error cleared) where the
// call fails or the tensor is not a contiguous CPU one of a supported dtype.
// Contiguous as torch means it: every dimension of size > 1 has the compact
// row-major stride; an empty tensor is contiguous.
bool view_dlpack(PyObject* obj, TensorView* out) {
  dlpack::Tensor d;
  if (g_torch.describe(obj, &d) != 0) {
    PyErr_Clear();
    return false;
  }
  const int code = dlpack_dtype(d.dtype);
  if (code < 0 || d.device.device_type != dlpack::kCPU || d.ndim < 0) return false;
  int64_t numel = 1, stride = 1;
  bool compact = true;
  for (int i = d.ndim - 1; i >= 0; --i) {
    const int64_t size = d.shape[i];
    if (d.strides != nullptr && size != 1 && d.strides[i] != stride) compact = false;
    stride *= size;
    numel *= size;
  }
  if (!compact && numel != 0) return false;
  out->ptr = reinterpret_cast<uintptr_t>(d.data) + d.byte_offset;
  out->numel = static_cast<size_t>(numel);
  out->dtype = code;
  return true;
}

bool exact_tensor(PyObject* obj) {
  return Py_TYPE(obj) == reinterpret_cast<PyTypeObject*>(g_torch.tensor_type);
}

// obj.<a> for a data attribute; nullptr (error cleared) on failure.
PyObject* get_attr(PyObject* obj, const TorchAttr& a) {
  descrgetfunc get = Py_TYPE(a.descr)->tp_descr_get;
  PyObject* r = exact_tensor(obj) && get != nullptr ? get(a.descr, obj, g_torch.tensor_type)
                                                    : PyObject_GetAttr(obj, a.name);
  if (r == nullptr) PyErr_Clear();
  return r;
}

// obj.<m>() for a method; nullptr (error cleared) on failure.
PyObject* call0(PyObject* obj, const TorchAttr& m) {
  PyObject* r = exact_tensor(obj) ? PyObject_Vectorcall(m.descr, &obj, 1, nullptr)
                                  : PyObject_CallMethodNoArgs(obj, m.name);
  if (r == nullptr) PyErr_Clear();
  return r;
}

}  // namespace

void set_torch(py::handle tensor_type, py::sequence dtypes) {
  auto attr = [&](const char* name) {
    TorchAttr a;
    a.name = PyUnicode_InternFromString(name);
    if (a.name == nullptr) throw py::error_already_set();
    a.descr = PyObject_GetAttr(tensor_type.ptr(), a.name);
    if (a.descr == nullptr) throw py::error_already_set();
    return a;
  };
  Torch t;
  t.tensor_type = tensor_type.inc_ref().ptr();
  t.dtype = attr("dtype");
  t.is_cpu = attr("is_cpu");
  t.is_contiguous = attr("is_contiguous");
  t.data_ptr = attr("data_ptr");
  t.numel = attr("numel");
  t.is_neg = attr("is_neg");
  for (py::handle d : dtypes) t.dtypes.push_back(d.inc_ref().ptr());
  t.describe = exchange_describe(t.tensor_type);
  g_torch = std::move(t);  // once per process: nothing released
}

namespace {

// A tensor with torch's negative bit set (a lazily negated view, such as
// z.conj().imag) stores the negation of its values: its bytes are not what it
// holds. True also when asking fails.
bool negated(PyObject* obj) {
  PyObject* neg = call0(obj, g_torch.is_neg);
  Py_XDECREF(neg);
  return neg != Py_False;
}

}  // namespace

bool view_tensor(PyObject* obj, TensorView* out) {
  const Torch& t = g_torch;
  if (t.tensor_type == nullptr) return false;
  if (t.describe != nullptr && exact_tensor(obj)) return view_dlpack(obj, out) && !negated(obj);
  PyObject* dt = get_attr(obj, t.dtype);
  if (dt == nullptr) return false;
  int code = -1;
  for (size_t i = 0; i < t.dtypes.size(); ++i)
    if (t.dtypes[i] == dt) code = static_cast<int>(i);
  Py_DECREF(dt);
  if (code < 0) return false;
  PyObject* cpu = get_attr(obj, t.is_cpu);
  const bool is_cpu = cpu == Py_True;
  Py_XDECREF(cpu);
  if (!is_cpu) return false;
  PyObject* contig = call0(obj, t.is_contiguous);
  const bool is_contig = contig == Py_True;
  Py_XDECREF(contig);
  if (!is_contig) return false;
  PyObject* p = call0(obj, t.data_ptr);
  PyObject* n = call0(obj, t.numel);
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
  return ok && !negated(obj);
}

// ---- the FastPath type ----
//
// A plain CPython type with METH_FASTCALL methods: a call costs one vectorcall,
// where pybind11's dispatcher builds an argument tuple, walks its overloads and
// casts every argument (0.17-0.2 us more per call, measured on one rank: a
// sixth of an 8-byte all-reduce between two).

namespace {

struct FastPathObject {
  PyObject ob_base;    // PyObject_HEAD
  PyObject* owner;     // the pybind11 Communicator, kept alive by this object
  Communicator* comm;  // owner's C++ object
};

Communicator& comm_of(PyObject* self) { return *reinterpret_cast<FastPathObject*>(self)->comm; }

// The fast paths' op argument: a valid ReduceOp code, or false (the Python
// path then handles it, errors included).
bool fast_op(PyObject* op, ReduceOp* out) {
  if (!PyLong_Check(op) || PyBool_Check(op)) return false;
  const long code = PyLong_AsLong(op);
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  if (!valid_reduce_op(static_cast<int>(code))) return false;
  *out = static_cast<ReduceOp>(code);
  return true;
}

// The fast paths' pair of tensors: `big` holds nranks blocks of `small`'s
// size and dtype, and the two are disjoint or `small` is block `rank` of `big`
// (the in-place layout). False for anything else.
bool fast_pair(PyObject* big, PyObject* small, int nranks, int rank, TensorView* b, TensorView* s) {
  if (!view_tensor(big, b) || !view_tensor(small, s) || b->dtype != s->dtype ||
      b->numel != s->numel * static_cast<size_t>(nranks))
    return false;
  const size_t es = dtype_size(static_cast<DataType>(s->dtype));
  const uintptr_t b_end = b->ptr + b->numel * es, s_end = s->ptr + s->numel * es;
  const bool disjoint = s->numel == 0 || s_end <= b->ptr || b_end <= s->ptr;
  return disjoint || s->ptr == b->ptr + static_cast<size_t>(rank) * s->numel * es;
}

// Runs `op` without the GIL; returns Py_True, or nullptr with the Python error
// set if it threw.
template <class Op>
PyObject* run_released(Op op) {
  std::exception_ptr err;
  PyThreadState* ts = PyEval_SaveThread();
  try {
    op();
  } catch (...) {
    err = std::current_exception();
  }
  PyEval_RestoreThread(ts);
  if (err) {
    set_python_error(err);
    return nullptr;
  }
  Py_RETURN_TRUE;
}

bool nargs_is(const char* name, Py_ssize_t nargs, Py_ssize_t want) {
  if (nargs == want) return true;
  PyErr_Format(PyExc_TypeError, "FastPath.%s takes %zd arguments (%zd given)", name, want, nargs);
  return false;
}

// all_reduce(tensor, op) -> bool: a synchronous all-reduce of a torch CPU
// tensor with the default timeout; False (nothing done) when the tensor or op
// needs the Python path.
PyObject* fast_all_reduce(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (!nargs_is("all_reduce", nargs, 2)) return nullptr;
  TensorView v;
  ReduceOp op;
  if (!fast_op(args[1], &op) || !view_tensor(args[0], &v)) Py_RETURN_FALSE;
  Communicator& c = comm_of(self);
  return run_released([&] {
    c.all_reduce(address(v.ptr), v.numel, static_cast<DataType>(v.dtype), op, false, -1.0);
  });
}

// reduce_scatter(output, input, op) -> bool: as all_reduce.
PyObject* fast_reduce_scatter(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (!nargs_is("reduce_scatter", nargs, 3)) return nullptr;
  Communicator& c = comm_of(self);
  TensorView out, in;
  ReduceOp op;
  if (!fast_op(args[2], &op) || !fast_pair(args[1], args[0], c.world_size(), c.rank(), &in, &out))
    Py_RETURN_FALSE;
  return run_released([&] {
    c.reduce_scatter(address(out.ptr), address(in.ptr), out.numel, static_cast<DataType>(out.dtype),
                     op, false, -1.0);
  });
}

// all_gather(output, input) -> bool: as all_reduce.
PyObject* fast_all_gather(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (!nargs_is("all_gather", nargs, 2)) return nullptr;
  Communicator& c = comm_of(self);
  TensorView out, in;
  if (!fast_pair(args[0], args[1], c.world_size(), c.rank(), &out, &in)) Py_RETURN_FALSE;
  return run_released([&] {
    c.all_gather(address(out.ptr), address(in.ptr), in.numel, static_cast<DataType>(in.dtype),
                 false, -1.0);
  });
}

// view_tensor(obj) -> (address, numel, dtype code) or None: view_tensor for
// the Python layer's own checks (a METH_O function: no pybind11 dispatch).
PyObject* py_view_tensor(PyObject*, PyObject* obj) {
  TensorView v;
  if (!view_tensor(obj, &v)) Py_RETURN_NONE;
  return Py_BuildValue("(Kni)", static_cast<unsigned long long>(v.ptr),
                       static_cast<Py_ssize_t>(v.numel), v.dtype);
}

PyMethodDef g_view_tensor_def = {
    "view_tensor", py_view_tensor, METH_O,
    "view_tensor(obj) -> (address, numel, dtype code) for a contiguous CPU torch tensor of a "
    "supported dtype, else None"};

void fast_path_dealloc(PyObject* self) {
  PyTypeObject* type = Py_TYPE(self);
  Py_XDECREF(reinterpret_cast<FastPathObject*>(self)->owner);
  type->tp_free(self);
  Py_DECREF(type);  // heap types own a reference from each instance
}

PyMethodDef g_methods[] = {
    {"all_reduce", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_all_reduce)),
     METH_FASTCALL, "all_reduce(tensor, op) -> bool"},
    {"reduce_scatter",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_reduce_scatter)),
     METH_FASTCALL, "reduce_scatter(output, input, op) -> bool"},
    {"all_gather", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_all_gather)),
     METH_FASTCALL, "all_gather(output, input) -> bool"},
    {nullptr, nullptr, 0, nullptr}};

PyType_Slot g_slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(fast_path_dealloc)},
    {Py_tp_methods, g_methods},
    {Py_tp_doc, const_cast<char*>("Synchronous collectives on torch CPU tensors, called "
                                  "without pybind11 (see fast_path.h).")},
    {0, nullptr}};

// Made only by fast_path() (FastPath() from Python raises TypeError): every
// instance has its communicator.
PyType_Spec g_spec = {"pycollectives._C.FastPath", sizeof(FastPathObject), 0,
                      Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION, g_slots};

}  // namespace

void bind_fast_path(py::module_& m) {
  PyObject* type = PyType_FromSpec(&g_spec);
  if (type == nullptr) throw py::error_already_set();
  auto type_obj = py::reinterpret_steal<py::object>(type);
  m.add_object("FastPath", type_obj);
  PyObject* view = PyCFunction_NewEx(&g_view_tensor_def, nullptr, m.attr("__name__").ptr());
  if (view == nullptr) throw py::error_already_set();
  m.add_object("view_tensor", py::reinterpret_steal<py::object>(view));
  m.def(
      "dlpack_exchange", [] { return g_torch.describe != nullptr; },
      "Whether view_tensor describes exact torch.Tensor objects through torch's DLPack "
      "exchange table (else through five attribute reads).");
  m.def(
      "fast_path",
      [type_obj](py::object core) {
        if (!py::isinstance<Communicator>(core))
          throw py::type_error("fast_path: expects a pycollectives._C.Communicator");
        Communicator* c = core.cast<Communicator*>();
        auto* tp = reinterpret_cast<PyTypeObject*>(type_obj.ptr());
        PyObject* self = tp->tp_alloc(tp, 0);
        if (self == nullptr) throw py::error_already_set();
        auto* f = reinterpret_cast<FastPathObject*>(self);
        f->owner = core.release().ptr();
        f->comm = c;
        return py::reinterpret_steal<py::object>(self);
      },
      "The FastPath of a Communicator (keeps it alive).");
}

}  // namespace pyc
