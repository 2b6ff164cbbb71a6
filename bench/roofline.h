// An analytic roofline of the generated attention kernels: what a variant should reach on a
// GPU before it ever runs there (bench/hsap_roofline prints it; docs/gpu_backend.md explains
// the model).
//
// Per tile pair (kBM query rows x kBN keys of one head) the model counts, from the tile
// shapes and the math of the variant:
//   - FLOPs (4 kBM kBN D forward, 10 kBM kBN D backward: two and five matrix products);
//   - the K/V (forward) or Q/dO/dQ (backward) bytes a CTA streams in from L2/HBM, hence the
//     FLOPs per byte and the bound of HBM bandwidth if none of it hit L2;
//   - the shared-memory bytes the warps read (ldmatrix / fp32 loads), against 128 B/clk/SM;
//   - the exponentials (MUFU, 16/clk/SM) and the tensor-core issue rate: an mma.sync
//     m16n8k16 is 4096 FLOPs; on sm_90 mma.sync runs at an assumed fraction of the wgmma
//     peak (kMmaSyncFractionSm90, to be measured by bench/device_check.sh); the tensor-core
//     backward issues more products than the 5 useful ones (7 with deterministic dq, 11
//     above head dim 128 where two warps recompute S and dP), which lowers its issue bound;
// and the occupancy (CTAs per SM) from the registers of the resource report, the threads and
// the shared memory. The prediction is the smallest on-chip bound (issue, shared memory,
// MUFU, ALU): the grid runs the query blocks of one head next to each other, so their
// re-reads of a K/V tile hit L2. The HBM bound without any L2 reuse is printed beside it as
// the floor a cache-hostile schedule would fall to.
#ifndef HSAP_BENCH_ROOFLINE_H_
#define HSAP_BENCH_ROOFLINE_H_

#include <string>

#include "jit/codegen_cuda.h"

namespace hsap::bench {

struct GpuSpec {
  std::string name;
  int arch = 90;
  int sms = 132;
  double clock_ghz = 1.83;            // the clock of the quoted tensor-core peak
  double dense_16bit_tflops = 989.4;  // dense bf16/f16 tensor-core peak (wgmma on sm_90)
  double fp32_tflops = 66.9;          // FFMA peak
  double hbm_tb_per_s = 3.35;
};

GpuSpec H100Sxm();
GpuSpec H200();

// Share of the dense peak that mma.sync (the sm_80 instruction these kernels use) reaches on
// sm_90, where the full rate needs wgmma: the A100's rate per SM and clock (2048 FLOPs), half
// of Hopper's 4096. Derived, not measured here: FlashAttention-2 (mma.sync) reaches the same
// FLOPs per SM-clock on H100 (370 TFLOP/s forward, d 128, FlashAttention-3 paper, arXiv
// 2407.08608, Fig. 5) as on A100 (73 % of 312, FlashAttention-2 paper, arXiv 2307.08691), which
// a tensor rate 4/3 of the A100's per clock would have lifted by about 1.2x; the "about 2/3"
// that Hopper write-ups quote for mma.sync is the upper end (docs/gpu_backend.md).
inline constexpr double kMmaSyncFractionSm90 = 0.5;

struct Roofline {
  double flops_per_tile = 0;         // one tile pair
  double flops_per_global_byte = 0;  // per byte streamed from L2/HBM
  double flops_per_smem_byte = 0;    // per shared-memory byte read by the warps
  int ctas_per_sm = 0;               // jit::CudaCtasPerSm
  std::string occupancy_limiter;
  // Bounds in TFLOP/s (of visible pairs, whole GPU).
  double peak_tflops = 0;       // the math's peak (tensor cores or FFMA)
  double issue_tflops = 0;      // tensor-core issue rate of mma.sync (or FFMA peak)
  double smem_tflops = 0;       // shared-memory bandwidth
  double mufu_tflops = 0;       // exponentials
  double alu_tflops = 0;        // fp32 softmax arithmetic (scale, mask, max, sums, rescale)
  double hbm_tflops = 0;        // HBM with no L2 reuse (not part of the prediction)
  // The issue model (bench/roofline_issue.h) on full tiles: the scheduler's serial pipes.
  // Tensor-core kernels only (0 otherwise).
  double scheduler_tflops = 0;
  double predicted_tflops = 0;  // the smallest on-chip bound, the scheduler's included
  std::string bound;            // which one
};

// The forward ("fwd") or backward ("bwd") roofline of `config` with its `tiles`, for a kernel
// of `registers` registers per thread (the resource report's figure) whose math is tensor
// cores or not (CudaKernelEntry::tensor_core).
Roofline ForwardRoofline(const jit::CudaKernelConfig& config, const jit::CudaTiles& tiles,
                         int registers, bool tensor_core, const GpuSpec& gpu);
Roofline BackwardRoofline(const jit::CudaKernelConfig& config, const jit::CudaTiles& tiles,
                          int registers, bool tensor_core, const GpuSpec& gpu);

}  // namespace hsap::bench

#endif  // HSAP_BENCH_ROOFLINE_H_
