// Which ranks share a host. Ranks of one host talk through shared memory
// (and CUDA IPC); ranks of different hosts through TCP. Learned at bootstrap:
// every rank publishes its host id (host_id()), and every rank builds the same
// Topology from the list.
#pragma once

#include <string>
#include <vector>

namespace pyc {

// This process's host id: PYCOLL_HOST_ID if set, else the kernel's boot id,
// the network namespace and the /dev/shm mount this process sees. Two
// processes share a host exactly when they share all three: the same kernel
// (boot id), the same network stack (two network namespaces are two hosts to
// the network, whatever they share besides) and the same POSIX shared memory.
std::string host_id();

class Topology {
 public:
  // One host holding every rank.
  static Topology single(int rank, int n);
  // From every rank's host id (ids[r] is rank r's). Hosts are numbered by
  // their lowest rank; a host's ranks by rank (their local index).
  static Topology from_ids(int rank, const std::vector<std::string>& ids);
  // From every rank's host index (hosts numbered by their lowest rank).
  static Topology from_hosts(int rank, const std::vector<int>& host_of);

  int rank() const { return rank_; }
  int size() const { return static_cast<int>(host_.size()); }
  int nhosts() const { return static_cast<int>(members_.size()); }
  bool multi_host() const { return nhosts() > 1; }
  int host(int r) const { return host_[r]; }
  int local(int r) const { return local_[r]; }
  bool same_host(int r) const { return host_[r] == host_[rank_]; }
  // The ranks of host h, ascending; this rank's host's.
  const std::vector<int>& members(int h) const { return members_[h]; }
  const std::vector<int>& locals() const { return members_[host_[rank_]]; }
  const std::vector<int>& host_of() const { return host_; }
  // Every host has as many ranks as every other: the hierarchical algorithms
  // pair local rank i of every host (its rail).
  bool uniform() const { return uniform_; }
  // Rank r's rail: local rank local(r) of every host, in host order (uniform only).
  std::vector<int> rail(int r) const;
  // The ranks of other hosts that rank r keeps a control connection with (and
  // exchanges tags with in a cross-host confirmation): on every other host h,
  // its local rank local(r) mod |h|, and every rank of h that picks r so. A
  // symmetric relation, linking every pair of hosts.
  std::vector<int> xpeers(int r) const;
  // Every rank, host by host (each host's ranks ascending): the flat ring's order.
  std::vector<int> host_order() const;
  // "[2, 3]": the ranks of rank r's host, for messages.
  std::string host_ranks(int r) const;

 private:
  int rank_ = 0;
  bool uniform_ = true;
  std::vector<int> host_, local_;
  std::vector<std::vector<int>> members_;
};

}  // namespace pyc
