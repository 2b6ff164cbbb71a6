#include "bench/roofline.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "bench/roofline_issue.h"
#include "jit/cuda_kernels.h"

namespace hsap::bench {
namespace {

// Per SM and clock: shared-memory bytes, MUFU results (ex2), fp32 instructions.
constexpr double kSmemBytesPerClock = 128;
constexpr double kMufuPerClock = 16;

int StorageBytes(DType t) { return t == DType::kF32 ? 4 : 2; }

struct TileCosts {
  double flops = 0, global_bytes = 0, smem_bytes = 0, exps = 0, alu_ops = 0;
  // Matrix products issued per useful one (the tensor-core backward recomputes some).
  double issued_per_useful = 1;
};

Roofline Evaluate(bool tc, const TileCosts& k, int threads, int registers, int smem,
                  const GpuSpec& gpu, double scheduler_tflops) {
  Roofline r;
  const double clocks_per_s = gpu.clock_ghz * 1e9 * gpu.sms;  // SM-clocks per second
  const double fp32_ops_per_clock = gpu.fp32_tflops * 1e12 / 2 / clocks_per_s;
  // TFLOP/s when one tile takes `clocks` SM-clocks.
  auto tflops = [&](double clocks) {
    return clocks > 0 ? k.flops / clocks * clocks_per_s / 1e12 : 0;
  };
  r.flops_per_tile = k.flops;
  r.flops_per_global_byte = k.global_bytes > 0 ? k.flops / k.global_bytes : 0;
  r.flops_per_smem_byte = k.smem_bytes > 0 ? k.flops / k.smem_bytes : 0;
  r.ctas_per_sm = jit::CudaCtasPerSm(gpu.arch, threads, registers, smem, &r.occupancy_limiter);
  r.peak_tflops = tc ? gpu.dense_16bit_tflops : gpu.fp32_tflops;
  r.issue_tflops = (tc ? gpu.dense_16bit_tflops * (gpu.arch >= 90 ? kMmaSyncFractionSm90 : 1.0)
                       : gpu.fp32_tflops) /
                   k.issued_per_useful;
  r.smem_tflops = tflops(k.smem_bytes / kSmemBytesPerClock);
  r.mufu_tflops = tflops(k.exps / kMufuPerClock);
  r.alu_tflops = tflops(k.alu_ops / fp32_ops_per_clock);
  r.hbm_tflops = r.flops_per_global_byte * gpu.hbm_tb_per_s;
  std::vector<std::pair<double, const char*>> bounds = {
      {r.issue_tflops, tc ? "mma.sync issue" : "FFMA issue"},
      {r.smem_tflops, "shared memory"},
      {r.mufu_tflops, "exp (MUFU)"},
      {r.alu_tflops, "fp32 softmax ALU"},
      {scheduler_tflops, "scheduler (issue)"},
  };
  r.scheduler_tflops = scheduler_tflops;
  r.predicted_tflops = r.peak_tflops;
  r.bound = "peak";
  for (const auto& [value, name] : bounds) {
    if (value > 0 && value < r.predicted_tflops) {
      r.predicted_tflops = value;
      r.bound = name;
    }
  }
  if (r.ctas_per_sm == 0) {
    r.predicted_tflops = 0;
    r.bound = "does not fit an SM";
  }
  return r;
}

}  // namespace

GpuSpec H100Sxm() {
  GpuSpec g;
  g.name = "H100 SXM";
  g.hbm_tb_per_s = 3.35;
  return g;
}

GpuSpec H200() {
  GpuSpec g;
  g.name = "H200";
  g.hbm_tb_per_s = 4.8;
  return g;
}

Roofline ForwardRoofline(const jit::CudaKernelConfig& c, const jit::CudaTiles& t, int registers,
                         bool tensor_core, const GpuSpec& gpu) {
  const double bm = t.block_m, bn = t.block_n, d = c.head_dim, warps = t.threads / 32.0;
  TileCosts k;
  k.flops = 4 * bm * bn * d;                            // S = Q K^T and O += P V
  k.global_bytes = 2 * bn * d * StorageBytes(c.dtype);  // the K and V tiles
  if (tensor_core) {
    // Every warp reads the whole K and V tiles by ldmatrix (and Q per k-step unless it is
    // held in registers).
    k.smem_bytes = warps * (4 * bn * d + (t.q_in_registers ? 0 : 32 * d));
  } else {
    // One fp32 shared load per FMA of each product (the other operand is the thread's own).
    k.smem_bytes = 4 * 2 * bm * bn * d;
  }
  k.exps = bm * bn;
  k.alu_ops = 6 * bm * bn + bm * d;  // scale/mask, max, subtract, sum, pack; O rescale
  return Evaluate(tensor_core, k, t.threads, registers, t.fwd_smem_bytes, gpu,
                  tensor_core ? ForwardSchedulerTflops(c, t, registers, gpu) : 0);
}

Roofline BackwardRoofline(const jit::CudaKernelConfig& c, const jit::CudaTiles& t, int registers,
                          bool tensor_core, const GpuSpec& gpu) {
  const double bm = t.bwd_block_m, bn = t.bwd_block_n, d = c.head_dim;
  TileCosts k;
  k.flops = 10 * bm * bn * d;  // S, dP = dO V^T, dV += P^T dO, dK += dS^T Q, dQ += dS K
  if (tensor_core) {
    // FlashAttention-2 order: a CTA keeps dK/dV of its key block and streams the query
    // blocks: Q and dO in, dQ added in fp32 (read and write).
    k.global_bytes = bm * d * (2 * StorageBytes(c.dtype) + 8);
    k.smem_bytes = 0;  // depends on the backward's warp layout; not modelled
    // Products issued of the 5 useful ones (hsap_attention_mma_bwd.cuh): S^T and dP^T once
    // per warp sharing a key group (two above head dim 128, which split D), dV and dK once;
    // dq either by atomics from dS^T (one product) or by query items that recompute S and dP
    // (again per warp sharing query rows) before dQ.
    const double split = d > 128 ? 2 : 1;
    const double dq = c.deterministic_dq ? 2 * split + 1 : 1;
    k.issued_per_useful = (2 * split + 2 + dq) / 5;
  } else {
    // Query block per CTA, key tiles streamed: K and V in, dK and dV added in fp32.
    k.global_bytes = bn * d * (2 * StorageBytes(c.dtype) + 16);
    k.smem_bytes = 4 * 5 * bm * bn * d;
  }
  k.exps = bm * bn;
  k.alu_ops = 6 * bm * bn;
  return Evaluate(tensor_core, k, t.bwd_threads, registers, t.bwd_smem_bytes, gpu,
                  tensor_core ? BackwardSchedulerTflops(c, t, registers, gpu) : 0);
}

}  // namespace hsap::bench
