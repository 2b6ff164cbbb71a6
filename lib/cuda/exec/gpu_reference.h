// The reference attention on a GPU: what ReferenceForward/ReferenceBackward (fp64) and
// NaiveForward/NaiveBackward (same precision) of attention/reference.h compute, for rows far
// too long for the host (a 32K-token row of 16 heads at head dim 128 is ~1.5e13 FLOP forward
// and backward), by the kernels of jit/device/hsap_reference.cuh.
//
// Same semantics as the host functions: the mask read off the layout's slices (documents of
// every mask kind, or arbitrary slices), the GQA map of dims.KvHead, q/k/v/dout in the storage
// dtype converted exactly on load, fp64 results in the host structs' layouts (lse -inf and out
// 0 where a query sees no key). The exact results differ from the host's only in the order of
// fp64 sums (about 1e-16 relative; the emulator test holds them to 1e-12 of each tensor's
// largest magnitude); the rounded ones repeat the host's operations in the host's order, so
// they are equal bit for bit where expf/logf are (the emulator), and on a GPU differ only
// where its expf/logf round differently (the same-precision error they stand for is the
// same).
//
// Measured on one H200 (bf16, one causal document of 32768 tokens, 16 heads, head dim 128, all
// four tensors): exact forward 1.2 s, exact forward and backward 3.6 s, with the rounded
// results 11 s (uploads and downloads included); the rounded bf16/fp16 results equal the host's
// bit for bit on the rows of tests/lib/cuda/exec/gpu_reference_test.cc.
//
// Layers, each usable alone:
//   - BuildRefIntervals: the visibility lists the kernels take, built on the host;
//   - ReferenceKernels: the launches of the eight kernels (JIT-compiled on a GPU by
//     LoadJitReferenceKernels; the tests run the same kernels in the CUDA emulator);
//   - RunGpuReference: uploads to a Device, launches, downloads the results;
//   - GpuReference: RunGpuReference on the current CUDA device with the JIT kernels.
#ifndef HSAP_LIB_CUDA_EXEC_GPU_REFERENCE_H_
#define HSAP_LIB_CUDA_EXEC_GPU_REFERENCE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attention/dtype.h"
#include "attention/layout.h"
#include "attention/reference.h"
#include "jit/device/hsap_reference.cuh"
#include "jit/reference_kernels.h"
#include "lib/cuda/runtime/device.h"

namespace hsap::cuda {

// The intervals of hsap_dev::RefIntervals, on the host. Rows are tokens of one axis: queries
// (their visible keys) or keys (the queries that see them). Each row's intervals are sorted,
// disjoint and maximal (adjacent ones merged), and so is each tile's union over its `tile`
// rows. lo / hi hold the rows' intervals, then the tiles'.
struct RefRowIntervals {
  int tile = 0;
  std::vector<int64_t> row_offsets;   // [rows + 1]
  std::vector<int64_t> tile_offsets;  // [ceil(rows / tile) + 1]
  std::vector<int64_t> lo, hi;
};

// For every query the keys it sees (by_key = false), or for every key the queries that see it
// (by_key = true), from the layout's slices in O(sum over slices of their rows + intervals
// log intervals). tile >= 1.
RefRowIntervals BuildRefIntervals(const Layout& layout, bool by_key, int tile);

// A launch of a reference kernel: grid, threads, dynamic shared memory (hsap_reference.cuh).
struct RefLaunch {
  unsigned int grid_x = 0, grid_y = 0;
  int threads = hsap_dev::kRefThreads;
  int smem_bytes = 0;
  bool empty() const { return grid_x == 0 || grid_y == 0; }
};
RefLaunch RefLaunchOf(jit::RefKernel kernel, jit::RefArith arith, int head_dim, long long tokens,
                      int heads_q, int heads_kv);

// The eight kernels of one (dtype, head dim), launched on stream `s` with the grids of
// RefLaunchOf.
class ReferenceKernels {
 public:
  virtual ~ReferenceKernels() = default;
  virtual DType dtype() const = 0;
  virtual int head_dim() const = 0;
  virtual absl::Status Forward(jit::RefArith arith, const hsap_dev::RefFwdParams& p,
                               cudaStream s) const = 0;
  virtual absl::Status RowDot(jit::RefArith arith, const hsap_dev::RefRowDotParams& p,
                              cudaStream s) const = 0;
  virtual absl::Status Dq(jit::RefArith arith, const hsap_dev::RefBwdParams& p,
                          cudaStream s) const = 0;
  virtual absl::Status DkDv(jit::RefArith arith, const hsap_dev::RefBwdParams& p,
                            cudaStream s) const = 0;
};

// Compiles (NVRTC, through CompileCache::Global()) and loads the kernels on the current CUDA
// device. Unimplemented without a CUDA device or NVRTC; InvalidArgument for a head dim the
// kernels do not take (jit::ValidateRefHeadDim).
absl::StatusOr<std::unique_ptr<ReferenceKernels>> LoadJitReferenceKernels(DType dtype,
                                                                          int head_dim);

struct GpuReferenceOptions {
  bool backward = true;  // dq, dk, dv as well (dout must then be given)
  bool rounded = true;   // the same-precision results as well (NaiveForward/Backward)
};

struct GpuReferenceResult {
  ReferenceForwardResult forward;        // ReferenceForward's
  ReferenceGradients backward;           // ReferenceBackward's; empty without backward
  ReferenceForwardResult naive_forward;  // NaiveForward's; empty without rounded
  ReferenceGradients naive_backward;     // NaiveBackward's; empty without rounded or backward
  double seconds = 0;                    // wall time: uploads, kernels, downloads
};

// The references of `layout` for `in` (q, k, v, and dout [T, heads_q, D], all in in.dtype;
// host or device pointers: they are copied with cudaMemcpyDefault semantics) on `device` with
// `kernels` (whose dtype and head dim must be in's). Uses about
// 8 * T * (3 * heads_q + 2 * heads_kv) * D bytes of device memory besides copies of the inputs,
// and frees it all before returning. InvalidArgument for inconsistent arguments; the
// device's or a launch's error otherwise.
absl::StatusOr<GpuReferenceResult> RunGpuReference(Device& device, const ReferenceKernels& kernels,
                                                   const Layout& layout, const ReferenceInputs& in,
                                                   const void* dout,
                                                   const GpuReferenceOptions& options = {});

// RunGpuReference on the current CUDA device (CreateCudaDevice) with LoadJitReferenceKernels.
// Unimplemented, saying what is missing, on a machine without a GPU.
absl::StatusOr<GpuReferenceResult> GpuReference(const Layout& layout, const ReferenceInputs& in,
                                                const void* dout,
                                                const GpuReferenceOptions& options = {});

}  // namespace hsap::cuda

#endif  // HSAP_LIB_CUDA_EXEC_GPU_REFERENCE_H_
