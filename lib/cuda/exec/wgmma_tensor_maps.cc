#include "lib/cuda/exec/wgmma_tensor_maps.h"

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace hsap::cuda {
namespace {

constexpr int kQueryTileRows = 128;  // WgmmaFwdShape::kBM
constexpr char kFwd[] = "sm_90a forward";
constexpr char kBwd[] = "sm_90a backward";

// One tensor [rows, heads, head_dim] of 16-bit elements.
absl::StatusOr<TensorMapBytes> EncodeOne(const CudaDriverApi& driver, const char* kernel,
                                         const char* what, const void* base, long long rows,
                                         int heads, int head_dim, TensorMapDataType type,
                                         int box_rows) {
  if (rows < 0 || rows > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat(kernel, ": ", what, " has ", rows,
                     " rows; TMA coordinates are signed 32-bit, so at most 2^31 - 1 rows per "
                     "call (split the batch)"));
  }
  if (heads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(kernel, ": ", what, " has ", heads, " heads (must be >= 1)"));
  }
  TiledTensorMapSpec spec;
  spec.dtype = type;
  spec.global_address = base;
  // A tensor without rows is never read (no work item names a row of it); the map still
  // needs a non-empty extent.
  spec.global_dims = {static_cast<uint64_t>(head_dim), static_cast<uint64_t>(heads),
                      static_cast<uint64_t>(rows > 0 ? rows : 1)};
  spec.global_strides = {static_cast<uint64_t>(head_dim) * 2,
                         static_cast<uint64_t>(heads) * static_cast<uint64_t>(head_dim) * 2};
  spec.box_dims = {64, 1, static_cast<uint32_t>(box_rows)};
  spec.swizzle = TensorMapSwizzle::k128B;
  spec.l2_promotion = TensorMapL2Promotion::k128B;
  spec.oob_fill = TensorMapOobFill::kZero;
  absl::StatusOr<TensorMapBytes> map = EncodeTiledTensorMap(driver, spec);
  if (!map.ok()) {
    return absl::Status(map.status().code(), absl::StrCat(kernel, ", tensor map of ", what, ": ",
                                                          map.status().message()));
  }
  return map;
}

// What both kernels' maps check first: 16-bit elements, a head dim the kernel takes
// (`head_dims`, spelled `takes` in the message), and a tile (`tile`: "key" or "query") of
// 16..256 rows (a TMA box dimension).
absl::Status CheckMapInputs(const char* kernel, DType dtype, int head_dim,
                            std::initializer_list<int> head_dims, const char* takes,
                            const char* tile, int tile_rows) {
  if (dtype != DType::kBF16 && dtype != DType::kF16) {
    return absl::InvalidArgumentError(
        absl::StrCat(kernel, ": dtype ", std::string(DTypeName(dtype)), " (it takes bf16 or f16)"));
  }
  if (std::find(head_dims.begin(), head_dims.end(), head_dim) == head_dims.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat(kernel, ": head dim ", head_dim, " (it takes ", takes, ")"));
  }
  if (tile_rows < 16 || tile_rows > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat(kernel, ": ", tile, " tile of ", tile_rows, " rows (must be in [16, 256])"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<WgmmaForwardMaps> EncodeWgmmaForwardMaps(const CudaDriverApi& driver,
                                                        const hsap_dev::FwdParams& p, DType dtype,
                                                        int head_dim, int key_tile_rows) {
  HSAP_RETURN_IF_ERROR(CheckMapInputs(kFwd, dtype, head_dim, {64, 128, 256}, "64, 128 or 256",
                                      "key", key_tile_rows));
  const TensorMapDataType type = TensorMapDataTypeOf(dtype);
  WgmmaForwardMaps maps;
  HSAP_ASSIGN_OR_RETURN(maps.q, EncodeOne(driver, kFwd, "q", p.q, p.q_rows, p.heads_q, head_dim,
                                          type, kQueryTileRows));
  HSAP_ASSIGN_OR_RETURN(maps.k, EncodeOne(driver, kFwd, "k", p.k, p.k_rows, p.heads_kv, head_dim,
                                          type, key_tile_rows));
  HSAP_ASSIGN_OR_RETURN(maps.v, EncodeOne(driver, kFwd, "v", p.v, p.k_rows, p.heads_kv, head_dim,
                                          type, key_tile_rows));
  return maps;
}

absl::StatusOr<WgmmaBackwardMaps> EncodeWgmmaBackwardMaps(const CudaDriverApi& driver,
                                                          const hsap_dev::BwdParams& p, DType dtype,
                                                          int head_dim, int box_rows) {
  HSAP_RETURN_IF_ERROR(
      CheckMapInputs(kBwd, dtype, head_dim, {64, 128}, "64 or 128", "TMA box", box_rows));
  const TensorMapDataType type = TensorMapDataTypeOf(dtype);
  WgmmaBackwardMaps maps;
  HSAP_ASSIGN_OR_RETURN(
      maps.q, EncodeOne(driver, kBwd, "q", p.q, p.q_rows, p.heads_q, head_dim, type, box_rows));
  HSAP_ASSIGN_OR_RETURN(
      maps.k, EncodeOne(driver, kBwd, "k", p.k, p.k_rows, p.heads_kv, head_dim, type, box_rows));
  HSAP_ASSIGN_OR_RETURN(
      maps.v, EncodeOne(driver, kBwd, "v", p.v, p.k_rows, p.heads_kv, head_dim, type, box_rows));
  HSAP_ASSIGN_OR_RETURN(maps.dout, EncodeOne(driver, kBwd, "dout", p.dout, p.q_rows, p.heads_q,
                                             head_dim, type, box_rows));
  return maps;
}

}  // namespace hsap::cuda
