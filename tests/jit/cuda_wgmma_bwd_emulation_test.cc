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
#include "gtest/gtest.h"
#include "jit/codegen_cuda.h"
#include "lib/cuda/exec/wgmma_tensor_maps.h"
#include "tests/support/emulated_cuda_runtime.h"
#include "tests/support/emulated_kernel_inputs.h"
#include "tests/support/nonfinite.h"
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

struct Gradients {
  std::vector<float> dq, dk, dv;
  unsigned int error_flag = 0;
};

// lse and delta of the reference forward (out rounded to the storage type, as the runtime
// keeps it), then attn_bwd_wgmma_kernel<Cfg> over the row's work list with the tensor maps
// the runtime passes. grid_x = 0: the runtime's grid (num_blocks, heads_q); else (grid_x, 1).
template <class Cfg>
Gradients RunBackward(const Problem& p, int64_t block_rows, unsigned int grid_x = 0,
                      const std::function<void(hsap_dev::BwdParams&)>& tweak = nullptr) {
  const AttentionDims& dims = p.in.dims;
  const int HQ = dims.heads_q, HKV = dims.heads_kv, D = dims.head_dim;
  const int64_t T = p.T();
  const ReferenceForwardResult fwd = ReferenceForward(p.in.layout, p.Inputs());
  std::vector<float> lse(fwd.lse.begin(), fwd.lse.end()), delta(T * HQ, 0.0f);
  for (int64_t r = 0; r < T; ++r) {
    for (int h = 0; h < HQ; ++h) {
      double sum = 0;
      for (int d = 0; d < D; ++d) {
        const size_t i = (r * HQ + h) * D + d;
        sum += double{p.dout.Get(i)} * RoundTo(p.in.dtype, fwd.out[i]);
      }
      delta[h * T + r] = static_cast<float>(sum);
    }
  }
  absl::StatusOr<WorkList> w = BuildWorkList(p.in.layout, block_rows);
  EXPECT_TRUE(w.ok()) << w.status();
  const auto blocks = testing::DeviceBlocks(*w);
  const auto segments = testing::DeviceSegments(*w);
  Gradients g;
  g.dq.assign(T * HQ * D, 0.0f);
  g.dk.assign(T * HKV * D, 0.0f);
  g.dv.assign(T * HKV * D, 0.0f);
  hsap_dev::BwdParams bp{};
  bp.q = p.in.q.data();
  bp.k = p.in.k.data();
  bp.v = p.in.v.data();
  bp.dout = p.dout.data();
  bp.lse = lse.data();
  bp.delta = delta.data();
  bp.dq = g.dq.data();
  bp.dk = g.dk.data();
  bp.dv = g.dv.data();
  bp.blocks = blocks.data();
  bp.segments = segments.data();
  bp.kv_head_of_q = dims.kv_head_of_q.empty() ? nullptr : dims.kv_head_of_q.data();
  bp.error_flag = &g.error_flag;
  bp.q_rows = bp.k_rows = T;
  bp.num_blocks = static_cast<int>(blocks.size());
  bp.heads_q = HQ;
  bp.heads_kv = HKV;
  bp.scale = dims.scale;
  if (tweak) tweak(bp);
  testing::EmulatedCudaRuntime emu;
  absl::StatusOr<cuda::WgmmaBackwardMaps> maps = cuda::EncodeWgmmaBackwardMaps(
      emu.driver(), bp, p.in.dtype, Cfg::kHeadDim, Cfg::kWgmmaBwdBlockM);
  EXPECT_TRUE(maps.ok()) << maps.status();
  if (!maps.ok()) return g;
  hsap_dev::TensorMap tq, tk, tv, tdo;  // the kernel parameters, as cuLaunchKernel copies them
  static_assert(sizeof(tq) == sizeof(maps->q));
  std::memcpy(&tq, &maps->q, sizeof(tq));
  std::memcpy(&tk, &maps->k, sizeof(tk));
  std::memcpy(&tv, &maps->v, sizeof(tv));
  std::memcpy(&tdo, &maps->dout, sizeof(tdo));
  EXPECT_EQ(hsap_emu::Launch(grid_x > 0 ? grid_x : bp.num_blocks, grid_x > 0 ? 1 : HQ, 128,
                             Cfg::kWgmmaBwdSmemBytes, false,
                             [&] { hsap_dev::attn_bwd_wgmma_kernel<Cfg>(bp, tq, tk, tv, tdo); }),
            absl::OkStatus());
  return g;
}

void ExpectGradientsWithinRule(const Problem& p, const Gradients& g) {
  EXPECT_EQ(g.error_flag, 0u);
  const ReferenceGradients ref = ReferenceBackward(p.in.layout, p.Inputs(), p.dout.data());
  const ReferenceGradients naive = NaiveBackward(p.in.layout, p.Inputs(), p.dout.data());
  for (const auto& [name, got, want, naive_want] : {std::tuple{"dq", &g.dq, &ref.dq, &naive.dq},
                                                    {"dk", &g.dk, &ref.dk, &naive.dk},
                                                    {"dv", &g.dv, &ref.dv, &naive.dv}}) {
    const std::vector<double> got64(got->begin(), got->end());
    testing::ExpectWithinRule(name, testing::MaxAbsError(got64, *want),
                              testing::MaxAbsError(*naive_want, *want), testing::MaxAbs(*want),
                              DType::kF32, testing::kCudaKernelFloor);
  }
}

// Within the rule on the runtime's grid, and bitwise equal on a grid of 8 CTAs (other CTAs
// take the items; every sum keeps its order).
template <class Cfg>
void CheckBackward(const Problem& p, int64_t block_rows) {
  static_assert(Cfg::kWgmmaBwd && Cfg::kDeterministicDq);
  ASSERT_EQ(p.in.dims.head_dim, Cfg::kHeadDim);
  const Gradients first = RunBackward<Cfg>(p, block_rows);
  ExpectGradientsWithinRule(p, first);
  if (testing::SweepIsSubset()) return;
  const Gradients second = RunBackward<Cfg>(p, block_rows, 8);
  auto bits_equal = [](const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  };
  EXPECT_EQ(second.error_flag, 0u);
  EXPECT_TRUE(bits_equal(first.dq, second.dq)) << "dq differs between two grids";
  EXPECT_TRUE(bits_equal(first.dk, second.dk)) << "dk differs between two grids";
  EXPECT_TRUE(bits_equal(first.dv, second.dv)) << "dv differs between two grids";
}

// Three documents: causal 150, sliding window (40) 100, full 70 (tiles straddle documents;
// the last boxes cross the tensor's end).
Layout MixedDocuments() {
  const std::vector<int64_t> cu = {0, 150, 250, 320};
  return *Layout::FromDocuments(cu, {MaskKind::kCausal, MaskKind::kSlidingWindow, MaskKind::kFull},
                                {0, 40, 0});
}

TEST(CudaWgmmaBackward, Bf16HeadDim64Gqa2) {
  CheckBackward<WgmmaBwdCfg<hsap_dev::bf16, 64, 2, true>>(
      MakeProblem(MixedDocuments(), DType::kBF16, 64, 2, 1, 41), 96);
}

}  // namespace
}  // namespace hsap
