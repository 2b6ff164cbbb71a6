// The TMA tensor maps of the sm_90a forward (jit/device/hsap_attention_wgmma_fwd.cuh): one per
// tensor of the forward's Params, q ([q_rows, heads_q, D]), k and v ([k_rows, heads_kv, D]),
// 16-bit elements, each a 3-D tiled map over (head dim, heads, rows) with boxes of 64 elements
// (128 bytes) x 1 head x `box_rows` rows (128 for Q, the kernel's key tile for K and V), the
// 128-byte swizzle and zero fill past the tensor's end. The kernel takes them by value after
// its Params (three `__grid_constant__ const hsap_dev::TensorMap`; TensorMapBytes has their
// size and alignment). Encoding is host work of a few microseconds per map, done per launch:
// the pointers and shapes change from one launch to the next.
#ifndef HSAP_LIB_CUDA_EXEC_WGMMA_TENSOR_MAPS_H_
#define HSAP_LIB_CUDA_EXEC_WGMMA_TENSOR_MAPS_H_

#include "absl/status/statusor.h"
#include "attention/dtype.h"
#include "jit/device/hsap_params.cuh"
#include "lib/cuda/runtime/cuda_loader.h"
#include "lib/cuda/runtime/tensor_map.h"

namespace hsap::cuda {

struct WgmmaForwardMaps {
  TensorMapBytes q, k, v;
};

// The maps for `p` (its q, k, v, row counts and head counts). InvalidArgument, naming the
// argument, when dtype is not bf16/f16, head_dim not 64, 128 or 256, key_tile_rows not in
// [16, 256], a row count above 2^31 - 1 (TMA coordinates are signed 32-bit), or a tensor the
// driver's rules refuse (EncodeTiledTensorMap: e.g. an address that is not 16-byte aligned).
absl::StatusOr<WgmmaForwardMaps> EncodeWgmmaForwardMaps(const CudaDriverApi& driver,
                                                        const hsap_dev::FwdParams& p, DType dtype,
                                                        int head_dim, int key_tile_rows);

struct WgmmaBackwardMaps {
  TensorMapBytes q, k, v, dout;
};

// The maps of the sm_90a backward (jit/device/hsap_attention_wgmma_bwd.cuh) for `p`: q and
// dout ([q_rows, heads_q, D]), k and v ([k_rows, heads_kv, D]), all in boxes of `box_rows`
// rows (jit::WgmmaBwdBoxRows of the kernel's stage tile), otherwise as the forward's; the
// kernel takes them after its Params in that order. InvalidArgument, naming the argument, as
// EncodeWgmmaForwardMaps (head_dim 64 or 128, box_rows in [16, 256]).
absl::StatusOr<WgmmaBackwardMaps> EncodeWgmmaBackwardMaps(const CudaDriverApi& driver,
                                                          const hsap_dev::BwdParams& p, DType dtype,
                                                          int head_dim, int box_rows);

}  // namespace hsap::cuda

#endif  // HSAP_LIB_CUDA_EXEC_WGMMA_TENSOR_MAPS_H_
