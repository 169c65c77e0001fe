// The part of DLPack's C ABI (dlpack.h, major version 1) that the fast path
// reads: a tensor described without ownership, and the exchange table a
// framework publishes as the capsule `Tensor.__dlpack_c_exchange_api__`
// (DLPack 1.2+; torch 2.13 has it). Declared here, by the layout the DLPack
// specification fixes, so that the build needs neither torch nor dlpack.h.
#pragma once

#include <cstdint>

namespace pyc::dlpack {

constexpr uint32_t kMajor = 1;  // the ABI these declarations follow
constexpr char kExchangeCapsule[] = "dlpack_exchange_api";
constexpr int32_t kCPU = 1;  // DLDeviceType kDLCPU

// DLDataTypeCode
enum : uint8_t { kInt = 0, kUInt = 1, kFloat = 2, kBfloat = 4 };

struct Version {
  uint32_t major;
  uint32_t minor;
};

struct Device {
  int32_t device_type;  // DLDeviceType (an int-sized C enum)
  int32_t device_id;
};

struct DataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};

struct Tensor {
  void* data;
  Device device;
  int32_t ndim;
  DataType dtype;
  int64_t* shape;
  int64_t* strides;  // may be null: compact row-major
  uint64_t byte_offset;
};

struct ExchangeHeader {
  Version version;
  ExchangeHeader* prev_api;
};

// Fills a non-owning description of `py_object` (of the publishing type);
// 0 on success, -1 with a Python exception set.
using TensorFromPyObject = int (*)(void* py_object, Tensor* out);

struct ExchangeApi {
  ExchangeHeader header;
  void* managed_tensor_allocator;
  void* managed_tensor_from_py_object_no_sync;
  void* managed_tensor_to_py_object_no_sync;
  TensorFromPyObject dltensor_from_py_object_no_sync;  // may be null
  void* current_work_stream;
};

}  // namespace pyc::dlpack
