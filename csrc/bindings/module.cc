// pycollectives._C: the Python bindings. Buffers arrive as integer addresses
// with element counts (the Python layer validates torch tensors and NumPy
// arrays); every blocking call releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <functional>
#include <memory>
#include <tuple>

#include "algo/prims.h"
#include "bindings/convert.h"
#include "bindings/cuda_bindings.h"
#include "bindings/cuda_comm_bindings.h"
#include "bindings/errors.h"
#include "bindings/fast_path.h"
#include "bindings/reduce_bindings.h"
#include "bindings/tensor_view.h"
#include "comm/communicator.h"
#include "core/cpu_probe.h"
#include "core/error.h"
#include "core/sha256.h"
#include "core/topology.h"
#include "reduce/reduce.h"
#include "transport/cma/ptracer.h"

namespace py = pybind11;
using namespace pyc;

namespace {

OpKind op_kind_named(const std::string& name) {
  for (int k = 0; k < kNumOpKinds; ++k)
    if (name == op_kind_name(static_cast<OpKind>(k))) return static_cast<OpKind>(k);
  throw py::value_error("pycollectives: no operation named '" + name + "'");
}

// A C++ check that calls the Python callable `check` (None: no check) with
// the GIL; what it raises propagates through the core to the caller.
FunctionRef<void()> python_check(const py::object& check) {
  static const auto none = [] {};
  if (check.is_none()) return none;
  // The FunctionRef refers to this lambda for the call only: it lives in the
  // caller's frame through a thread_local, one per thread, rebound per call.
  thread_local std::function<void()> fn;
  fn = [&check] {
    py::gil_scoped_acquire gil;
    check();
  };
  return fn;
}

bool python_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// comm.stats(): the counters of each operation that ran.
py::dict stats_dict(const Communicator& c) {
  py::dict d;
  for (int k = 0; k < kNumOpKinds; ++k) {
    const OpStats& s = c.stats(static_cast<OpKind>(k));
    if (s.calls.load() == 0) continue;
    py::dict e;
    e["calls"] = s.calls.load();
    e["bytes_sent"] = s.bytes_sent.load();
    e["bytes_received"] = s.bytes_recv.load();
    e["bytes_out"] = s.bytes_out.load();  // this rank's own copies, on the path taken
    e["bytes_in"] = s.bytes_in.load();
    e["time_s"] = static_cast<double>(s.time_ns.load()) * 1e-9;
    py::dict paths;  // how the calls moved their bytes
    for (int p = 0; p < kNumPaths; ++p)
      if (s.paths[p].load() > 0) paths[path_name(static_cast<Path>(p))] = s.paths[p].load();
    e["paths"] = paths;
    e["taken_over"] = s.taken_over.load();  // single copy: chunks done for a peer
    d[op_kind_name(static_cast<OpKind>(k))] = e;
  }
  return d;
}

// comm.cma_tuning(): what the single-copy tuner timed and kept, per operation
// and size class.
py::dict cma_tuning_dict(const Communicator& c) {
  const auto ns = [](double v) -> py::object {
    return v < HUGE_VAL ? py::object(py::float_(v)) : py::object(py::none());
  };
  py::dict d;
  for (int k = 0; k < kNumOpKinds; ++k) {
    const std::vector<CmaTuner::Report> classes = c.cma_tuner().report(static_cast<OpKind>(k));
    if (classes.empty()) continue;
    py::dict e;
    for (const CmaTuner::Report& r : classes) {
      py::dict cls;
      cls["decided"] =
          r.decided < 0 ? py::object(py::none()) : py::object(py::str(r.decided ? "cma" : "slots"));
      cls["slots_ns_per_byte"] = ns(r.best[0]);
      cls["cma_ns_per_byte"] = ns(r.best[1]);
      e[py::int_(r.from_bytes)] = cls;
    }
    d[op_kind_name(static_cast<OpKind>(k))] = e;
  }
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "pycollectives core: shared-memory collectives on raw buffers";
  bind_reduce(m);
  bind_cuda(m);
  bind_cuda_comm(m);

  init_error_classes();
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error&) {  // the core's own; anything else: pybind11's translation
      set_python_error(std::current_exception());
    }
  });

  // A blocking call releases the GIL; while it sleeps, this hook lets Ctrl-C
  // through: on Python's main thread (the caller's, never the progress
  // thread), take the GIL and run the signal handlers.
  // Python runs signal handlers on its main thread only: any other thread
  // (the torch backend's completion thread waiting on a Work, say) returns
  // at once, without taking the GIL from the thread that runs Python.
  static const unsigned long main_thread =
      py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>();
  set_interrupt_check([]() -> bool {
    if (PyThread_get_thread_ident() != main_thread || PyGILState_GetThisThreadState() == nullptr ||
        python_finalizing())
      return false;
    PyGILState_STATE st = PyGILState_Ensure();
    const bool raised = PyErr_CheckSignals() != 0;
    if (raised) PyErr_Clear();  // re-raised as KeyboardInterrupt by the translator
    PyGILState_Release(st);
    return raised;
  });
  m.def("unique_segment_name", &ShmSegment::unique_name);
  m.def("host_id", &host_id,
        "This process's host id (PYCOLL_HOST_ID, else boot id, network namespace and /dev/shm): "
        "ranks with equal ids share memory, others talk over TCP");
  m.def(
      "resolved_config",
      [](int world_size) {
        // Rank 0's settings with their defaults for `world_size` ranks, which
        // bind every host's segment (rendezvous.py publishes them).
        const CommConfig c = CommConfig::from_env().resolved(world_size);
        return py::make_tuple(c.slot_bytes, c.nslots, c.oneshot_bytes,
                              static_cast<uint32_t>(c.algo));
      },
      py::arg("world_size"));
  m.def(
      "sha256",
      [](const py::bytes& data) {
        const std::string d = data;
        const Digest h = sha256(d.data(), d.size());
        return py::bytes(reinterpret_cast<const char*>(h.data()), h.size());
      },
      py::arg("data"), "SHA-256 of `data` (the core's own, used by the TCP handshakes).");
  m.def(
      "hmac_sha256",
      [](const py::bytes& key, const py::bytes& data) {
        const std::string k = key, d = data;
        const Digest h = hmac_sha256(k.data(), k.size(), d.data(), d.size());
        return py::bytes(reinterpret_cast<const char*>(h.data()), h.size());
      },
      py::arg("key"), py::arg("data"), "HMAC-SHA256 (the core's own, used by the TCP handshakes).");
  m.def("unlink_segment", &ShmSegment::unlink_name, py::arg("name"),
        "Removes a segment's name from /dev/shm (ENOENT: already gone).");
  m.def(
      "ptracer",
      [] {
        bool applied = false;
        const long wanted = ptracer_wanted(&applied);
        return std::make_pair(wanted, applied);
      },
      "(tracer, applied): what this process's communicators call for under Yama (0 none, -1 "
      "any process of the user, else a pid), and whether it is in force (ptrace_scope 1)");
  m.def("cpu_round_trip_ns", &cpu_round_trip_ns, py::arg("cpu_a"), py::arg("cpu_b"),
        py::arg("round_trips") = 20000, py::call_guard<py::gil_scoped_release>());
  bind_tensor_view(m);
  bind_fast_path(m);
  bind_fast_method(m);

  py::class_<Work, std::shared_ptr<Work>>(m, "Work")
      .def(
          "wait", [](Work& w, double timeout) { return w.wait(timeout); },
          py::arg("timeout") = -1.0, py::call_guard<py::gil_scoped_release>())
      .def("is_completed", &Work::is_completed)
      .def_property_readonly("source", &Work::source);

  // A symmetric window's local buffer, exported as bytes (torch.frombuffer
  // keeps this object, hence the mapping, alive as long as the tensor).
  py::class_<ShmWindow, std::shared_ptr<ShmWindow>>(m, "Window", py::buffer_protocol())
      .def_property_readonly("nbytes", &ShmWindow::bytes)
      .def_property_readonly(
          "ptr", [](const ShmWindow& w) { return reinterpret_cast<uintptr_t>(w.local()); })
      .def_buffer([](ShmWindow& w) {
        return py::buffer_info(w.local(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(w.bytes())}, {1});
      });

  // A communicator's single-copy tuner on its own (comm/cma_choice.h), for
  // tests of its decisions on given timings.
  py::class_<CmaTuner>(m, "CmaTuner")
      .def(py::init<bool>(), py::arg("enabled") = true)
      .def("choose",  // (prefers single copy, timed)
           [](CmaTuner& t, const std::string& kind, size_t total) {
             const CmaTuner::Choice c = t.choose(op_kind_named(kind), total);
             return std::make_pair(c.cma, c.timed);
           })
      .def("record", [](CmaTuner& t, const std::string& kind, size_t total, bool ran_cma,
                        uint64_t ns) { t.record(op_kind_named(kind), total, ran_cma, ns); })
      .def("decided", [](const CmaTuner& t, const std::string& kind, size_t total) {
        return t.decided(op_kind_named(kind), total);
      });

  using C = Communicator;
  using G = py::call_guard<py::gil_scoped_release>;
  py::class_<C, std::shared_ptr<C>>(m, "Communicator")
      .def(py::init([](int rank, int n, const std::string& name, bool creator, double timeout,
                       const py::object& check, const py::object& hosts, const py::bytes& comm_id,
                       const std::string& hint, const py::object& config, const py::bytes& secret) {
             const CommConfig cfg = CommConfig::from_env();
             std::unique_ptr<HostSetup> setup;
             if (!hosts.is_none()) {  // ranks on several hosts (rendezvous.py)
               setup = std::make_unique<HostSetup>();
               const auto host_of = hosts.cast<std::vector<int>>();
               if (static_cast<int>(host_of.size()) != n || rank < 0 || rank >= n)
                 throw py::value_error("pycollectives: init: hosts must list world_size hosts");
               setup->topo = Topology::from_hosts(rank, host_of);
               const std::string id = comm_id;
               if (id.size() != sizeof(setup->comm_id))
                 throw py::value_error("pycollectives: init: comm_id must be 16 bytes");
               std::memcpy(setup->comm_id, id.data(), id.size());
               std::string key = secret;  // the job's (rendezvous.py): never empty
               if (key.size() < 16)
                 throw py::value_error(
                     "pycollectives: init: the job's secret must be 16 bytes or more");
               setup->key = derive_key(key.data(), key.size(), setup->comm_id);
               wipe(key.data(), key.size());
               setup->hint = hint;
               const auto [slot, nslots, oneshot, algo] =
                   config.cast<std::tuple<size_t, uint32_t, size_t, uint32_t>>();
               if (slot < 64 || slot > kMaxSlotBytes || nslots < kMinSlots || nslots > kMaxNSlots ||
                   oneshot > kMaxOneShotBytes || algo > static_cast<uint32_t>(Algo::kCma))
                 throw py::value_error("pycollectives: init: rank 0's settings are out of range");
               setup->slot_bytes = slot;
               setup->nslots = nslots;
               setup->oneshot_bytes = oneshot;
               setup->algo = static_cast<Algo>(algo);
             }
             py::gil_scoped_release nogil;
             return std::make_shared<C>(rank, n, name, creator, cfg, timeout, python_check(check),
                                        setup.get());
           }),
           py::arg("rank"), py::arg("world_size"), py::arg("name"), py::arg("creator"),
           py::arg("timeout"), py::arg("check") = py::none(), py::arg("hosts") = py::none(),
           py::arg("comm_id") = py::bytes(), py::arg("hint") = "", py::arg("config") = py::none(),
           py::arg("secret") = py::bytes())
      .def(
          "connect",
          [](C& c, const py::object& check, const std::vector<std::string>& addrs) {
            py::gil_scoped_release nogil;
            c.connect(python_check(check), addrs);
          },
          py::arg("check") = py::none(), py::arg("addrs") = std::vector<std::string>{})
      .def_property_readonly("default_timeout", &C::default_timeout)
      .def("set_default_timeout", &C::set_default_timeout, py::arg("timeout"))
      .def_property_readonly("multi_host", &C::multi_host)
      .def_property_readonly("net_address", &C::net_address)
      .def_property_readonly("host_of", [](const C& c) { return c.topology().host_of(); })
      .def("net_info",
           [](const C& c) {
             py::dict d;
             d["address"] = c.net_address();
             d["interface"] = c.net_interface();
             d["rejected"] = c.net_rejected();
             d["listening"] = c.net_listening();
             d["control_buffer_peak"] = c.net_control_buffer_peak();
             const auto [sent, recvd] = c.net_bytes();
             d["bytes_sent"] = sent;
             d["bytes_received"] = recvd;
             return d;
           })
      .def("close", &C::close, G())
      .def("abort", &C::abort, py::arg("message"), G())
      .def_property_readonly("aborted", &C::is_aborted)
      .def("set_any_thread", &C::set_any_thread, py::arg("any"))
      .def_property_readonly("rank", &C::rank)
      .def_property_readonly("world_size", &C::world_size)
      .def_property_readonly("algo", &C::algo_name)
      .def_property_readonly("cma", &C::cma_enabled)
      .def(
          "all_reduce",
          [](C& c, uintptr_t buf, size_t n, int dt, int op, bool async, double to) {
            return c.all_reduce(address(buf), n, checked_dtype(dt, "Communicator"),
                                checked_op(op, "Communicator"), async, to);
          },
          G())
      .def(
          "reduce_scatter",
          [](C& c, uintptr_t out, uintptr_t in, size_t n, int dt, int op, bool async, double to) {
            return c.reduce_scatter(address(out), address(in), n, checked_dtype(dt, "Communicator"),
                                    checked_op(op, "Communicator"), async, to);
          },
          G())
      .def(
          "all_gather",
          [](C& c, uintptr_t out, uintptr_t in, size_t n, int dt, bool async, double to) {
            return c.all_gather(address(out), address(in), n, checked_dtype(dt, "Communicator"),
                                async, to);
          },
          G())
      .def(
          "broadcast",
          [](C& c, uintptr_t buf, size_t n, int dt, int root, bool async, double to) {
            return c.broadcast(address(buf), n, checked_dtype(dt, "Communicator"), root, async, to);
          },
          G())
      .def(
          "reduce",
          [](C& c, uintptr_t buf, size_t n, int dt, int op, int root, bool async, double to) {
            return c.reduce(address(buf), n, checked_dtype(dt, "Communicator"),
                            checked_op(op, "Communicator"), root, async, to);
          },
          G())
      .def(
          "all_to_all",
          [](C& c, uintptr_t out, uintptr_t in, size_t n, int dt, bool async, double to) {
            return c.all_to_all(address(out), address(in), n, checked_dtype(dt, "Communicator"),
                                async, to);
          },
          G())
      .def(
          "send",
          [](C& c, uintptr_t buf, size_t n, int dt, int peer, bool async, double to) {
            return c.send(address(buf), n, checked_dtype(dt, "Communicator"), peer, async, to);
          },
          G())
      .def(
          "recv",
          [](C& c, uintptr_t buf, size_t n, int dt, int peer, bool async, double to) {
            return c.recv(address(buf), n, checked_dtype(dt, "Communicator"), peer, async, to);
          },
          G())
      .def("recv_any",  // (Work or None, the sender's rank when synchronous)
           [](C& c, uintptr_t buf, size_t n, int dt, bool async, double to) {
             const DataType d = checked_dtype(dt, "Communicator");
             int source = -1;
             std::shared_ptr<Work> w;
             {
               py::gil_scoped_release nogil;
               w = c.recv_any(address(buf), n, d, async, to, &source);
             }
             return std::make_pair(w, source);
           })
      .def("batch_p2p",
           // items: (is_send, ptr, count, dtype, peer) tuples
           [](C& c, const std::vector<std::tuple<bool, uintptr_t, size_t, int, int>>& items,
              bool async, double to) {
             std::vector<Communicator::P2PItem> v;
             v.reserve(items.size());
             for (const auto& [is_send, p, n, dt, peer] : items)
               v.push_back({is_send, address(p), n, checked_dtype(dt, "Communicator"), peer});
             py::gil_scoped_release nogil;
             return c.batch_p2p(std::move(v), async, to);
           })
      .def("alloc_window", &C::alloc_window, py::arg("nbytes"), py::arg("timeout"), G())
      .def("barrier", &C::barrier, G())
      .def("split", &C::split, G())
      // Recovery (comm/recovery.cc): agree returns (value, verdict by rank),
      // shrink (communicator, survivors' old ranks, verdict by rank).
      .def("revoke", &C::revoke, py::arg("message"), G())
      .def(
          "agree",
          [](C& c, uint32_t flag, double timeout) {
            C::Agreement a = c.agree(flag, timeout);
            return std::make_tuple(a.value, std::vector<int>(a.verdicts.begin(), a.verdicts.end()));
          },
          py::arg("flag"), py::arg("timeout"), G())
      .def(
          "shrink",
          [](C& c, double timeout) {
            C::Shrunk s = c.shrink(timeout);
            return std::make_tuple(s.comm, s.survivors,
                                   std::vector<int>(s.verdicts.begin(), s.verdicts.end()));
          },
          py::arg("timeout"), G())
      .def("why_gone", &C::why_gone, py::arg("rank"))
      .def("fence", &C::fence, py::arg("why"), G())
      .def("stats", &stats_dict)
      .def("cma_tuning", &cma_tuning_dict);
}
