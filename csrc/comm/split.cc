// Communicator::split (MPI_Comm_split / ncclCommSplit): two all-gathers over
// the parent, one for (color, key), one for the new segments' names.
#include <algorithm>
#include <cstring>
#include <tuple>

#include "comm/communicator.h"
#include "core/error.h"

namespace pyc {

std::shared_ptr<Communicator> Communicator::split(int color, int key, double timeout_s) {
  if (timeout_s < 0) timeout_s = timeout_s_;
  const int n = n_;
  // Both exchanges are collectives of kind kSplit, so a rank that calls split
  // while another calls something else gets a mismatch error, not a hang.
  std::vector<int64_t> mine = {color < 0 ? -1 : color, key, rank_}, all(3 * n);
  auto gather = [&](void* out, const void* in, size_t count, DataType dt) {
    OpSig sig{OpKind::kSplit, dt, ReduceOp::kSum, -1, count};
    collective(sig, timeout_s, false,
               [out, in, count](OpCtx& c) { ring_all_gather(c, in, out, count); });
  };
  gather(all.data(), mine.data(), 3, DataType::kInt64);

  std::vector<std::tuple<int64_t, int64_t>> members;  // (key, old rank) of my color
  for (int r = 0; r < n; ++r)
    if (color >= 0 && all[3 * r] == color) members.emplace_back(all[3 * r + 1], all[3 * r + 2]);
  std::sort(members.begin(), members.end());
  int new_rank = -1;
  for (size_t i = 0; i < members.size(); ++i)
    if (std::get<1>(members[i]) == rank_) new_rank = static_cast<int>(i);
  const int new_n = static_cast<int>(members.size());

  // The leader of each color creates the new segment and shares its name.
  constexpr size_t kName = 64;
  std::vector<char> name(kName, 0), names(kName * n, 0);
  std::shared_ptr<Communicator> child;
  if (new_rank == 0) {
    std::string nm = ShmSegment::unique_name();
    PYC_ASSERT(nm.size() < kName);
    child = std::make_shared<Communicator>(0, new_n, nm, true, CommConfig::from_env(), timeout_s_);
    std::memcpy(name.data(), nm.c_str(), nm.size());
  }
  gather(names.data(), name.data(), kName, DataType::kUInt8);
  if (new_rank > 0) {
    const int leader = static_cast<int>(std::get<1>(members[0]));
    std::string nm(&names[kName * leader]);
    child = std::make_shared<Communicator>(new_rank, new_n, nm, false, CommConfig::from_env(),
                                           timeout_s_);
  }
  if (child) child->connect();
  return child;
}

}  // namespace pyc
