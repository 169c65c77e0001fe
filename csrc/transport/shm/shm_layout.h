// Layout of a communicator's shared-memory segment: a header, a control block
// per rank, a slot FIFO per ordered pair of ranks, and per-rank one-shot areas.
#pragma once

#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "core/wait.h"

namespace pyc {

constexpr uint64_t kShmMagic = 0x31636f6c6c637970ull;  // "pycollc1"
constexpr int kSigHistory = 64;                        // operations whose signature each rank keeps
constexpr int kMaxLead = 32;                           // how many collectives a rank may run ahead
constexpr size_t kAlign = 64;

struct SegmentHeader {
  uint64_t magic;
  uint32_t world_size;
  uint32_t nslots;
  uint64_t slot_bytes;
  uint64_t oneshot_bytes;
  uint64_t total_bytes;
  uint32_t algo;                // the creator's PYCOLL_ALGO choice, binding on all ranks
  std::atomic<uint32_t> ready;  // creator sets 1 once everything is initialized
  // The communicator's error: 0 none, r + 1 rank r's (RankCtl::abort_kind and
  // abort_msg, complete before the rank claimed this word with one CAS, so a
  // rank killed at any point leaves either no abort or a whole one).
  alignas(64) std::atomic<uint32_t> abort_rank;
  // The latest fault-tolerant agreement decided (comm/recovery.cc): its number
  // << 32 | (r + 1), rank r's proposal (AgreeCtl::prop) being the decision;
  // claimed by one CAS once the proposal is complete.
  alignas(64) std::atomic<uint64_t> agreed;
};

// The largest sizes a segment's header may announce (PYCOLL_* ranges).
constexpr size_t kMaxSlotBytes = size_t{1} << 30;
constexpr uint32_t kMaxNSlots = 1024;
constexpr size_t kMaxOneShotBytes = size_t{64} << 20;

// One operation's announcement (Communicator::announce): a seqlock, written
// by its rank while peers may read it, hence atomics throughout.
struct SigEntry {
  std::atomic<uint32_t> seq;
  uint32_t pad;
  std::atomic<uint64_t> w0, w1;
  // symmetric-window placement of the buffer (window id << 40 | offset), or 0
  std::atomic<uint64_t> where;
  std::atomic<uint64_t> addr;  // the (input) buffer's address in this rank's process, for CMA, or 0
  std::atomic<uint64_t> out;   // the output buffer's address likewise (all-reduce: = addr)
};

struct alignas(64) RankCtl {
  Counter started;   // latest collective sequence number started
  Counter reduced;   // direct all-reduce: this rank's part of operation `value` is reduced
  Counter gathered;  // direct and single-copy paths: this rank is done with every peer's buffers
  // Single copy (algo/cma.cc): the claim counter of this rank's part of the
  // operation, sequence number << 32 | next unclaimed chunk.
  alignas(64) std::atomic<uint64_t> cma_next;
  alignas(64) int32_t pid;
  std::atomic<uint32_t> attached;  // 1 once this rank holds `alive` (its death shows from then on)
  // Connecting single copy (Communicator::agree_cma), each 1 for yes, 2 for
  // no: cma_want, this rank would use it; cma_ready, it found every peer of
  // its user and let them access it (Yama); cma_state, it read (and wrote
  // back) every peer's token, the word at cma_addr in its process.
  std::atomic<uint32_t> cma_want;
  std::atomic<uint32_t> cma_ready;
  std::atomic<uint32_t> cma_state;
  uint64_t cma_addr;
  uint64_t cma_token;
  cpu_set_t cpus;                     // the CPUs this rank may run on
  std::atomic<uint32_t> closed;       // set by close() before `alive` is released
  alignas(64) pthread_mutex_t alive;  // robust; held while the rank's communicator lives
  // What this rank is doing, for a timeout's verdict (OpMonitor::culprit):
  // the collective it waits in and for whom, seq << 32 | (peer + 1), or 0;
  // and the steady clock (ns) of its latest check in that wait.
  alignas(64) std::atomic<uint64_t> waiting;
  std::atomic<int64_t> beat_ns;
  std::atomic<uint32_t> done;  // the latest collective this rank finished (or failed)
  // Single copy: seq << 1 | 1 while this rank may still copy into its peers'
  // buffers for collective seq (algo/cma.cc); an aborting peer waits for it.
  std::atomic<uint64_t> cma_busy;
  // This rank's error, written before it claims SegmentHeader::abort_rank.
  int32_t abort_kind;  // an AbortKind
  int32_t abort_from;  // the rank that reported it: this one, or another host's (tcp_net.h)
  char abort_msg[1024];
  alignas(64) SigEntry sig[kSigHistory];
};

// A rank's part in the fault-tolerant agreement (comm/recovery.cc), followed
// in the segment by two arrays of world_size bytes, the verdicts of its two
// proposals (AgreeVerdict, by rank).
struct alignas(64) AgreeCtl {
  std::atomic<uint32_t> entered;  // the latest agreement this rank entered (its number)
  std::atomic<uint32_t> flag;     // its flag there (stored before `entered`)
  // Its proposals, by agreement number % 2: a seqlock (number 0 while being
  // written); the one SegmentHeader::agreed names is the decision.
  struct Proposal {
    std::atomic<uint32_t> number;
    std::atomic<uint32_t> value;  // the AND of the flags of the ranks it finds alive
    char name[64];                // the segment of the survivors' communicator (shrink)
  } prop[2];
};

struct alignas(64) FifoCtl {
  Counter tail;      // slots posted by the sender
  Counter head;      // slots released by the receiver
  Counter cma_done;  // the latest single-copy message of this pair read by the receiver (its seq)
  // Single-copy all-to-all (algo/cma.cc): the claim counter of this pair's
  // block, sequence number << 32 | next unclaimed chunk.
  alignas(64) std::atomic<uint64_t> cma_next;
};

// Header of every FIFO slot: which operation wrote it.
struct alignas(64) SlotHeader {
  uint32_t seq;
  uint32_t pad;
  uint64_t w0, w1;
  uint64_t bytes;
};

// How many payload bytes travel in a one-shot area's first cache line.
constexpr size_t kOneShotInline = 40;

// One-shot area header: the sequence number is the ready flag. A payload of at
// most kOneShotInline bytes sits in the flag's cache line (`inline_data`), so
// that a reader that sees the flag has the operation's tag and data with it
// and the writer claims one line; a larger one follows the header, aligned.
struct alignas(64) OneShotHeader {
  Flag seq;
  uint64_t w0, w1;
  unsigned char inline_data[kOneShotInline];
};
static_assert(sizeof(OneShotHeader) == 64, "a one-shot area's flag, tag and inline data: one line");

// Byte offsets of every part of the segment, computed identically by all ranks.
struct ShmLayout {
  int world_size = 0;
  uint32_t nslots = 0;
  size_t slot_bytes = 0;     // payload per slot
  size_t oneshot_bytes = 0;  // payload per one-shot buffer (two per rank)

  size_t rank_ctl_off = 0;
  size_t fifo_ctl_off = 0;
  size_t fifo_data_off = 0;
  size_t oneshot_off = 0;
  size_t agree_off = 0;
  size_t agree_stride = 0;  // an AgreeCtl and its two verdict arrays
  size_t total = 0;

  ShmLayout() = default;
  // Throws InvalidArgument when the segment would not fit the address space
  // (the sizes come from the environment, or a peer's header).
  ShmLayout(int world_size, uint32_t nslots, size_t slot_bytes, size_t oneshot_bytes);

  size_t slot_stride() const { return sizeof(SlotHeader) + slot_bytes; }
  size_t oneshot_stride() const { return sizeof(OneShotHeader) + oneshot_bytes; }
  // Index of the FIFO that carries data from `src` to `dst` (src != dst).
  int pair(int src, int dst) const { return src * (world_size - 1) + (dst < src ? dst : dst - 1); }

  SegmentHeader* header(void* base) const { return static_cast<SegmentHeader*>(base); }
  RankCtl* rank_ctl(void* base, int r) const;
  FifoCtl* fifo_ctl(void* base, int src, int dst) const;
  char* fifo_slots(void* base, int src, int dst) const;
  OneShotHeader* oneshot(void* base, int r, int parity) const;
  AgreeCtl* agree(void* base, int r) const;
  // Proposal `which` (0, 1) of rank r: its verdict on every rank.
  uint8_t* verdicts(void* base, int r, int which) const;
};

}  // namespace pyc
