// Checks for CUDA runtime calls: a failing call throws pyc::Error carrying the
// file, the line, the call's text and cudaGetErrorString; require_device()
// turns "no driver" and "no device" into one clear error.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <sstream>

#include "core/error.h"

namespace pyc::cuda {
namespace detail {

[[noreturn]] inline void throw_cuda(const char* file, int line, const char* call, cudaError_t err) {
  // Clears the runtime's "last error" when the error is not sticky, so that a
  // later cudaGetLastError() after a launch does not report this one again.
  (void)cudaGetLastError();
  std::ostringstream os;
  os << "pycollectives: CUDA call " << call << " failed: " << cudaGetErrorString(err) << " ("
     << cudaGetErrorName(err) << ", " << static_cast<int>(err) << ") at " << file << ":" << line;
  throw Error(os.str());
}

}  // namespace detail

// Number of CUDA devices this process can use; 0 when there is no driver, no
// device, or the runtime fails to initialize. Never throws.
inline int device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

// Throws pyc::Error "pycollectives: no CUDA device ..." (with the runtime's
// reason) when cudaGetDeviceCount fails or finds no device. `what` names the
// operation that needed the device.
inline void require_device(const char* what) {
  // Once found, the devices of a process stay (CUDA_VISIBLE_DEVICES is read
  // once): later calls skip the query.
  static std::atomic<bool> found{false};
  if (found.load(std::memory_order_relaxed)) return;
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err == cudaSuccess && n > 0) {
    found.store(true, std::memory_order_relaxed);
    return;
  }
  (void)cudaGetLastError();
  std::ostringstream os;
  os << "pycollectives: no CUDA device: " << what << " needs one, but ";
  if (err != cudaSuccess) {
    os << "cudaGetDeviceCount failed: " << cudaGetErrorString(err) << " (" << cudaGetErrorName(err)
       << ")";
  } else {
    os << "cudaGetDeviceCount found 0 devices";
  }
  throw Error(os.str());
}

}  // namespace pyc::cuda

// Checks a CUDA runtime call; throws pyc::Error with file:line, the call and
// the runtime's error string.
#define PYC_CUDA_CHECK(call)                                                     \
  do {                                                                           \
    const cudaError_t pyc_cuda_err_ = (call);                                    \
    if (pyc_cuda_err_ != cudaSuccess)                                            \
      ::pyc::cuda::detail::throw_cuda(__FILE__, __LINE__, #call, pyc_cuda_err_); \
  } while (0)
