// The issue model of the tensor-core attention kernels: why they run where they run.
//
// The bounds of bench/roofline.h (tensor-core rate, shared memory, MUFU, ALU, each taken
// alone) predicted 440 TFLOP/s forward and 471 backward for the H200 rows that measured 137
// and 93 (docs/gpu_backend.md). What they miss is the instruction stream around the mma.sync
// instructions. This model counts it per warp and tile ("warp-tile": the 16 query rows of a
// warp against one key tile in the forward; the 16 keys of a warp against one query tile in
// the backward's key pass; 16 query rows against one 32-key tile in its dq pass), per pipe,
// from the tile shapes and the per-score / per-copy costs counted in the SASS that ptxas
// (CUDA 13) makes of hsap_attention_mma_{fwd,bwd}.cuh (the constants in roofline_issue.cc
// name the SASS they were counted from), and turns it into time on one warp scheduler:
//
//   busy(warp-tile) = sum over instructions of the cycles each holds its scheduler:
//     HMMA (mma.sync m16n8k16): 4096 FLOPs at the mma.sync share of the SM's tensor rate
//       (8 cycles on sm_90 at kMmaSyncFractionSm90 = 1/2 of the dense peak, 8 on an A100);
//     ALU (integer, logic, compares, selects, FMNMX/FSETP/FSEL): 2 (16 lanes per scheduler);
//     IMAD (the FMA pipe's heavy half): 2;  FP32 FMUL/FADD/FFMA/F2FP: 1 (32 lanes);
//     MUFU (ex2, rcp): 8 (16 results per clock per SM);  anything else (ldmatrix, cp.async,
//     shuffles, shared loads, branches, barriers): 1.
//   A scheduler holds W = CTAs/SM * warps/CTA / 4 warps; a round (each of them one
//   warp-tile) takes max(W * busy, busy + exposed), exposed being the latency a warp waits
//   out per tile that no instruction of its own fills (barriers, the shuffle rounds, a global
//   load on the CTA's critical path). Summing the pipes, rather than overlapping them, is the
//   assumption that at W = 2 (241-245 registers: 2 CTAs of 4 warps per SM) and with the
//   dependent chains of these loops the scheduler seldom finds an instruction of another pipe
//   to issue; the "overlapped" figure (the busiest pipe alone) is printed beside it as the
//   ceiling of perfect overlap.
//
// A workload's figure then follows from how many warp-tiles of each kind its work list
// makes (CountWarpTiles: exactly the kernels' walks) and the useful FLOPs of its visible
// pairs. No term is fitted to a measurement; tests/bench/roofline_test.cc holds the
// predictions to the H200 figures.
#ifndef HSAP_BENCH_ROOFLINE_ISSUE_H_
#define HSAP_BENCH_ROOFLINE_ISSUE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "attention/worklist.h"
#include "bench/roofline.h"
#include "jit/codegen_cuda.h"

namespace hsap::bench {

// Instructions of one warp-tile, per pipe, and the latency it exposes.
struct WarpTileMix {
  std::string name;
  double hmma = 0;     // mma.sync m16n8k16
  double ldsm = 0;     // ldmatrix (x4 or x2)
  double mufu = 0;     // ex2 / rcp
  double alu = 0;      // integer, logic, compare, select, FMNMX, FSETP, FSEL
  double imad = 0;     // IMAD / IMUL
  double fp32 = 0;     // FMUL, FADD, FFMA, F2FP
  double other = 0;    // cp.async, shuffles, shared loads/stores, branches, barriers, ...
  double exposed = 0;  // cycles of latency per warp-tile that no own instruction fills
  double useful_flops = 0;  // of the visible-pair products this warp-tile advances
};

// What the kernels' code does per copy, score and tile: the code as it is now
// (CurrentKernelCode) and as it was when the H200 figures were measured (MeasuredKernelCode,
// commit 32fe21d: the figures the test holds the model to). Each flag is one change of the
// ranked plan (ForwardChanges, BackwardKeyChanges); the SASS each cost was counted from is
// named in roofline_issue.cc.
struct KernelCode {
  bool generic_copy = true;     // the 64-bit row walk per 16-byte cp.async (fwd and bwd)
  bool mask_every_tile = true;  // forward: per-score band test on every tile
  // Forward: the per-score exp2f with its range check, the scale apart, NaN/+inf and saw-key
  // flags per score, 64-bit band test and every thread walking the key tiles (true), or the
  // current core counted together (false): FoldedOnlineSoftmax, TileMask, thread 0's walk.
  bool per_score_softmax = true;
  bool bwd_accurate_exp = true;   // backward (both passes): expf per element
  bool bwd_walk_in_loop = true;   // backward key pass: thread 0 walks between barriers
  // Forward: m16 row blocks per warp. 1: the 64-row tiles the H200 figures ran (64 keys up to
  // head dim 128, 32 above); 2: 128-row tiles (FlashAttention-2's shape) with the key tile of
  // the shipped tiles; 0: the tiles ChooseCudaTiles picks (the current code).
  int row_blocks = 1;
  // Backward: query rows of the key pass's tiles (16: what the H200 figures ran at head dim
  // 128; 0: the tiles ChooseCudaTiles picks, 32 there now).
  int bwd_block_m = 16;
};
KernelCode MeasuredKernelCode();
KernelCode CurrentKernelCode();

// The tiles under `code` (row_blocks, bwd_block_m above): `shipped` (ChooseCudaTiles) with the
// forward's and the backward's tiles and shared memory set to the code's.
jit::CudaTiles TilesOf(const jit::CudaKernelConfig& config, jit::CudaTiles shipped,
                       const KernelCode& code);
// Scheduler cycles per instruction of each pipe (see the top of this file).
struct PipeCycles {
  double hmma = 6, alu = 2, imad = 2, fp32 = 1, mufu = 8, other = 1;
};
PipeCycles PipeCyclesOf(const GpuSpec& gpu);

// The cycles one warp-tile holds its scheduler, term by term.
struct WarpTileTime {
  double tensor = 0, ldsm = 0, mufu = 0, alu = 0, imad = 0, fp32 = 0, other = 0;
  double busy = 0;        // their sum
  double overlapped = 0;  // the largest single pipe (issue counted as a pipe of 1/cycle)
};
WarpTileTime TimeOf(const WarpTileMix& mix, const PipeCycles& pipes);

// The mixes of the shipped tensor-core kernels for `config` with `tiles` (tensor-core tiles:
// tiles.bwd_tensor_core for the backward ones), of `code` (default: the current one).
// The forward's mix is that of a whole tile (every score visible, no per-score test) unless
// `cut` or the code tests every tile (mask_every_tile).
WarpTileMix ForwardWarpTileMix(const jit::CudaKernelConfig& config, const jit::CudaTiles& tiles,
                               const KernelCode& code = CurrentKernelCode(), bool cut = false);
WarpTileMix BackwardKeyWarpTileMix(const jit::CudaKernelConfig& config, const jit::CudaTiles& tiles,
                                   const KernelCode& code = CurrentKernelCode());
WarpTileMix BackwardQueryWarpTileMix(const jit::CudaKernelConfig& config,
                                     const jit::CudaTiles& tiles,
                                     const KernelCode& code = CurrentKernelCode());
// One step of the key pass's walk (a block or a segment looked at by thread 0), charged to
// every warp of the CTA (they wait for it at the barrier).
WarpTileMix BackwardKeyWalkStepMix();

// Warp-tiles of one head that the kernels' walks visit for `work` (per head; multiply by
// heads): forward (kBM-row chunks x kBN-key tiles per segment, one per warp), the backward's
// key pass (per kBN-key tile, the kBM-row query tiles that see it) and dq pass (per kQM-row
// chunk, the kDqBN-key tiles), and the visible pairs.
struct WarpTileCounts {
  double fwd = 0, bwd_key = 0, bwd_query = 0;
  // Forward warp-tiles that take the per-score test: the band cuts the CTA's tile, the tile
  // holds fewer than kBN keys, or the warp's 16 rows are not all valid (the rest are whole).
  double fwd_cut = 0;
  // Steps of the key pass's walk (next_key_tile): every key item scans every block and
  // segment of its query heads, thread 0 alone while the CTA waits at a barrier.
  double bwd_key_walk_steps = 0;
  double pairs = 0;
};
WarpTileCounts CountWarpTiles(const WorkList& work, const jit::CudaKernelConfig& config,
                              const jit::CudaTiles& tiles, int64_t k_rows);

// The predicted rate of one kernel over a workload.
struct IssuePrediction {
  int warps_per_scheduler = 0;
  WarpTileTime per_tile;   // of the (first) mix
  double round_cycles = 0; // per scheduler and round, of the (first) mix
  double tflops = 0;       // useful FLOPs / time, whole GPU
  double overlapped_tflops = 0;  // with the pipes perfectly overlapped
  std::string bound;       // "scheduler (serial pipes)" or "latency"
};

// `mixes[i]` runs `warp_tiles[i]` times (all heads); `flops` are the useful FLOPs of the
// whole workload; `registers`, `threads`, `smem` size the occupancy.
IssuePrediction PredictIssue(const std::vector<WarpTileMix>& mixes,
                             const std::vector<double>& warp_tiles, double flops, int threads,
                             int registers, int smem, const GpuSpec& gpu);

// The forward / backward prediction of `config` on a document layout given by its
// cu_seqlens (causal documents), `heads` query heads = kv heads.
absl::StatusOr<IssuePrediction> PredictForwardOnDocuments(const jit::CudaKernelConfig& config,
                                                          int registers,
                                                          const std::vector<int64_t>& cu_seqlens,
                                                          int heads, const GpuSpec& gpu,
                                                          const KernelCode& code = CurrentKernelCode());
absl::StatusOr<IssuePrediction> PredictBackwardOnDocuments(const jit::CudaKernelConfig& config,
                                                           int registers,
                                                           const std::vector<int64_t>& cu_seqlens,
                                                           int heads, const GpuSpec& gpu,
                                                           const KernelCode& code = CurrentKernelCode());

// Full-tile rates of one kernel without a workload (every warp-tile full, no tail): the
// forward, and the backward's key and dq passes together (per visible pair: one key-pass
// warp-tile per 16 x kBM pairs, one dq warp-tile per 16 x kDqBN).
double ForwardSchedulerTflops(const jit::CudaKernelConfig& config, const jit::CudaTiles& tiles,
                              int registers, const GpuSpec& gpu,
                              const KernelCode& code = CurrentKernelCode());
double BackwardSchedulerTflops(const jit::CudaKernelConfig& config, const jit::CudaTiles& tiles,
                               int registers, const GpuSpec& gpu,
                               const KernelCode& code = CurrentKernelCode());

// A change to the kernels and the mix it would leave: the ranked plan of hsap_roofline.
struct MixChange {
  std::string name;
  std::string what;  // one line: what changes in the kernel
};
// The candidate changes not yet made to the current code, each applied alone (then all of
// them together, then with 32 rows per warp), with the mix each would leave.
struct ChangedMix {
  MixChange change;
  WarpTileMix mix;
};
std::vector<ChangedMix> ForwardChanges(const jit::CudaKernelConfig& config,
                                       const jit::CudaTiles& tiles);
std::vector<ChangedMix> BackwardKeyChanges(const jit::CudaKernelConfig& config,
                                           const jit::CudaTiles& tiles);

}  // namespace hsap::bench

#endif  // HSAP_BENCH_ROOFLINE_ISSUE_H_
