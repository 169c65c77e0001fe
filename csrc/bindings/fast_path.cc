// The synchronous fast path (see fast_path.h): the FastPath type, whose
// methods run collectives on torch CPU tensors described by view_tensor.
#include "bindings/fast_path.h"

#include <vector>

#include "bindings/convert.h"
#include "bindings/errors.h"
#include "bindings/tensor_view.h"
#include "comm/communicator.h"
#include "core/types.h"
#include "core/wait.h"

namespace py = pybind11;

namespace pyc {

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

// Whether two tensors of one dtype share no byte (an empty one shares none).
bool disjoint(const TensorView& a, const TensorView& b) {
  const size_t es = dtype_size(static_cast<DataType>(a.dtype));
  return a.numel == 0 || b.numel == 0 || a.ptr + a.numel * es <= b.ptr ||
         b.ptr + b.numel * es <= a.ptr;
}

// The fast paths' pair of tensors: `big` holds nranks blocks of `small`'s
// size and dtype, and the two are disjoint or `small` is block `rank` of `big`
// (the in-place layout). False for anything else.
bool fast_pair(PyObject* big, PyObject* small, int nranks, int rank, TensorView* b, TensorView* s) {
  if (!view_tensor(big, b) || !view_tensor(small, s) || b->dtype != s->dtype ||
      b->numel != s->numel * static_cast<size_t>(nranks))
    return false;
  const size_t es = dtype_size(static_cast<DataType>(s->dtype));
  return disjoint(*b, *s) || s->ptr == b->ptr + static_cast<size_t>(rank) * s->numel * es;
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

// Lets go of the GIL the first time the operation would stop running (a wait
// that has spun its fill, a hand-off to the progress thread): see BlockHook.
struct ReleaseGilOnBlock final : BlockHook {
  PyThreadState* saved = nullptr;
  void before_block() override {
    if (saved == nullptr) saved = PyEval_SaveThread();
  }
};

// Messages up to this size keep the GIL while their wait spins: one handshake
// through the one-shot areas' first line, ~1 us, where releasing and taking
// the GIL back costs a tenth of it. Larger ones (copies that take longer, with
// no wait to hook) release it first, as run_released.
constexpr size_t kKeepGilBytes = 40;

// As run_released, but releases the GIL only before the operation blocks,
// for a small message on one host (its waits are all spin-then-yield ones,
// which call the hook; across hosts the sockets' waits do not).
template <class Op>
PyObject* run_small(Op op) {
  std::exception_ptr err;
  ReleaseGilOnBlock gil;
  BlockHook* prev = set_block_hook(&gil);
  try {
    op();
  } catch (...) {
    err = std::current_exception();
  }
  set_block_hook(prev);
  if (gil.saved != nullptr) PyEval_RestoreThread(gil.saved);
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
  const auto dt = static_cast<DataType>(v.dtype);
  auto run = [&] { c.all_reduce(address(v.ptr), v.numel, dt, op, false, -1.0); };
  if (v.numel * dtype_size(dt) <= kKeepGilBytes && !c.multi_host()) return run_small(run);
  return run_released(run);
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

// A rank argument in [0, nranks) other than `self_rank` (-1: any), or false.
bool fast_rank(PyObject* arg, const Communicator& c, int self_rank, int* out) {
  if (!PyLong_Check(arg) || PyBool_Check(arg)) return false;
  const long r = PyLong_AsLong(arg);
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  if (r < 0 || r >= c.world_size() || r == self_rank) return false;
  *out = static_cast<int>(r);
  return true;
}

// broadcast(tensor, src) -> bool: as all_reduce.
PyObject* fast_broadcast(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (!nargs_is("broadcast", nargs, 2)) return nullptr;
  Communicator& c = comm_of(self);
  TensorView v;
  int root;
  if (!fast_rank(args[1], c, -1, &root) || !view_tensor(args[0], &v)) Py_RETURN_FALSE;
  return run_released([&] {
    c.broadcast(address(v.ptr), v.numel, static_cast<DataType>(v.dtype), root, false, -1.0);
  });
}

// reduce(tensor, dst, op) -> bool: as all_reduce.
PyObject* fast_reduce(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (!nargs_is("reduce", nargs, 3)) return nullptr;
  Communicator& c = comm_of(self);
  TensorView v;
  int root;
  ReduceOp op;
  if (!fast_rank(args[1], c, -1, &root) || !fast_op(args[2], &op) || !view_tensor(args[0], &v))
    Py_RETURN_FALSE;
  return run_released([&] {
    c.reduce(address(v.ptr), v.numel, static_cast<DataType>(v.dtype), op, root, false, -1.0);
  });
}

// all_to_all(output, input) -> bool: as all_reduce; the two tensors must have
// the same dtype and size, a multiple of world_size, and must not overlap.
PyObject* fast_all_to_all(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (!nargs_is("all_to_all", nargs, 2)) return nullptr;
  Communicator& c = comm_of(self);
  TensorView out, in;
  if (!view_tensor(args[0], &out) || !view_tensor(args[1], &in) || out.dtype != in.dtype ||
      out.numel != in.numel || in.numel % static_cast<size_t>(c.world_size()) != 0 ||
      !disjoint(out, in))
    Py_RETURN_FALSE;
  return run_released([&] {
    c.all_to_all(address(out.ptr), address(in.ptr), in.numel / c.world_size(),
                 static_cast<DataType>(in.dtype), false, -1.0);
  });
}

// send(tensor, dst) and recv(tensor, src) -> bool: as all_reduce; the peer is
// another rank.
template <bool kSend>
PyObject* fast_p2p(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (!nargs_is(kSend ? "send" : "recv", nargs, 2)) return nullptr;
  Communicator& c = comm_of(self);
  TensorView v;
  int peer;
  if (!fast_rank(args[1], c, c.rank(), &peer) || !view_tensor(args[0], &v)) Py_RETURN_FALSE;
  return run_released([&] {
    const auto dt = static_cast<DataType>(v.dtype);
    if (kSend)
      c.send(address(v.ptr), v.numel, dt, peer, false, -1.0);
    else
      c.recv(address(v.ptr), v.numel, dt, peer, false, -1.0);
  });
}

// batch_p2p(ops) -> bool: as all_reduce, for a list or tuple of ("send",
// tensor, dst) and ("recv", tensor, src) tuples. Whether sends to this rank
// pair with receives from it, the core checks (and raises).
PyObject* fast_batch_p2p(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (!nargs_is("batch_p2p", nargs, 1)) return nullptr;
  Communicator& c = comm_of(self);
  PyObject* ops = args[0];
  if (!PyList_Check(ops) && !PyTuple_Check(ops)) Py_RETURN_FALSE;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(ops);
  std::vector<Communicator::P2PItem> items(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* op = PySequence_Fast_GET_ITEM(ops, i);
    if (!PyTuple_Check(op) || PyTuple_GET_SIZE(op) != 3) Py_RETURN_FALSE;
    PyObject* kind = PyTuple_GET_ITEM(op, 0);
    if (!PyUnicode_Check(kind)) Py_RETURN_FALSE;
    const bool send = PyUnicode_CompareWithASCIIString(kind, "send") == 0;
    if (!send && PyUnicode_CompareWithASCIIString(kind, "recv") != 0) Py_RETURN_FALSE;
    TensorView v;
    int peer;
    if (!fast_rank(PyTuple_GET_ITEM(op, 2), c, -1, &peer) ||
        !view_tensor(PyTuple_GET_ITEM(op, 1), &v))
      Py_RETURN_FALSE;
    items[i] = {send, address(v.ptr), v.numel, static_cast<DataType>(v.dtype), peer};
  }
  return run_released([&] { c.batch_p2p(std::move(items), false, -1.0); });
}

void fast_path_dealloc(PyObject* self) {
  PyTypeObject* type = Py_TYPE(self);
  Py_XDECREF(reinterpret_cast<FastPathObject*>(self)->owner);
  type->tp_free(self);
  Py_DECREF(type);  // heap types own a reference from each instance
}

// A METH_FASTCALL function as the PyCFunction a PyMethodDef holds.
template <class F>
PyCFunction fastcall(F* f) {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(f));
}

PyMethodDef g_methods[] = {
    {"all_reduce", fastcall(fast_all_reduce), METH_FASTCALL, "all_reduce(tensor, op) -> bool"},
    {"reduce_scatter", fastcall(fast_reduce_scatter), METH_FASTCALL,
     "reduce_scatter(output, input, op) -> bool"},
    {"all_gather", fastcall(fast_all_gather), METH_FASTCALL, "all_gather(output, input) -> bool"},
    {"broadcast", fastcall(fast_broadcast), METH_FASTCALL, "broadcast(tensor, src) -> bool"},
    {"reduce", fastcall(fast_reduce), METH_FASTCALL, "reduce(tensor, dst, op) -> bool"},
    {"all_to_all", fastcall(fast_all_to_all), METH_FASTCALL, "all_to_all(output, input) -> bool"},
    {"send", fastcall(fast_p2p<true>), METH_FASTCALL, "send(tensor, dst) -> bool"},
    {"recv", fastcall(fast_p2p<false>), METH_FASTCALL, "recv(tensor, src) -> bool"},
    {"batch_p2p", fastcall(fast_batch_p2p), METH_FASTCALL,
     "batch_p2p([(\"send\" or \"recv\", tensor, peer), ...]) -> bool"},
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
