// Tensor introspection through the CPython C API (see tensor_view.h): one
// call through torch's DLPack exchange table for an exact torch.Tensor where
// torch publishes one, attribute reads otherwise.
#include "bindings/tensor_view.h"

#include <vector>

#include "bindings/dlpack_abi.h"
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
// Either way one more call, is_neg, ~0.1 us (see negated below).
// For an exact torch.Tensor the descriptors found once on the type are called
// directly; anything else (a subclass, which may override them) goes through
// ordinary lookups.
struct TorchAttr {
  PyObject* name = nullptr;
  PyObject* descr = nullptr;  // torch.Tensor.<name>
};
struct Torch {
  PyObject* tensor_type = nullptr;
  TorchAttr dtype, is_cpu, is_contiguous, data_ptr, numel, is_neg, untyped_storage;
  TorchAttr storage_nbytes, storage_data_ptr;     // of torch.UntypedStorage
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

void set_torch(py::handle tensor_type, py::sequence dtypes, py::handle storage_type) {
  auto attr = [&](const char* name, py::handle type) {
    TorchAttr a;
    a.name = PyUnicode_InternFromString(name);
    if (a.name == nullptr) throw py::error_already_set();
    a.descr = PyObject_GetAttr(type.ptr(), a.name);
    if (a.descr == nullptr) throw py::error_already_set();
    return a;
  };
  Torch t;
  t.tensor_type = tensor_type.inc_ref().ptr();
  t.dtype = attr("dtype", tensor_type);
  t.is_cpu = attr("is_cpu", tensor_type);
  t.is_contiguous = attr("is_contiguous", tensor_type);
  t.data_ptr = attr("data_ptr", tensor_type);
  t.numel = attr("numel", tensor_type);
  t.is_neg = attr("is_neg", tensor_type);
  t.untyped_storage = attr("untyped_storage", tensor_type);
  t.storage_nbytes = attr("nbytes", storage_type);
  t.storage_data_ptr = attr("data_ptr", storage_type);
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

// m(obj) for a method descriptor m of obj's exact type, as an unsigned
// integer; false (error cleared) on failure.
bool call_u64(PyObject* obj, const TorchAttr& m, uint64_t* out) {
  PyObject* r = PyObject_Vectorcall(m.descr, &obj, 1, nullptr);
  if (r == nullptr) {
    PyErr_Clear();
    return false;
  }
  *out = PyLong_Check(r) ? PyLong_AsUnsignedLongLong(r) : 0;
  const bool ok = PyLong_Check(r) && !PyErr_Occurred();
  PyErr_Clear();
  Py_DECREF(r);
  return ok;
}

// Whether the tensor's `bytes` at `ptr` lie inside its storage: torch's
// metadata (sizes, offset) survives a storage resized under it (FSDP frees
// a parameter by resizing its storage to 0), the memory does not. False also
// when asking fails.
bool in_storage(PyObject* obj, uintptr_t ptr, size_t bytes) {
  if (bytes == 0) return true;
  if (ptr == 0) return false;  // resized to 0: no memory at all (cheap, common)
  PyObject* st = call0(obj, g_torch.untyped_storage);
  if (st == nullptr) return false;
  uint64_t base = 0, nbytes = 0;
  const bool ok = call_u64(st, g_torch.storage_data_ptr, &base) &&
                  call_u64(st, g_torch.storage_nbytes, &nbytes);
  Py_DECREF(st);
  return ok && ptr >= base && ptr - base <= nbytes && bytes <= nbytes - (ptr - base);
}

}  // namespace

bool view_tensor(PyObject* obj, TensorView* out) {
  const Torch& t = g_torch;
  if (t.tensor_type == nullptr) return false;
  // An exact tensor described through DLPack: a storage freed by resizing it
  // to 0 (FSDP) leaves no memory at all, which the null address says at no
  // cost. Asking torch for the storage's size costs three calls, ~0.16 us,
  // 18% of a 2-rank 8-byte all-reduce on this project's VM: a storage shrunk
  // to a smaller non-zero size is caught on the Python path (every other
  // call, and every non-exact tensor here), and in this one is trusted as
  // torch's own kernels trust it.
  if (t.describe != nullptr && exact_tensor(obj))
    return view_dlpack(obj, out) && (out->ptr != 0 || out->numel == 0) && !negated(obj);
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
  return ok && !negated(obj) &&
         in_storage(obj, out->ptr, out->numel * dtype_size(static_cast<DataType>(out->dtype)));
}

namespace {

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

}  // namespace

void bind_tensor_view(py::module_& m) {
  m.def("set_torch", &set_torch);
  PyObject* view = PyCFunction_NewEx(&g_view_tensor_def, nullptr, m.attr("__name__").ptr());
  if (view == nullptr) throw py::error_already_set();
  m.add_object("view_tensor", py::reinterpret_steal<py::object>(view));
  m.def(
      "dlpack_exchange", [] { return g_torch.describe != nullptr; },
      "Whether view_tensor describes exact torch.Tensor objects through torch's DLPack "
      "exchange table (else through five attribute reads).");
}

}  // namespace pyc
