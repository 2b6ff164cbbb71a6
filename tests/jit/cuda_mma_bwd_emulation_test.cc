// The tensor-core backward (jit/device/hsap_attention_mma_bwd.cuh) run by the CPU emulator
// (tests/support/cuda_emulator.h with the warp-collective mma / ldmatrix / cp.async of
// tests/support/emulated_ptx.h) at the tiles and CTA size a GPU runs (the shipped tiles of
// MmaBwdTileFor, 4 warps: 32x64 at head dims 64 and 128, 32x32 with two warps splitting D at
// 144 and 256, 16x32 at 240), every mask kind and arbitrary slices, GQA and a kv-head map, bf16 and
// f16: dq, dk, dv against the fp64 reference backward under the
// project's rule (attention/tolerance.h), with lse and delta from the reference forward.
// The deterministic dq mode run twice is bitwise equal; the atomic mode is within the rule.
// The configurations are the generator's (tests/support/emulator_configs.h).
// The emulator must come before the device code.
// clang-format off
#include "tests/support/cuda_emulator.h"
#include "jit/device/hsap_attention_mma_bwd.cuh"
#include "tests/support/emulator_configs.h"
// clang-format on

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "attention/dtype.h"
#include "attention/layout.h"
#include "attention/reference.h"
#include "attention/tolerance.h"
#include "attention/worklist.h"
#include "gtest/gtest.h"
#include "tests/support/attention_test_util.h"
#include "tests/support/emulated_kernel_inputs.h"
#include "tests/support/tolerance.h"

namespace hsap {
namespace {

using testing::MmaBwdCfg;

// q, k, v, dout in a 16-bit storage type (bit patterns).
struct Problem {
  Layout layout;
  DType dtype;
  AttentionDims dims;
  std::vector<uint16_t> q, k, v, dout;
  int64_t T() const { return layout.num_tokens(); }
  ReferenceInputs Inputs() const { return {dims, dtype, q.data(), k.data(), v.data()}; }
};

std::vector<uint16_t> RandomBits(std::mt19937_64& rng, DType t, size_t n) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<uint16_t> x(n);
  for (uint16_t& b : x) b = t == DType::kBF16 ? FloatToBF16(u(rng)).bits : FloatToF16(u(rng)).bits;
  return x;
}

Problem MakeProblem(Layout layout, DType dtype, int head_dim, int heads_q, int heads_kv,
                    uint64_t seed, std::vector<int> kv_map = {}) {
  std::mt19937_64 rng(seed);
  AttentionDims dims;
  dims.heads_q = heads_q;
  dims.heads_kv = heads_kv;
  dims.head_dim = head_dim;
  dims.scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  dims.kv_head_of_q = std::move(kv_map);
  const int64_t T = layout.num_tokens();
  Problem p{std::move(layout), dtype, dims, {}, {}, {}, {}};
  p.q = RandomBits(rng, dtype, T * heads_q * head_dim);
  p.k = RandomBits(rng, dtype, T * heads_kv * head_dim);
  p.v = RandomBits(rng, dtype, T * heads_kv * head_dim);
  p.dout = RandomBits(rng, dtype, T * heads_q * head_dim);
  return p;
}

// Documents of every mask kind whose lengths end inside, at and across 64-row tiles (the
// emulator runs a thread per CUDA thread: rows are few, tiles are the GPU's).
Layout DocumentLayout() {
  const std::vector<int64_t> cu = {0, 70, 75, 120, 150};
  const std::vector<MaskKind> kinds = {MaskKind::kCausal, MaskKind::kFull, MaskKind::kSlidingWindow,
                                       MaskKind::kPrefixLM};
  const std::vector<int64_t> params = {0, 0, 23, 19};
  return *Layout::FromDocuments(cu, kinds, params);
}

// Arbitrary block-sparse slices: off-diagonal rectangles, a band with both bounds, a causal
// window, and rows that see nothing.
Layout SliceLayout() {
  std::vector<MaskSlice> slices = {
      MaskSlice::Causal(0, 70, 0, 70),
      MaskSlice::Full(70, 110, 10, 45),
      MaskSlice::Causal(70, 110, 70, 110, 17),
      {110, 140, 60, 130, -30, 12},  // diag_lo <= (k - 60) - (q - 110) <= diag_hi
  };
  return *Layout::FromSlices(140, std::move(slices));
}

using testing::Gradients;

// lse and delta of the reference forward (out rounded to the storage type, as the runtime
// keeps it), then the mma backward of Cfg over the whole row's work list.
// grid_x = 0: the grid the runtime launches, (num_blocks, heads_q); else (grid_x, 1): the
// kernel walks its items over any grid. `tweak` may break the Params' contract.
template <class Cfg>
Gradients RunBackward(const Problem& p, int64_t block_rows, unsigned int grid_x = 0,
                      const std::function<void(hsap_dev::BwdParams&)>& tweak = nullptr) {
  testing::BackwardInputs x(p.layout, p.Inputs(), p.dout.data(), block_rows);
  hsap_dev::BwdParams& bp = x.params;
  if (tweak) tweak(bp);
  EXPECT_EQ(hsap_emu::Launch(grid_x > 0 ? grid_x : bp.num_blocks, grid_x > 0 ? 1 : bp.heads_q,
                             Cfg::kBwdThreads, Cfg::kBwdSmemBytes, false,
                             [&] { hsap_dev::attn_bwd_mma_kernel<Cfg>(bp); }),
            absl::OkStatus());
  return std::move(x.gradients);
}

void ExpectGradientsWithinRule(const Problem& p, const Gradients& g) {
  testing::ExpectGradientsWithinRule(p.layout, p.Inputs(), p.dout.data(), g);
}

template <class Cfg>
void CheckDeterministic(const Problem& p, int64_t block_rows) {
  static_assert(Cfg::kDeterministicDq);
  const Gradients first = RunBackward<Cfg>(p, block_rows);
  ExpectGradientsWithinRule(p, first);
  // Again on a grid of 8 CTAs: other CTAs take the items, the sums keep their order.
  const Gradients second = RunBackward<Cfg>(p, block_rows, 8);
  auto bits_equal = [](const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  };
  EXPECT_EQ(second.error_flag, 0u);
  EXPECT_TRUE(bits_equal(first.dq, second.dq)) << "dq differs between two runs";
  EXPECT_TRUE(bits_equal(first.dk, second.dk)) << "dk differs between two runs";
  EXPECT_TRUE(bits_equal(first.dv, second.dv)) << "dv differs between two runs";
}

// Head dim 64: 32-query x 64-key tiles, 4 warps; bf16, GQA 2, documents of every kind in
// blocks of 96 rows (two 64-row query chunks per block, one of them partial).
TEST(CudaMmaBackward, Bf16HeadDim64Documents) {
  CheckDeterministic<MmaBwdCfg<hsap_dev::bf16, 64, 2, true>>(
      MakeProblem(DocumentLayout(), DType::kBF16, 64, 2, 1, 21), 96);
}
// Head dim 128: 32-query x 64-key tiles for dK/dV (registers), 64-row dq chunks; f16 and
// arbitrary slices, one kv head for two query heads.
TEST(CudaMmaBackward, F16HeadDim128Slices) {
  CheckDeterministic<MmaBwdCfg<hsap_dev::f16, 128, 2, true>>(
      MakeProblem(SliceLayout(), DType::kF16, 128, 2, 1, 22), 64);
}
// A query-head to kv-head map given at run time (HexiSeq head ranges), here crossed; in
// blocks of 128 rows, the work list the runtime builds at head dim 64 (the forward's tile).
TEST(CudaMmaBackward, KvHeadMap) {
  CheckDeterministic<MmaBwdCfg<hsap_dev::f16, 64, 2, true>>(
      MakeProblem(DocumentLayout(), DType::kF16, 64, 2, 2, 23, {1, 0}), 128);
}
// Head dim 256: 32-query x 32-key tiles, two warps per 16 keys each holding dK/dV of half of
// D, and two warps per 16 query rows each holding dQ of half of D (32-row dq chunks); bf16,
// GQA 2, documents of every kind in blocks of 96 rows.
TEST(CudaMmaBackward, Bf16HeadDim256Documents) {
  CheckDeterministic<MmaBwdCfg<hsap_dev::bf16, 256, 2, true>>(
      MakeProblem(DocumentLayout(), DType::kBF16, 256, 2, 1, 26), 96);
}
// Head dim 144: the same split, with 72 columns per warp (an odd number of 8-column n-tiles,
// the ldmatrix .x2 tail of the fragment loads); arbitrary slices.
TEST(CudaMmaBackward, Bf16HeadDim144Slices) {
  CheckDeterministic<MmaBwdCfg<hsap_dev::bf16, 144, 2, true>>(
      MakeProblem(SliceLayout(), DType::kBF16, 144, 2, 1, 27), 64);
}
// Head dim 240: the dq pass takes 16-key tiles there (MmaBwdShape::kDqBN); f16, slices.
TEST(CudaMmaBackward, F16HeadDim240Slices) {
  CheckDeterministic<MmaBwdCfg<hsap_dev::f16, 240, 2, true>>(
      MakeProblem(SliceLayout(), DType::kF16, 240, 2, 1, 31), 64);
}
// fp32 atomics for dq: within the rule (not bitwise reproducible by design), at head dims 64,
// 128, 144 (dq columns in two parts: 144 / 8 does not divide by 4 warps) and 256.
TEST(CudaMmaBackward, AtomicDqWithinTheRule) {
  const Problem p = MakeProblem(SliceLayout(), DType::kBF16, 128, 2, 1, 24);
  ExpectGradientsWithinRule(p, RunBackward<MmaBwdCfg<hsap_dev::bf16, 128, 2, false>>(p, 64));
  const Problem p64 = MakeProblem(DocumentLayout(), DType::kBF16, 64, 2, 1, 28);
  ExpectGradientsWithinRule(p64, RunBackward<MmaBwdCfg<hsap_dev::bf16, 64, 2, false>>(p64, 96));
  const Problem p144 = MakeProblem(DocumentLayout(), DType::kBF16, 144, 2, 1, 30);
  ExpectGradientsWithinRule(p144, RunBackward<MmaBwdCfg<hsap_dev::bf16, 144, 2, false>>(p144, 96));
  const Problem p256 = MakeProblem(SliceLayout(), DType::kF16, 256, 2, 1, 29);
  ExpectGradientsWithinRule(p256, RunBackward<MmaBwdCfg<hsap_dev::f16, 256, 2, false>>(p256, 64));
}

// Broken contracts are flagged and nothing is written: q not 16-byte aligned (cp.async),
// and heads_q != heads_kv * kGqa without a map.
TEST(CudaMmaBackward, ContractViolationsAreFlagged) {
  using Cfg = MmaBwdCfg<hsap_dev::bf16, 64, 2, true>;
  const Problem p = MakeProblem(DocumentLayout(), DType::kBF16, 64, 2, 1, 25);
  const std::vector<uint16_t> shifted_q = [&] {
    std::vector<uint16_t> q(p.q.size() + 1);
    std::copy(p.q.begin(), p.q.end(), q.begin() + 1);
    return q;
  }();
  auto all_zero = [](const Gradients& g) {
    for (const std::vector<float>* x : {&g.dq, &g.dk, &g.dv}) {
      for (float v : *x) {
        if (v != 0.0f) return false;
      }
    }
    return true;
  };
  const Gradients misaligned =
      RunBackward<Cfg>(p, 64, 0, [&](hsap_dev::BwdParams& bp) { bp.q = shifted_q.data() + 1; });
  EXPECT_EQ(misaligned.error_flag, static_cast<unsigned int>(hsap_dev::kErrorMisaligned));
  EXPECT_TRUE(all_zero(misaligned));
  const Gradients heads =
      RunBackward<Cfg>(p, 64, 0, [](hsap_dev::BwdParams& bp) { bp.heads_kv = 2; });
  EXPECT_EQ(heads.error_flag, static_cast<unsigned int>(hsap_dev::kErrorHeads));
  EXPECT_TRUE(all_zero(heads));
}

}  // namespace
}  // namespace hsap
