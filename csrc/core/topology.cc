// Hosts and their ranks (see topology.h).
#include "core/topology.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>

#include "core/error.h"

namespace pyc {
namespace {

std::string first_line(const char* path) {
  std::ifstream f(path);
  std::string s;
  if (f) std::getline(f, s);
  return s;
}

// "dev:ino" of a path, or "?" where it cannot be read.
std::string inode(const char* path) {
  struct stat st;
  if (stat(path, &st) != 0) return "?";
  std::ostringstream os;
  os << st.st_dev << ":" << st.st_ino;
  return os.str();
}

}  // namespace

std::string host_id() {
  const char* env = std::getenv("PYCOLL_HOST_ID");
  if (env != nullptr && *env != '\0') return std::string("env:") + env;
  // The boot id tells kernels apart (the hostname need not: containers copy
  // it, and two machines may share one); the network namespace, hosts that
  // one kernel runs side by side (containers, and this project's tests);
  // /dev/shm's mount, processes that could not share a segment anyway.
  return first_line("/proc/sys/kernel/random/boot_id") + "/net:" + inode("/proc/self/ns/net") +
         "/shm:" + inode("/dev/shm");
}

Topology Topology::single(int rank, int n) { return from_hosts(rank, std::vector<int>(n, 0)); }

Topology Topology::from_ids(int rank, const std::vector<std::string>& ids) {
  std::map<std::string, int> index;
  std::vector<int> host_of(ids.size());
  for (size_t r = 0; r < ids.size(); ++r) {
    auto it = index.emplace(ids[r], static_cast<int>(index.size())).first;
    host_of[r] = it->second;
  }
  return from_hosts(rank, host_of);
}

Topology Topology::from_hosts(int rank, const std::vector<int>& host_of) {
  const int n = static_cast<int>(host_of.size());
  if (n < 1 || rank < 0 || rank >= n)
    PYC_THROW(InvalidArgument,
              "pycollectives: rank " << rank << " out of range for " << n << " ranks");
  Topology t;
  t.rank_ = rank;
  // Renumber the hosts by their lowest rank, whatever numbers were given.
  std::map<int, int> renum;
  t.host_.resize(n);
  t.local_.resize(n);
  for (int r = 0; r < n; ++r) {
    auto it = renum.emplace(host_of[r], static_cast<int>(renum.size())).first;
    t.host_[r] = it->second;
  }
  t.members_.resize(renum.size());
  for (int r = 0; r < n; ++r) {
    auto& m = t.members_[t.host_[r]];
    t.local_[r] = static_cast<int>(m.size());
    m.push_back(r);
  }
  for (const auto& m : t.members_) t.uniform_ = t.uniform_ && m.size() == t.members_[0].size();
  return t;
}

std::vector<int> Topology::rail(int r) const {
  PYC_ASSERT(uniform_);
  std::vector<int> out;
  for (const auto& m : members_) out.push_back(m[local_[r]]);
  return out;
}

std::vector<int> Topology::xpeers(int r) const {
  std::vector<int> out;
  const int i = local_[r];
  const int nr = static_cast<int>(members_[host_[r]].size());
  for (int h = 0; h < nhosts(); ++h) {
    if (h == host_[r]) continue;
    const auto& m = members_[h];
    const int nh = static_cast<int>(m.size());
    for (int j = 0; j < nh; ++j)
      if (j == i % nh || i == j % nr) out.push_back(m[j]);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<int> Topology::host_order() const {
  std::vector<int> out;
  for (const auto& m : members_) out.insert(out.end(), m.begin(), m.end());
  return out;
}

std::string Topology::host_ranks(int r) const {
  std::ostringstream os;
  os << "[";
  const char* sep = "";
  for (int p : members_[host_[r]]) {
    os << sep << p;
    sep = ", ";
  }
  os << "]";
  return os.str();
}

}  // namespace pyc
