// Communicator::split (MPI_Comm_split / ncclCommSplit): four all-gathers
// (five where a color spans hosts)
// over the parent, which every rank makes whatever fails, so that a rank that
// fails tells its peers why instead of leaving them to time out:
// 1. (color, key, rank);
// 2. the intents: the first member of each color on each host (its creator)
//    names the segment it will make; across hosts, the color's first member
//    adds the new communicator's random id and its settings, which bind every
//    host (as rank 0's do at init, rendezvous.py);
// 3. the creators' results: made, with the new listening address, or why not;
// 4. every member's: joined (opened its host's segment), with its address.
// 5. where a color spans hosts: every member's, after it made its own TCP
//    connections (connect_out): connected, or why not. Only then does a rank
//    wait for its peers' connections (connect_in), which have all been made.
// A color whose ranks span hosts makes a communicator like init's across
// hosts (shared memory within each host, TCP between them, the same
// hierarchical collectives), its handshakes carrying its own id; the
// addresses go through the parent, not the bootstrap store.
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>
#include <string>
#include <tuple>

#include "algo/algorithms.h"
#include "comm/communicator.h"
#include "core/error.h"
#include "core/sha256.h"

namespace pyc {
namespace {

// A rank's record in an exchange: a status byte, then text; an intent that
// spans hosts also carries the new communicator's id and settings (Intent, at
// the record's end).
constexpr size_t kRecord = 512;
constexpr char kNone = 0, kName = 'N', kJoined = 'J', kConnected = 'C', kFailed = 'E',
               kInvalid = 'V';

struct Intent {
  uint8_t comm_id[16];
  uint64_t slot_bytes, nslots, oneshot_bytes, algo;
};
constexpr size_t kIntentAt = kRecord - sizeof(Intent);

void put(std::vector<char>& rec, char status, const std::string& text) {
  std::fill(rec.begin(), rec.end(), 0);
  rec[0] = status;
  std::memcpy(rec.data() + 1, text.data(), std::min(text.size(), kIntentAt - 2));
}

std::string text(const std::vector<char>& all, int r) {
  const char* t = &all[kRecord * r + 1];
  return std::string(t, strnlen(t, kIntentAt - 2));
}

// Records in `rec` why this rank cannot go on (once: the first reason).
void put_error(std::vector<char>& rec, const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const InvalidArgument& x) {
    put(rec, kInvalid, x.what());
  } catch (const std::exception& x) {
    put(rec, kFailed, x.what());
  }
}

// Runs make(), returning its error (recorded in `rec`) if it throws; bad
// input (a setting, say) named with this rank and the operation (`where`).
template <class Make>
std::exception_ptr attempt(std::vector<char>& rec, const std::string& where, Make make) {
  try {
    try {
      make();
    } catch (const InvalidArgument& x) {
      std::string msg = x.what();
      const std::string lib = "pycollectives: ";
      if (msg.compare(0, lib.size(), lib) == 0) msg.erase(0, lib.size());
      throw InvalidArgument(where + msg);
    }
    return nullptr;
  } catch (...) {
    put_error(rec, std::current_exception());
    return std::current_exception();
  }
}

// Whether the ranks of some color (all_ids: every rank's color, key, rank) are on several hosts.
bool any_color_spans(const Topology& topo, const std::vector<int64_t>& all_ids) {
  const int n = static_cast<int>(all_ids.size() / 3);
  for (int r = 0; r < n; ++r)
    for (int q = 0; q < r; ++q)
      if (all_ids[3 * r] >= 0 && all_ids[3 * r] == all_ids[3 * q] && topo.host(r) != topo.host(q))
        return true;
  return false;
}

}  // namespace

std::shared_ptr<Communicator> Communicator::split(int color, int key, double timeout_s) {
  timeout_s = op_timeout(timeout_s, OpKind::kSplit);
  const int n = n_;
  // Every exchange is a collective of kind kSplit, so a rank that calls split
  // while another calls something else gets a mismatch error, not a hang.
  auto gather = [&](void* out, const void* in, size_t count, DataType dt) {
    OpSig sig{OpKind::kSplit, dt, ReduceOp::kSum, -1, count};
    collective(sig, timeout_s, false,
               [out, in, count](OpCtx& c) { ring_all_gather(c, in, out, count); });
  };
  std::vector<int64_t> ids = {color < 0 ? -1 : color, key, rank_}, all_ids(3 * n);
  gather(all_ids.data(), ids.data(), 3, DataType::kInt64);

  std::vector<std::tuple<int64_t, int64_t>> members;  // (key, old rank) of my color
  for (int r = 0; r < n; ++r)
    if (color >= 0 && all_ids[3 * r] == color) members.emplace_back(all_ids[3 * r + 1], r);
  std::sort(members.begin(), members.end());
  const int new_n = static_cast<int>(members.size());
  int new_rank = -1, creator = -1;  // creator: the first member on this host (old rank)
  std::vector<int> old(new_n), host_of(new_n);
  bool spans = false;
  for (int i = 0; i < new_n; ++i) {
    old[i] = static_cast<int>(std::get<1>(members[i]));
    host_of[i] = topo_.host(old[i]);
    spans = spans || host_of[i] != host_of[0];
    if (old[i] == rank_) new_rank = i;
    if (creator < 0 && topo_.same_host(old[i])) creator = old[i];
  }
  const bool member = new_rank >= 0, creates = member && creator == rank_;
  const int leader = member ? old[0] : -1;  // the new rank 0

  std::vector<char> mine(kRecord, kNone), all(kRecord * n, 0);
  std::exception_ptr err;  // why this rank cannot go on: raised after the last exchange
  const std::string me = "pycollectives: rank " + std::to_string(rank_) + ": split: ";
  auto who = [&] { return me + "rank "; };
  // Whether rank r's record says `want`; else err (once) says why not.
  auto need = [&](int r, char want, const std::string& what) {
    const char status = all[kRecord * r];
    if (err || status == want) return !err;
    const std::string msg =
        who() + std::to_string(r) + " " + what + " of color " + std::to_string(color) +
        (status == kNone ? std::string(": it failed before") : ": " + text(all, r));
    err = status == kInvalid ? std::make_exception_ptr(InvalidArgument(msg))
                             : std::make_exception_ptr(Error(msg));
    return false;
  };

  // 2. The intents.
  std::string name;
  if (creates)
    err = attempt(mine, me, [&] {
      Intent in{};
      if (spans && new_rank == 0) {
        random_bytes(in.comm_id, sizeof(in.comm_id));
        const CommConfig c = CommConfig::from_env().resolved(new_n);
        in.slot_bytes = c.slot_bytes;
        in.nslots = c.nslots;
        in.oneshot_bytes = c.oneshot_bytes;
        in.algo = static_cast<uint64_t>(c.algo);
      }
      put(mine, kName, ShmSegment::unique_name());
      std::memcpy(mine.data() + kIntentAt, &in, sizeof(in));
    });
  gather(all.data(), mine.data(), kRecord, DataType::kUInt8);
  HostSetup setup;
  if (member && need(creator, kName, "(the first on this host) could not name the segment") &&
      (!spans || need(leader, kName, "(the first) could not set up the new communicator"))) {
    name = text(all, creator);
    if (spans) {
      Intent in;
      std::memcpy(&in, &all[kRecord * leader + kIntentAt], sizeof(in));
      setup.topo = Topology::from_hosts(new_rank, host_of);
      std::memcpy(setup.comm_id, in.comm_id, sizeof(in.comm_id));
      // Its key, from this one's (whose connections carried the id): the
      // child's handshakes prove the parent's key too.
      setup.key = derive_key(net_->key().bytes, sizeof(net_->key().bytes), in.comm_id);
      setup.hint = net_hint_;
      setup.slot_bytes = in.slot_bytes;
      setup.nslots = static_cast<uint32_t>(in.nslots);
      setup.oneshot_bytes = in.oneshot_bytes;
      setup.algo = static_cast<Algo>(in.algo);
    }
  }
  // 3. The creators make the new segments (and, across hosts, listen).
  std::shared_ptr<Communicator> child;
  auto make = [&](bool create) {
    if (err) return put_error(mine, err);
    err = attempt(mine, me, [&] {
      child = std::make_shared<Communicator>(new_rank, new_n, name, create, CommConfig::from_env(),
                                             timeout_s_, kNoCheck, spans ? &setup : nullptr);
      put(mine, kJoined, child->net_address());
    });
  };
  if (creates) make(true);
  gather(all.data(), mine.data(), kRecord, DataType::kUInt8);
  // 4. The others open their host's segment, once its creator made it.
  if (member && !creates) {
    (void)need(creator, kJoined, "(the first on this host) could not create the new communicator");
    make(false);
  }
  if (err) put_error(mine, err);
  gather(all.data(), mine.data(), kRecord, DataType::kUInt8);
  std::vector<std::string> addrs;
  for (int i = 0; i < new_n; ++i) {
    if (old[i] != rank_) (void)need(old[i], kJoined, "could not join the new communicator");
    if (spans) addrs.push_back(text(all, old[i]));
  }
  // 5. Where a color spans hosts (every rank knows from the colors): each
  // member makes its own TCP connections, then every member learns whether
  // all could, so that a rank that could not connect is named on every rank
  // at once, not by the wait of the peer it should have connected to.
  if (any_color_spans(topo_, all_ids)) {
    if (!err && spans)
      err = attempt(mine, me, [&] {
        child->connect_out(kNoCheck, addrs);
        put(mine, kConnected, "");
      });
    if (err) {
      child.reset();  // its sockets close: a peer connecting to it fails at once
      put_error(mine, err);
    }
    gather(all.data(), mine.data(), kRecord, DataType::kUInt8);
    for (int i = 0; i < new_n && spans; ++i)
      if (old[i] != rank_)
        (void)need(old[i], kConnected,
                   "could not connect to the other hosts for the new communicator");
  }
  if (err) {
    child.reset();  // a creator's child, going, removes its segment
    std::rethrow_exception(err);
  }
  if (child && spans) child->connect_in(kNoCheck);
  if (child && !spans) child->connect(kNoCheck, addrs);
  return child;
}

}  // namespace pyc
