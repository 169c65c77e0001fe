// Collectives over buffers that every rank can address (the direct CUDA IPC
// path, cuda/ipc_direct.h): each rank enqueues one or a few kernels that read
// and write the peers' buffers in place, on the operation's KernelExec.
//
// Each rank owns a part of the work and no two ranks write the same bytes, so
// the ranks' kernels may run in any order or at the same time:
//   all_reduce      rank r reduces part r of every buffer (left fold in rank
//                   order, so every rank gets the same bits) and writes it
//                   into every buffer: reads S, writes S per rank;
//   reduce_scatter  rank r reduces block r of every input into its output;
//   all_gather      rank r writes its input into block r of every output;
//   broadcast       every rank but the root copies the root's buffer;
//   reduce          rank r reduces part r of every buffer into the root's;
//   all_to_all      rank r writes its input block p into rank p's output block r.
// AVG sums, then divides the part once. count is as the Communicator's
// methods take it; views hold nranks <= cuda::kMaxSrcs buffers.
#pragma once

#include <cstddef>

#include "algo/context.h"
#include "cuda/ipc_direct.h"

namespace pyc {

void ipc_all_reduce(OpCtx& c, const IpcView& v, size_t count);
void ipc_reduce_scatter(OpCtx& c, const IpcView& v, size_t count);
void ipc_all_gather(OpCtx& c, const IpcView& v, size_t count);
void ipc_broadcast(OpCtx& c, const IpcView& v, size_t count, int root);
void ipc_reduce(OpCtx& c, const IpcView& v, size_t count, int root);
void ipc_all_to_all(OpCtx& c, const IpcView& v, size_t count);

}  // namespace pyc
