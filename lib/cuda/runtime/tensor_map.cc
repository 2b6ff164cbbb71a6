#include "lib/cuda/runtime/tensor_map.h"

#include <algorithm>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace hsap::cuda {
namespace {

constexpr uint64_t kMaxDim = uint64_t{1} << 32;       // "less than or equal to 2^32"
constexpr uint64_t kStrideLimit = uint64_t{1} << 40;  // "less than 2^40"

absl::Status Invalid(const std::string& field, const std::string& rule, const std::string& fix) {
  return absl::InvalidArgumentError(
      absl::StrCat("TiledTensorMapSpec.", field, ": ", rule, " (cuTensorMapEncodeTiled); ", fix));
}

// The rank and the per-dimension arrays.
absl::Status CheckShape(const TiledTensorMapSpec& s) {
  const size_t rank = s.global_dims.size();
  // "tensorRank must be non-zero and less than or equal to the maximum supported
  // dimensionality of 5."
  if (rank < 1 || rank > 5) {
    return Invalid("global_dims", absl::StrCat("rank ", rank, " is outside 1 .. 5"),
                   "describe the tensor with 1 to 5 dimensions, merging contiguous ones");
  }
  if (s.global_strides.size() != rank - 1) {
    return Invalid("global_strides",
                   absl::StrCat(s.global_strides.size(), " strides for rank ", rank),
                   absl::StrCat("give the byte strides of dimensions 1 .. ", rank - 1, " (",
                                rank - 1, " values); dimension 0 is contiguous"));
  }
  if (s.box_dims.size() != rank) {
    return Invalid("box_dims", absl::StrCat(s.box_dims.size(), " box sizes for rank ", rank),
                   "give one box size per dimension");
  }
  if (!s.element_strides.empty() && s.element_strides.size() != rank) {
    return Invalid("element_strides",
                   absl::StrCat(s.element_strides.size(), " steps for rank ", rank),
                   "give one step per dimension, or none for all 1");
  }
  for (size_t i = 0; i < rank; ++i) {
    // "globalDim array ... must be non-zero and less than or equal to 2^32."
    if (s.global_dims[i] == 0 || s.global_dims[i] > kMaxDim) {
      return Invalid(absl::StrCat("global_dims[", i, "]"),
                     absl::StrCat(s.global_dims[i], " is outside 1 .. 2^32"),
                     "split the dimension or drop an empty tensor before encoding");
    }
    // "boxDim array ... must be non-zero and less than or equal to 256."
    if (s.box_dims[i] == 0 || s.box_dims[i] > 256) {
      return Invalid(absl::StrCat("box_dims[", i, "]"),
                     absl::StrCat(s.box_dims[i], " is outside 1 .. 256"),
                     "copy larger tiles as several boxes");
    }
    // "elementStrides array ... must be non-zero and less than or equal to 8."
    const uint32_t step = s.element_strides.empty() ? 1 : s.element_strides[i];
    if (step == 0 || step > 8) {
      return Invalid(absl::StrCat("element_strides[", i, "]"),
                     absl::StrCat(step, " is outside 1 .. 8"), "use a step of 1 to 8");
    }
  }
  return absl::OkStatus();
}

}  // namespace

int TensorMapElementBytes(TensorMapDataType t) {
  switch (t) {
    case TensorMapDataType::kUint8:
      return 1;
    case TensorMapDataType::kUint16:
    case TensorMapDataType::kFloat16:
    case TensorMapDataType::kBfloat16:
      return 2;
    case TensorMapDataType::kUint64:
    case TensorMapDataType::kInt64:
    case TensorMapDataType::kFloat64:
      return 8;
    case TensorMapDataType::kUint32:
    case TensorMapDataType::kInt32:
    case TensorMapDataType::kFloat32:
    case TensorMapDataType::kFloat32Ftz:
    case TensorMapDataType::kTfloat32:
    case TensorMapDataType::kTfloat32Ftz:
      return 4;
  }
  return 0;
}

TensorMapDataType TensorMapDataTypeOf(DType t) {
  switch (t) {
    case DType::kF32:
      return TensorMapDataType::kFloat32;
    case DType::kBF16:
      return TensorMapDataType::kBfloat16;
    case DType::kF16:
      return TensorMapDataType::kFloat16;
  }
  return TensorMapDataType::kFloat32;
}

absl::Status ValidateTiledTensorMapSpec(const TiledTensorMapSpec& s) {
  const int element = TensorMapElementBytes(s.dtype);
  if (element == 0) {
    return Invalid("dtype", absl::StrCat("value ", static_cast<int>(s.dtype)),
                   "use a TensorMapDataType enumerator");
  }
  HSAP_RETURN_IF_ERROR(CheckShape(s));
  // "globalAddress, which specifies the starting address of the memory region described,
  // must be 16 byte aligned."
  const auto address = reinterpret_cast<uintptr_t>(s.global_address);
  if (address == 0 || address % 16 != 0) {
    return Invalid("global_address",
                   absl::StrCat("0x", absl::Hex(address), " is null or not 16-byte aligned"),
                   "pass the tensor's device address (cudaMalloc returns 256-byte aligned "
                   "memory; offsets into it must keep 16-byte alignment)");
  }
  // "globalStrides array ... must be a multiple of 16 and less than 2^40."
  for (size_t i = 0; i < s.global_strides.size(); ++i) {
    const uint64_t stride = s.global_strides[i];
    if (stride % 16 != 0 || stride >= kStrideLimit) {
      return Invalid(absl::StrCat("global_strides[", i, "]"),
                     absl::StrCat(stride, " bytes is not a multiple of 16 below 2^40"),
                     "pad the rows of the tensor to a multiple of 16 bytes");
    }
  }
  // "When interleave is CU_TENSOR_MAP_INTERLEAVE_NONE, { boxDim[0] *
  // elementSizeInBytes( tensorDataType ) } must be a multiple of 16 bytes."
  const uint64_t inner = uint64_t{s.box_dims[0]} * static_cast<unsigned>(element);
  if (inner % 16 != 0) {
    return Invalid(
        "box_dims[0]",
        absl::StrCat(s.box_dims[0], " elements of ", element, " bytes make an inner box of ", inner,
                     " bytes, not a multiple of 16"),
        absl::StrCat("use a multiple of ", 16 / std::min(element, 16), " elements"));
  }
  // "When interleave is CU_TENSOR_MAP_INTERLEAVE_NONE and swizzle is not
  // CU_TENSOR_MAP_SWIZZLE_NONE, the bounding box inner dimension (computed as boxDim[0]
  // multiplied by element size derived from tensorDataType) must be less than or equal to
  // the swizzle size": 32, 64 or 128 bytes.
  const int sw = static_cast<int>(s.swizzle);
  if (sw < 0 || sw > 3) {
    return Invalid("swizzle", absl::StrCat("value ", sw), "use a TensorMapSwizzle enumerator");
  }
  if (s.swizzle != TensorMapSwizzle::kNone && inner > (16u << sw)) {
    return Invalid("box_dims[0]",
                   absl::StrCat("an inner box of ", inner, " bytes exceeds the ", 16 << sw,
                                "-byte span of the swizzle"),
                   absl::StrCat("load at most ", (16 << sw) / element,
                                " elements per box row (several boxes side by side) or use a "
                                "wider swizzle"));
  }
  const int l2 = static_cast<int>(s.l2_promotion);
  if (l2 < 0 || l2 > 3) {
    return Invalid("l2_promotion", absl::StrCat("value ", l2),
                   "use a TensorMapL2Promotion enumerator");
  }
  // "CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA can only be used when tensorDataType
  // represents a floating-point data type."
  const int oob = static_cast<int>(s.oob_fill);
  const bool is_float = static_cast<int>(s.dtype) >= static_cast<int>(TensorMapDataType::kFloat16);
  if (oob < 0 || oob > 1 || (s.oob_fill == TensorMapOobFill::kNanRequestZeroFma && !is_float)) {
    return Invalid("oob_fill",
                   absl::StrCat("value ", oob, " for element type ", static_cast<int>(s.dtype)),
                   "use kZero (kNanRequestZeroFma only for floating-point types)");
  }
  return absl::OkStatus();
}

uint32_t TensorMapBoxBytes(const TiledTensorMapSpec& s) {
  uint32_t bytes = static_cast<uint32_t>(TensorMapElementBytes(s.dtype));
  for (size_t i = 0; i < s.box_dims.size(); ++i) {
    // Dimension 0's step is ignored without interleave ("TMA doesn't support the stride for
    // dimension zero"); the others load ceil(boxDim[i] / elementStrides[i]) elements.
    const uint32_t step = i == 0 || s.element_strides.empty() ? 1 : s.element_strides[i];
    bytes *= (s.box_dims[i] + step - 1) / step;
  }
  return bytes;
}

absl::StatusOr<TensorMapBytes> EncodeTiledTensorMap(const CudaDriverApi& driver,
                                                    const TiledTensorMapSpec& s) {
  HSAP_RETURN_IF_ERROR(ValidateTiledTensorMapSpec(s));
  if (driver.TensorMapEncodeTiled == nullptr) {
    return absl::UnimplementedError(
        absl::StrCat(driver.path,
                     " lacks cuTensorMapEncodeTiled: TMA tensor maps need a CUDA "
                     "12.0 or newer driver"));
  }
  const uint32_t rank = static_cast<uint32_t>(s.global_dims.size());
  unsigned long long dims[5] = {}, strides[5] = {};
  unsigned box[5] = {}, steps[5] = {};
  for (uint32_t i = 0; i < rank; ++i) {
    dims[i] = s.global_dims[i];
    box[i] = s.box_dims[i];
    steps[i] = s.element_strides.empty() ? 1 : s.element_strides[i];
    if (i + 1 < rank) strides[i] = s.global_strides[i];
  }
  TensorMapBytes out = {};
  const CUresult r = driver.TensorMapEncodeTiled(
      &out, static_cast<int>(s.dtype), rank, const_cast<void*>(s.global_address), dims, strides,
      box, steps, /*CU_TENSOR_MAP_INTERLEAVE_NONE=*/0, static_cast<int>(s.swizzle),
      static_cast<int>(s.l2_promotion), static_cast<int>(s.oob_fill));
  if (absl::Status st = driver.Check(r, "cuTensorMapEncodeTiled"); !st.ok()) {
    return absl::InternalError(absl::StrCat(
        st.message(), " for a spec that meets the documented requirements (rank ", rank, ")"));
  }
  return out;
}

absl::StatusOr<TensorMapBytes> EncodeTiledTensorMap(const TiledTensorMapSpec& spec) {
  HSAP_RETURN_IF_ERROR(ValidateTiledTensorMapSpec(spec));
  HSAP_ASSIGN_OR_RETURN(const CudaDriverApi* driver, LoadCudaDriver());
  return EncodeTiledTensorMap(*driver, spec);
}

}  // namespace hsap::cuda
