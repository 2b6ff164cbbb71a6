#include "bench/gpu_reference.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/status_macros.h"
#include "lib/cuda/exec/gpu_reference.h"

namespace hsap::bench {

absl::StatusOr<ReferenceChoice> ParseReferenceChoice(absl::string_view name) {
  if (name == "auto") return ReferenceChoice::kAuto;
  if (name == "host") return ReferenceChoice::kHost;
  if (name == "gpu") return ReferenceChoice::kGpu;
  return absl::InvalidArgumentError(
      absl::StrCat("the reference is auto, host or gpu, not '", name, "'"));
}

absl::string_view ReferenceSiteName(ReferenceSite site) {
  switch (site) {
    case ReferenceSite::kHost:
      return "host";
    case ReferenceSite::kGpu:
      return "gpu";
    case ReferenceSite::kNone:
      break;
  }
  return "-";
}

ReferenceSite PickReference(const ReferencePolicy& policy, bool cuda_backend, double fwd_gflop) {
  const bool host_ok = fwd_gflop <= policy.host_max_gflop;
  const bool gpu_ok = fwd_gflop <= policy.gpu_max_gflop;
  switch (policy.choice) {
    case ReferenceChoice::kHost:
      return host_ok ? ReferenceSite::kHost : ReferenceSite::kNone;
    case ReferenceChoice::kGpu:
      return gpu_ok ? ReferenceSite::kGpu : ReferenceSite::kNone;
    case ReferenceChoice::kAuto:
      if (cuda_backend && fwd_gflop > kAutoGpuAboveGflop && gpu_ok) return ReferenceSite::kGpu;
      return host_ok ? ReferenceSite::kHost : ReferenceSite::kNone;
  }
  return ReferenceSite::kNone;
}

std::string DescribeReferencePolicy(const ReferencePolicy& policy, bool cuda_backend) {
  const std::string host = absl::StrFormat(
      "the host's fp64 reference (attention/reference.h) on rows up to %g GFLOP of forward work",
      policy.host_max_gflop);
  const std::string gpu = absl::StrFormat(
      "the fp64 reference on the GPU (jit/device/hsap_reference.cuh) on rows up to %g GFLOP",
      policy.gpu_max_gflop);
  switch (policy.choice) {
    case ReferenceChoice::kHost:
      return absl::StrCat("reference host: ", host);
    case ReferenceChoice::kGpu:
      return absl::StrCat("reference gpu: ", gpu);
    case ReferenceChoice::kAuto:
      break;
  }
  if (!cuda_backend) return absl::StrCat("reference auto: ", host);
  return absl::StrFormat("reference auto: %s above %g GFLOP, else %s", gpu, kAutoGpuAboveGflop,
                         host);
}

absl::StatusOr<RowReference> ComputeRowReference(ReferenceSite site, const Layout& layout,
                                                 const ReferenceInputs& in, const void* dout) {
  RowReference r;
  r.site = site;
  const absl::Time start = absl::Now();
  switch (site) {
    case ReferenceSite::kHost:
      r.ref = ReferenceForward(layout, in);
      r.naive = NaiveForward(layout, in);
      r.gref = ReferenceBackward(layout, in, dout);
      r.gnaive = NaiveBackward(layout, in, dout);
      break;
    case ReferenceSite::kGpu: {
      HSAP_ASSIGN_OR_RETURN(cuda::GpuReferenceResult g, cuda::GpuReference(layout, in, dout));
      r.ref = std::move(g.forward);
      r.naive = std::move(g.naive_forward);
      r.gref = std::move(g.backward);
      r.gnaive = std::move(g.naive_backward);
      break;
    }
    case ReferenceSite::kNone:
      return absl::InvalidArgumentError("no reference site for this row");
  }
  r.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  return r;
}

namespace {

// Why PickReference left a row of `fwd_gflop` unchecked: the limit it is beyond.
std::string BeyondLimitNote(const ReferencePolicy& policy, bool cuda_backend, double fwd_gflop) {
  const std::string host = absl::StrFormat("--ref-max-gflop %g", policy.host_max_gflop);
  const std::string gpu = absl::StrFormat("--gpu-ref-max-gflop %g", policy.gpu_max_gflop);
  std::string limit;
  switch (policy.choice) {
    case ReferenceChoice::kHost:
      limit = host;
      break;
    case ReferenceChoice::kGpu:
      limit = gpu;
      break;
    case ReferenceChoice::kAuto:
      limit = cuda_backend ? absl::StrCat(host, " and ", gpu) : host;
      if (!cuda_backend && fwd_gflop <= policy.gpu_max_gflop) {
        absl::StrAppend(&limit, "; --reference gpu checks it on a GPU");
      }
      break;
  }
  return absl::StrFormat("not checked: %.6g GFLOP of forward work, above %s", fwd_gflop, limit);
}

}  // namespace

ObtainedReference ObtainRowReference(
    const ReferencePolicy& policy, bool cuda_backend, double fwd_gflop,
    absl::FunctionRef<absl::StatusOr<RowReference>(ReferenceSite)> compute,
    std::string* gpu_error) {
  ObtainedReference out;
  const ReferenceSite site = PickReference(policy, cuda_backend, fwd_gflop);
  if (site == ReferenceSite::kNone) {
    out.note = BeyondLimitNote(policy, cuda_backend, fwd_gflop);
    return out;
  }
  if (site == ReferenceSite::kGpu) {
    // The first failure is said in full; later rows refer to it.
    std::string failed = "the GPU reference failed on an earlier row";
    if (gpu_error->empty()) {
      absl::StatusOr<RowReference> gpu = compute(ReferenceSite::kGpu);
      if (gpu.ok()) {
        out.ref = *std::move(gpu);
        return out;
      }
      *gpu_error = gpu.status().ToString();
      failed = absl::StrCat("the GPU reference failed (", *gpu_error, ")");
    }
    if (fwd_gflop > policy.host_max_gflop) {
      out.note = absl::StrFormat("not checked: %s, and %.6g GFLOP is above --ref-max-gflop %g",
                                 failed, fwd_gflop, policy.host_max_gflop);
      return out;
    }
    out.note = absl::StrCat(failed, "; the host's instead");
  }
  absl::StatusOr<RowReference> host = compute(ReferenceSite::kHost);
  if (!host.ok()) {
    out.note = absl::StrCat("not checked: the host reference failed (", host.status().ToString(),
                            ")", out.note.empty() ? "" : "; ", out.note);
    return out;
  }
  out.ref = *std::move(host);
  return out;
}

}  // namespace hsap::bench
