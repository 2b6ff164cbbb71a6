// The reference a bench row is checked against (bench-only code): the host's fp64 reference
// (attention/reference.h), or the same computation on the GPU (lib/cuda/exec/gpu_reference.h)
// for rows the host would take minutes or hours on.
//
// Either way a row's check gets the fp64 results (ref) and the same-precision ones (naive:
// every intermediate rounded to the storage dtype, NaiveForward/Backward), so the tolerance
// rule of the checks (attention/tolerance.h: |x - ref| <= 2 * max |naive - ref| + floor) is
// the same rule whichever computed them. On the GPU both come from the kernels of
// jit/device/hsap_reference.cuh: fp64 results equal to the host's within 1e-12 of each tensor's
// largest magnitude, same-precision results equal to the host's where the GPU's expf/logf
// round as glibc's (bit for bit on the H200 for bf16 and fp16 rows; fp32 rows differ in the last
// bits and their same-precision error is the same to within a few per cent).
//
// Measured on one H200 (bf16, one causal document of 32768 tokens, 16 heads, head dim 128):
// fp64 forward and backward 3.6 s, with the same-precision results 11 s, uploads and downloads
// included; the host needs hours for that row.
//
// Choice (--reference auto|host|gpu of hsap_attn_perf):
//   host: the host, for rows up to host_max_gflop of forward work;
//   gpu:  the GPU, for rows up to gpu_max_gflop;
//   auto: the GPU on the cuda backends for rows above kAutoGpuAboveGflop (below it the
//         host is as quick as the GPU's first compile) up to gpu_max_gflop, else the host up
//         to host_max_gflop.
// Rows beyond the chosen reference's limit are not checked.
#ifndef HSAP_BENCH_GPU_REFERENCE_H_
#define HSAP_BENCH_GPU_REFERENCE_H_

#include <optional>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attention/layout.h"
#include "attention/reference.h"

namespace hsap::bench {

enum class ReferenceChoice { kAuto, kHost, kGpu };
// "auto", "host", "gpu"; InvalidArgument otherwise.
absl::StatusOr<ReferenceChoice> ParseReferenceChoice(absl::string_view name);

// Where a row is checked.
enum class ReferenceSite { kNone, kHost, kGpu };
absl::string_view ReferenceSiteName(ReferenceSite site);  // "-", "host", "gpu"

// Forward work (GFLOP) above which auto picks the GPU on the cuda backends.
inline constexpr double kAutoGpuAboveGflop = 0.5;

struct ReferencePolicy {
  ReferenceChoice choice = ReferenceChoice::kAuto;
  double host_max_gflop = 4.0;     // hsap_attn_perf --ref-max-gflop
  double gpu_max_gflop = 20000.0;  // hsap_attn_perf --gpu-ref-max-gflop (32K x 16 heads x d 128:
                                   // 4400)
};

// The site that checks a row of `fwd_gflop` forward work (4 * D * visible pairs * heads).
ReferenceSite PickReference(const ReferencePolicy& policy, bool cuda_backend, double fwd_gflop);

// One line for the bench's preamble saying which reference checks which rows.
std::string DescribeReferencePolicy(const ReferencePolicy& policy, bool cuda_backend);

struct RowReference {
  ReferenceSite site = ReferenceSite::kNone;
  ReferenceForwardResult ref, naive;  // out [T, Hq, D], lse [Hq, T]
  ReferenceGradients gref, gnaive;    // dq [T, Hq, D], dk and dv [T, Hkv, D]
  double seconds = 0;                 // wall time of the computation
};

// The fp64 and same-precision results of a row at `site` (kHost or kGpu): in.q/k/v and dout
// [T, Hq, D] in in.dtype on the host. On the GPU: Unimplemented, saying what is missing, on a
// machine without one; the device's error otherwise.
absl::StatusOr<RowReference> ComputeRowReference(ReferenceSite site, const Layout& layout,
                                                 const ReferenceInputs& in, const void* dout);

// A row's reference under `policy`, what the bench checks the row against: the one
// PickReference chooses, computed by `compute` (ComputeRowReference for the row, in the
// bench). When the GPU's fails, *gpu_error keeps its message and the GPU is not tried again
// on later rows (they are larger); such rows get the host's when within
// policy.host_max_gflop. `ref` is empty when the row is not checked; `note` says why, or why
// the host stood in for the GPU (empty otherwise): the GPU's error on the row it failed on,
// "failed on an earlier row" after.
struct ObtainedReference {
  std::optional<RowReference> ref;
  std::string note;
};
ObtainedReference ObtainRowReference(
    const ReferencePolicy& policy, bool cuda_backend, double fwd_gflop,
    absl::FunctionRef<absl::StatusOr<RowReference>(ReferenceSite)> compute, std::string* gpu_error);

}  // namespace hsap::bench

#endif  // HSAP_BENCH_GPU_REFERENCE_H_
