// Names and sizes of the core value types, and the packing of OpSig into the
// two words that ranks publish in shared memory.
#include "core/types.h"

#include <sstream>

#include "core/error.h"

namespace pyc {

size_t dtype_size(DataType dt) {
  switch (dt) {
    case DataType::kFloat32:
      return 4;
    case DataType::kFloat64:
      return 8;
    case DataType::kFloat16:
      return 2;
    case DataType::kBFloat16:
      return 2;
    case DataType::kInt8:
      return 1;
    case DataType::kUInt8:
      return 1;
    case DataType::kInt32:
      return 4;
    case DataType::kInt64:
      return 8;
  }
  PYC_THROW(InvalidArgument, "pycollectives: invalid dtype " << static_cast<int32_t>(dt));
}

const char* dtype_name(DataType dt) {
  switch (dt) {
    case DataType::kFloat32:
      return "float32";
    case DataType::kFloat64:
      return "float64";
    case DataType::kFloat16:
      return "float16";
    case DataType::kBFloat16:
      return "bfloat16";
    case DataType::kInt8:
      return "int8";
    case DataType::kUInt8:
      return "uint8";
    case DataType::kInt32:
      return "int32";
    case DataType::kInt64:
      return "int64";
  }
  return "invalid_dtype";
}

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kProd:
      return "prod";
    case ReduceOp::kMin:
      return "min";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kAvg:
      return "avg";
  }
  return "invalid_op";
}

bool valid_dtype(int32_t v) { return v >= 0 && v < kNumDataTypes; }

bool valid_reduce_op(int32_t v) { return v >= 0 && v < kNumReduceOps; }

const char* op_kind_name(OpKind k) {
  switch (k) {
    case OpKind::kAllReduce:
      return "all_reduce";
    case OpKind::kReduceScatter:
      return "reduce_scatter";
    case OpKind::kAllGather:
      return "all_gather";
    case OpKind::kBroadcast:
      return "broadcast";
    case OpKind::kReduce:
      return "reduce";
    case OpKind::kAllToAll:
      return "all_to_all";
    case OpKind::kBarrier:
      return "barrier";
    case OpKind::kSend:
      return "send";
    case OpKind::kRecv:
      return "recv";
    case OpKind::kSplit:
      return "split";
    case OpKind::kBatchP2P:
      return "batch_p2p";
    case OpKind::kAllocShared:
      return "alloc_shared";
  }
  return "invalid_kind";
}

// word0 layout, low to high: kind (8 bits), dtype (8), op (8), unused (8;
// point-to-point slot tags mark single-copy descriptors in its low bit,
// algo/p2p.cc), root + 1 as uint32 (32; 0 means "no root").
uint64_t OpSig::word0() const {
  const uint32_t root_field = static_cast<uint32_t>(root) + 1u;
  return static_cast<uint64_t>(static_cast<uint8_t>(kind)) |
         static_cast<uint64_t>(static_cast<uint8_t>(dtype)) << 8 |
         static_cast<uint64_t>(static_cast<uint8_t>(op)) << 16 |
         static_cast<uint64_t>(root_field) << 32;
}

OpSig OpSig::unpack(uint64_t w0, uint64_t w1) {
  OpSig s;
  s.kind = static_cast<OpKind>(w0 & 0xff);
  s.dtype = static_cast<DataType>((w0 >> 8) & 0xff);
  s.op = static_cast<ReduceOp>((w0 >> 16) & 0xff);
  s.root = static_cast<int32_t>(static_cast<uint32_t>(w0 >> 32) - 1u);
  s.count = w1;
  return s;
}

std::string OpSig::describe() const {
  std::ostringstream os;
  os << op_kind_name(kind) << "(";
  if (kind == OpKind::kBarrier || kind == OpKind::kSplit) return os.str() + ")";
  if (kind == OpKind::kBatchP2P) {
    os << count << " sends and receives)";
    return os.str();
  }
  if (kind == OpKind::kAllocShared) {
    os << "nbytes=" << count << ")";
    return os.str();
  }
  os << "count=" << count << ", " << dtype_name(dtype);
  switch (kind) {
    case OpKind::kAllReduce:
    case OpKind::kReduceScatter:
      os << ", " << reduce_op_name(op);
      break;
    case OpKind::kReduce:
      os << ", " << reduce_op_name(op) << ", root=" << root;
      break;
    case OpKind::kBroadcast:
      os << ", root=" << root;
      break;
    case OpKind::kSend:
    case OpKind::kRecv:
      if (root < 0)
        os << ", peer=any";
      else
        os << ", peer=" << root;
      break;
    default:
      break;
  }
  os << ")";
  return os.str();
}

}  // namespace pyc
