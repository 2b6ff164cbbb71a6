// Inputs and checks of the emulated CUDA kernel tests (tests/jit/cuda_*emulation_test.cc): a
// work list in the device's structs, 16-bit Q/K/V of a packed row, the forward's Params and
// partial results, and the tolerance rule for the kernels' fp32 results. Include after the
// device headers (jit/device/hsap_params.cuh, through tests/support/cuda_emulator.h and the
// kernels').
#ifndef HSAP_TESTS_SUPPORT_EMULATED_KERNEL_INPUTS_H_
#define HSAP_TESTS_SUPPORT_EMULATED_KERNEL_INPUTS_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "attention/dtype.h"
#include "attention/layout.h"
#include "attention/reference.h"
#include "attention/tolerance.h"
#include "attention/worklist.h"
#include "gtest/gtest.h"
#include "tests/support/nonfinite.h"
#include "tests/support/tolerance.h"

namespace hsap::testing {

inline std::vector<hsap_dev::QueryBlock> DeviceBlocks(const WorkList& w) {
  std::vector<hsap_dev::QueryBlock> out;
  for (const QueryBlock& b : w.blocks) out.push_back({b.q_begin, b.q_end, b.seg_begin, b.seg_end});
  return out;
}
inline std::vector<hsap_dev::KeySegment> DeviceSegments(const WorkList& w) {
  std::vector<hsap_dev::KeySegment> out;
  for (const KeySegment& s : w.segments) out.push_back({s.k_begin, s.k_end, s.diag_lo, s.diag_hi});
  return out;
}

// 16-bit storage (bf16 or f16 bits), 16-byte aligned as cp.async and TMA require of a global
// address (and as device allocations are).
struct Bits {
  std::vector<uint16_t> v;
  DType dtype;
  Bits(DType t, size_t n) : v(n + 8, 0), dtype(t) {}
  uint16_t* data() {
    auto p = reinterpret_cast<std::uintptr_t>(v.data());
    return v.data() + ((16 - p % 16) % 16) / 2;
  }
  const uint16_t* data() const { return const_cast<Bits*>(this)->data(); }
  void Set(size_t i, float x) {
    data()[i] = dtype == DType::kBF16 ? FloatToBF16(x).bits : FloatToF16(x).bits;
  }
  float Get(size_t i) const {
    return dtype == DType::kBF16 ? BF16ToFloat(BF16{data()[i]}) : F16ToFloat(F16{data()[i]});
  }
};

// A packed row of [tokens][heads][head_dim] 16-bit Q, K, V.
struct BitsProblem {
  Layout layout;
  AttentionDims dims;
  DType dtype;
  Bits q, k, v;
  int64_t T() const { return layout.num_tokens(); }
};

// Uniform q, k in [-2, 2] and v in [-1, 1]: scores of a few units, so that softmax rows are
// neither flat nor one-hot.
inline BitsProblem MakeBitsProblem(Layout layout, DType dtype, int head_dim, int heads_q,
                                   int heads_kv, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  AttentionDims dims;
  dims.heads_q = heads_q;
  dims.heads_kv = heads_kv;
  dims.head_dim = head_dim;
  dims.scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const int64_t T = layout.num_tokens();
  BitsProblem p{std::move(layout),
                dims,
                dtype,
                Bits(dtype, T * heads_q * head_dim),
                Bits(dtype, T * heads_kv * head_dim),
                Bits(dtype, T * heads_kv * head_dim)};
  for (Bits* x : {&p.q, &p.k}) {
    for (size_t i = 0; i + 8 < x->v.size(); ++i) x->Set(i, 2.0f * u(rng));
  }
  for (size_t i = 0; i + 8 < p.v.v.size(); ++i) p.v.Set(i, u(rng));
  return p;
}

// Out [T, Hq, D] = 0 and lse [Hq, T] = -inf, as init_partial_kernel leaves them.
struct Partial {
  std::vector<float> out, lse;
  Partial(int64_t T, const AttentionDims& d)
      : out(T * d.heads_q * d.head_dim, 0.0f), lse(T * d.heads_q, -INFINITY) {}
};

// The forward's Params over `p` (q and k rows: the whole row) into `r`, with the device work
// list `blocks` / `segments`, the kv-head map (or nullptr) and the error word.
inline hsap_dev::FwdParams ForwardParams(const BitsProblem& p,
                                         const std::vector<hsap_dev::QueryBlock>& blocks,
                                         const std::vector<hsap_dev::KeySegment>& segments,
                                         Partial* r, const int* kv_map, unsigned int* error_flag) {
  hsap_dev::FwdParams fp{};
  fp.q = p.q.data();
  fp.k = p.k.data();
  fp.v = p.v.data();
  fp.out = r->out.data();
  fp.lse = r->lse.data();
  fp.blocks = blocks.data();
  fp.segments = segments.data();
  fp.kv_head_of_q = kv_map;
  fp.error_flag = error_flag;
  fp.q_rows = p.T();
  fp.k_rows = p.T();
  fp.num_blocks = static_cast<int>(blocks.size());
  fp.heads_q = p.dims.heads_q;
  fp.heads_kv = p.dims.heads_kv;
  fp.scale = p.dims.scale;
  return fp;
}

// The fused forward's inputs over `p` (fused_fwd_kernel, fused_fwd_wgmma_kernel): the row's
// keys cut into the contiguous `shards` (runs into the global row), step s attending shard s
// through its own work list (blocks of `block_rows` query rows) and copying it from its own
// buffer (a peer's export) into the two staging buffers, each the size of the largest shard;
// the copy parts of each step, `copy_ctas`; results merged into `r`. No ready flags (every
// shard is published). Built in place: params points into the object.
template <int kSteps>
struct FusedForwardInputs {
  std::vector<Bits> ks, vs, stage;  // stage: K buffers 0 and 1, then V buffers 0 and 1
  std::vector<std::vector<hsap_dev::QueryBlock>> blocks;
  std::vector<std::vector<hsap_dev::KeySegment>> segments;
  unsigned int counters[4] = {0, 0, 0, 0};
  std::vector<unsigned int> consumed = std::vector<unsigned int>(kSteps, 0);
  unsigned int error_flag = 0;
  hsap_dev::FusedFwdParamsT<kSteps> params{};

  FusedForwardInputs(const BitsProblem& p, const std::vector<TokenRun>& shards, int64_t block_rows,
                     int copy_ctas, Partial* r) {
    const int64_t row = int64_t{p.dims.heads_kv} * p.dims.head_dim;
    const std::vector<TokenRun> all = {{0, 0, p.T()}};
    int64_t max_rows = 0;
    for (const TokenRun& shard : shards) {
      ks.emplace_back(p.dtype, shard.length * row);
      vs.emplace_back(p.dtype, shard.length * row);
      for (int64_t i = 0; i < shard.length * row; ++i) {
        ks.back().data()[i] = p.k.data()[shard.global_begin * row + i];
        vs.back().data()[i] = p.v.data()[shard.global_begin * row + i];
      }
      absl::StatusOr<WorkList> w = BuildWorkList(
          p.layout.slices(), all, {{shard.global_begin, 0, shard.length}}, block_rows);
      EXPECT_TRUE(w.ok()) << w.status();
      blocks.push_back(w.ok() ? DeviceBlocks(*w) : std::vector<hsap_dev::QueryBlock>{});
      segments.push_back(w.ok() ? DeviceSegments(*w) : std::vector<hsap_dev::KeySegment>{});
      max_rows = std::max(max_rows, shard.length);
    }
    for (int b = 0; b < 4; ++b) stage.emplace_back(p.dtype, max_rows * row);
    hsap_dev::FusedFwdHead& h = params.head;
    h.q = p.q.data();
    h.out = r->out.data();
    h.lse = r->lse.data();
    h.error_flag = &error_flag;
    for (int b = 0; b < 2; ++b) {
      h.stage_k[b] = stage[b].data();
      h.stage_v[b] = stage[2 + b].data();
    }
    h.counters = counters;
    h.q_rows = p.T();
    h.heads_q = p.dims.heads_q;
    h.heads_kv = p.dims.heads_kv;
    h.scale = p.dims.scale;
    h.num_steps = static_cast<int>(shards.size());
    h.num_copy_ctas = copy_ctas;
    EXPECT_LE(shards.size(), static_cast<size_t>(kSteps));
    for (size_t s = 0; s < shards.size() && s < static_cast<size_t>(kSteps); ++s) {
      hsap_dev::FusedStep& st = params.steps[s];
      st.k_src = ks[s].data();
      st.v_src = vs[s].data();
      st.consumed_flag = &consumed[s];
      st.blocks = blocks[s].data();
      st.segments = segments[s].data();
      st.k_rows = shards[s].length;
      st.num_blocks = static_cast<int>(blocks[s].size());
    }
  }
  FusedForwardInputs(const FusedForwardInputs&) = delete;
  FusedForwardInputs& operator=(const FusedForwardInputs&) = delete;
};

// max |got - ref| over the finite ref entries (a NaN in got is the error); an infinite ref
// entry must be met exactly.
inline double MaxKernelError(const std::vector<float>& got, const std::vector<double>& ref,
                             const std::string& name) {
  EXPECT_EQ(got.size(), ref.size()) << name;
  double e = 0;
  for (size_t i = 0; i < std::min(got.size(), ref.size()); ++i) {
    if (std::isinf(ref[i])) {
      EXPECT_EQ(double{got[i]}, ref[i]) << name << "[" << i << "]";
      continue;
    }
    const double diff = std::abs(double{got[i]} - ref[i]);
    if (!(diff <= e)) e = diff;  // NaN propagates as the error
  }
  return e;
}

// The kernels' rule (attention/tolerance.h): max |got - ref| <= 2 * max |naive - ref| +
// kKernelFloor * max(1, max |ref|); and not bitwise fp64, which bf16/f16 math cannot give.
inline void ExpectWithinRule(const std::string& name, const std::vector<float>& got,
                             const std::vector<double>& naive, const std::vector<double>& ref) {
  const double err = MaxKernelError(got, ref, name);
  double n = 0;  // the naive computation's error (it is fp64 on rounded intermediates)
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isinf(ref[i])) n = std::max(n, std::abs(naive[i] - ref[i]));
  }
  const double bound = ToleranceBound(n, MaxAbs(ref), kKernelFloor);
  EXPECT_LE(err, bound) << name << ": kernel error " << err << ", naive error " << n;
  EXPECT_GT(err, 0.0) << name << ": bitwise equal to fp64 is not what bf16/f16 math gives";
}

// A forward kernel's out and lse in `r` for `p` (kv-head map: p.dims'), against the fp64
// reference under ExpectWithinRule's rule; `name` prefixes the messages.
inline void ExpectForwardWithinRule(const BitsProblem& p, const Partial& r,
                                    const std::string& name = "") {
  const ReferenceInputs in{p.dims, p.dtype, p.q.data(), p.k.data(), p.v.data()};
  const ReferenceForwardResult ref = ReferenceForward(p.layout, in);
  const ReferenceForwardResult naive = NaiveForward(p.layout, in);
  ExpectWithinRule(name + "out", r.out, naive.out, ref.out);
  ExpectWithinRule(name + "lse", r.lse, naive.lse, ref.lse);
}

// NaN and infinity through a 16-bit forward kernel as a naive softmax has them
// (tests/support/nonfinite.h): for every plant, a bf16 row of NonFiniteLayout (d 64, GQA
// 2:1) with the NaN or inf planted in q or k, run by `launch` (the kernel over the work list
// of `block_rows`-row blocks into the partial; returns the error word, which must be 0);
// out and lse must be NaN exactly where the fp64 naive ones are, and infinite lse equal.
inline void ExpectNonFiniteLikeANaiveSoftmax(
    int64_t block_rows,
    const std::function<unsigned int(const BitsProblem&, const WorkList&, Partial*)>& launch) {
  for (Plant plant : kAllPlants) {
    SCOPED_TRACE(PlantName(plant));
    BitsProblem p = MakeBitsProblem(NonFiniteLayout(), DType::kBF16, 64, 2, 1, 8);
    std::vector<float> q(p.q.v.size() - 8), k(p.k.v.size() - 8), v(p.v.v.size() - 8);
    for (size_t i = 0; i < q.size(); ++i) q[i] = p.q.Get(i);
    for (size_t i = 0; i < k.size(); ++i) k[i] = p.k.Get(i), v[i] = p.v.Get(i);
    PlantNonFinite(plant, p.dims, &q, &k);
    for (size_t i = 0; i < q.size(); ++i) p.q.Set(i, q[i]);
    for (size_t i = 0; i < k.size(); ++i) p.k.Set(i, k[i]);
    absl::StatusOr<WorkList> w = BuildWorkList(p.layout, block_rows);
    ASSERT_TRUE(w.ok()) << w.status();
    Partial r(p.T(), p.dims);
    EXPECT_EQ(launch(p, *w, &r), 0u);
    const NaiveOutputs ref = NaiveFp64Forward(p.layout, p.dims, q, k, v);
    int64_t nan_rows = 0;
    for (size_t i = 0; i < r.lse.size(); ++i) {
      ASSERT_EQ(std::isnan(r.lse[i]), std::isnan(ref.lse[i])) << "lse[" << i << "]";
      nan_rows += std::isnan(ref.lse[i]);
      if (std::isinf(ref.lse[i])) {
        EXPECT_EQ(double{r.lse[i]}, ref.lse[i]) << i;
      }
    }
    for (size_t i = 0; i < r.out.size(); ++i) {
      ASSERT_EQ(std::isnan(r.out[i]), std::isnan(ref.out[i])) << "out[" << i << "]";
    }
    EXPECT_GT(nan_rows, 0);
    EXPECT_LT(nan_rows, static_cast<int64_t>(r.lse.size()));
  }
}

// What a backward kernel wrote: dq, dk, dv in fp32, and its error word.
struct Gradients {
  std::vector<float> dq, dk, dv;
  unsigned int error_flag = 0;
};

// What a backward kernel is launched over in the emulation tests: the reference forward's
// lse and delta = rowsum(dO * O) ([heads_q][rows], O rounded to the storage type as the
// runtime keeps it), the row's device work list (blocks of `block_rows`), zeroed gradients
// and the BwdParams over all of them (q and k rows: the whole row; dout: 16-bit storage of
// in.dtype). Built in place: params points into the object; take `gradients` after the run.
struct BackwardInputs {
  std::vector<float> lse, delta;
  std::vector<hsap_dev::QueryBlock> blocks;
  std::vector<hsap_dev::KeySegment> segments;
  std::vector<int> kv_head_of_q;  // in.dims' (in may be a temporary)
  Gradients gradients;
  hsap_dev::BwdParams params{};

  BackwardInputs(const Layout& layout, const ReferenceInputs& in, const void* dout,
                 int64_t block_rows) {
    const AttentionDims& dims = in.dims;
    const int HQ = dims.heads_q, HKV = dims.heads_kv, D = dims.head_dim;
    const int64_t T = layout.num_tokens();
    const ReferenceForwardResult fwd = ReferenceForward(layout, in);
    lse.assign(fwd.lse.begin(), fwd.lse.end());
    delta.assign(T * HQ, 0.0f);
    for (int64_t r = 0; r < T; ++r) {
      for (int h = 0; h < HQ; ++h) {
        double sum = 0;
        for (int d = 0; d < D; ++d) {
          const size_t i = (r * HQ + h) * D + d;
          sum += double{LoadAsFloat(in.dtype, dout, i)} * RoundTo(in.dtype, fwd.out[i]);
        }
        delta[h * T + r] = static_cast<float>(sum);
      }
    }
    absl::StatusOr<WorkList> w = BuildWorkList(layout, block_rows);
    EXPECT_TRUE(w.ok()) << w.status();
    if (w.ok()) {
      blocks = DeviceBlocks(*w);
      segments = DeviceSegments(*w);
    }
    gradients.dq.assign(T * HQ * D, 0.0f);
    gradients.dk.assign(T * HKV * D, 0.0f);
    gradients.dv.assign(T * HKV * D, 0.0f);
    hsap_dev::BwdParams& bp = params;
    bp.q = in.q;
    bp.k = in.k;
    bp.v = in.v;
    bp.dout = dout;
    bp.lse = lse.data();
    bp.delta = delta.data();
    bp.dq = gradients.dq.data();
    bp.dk = gradients.dk.data();
    bp.dv = gradients.dv.data();
    bp.blocks = blocks.data();
    bp.segments = segments.data();
    kv_head_of_q = dims.kv_head_of_q;
    bp.kv_head_of_q = kv_head_of_q.empty() ? nullptr : kv_head_of_q.data();
    bp.error_flag = &gradients.error_flag;
    bp.q_rows = bp.k_rows = T;
    bp.num_blocks = static_cast<int>(blocks.size());
    bp.heads_q = HQ;
    bp.heads_kv = HKV;
    bp.scale = dims.scale;
  }
  BackwardInputs(const BackwardInputs&) = delete;
  BackwardInputs& operator=(const BackwardInputs&) = delete;
};

// `g` against the fp64 reference backward of (layout, in, dout) under the project's rule
// (tests/support/tolerance.h), scaled by the same-precision naive backward's error; no error
// bit set.
inline void ExpectGradientsWithinRule(const Layout& layout, const ReferenceInputs& in,
                                      const void* dout, const Gradients& g) {
  EXPECT_EQ(g.error_flag, 0u);
  const ReferenceGradients ref = ReferenceBackward(layout, in, dout);
  const ReferenceGradients naive = NaiveBackward(layout, in, dout);
  for (const auto& [name, got, want, naive_want] : {std::tuple{"dq", &g.dq, &ref.dq, &naive.dq},
                                                    {"dk", &g.dk, &ref.dk, &naive.dk},
                                                    {"dv", &g.dv, &ref.dv, &naive.dv}}) {
    const std::vector<double> got64(got->begin(), got->end());
    ExpectWithinRule(name, MaxAbsError(got64, *want), MaxAbsError(*naive_want, *want),
                     MaxAbs(*want), DType::kF32, kCudaKernelFloor);
  }
}

}  // namespace hsap::testing

#endif  // HSAP_TESTS_SUPPORT_EMULATED_KERNEL_INPUTS_H_
