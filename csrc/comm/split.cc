// Communicator::split (MPI_Comm_split / ncclCommSplit): three all-gathers
// over the parent: (color, key); the leaders' new segment names, or why a
// leader could not make one; whether each member could join it. A rank that
// fails thus tells its peers why, instead of leaving them to time out.
#include <algorithm>
#include <cstring>
#include <exception>
#include <string>
#include <tuple>

#include "algo/algorithms.h"
#include "comm/communicator.h"
#include "core/error.h"

namespace pyc {
namespace {

// A rank's record in an exchange: a status byte, then text.
constexpr size_t kRecord = 512;
constexpr char kNone = 0, kName = 'N', kJoined = 'J', kFailed = 'E', kInvalid = 'V';

void put(std::vector<char>& rec, char status, const std::string& text) {
  std::fill(rec.begin(), rec.end(), 0);
  rec[0] = status;
  std::memcpy(rec.data() + 1, text.data(), std::min(text.size(), kRecord - 2));
}

std::string text(const std::vector<char>& all, int r) {
  const char* t = &all[kRecord * r + 1];
  return std::string(t, strnlen(t, kRecord - 1));
}

// Runs make(), recording its error in `rec` (and returning it) if it throws.
template <class Make>
std::exception_ptr attempt(std::vector<char>& rec, Make make) {
  try {
    make();
    return nullptr;
  } catch (const InvalidArgument& e) {
    put(rec, kInvalid, e.what());
    return std::current_exception();
  } catch (const std::exception& e) {
    put(rec, kFailed, e.what());
    return std::current_exception();
  }
}

[[noreturn]] void raise_for(char status, const std::string& msg) {
  if (status == kInvalid) throw InvalidArgument(msg);
  throw Error(msg);
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

  // Across hosts, a new communicator must lie within one host (its segment is
  // one host's): every rank checks every color alike, so all raise or none.
  if (multi_host())
    for (int r = 0; r < n; ++r)
      for (int q = 0; q < r; ++q)
        if (all_ids[3 * r] >= 0 && all_ids[3 * q] == all_ids[3 * r] &&
            topo_.host(q) != topo_.host(r))
          PYC_THROW(InvalidArgument, "pycollectives: rank "
                                         << rank_ << ": split: color " << all_ids[3 * r]
                                         << " joins rank " << q << " and rank " << r
                                         << ", which are on different hosts: split across hosts "
                                            "is not supported (each color within one host)");
  std::vector<std::tuple<int64_t, int64_t>> members;  // (key, old rank) of my color
  for (int r = 0; r < n; ++r)
    if (color >= 0 && all_ids[3 * r] == color)
      members.emplace_back(all_ids[3 * r + 1], all_ids[3 * r + 2]);
  std::sort(members.begin(), members.end());
  int new_rank = -1;
  for (size_t i = 0; i < members.size(); ++i)
    if (std::get<1>(members[i]) == rank_) new_rank = static_cast<int>(i);
  const int new_n = static_cast<int>(members.size());
  const int leader = new_rank >= 0 ? static_cast<int>(std::get<1>(members[0])) : -1;

  // The leader of each color creates the new segment and shares its name, or
  // the error that stopped it.
  std::vector<char> mine(kRecord, kNone), all(kRecord * n, 0);
  std::shared_ptr<Communicator> child;
  std::exception_ptr failed;
  if (new_rank == 0) {
    const std::string nm = ShmSegment::unique_name();
    failed = attempt(mine, [&] {
      child =
          std::make_shared<Communicator>(0, new_n, nm, true, CommConfig::from_env(), timeout_s_);
      put(mine, kName, nm);
    });
  }
  gather(all.data(), mine.data(), kRecord, DataType::kUInt8);
  if (failed) std::rethrow_exception(failed);
  put(mine, kJoined, "");
  if (new_rank > 0) {
    const char status = all[kRecord * leader];
    if (status != kName)
      raise_for(status, "pycollectives: rank " + std::to_string(rank_) + ": split: rank " +
                            std::to_string(leader) + ", the first of color " +
                            std::to_string(color) +
                            ", could not create the new communicator: " + text(all, leader));
    failed = attempt(mine, [&] {
      child = std::make_shared<Communicator>(new_rank, new_n, text(all, leader), false,
                                             CommConfig::from_env(), timeout_s_);
    });
  }
  // Whether every member joined: else each raises why (the leader's child,
  // going, removes its segment).
  gather(all.data(), mine.data(), kRecord, DataType::kUInt8);
  if (failed) std::rethrow_exception(failed);
  for (const auto& m : members) {
    const int r = static_cast<int>(std::get<1>(m));
    const char status = all[kRecord * r];
    if (r != rank_ && status != kJoined)
      raise_for(status, "pycollectives: rank " + std::to_string(rank_) + ": split: rank " +
                            std::to_string(r) + " could not join the new communicator of color " +
                            std::to_string(color) + ": " + text(all, r));
  }
  if (child) child->connect();
  return child;
}

}  // namespace pyc
