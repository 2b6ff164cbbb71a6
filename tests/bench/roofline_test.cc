#include "bench/roofline.h"

#include "gtest/gtest.h"
#include "jit/codegen_cuda.h"

namespace hsap::bench {
namespace {

jit::CudaKernelConfig Bf16D128() {
  jit::CudaKernelConfig c;
  c.arch = "sm_90";
  c.dtype = DType::kBF16;
  c.head_dim = 128;
  return c;
}

// 64 x 64 tiles on 4 warps at D = 64 (Q in registers): 64 FLOPs per K/V byte from L2/HBM, 16
// per shared byte (every warp reads the whole K and V tile for its 16 rows), so shared memory
// (128 B/clk/SM) caps the forward at 16 * 128 FLOP/clk/SM, below the assumed mma.sync rate.
TEST(Roofline, TensorCoreForwardIsBoundBySharedMemory) {
  jit::CudaKernelConfig c = Bf16D128();
  c.head_dim = 64;
  absl::StatusOr<jit::CudaTiles> t = jit::ChooseCudaTiles(c);
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_TRUE(t->q_in_registers);
  const GpuSpec h200 = H200();
  const Roofline r = ForwardRoofline(c, *t, 173, /*tensor_core=*/true, h200);
  EXPECT_DOUBLE_EQ(r.flops_per_tile, 4.0 * 64 * 64 * 64);
  EXPECT_DOUBLE_EQ(r.flops_per_global_byte, 64);
  EXPECT_DOUBLE_EQ(r.flops_per_smem_byte, 16);
  EXPECT_DOUBLE_EQ(r.peak_tflops, h200.dense_16bit_tflops);
  EXPECT_NEAR(r.issue_tflops, h200.dense_16bit_tflops * kMmaSyncFractionSm90, 1e-9);
  const double smem = 16.0 * 128 * h200.sms * h200.clock_ghz * 1e9 / 1e12;
  EXPECT_NEAR(r.smem_tflops, smem, 1e-6);
  EXPECT_NEAR(r.predicted_tflops, smem, 1e-6);
  EXPECT_EQ(r.bound, "shared memory");
  EXPECT_NEAR(r.hbm_tflops, 64 * 4.8, 1e-9);  // not part of the prediction
  // 173 registers: 5632 per warp after rounding, 22528 per CTA, two CTAs in 65536.
  EXPECT_EQ(r.ctas_per_sm, 2);
  EXPECT_EQ(r.occupancy_limiter, "registers");
  // H100 and H200 differ only in HBM: the on-chip prediction is the same.
  EXPECT_DOUBLE_EQ(ForwardRoofline(c, *t, 173, true, H100Sxm()).predicted_tflops,
                   r.predicted_tflops);
  // At D = 128 Q is re-read per k-step: 32 D more shared bytes per warp and tile.
  const jit::CudaKernelConfig c128 = Bf16D128();
  absl::StatusOr<jit::CudaTiles> t128 = jit::ChooseCudaTiles(c128);
  ASSERT_TRUE(t128.ok()) << t128.status();
  ASSERT_FALSE(t128->q_in_registers);
  EXPECT_DOUBLE_EQ(ForwardRoofline(c128, *t128, 241, true, h200).flops_per_smem_byte,
                   4.0 * 64 * 64 * 128 / (4 * (4.0 * 64 * 128 + 32 * 128)));
}

// The tensor-core backward's issue bound counts the products it recomputes: 7 issued per 5
// useful with deterministic dq, 11 above head dim 128 (two warps per key group and per query
// rows recompute S and dP), 5 with atomic dq up to 128.
TEST(Roofline, TensorCoreBackwardIssueCountsRecomputedProducts) {
  const GpuSpec h200 = H200();
  const double mma_sync = h200.dense_16bit_tflops * kMmaSyncFractionSm90;
  auto issue = [&](int head_dim, bool deterministic_dq) {
    jit::CudaKernelConfig c = Bf16D128();
    c.head_dim = head_dim;
    c.deterministic_dq = deterministic_dq;
    absl::StatusOr<jit::CudaTiles> t = jit::ChooseCudaTiles(c);
    EXPECT_TRUE(t.ok() && t->bwd_tensor_core) << head_dim;
    return BackwardRoofline(c, *t, 240, /*tensor_core=*/true, h200).issue_tflops;
  };
  EXPECT_DOUBLE_EQ(issue(128, false), mma_sync);
  EXPECT_DOUBLE_EQ(issue(128, true), mma_sync * 5 / 7);
  EXPECT_DOUBLE_EQ(issue(64, true), mma_sync * 5 / 7);
  EXPECT_DOUBLE_EQ(issue(256, true), mma_sync * 5 / 11);
  EXPECT_DOUBLE_EQ(issue(256, false), mma_sync * 5 / 7);
}

TEST(Roofline, FmaKernelsAreBoundFarBelowTheTensorCorePeak) {
  jit::CudaKernelConfig c = Bf16D128();
  c.math = jit::CudaMath::kFma;
  absl::StatusOr<jit::CudaTiles> t = jit::ChooseCudaTiles(c);
  ASSERT_TRUE(t.ok()) << t.status();
  const Roofline f = ForwardRoofline(c, *t, 128, /*tensor_core=*/false, H200());
  EXPECT_DOUBLE_EQ(f.peak_tflops, H200().fp32_tflops);
  EXPECT_LE(f.predicted_tflops, f.peak_tflops);
  EXPECT_LT(f.predicted_tflops, 0.1 * H200().dense_16bit_tflops);
  const Roofline b = BackwardRoofline(c, *t, 128, false, H200());
  EXPECT_DOUBLE_EQ(b.flops_per_tile, 10.0 * t->bwd_block_m * t->bwd_block_n * 128);
  EXPECT_GT(b.predicted_tflops, 0);
  // A kernel that does not fit an SM predicts nothing.
  jit::CudaTiles huge = *t;
  huge.fwd_smem_bytes = 1 << 20;
  EXPECT_EQ(ForwardRoofline(c, huge, 128, false, H200()).predicted_tflops, 0);
}

}  // namespace
}  // namespace hsap::bench
