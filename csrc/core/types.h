// Core value types shared by every layer: data types, reduction ops, and the
// signature that identifies one operation across ranks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace pyc {

enum class DataType : int32_t {
  kFloat32 = 0,
  kFloat64 = 1,
  kFloat16 = 2,
  kBFloat16 = 3,
  kInt8 = 4,
  kUInt8 = 5,
  kInt32 = 6,
  kInt64 = 7,
};
constexpr int kNumDataTypes = 8;

enum class ReduceOp : int32_t {
  kSum = 0,
  kProd = 1,
  kMin = 2,
  kMax = 3,
  kAvg = 4,
};
constexpr int kNumReduceOps = 5;

size_t dtype_size(DataType dt);
const char* dtype_name(DataType dt);
const char* reduce_op_name(ReduceOp op);
bool valid_dtype(int32_t v);
bool valid_reduce_op(int32_t v);

// What kind of operation a signature describes.
enum class OpKind : uint8_t {
  kAllReduce = 0,
  kReduceScatter,
  kAllGather,
  kBroadcast,
  kReduce,
  kAllToAll,
  kBarrier,
  kSend,
  kRecv,
  kSplit,
  kBatchP2P,     // count: the number of sends and receives in the batch
  kAllocShared,  // count: the bytes each rank asked for
};
constexpr int kNumOpKinds = 12;
const char* op_kind_name(OpKind k);

// The fingerprint of one operation, published by every rank so that peers
// calling a different collective at the same sequence number are detected.
struct OpSig {
  OpKind kind = OpKind::kBarrier;
  DataType dtype = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  int32_t root = -1;   // root / peer rank, -1 when the op has none
  uint64_t count = 0;  // elements per rank, as passed by the caller

  // Packs into two words for shared memory.
  uint64_t word0() const;
  uint64_t word1() const { return count; }
  static OpSig unpack(uint64_t w0, uint64_t w1);
  bool operator==(const OpSig& o) const { return word0() == o.word0() && count == o.count; }
  bool operator!=(const OpSig& o) const { return !(*this == o); }
  // e.g. "all_reduce(count=1000, float32, sum)"
  std::string describe() const;
};

}  // namespace pyc
