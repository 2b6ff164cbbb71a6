// TMA tensor maps for the sm_90a kernels: the 128-byte CUtensorMap that
// cp.async.bulk.tensor reads (jit/device/hsap_tma.cuh), built on the host by the driver's
// cuTensorMapEncodeTiled (loaded by cuda_loader.h) and passed to a kernel as a
// `__grid_constant__ const hsap_dev::TensorMap` parameter.
//
// EncodeTiledTensorMap first checks the spec against every requirement the CUDA Driver API
// reference states for cuTensorMapEncodeTiled (quoted at each check in tensor_map.cc), so that
// a bad spec fails with InvalidArgument naming the field, its value, the rule and the fix,
// instead of the driver's bare CUDA_ERROR_INVALID_VALUE. Then the driver encodes; a driver
// refusal after the checks passed is Internal with the driver's message (a rule the
// documentation does not state). Without a driver, or one older than CUDA 12.0 (no
// cuTensorMapEncodeTiled), Unimplemented.
//
// Scope: tiled mode only, without interleave (CU_TENSOR_MAP_INTERLEAVE_NONE), the 13 element
// types of CUDA 12.0 and the swizzle modes none / 32B / 64B / 128B; the packed types and the
// 128B_ATOM_* swizzles of CUDA 12.8 (sm_100) are not offered.
#ifndef HSAP_LIB_CUDA_RUNTIME_TENSOR_MAP_H_
#define HSAP_LIB_CUDA_RUNTIME_TENSOR_MAP_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attention/dtype.h"
#include "lib/cuda/runtime/cuda_loader.h"

namespace hsap::cuda {

// CUtensorMapDataType (cuda.h), the types of CUDA 12.0.
enum class TensorMapDataType : int {
  kUint8 = 0,
  kUint16 = 1,
  kUint32 = 2,
  kInt32 = 3,
  kUint64 = 4,
  kInt64 = 5,
  kFloat16 = 6,
  kFloat32 = 7,
  kFloat64 = 8,
  kBfloat16 = 9,
  kFloat32Ftz = 10,
  kTfloat32 = 11,
  kTfloat32Ftz = 12,
};
// CUtensorMapSwizzle: 16-byte chunks permuted within a span of 32, 64 or 128 bytes.
enum class TensorMapSwizzle : int { kNone = 0, k32B = 1, k64B = 2, k128B = 3 };
// CUtensorMapL2promotion.
enum class TensorMapL2Promotion : int { kNone = 0, k64B = 1, k128B = 2, k256B = 3 };
// CUtensorMapFloatOOBfill: what out-of-bounds box elements hold (zeros, or a NaN constant for
// floating-point types).
enum class TensorMapOobFill : int { kZero = 0, kNanRequestZeroFma = 1 };

// The element size in bytes; the CUtensorMapDataType of a storage type.
int TensorMapElementBytes(TensorMapDataType t);
TensorMapDataType TensorMapDataTypeOf(DType t);

// A tiled tensor map. Dimension 0 is the innermost (contiguous) one; the rank is
// global_dims.size() (1 .. 5).
struct TiledTensorMapSpec {
  TensorMapDataType dtype = TensorMapDataType::kBfloat16;
  const void* global_address = nullptr;   // device memory, 16-byte aligned
  std::vector<uint64_t> global_dims;      // elements per dimension, each 1 .. 2^32
  std::vector<uint64_t> global_strides;   // bytes between consecutive indices of dimensions
                                          // 1 .. rank-1 (rank - 1 entries): multiples of 16,
                                          // below 2^40
  std::vector<uint32_t> box_dims;         // elements per dimension of one copy, 1 .. 256
  std::vector<uint32_t> element_strides;  // traversal steps 1 .. 8; empty: all 1
  TensorMapSwizzle swizzle = TensorMapSwizzle::kNone;
  TensorMapL2Promotion l2_promotion = TensorMapL2Promotion::kNone;
  TensorMapOobFill oob_fill = TensorMapOobFill::kZero;
};

// CUtensorMap's bytes: the same size and alignment as hsap_dev::TensorMap (hsap_tma.cuh), so
// that a kernel parameter of that type can be filled with them.
struct alignas(64) TensorMapBytes {
  uint64_t opaque[16];
};
static_assert(sizeof(TensorMapBytes) == 128);

// OK when `spec` meets every documented requirement of cuTensorMapEncodeTiled; otherwise
// InvalidArgument naming the field, the rule and the fix. Needs no driver.
absl::Status ValidateTiledTensorMapSpec(const TiledTensorMapSpec& spec);

// The bytes one copy of the box moves into shared memory (and completes on its mbarrier):
// the product of ceil(box_dims[i] / element_strides[i]) times the element size. Call on a
// valid spec.
uint32_t TensorMapBoxBytes(const TiledTensorMapSpec& spec);

// ValidateTiledTensorMapSpec, then cuTensorMapEncodeTiled of `driver`.
absl::StatusOr<TensorMapBytes> EncodeTiledTensorMap(const CudaDriverApi& driver,
                                                    const TiledTensorMapSpec& spec);
// Same, with the process' driver (LoadCudaDriver).
absl::StatusOr<TensorMapBytes> EncodeTiledTensorMap(const TiledTensorMapSpec& spec);

}  // namespace hsap::cuda

#endif  // HSAP_LIB_CUDA_RUNTIME_TENSOR_MAP_H_
