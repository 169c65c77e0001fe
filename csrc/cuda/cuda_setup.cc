// The CUDA path's set-up (see cuda_path_impl.h), at the first CUDA collective:
// the staging memory, the exchange of IPC handles, the control segment of the
// staging FIFOs, and the direct path's connection.
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "algo/algorithms.h"
#include "algo/prims.h"
#include "core/env.h"
#include "cuda/check.h"
#include "cuda/cuda_path_impl.h"
#include "cuda/kernels.h"

namespace pyc {
namespace {

// PYCOLL_CUDA_SLOT_BYTES default: large slots amortize the host round trip
// of each ring step (event query, publish, the peer's poll and launch);
// smaller ones as the staging memory, (n-1) x nslots x slot, grows with n.
size_t default_slot_bytes(int n) { return n <= 4 ? 16 << 20 : n <= 8 ? 8 << 20 : 4 << 20; }
constexpr uint32_t kDefaultNSlots = 4;  // PYCOLL_CUDA_NSLOTS
// The largest values of PYCOLL_CUDA_SLOT_BYTES and PYCOLL_CUDA_NSLOTS: their
// product, times the peers, is device memory, computed without wrapping.
constexpr size_t kMaxCudaSlotBytes = size_t{4} << 30;
constexpr size_t kMaxCudaNSlots = 1024;

size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// What each rank tells the others at the first CUDA collective.
struct PeerInfo {
  cudaIpcMemHandle_t mem;  // this rank's staging buffer (its incoming FIFOs)
  char uuid[16];           // its device (ordinals differ between processes)
  char ctl_name[64];       // rank 0: the name of the control segment
  uint64_t slot_bytes;
  uint32_t nslots;
  int32_t pid;
  uint32_t direct;  // 1: this rank may take the direct path
};

// Layout: the header, the n(n-1) FIFO control blocks, their slot headers, the
// n records of the direct path.
size_t ctl_bytes(int n, uint32_t nslots) {
  const size_t pairs = static_cast<size_t>(n) * static_cast<size_t>(n - 1);
  return round_up(sizeof(CtlHeader), kAlign) + pairs * sizeof(FifoCtl) +
         pairs * nslots * sizeof(SlotHeader) + static_cast<size_t>(n) * sizeof(DirectCtl);
}

// Index of the FIFO src -> dst among all n(n-1), as ShmLayout::pair.
size_t pair_index(int n, int src, int dst) {
  return static_cast<size_t>(src) * (n - 1) + (dst < src ? dst : dst - 1);
}

// Position of src's FIFO among dst's n-1 incoming FIFOs (in dst's staging buffer).
size_t in_index(int src, int dst) { return static_cast<size_t>(src < dst ? src : src - 1); }

}  // namespace

void CudaPath::setup(OpCtx& c) {
  const int n = comm_.n_, r = comm_.rank_;
  std::vector<CudaFifo> out(n), in(n);
  if (n == 1) {
    links_ = std::make_unique<CudaLinks>(comm_, r, n, 1, kAlign, *exec_, out, in);
    return;
  }
  PeerInfo mine;
  std::memset(&mine, 0, sizeof(mine));
  mine.slot_bytes = round_up(
      env_size("PYCOLL_CUDA_SLOT_BYTES", default_slot_bytes(n), 1, kMaxCudaSlotBytes), 4096);
  mine.nslots = static_cast<uint32_t>(
      env_size("PYCOLL_CUDA_NSLOTS", kDefaultNSlots, kMinSlots, kMaxCudaNSlots));
  mine.pid = static_cast<int32_t>(getpid());
  cudaDeviceProp prop{};
  PYC_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
  static_assert(sizeof(prop.uuid) == sizeof(mine.uuid), "cudaUUID_t is 16 bytes");
  std::memcpy(mine.uuid, &prop.uuid, sizeof(mine.uuid));
  const size_t fifo_bytes = static_cast<size_t>(mine.nslots) * mine.slot_bytes;
  const size_t staging_bytes = static_cast<size_t>(n - 1) * fifo_bytes;
  if (const cudaError_t e = cudaMalloc(&staging_, staging_bytes); e != cudaSuccess) {
    (void)cudaGetLastError();
    staging_ = nullptr;
    PYC_THROW(Error, "pycollectives: rank "
                         << r << ": cannot allocate " << staging_bytes
                         << " bytes of staging memory on " << device_name(device_) << " (" << n - 1
                         << " peers x " << mine.nslots << " slots x " << mine.slot_bytes
                         << " bytes): " << cudaGetErrorString(e) << " at " << __FILE__ << ":"
                         << __LINE__ << "; lower PYCOLL_CUDA_SLOT_BYTES / PYCOLL_CUDA_NSLOTS");
  }
  PYC_CUDA_CHECK(cudaIpcGetMemHandle(&mine.mem, staging_));
  // The direct path: on unless the staging ring is forced, for as many ranks
  // as one reduction kernel takes sources.
  mine.direct = comm_.algo_ != Algo::kRing && n <= cuda::kMaxSrcs ? 1 : 0;
  const size_t cbytes = ctl_bytes(n, mine.nslots);
  if (r == 0) {
    const std::string name = ShmSegment::unique_name();
    PYC_ASSERT(name.size() < sizeof(mine.ctl_name));
    ctl_ = ShmSegment::create(name, cbytes);
    ctl_linked_ = true;
    std::memcpy(mine.ctl_name, name.c_str(), name.size());
  }

  // The exchange: a CPU all-gather over the shared-memory links, tagged as
  // this operation (every rank runs it at the same sequence number).
  std::vector<PeerInfo> all(n);
  {
    OpCtx g = c;
    g.dtype = DataType::kUInt8;
    g.op = ReduceOp::kSum;
    g.links = &comm_;
    g.exec = nullptr;
    ring_all_gather(g, &mine, all.data(), sizeof(PeerInfo));
  }
  for (int p = 1; p < n; ++p)
    if (all[p].slot_bytes != all[0].slot_bytes || all[p].nslots != all[0].nslots)
      PYC_THROW(InvalidArgument,
                "pycollectives: rank "
                    << r << ": PYCOLL_CUDA_SLOT_BYTES / PYCOLL_CUDA_NSLOTS differ: "
                    << "rank " << p << " uses " << all[p].nslots << " x " << all[p].slot_bytes
                    << " bytes, rank 0 " << all[0].nslots << " x " << all[0].slot_bytes
                    << "; set them alike on every rank");
  if (r != 0) {
    all[0].ctl_name[sizeof(all[0].ctl_name) - 1] = '\0';
    ctl_ = ShmSegment::open(all[0].ctl_name, cbytes, comm_.timeout_s_, kNoCheck);
    ctl_linked_ = true;
  }
  auto* hdr = static_cast<CtlHeader*>(ctl_.data());
  hdr->attached.fetch_add(1);

  // Map the peers' staging buffers; enable peer access where the device differs.
  int ndev = 0;
  PYC_CUDA_CHECK(cudaGetDeviceCount(&ndev));
  peer_base_.assign(n, nullptr);
  for (int p = 0; p < n; ++p) {
    if (p == r) continue;
    if (std::memcmp(all[p].uuid, mine.uuid, sizeof(mine.uuid)) != 0) {
      for (int d = 0; d < ndev; ++d) {
        cudaDeviceProp pp{};
        PYC_CUDA_CHECK(cudaGetDeviceProperties(&pp, d));
        if (std::memcmp(&pp.uuid, all[p].uuid, sizeof(mine.uuid)) != 0) continue;
        int can = 0;
        PYC_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, device_, d));
        if (!can)
          PYC_THROW(Error, "pycollectives: rank " << r << ": " << device_name(device_)
                                                  << " cannot access the device of rank " << p
                                                  << " (" << device_name(d)
                                                  << " here) peer to peer");
        const cudaError_t e = cudaDeviceEnablePeerAccess(d, 0);
        if (e == cudaErrorPeerAccessAlreadyEnabled)
          (void)cudaGetLastError();
        else
          PYC_CUDA_CHECK(e);
      }
      // A device this process cannot see (CUDA_VISIBLE_DEVICES): the IPC open
      // below enables access lazily.
    }
    PYC_CUDA_CHECK(
        cudaIpcOpenMemHandle(&peer_base_[p], all[p].mem, cudaIpcMemLazyEnablePeerAccess));
  }

  auto* fifo_ctl = reinterpret_cast<FifoCtl*>(static_cast<char*>(ctl_.data()) +
                                              round_up(sizeof(CtlHeader), kAlign));
  auto* hdrs = reinterpret_cast<SlotHeader*>(fifo_ctl + static_cast<size_t>(n) * (n - 1));
  const uint32_t ns = mine.nslots;
  for (int p = 0; p < n; ++p) {
    if (p == r) continue;
    const size_t o = pair_index(n, r, p), i = pair_index(n, p, r);
    out[p] = CudaFifo{fifo_ctl + o, hdrs + o * ns,
                      static_cast<char*>(peer_base_[p]) + in_index(r, p) * fifo_bytes};
    in[p] = CudaFifo{fifo_ctl + i, hdrs + i * ns,
                     static_cast<char*>(staging_) + in_index(p, r) * fifo_bytes};
  }
  links_ = std::make_unique<CudaLinks>(comm_, r, n, ns, mine.slot_bytes, *exec_, out, in);

  bool every_rank_direct = true, one_device = true;
  for (const PeerInfo& p : all) {
    every_rank_direct = every_rank_direct && p.direct == 1;
    one_device = one_device && std::memcmp(p.uuid, mine.uuid, sizeof(mine.uuid)) == 0;
  }
  if (every_rank_direct) {
    direct_ = std::make_unique<IpcDirect>(r, n, stream_, one_device);
    direct_->connect(reinterpret_cast<DirectCtl*>(hdrs + static_cast<size_t>(n) * (n - 1) * ns));
    direct_ready_.store(true);
  }
}

}  // namespace pyc
