#include "comm/cma_choice.h"

#include <algorithm>

namespace pyc {

size_t cma_total(const OpSig& sig, int nranks) {
  const size_t bytes = sig.count * dtype_size(sig.dtype);
  switch (sig.kind) {
    case OpKind::kReduceScatter:  // count: the output's (one block of the input)
    case OpKind::kAllGather:      // count: the input's (one block of the output)
    case OpKind::kAllToAll:       // count: one block's
      return bytes * static_cast<size_t>(nranks);
    default:
      return bytes;
  }
}

// The bands where single copy measured faster than the slots on the 2-core
// Intel VM (docs/benchmarks.md, "Single copy against the slots on the Intel
// VM"): below them a system call per peer and chunk costs more than the slots'
// pipelined copies; from 32 MiB, where the output is out of the caches, the
// kernel's copy into it (ordinary stores) mostly loses to the slots' streaming
// stores in the collectives that only copy; nothing was measured beyond 4
// ranks. Outside them it lost, or won by little and not from run to run, on
// both machines measured, so it is not tried there.
bool cma_band(OpKind kind, int n, size_t total) {
  constexpr size_t KiB = 1024, MiB = 1024 * KiB;
  // A batch's sends are candidates one by one, from 64 KiB (Communicator::batch_p2p).
  if (kind == OpKind::kBatchP2P) return total > 0;
  if (n > 4) return false;
  switch (kind) {
    case OpKind::kAllReduce:  // 4 ranks from 32 MiB: the ring's streaming stores win
      return total >= 1 * MiB && (n < 4 || total < 32 * MiB);
    case OpKind::kReduceScatter:
      return n == 2   ? total >= 256 * KiB && total < 32 * MiB
             : n == 3 ? total >= 1 * MiB
                      : total >= 1 * MiB && total < 8 * MiB;
    case OpKind::kAllGather:
      return n == 2   ? total >= 64 * KiB && total < 32 * MiB
             : n == 3 ? total >= 256 * KiB && total < 32 * MiB
                      : total >= 1 * MiB && total < 32 * MiB;
    case OpKind::kReduce:  // 3-4 ranks: gains and losses from run to run
      return n == 2 && total >= 1 * MiB && total < 32 * MiB;
    case OpKind::kBroadcast:
      return total >= 256 * KiB && (n == 2 || total < 32 * MiB);
    case OpKind::kAllToAll:
      return total >= 256 * KiB && total < 32 * MiB;
    default:
      return false;
  }
}

int CmaTuner::size_class(size_t total) {
  return total ? std::min(kClasses - 1, 63 - __builtin_clzll(total)) : 0;
}

CmaTuner::Class& CmaTuner::at(OpKind kind, size_t total) {
  return classes_[static_cast<int>(kind)][size_class(total)];
}

CmaTuner::Choice CmaTuner::choose(OpKind kind, size_t total) {
  if (!enabled_) return {true, false};
  Class& c = at(kind, total);
  if (c.decided.load(std::memory_order_relaxed) < 0) {
    const uint32_t i = c.calls.fetch_add(1, std::memory_order_relaxed);
    if (i == 0) return {true, false};                 // untimed
    if (i <= 2 * kTrials) return {i % 2 == 1, true};  // single copy, slots, single copy, ...
    const double slots = c.best[0].load(std::memory_order_relaxed);
    const double cma = c.best[1].load(std::memory_order_relaxed);
    const bool both = slots < HUGE_VAL && cma < HUGE_VAL;  // else keep to the slots
    c.decided.store(both && cma < slots ? 1 : 0, std::memory_order_relaxed);
  }
  return {c.decided.load(std::memory_order_relaxed) == 1, false};
}

void CmaTuner::record(OpKind kind, size_t total, bool ran_cma, uint64_t ns) {
  if (total == 0) return;
  std::atomic<double>& best = at(kind, total).best[ran_cma ? 1 : 0];
  const double per_byte = static_cast<double>(ns) / static_cast<double>(total);
  if (per_byte < best.load(std::memory_order_relaxed))
    best.store(per_byte, std::memory_order_relaxed);
}

int CmaTuner::decided(OpKind kind, size_t total) const {
  return enabled_ ? classes_[static_cast<int>(kind)][size_class(total)].decided.load(
                        std::memory_order_relaxed)
                  : 1;
}

std::vector<CmaTuner::Report> CmaTuner::report(OpKind kind) const {
  std::vector<Report> out;
  if (!enabled_) return out;
  for (int k = 0; k < kClasses; ++k) {
    const Class& c = classes_[static_cast<int>(kind)][k];
    if (c.calls.load(std::memory_order_relaxed) == 0) continue;
    out.push_back(
        {size_t{1} << k,
         c.decided.load(std::memory_order_relaxed),
         {c.best[0].load(std::memory_order_relaxed), c.best[1].load(std::memory_order_relaxed)}});
  }
  return out;
}

}  // namespace pyc
