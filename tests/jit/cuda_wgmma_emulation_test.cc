// The sm_90a forward (jit/device/hsap_attention_wgmma_fwd.cuh) run in the CUDA emulator
// (tests/support/cuda_emulator.h, with wgmma from tests/support/emulated_wgmma.h and TMA and
// mbarriers from tests/support/emulated_tma.h, each written from the PTX ISA apart from any
// kernel) at the tiles the generator picks (128 query rows on a TMA producer warpgroup and two
// wgmma consumer warpgroups), against the fp64 reference under the project's rule
// (attention/tolerance.h):
//   max |kernel - ref| <= 2 * max |naive - ref| + 1e-6 * max(1, max |ref|)
// The tensor maps are encoded by the host code the runtime uses (lib/cuda/exec/
// wgmma_tensor_maps.h on lib/cuda/runtime/tensor_map.h) through the emulated driver's
// cuTensorMapEncodeTiled (tests/support/emulated_cuda_runtime.h). Packed documents of 100-300
// tokens end inside and across the 128-row query tiles and the key tiles, so TMA boxes cross
// documents and the tensor's end; every mask kind, GQA 2:1 and a run-time kv-head map, d 64,
// 128 and 256, bf16 and f16. Under the sanitizers (HSAP_TEST_SWEEP=subset) the
// configurations sweep runs its first and last case.
// clang-format off
#include "tests/support/cuda_emulator.h"
#include "jit/device/hsap_attention.cuh"
#include "jit/device/hsap_attention_wgmma_fwd.cuh"
#include "tests/support/emulator_configs.h"
// clang-format on

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "attention/dtype.h"
#include "attention/reference.h"
#include "attention/tolerance.h"
#include "attention/worklist.h"
#include "gtest/gtest.h"
#include "jit/codegen_cuda.h"
#include "lib/cuda/exec/launch_grid.h"
#include "lib/cuda/exec/wgmma_tensor_maps.h"
#include "tests/support/attention_test_util.h"
#include "tests/support/emulated_cuda_runtime.h"
#include "tests/support/emulated_kernel_inputs.h"
#include "tests/support/nonfinite.h"
#include "tests/support/random_layouts.h"
#include "tests/support/sweep.h"
#include "tests/support/tolerance.h"

namespace hsap {
namespace {

using testing::WgmmaFwdCfg;

using testing::Bits;
using testing::DeviceBlocks;
using testing::DeviceSegments;
using Problem = testing::BitsProblem;
using testing::ExpectWithinRule;
using testing::MakeBitsProblem;
using testing::Partial;


// Runs attn_fwd_wgmma_kernel<Cfg> on `w` with the tensor maps the runtime would pass; returns
// the error word.
template <class Cfg>
unsigned int LaunchForward(const Problem& p, const WorkList& w, Partial* r,
                           const int* kv_map = nullptr) {
  const auto blocks = DeviceBlocks(w);
  const auto segments = DeviceSegments(w);
  unsigned int error_flag = 0;
  const hsap_dev::FwdParams fp =
      testing::ForwardParams(p, blocks, segments, r, kv_map, &error_flag);
  testing::EmulatedCudaRuntime emu;
  absl::StatusOr<cuda::WgmmaForwardMaps> maps =
      cuda::EncodeWgmmaForwardMaps(emu.driver(), fp, p.dtype, Cfg::kHeadDim, Cfg::kWgmmaBlockN);
  EXPECT_TRUE(maps.ok()) << maps.status();
  if (!maps.ok()) return ~0u;
  hsap_dev::TensorMap tq, tk, tv;  // the kernel parameters, as cuLaunchKernel copies them
  static_assert(sizeof(tq) == sizeof(maps->q));
  std::memcpy(&tq, &maps->q, sizeof(tq));
  std::memcpy(&tk, &maps->k, sizeof(tk));
  std::memcpy(&tv, &maps->v, sizeof(tv));
  EXPECT_EQ(hsap_emu::Launch(fp.num_blocks, fp.heads_q, 384, Cfg::kWgmmaSmemBytes, false,
                             [&] { hsap_dev::attn_fwd_wgmma_kernel<Cfg>(fp, tq, tk, tv); }),
            absl::OkStatus());
  return error_flag;
}

template <class Cfg>
void CheckForward(Problem p, int64_t block_rows, std::vector<int> kv_map = {}) {
  static_assert(Cfg::kWgmmaFwd && Cfg::kTensorCore);
  ASSERT_EQ(p.dims.head_dim, Cfg::kHeadDim);
  p.dims.kv_head_of_q = kv_map;
  absl::StatusOr<WorkList> w = BuildWorkList(p.layout, block_rows);
  ASSERT_TRUE(w.ok()) << w.status();
  Partial r(p.T(), p.dims);
  EXPECT_EQ(LaunchForward<Cfg>(p, *w, &r, kv_map.empty() ? nullptr : kv_map.data()), 0u);
  testing::ExpectForwardWithinRule(p, r);
}

// Three documents: causal 150 (ends inside the second 128-row tile), sliding window (40) 230,
// full 100, then prefix-LM (prefix 30) 120: query tiles and key tiles straddle documents and
// the last boxes cross the tensor's end.
Layout MixedDocuments() {
  const std::vector<int64_t> cu = {0, 150, 380, 480, 600};
  const std::vector<MaskKind> kinds = {MaskKind::kCausal, MaskKind::kSlidingWindow,
                                       MaskKind::kFull, MaskKind::kPrefixLM};
  return *Layout::FromDocuments(cu, kinds, {0, 40, 0, 30});
}

TEST(CudaWgmmaEmulation, ForwardBf16HeadDim64Gqa2) {
  CheckForward<WgmmaFwdCfg<hsap_dev::bf16, 64, 2, true>>(
      MakeBitsProblem(MixedDocuments(), DType::kBF16, 64, 4, 2, 1), 256);
}
TEST(CudaWgmmaEmulation, ForwardF16HeadDim128Gqa2) {
  CheckForward<WgmmaFwdCfg<hsap_dev::f16, 128, 2, true>>(
      MakeBitsProblem(MixedDocuments(), DType::kF16, 128, 2, 1, 2), 160);
}
TEST(CudaWgmmaEmulation, ForwardBf16HeadDim128WithKvHeadMap) {
  if (testing::SweepIsSubset()) GTEST_SKIP() << "sweep subset: d 128 runs in f16 above";
  CheckForward<WgmmaFwdCfg<hsap_dev::bf16, 128, 2, true>>(
      MakeBitsProblem(MixedDocuments(), DType::kBF16, 128, 2, 2, 3), 256, {1, 0});
}
TEST(CudaWgmmaEmulation, ForwardBf16HeadDim256) {
  if (testing::SweepIsSubset()) GTEST_SKIP() << "sweep subset: d 64 and 128 run above";
  const std::vector<int64_t> cu = {0, 130, 250};
  CheckForward<WgmmaFwdCfg<hsap_dev::bf16, 256, 2, true>>(
      MakeBitsProblem(*Layout::FromDocuments(cu, {MaskKind::kCausal, MaskKind::kSlidingWindow},
                                         {0, 50}),
                  DType::kBF16, 256, 2, 1, 4),
      128);
}
// The full-only variant on bidirectional documents.
TEST(CudaWgmmaEmulation, ForwardFullOnlyVariant) {
  const std::vector<int64_t> cu = {0, 100, 300, 330};
  CheckForward<WgmmaFwdCfg<hsap_dev::bf16, 64, 2, false>>(
      MakeBitsProblem(*Layout::FromDocuments(cu, std::vector<MaskKind>(3, MaskKind::kFull)),
                  DType::kBF16, 64, 2, 1, 5),
      128);
}

// User slices: causal blocks, some with a window, and full rectangles onto earlier blocks
// (chunks whose segments are partly or wholly invisible to some of their rows).
TEST(CudaWgmmaEmulation, ForwardArbitrarySlices) {
  CheckForward<WgmmaFwdCfg<hsap_dev::bf16, 64, 2, true>>(
      MakeBitsProblem(testing::RandomSliceLayout(200, 5), DType::kBF16, 64, 2, 1, 6), 128);
}

// A banded segment given to the full-only variant: reported and skipped by the producer,
// whose tile count the consumers follow, so the CTA neither hangs nor computes it.
TEST(CudaWgmmaEmulation, BandInFullOnlyVariantIsFlaggedWithoutHanging) {
  using Cfg = WgmmaFwdCfg<hsap_dev::bf16, 64, 2, false>;
  Problem p = MakeBitsProblem(MixedDocuments(), DType::kBF16, 64, 2, 1, 11);
  absl::StatusOr<WorkList> w = BuildWorkList(p.layout, 128);
  ASSERT_TRUE(w.ok());
  Partial r(p.T(), p.dims);
  EXPECT_EQ(LaunchForward<Cfg>(p, *w, &r),
            static_cast<unsigned int>(hsap_dev::kErrorBandInFullOnlyVariant));
  // The full document's rows (380..480) were computed; the causal document's were not.
  EXPECT_GT(r.lse[400], -INFINITY);
  EXPECT_EQ(r.lse[10], -INFINITY);
}

// NaN and infinity as a naive softmax has them, like the mma.sync and FMA kernels; and a
// non-finite V row of another document, read by a TMA box that crosses the segment's end,
// does not reach this document's rows (the kernel zeroes V rows past the valid keys).
TEST(CudaWgmmaEmulation, NaNAndInfinityPropagateLikeANaiveSoftmax) {
  using Cfg = WgmmaFwdCfg<hsap_dev::bf16, 64, 2, true>;
  testing::ExpectNonFiniteLikeANaiveSoftmax(
      96,
      [](const Problem& p, const WorkList& w, Partial* r) { return LaunchForward<Cfg>(p, w, r); });
}

TEST(CudaWgmmaEmulation, NonFiniteValueRowsOfOtherDocumentsStayOut) {
  using Cfg = WgmmaFwdCfg<hsap_dev::bf16, 64, 2, true>;
  // Documents of 100 and 60 tokens: the first document's key tiles (128 rows) read the
  // second's first 28 rows, whose V holds an inf and a NaN.
  const std::vector<int64_t> cu = {0, 100, 160};
  Problem p = MakeBitsProblem(*Layout::FromDocuments(cu, {MaskKind::kCausal, MaskKind::kFull}),
                          DType::kBF16, 64, 2, 1, 9);
  const int D = 64, HKV = 1;
  p.v.Set((110 * HKV) * D + 3, INFINITY);
  p.v.Set((120 * HKV) * D + 7, NAN);
  absl::StatusOr<WorkList> w = BuildWorkList(p.layout, 128);
  ASSERT_TRUE(w.ok()) << w.status();
  Partial r(p.T(), p.dims);
  EXPECT_EQ(LaunchForward<Cfg>(p, *w, &r), 0u);
  // Rows of the first document are finite (the second's are not: they attend to them).
  for (int64_t row = 0; row < 100; ++row) {
    for (int h = 0; h < 2; ++h) {
      for (int d = 0; d < D; ++d) {
        ASSERT_TRUE(std::isfinite(r.out[(row * 2 + h) * D + d])) << row << " " << h << " " << d;
      }
    }
  }
}

// Broken contracts are flagged and skip the CTA's work, as in the other forwards.
TEST(CudaWgmmaEmulation, BadHeadsAreFlagged) {
  using Cfg = WgmmaFwdCfg<hsap_dev::bf16, 64, 2, true>;
  Problem p = MakeBitsProblem(MixedDocuments(), DType::kBF16, 64, 2, 2, 10);  // 2 != 2 * kGqa
  absl::StatusOr<WorkList> w = BuildWorkList(p.layout, 128);
  ASSERT_TRUE(w.ok());
  Partial r(p.T(), p.dims);
  EXPECT_EQ(LaunchForward<Cfg>(p, *w, &r), static_cast<unsigned int>(hsap_dev::kErrorHeads));
  for (float x : r.lse) EXPECT_EQ(x, -INFINITY);
}

// The fused forward on the sm_90a core: three uneven key shards of a packed row through the
// launches the runtime makes (cuda::FusedWgmmaLaunches, each with the forward's tensor maps of
// the buffer it attends), run in order; two copy CTAs stage step s while the forward's CTAs
// attend step s - 1. Step 2 reuses buffer 0 after step 0's 200 rows, so its tiles read
// step 0's stale rows past its own 150 (masked, V zeroed). The CTAs of a launch run one after
// another, copy CTAs first: no CTA waits for another of its launch.
TEST(CudaWgmmaEmulation, FusedForwardThreeUnevenSteps) {
  using Cfg = WgmmaFwdCfg<hsap_dev::bf16, 64, 2, true, 3>;
  constexpr int kSteps = 3, kCopy = 2;
  const Problem p = MakeBitsProblem(MixedDocuments(), DType::kBF16, 64, 4, 2, 12);
  Partial r(p.T(), p.dims);
  testing::FusedForwardInputs<kSteps> f(p, {{400, 0, 200}, {0, 0, 250}, {250, 0, 150}}, 128, kCopy,
                                        &r);
  absl::StatusOr<std::vector<cuda::FusedWgmmaLaunch>> launches = cuda::FusedWgmmaLaunches(
      f.params.head, absl::MakeConstSpan(f.params.steps, kSteps), kCopy, Cfg::kHeadDim, 2);
  ASSERT_TRUE(launches.ok()) << launches.status();
  ASSERT_EQ(launches->size(), static_cast<size_t>(kSteps + 1));
  testing::EmulatedCudaRuntime emu;
  for (const cuda::FusedWgmmaLaunch& l : *launches) {
    absl::StatusOr<cuda::WgmmaForwardMaps> maps = cuda::EncodeWgmmaForwardMaps(
        emu.driver(), l.fwd, p.dtype, Cfg::kHeadDim, Cfg::kWgmmaBlockN);
    ASSERT_TRUE(maps.ok()) << maps.status();
    hsap_dev::TensorMap tq, tk, tv;  // the kernel parameters, as cuLaunchKernel copies them
    std::memcpy(&tq, &maps->q, sizeof(tq));
    std::memcpy(&tk, &maps->k, sizeof(tk));
    std::memcpy(&tv, &maps->v, sizeof(tv));
    EXPECT_EQ(
        hsap_emu::Launch(l.grid.x, l.grid.y, 384, Cfg::kWgmmaSmemBytes,
                         /*all_concurrent=*/false,
                         [&] { hsap_dev::fused_fwd_wgmma_kernel<Cfg>(l.fwd, l.copy, tq, tk, tv); }),
        absl::OkStatus());
  }
  EXPECT_EQ(f.error_flag, 0u);
  for (int s = 0; s < kSteps; ++s) EXPECT_EQ(f.consumed[s], static_cast<unsigned>(kCopy)) << s;
  testing::ExpectForwardWithinRule(p, r, "fused ");
}

// A peer that never publishes: the copy CTAs give up after the timeout, report it and still
// count their part as consumed; the kernel ends.
TEST(CudaWgmmaEmulation, FusedForwardPeerTimeoutIsReportedAndEnds) {
  using Cfg = WgmmaFwdCfg<hsap_dev::bf16, 64, 2, true, 3>;
  const Problem p = MakeBitsProblem(MixedDocuments(), DType::kBF16, 64, 2, 1, 13);
  Partial r(p.T(), p.dims);
  testing::FusedForwardInputs<3> f(p, {{0, 0, p.T()}}, 128, 1, &r);
  const unsigned int never = 0;
  f.params.steps[0].ready_flag = &never;
  f.params.steps[0].ready_value = 1;
  f.params.head.ready_timeout_ns = 1000000;  // 1 ms
  absl::StatusOr<std::vector<cuda::FusedWgmmaLaunch>> launches = cuda::FusedWgmmaLaunches(
      f.params.head, absl::MakeConstSpan(f.params.steps, 1), 1, Cfg::kHeadDim, 2);
  ASSERT_TRUE(launches.ok()) << launches.status();
  const cuda::FusedWgmmaLaunch& copy_only = launches->front();
  hsap_dev::TensorMap unused{};
  EXPECT_EQ(hsap_emu::Launch(copy_only.grid.x, copy_only.grid.y, 384, Cfg::kWgmmaSmemBytes, false,
                             [&] {
                               hsap_dev::fused_fwd_wgmma_kernel<Cfg>(copy_only.fwd, copy_only.copy,
                                                                     unused, unused, unused);
                             }),
            absl::OkStatus());
  EXPECT_EQ(f.error_flag, static_cast<unsigned int>(hsap_dev::kErrorPeerTimeout));
  EXPECT_EQ(f.consumed[0], 1u);
}

// The generator's tiles and the device shape agree (shared memory, key tile, stages).
TEST(CudaWgmmaEmulation, ConfigurationsAreTheGenerators) {
  using Cfg = WgmmaFwdCfg<hsap_dev::bf16, 128, 2, true>;
  static_assert(Cfg::kWgmmaBlockN == 128 && Cfg::kWgmmaStages == 2);
  static_assert(WgmmaFwdCfg<hsap_dev::bf16, 256, 2, true>::kWgmmaBlockN == 64);
  EXPECT_EQ(hsap_dev::WgmmaFwdShapeOf<Cfg>::kSmemBytes, Cfg::kWgmmaSmemBytes);
  jit::CudaKernelConfig c;
  c.arch = "sm_90a";
  c.dtype = DType::kBF16;
  c.head_dim = 128;
  c.gqa = 2;
  absl::StatusOr<jit::CudaTiles> t = jit::ChooseCudaTiles(c);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_TRUE(t->wgmma_fwd);
  EXPECT_EQ(t->wgmma_smem_bytes, Cfg::kWgmmaSmemBytes);
}

}  // namespace
}  // namespace hsap
