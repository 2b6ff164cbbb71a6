// Prints the analytic roofline (bench/roofline.h) of every shipped CUDA kernel variant's
// forward and backward on H100 SXM and H200: what each should reach before it runs on a
// GPU. Registers come from ptxas' report of an NVRTC compile (through the JIT cache); without
// NVRTC the occupancy assumes 128 registers per thread and says so.
//
//   hsap_roofline [sm_90|sm_80 ...]          (default: sm_90)
//   hsap_roofline --sweep [sm_90|sm_80 ...]  registers and spills of every kernel of every
//                                            tensor-core configuration the generator makes
//                                            (head dims 64..256, bf16/f16, GQA 1/8, band or
//                                            full, deterministic or atomic dq; the fused
//                                            forward for bf16, GQA 1, deterministic dq)
#include <algorithm>
#include <cstdio>
#include <utility>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/roofline.h"
#include "bench/roofline_issue.h"
#include "jit/cache.h"
#include "jit/codegen_cuda.h"
#include "jit/cuda_kernels.h"

namespace hsap::bench {
namespace {

constexpr int kAssumedRegisters = 128;

void PrintVariant(const jit::CudaKernelConfig& c, const std::vector<GpuSpec>& gpus) {
  absl::StatusOr<jit::CompiledCudaKernels> k =
      jit::CompileCudaKernels(c, &jit::CompileCache::Global());
  absl::StatusOr<std::vector<jit::CudaKernelResources>> res =
      k.ok() ? k->Resources() : absl::StatusOr<std::vector<jit::CudaKernelResources>>(k.status());
  absl::StatusOr<jit::CudaTiles> t = jit::ChooseCudaTiles(c);
  if (!t.ok()) {
    std::printf("%-34s %s\n", c.Name().c_str(), t.status().ToString().c_str());
    return;
  }
  for (const char* role : {"fwd", "bwd"}) {
    int regs = kAssumedRegisters, spills = -1;
    std::string note = "regs assumed";
    // The math of the role's kernel as the generator emits it (without a compile: the
    // forward follows the config's math, the backward is taken as FMA).
    bool tc = std::string(role) == "fwd" && ResolveCudaMath(c) == jit::CudaMath::kTensorCore;
    if (k.ok()) {
      for (size_t i = 0; i < k->source.kernels.size(); ++i) {
        if (k->source.kernels[i].role != role) continue;
        tc = k->source.kernels[i].tensor_core;
        if (!res.ok()) continue;
        regs = (*res)[i].registers;
        spills = (*res)[i].spill_store_bytes + (*res)[i].spill_load_bytes;
        note = "";
      }
    }
    for (const GpuSpec& gpu : gpus) {
      const Roofline r = std::string(role) == "fwd" ? ForwardRoofline(c, *t, regs, tc, gpu)
                                                    : BackwardRoofline(c, *t, regs, tc, gpu);
      const bool fwd = std::string(role) == "fwd";
      std::printf(
          "%-34s %-3s %-8s %3dx%-3d %4d %5s %6d %d(%-13s) %6.1f %5.1f | %6.0f %6.0f %6.0f %6.0f "
          "%6.0f | %6.0f %5.1f%% %-18s %s\n",
          c.Name().c_str(), (std::string(role) + (tc ? "*" : "")).c_str(), gpu.name.c_str(),
          fwd ? t->block_m : t->bwd_block_m, fwd ? t->block_n : t->bwd_block_n, regs,
          spills < 0 ? "?" : absl::StrCat(spills).c_str(),
          fwd ? t->fwd_smem_bytes : t->bwd_smem_bytes, r.ctas_per_sm, r.occupancy_limiter.c_str(),
          r.flops_per_global_byte, r.flops_per_smem_byte, r.issue_tflops, r.smem_tflops,
          r.mufu_tflops, r.alu_tflops, r.hbm_tflops, r.predicted_tflops,
          100.0 * r.predicted_tflops / gpu.dense_16bit_tflops, r.bound.c_str(), note.c_str());
    }
  }
}

void PrintTerms(const char* name, const WarpTileMix& m, const GpuSpec& gpu) {
  const WarpTileTime t = TimeOf(m, PipeCyclesOf(gpu));
  auto pct = [&](double x) { return 100 * x / t.busy; };
  std::printf(
      "  %-22s %5.0f cycles/warp-tile: tensor %4.0f (%2.0f%%) ldsm %3.0f (%2.0f%%) mufu %4.0f "
      "(%2.0f%%) alu %4.0f (%2.0f%%) imad %4.0f (%2.0f%%) fp32 %4.0f (%2.0f%%) other %4.0f "
      "(%2.0f%%); instructions: %3.0f HMMA %3.0f LDSM %3.0f MUFU %4.0f ALU %4.0f IMAD %4.0f FP32 "
      "%4.0f other\n",
      name, t.busy, t.tensor, pct(t.tensor), t.ldsm, pct(t.ldsm), t.mufu, pct(t.mufu), t.alu,
      pct(t.alu), t.imad, pct(t.imad), t.fp32, pct(t.fp32), t.other, pct(t.other), m.hmma,
      m.ldsm, m.mufu, m.alu, m.imad, m.fp32, m.other);
}

// Where the time of the H200 rows goes and what would help, for one configuration.
void PrintIssueModel(const jit::CudaKernelConfig& c, int fwd_regs, int bwd_regs) {
  const GpuSpec gpu = H200();
  absl::StatusOr<jit::CudaTiles> t = jit::ChooseCudaTiles(c);
  if (!t.ok()) return;
  std::printf(
      "\n# Issue model (bench/roofline_issue.h) of %s on the H200: scheduler cycles per "
      "warp-tile,\n# pipes summed (HMMA %.0f, ALU/IMAD 2, FP32 1, MUFU 8, other 1 cycle), "
      "%d warps per scheduler.\n",
      c.Name().c_str(), PipeCyclesOf(gpu).hmma,
      PredictIssue({ForwardWarpTileMix(c, *t)}, {1}, 1, t->threads, fwd_regs, t->fwd_smem_bytes,
                   gpu)
          .warps_per_scheduler);
  const std::string fwd_tile =
      absl::StrCat("fwd (", t->block_m / (t->threads / 32), " x ", t->block_n, " keys)");
  PrintTerms(fwd_tile.c_str(), ForwardWarpTileMix(c, *t), gpu);
  const std::string key_tile = absl::StrCat("bwd key (16 x ", t->bwd_block_m, " q)");
  PrintTerms(key_tile.c_str(), BackwardKeyWarpTileMix(c, *t), gpu);
  PrintTerms("bwd dq (16 x 32 keys)", BackwardQueryWarpTileMix(c, *t), gpu);
  const std::vector<std::pair<const char*, std::vector<int64_t>>> rows = {
      {"32K causal", {0, 32768}}, {"128K causal", {0, 131072}}};
  for (const auto& [name, cu] : rows) {
    absl::StatusOr<IssuePrediction> f = PredictForwardOnDocuments(c, fwd_regs, cu, 16, gpu);
    absl::StatusOr<IssuePrediction> b = PredictBackwardOnDocuments(c, bwd_regs, cu, 16, gpu);
    if (!f.ok() || !b.ok()) continue;
    std::printf(
        "  %-12s predicted fwd %5.1f TFLOP/s (pipes overlapped: %5.1f), bwd %5.1f (%5.1f); "
        "bound: %s\n",
        name, f->tflops, f->overlapped_tflops, b->tflops, b->overlapped_tflops, f->bound.c_str());
  }
  auto rank = [&](const char* what, const std::vector<ChangedMix>& changes, double base,
                  auto&& rate) {
    std::vector<std::pair<double, const ChangedMix*>> ranked;
    for (const ChangedMix& ch : changes) ranked.push_back({rate(ch.mix), &ch});
    std::sort(ranked.begin(), ranked.end(),
              [](const auto& a, const auto& b) { return a.first > b.first; });
    std::printf("  %s changes, ranked (full-tile rate now %.0f TFLOP/s):\n", what, base);
    for (const auto& [r, ch] : ranked) {
      std::printf("    %6.0f TFLOP/s (x%.2f)  %-28s %s\n", r, r / base, ch->change.name.c_str(),
                  ch->change.what.c_str());
    }
  };
  const double fwd_base = ForwardSchedulerTflops(c, *t, fwd_regs, gpu);
  rank("forward", ForwardChanges(c, *t), fwd_base, [&](const WarpTileMix& m) {
    return PredictIssue({m}, {1e6}, 1e6 * m.useful_flops, t->threads, fwd_regs, t->fwd_smem_bytes,
                        gpu)
        .tflops;
  });
  const WarpTileMix q = BackwardQueryWarpTileMix(c, *t);
  const double bwd_base = BackwardSchedulerTflops(c, *t, bwd_regs, gpu);
  rank("backward key-pass", BackwardKeyChanges(c, *t), bwd_base, [&](const WarpTileMix& m) {
    // Per pair as BackwardSchedulerTflops: the key pass changed, the dq pass as it is.
    const double pairs = 1e9;
    return PredictIssue({m, q}, {pairs / (16.0 * t->bwd_block_m), pairs / (16.0 * 32)},
                        10 * pairs * c.head_dim, t->bwd_threads, bwd_regs, t->bwd_smem_bytes, gpu)
        .tflops;
  });
}

// The --sweep mode: one line per kernel, then the count of kernels that spill. Returns 1 when
// one does or a configuration does not compile.
int Sweep(const std::vector<std::string>& archs) {
  int spilling = 0, failed = 0, kernels = 0;
  for (const std::string& arch : archs) {
    for (int peers : {0, 3}) {
      for (DType dtype : {DType::kBF16, DType::kF16}) {
        for (int d = 64; d <= 256; d += 16) {
          for (bool deterministic_dq : {true, false}) {
            for (int gqa : {1, 8}) {
              for (bool band : {true, false}) {
                if (peers > 0 && (dtype != DType::kBF16 || !deterministic_dq || gqa != 1)) continue;
                jit::CudaKernelConfig c;
                c.arch = arch;
                c.dtype = dtype;
                c.head_dim = d;
                c.deterministic_dq = deterministic_dq;
                c.gqa = gqa;
                c.has_band = band;
                if (peers > 0) c.role = {peers};
                absl::StatusOr<jit::CompiledCudaKernels> k =
                    jit::CompileCudaKernels(c, &jit::CompileCache::Global());
                absl::StatusOr<std::vector<jit::CudaKernelResources>> res =
                    k.ok() ? k->Resources()
                           : absl::StatusOr<std::vector<jit::CudaKernelResources>>(k.status());
                if (!res.ok()) {
                  std::printf("%-40s FAILED %s\n", c.Name().c_str(),
                              std::string(res.status().message()).c_str());
                  ++failed;
                  continue;
                }
                for (size_t i = 0; i < res->size(); ++i) {
                  const jit::CudaKernelResources& r = (*res)[i];
                  const int spill = r.spill_store_bytes + r.spill_load_bytes;
                  std::printf("%-40s %-14s regs %3d spill %d\n", c.Name().c_str(),
                              k->source.kernels[i].role.c_str(), r.registers, spill);
                  spilling += spill > 0;
                  ++kernels;
                }
              }
            }
          }
        }
      }
    }
  }
  std::printf("# %d kernels, %d spill, %d configurations did not compile\n", kernels, spilling,
              failed);
  return spilling > 0 || failed > 0 ? 1 : 0;
}

int Main(int argc, char** argv) {
  std::vector<std::string> archs;
  bool sweep = false;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--sweep") {
      sweep = true;
    } else {
      archs.push_back(argv[i]);
    }
  }
  if (archs.empty()) archs.push_back("sm_90");
  if (sweep) return Sweep(archs);
  const std::vector<GpuSpec> gpus = {H100Sxm(), H200()};
  std::printf(
      "# Analytic roofline of the shipped CUDA variants (bench/roofline.h; docs/gpu_backend.md).\n"
      "# Bounds in TFLOP/s over visible pairs on the whole GPU; %% is of the %.1f TFLOP/s dense\n"
      "# bf16 peak. mma.sync on sm_90 taken at %.0f%% of that peak (docs/gpu_backend.md).\n"
      "# FLOP/B: per byte streamed from L2/HBM (glob) and read from shared memory (smem; 0: "
      "not modelled).\n"
      "# pred: the smallest on-chip bound (mma.sync issue, smem, exp, alu, scheduler: the issue "
      "model of bench/roofline_issue.h); hbm: HBM with no L2 reuse, "
      "the floor of a cache-hostile schedule. dir*: tensor-core kernel.\n",
      gpus[0].dense_16bit_tflops, 100 * kMmaSyncFractionSm90);
  std::printf(
      "%-34s %-3s %-8s %-7s %4s %5s %6s %-16s %6s %5s | %6s %6s %6s %6s %6s | %6s %6s %-18s\n",
      "variant", "dir", "gpu", "tile", "regs", "spill", "smem", "CTAs/SM(limit)", "glob", "smem",
      "issue", "smem", "exp", "alu", "hbm", "pred", "%peak", "bound");
  for (const std::string& arch : archs) {
    for (const jit::CudaKernelConfig& c : jit::ShippedCudaConfigs(arch)) {
      if (c.role.num_peers > 0) continue;  // the fused forward has the forward's core
      PrintVariant(c, gpus);
    }
  }
  // The issue model's breakdown and plan for the rows measured on the H200 (bf16, d 128),
  // with the registers of ptxas' report when NVRTC is there.
  jit::CudaKernelConfig c;
  c.arch = "sm_90";
  c.dtype = DType::kBF16;
  c.head_dim = 128;
  int fwd_regs = 241, bwd_regs = 244;  // ptxas (CUDA 13), when no compile is possible
  absl::StatusOr<jit::CompiledCudaKernels> k = jit::CompileCudaKernels(c, &jit::CompileCache::Global());
  if (k.ok()) {
    absl::StatusOr<std::vector<jit::CudaKernelResources>> res = k->Resources();
    for (size_t i = 0; res.ok() && i < k->source.kernels.size(); ++i) {
      if (k->source.kernels[i].role == "fwd") fwd_regs = (*res)[i].registers;
      if (k->source.kernels[i].role == "bwd") bwd_regs = (*res)[i].registers;
    }
  }
  PrintIssueModel(c, fwd_regs, bwd_regs);
  return 0;
}

}  // namespace
}  // namespace hsap::bench

int main(int argc, char** argv) { return hsap::bench::Main(argc, argv); }
