// The tensor-core forward (jit/device/hsap_attention_mma_fwd.cuh) run in the CUDA emulator
// (tests/support/cuda_emulator.h, with the warp-collective mma/ldmatrix/cp.async of
// tests/support/emulated_ptx.h) at the production tiles the generator picks (64 query rows
// on 4 warps, 64-key tiles, a 2-stage cp.async ring), against the fp64 reference under the
// project's rule (attention/tolerance.h):
//   max |kernel - ref| <= 2 * max |naive - ref| + 1e-6 * max(1, max |ref|)
// Documents end inside, at and across the 64-row tiles; work-list blocks are longer than a
// tile, so blocks run in several chunks, the last one partial. The configurations are the
// generator's (tests/support/emulator_configs.h, family MmaTileCfg).
// clang-format off
#include "tests/support/cuda_emulator.h"
#include "jit/device/hsap_attention.cuh"
#include "tests/support/emulator_configs.h"
// clang-format on

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "attention/dtype.h"
#include "attention/reference.h"
#include "attention/tolerance.h"
#include "attention/worklist.h"
#include "gtest/gtest.h"
#include "jit/codegen_cuda.h"
#include "tests/support/attention_test_util.h"
#include "tests/support/emulated_kernel_inputs.h"
#include "tests/support/nonfinite.h"
#include "tests/support/random_layouts.h"
#include "tests/support/tolerance.h"

namespace hsap {
namespace {

using testing::MmaTileCfg;

using testing::Bits;
using testing::DeviceBlocks;
using testing::DeviceSegments;
using Problem = testing::BitsProblem;
using testing::ExpectWithinRule;
using testing::MakeBitsProblem;
using testing::Partial;


template <class Cfg>
unsigned int LaunchForward(const Problem& p, const WorkList& w, Partial* r,
                           const int* kv_map = nullptr) {
  const auto blocks = DeviceBlocks(w);
  const auto segments = DeviceSegments(w);
  unsigned int error_flag = 0;
  const hsap_dev::FwdParams fp =
      testing::ForwardParams(p, blocks, segments, r, kv_map, &error_flag);
  EXPECT_EQ(hsap_emu::Launch(fp.num_blocks, fp.heads_q, Cfg::kThreads, Cfg::kFwdSmemBytes, false,
                             [&] { hsap_dev::attn_fwd_kernel<Cfg>(fp); }),
            absl::OkStatus());
  return error_flag;
}

// The forward of `p` (work-list blocks of `block_rows` rows) against the reference.
template <class Cfg>
void CheckForward(Problem p, int64_t block_rows, std::vector<int> kv_map = {}) {
  static_assert(Cfg::kTensorCore && Cfg::kThreads == 128 &&
                (Cfg::kBlockM == 64 || Cfg::kBlockM == 128));
  ASSERT_EQ(p.dims.head_dim, Cfg::kHeadDim);
  p.dims.kv_head_of_q = kv_map;
  absl::StatusOr<WorkList> w = BuildWorkList(p.layout, block_rows);
  ASSERT_TRUE(w.ok()) << w.status();
  Partial r(p.T(), p.dims);
  EXPECT_EQ(LaunchForward<Cfg>(p, *w, &r, kv_map.empty() ? nullptr : kv_map.data()), 0u);
  testing::ExpectForwardWithinRule(p, r);
}

// Every mask kind, documents ending inside, at and across 64-row tiles: causal 70, full 64,
// causal 1, sliding window (20) 45, prefix-LM (prefix 15) 35, full 20.
Layout EveryMaskKind() {
  const std::vector<int64_t> cu = {0, 70, 134, 135, 180, 215, 235};
  const std::vector<MaskKind> kinds = {MaskKind::kCausal,   MaskKind::kFull,
                                       MaskKind::kCausal,   MaskKind::kSlidingWindow,
                                       MaskKind::kPrefixLM, MaskKind::kFull};
  return *Layout::FromDocuments(cu, kinds, {0, 0, 0, 20, 15, 0});
}

TEST(CudaMmaEmulation, ForwardEveryMaskKindBf16HeadDim64Gqa2) {
  CheckForward<MmaTileCfg<hsap_dev::bf16, 64, 2, true>>(
      MakeBitsProblem(EveryMaskKind(), DType::kBF16, 64, 4, 2, 1), 160);
}
TEST(CudaMmaEmulation, ForwardEveryMaskKindFp16HeadDim64Gqa2) {
  CheckForward<MmaTileCfg<hsap_dev::f16, 64, 2, true>>(
      MakeBitsProblem(EveryMaskKind(), DType::kF16, 64, 2, 1, 2), 96);
}
TEST(CudaMmaEmulation, ForwardEveryMaskKindBf16HeadDim128Gqa2) {
  CheckForward<MmaTileCfg<hsap_dev::bf16, 128, 2, true>>(
      MakeBitsProblem(EveryMaskKind(), DType::kBF16, 128, 2, 1, 3), 160);
}
TEST(CudaMmaEmulation, ForwardEveryMaskKindFp16HeadDim128Gqa2) {
  CheckForward<MmaTileCfg<hsap_dev::f16, 128, 2, true>>(
      MakeBitsProblem(EveryMaskKind(), DType::kF16, 128, 2, 1, 4), 96);
}
// Head dims above 128 (64 x 32 tiles) whose 16-byte chunks per row (18, 30) do not divide
// the 128 threads: the copies leave the last threads idle (cp_async_rows).
TEST(CudaMmaEmulation, ForwardEveryMaskKindBf16HeadDim144Gqa2) {
  CheckForward<MmaTileCfg<hsap_dev::bf16, 144, 2, true>>(
      MakeBitsProblem(EveryMaskKind(), DType::kBF16, 144, 2, 1, 8), 128);
}
TEST(CudaMmaEmulation, ForwardEveryMaskKindFp16HeadDim240Gqa2) {
  CheckForward<MmaTileCfg<hsap_dev::f16, 240, 2, true>>(
      MakeBitsProblem(EveryMaskKind(), DType::kF16, 240, 2, 1, 9), 96);
}
// User slices: causal blocks, some with a window, and full rectangles onto earlier blocks.
TEST(CudaMmaEmulation, ForwardArbitrarySlices) {
  CheckForward<MmaTileCfg<hsap_dev::bf16, 64, 2, true>>(
      MakeBitsProblem(testing::RandomSliceLayout(200, 5), DType::kBF16, 64, 2, 1, 5), 128);
}
// A run-time query-head to kv-head map (not h / kGqa).
TEST(CudaMmaEmulation, ForwardWithKvHeadMap) {
  CheckForward<MmaTileCfg<hsap_dev::bf16, 64, 2, true>>(
      MakeBitsProblem(EveryMaskKind(), DType::kBF16, 64, 2, 2, 6), 160, {1, 0});
}
// The full-only variant on bidirectional documents.
TEST(CudaMmaEmulation, ForwardFullOnlyVariant) {
  const std::vector<int64_t> cu = {0, 100, 164, 200};
  CheckForward<MmaTileCfg<hsap_dev::bf16, 64, 2, false>>(
      MakeBitsProblem(*Layout::FromDocuments(cu, std::vector<MaskKind>(3, MaskKind::kFull)),
                  DType::kBF16, 64, 2, 1, 7),
      128);
}

// NaN and infinity as a naive softmax has them (include/hsap/hsap.h), like the FMA kernel:
// the same rows are NaN, rows that see no planted key stay finite.
TEST(CudaMmaEmulation, NaNAndInfinityPropagateLikeANaiveSoftmax) {
  using Cfg = MmaTileCfg<hsap_dev::bf16, 64, 2, true>;
  testing::ExpectNonFiniteLikeANaiveSoftmax(
      96,
      [](const Problem& p, const WorkList& w, Partial* r) { return LaunchForward<Cfg>(p, w, r); });
}

// The fused forward (copy CTAs staging K/V shards, compute CTAs attending) on the same
// tensor-core core: three shards, each step's partial merged into the same rows.
TEST(CudaMmaEmulation, FusedForwardThreeSteps) {
  using Cfg = MmaTileCfg<hsap_dev::bf16, 64, 2, true, 3>;
  constexpr int kSteps = 3, kCopy = 1, kCompute = 3;
  const Problem p = MakeBitsProblem(EveryMaskKind(), DType::kBF16, 64, 2, 1, 9);
  const int64_t T = p.T();
  // Contiguous shards [0, 100), [100, 180), [180, T), attended in the order 2, 0, 1.
  Partial r(T, p.dims);
  testing::FusedForwardInputs<kSteps> f(p, {{180, 0, T - 180}, {0, 0, 100}, {100, 0, 80}}, 96,
                                        kCopy, &r);
  EXPECT_EQ(
      hsap_emu::Launch(kCopy + kCompute, 1, Cfg::kThreads, Cfg::kFwdSmemBytes,
                       /*all_concurrent=*/true, [&] { hsap_dev::fused_fwd_kernel<Cfg>(f.params); }),
      absl::OkStatus());
  EXPECT_EQ(f.error_flag, 0u);
  testing::ExpectForwardWithinRule(p, r, "fused ");
}

// cp.async moves 16-byte rows: a misaligned tensor is reported, nothing is computed.
TEST(CudaMmaEmulation, MisalignedTensorIsFlagged) {
  using Cfg = MmaTileCfg<hsap_dev::bf16, 64, 2, true>;
  Problem p = MakeBitsProblem(EveryMaskKind(), DType::kBF16, 64, 2, 1, 10);
  absl::StatusOr<WorkList> w = BuildWorkList(p.layout, 96);
  ASSERT_TRUE(w.ok());
  Partial r(p.T(), p.dims);
  hsap_dev::FwdParams fp{};
  const auto blocks = DeviceBlocks(*w);
  const auto segments = DeviceSegments(*w);
  unsigned int error_flag = 0;
  fp.q = p.q.data();
  fp.k = p.k.data() + 1;  // 2 bytes off
  fp.v = p.v.data();
  fp.out = r.out.data();
  fp.lse = r.lse.data();
  fp.blocks = blocks.data();
  fp.segments = segments.data();
  fp.error_flag = &error_flag;
  fp.q_rows = fp.k_rows = p.T() - 1;
  fp.num_blocks = 1;
  fp.heads_q = 2;
  fp.heads_kv = 1;
  fp.scale = 1.0f;
  EXPECT_EQ(hsap_emu::Launch(1, 2, Cfg::kThreads, Cfg::kFwdSmemBytes, false,
                             [&] { hsap_dev::attn_fwd_kernel<Cfg>(fp); }),
            absl::OkStatus());
  EXPECT_EQ(error_flag, static_cast<unsigned int>(hsap_dev::kErrorMisaligned));
  for (float x : r.lse) EXPECT_EQ(x, -INFINITY);
}

// The generator's tiles for these configurations: on 4 warps with 2 stages, 128 x 64 at head
// dim 64 (two m16 row blocks per warp, Q's fragments held in registers) and 64 x 64 at 128
// (one row block, Q re-read from shared memory), so the tests above run both shapes and both
// Q paths; the device shape agrees with the generator's byte count.
TEST(CudaMmaEmulation, ConfigurationsAreTheGenerators) {
  using Cfg128 = MmaTileCfg<hsap_dev::bf16, 128, 2, true>;
  using Cfg64 = MmaTileCfg<hsap_dev::bf16, 64, 2, true>;
  static_assert(Cfg128::kBlockM == 64 && Cfg128::kBlockN == 64 && Cfg128::kThreads == 128);
  static_assert(Cfg128::kFwdStages == 2 && !Cfg128::kQInRegisters);
  static_assert(hsap_dev::MmaFwdShapeOf<Cfg128>::kRowBlocks == 1);
  static_assert(Cfg64::kBlockM == 128 && Cfg64::kBlockN == 64 && Cfg64::kThreads == 128);
  static_assert(Cfg64::kQInRegisters && hsap_dev::MmaFwdShapeOf<Cfg64>::kRowBlocks == 2);
  EXPECT_EQ(hsap_dev::MmaFwdShapeOf<Cfg128>::kSmemBytes, Cfg128::kFwdSmemBytes);
  EXPECT_EQ(hsap_dev::MmaFwdShapeOf<Cfg64>::kSmemBytes, Cfg64::kFwdSmemBytes);
  for (int head_dim : {64, 128}) {
    jit::CudaKernelConfig c;
    c.arch = "sm_90";
    c.dtype = DType::kBF16;
    c.head_dim = head_dim;
    c.gqa = 2;
    absl::StatusOr<jit::CudaTiles> t = jit::ChooseCudaTiles(c);
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(t->fwd_smem_bytes, head_dim == 64 ? Cfg64::kFwdSmemBytes : Cfg128::kFwdSmemBytes);
    EXPECT_EQ(t->block_m, head_dim == 64 ? 128 : 64);
  }
}

}  // namespace
}  // namespace hsap
