// Prints the analytic roofline (bench/roofline.h) of every shipped CUDA kernel variant's
// forward and backward on H100 SXM and H200: what each should reach before it runs on a
// GPU. Registers come from ptxas' report of an NVRTC compile (through the JIT cache); without
// NVRTC the occupancy assumes 128 registers per thread and says so.
//
//   hsap_roofline [sm_90|sm_80 ...]     (default: sm_90)
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/roofline.h"
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

int Main(int argc, char** argv) {
  std::vector<std::string> archs;
  for (int i = 1; i < argc; ++i) archs.push_back(argv[i]);
  if (archs.empty()) archs.push_back("sm_90");
  const std::vector<GpuSpec> gpus = {H100Sxm(), H200()};
  std::printf(
      "# Analytic roofline of the shipped CUDA variants (bench/roofline.h; docs/gpu_backend.md).\n"
      "# Bounds in TFLOP/s over visible pairs on the whole GPU; %% is of the %.1f TFLOP/s dense\n"
      "# bf16 peak. mma.sync on sm_90 assumed at %.0f%% of that peak (to be measured).\n"
      "# FLOP/B: per byte streamed from L2/HBM (glob) and read from shared memory (smem; 0: "
      "not modelled).\n"
      "# pred: the smallest on-chip bound (issue, smem, exp, alu); hbm: HBM with no L2 reuse, "
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
  return 0;
}

}  // namespace
}  // namespace hsap::bench

int main(int argc, char** argv) { return hsap::bench::Main(argc, argv); }
