// The launch grids of the JIT CUDA kernels (the grids jit/device/hsap_params.cuh documents),
// as pure functions of the Params and the device's limits: no CUDA call, so that they are
// unit-tested and the emulated kernels of the tests launch the same grids as the GPU.
#ifndef HSAP_LIB_CUDA_EXEC_LAUNCH_GRID_H_
#define HSAP_LIB_CUDA_EXEC_LAUNCH_GRID_H_

#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "jit/device/hsap_params.cuh"

namespace hsap::cuda {

// CUDA's limits on a grid (every architecture the kernels support).
inline constexpr long long kMaxGridX = (1LL << 31) - 1;
inline constexpr long long kMaxGridY = 65535;

// Threads per CTA of the row-wise helper kernels (their __launch_bounds__).
inline constexpr int kHelperThreads = 256;

struct LaunchGrid {
  unsigned int x = 0, y = 0;

  // No CTA: there is nothing to launch (cuLaunchKernel would reject the grid).
  bool empty() const { return x == 0 || y == 0; }
  friend bool operator==(const LaunchGrid&, const LaunchGrid&) = default;
};

// The attention forward and backward: one CTA per (query block, query head), grid
// (num_blocks, heads_q); the kernels do not loop, so a grid that cannot hold the work is an
// error rather than a cap. Empty when either is zero; InvalidArgument when either is
// negative or beyond the grid's limits (num_blocks > 2^31 - 1, heads_q > 65535).
absl::StatusOr<LaunchGrid> AttentionGrid(long long num_blocks, long long heads_q);

// The row-wise helpers, whose loops are grid-stride: CTAs of kHelperThreads threads for
// `threads_wanted` threads of work, at least one (no work: one CTA that does nothing) and at
// most `max_ctas` (at least 1) and the grid's limit; grid.y is 1.
LaunchGrid HelperGrid(long long threads_wanted, long long max_ctas);

// HelperGrid for each helper kernel, by the threads of work its loop has: a warp per (row,
// head) for the delta, four threads per (row, head) for the init, a thread per element for
// convert and accumulate, a CTA per chunk for the chunk copies (empty without chunks).
LaunchGrid HelperGrid(const hsap_dev::DeltaParams& p, long long max_ctas);
LaunchGrid HelperGrid(const hsap_dev::InitParams& p, long long max_ctas);
LaunchGrid HelperGrid(const hsap_dev::ConvertParams& p, long long max_ctas);
LaunchGrid HelperGrid(const hsap_dev::AccumulateParams& p, long long max_ctas);
LaunchGrid HelperGrid(const hsap_dev::ChunksParams& p, long long max_ctas);
// The cuDNN engine's helpers: a warp per (entry row, head) for the merge, a thread per
// element for the Stats gather and the gradient add (empty without entries).
LaunchGrid HelperGrid(const hsap_dev::EntryMergeParams& p, long long max_ctas);
LaunchGrid HelperGrid(const hsap_dev::StatsGatherParams& p, long long max_ctas);
LaunchGrid HelperGrid(const hsap_dev::EntryAddParams& p, long long max_ctas);

// The fused forward: room for `copy_ctas` copy tasks plus as many CTAs as the largest step
// has work items (num_blocks x heads_q, at least one), within the launch's part of the
// resident CTAs, resident_ctas / share. The kernel hands work out by ticket, so its CTAs
// need not be co-resident (any one of them finishes the launch); the cap keeps each rank's
// kernel, whose CTAs spin on peers' flags while holding an SM, from crowding out the
// kernels of the ranks sharing the GPU. Empty without steps; ResourceExhausted when not even
// one CTA beyond the copy tasks fits, or when the launch has 2^31 tasks or more (tickets
// are 32-bit).
absl::StatusOr<LaunchGrid> FusedForwardGrid(absl::Span<const hsap_dev::FusedStep> steps,
                                            int heads_q, long long resident_ctas, int share,
                                            int copy_ctas);

// One launch of the sm_90a fused forward (fused_fwd_wgmma_kernel, hsap_params.cuh FusedCopy):
// the attention of one step (fwd; no blocks in the first launch) and the copy of the next
// (copy; parts 0 in the last launch), on `grid`.
struct FusedWgmmaLaunch {
  hsap_dev::FwdParams fwd{};
  hsap_dev::FusedCopy copy{};
  LaunchGrid grid;
};

// The sm_90a fused forward of `head` and `steps` as steps.size() + 1 launches, to run in this
// order on one stream: launch s (s <= steps.size()) copies step s into staging buffer s % 2
// in `copy_ctas` parts (none in the last) and attends step s - 1 from buffer (s - 1) % 2
// (nothing in the first). Each K/V row is heads_kv * head_dim elements of `element_bytes`.
// Empty without steps; InvalidArgument when copy_ctas < 1 or a launch's grid would exceed
// the limits (AttentionGrid).
absl::StatusOr<std::vector<FusedWgmmaLaunch>> FusedWgmmaLaunches(
    const hsap_dev::FusedFwdHead& head, absl::Span<const hsap_dev::FusedStep> steps, int copy_ctas,
    int head_dim, int element_bytes);

}  // namespace hsap::cuda

#endif  // HSAP_LIB_CUDA_EXEC_LAUNCH_GRID_H_
