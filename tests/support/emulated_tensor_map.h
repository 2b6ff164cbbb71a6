// The emulated driver's tensor maps: cuTensorMapEncodeTiled as the CUDA emulator's driver
// (tests/support/emulated_cuda_runtime.h) implements it, and the decoding that the emulated
// TMA (tests/support/emulated_tma.h) does of the 128 opaque bytes.
//
// The refusals are the requirements the CUDA Driver API reference states for
// cuTensorMapEncodeTiled (cuda.h's comment of the function, CUDA 13.0), each failing with
// CUDA_ERROR_INVALID_VALUE as the driver does; they are written here from that text,
// separately from the library's own validation (lib/cuda/runtime/tensor_map.cc), so that each
// checks the other. The packed data types of CUDA 12.8 (16U4 / 16U6) and the swizzle modes
// 128B_ATOM_* (sm_100) are refused with CUDA_ERROR_NOT_SUPPORTED: the emulator does not model
// them.
//
// The opaque bytes hold EmuTensorMap below (the emulator's own layout: the real driver's is
// undocumented), tagged by a magic word so that the emulated TMA faults on a map that was not
// encoded.
#ifndef HSAP_TESTS_SUPPORT_EMULATED_TENSOR_MAP_H_
#define HSAP_TESTS_SUPPORT_EMULATED_TENSOR_MAP_H_

#include <cstdint>
#include <cstring>

namespace hsap_emu {

inline constexpr std::uint32_t kEmuTensorMapMagic = 0x414d5448u;  // "HTMA"
inline constexpr int kEmuCuErrorInvalidValue = 1;                 // CUDA_ERROR_INVALID_VALUE
inline constexpr int kEmuCuErrorNotSupported = 801;               // CUDA_ERROR_NOT_SUPPORTED

struct EmuTensorMap {
  std::uint32_t magic;
  std::uint8_t dtype;  // CUtensorMapDataType
  std::uint8_t rank;
  std::uint8_t interleave;  // CUtensorMapInterleave
  std::uint8_t swizzle;     // CUtensorMapSwizzle
  std::uint8_t l2_promotion;
  std::uint8_t oob_fill;  // CUtensorMapFloatOOBfill
  std::uint8_t element_bytes;
  std::uint8_t reserved0;
  std::uint64_t address;
  std::uint64_t dims[5];
  std::uint64_t strides[5];  // bytes; strides[0] is the element size, strides[i] the driver's
                             // globalStrides[i - 1]
  std::uint16_t box[5];
  std::uint8_t element_strides[5];
};
static_assert(sizeof(EmuTensorMap) <= 128, "a CUtensorMap holds 128 bytes");

// CUtensorMapDataType's element size in bytes (cuda.h's table); 0 for the packed types and
// for values outside the enum.
inline int EmuTensorMapElementBytes(int dtype) {
  static constexpr int kBytes[] = {1, 2, 4, 4, 8, 8, 2, 4, 8, 2, 4, 4, 4};
  return dtype >= 0 && dtype < 13 ? kBytes[dtype] : 0;
}
// FLOAT16, FLOAT32, FLOAT64, BFLOAT16, FLOAT32_FTZ, TFLOAT32, TFLOAT32_FTZ.
inline bool EmuTensorMapIsFloat(int dtype) { return dtype >= 6 && dtype <= 12; }

// cuTensorMapEncodeTiled of the emulated driver: 0 (CUDA_SUCCESS), or the error the driver
// documents for the first requirement broken.
inline int EmuEncodeTiledTensorMap(void* tensor_map, int dtype, std::uint32_t rank,
                                   void* global_address, const std::uint64_t* global_dim,
                                   const std::uint64_t* global_strides,
                                   const std::uint32_t* box_dim,
                                   const std::uint32_t* element_strides, int interleave,
                                   int swizzle, int l2_promotion, int oob_fill) {
  constexpr int kInvalid = kEmuCuErrorInvalidValue;
  // "tensorMap address must be aligned to 64 bytes."
  if (tensor_map == nullptr || reinterpret_cast<std::uintptr_t>(tensor_map) % 64 != 0) {
    return kInvalid;
  }
  if (dtype >= 13 && dtype <= 15) return kEmuCuErrorNotSupported;  // packed types
  const int element = EmuTensorMapElementBytes(dtype);
  if (element == 0) return kInvalid;  // "has to be an enum from CUtensorMapDataType"
  // "tensorRank must be non-zero and less than or equal to the maximum supported
  // dimensionality of 5. If interleave is not CU_TENSOR_MAP_INTERLEAVE_NONE, then tensorRank
  // must additionally be greater than or equal to 3."
  if (interleave < 0 || interleave > 2) return kInvalid;
  if (rank == 0 || rank > 5 || (interleave != 0 && rank < 3)) return kInvalid;
  // "globalAddress ... must be 16 byte aligned ... When interleave is
  // CU_TENSOR_MAP_INTERLEAVE_32B, globalAddress must be 32 byte aligned."
  const auto address = reinterpret_cast<std::uintptr_t>(global_address);
  if (address % (interleave == 2 ? 32 : 16) != 0) return kInvalid;
  if (global_dim == nullptr || box_dim == nullptr || element_strides == nullptr ||
      (rank > 1 && global_strides == nullptr)) {
    return kInvalid;
  }
  for (std::uint32_t i = 0; i < rank; ++i) {
    // "globalDim ... must be non-zero and less than or equal to 2^32."
    if (global_dim[i] == 0 || global_dim[i] > (std::uint64_t{1} << 32)) return kInvalid;
    // "boxDim ... must be non-zero and less than or equal to 256."
    if (box_dim[i] == 0 || box_dim[i] > 256) return kInvalid;
    // "elementStrides ... must be non-zero and less than or equal to 8."
    if (element_strides[i] == 0 || element_strides[i] > 8) return kInvalid;
  }
  for (std::uint32_t i = 0; i + 1 < rank; ++i) {
    // "globalStrides ... must be a multiple of 16 and less than 2^40 ... When interleave is
    // CU_TENSOR_MAP_INTERLEAVE_32B, the strides must be a multiple of 32."
    const std::uint64_t s = global_strides[i];
    if (s % (interleave == 2 ? 32 : 16) != 0 || s >= (std::uint64_t{1} << 40)) return kInvalid;
  }
  const std::uint64_t inner_bytes = std::uint64_t{box_dim[0]} * static_cast<unsigned>(element);
  // "When interleave is CU_TENSOR_MAP_INTERLEAVE_NONE, { boxDim[0] *
  // elementSizeInBytes( tensorDataType ) } must be a multiple of 16 bytes."
  if (interleave == 0 && inner_bytes % 16 != 0) return kInvalid;
  if (swizzle >= 4 && swizzle <= 6) return kEmuCuErrorNotSupported;  // 128B_ATOM_* (sm_100)
  if (swizzle < 0 || swizzle > 6) return kInvalid;
  // "When interleave is CU_TENSOR_MAP_INTERLEAVE_NONE and swizzle is not
  // CU_TENSOR_MAP_SWIZZLE_NONE, the bounding box inner dimension ... must be less than or
  // equal to the swizzle size" (32, 64, 128 bytes).
  if (interleave == 0 && swizzle != 0 && inner_bytes > (16u << swizzle)) return kInvalid;
  // "When interleave is CU_TENSOR_MAP_INTERLEAVE_32B, swizzle must be
  // CU_TENSOR_MAP_SWIZZLE_32B."
  if (interleave == 2 && swizzle != 1) return kInvalid;
  if (l2_promotion < 0 || l2_promotion > 3) return kInvalid;
  // "CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA can only be used when tensorDataType
  // represents a floating-point data type."
  if (oob_fill < 0 || oob_fill > 1 || (oob_fill == 1 && !EmuTensorMapIsFloat(dtype))) {
    return kInvalid;
  }
  EmuTensorMap m;
  std::memset(&m, 0, sizeof(m));
  m.magic = kEmuTensorMapMagic;
  m.dtype = static_cast<std::uint8_t>(dtype);
  m.rank = static_cast<std::uint8_t>(rank);
  m.interleave = static_cast<std::uint8_t>(interleave);
  m.swizzle = static_cast<std::uint8_t>(swizzle);
  m.l2_promotion = static_cast<std::uint8_t>(l2_promotion);
  m.oob_fill = static_cast<std::uint8_t>(oob_fill);
  m.element_bytes = static_cast<std::uint8_t>(element);
  m.address = address;
  m.strides[0] = static_cast<std::uint64_t>(element);
  for (std::uint32_t i = 0; i < rank; ++i) {
    m.dims[i] = global_dim[i];
    m.box[i] = static_cast<std::uint16_t>(box_dim[i]);
    m.element_strides[i] = static_cast<std::uint8_t>(element_strides[i]);
    if (i > 0) m.strides[i] = global_strides[i - 1];
  }
  std::memset(tensor_map, 0, 128);
  std::memcpy(tensor_map, &m, sizeof(m));
  return 0;
}

// The fields of an encoded map; false when the 128 bytes at `map` are not one.
inline bool EmuDecodeTensorMap(const void* map, EmuTensorMap& out) {
  std::memcpy(&out, map, sizeof(out));
  return out.magic == kEmuTensorMapMagic && out.rank >= 1 && out.rank <= 5;
}

}  // namespace hsap_emu

#endif  // HSAP_TESTS_SUPPORT_EMULATED_TENSOR_MAP_H_
