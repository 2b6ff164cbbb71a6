// The sm_90a backward (jit/device/hsap_attention_wgmma_bwd.cuh) run in the CUDA emulator
// (tests/support/cuda_emulator.h: wgmma from tests/support/emulated_wgmma.h, TMA and mbarriers
// from tests/support/emulated_tma.h, the mma.sync dq items from tests/support/emulated_ptx.h)
// at the tiles the generator picks (key items of 64 keys on one wgmma warpgroup, 64-row query
// tiles), against the fp64 reference backward under the project's rule (attention/tolerance.h):
//   max |kernel - ref| <= 2 * max |naive - ref| + floor * max(1, max |ref|)
// for dq, dk and dv, with lse and delta from the reference forward. The tensor maps are
// encoded by the runtime's host code (lib/cuda/exec/wgmma_tensor_maps.h) through the emulated
// driver. Packed documents of 100-300 tokens (causal, sliding window, full, prefix-LM) end
// inside and across the 64-row tiles, so TMA boxes cross documents and the tensor's end; GQA
// 2:1 and a run-time kv-head map, d 64 and 128, bf16 and f16, band and full-only variants;
// dq, dk, dv bitwise equal on another grid; NaN as the naive backward has it.
// clang-format off
#include "tests/support/cuda_emulator.h"
#include "jit/device/hsap_attention.cuh"
#include "jit/device/hsap_attention_wgmma_bwd.cuh"
#include "tests/support/emulator_configs.h"
// clang-format on

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "attention/dtype.h"
#include "attention/reference.h"
#include "attention/tolerance.h"
#include "attention/worklist.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "jit/codegen_cuda.h"
#include "lib/cuda/exec/wgmma_tensor_maps.h"
#include "tests/support/emulated_cuda_runtime.h"
#include "tests/support/emulated_kernel_inputs.h"
#include "tests/support/nonfinite.h"
#include "tests/support/random_layouts.h"
#include "tests/support/sweep.h"
#include "tests/support/tolerance.h"

namespace hsap {
namespace {

using testing::Bits;
using testing::WgmmaBwdCfg;

// q, k, v (testing::BitsProblem) and dout, 16-byte aligned 16-bit storage.
struct Problem {
  testing::BitsProblem in;
  Bits dout;
  int64_t T() const { return in.T(); }
  ReferenceInputs Inputs() const {
    return {in.dims, in.dtype, in.q.data(), in.k.data(), in.v.data()};
  }
};

Problem MakeProblem(Layout layout, DType dtype, int head_dim, int heads_q, int heads_kv,
                    uint64_t seed, std::vector<int> kv_map = {}) {
  testing::BitsProblem in =
      testing::MakeBitsProblem(std::move(layout), dtype, head_dim, heads_q, heads_kv, seed);
  in.dims.kv_head_of_q = std::move(kv_map);
  Bits dout(dtype, in.q.v.size() - 8);
  std::mt19937_64 rng(seed + 1000);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (size_t i = 0; i + 8 < dout.v.size(); ++i) dout.Set(i, u(rng));
  return Problem{std::move(in), std::move(dout)};
}

using testing::Gradients;

// lse and delta of the reference forward (out rounded to the storage type, as the runtime
// keeps it), then attn_bwd_wgmma_kernel<Cfg> over the row's work list with the tensor maps
// the runtime passes. grid_x = 0: the runtime's grid (num_blocks, heads_q); else (grid_x, 1).
template <class Cfg>
Gradients RunBackward(const Problem& p, int64_t block_rows, unsigned int grid_x = 0,
                      const std::function<void(hsap_dev::BwdParams&)>& tweak = nullptr) {
  testing::BackwardInputs x(p.in.layout, p.Inputs(), p.dout.data(), block_rows);
  hsap_dev::BwdParams& bp = x.params;
  if (tweak) tweak(bp);
  testing::EmulatedCudaRuntime emu;
  absl::StatusOr<cuda::WgmmaBackwardMaps> maps = cuda::EncodeWgmmaBackwardMaps(
      emu.driver(), bp, p.in.dtype, Cfg::kHeadDim, Cfg::kWgmmaBwdBoxRows);
  EXPECT_TRUE(maps.ok()) << maps.status();
  if (!maps.ok()) return std::move(x.gradients);
  hsap_dev::TensorMap tq, tk, tv, tdo;  // the kernel parameters, as cuLaunchKernel copies them
  static_assert(sizeof(tq) == sizeof(maps->q));
  std::memcpy(&tq, &maps->q, sizeof(tq));
  std::memcpy(&tk, &maps->k, sizeof(tk));
  std::memcpy(&tv, &maps->v, sizeof(tv));
  std::memcpy(&tdo, &maps->dout, sizeof(tdo));
  EXPECT_EQ(hsap_emu::Launch(grid_x > 0 ? grid_x : bp.num_blocks, grid_x > 0 ? 1 : bp.heads_q,
                             hsap_dev::WgmmaBwdShape<Cfg>::kThreads, Cfg::kWgmmaBwdSmemBytes, false,
                             [&] { hsap_dev::attn_bwd_wgmma_kernel<Cfg>(bp, tq, tk, tv, tdo); }),
            absl::OkStatus());
  return std::move(x.gradients);
}

void ExpectGradientsWithinRule(const Problem& p, const Gradients& g) {
  testing::ExpectGradientsWithinRule(p.in.layout, p.Inputs(), p.dout.data(), g);
}

// Within the rule on the runtime's grid; with `twice`, also bitwise equal on grids of 8 CTAs
// and of one (other CTAs take the items, every sum keeps its order; one CTA runs every item
// through its stage ring, the stages' and the fixed tiles' phases wrapping many times).
template <class Cfg>
void CheckBackward(const Problem& p, int64_t block_rows, bool twice = false) {
  static_assert(Cfg::kWgmmaBwd && Cfg::kDeterministicDq);
  ASSERT_EQ(p.in.dims.head_dim, Cfg::kHeadDim);
  const Gradients first = RunBackward<Cfg>(p, block_rows);
  ExpectGradientsWithinRule(p, first);
  if (!twice) return;
  auto bits_equal = [](const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  };
  for (unsigned int grid : {8u, 1u}) {
    const Gradients other = RunBackward<Cfg>(p, block_rows, grid);
    EXPECT_EQ(other.error_flag, 0u);
    EXPECT_TRUE(bits_equal(first.dq, other.dq)) << "dq differs on a grid of " << grid;
    EXPECT_TRUE(bits_equal(first.dk, other.dk)) << "dk differs on a grid of " << grid;
    EXPECT_TRUE(bits_equal(first.dv, other.dv)) << "dv differs on a grid of " << grid;
  }
}

// Three documents: causal 150, sliding window (40) 130, full 100 (tiles straddle documents;
// the last boxes cross the tensor's end).
Layout MixedDocuments() {
  const std::vector<int64_t> cu = {0, 150, 280, 380};
  return *Layout::FromDocuments(cu, {MaskKind::kCausal, MaskKind::kSlidingWindow, MaskKind::kFull},
                                {0, 40, 0});
}

TEST(CudaWgmmaBackward, Bf16HeadDim64Gqa2) {
  CheckBackward<WgmmaBwdCfg<hsap_dev::bf16, 64, 2, true>>(
      MakeProblem(MixedDocuments(), DType::kBF16, 64, 2, 1, 41), 96, /*twice=*/true);
}
TEST(CudaWgmmaBackward, F16HeadDim128Gqa2) {
  CheckBackward<WgmmaBwdCfg<hsap_dev::f16, 128, 2, true>>(
      MakeProblem(MixedDocuments(), DType::kF16, 128, 2, 1, 42), 128, /*twice=*/true);
}
// A query-head to kv-head map given at run time, here crossed; user slices (rectangles onto
// earlier blocks, windows).
TEST(CudaWgmmaBackward, Bf16HeadDim128KvHeadMapSlices) {
  if (testing::SweepIsSubset()) GTEST_SKIP() << "sweep subset: d 128 runs in f16 above";
  CheckBackward<WgmmaBwdCfg<hsap_dev::bf16, 128, 2, true>>(
      MakeProblem(testing::RandomSliceLayout(200, 5), DType::kBF16, 128, 2, 2, 43, {1, 0}), 64);
}
TEST(CudaWgmmaBackward, F16HeadDim64Slices) {
  CheckBackward<WgmmaBwdCfg<hsap_dev::f16, 64, 2, true>>(
      MakeProblem(testing::RandomSliceLayout(180, 7), DType::kF16, 64, 2, 1, 44), 64);
}
// The full-only variant on bidirectional documents.
TEST(CudaWgmmaBackward, FullOnlyVariant) {
  const std::vector<int64_t> cu = {0, 100, 230, 260};
  CheckBackward<WgmmaBwdCfg<hsap_dev::bf16, 64, 2, false>>(
      MakeProblem(*Layout::FromDocuments(cu, std::vector<MaskKind>(3, MaskKind::kFull)),
                  DType::kBF16, 64, 2, 1, 45),
      128);
}

// A banded segment given to the full-only variant: reported and skipped (key and dq items),
// without hanging; the full document's gradients are computed.
TEST(CudaWgmmaBackward, BandInFullOnlyVariantIsFlaggedWithoutHanging) {
  const Problem p = MakeProblem(MixedDocuments(), DType::kBF16, 64, 2, 1, 46);
  const Gradients g = RunBackward<WgmmaBwdCfg<hsap_dev::bf16, 64, 2, false>>(p, 128);
  EXPECT_EQ(g.error_flag, static_cast<unsigned int>(hsap_dev::kErrorBandInFullOnlyVariant));
  const int D = 64;
  auto row_nonzero = [&](const std::vector<float>& x, int64_t row, int heads) {
    for (int i = 0; i < heads * D; ++i) {
      if (x[row * heads * D + i] != 0.0f) return true;
    }
    return false;
  };
  EXPECT_TRUE(row_nonzero(g.dq, 300, 2));  // the full document [280, 380)
  EXPECT_TRUE(row_nonzero(g.dk, 300, 1));
  EXPECT_FALSE(row_nonzero(g.dq, 10, 2));  // the causal one
  EXPECT_FALSE(row_nonzero(g.dv, 10, 1));
}

// NaN and infinity in dout: the gradients the naive backward makes NaN are NaN; and the rows
// of another document that a Q / dO box reads past the tile's rows (zeroed in shared memory)
// do not reach this document's keys: documents [0, 100) causal and [100, 160) full, dout of
// rows 110 (+inf) and 120 (NaN) of the second. The first document's query tile [64, 100)
// reads rows 100..127 with its box.
TEST(CudaWgmmaBackward, NonFiniteDoutStaysInItsRowsAndTiles) {
  using Cfg = WgmmaBwdCfg<hsap_dev::bf16, 64, 2, true>;
  const std::vector<int64_t> cu = {0, 100, 160};
  Problem p = MakeProblem(*Layout::FromDocuments(cu, {MaskKind::kCausal, MaskKind::kFull}),
                          DType::kBF16, 64, 2, 1, 47);
  const int D = 64, HQ = 2;
  for (int h = 0; h < HQ; ++h) {
    for (int d = 0; d < D; d += 7) {
      p.dout.Set((110 * HQ + h) * D + d, INFINITY);
      p.dout.Set((120 * HQ + h) * D + d, NAN);
    }
  }
  const Gradients g = RunBackward<Cfg>(p, 128);
  EXPECT_EQ(g.error_flag, 0u);
  std::vector<float> dout(p.in.q.v.size() - 8);
  for (size_t i = 0; i < dout.size(); ++i) dout[i] = p.dout.Get(i);
  const ReferenceForwardResult fwd = ReferenceForward(p.in.layout, p.Inputs());
  const testing::NaNGradients want =
      testing::NaiveNaNGradients(p.in.layout, p.in.dims, fwd.lse, dout);
  testing::ExpectNoNaNLost(g.dq, want.dq, "dq");
  testing::ExpectNoNaNLost(g.dk, want.dk, "dk");
  testing::ExpectNoNaNLost(g.dv, want.dv, "dv");
  // Keys 0..63 (the first key item: only the first document's keys) and the first document's
  // dq rows stay finite.
  for (int64_t i = 0; i < 64 * D; ++i) {
    ASSERT_TRUE(std::isfinite(g.dk[i]) && std::isfinite(g.dv[i])) << "key " << i / D;
  }
  for (int64_t i = 0; i < 100 * HQ * D; ++i) {
    ASSERT_TRUE(std::isfinite(g.dq[i])) << "row " << i / (HQ * D);
  }
}

// Non-finite keys of the next document, read by the dq items' key boxes past the tile's valid
// keys (zeroed in shared memory) and by the key items' tiles (masked), stay out of the first
// document's gradients: documents [0, 100) causal and [100, 160) full, k rows 110 (+inf) and
// 120 (NaN). The dq chunk [64, 100) reads keys 100..127 with its second key box.
TEST(CudaWgmmaBackward, NonFiniteKeysOfOtherDocumentsStayOut) {
  using Cfg = WgmmaBwdCfg<hsap_dev::f16, 64, 2, true>;
  const std::vector<int64_t> cu = {0, 100, 160};
  Problem p = MakeProblem(*Layout::FromDocuments(cu, {MaskKind::kCausal, MaskKind::kFull}),
                          DType::kF16, 64, 2, 1, 49);
  const int D = 64, HQ = 2;
  p.in.k.Set(110 * D + 3, INFINITY);
  p.in.k.Set(120 * D + 7, NAN);
  const Gradients g = RunBackward<Cfg>(p, 128);
  EXPECT_EQ(g.error_flag, 0u);
  for (int64_t i = 0; i < 100 * HQ * D; ++i) {
    ASSERT_TRUE(std::isfinite(g.dq[i])) << "dq row " << i / (HQ * D);
  }
  for (int64_t i = 0; i < 100 * D; ++i) {
    ASSERT_TRUE(std::isfinite(g.dk[i]) && std::isfinite(g.dv[i])) << "key " << i / D;
  }
  int64_t non_finite = 0;  // the second document's gradients are not all finite
  for (int64_t i = 100 * HQ * D; i < 160 * HQ * D; ++i) non_finite += !std::isfinite(g.dq[i]);
  EXPECT_GT(non_finite, 0);
}

// Broken contracts: heads_q != heads_kv * kGqa without a map is flagged and nothing is
// written; a q that is not 16-byte aligned is refused by the tensor-map encoder (host side),
// naming the tensor.
TEST(CudaWgmmaBackward, ContractViolations) {
  using Cfg = WgmmaBwdCfg<hsap_dev::bf16, 64, 2, true>;
  const Problem p = MakeProblem(MixedDocuments(), DType::kBF16, 64, 2, 1, 48);
  const Gradients heads =
      RunBackward<Cfg>(p, 128, 0, [](hsap_dev::BwdParams& bp) { bp.heads_kv = 2; });
  EXPECT_EQ(heads.error_flag, static_cast<unsigned int>(hsap_dev::kErrorHeads));
  for (const std::vector<float>* x : {&heads.dq, &heads.dk, &heads.dv}) {
    for (float v : *x) ASSERT_EQ(v, 0.0f);
  }
  hsap_dev::BwdParams bp{};
  bp.q = reinterpret_cast<const char*>(p.in.q.data()) + 2;
  bp.k = p.in.k.data();
  bp.v = p.in.v.data();
  bp.dout = p.dout.data();
  bp.q_rows = bp.k_rows = p.T();
  bp.heads_q = 2;
  bp.heads_kv = 1;
  testing::EmulatedCudaRuntime emu;
  absl::StatusOr<cuda::WgmmaBackwardMaps> maps =
      cuda::EncodeWgmmaBackwardMaps(emu.driver(), bp, DType::kBF16, 64, 64);
  EXPECT_FALSE(maps.ok());
  EXPECT_THAT(std::string(maps.status().message()), ::testing::HasSubstr("tensor map of q"));
  bp.q = p.in.q.data();
  EXPECT_FALSE(cuda::EncodeWgmmaBackwardMaps(emu.driver(), bp, DType::kBF16, 256, 64).ok());
  EXPECT_FALSE(cuda::EncodeWgmmaBackwardMaps(emu.driver(), bp, DType::kF32, 64, 64).ok());
}

// The generator's tiles and the device shape agree: 48-row stage tiles in 16-row boxes at
// head dim 128, 64-row tiles and boxes at 64; a producer and two consumer warpgroups.
TEST(CudaWgmmaBackward, ConfigurationsAreTheGenerators) {
  using Cfg = WgmmaBwdCfg<hsap_dev::bf16, 128, 2, true>;
  static_assert(Cfg::kWgmmaBwd && Cfg::kWgmmaBwdBlockM == 48 && Cfg::kWgmmaBwdBoxRows == 16);
  static_assert(hsap_dev::WgmmaBwdShape<Cfg>::kThreads == 384);
  EXPECT_EQ(hsap_dev::WgmmaBwdShape<Cfg>::kSmemBytes, Cfg::kWgmmaBwdSmemBytes);
  EXPECT_EQ(jit::WgmmaBwdBoxRows(Cfg::kWgmmaBwdBlockM), Cfg::kWgmmaBwdBoxRows);
  using Full = WgmmaBwdCfg<hsap_dev::bf16, 64, 2, false>;
  static_assert(Full::kWgmmaBwdBlockM == 64 && Full::kWgmmaBwdBoxRows == 64);
  EXPECT_EQ(hsap_dev::WgmmaBwdShape<Full>::kSmemBytes, Full::kWgmmaBwdSmemBytes);
}

}  // namespace
}  // namespace hsap
