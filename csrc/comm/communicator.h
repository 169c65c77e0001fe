// A communicator: the ranks of one group, their shared-memory segment (one
// per host: the ranks of a host share one), the links between them (shared
// memory within a host, TCP between hosts), and the operations on those
// links. Like NCCL's API, operations take pointers, element counts, a dtype
// and an op.
#pragma once

#include <pthread.h>
#include <sys/types.h>

#include <array>
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "algo/algorithms.h"
#include "algo/hierarchical.h"
#include "comm/cma_choice.h"
#include "comm/control.h"
#include "comm/progress.h"
#include "core/clock.h"
#include "core/function_ref.h"
#include "core/process.h"
#include "core/topology.h"
#include "core/types.h"
#include "transport/shm/shm_fifo.h"
#include "transport/shm/shm_segment.h"
#include "transport/shm/shm_window.h"
#include "transport/tcp/tcp_net.h"

namespace pyc {

class CudaPath;      // cuda/cuda_path.h: the CUDA transport of a communicator
class PtracerGrant;  // transport/cma/ptracer.h

// A check that never fails (Communicator's default `check`).
inline const auto kNoCheck = [] {};

enum class Algo : uint32_t { kAuto = 0, kRing = 1, kOneShot = 2, kCma = 3 };

// Sizes chosen by the rank that creates the segment; the others read them.
struct CommConfig {
  size_t slot_bytes = 0;     // 0: default for the world size
  uint32_t nslots = 0;       // 0: default
  size_t oneshot_bytes = 0;  // 0: default
  Algo algo = Algo::kAuto;
  // Outputs of at least this many bytes (on this rank) are written with
  // streaming stores (output_store); a local choice, ranks may differ.
  size_t stream_bytes = size_t{32} << 20;
  // Whether single copy is timed against the slots where it can win (CmaTuner);
  // a local choice.
  bool cma_tune = true;
  // How long a wait yields before it sleeps, in microseconds (wait.h,
  // WaitMonitor::yield_us); a local choice.
  uint32_t yield_us = 1000;
  // PYCOLL_SLOT_BYTES, PYCOLL_NSLOTS, PYCOLL_ONESHOT_BYTES, PYCOLL_ALGO,
  // PYCOLL_STREAM_BYTES, PYCOLL_CMA_TUNE, PYCOLL_YIELD_US
  static CommConfig from_env();
  // These settings with the segment's defaults for `world_size` ranks in
  // place of the zeros (what a creator makes, and what binds every host).
  CommConfig resolved(int world_size) const;
};

// What a communicator whose ranks span hosts is made with (rendezvous.py):
// where every rank is, the communicator's id (which every TCP handshake
// carries) and key (which every handshake proves: tcp_auth.h), the store's
// address (the default interface is the one that reaches it), and rank 0's
// settings, which bind every host's segment.
struct HostSetup {
  Topology topo;
  uint8_t comm_id[16] = {};
  NetKey key;
  std::string hint;
  size_t slot_bytes = 0, oneshot_bytes = 0;
  uint32_t nslots = 0;
  Algo algo = Algo::kAuto;
};

struct OpStats {
  // bytes_sent / bytes_recv: a collective's traffic by definition (comm/traffic.h),
  // a message's bytes; bytes_out / bytes_in: what this rank itself copied to and
  // from its peers on the path taken.
  std::atomic<uint64_t> calls{0}, bytes_sent{0}, bytes_recv{0}, bytes_out{0}, bytes_in{0};
  std::atomic<uint64_t> time_ns{0}, taken_over{0};
  std::array<std::atomic<uint64_t>, kNumPaths> paths{};  // calls by Path
};

enum class AbortKind : int32_t { kNone = 0, kError, kTimeout, kPeerFailure, kMismatch, kRevoked };

class Communicator final : public Links, public NetHost, public HierHost {
 public:
  // The creator (rank 0 of the group, or of its host when `hosts` is given)
  // makes segment `name`; the others of its host open it (only a segment of
  // this user, readable by no other: see shm_segment.h). `check` runs about
  // every 10 ms while a rank waits for the others (init passes one that
  // raises a peer's published error, or names a rank that died before it
  // attached); the waits are bounded by timeout_s. With `hosts` (ranks on
  // several hosts), also listens for the ranks of the other hosts
  // (net_address(), to publish before connect()).
  Communicator(int rank, int world_size, const std::string& name, bool creator,
               const CommConfig& cfg, double timeout_s, FunctionRef<void()> check = kNoCheck,
               const HostSetup* hosts = nullptr);
  ~Communicator() override;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // Waits until every rank of this host has mapped the segment, then
  // removes its name (every rank: a creator that dies then leaves nothing
  // behind); then agrees with the peers on single copy (agree_cma; one host
  // only). Across hosts, `addrs` holds every rank's net_address(): the
  // control connections are made (tcp_net.h). Raises PeerFailure for a rank
  // that dies meanwhile, and whatever `check` raises.
  void connect(FunctionRef<void()> check = kNoCheck, const std::vector<std::string>& addrs = {});
  // connect() in two steps (split across hosts agrees over the parent between
  // them, so that a rank whose connections fail is named on every rank at
  // once): connect_out() waits for this host's ranks and, across hosts, makes
  // this rank's own control connections, raising if one fails; connect_in()
  // waits for the peers' connections (across hosts) or agrees on single copy.
  void connect_out(FunctionRef<void()> check, const std::vector<std::string>& addrs);
  void connect_in(FunctionRef<void()> check);
  // Releases the communicator (idempotent). Pending operations run on, but
  // one that a peer stays away from, idle, for a second (a point-to-point
  // one: that waits a second) is aborted instead of waiting for its
  // timeout, and so are the ones after it (OpMonitor::check_closing). Returns "<operation>:
  // <error>" for each pending operation that failed. In a forked child, releases this process's
  // copy without touching the parent's threads or shared state.
  std::vector<std::string> close();
  // Aborts the communicator on every rank with `msg` (the first abort wins):
  // their pending and later operations raise CommunicatorAborted carrying it.
  // For a rank that stops for a reason of its own (an interrupt in Python
  // code) so that its peers say why instead of waiting. No-op once closed.
  void abort(const std::string& msg);
  // Whether an abort (an error, a timeout, a dead peer, abort()) is set.
  bool is_aborted() const { return aborted(); }
  // Whether operations may be issued by any thread: the caller serializes
  // them (the torch backend does, under its lock). Otherwise the first
  // thread to issue one is the only one that may (check_issue).
  void set_any_thread(bool any) { any_thread_ = any; }

  int rank() const { return rank_; }
  int world_size() const { return n_; }
  const Topology& topology() const { return topo_; }
  bool multi_host() const { return topo_.multi_host(); }
  // This rank's listening address ("ip:port") and its interface, across hosts.
  std::string net_address() const { return net_ ? net_->address() : ""; }
  std::string net_interface() const { return net_ ? net_->interface() : ""; }
  // Connections refused by this rank's listener (bad handshakes, evicted, expired).
  uint64_t net_rejected() const { return net_ ? net_->rejected() : 0; }
  bool net_listening() const { return net_ && net_->listening(); }
  size_t net_control_buffer_peak() const { return net_ ? net_->control_buffer_peak() : 0; }
  // Payload bytes sent to and received from other hosts.
  std::pair<uint64_t, uint64_t> net_bytes() const {
    return net_ ? net_->bytes() : std::pair<uint64_t, uint64_t>{0, 0};
  }
  double default_timeout() const { return timeout_s_; }
  const char* algo_name() const;
  // Whether single-copy reads and writes of peers' plain buffers (CMA) are available.
  bool cma_enabled() const { return cma_; }

  // timeout_s < 0: the communicator's default. Return nullptr unless async.
  std::shared_ptr<Work> all_reduce(void* buf, size_t count, DataType dt, ReduceOp op, bool async,
                                   double timeout_s);
  std::shared_ptr<Work> reduce_scatter(void* out, const void* in, size_t count, DataType dt,
                                       ReduceOp op, bool async, double timeout_s);
  std::shared_ptr<Work> all_gather(void* out, const void* in, size_t count, DataType dt, bool async,
                                   double timeout_s);
  std::shared_ptr<Work> broadcast(void* buf, size_t count, DataType dt, int root, bool async,
                                  double timeout_s);
  std::shared_ptr<Work> reduce(void* buf, size_t count, DataType dt, ReduceOp op, int root,
                               bool async, double timeout_s);
  std::shared_ptr<Work> all_to_all(void* out, const void* in, size_t count, DataType dt, bool async,
                                   double timeout_s);
  std::shared_ptr<Work> send(const void* buf, size_t count, DataType dt, int peer, bool async,
                             double timeout_s);
  std::shared_ptr<Work> recv(void* buf, size_t count, DataType dt, int peer, bool async,
                             double timeout_s);
  // Receives the next message any peer sends to this rank (MPI_ANY_SOURCE):
  // the first peer whose message has arrived, after the operations issued
  // before it. Synchronous: returns nullptr and sets *source to the sender;
  // async: the Work's source() names it once complete.
  std::shared_ptr<Work> recv_any(void* buf, size_t count, DataType dt, bool async, double timeout_s,
                                 int* source);
  std::shared_ptr<Work> barrier(bool async, double timeout_s);
  // Sends and receives that progress together; a send to this rank pairs
  // with the next receive from this rank. Matched in order per pair of ranks.
  struct P2PItem {
    bool send;
    void* buf;
    size_t count;
    DataType dtype;
    int peer;
  };
  std::shared_ptr<Work> batch_p2p(std::vector<P2PItem> items, bool async, double timeout_s);
  // Collective: every rank allocates a `bytes`-byte buffer that every peer maps
  // (a symmetric window). An all-reduce whose buffer, a reduce-scatter whose
  // input or an all-gather whose output lies in a window at the same offset on
  // every rank runs in place across the buffers (direct.cc).
  std::shared_ptr<ShmWindow> alloc_window(size_t bytes, double timeout_s);
  // Collective; returns nullptr for color < 0.
  std::shared_ptr<Communicator> split(int color, int key, double timeout_s);

  // ---- recovery from a lost rank (comm/recovery.cc; ranks on one host) ----
  // Revokes the communicator on every rank (MPIX_Comm_revoke): their pending
  // and later operations raise Revoked carrying `msg` (the first abort wins).
  // agree() and shrink() still work on it.
  void revoke(const std::string& msg);
  // What a fault-tolerant agreement decided, alike on every survivor: the
  // AND of the survivors' flags, and every rank's verdict (AgreeVerdict).
  struct Agreement {
    uint32_t value = 0;
    std::vector<uint8_t> verdicts;  // by rank
    std::string name;               // a fresh segment name (shrink's)
    uint32_t number = 0;            // which agreement of this communicator
  };
  // Collective over the ranks not failed in an earlier agreement
  // (MPIX_Comm_agree): works on an aborted or revoked communicator, and
  // whoever dies meanwhile. A rank that has not entered it within timeout_s
  // (stopped, stuck) is declared failed (unresponsive) and fenced: when it
  // comes back, its agree() and shrink() raise, and so does any operation on
  // this communicator, which the survivors revoke once a rank failed.
  Agreement agree(uint32_t flag, double timeout_s);
  // Collective (MPIX_Comm_shrink): a new communicator of the ranks that did
  // not fail, renumbered in order; `survivors` their ranks here. Agrees on the
  // failed ranks, builds it, and agrees that every survivor could; a rank
  // that fails meanwhile restarts the round without it. Bounded: each round
  // takes at most about three timeouts, and each one but the last loses a rank.
  struct Shrunk {
    std::shared_ptr<Communicator> comm;
    std::vector<int> survivors;
    std::vector<uint8_t> verdicts;
  };
  Shrunk shrink(double timeout_s);
  // Across hosts, agree() and shrink() run through the job's store
  // (pycollectives/_recovery_hosts.py), which asks these of the core: why
  // rank p is gone, or "" while it is not known to be (its robust mutex on
  // this host, its connections on another); and fences this rank (its
  // operations on this communicator raise `why` from now on).
  std::string why_gone(int p);
  void fence(const std::string& why);
  // The default timeout of later operations (shrink and grow across hosts
  // give the new communicator its parent's, not the time they were bounded
  // by); before any operation is issued on it. Raises InvalidArgument unless > 0.
  void set_default_timeout(double timeout_s);

  const OpStats& stats(OpKind k) const { return stats_[static_cast<int>(k)]; }
  // This rank's single-copy tuner, for comm.cma_tuning().
  const CmaTuner& cma_tuner() const { return cma_tuner_; }

  // Links
  SendConn& send_to(int peer) override { return *send_[peer]; }
  RecvConn& recv_from(int peer) override { return *recv_[peer]; }
  [[noreturn]] void tag_mismatch(int peer, const SlotTag& got, const SlotTag& want) override;

  // NetHost: a control frame of another host's rank (control.cc).
  void on_control(int peer, uint32_t type, const char* body, uint32_t bytes) override;

 private:
  friend class OpMonitor;
  friend class CudaPath;
  using Body = std::function<void(OpCtx&)>;
  using BodyRef = FunctionRef<void(OpCtx&)>;

  void check_rank(int r, const char* what, OpKind kind) const;
  // Every issue of an operation: the communicator is open, this process made
  // it (not a forked child) and this thread may issue (set_any_thread).
  void check_issue(OpKind kind) {
    const auto self = static_cast<uint64_t>(pthread_self());
    if (closed_.load(std::memory_order_relaxed) || fork_gen_ != fork_generation() ||
        (!any_thread_ && issuer_.load(std::memory_order_relaxed) != self))
      check_issue_slow(kind, self);
  }
  // The first issue records its thread; anything else raises.
  void check_issue_slow(OpKind kind, uint64_t self);
  // timeout_s < 0: the default; NaN: InvalidArgument naming the operation.
  double op_timeout(double timeout_s, OpKind kind) const;
  // Rank r's control block: in the segment for a rank of this host, else this
  // process's copy of what its host last said of it (peer_status).
  RankCtl* ctl(int r) const { return ctls_[r]; }
  // Across hosts: asks the other hosts where their ranks are (for a
  // timeout's verdict and close()'s), bounded by `wait`.
  void refresh_remote(std::chrono::milliseconds wait);
  // Why rank p of another host was not heard from in the last refresh (its
  // own silence, or its host's link's), for a timeout's verdict.
  std::string silent_note(int p);
  // Whether ctl(r) says where rank r is: this host's, or its host answered.
  bool heard(int r) const {
    return topo_.same_host(r) || ctls_[r]->attached.load(std::memory_order_acquire) != 0;
  }
  // Maps and checks the segment of a rank other than the creator.
  void open_segment(const std::string& name, double timeout_s, FunctionRef<void()> check);
  // connect(): waits until ready(p) for every rank p, naming `what` in a
  // timeout; raises for a peer that died (once attached), an abort, and
  // whatever `check` raises.
  template <class Ready>
  void wait_all(const char* what, Clock::time_point deadline, FunctionRef<void()> check,
                Ready ready);
  // recovery.cc: the checks of agree() and shrink() (`what`), their timeout
  // (< 0: the default), one round of agreement, and its record in AgreeCtl.
  double recovery_timeout(double timeout_s, const char* what) const;
  void check_recovery(const char* what) const;
  void propose(uint32_t number, uint32_t flag);
  Agreement adopt(uint32_t number);
  [[noreturn]] void fenced(const std::string& why);
  // The collective point of alloc_window: every rank reached it (kind
  // kAllocShared, so a rank in another collective gets a mismatch).
  void sync(const OpSig& sig, double timeout_s);
  // Broadcast: every rank announced operation c.tag.seq alike (its root
  // included), else CollectiveMismatch on every rank. A rank that only sends
  // (the root) would otherwise return before anyone could tell it.
  void confirm_alike(OpCtx& c);
  // A single-copy collective failed here: waits (bounded) until no peer
  // still copies into this rank's buffers for it (RankCtl::cma_busy).
  void wait_peers_copied(uint32_t seq);
  // A forked child's close(): forgets what belongs to the parent.
  void release_in_child();
  // Queues a collective: numbered at issue, announced and run in order.
  // `where`: the buffer's window placement (see SigEntry::where), announced with the op.
  // `in`, `out`: the buffers peers read and write with CMA (SigEntry::addr, out), likewise.
  // A synchronous one with nothing pending runs on the caller's thread and
  // allocates nothing; `body` is copied only into a queued operation.
  template <class F>
  std::shared_ptr<Work> collective(const OpSig& sig, double timeout_s, bool async, F&& body,
                                   uint64_t where = 0, const void* in = nullptr,
                                   const void* out = nullptr);
  void run_collective(const OpSig& sig, uint32_t seq, double timeout_s, BodyRef body,
                      uint64_t where, uint64_t addr, uint64_t out);
  // A send or a receive, numbered with the next message to or from `peer`
  // when it runs (body sees it in c.tag.seq).
  std::shared_ptr<Work> point_to_point(const OpSig& sig, int peer, double timeout_s, bool async,
                                       Body body);
  // Runs one operation: its monitor and context, the abort of every rank if it
  // fails, its statistics. Point to point (collective false): a send, a receive
  // or a batch of them, numbered per pair of ranks and not announced (peers
  // need not take part).
  void run_op(const OpSig& sig, uint32_t seq, double timeout_s, bool collective, BodyRef body);
  void announce(uint32_t seq, const OpSig& sig, uint64_t where, uint64_t addr, uint64_t out);
  // A one-shot operation that posts `bytes` is likely next: asks for this
  // rank's flag line of the next operation's area in writable state now, so
  // that the peers' copy of it is invalidated while the call does its checks
  // and bookkeeping, not when it posts (a hint: nothing depends on it).
  void prefetch_oneshot(size_t bytes) const {
    if (bytes > 0 && bytes <= oneshot_.small_bytes && n_ > 1 && n_ == nlocal_)
      __builtin_prefetch(oneshot_.flag[(seq_.load(std::memory_order_relaxed) + 1) & 1][rank_], 1);
  }
  // The window holding [p, p + n) on this rank and its placement word, if any.
  std::shared_ptr<ShmWindow> find_window(const void* p, size_t n, uint64_t* where);
  // After every peer started operation c.tag.seq: whether all announced the
  // same operation at the same placement `where` (then direct.cc applies).
  bool symmetric(OpCtx& c, uint64_t where);
  // After every peer started operation c.tag.seq: whether all announced the
  // same operation and `also(entry)` holds for every rank's announcement.
  template <class Also>
  bool announced_alike(OpCtx& c, Also also);
  // Whether the operation runs on the windows (direct.cc): `win` holds its
  // buffer of `bytes` per rank, and every rank placed it alike (symmetric).
  bool direct(OpCtx& c, const ShmWindow* win, size_t bytes, uint64_t where);
  // The buffers at placement `where` in every rank's copy of `win`, and the counters.
  DirectView direct_view(const ShmWindow& win, uint64_t where);
  // Whether this rank would take single copy (cma.cc) for an operation of
  // `kind` moving `total` bytes (cma_total; a batch: the bytes of its sends of
  // single-copy size), its buffer at window placement `where` (or 0): CMA
  // works between every pair of ranks and PYCOLL_ALGO=cma, or the size lies in
  // a band where single copy can win and this rank's tuner prefers it
  // (comm/cma_choice.h); and whether to time it for the tuner. run_collective
  // announces no address when it is not preferred.
  CmaTuner::Choice cma_choice(OpKind kind, size_t total, uint64_t where);
  // Whether operation c.tag.seq runs single-copy: every rank announced the
  // same operation and an address (waits for the peers' announcements only
  // if this rank announced one).
  bool cma(OpCtx& c);
  CmaView cma_view(uint32_t seq);
  // What a point-to-point message with `peer` needs for single copy: its
  // process and the pair's acknowledgement counter (sender to receiver).
  P2PCma p2p_cma(int peer, bool send);
  // How the operation's copies write into the caller's output: streamed past
  // the caches from stream_bytes_ of output on this rank.
  Store output_store(const OpSig& sig) const;
  // Whether this rank would use CMA (PYCOLL_CMA, PYCOLL_ALGO, world size).
  bool cma_wanted() const;
  // Agrees with the peers on cma_ (in connect()): every rank wants it, every
  // peer runs as this user (checked here, through /proc, with a pidfd), each
  // lets its peers access it (PtracerGrant), and every rank can read and
  // write every peer's probe word.
  void agree_cma(Clock::time_point deadline, FunctionRef<void()> check);
  // Waits until every peer has started collective `seq` (or a later one).
  void wait_started(uint32_t seq, WaitMonitor& mon);
  void account(const OpSig& sig, const OpCtx& c, uint64_t ns);

  // Abort state shared by all ranks: the first error wins (control.cc).
  void set_abort(AbortKind kind, const std::string& msg);
  [[noreturn]] void throw_abort() const;
  bool aborted() const;
  // Across hosts (control.cc): sends an error to every control peer but
  // `except`; raises here an error another host reported (the first error
  // wins), returning whether it was taken (then it is passed on); where this
  // host's ranks are (another host's question); another host's answer about
  // one of its ranks.
  void send_abort(int kind, int from, const std::string& msg, int except = -1);
  bool adopt_abort(int kind, int from, const std::string& msg);
  std::vector<CtlStatusEntry> host_status();
  void peer_status(const CtlStatusEntry& e);
  // After refresh_remote: StatusQuery::silent_link.
  int silent_link(int p) { return query_.silent_link(topo_, p); }
  // Peer liveness through its robust mutex (a rank of this host) or its
  // connections (another host's): returns a description if gone.
  std::string peer_gone(int peer);

  // ---- across hosts: what the hierarchical schedules ask (algo/hierarchical.h) ----
  // Whether this operation of `bytes` per rank takes the one-shot path; if so,
  // first waits until every peer has started operation seq-1.
  bool oneshot(OpCtx& c, size_t bytes) override;
  const OneShotAreas& oneshot_areas() const override { return oneshot_; }
  // Records that peers (or just `only`) were seen in operation `seq`.
  void saw_flags(uint32_t seq, int only = -1) override;
  char* scratch(size_t bytes) override;
  void confirm_hosts(OpCtx& c) override;
  // Where this communicator's hierarchical schedules run.
  Hier hier() { return Hier{topo_, *this, algo_ == Algo::kRing, layout_.oneshot_bytes}; }

  int rank_, n_;
  Topology topo_;
  int nlocal_ = 1;           // ranks on this host
  std::vector<int> locals_;  // their global ranks (this one's among them)
  double timeout_s_;
  bool creator_;
  uint64_t fork_gen_;                 // fork_generation() at construction
  bool any_thread_ = false;           // set_any_thread
  std::atomic<uint64_t> issuer_{0};   // pthread_self() of the first issue (0: none yet)
  std::atomic<bool> closing_{false};  // close() has begun: see OpMonitor::check_closing
  std::mutex abort_mu_;               // set_abort: this process's threads, one at a time
  std::shared_ptr<InterruptHook> interrupt_hook_;
  ShmSegment seg_;
  ShmLayout layout_;
  SegmentHeader* hdr_ = nullptr;
  Algo algo_ = Algo::kAuto;
  size_t stream_bytes_ = 0;                        // CommConfig::stream_bytes
  uint32_t yield_us_ = 1000;                       // CommConfig::yield_us
  std::vector<RankCtl*> ctls_;                     // see ctl()
  std::vector<std::unique_ptr<RankCtl>> mirrors_;  // other hosts' ranks, as last heard
  std::vector<std::unique_ptr<ShmSendConn>> shm_send_;
  std::vector<std::unique_ptr<ShmRecvConn>> shm_recv_;
  std::vector<SendConn*> send_;  // by rank: shared memory within the host, TCP across
  std::vector<RecvConn*> recv_;
  StatusQuery query_;  // refresh_remote's questions (before net_: its thread answers into it)
  std::unique_ptr<TcpNet> net_;           // across hosts
  Clock::time_point connect_deadline_{};  // connect_out()'s, for connect_in()
  std::string net_hint_;  // HostSetup::hint, for the communicators split from this one
  std::vector<char> scratch_;
  OneShotAreas oneshot_{};
  std::vector<uint32_t> known_started_;  // lower bounds of peers' `started`
  // Point-to-point messages sent to / received from each peer, numbered when
  // they run (operations run one at a time, in issue order), so that a
  // receive from any peer takes the number of the peer it finds.
  std::vector<uint32_t> p2p_sent_, p2p_recvd_;
  int any_next_ = 0;      // where recv_any starts looking (round robin)
  int spin_polls_ = 256;  // see WaitMonitor::spin_polls
  int max_spin_polls_ = 256;
  std::vector<unsigned char> shares_cpu_;  // see WaitMonitor::shares_cpu (set at connect)
  bool spin_only_ = false;                 // see WaitMonitor::spin_only (set at connect)
  // Collectives issued: assigned under the engine's lock, read without it only
  // for a hint (prefetch_oneshot).
  std::atomic<uint32_t> seq_{0};
  std::array<OpStats, kNumOpKinds> stats_;
  std::unique_ptr<ProgressEngine> engine_;
  std::atomic<bool> closed_{false};
  std::mutex windows_mu_;
  std::vector<std::weak_ptr<ShmWindow>> windows_;
  std::atomic<bool> any_window_{false};  // set by the first alloc_window: find_window's lock
  int next_window_ = 0;                  // windows allocated (collectively, so equal on all ranks)
  // Created by the first CUDA operation (cuda/); released by close() once the
  // engine has stopped. Stays null in a CPU-only build.
  std::shared_ptr<CudaPath> cuda_;
  // recovery.cc: agreements entered, the verdicts of the latest (empty: none
  // yet, every rank alive), and why this rank was fenced (empty: it was not).
  uint32_t agreements_ = 0;
  std::vector<uint8_t> verdicts_;
  std::string fenced_;
  bool cma_ = false;             // agreed by every rank in connect()
  std::vector<pid_t> peer_pid_;  // checked in connect(): CMA copies go to these only
  std::unique_ptr<PtracerGrant> ptracer_;
  CmaTuner cma_tuner_;                   // where this rank prefers single copy
  uint64_t cma_token_ = 0;               // what peers' probes read here
  std::unique_ptr<char[]> cma_scratch_;  // n chunks, made by the first CMA operation
  std::mutex cuda_mu_;                   // guards the creation of cuda_
};

template <class F>
std::shared_ptr<Work> Communicator::collective(const OpSig& sig, double timeout_s, bool async,
                                               F&& body, uint64_t where, const void* in,
                                               const void* out) {
  check_issue(sig.kind);
  timeout_s = op_timeout(timeout_s, sig.kind);
  const uint64_t a = cma_ ? reinterpret_cast<uintptr_t>(in) : 0;
  const uint64_t o = cma_ ? reinterpret_cast<uintptr_t>(out) : 0;
  auto next = [this] {
    const uint32_t s = seq_.load(std::memory_order_relaxed) + 1;
    seq_.store(s, std::memory_order_relaxed);
    return s;
  };
  auto run = [this, sig, timeout_s, where, a, o](uint32_t seq, BodyRef b) {
    run_collective(sig, seq, timeout_s, b, where, a, o);
  };
  if (!async && engine_->run_if_idle(next, [&](uint32_t seq) { run(seq, body); })) return nullptr;
  return engine_->submit(
      next, [run, body = std::forward<F>(body)](uint32_t seq) { run(seq, body); }, async,
      op_kind_name(sig.kind));
}

}  // namespace pyc
