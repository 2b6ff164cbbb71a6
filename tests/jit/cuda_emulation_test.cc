// The CUDA kernels of jit/device/hsap_attention.cuh, run on the CPU by the emulator of
// tests/support/cuda_emulator.h (one std::thread per CUDA thread), against the fp64 reference
// under the project's rule:
//   max |kernel - ref| <= 2 * max |naive - ref| + 1e-6 * max(1, max |ref|)
// where `naive` is the same computation with every intermediate rounded to the storage type.
// This checks the kernels' indexing, masking, online softmax, merges, barriers, shuffles
// and the fused kernel's flag protocol on a machine without a GPU; tiles are small so that
// several tiles, chunks and segments occur on short rows. The configurations are those
// jit/codegen_cuda emits (tests/support/emulator_configs.h, generated at build time).
// The emulator must come before the device code.
// clang-format off
#include "tests/support/cuda_emulator.h"
#include "jit/device/hsap_attention.cuh"
#include "tests/support/emulator_configs.h"
// clang-format on

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>
#include <random>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attention/reference.h"
#include "attention/tolerance.h"
#include "attention/worklist.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "jit/codegen_cuda.h"
#include "jit/cuda_kernels.h"
#include "lib/cuda/cudnn/attention_pieces.h"
#include "tests/support/attention_test_util.h"
#include "tests/support/emulated_kernel_inputs.h"
#include "tests/support/nonfinite.h"
#include "tests/support/tolerance.h"

namespace hsap {
namespace {

using testing::SmallTileCfg;

constexpr int kDim = 32;
constexpr int kHeadsQ = 4;
constexpr int kHeadsKv = 2;

// A storage-typed tensor.
struct Tensor {
  DType dtype = DType::kF32;
  std::vector<float> f32;
  std::vector<uint16_t> bits;

  Tensor(DType t, size_t n) : dtype(t) {
    if (t == DType::kF32) {
      f32.assign(n, 0.0f);
    } else {
      bits.assign(n, 0);
    }
  }
  void Set(size_t i, float x) {
    if (dtype == DType::kF32) {
      f32[i] = x;
    } else if (dtype == DType::kBF16) {
      bits[i] = FloatToBF16(x).bits;
    } else {
      bits[i] = FloatToF16(x).bits;
    }
  }
  const void* data() const {
    return dtype == DType::kF32 ? static_cast<const void*>(f32.data()) : bits.data();
  }
  void* data() { return dtype == DType::kF32 ? static_cast<void*>(f32.data()) : bits.data(); }
};

Tensor RandomTensor(std::mt19937_64& rng, DType t, size_t n) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  Tensor x(t, n);
  for (size_t i = 0; i < n; ++i) x.Set(i, u(rng));
  return x;
}

// Rows of a [T, heads, D] tensor at the given global positions, as a new buffer.
Tensor Gather(const Tensor& src, const std::vector<int64_t>& global_rows, int heads) {
  const size_t row = static_cast<size_t>(heads) * kDim;
  Tensor out(src.dtype, global_rows.size() * row);
  for (size_t r = 0; r < global_rows.size(); ++r) {
    for (size_t i = 0; i < row; ++i) {
      const size_t from = global_rows[r] * row + i;
      if (src.dtype == DType::kF32) {
        out.f32[r * row + i] = src.f32[from];
      } else {
        out.bits[r * row + i] = src.bits[from];
      }
    }
  }
  return out;
}

struct Problem {
  Layout layout;
  DType dtype;
  AttentionDims dims;
  Tensor q, k, v, dout;
  int64_t T() const { return layout.num_tokens(); }
};

// Documents of every mask kind, lengths around the small tiles' edges.
Layout MixedLayout() {
  const std::vector<int64_t> cu = {0, 21, 38, 39, 62, 80, 93};
  const std::vector<MaskKind> kinds = {MaskKind::kCausal,   MaskKind::kFull,
                                       MaskKind::kCausal,   MaskKind::kSlidingWindow,
                                       MaskKind::kPrefixLM, MaskKind::kFull};
  const std::vector<int64_t> params = {0, 0, 0, 9, 7, 0};
  return *Layout::FromDocuments(cu, kinds, params);
}

Problem MakeProblem(Layout layout, DType dtype, uint64_t seed, int heads_kv = kHeadsKv,
                    int heads_q = kHeadsQ, int head_dim = kDim) {
  std::mt19937_64 rng(seed);
  AttentionDims dims;
  dims.heads_q = heads_q;
  dims.heads_kv = heads_kv;
  dims.head_dim = head_dim;
  dims.scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const int64_t T = layout.num_tokens();
  Problem p{std::move(layout),
            dtype,
            dims,
            RandomTensor(rng, dtype, T * heads_q * head_dim),
            RandomTensor(rng, dtype, T * heads_kv * head_dim),
            RandomTensor(rng, dtype, T * heads_kv * head_dim),
            RandomTensor(rng, dtype, T * heads_q * head_dim)};
  return p;
}

template <typename A>
double MaxError(const std::vector<A>& a, const std::vector<double>& ref, const char* name) {
  EXPECT_EQ(a.size(), ref.size()) << name;
  double e = 0;
  for (size_t i = 0; i < std::min(a.size(), ref.size()); ++i) {
    if (std::isinf(ref[i])) {
      EXPECT_EQ(static_cast<double>(a[i]), ref[i]) << name << "[" << i << "]";
      continue;
    }
    const double diff = std::abs(static_cast<double>(a[i]) - ref[i]);
    if (!(diff <= e)) e = diff;  // NaN propagates as the error
  }
  return e;
}

void ExpectWithinRule(const std::string& name, const std::vector<float>& kernel,
                      const std::vector<double>& naive, const std::vector<double>& ref) {
  const double kernel_err = MaxError(kernel, ref, name.c_str());
  const double naive_err = MaxError(naive, ref, "naive");
  const double bound = ToleranceBound(naive_err, testing::MaxAbs(ref), kKernelFloor);
  EXPECT_LE(kernel_err, bound) << name << ": kernel error " << kernel_err << ", naive error "
                               << naive_err;
}

using testing::DeviceBlocks;
using testing::DeviceSegments;

template <class Cfg>
void LaunchInit(float* out, float* lse, int64_t rows, int heads = kHeadsQ) {
  hsap_dev::InitParams p{out, lse, rows, heads};
  ASSERT_EQ(hsap_emu::Launch(2, 1, 64, 0, false, [&] { hsap_dev::init_partial_kernel<Cfg>(p); }),
            absl::OkStatus());
}

// Forward of the work list `w` (q buffer = whole row, k/v buffer as given) into out/lse.
template <class Cfg>
unsigned int LaunchForward(const Problem& p, const WorkList& w, const void* k, const void* v,
                           int64_t k_rows, float* out, float* lse, int heads_kv = kHeadsKv,
                           const int* kv_map = nullptr) {
  const auto blocks = DeviceBlocks(w);
  const auto segments = DeviceSegments(w);
  unsigned int error_flag = 0;
  hsap_dev::FwdParams fp{};
  fp.q = p.q.data();
  fp.k = k;
  fp.v = v;
  fp.out = out;
  fp.lse = lse;
  fp.blocks = blocks.data();
  fp.segments = segments.data();
  fp.kv_head_of_q = kv_map;
  fp.error_flag = &error_flag;
  fp.q_rows = p.T();
  fp.k_rows = k_rows;
  fp.num_blocks = static_cast<int>(blocks.size());
  fp.heads_q = p.dims.heads_q;
  fp.heads_kv = heads_kv;
  fp.scale = p.dims.scale;
  if (fp.num_blocks > 0) {
    EXPECT_EQ(hsap_emu::Launch(fp.num_blocks, fp.heads_q, Cfg::kThreads, Cfg::kFwdSmemBytes, false,
                               [&] { hsap_dev::attn_fwd_kernel<Cfg>(fp); }),
              absl::OkStatus());
  }
  return error_flag;
}

// Forward, delta and backward of `p` with the kernels of Cfg against the reference; the
// work list's query blocks have at most `block_rows` rows (more than Cfg::kBlockM: blocks
// are processed in chunks).
template <class Cfg>
void CheckForwardAndBackward(Problem p, int64_t block_rows, std::vector<int> kv_map = {}) {
  ASSERT_EQ(p.dims.head_dim, Cfg::kHeadDim);
  const DType kType = p.dtype;
  const int HQ = p.dims.heads_q, HKV = p.dims.heads_kv, D = p.dims.head_dim;
  p.dims.kv_head_of_q = kv_map;
  const int* kv_map_ptr = kv_map.empty() ? nullptr : kv_map.data();
  const int64_t T = p.T();
  absl::StatusOr<WorkList> w = BuildWorkList(p.layout, block_rows);
  ASSERT_TRUE(w.ok()) << w.status();

  std::vector<float> out(T * HQ * D, 7.0f), lse(T * HQ, 7.0f);
  LaunchInit<Cfg>(out.data(), lse.data(), T, HQ);
  for (float x : lse) ASSERT_EQ(x, -INFINITY);
  for (float x : out) ASSERT_EQ(x, 0.0f);
  EXPECT_EQ(
      LaunchForward<Cfg>(p, *w, p.k.data(), p.v.data(), T, out.data(), lse.data(), HKV, kv_map_ptr),
      0u);

  const ReferenceInputs in{p.dims, p.dtype, p.q.data(), p.k.data(), p.v.data()};
  const ReferenceForwardResult ref = ReferenceForward(p.layout, in);
  const ReferenceForwardResult naive = NaiveForward(p.layout, in);
  ExpectWithinRule("out", out, naive.out, ref.out);
  ExpectWithinRule("lse", lse, naive.lse, ref.lse);

  // Backward from the kernel's own (out, lse), out stored in the storage type.
  Tensor out_stored(kType, out.size());
  hsap_dev::ConvertParams cp{out.data(), out_stored.data(), static_cast<long long>(out.size())};
  ASSERT_EQ(hsap_emu::Launch(3, 1, 64, 0, false, [&] { hsap_dev::convert_out_kernel<Cfg>(cp); }),
            absl::OkStatus());
  for (size_t i = 0; i < out.size(); i += 97) {
    EXPECT_EQ(LoadAsFloat(kType, out_stored.data(), i), RoundTo(kType, out[i]));
  }
  std::vector<float> delta(T * HQ, -1.0f);
  hsap_dev::DeltaParams dp{p.dout.data(), out_stored.data(), delta.data(), T, HQ};
  // Fewer warps than items: the warp-stride loop covers the rest.
  ASSERT_EQ(hsap_emu::Launch(3, 1, 64, 0, false, [&] { hsap_dev::attn_delta_kernel<Cfg>(dp); }),
            absl::OkStatus());
  for (int64_t r = 0; r < T; r += 13) {
    for (int h = 0; h < HQ; ++h) {
      double want = 0;
      for (int d = 0; d < D; ++d) {
        const size_t i = (r * HQ + h) * D + d;
        want +=
            double{LoadAsFloat(kType, p.dout.data(), i)} * LoadAsFloat(kType, out_stored.data(), i);
      }
      EXPECT_NEAR(delta[h * T + r], want, 1e-5 * (1 + std::abs(want))) << r << "," << h;
    }
  }

  const auto blocks = DeviceBlocks(*w);
  const auto segments = DeviceSegments(*w);
  std::vector<float> dq(out.size(), 0.0f), dk(T * HKV * D, 0.0f), dv(dk.size(), 0.0f);
  unsigned int error_flag = 0;
  hsap_dev::BwdParams bp{};
  bp.q = p.q.data();
  bp.k = p.k.data();
  bp.v = p.v.data();
  bp.dout = p.dout.data();
  bp.lse = lse.data();
  bp.delta = delta.data();
  bp.dq = dq.data();
  bp.dk = dk.data();
  bp.dv = dv.data();
  bp.blocks = blocks.data();
  bp.segments = segments.data();
  bp.kv_head_of_q = kv_map_ptr;
  bp.error_flag = &error_flag;
  bp.q_rows = T;
  bp.k_rows = T;
  bp.num_blocks = static_cast<int>(blocks.size());
  bp.heads_q = HQ;
  bp.heads_kv = HKV;
  bp.scale = p.dims.scale;
  ASSERT_EQ(hsap_emu::Launch(bp.num_blocks, HQ, Cfg::kBwdThreads, Cfg::kBwdSmemBytes, false,
                             [&] { hsap_dev::attn_bwd_kernel<Cfg>(bp); }),
            absl::OkStatus());
  EXPECT_EQ(error_flag, 0u);
  const ReferenceGradients gref = ReferenceBackward(p.layout, in, p.dout.data());
  const ReferenceGradients gnaive = NaiveBackward(p.layout, in, p.dout.data());
  ExpectWithinRule("dq", dq, gnaive.dq, gref.dq);
  ExpectWithinRule("dk", dk, gnaive.dk, gref.dk);
  ExpectWithinRule("dv", dv, gnaive.dv, gref.dv);
}

TEST(CudaEmulation, ForwardAndBackwardFp32) {
  CheckForwardAndBackward<SmallTileCfg<float, kHeadsQ / kHeadsKv, true>>(
      MakeProblem(MixedLayout(), DType::kF32, 1), 40);
}
// NaN and infinity as a naive softmax has them (hsap.h), over several chunks and tiles.
TEST(CudaEmulation, NaNAndInfinityPropagateLikeANaiveSoftmax) {
  using Cfg = SmallTileCfg<float, kHeadsQ / kHeadsKv, true>;
  for (testing::Plant plant : testing::kAllPlants) {
    SCOPED_TRACE(testing::PlantName(plant));
    Problem p = MakeProblem(testing::NonFiniteLayout(), DType::kF32, 15);
    testing::PlantNonFinite(plant, p.dims, &p.q.f32, &p.k.f32);
    const int64_t T = p.T();
    absl::StatusOr<WorkList> w = BuildWorkList(p.layout, 40);
    ASSERT_TRUE(w.ok()) << w.status();
    std::vector<float> out(T * kHeadsQ * kDim), lse(T * kHeadsQ);
    LaunchInit<Cfg>(out.data(), lse.data(), T);
    EXPECT_EQ(LaunchForward<Cfg>(p, *w, p.k.data(), p.v.data(), T, out.data(), lse.data()), 0u);
    testing::ExpectForwardNaNPattern(
        out, lse, testing::NaiveFp64Forward(p.layout, p.dims, p.q.f32, p.k.f32, p.v.f32),
        testing::PlantName(plant));
  }
}

TEST(CudaEmulation, ForwardAndBackwardBf16) {
  CheckForwardAndBackward<SmallTileCfg<hsap_dev::bf16, kHeadsQ / kHeadsKv, true>>(
      MakeProblem(MixedLayout(), DType::kBF16, 2), 40);
}
TEST(CudaEmulation, ForwardAndBackwardFp16) {
  CheckForwardAndBackward<SmallTileCfg<hsap_dev::f16, kHeadsQ / kHeadsKv, true>>(
      MakeProblem(MixedLayout(), DType::kF16, 3), 40);
}
// A non-contiguous query-head to kv-head map (HexiSeq head ranges), given at run time.
TEST(CudaEmulation, ForwardAndBackwardWithKvHeadMap) {
  CheckForwardAndBackward<SmallTileCfg<float, kHeadsQ / kHeadsKv, true>>(
      MakeProblem(MixedLayout(), DType::kF32, 8), 40, {1, 0, 0, 1});
}

// The tiles a GPU runs: the configuration ChooseCudaTiles gives a shipped variant (bf16, head
// dim 128, 64x64 forward and 64x32 backward tiles on 128 threads), on a short row whose
// documents end inside, at and across the 64-row tiles. Blocks of up to 160 rows are
// processed in 64-row chunks.
TEST(CudaEmulation, ForwardAndBackwardWithTheTilesOfTheGpu) {
  using Cfg = testing::ChosenTileCfg<hsap_dev::bf16, 128, 1, true>;
  static_assert(Cfg::kBlockM == 64 && Cfg::kBlockN == 64 && Cfg::kThreads == 128);
  static_assert(Cfg::kBwdBlockM == 64 && Cfg::kBwdBlockN == 32 && Cfg::kBwdThreads == 128);
  const std::vector<int64_t> cu = {0, 100, 164, 220};
  const std::vector<MaskKind> kinds = {MaskKind::kCausal, MaskKind::kFull,
                                       MaskKind::kSlidingWindow};
  const std::vector<int64_t> params = {0, 0, 40};
  absl::StatusOr<Layout> layout = Layout::FromDocuments(cu, kinds, params);
  ASSERT_TRUE(layout.ok()) << layout.status();
  CheckForwardAndBackward<Cfg>(
      MakeProblem(*std::move(layout), DType::kBF16, 12, /*heads_kv=*/2, /*heads_q=*/2, 128), 160);
}

// Keys in two shards: two partial forwards (rows that see nothing in a shard keep lse
// -inf), merged by the merge kernel, equal the whole-row reference.
TEST(CudaEmulation, SplitKeysMergeKernel) {
  using Cfg = SmallTileCfg<float, kHeadsQ / kHeadsKv, true>;
  const Problem p = MakeProblem(MixedLayout(), DType::kF32, 4);
  const int64_t T = p.T();
  std::mt19937_64 rng(5);
  const std::vector<TokenRun> all = {{0, 0, T}};
  std::vector<TokenRun> first = testing::RandomRuns(rng, T, 5, 0.5);
  // The complement of `first`, as a second shard.
  std::vector<bool> in_first(T, false);
  for (const TokenRun& r : first) {
    for (int64_t i = 0; i < r.length; ++i) in_first[r.global_begin + i] = true;
  }
  std::vector<TokenRun> second;
  for (int64_t t = 0; t < T; ++t) {
    if (in_first[t]) continue;
    if (!second.empty() && second.back().global_begin + second.back().length == t) {
      ++second.back().length;
    } else {
      second.push_back({t, 0, 1});
    }
  }
  int64_t local = 0;
  for (TokenRun& r : second) {
    r.local_begin = local;
    local += r.length;
  }
  std::vector<std::vector<float>> outs, lses;
  for (const std::vector<TokenRun>* runs : {&first, &second}) {
    const std::vector<int64_t> global = testing::GlobalOfLocal(*runs);
    const Tensor k = Gather(p.k, global, kHeadsKv);
    const Tensor v = Gather(p.v, global, kHeadsKv);
    absl::StatusOr<WorkList> w = BuildWorkList(p.layout.slices(), all, *runs, 32);
    ASSERT_TRUE(w.ok()) << w.status();
    outs.emplace_back(T * kHeadsQ * kDim);
    lses.emplace_back(T * kHeadsQ);
    LaunchInit<Cfg>(outs.back().data(), lses.back().data(), T);
    EXPECT_EQ(LaunchForward<Cfg>(p, *w, k.data(), v.data(), static_cast<int64_t>(global.size()),
                                 outs.back().data(), lses.back().data()),
              0u);
  }
  // Some rows must have seen nothing in one shard, or the test would not test that case.
  EXPECT_TRUE(std::any_of(lses[0].begin(), lses[0].end(), [](float x) { return std::isinf(x); }));
  hsap_dev::MergeParams mp{
      outs[0].data(), lses[0].data(), outs[1].data(), lses[1].data(), T, kHeadsQ, T, T};
  ASSERT_EQ(hsap_emu::Launch(2, 1, 64, 0, false, [&] { hsap_dev::lse_merge_kernel<Cfg>(mp); }),
            absl::OkStatus());
  const ReferenceInputs in{p.dims, p.dtype, p.q.data(), p.k.data(), p.v.data()};
  const ReferenceForwardResult ref = ReferenceForward(p.layout, in);
  const ReferenceForwardResult naive = NaiveForward(p.layout, in);
  ExpectWithinRule("merged out", outs[0], naive.out, ref.out);
  ExpectWithinRule("merged lse", lses[0], naive.lse, ref.lse);
}

// The fused kernel: K/V in kSteps "peer" shards, copy CTAs staging them through the two
// buffers while compute CTAs attend; step 1's shard is ready from the start, the last one
// becomes ready only later (a peer that is still writing). The result equals the reference
// and every counter and flag ends where the protocol says.
// never_ready: the last shard's flag is never published; its copy times out (reported in
// the error word), the kernel still finishes and balances every counter.
// resident > 0: the emulated GPU keeps only that many CTAs resident (fewer than the grid of
// copy_ctas + compute_ctas): CTAs that wait for CTAs that never start would deadlock.
// lost_task: the first task (step 0's first copy) is handed to nobody, as if its CTA never
// ran: the tasks waiting for it give up after the bound, report kErrorStalled, and the
// kernel still ends.
template <int kSteps>
void CheckFused(int copy_ctas, int compute_ctas, uint64_t seed, bool never_ready = false,
                int resident = 0, bool lost_task = false) {
  using Cfg = SmallTileCfg<hsap_dev::bf16, kHeadsQ / kHeadsKv, true, kSteps>;
  const Problem p = MakeProblem(MixedLayout(), DType::kBF16, seed);
  const int64_t T = p.T();
  const std::vector<TokenRun> all = {{0, 0, T}};
  // Contiguous shards of random sizes, attended to in a shuffled order.
  std::mt19937_64 rng(seed);
  std::vector<int64_t> cuts = {0, T};
  while (static_cast<int>(cuts.size()) < kSteps + 1) {
    const int64_t c = std::uniform_int_distribution<int64_t>(1, T - 1)(rng);
    if (std::find(cuts.begin(), cuts.end(), c) == cuts.end()) cuts.push_back(c);
  }
  std::sort(cuts.begin(), cuts.end());
  std::vector<std::vector<TokenRun>> shards;
  for (int s = 0; s < kSteps; ++s) shards.push_back({{cuts[s], 0, cuts[s + 1] - cuts[s]}});
  std::shuffle(shards.begin(), shards.end(), rng);

  std::vector<Tensor> ks, vs;
  std::vector<std::vector<hsap_dev::QueryBlock>> blocks;
  std::vector<std::vector<hsap_dev::KeySegment>> segments;
  int64_t max_rows = 0;
  for (const auto& runs : shards) {
    const std::vector<int64_t> global = testing::GlobalOfLocal(runs);
    ks.push_back(Gather(p.k, global, kHeadsKv));
    vs.push_back(Gather(p.v, global, kHeadsKv));
    absl::StatusOr<WorkList> w = BuildWorkList(p.layout.slices(), all, runs, 32);
    ASSERT_TRUE(w.ok()) << w.status();
    blocks.push_back(DeviceBlocks(*w));
    segments.push_back(DeviceSegments(*w));
    max_rows = std::max<int64_t>(max_rows, global.size());
  }
  std::vector<std::vector<uint16_t>> stage(4, std::vector<uint16_t>(max_rows * kHeadsKv * kDim));
  std::vector<float> out(T * kHeadsQ * kDim), lse(T * kHeadsQ);
  LaunchInit<Cfg>(out.data(), lse.data(), T);

  unsigned int counters[4] = {0, 0, 0, 0};
  std::vector<unsigned int> ready_flags(kSteps, 1), consumed_flags(kSteps, 0);
  ready_flags[1] = 5;           // published with value 5
  ready_flags[kSteps - 1] = 0;  // published later by the "peer" thread
  unsigned int error_flag = 0;
  hsap_dev::FusedFwdParamsT<kSteps> fp{};
  fp.head.q = p.q.data();
  fp.head.out = out.data();
  fp.head.lse = lse.data();
  fp.head.kv_head_of_q = nullptr;
  fp.head.error_flag = &error_flag;
  for (int b = 0; b < 2; ++b) {
    fp.head.stage_k[b] = stage[b].data();
    fp.head.stage_v[b] = stage[2 + b].data();
  }
  fp.head.counters = counters;
  fp.head.q_rows = T;
  fp.head.heads_q = kHeadsQ;
  fp.head.heads_kv = kHeadsKv;
  fp.head.scale = p.dims.scale;
  fp.head.num_steps = kSteps;
  fp.head.num_copy_ctas = copy_ctas;
  fp.head.ready_timeout_ns = never_ready || lost_task ? 20'000'000ull : 0;
  if (lost_task) counters[3] = 1;  // ticket 0 was "taken" by a CTA that never runs
  for (int s = 0; s < kSteps; ++s) {
    hsap_dev::FusedStep& st = fp.steps[s];
    st.k_src = ks[s].data();
    st.v_src = vs[s].data();
    st.ready_flag = s == 0 ? nullptr : &ready_flags[s];
    st.ready_value = s == 1 ? 5 : 1;
    st.consumed_flag = &consumed_flags[s];
    st.blocks = blocks[s].data();
    st.segments = segments[s].data();
    st.k_rows = static_cast<long long>(ks[s].bits.size() / (kHeadsKv * kDim));
    st.num_blocks = static_cast<int>(blocks[s].size());
  }
  std::thread peer([&] {
    if (never_ready) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    std::atomic_ref<unsigned int>(ready_flags[kSteps - 1]).store(1, std::memory_order_release);
  });
  std::optional<hsap_emu::Residency> residency;
  if (resident > 0) residency.emplace(resident, std::chrono::seconds(5));
  const int grid = copy_ctas + compute_ctas;
  EXPECT_EQ(hsap_emu::Launch(residency.has_value() ? &*residency : nullptr, "fused forward", grid,
                             1, Cfg::kThreads, Cfg::kFwdSmemBytes,
                             /*all_concurrent=*/true, [&] { hsap_dev::fused_fwd_kernel<Cfg>(fp); }),
            absl::OkStatus());
  peer.join();
  if (residency.has_value()) {
    EXPECT_EQ(residency->peak(), resident);
  }
  if (lost_task) {
    EXPECT_EQ(error_flag, static_cast<unsigned int>(hsap_dev::kErrorStalled));
    return;
  }

  EXPECT_EQ(error_flag, never_ready ? hsap_dev::kErrorPeerTimeout : 0u);
  const unsigned int uses[2] = {(kSteps + 1) / 2, kSteps / 2};  // steps per staging buffer
  for (int b = 0; b < 2; ++b) {
    EXPECT_EQ(counters[b], uses[b] * copy_ctas) << "ready[" << b << "]";
  }
  unsigned int items = 0;
  for (const auto& b : blocks) items += static_cast<unsigned int>(b.size()) * kHeadsQ;
  EXPECT_EQ(counters[2], items) << "items done";
  // Every task once, then one ticket per CTA that found no work.
  EXPECT_EQ(counters[3], items + kSteps * copy_ctas + grid) << "tickets";
  for (unsigned int c : consumed_flags) EXPECT_EQ(c, static_cast<unsigned int>(copy_ctas));
  if (never_ready) return;  // the last step was not copied: out is garbage

  const ReferenceInputs in{p.dims, p.dtype, p.q.data(), p.k.data(), p.v.data()};
  const ReferenceForwardResult ref = ReferenceForward(p.layout, in);
  const ReferenceForwardResult naive = NaiveForward(p.layout, in);
  ExpectWithinRule("fused out", out, naive.out, ref.out);
  ExpectWithinRule("fused lse", lse, naive.lse, ref.lse);
}

TEST(CudaEmulation, FusedForwardThreeSteps) { CheckFused<3>(1, 2, 6); }
TEST(CudaEmulation, FusedForwardPeerTimeoutFinishes) {
  CheckFused<3>(2, 2, 8, /*never_ready=*/true);
}
// Each staging buffer reused twice or more, several copy CTAs splitting each copy.
TEST(CudaEmulation, FusedForwardFiveStepsTwoCopiers) { CheckFused<5>(2, 3, 9); }
// Issue 26: a GPU that keeps fewer of the kernel's CTAs resident than its grid (other
// kernels hold the rest). A kernel whose CTAs wait for every CTA of the grid deadlocks (the
// emulator reports it); fused_fwd_kernel hands work out by ticket, so the resident CTAs
// finish it, whether two of five or a single one.
TEST(CudaEmulation, FusedForwardUnderPartialResidency) {
  CheckFused<5>(1, 4, 10, /*never_ready=*/false, /*resident=*/2);
  CheckFused<3>(2, 2, 11, /*never_ready=*/false, /*resident=*/1);
}
// A task that nobody runs: every wait on it is bounded, reported, and the kernel ends.
TEST(CudaEmulation, FusedForwardStalledWaitIsBoundedAndReported) {
  CheckFused<3>(1, 2, 12, /*never_ready=*/false, /*resident=*/0, /*lost_task=*/true);
}

// Broken contracts are flagged and skipped, never read out of bounds (ASan watches).
TEST(CudaEmulation, ContractViolationsAreFlagged) {
  const Problem p = MakeProblem(MixedLayout(), DType::kF32, 7);
  const int64_t T = p.T();
  absl::StatusOr<WorkList> w = BuildWorkList(p.layout, 32);
  ASSERT_TRUE(w.ok());
  std::vector<float> out(T * kHeadsQ * kDim), lse(T * kHeadsQ);
  {
    // A full-only variant given causal segments.
    using FullOnly = SmallTileCfg<float, kHeadsQ / kHeadsKv, false>;
    LaunchInit<FullOnly>(out.data(), lse.data(), T);
    const unsigned int flag =
        LaunchForward<FullOnly>(p, *w, p.k.data(), p.v.data(), T, out.data(), lse.data());
    EXPECT_EQ(flag, static_cast<unsigned int>(hsap_dev::kErrorBandInFullOnlyVariant));
  }
  using Cfg = SmallTileCfg<float, kHeadsQ / kHeadsKv, true>;
  {
    // heads_q != heads_kv * kGqa without a map.
    LaunchInit<Cfg>(out.data(), lse.data(), T);
    const unsigned int flag = LaunchForward<Cfg>(p, *w, p.k.data(), p.v.data(), T, out.data(),
                                                 lse.data(), /*heads_kv=*/1);
    EXPECT_EQ(flag, static_cast<unsigned int>(hsap_dev::kErrorHeads));
    for (float x : lse) EXPECT_EQ(x, -INFINITY);
  }
  {
    // Key rows beyond k_rows.
    LaunchInit<Cfg>(out.data(), lse.data(), T);
    const unsigned int flag =
        LaunchForward<Cfg>(p, *w, p.k.data(), p.v.data(), T - 5, out.data(), lse.data());
    EXPECT_EQ(flag, static_cast<unsigned int>(hsap_dev::kErrorRowsOutOfRange));
  }
}

// The emulated configurations are generated (tests/support/gen_emulator_configs.cc): their
// constants are those of the generator's program for the same configuration.
TEST(CudaEmulation, ConfigurationsAreTheGenerators) {
  jit::CudaKernelConfig c;
  c.arch = "sm_90";
  c.dtype = DType::kBF16;
  c.head_dim = kDim;
  c.gqa = kHeadsQ / kHeadsKv;
  c.block_m = 32;
  c.block_n = 16;
  c.threads = 64;
  c.bwd_block_m = 16;
  c.bwd_block_n = 16;
  c.bwd_threads = 32;
  c.role = {2};
  absl::StatusOr<jit::CudaKernelSource> s = jit::GenerateCudaKernels(c);
  ASSERT_TRUE(s.ok()) << s.status();
  using Cfg = SmallTileCfg<hsap_dev::bf16, kHeadsQ / kHeadsKv, true, 3>;
  EXPECT_EQ(s->tiles.fwd_smem_bytes, Cfg::kFwdSmemBytes);
  EXPECT_EQ(s->tiles.bwd_smem_bytes, Cfg::kBwdSmemBytes);
  EXPECT_THAT(s->source,
              ::testing::HasSubstr(absl::StrCat("kFwdSmemBytes = ", Cfg::kFwdSmemBytes, ";")));
  EXPECT_THAT(s->source, ::testing::HasSubstr("kMaxSteps = 3;"));
  EXPECT_EQ(Cfg::kMaxSteps, 3);
  EXPECT_EQ(hsap_dev::FwdShape<Cfg>::kFwdSmemBytes, Cfg::kFwdSmemBytes);
  EXPECT_EQ(hsap_dev::BwdShape<Cfg>::kBwdSmemBytes, Cfg::kBwdSmemBytes);

  // The GPU-tiled configuration is a shipped variant with the tiles ChooseCudaTiles picks.
  using Gpu = testing::ChosenTileCfg<hsap_dev::bf16, 128, 1, true>;
  jit::CudaKernelConfig shipped;
  shipped.arch = "sm_90";
  shipped.dtype = DType::kBF16;
  shipped.head_dim = 128;
  shipped.gqa = 1;
  shipped.has_band = true;
  bool found = false;
  for (const jit::CudaKernelConfig& k : jit::ShippedCudaConfigs("sm_90")) {
    found |= k.Name() == shipped.Name();
  }
  EXPECT_TRUE(found) << shipped.Name();
  shipped.math = jit::CudaMath::kFma;  // ChosenTileCfg: the FMA kernels of that variant
  absl::StatusOr<jit::CudaTiles> tiles = jit::ChooseCudaTiles(shipped);
  ASSERT_TRUE(tiles.ok()) << tiles.status();
  EXPECT_EQ(tiles->block_m, Gpu::kBlockM);
  EXPECT_EQ(tiles->block_n, Gpu::kBlockN);
  EXPECT_EQ(tiles->threads, Gpu::kThreads);
  EXPECT_EQ(tiles->bwd_block_m, Gpu::kBwdBlockM);
  EXPECT_EQ(tiles->bwd_block_n, Gpu::kBwdBlockN);
  EXPECT_EQ(tiles->bwd_threads, Gpu::kBwdThreads);
  EXPECT_EQ(tiles->fwd_smem_bytes, Gpu::kFwdSmemBytes);
  EXPECT_EQ(tiles->bwd_smem_bytes, Gpu::kBwdSmemBytes);
}

// 16-byte vector copies of `n` uint4 per thread at src + i and dst + i (the copy loop of
// copy_slice, without its alignment test). Misaligned pointers are the point here, so the
// undefined-behaviour sanitizer's alignment check (which would abort first) is off.
__attribute__((no_sanitize("alignment"))) void CopyVectors(const unsigned char* src,
                                                           unsigned char* dst) {
  const uint4* s = reinterpret_cast<const uint4*>(src);
  uint4* d = reinterpret_cast<uint4*>(dst);
  const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
  d[i] = s[i];
}

// Two CTAs of 64 threads copy 16 bytes each; threads meet at barriers before and after.
absl::Status LaunchVectorCopy(const unsigned char* src, unsigned char* dst) {
  return hsap_emu::Launch(2, 1, 64, 0, /*all_concurrent=*/false, [&] {
    __syncthreads();
    CopyVectors(src, dst);
    __syncthreads();
    __syncwarp();
  });
}

TEST(CudaEmulation, AlignedVectorCopiesRun) {
  alignas(16) unsigned char src[2 * 64 * 16], dst[2 * 64 * 16] = {};
  for (size_t i = 0; i < sizeof(src); ++i) src[i] = static_cast<unsigned char>(i * 7 + 1);
  ASSERT_EQ(LaunchVectorCopy(src, dst), absl::OkStatus());
  EXPECT_EQ(std::vector<unsigned char>(dst, dst + sizeof(dst)),
            std::vector<unsigned char>(src, src + sizeof(src)));
}

// A misaligned 16-byte load or store fails the launch with the GPU's "misaligned address"
// (the other threads leave at their next barrier), and the process carries on.
TEST(CudaEmulation, MisalignedVectorAccessFailsTheLaunch) {
  alignas(16) unsigned char src[2 * 64 * 16 + 16] = {}, dst[2 * 64 * 16 + 16] = {};
  for (auto [from, to, access] : {std::tuple{src + 4, dst, "load"}, {src, dst + 8, "store"}}) {
    const absl::Status launched = LaunchVectorCopy(from, to);
    EXPECT_EQ(launched.code(), absl::StatusCode::kInternal) << launched;
    EXPECT_THAT(launched.message(), ::testing::HasSubstr("misaligned address"));
    EXPECT_THAT(launched.message(), ::testing::HasSubstr(absl::StrCat("16-byte ", access)));
  }
  // The emulator is usable after a fault.
  alignas(16) unsigned char copy[2 * 64 * 16];
  EXPECT_EQ(LaunchVectorCopy(src, copy), absl::OkStatus());
}

// The same fault in a launch whose CTAs wait on one another: the waiting CTA stops too.
TEST(CudaEmulation, MisalignedVectorAccessStopsWaitingCtas) {
  alignas(16) unsigned char buf[64 * 16 + 16] = {};
  unsigned int flag = 0;
  const absl::Status launched = hsap_emu::Launch(2, 1, 64, 0, /*all_concurrent=*/true, [&] {
    if (blockIdx.x == 0) {
      CopyVectors(buf + 4, buf);  // faults; never signals
      hsap_dev::cta_signal_add_gpu(&flag, 1);
    } else {
      hsap_dev::cta_wait_geq_gpu(&flag, 1);
    }
  });
  EXPECT_EQ(launched.code(), absl::StatusCode::kInternal) << launched;
  EXPECT_THAT(launched.message(), ::testing::HasSubstr("CTA (0, 0)"));
  EXPECT_EQ(flag, 0u);
}

// Threads of a CTA that wait at barriers which cannot complete (lanes 33-63 at their warp's
// barrier, lane 32 at __syncthreads): a GPU hangs; the emulator stops the launch and says so.
TEST(CudaEmulation, ThreadsWaitingAtDifferentBarriersStopTheLaunch) {
  const absl::Status launched = hsap_emu::Launch(2, 1, 64, 0, /*all_concurrent=*/false, [&] {
    if (threadIdx.x >= 33) __syncwarp();
    __syncthreads();
  });
  EXPECT_EQ(launched.code(), absl::StatusCode::kInternal) << launched;
  EXPECT_THAT(launched.message(), ::testing::HasSubstr("deadlock in CTA ("));
  EXPECT_THAT(launched.message(), ::testing::HasSubstr("wait at barriers that cannot complete"));
  // Without the divergence the same launch completes.
  EXPECT_EQ(hsap_emu::Launch(2, 1, 64, 0, false,
                             [&] {
                               __syncwarp();
                               __syncthreads();
                             }),
            absl::OkStatus());
}

// ---- named barriers (bar.sync / bar.arrive a, b) ----

// Two warpgroups take turns as the sm_90a forward's consumers do (hsap_attention_wgmma_fwd.cuh):
// group g waits at barrier 1 + g for its turn and passes it at the other's barrier; group 1
// gives the first turn. Without the barriers the fibers would run group 0's rounds first.
TEST(CudaEmulation, NamedBarriersMakeTwoGroupsTakeTurns) {
  constexpr int kRounds = 5;
  std::vector<int> turns;  // the group of each turn, in order
  const absl::Status launched = hsap_emu::Launch(1, 1, 256, 0, /*all_concurrent=*/false, [&] {
    const int group = static_cast<int>(threadIdx.x) / 128;
    if (group == 1) hsap_dev::named_barrier_arrive<1, 256>();
    for (int round = 0; round < kRounds; ++round) {
      if (group == 0) {
        hsap_dev::named_barrier_sync<1, 256>();
      } else {
        hsap_dev::named_barrier_sync<2, 256>();
      }
      if (threadIdx.x % 128 == 0) turns.push_back(group);
      if (group == 0) {
        hsap_dev::named_barrier_arrive<2, 256>();
      } else {
        hsap_dev::named_barrier_arrive<1, 256>();
      }
    }
  });
  ASSERT_EQ(launched, absl::OkStatus());
  ASSERT_EQ(turns.size(), 2u * kRounds);
  for (size_t i = 0; i < turns.size(); ++i) EXPECT_EQ(turns[i], static_cast<int>(i % 2)) << i;
}

// bar.arrive does not wait: warp 0 arrives at barrier 4 and goes on to barrier 5, where warp 1
// waits before it arrives at barrier 4. Were the arrive a wait, neither warp could go on.
TEST(CudaEmulation, NamedBarrierArriveDoesNotWait) {
  int seen = -1, value = 0;
  const absl::Status launched = hsap_emu::Launch(1, 1, 64, 0, /*all_concurrent=*/false, [&] {
    if (threadIdx.x < 32) {
      if (threadIdx.x == 0) value = 7;
      hsap_dev::named_barrier_arrive<4, 64>();
      hsap_dev::named_barrier_sync<5, 64>();
    } else {
      hsap_dev::named_barrier_sync<5, 64>();
      if (threadIdx.x == 32) seen = value;
      hsap_dev::named_barrier_sync<4, 64>();
    }
  });
  ASSERT_EQ(launched, absl::OkStatus());
  EXPECT_EQ(seen, 7);
}

// What the ISA leaves undefined, or a GPU would hang on, stops the launch with the reason;
// the emulator is usable afterwards.
TEST(CudaEmulation, NamedBarrierMisuseStopsTheLaunch) {
  struct Case {
    int id, threads;
    bool wait;
    const char* says;
  };
  for (const Case& c :
       {Case{0, 64, true, "named barriers are 1..15"},
        Case{16, 64, false, "named barriers are 1..15"},
        Case{3, 48, true, "non-zero multiple of 32"}, Case{3, 0, false, "non-zero multiple of 32"},
        Case{3, 96, true, "at most the CTA's 64 threads"}}) {
    const absl::Status launched = hsap_emu::Launch(
        1, 1, 64, 0, false, [&] { hsap_emu_named_barrier(c.id, c.threads, c.wait); });
    EXPECT_EQ(launched.code(), absl::StatusCode::kInternal) << c.id << " " << c.threads;
    EXPECT_THAT(launched.message(), ::testing::HasSubstr(c.says));
  }
  // One phase, two thread counts.
  absl::Status launched = hsap_emu::Launch(1, 1, 128, 0, false, [&] {
    hsap_emu_named_barrier(2, threadIdx.x < 64 ? 128 : 96, /*wait=*/false);
  });
  EXPECT_EQ(launched.code(), absl::StatusCode::kInternal) << launched;
  EXPECT_THAT(launched.message(), ::testing::HasSubstr("one phase, one thread count"));
  // Exited threads never arrive: half the CTA waits for the other half for ever.
  launched = hsap_emu::Launch(1, 1, 128, 0, false, [&] {
    if (threadIdx.x < 64) hsap_dev::named_barrier_sync<1, 128>();
  });
  EXPECT_EQ(launched.code(), absl::StatusCode::kInternal) << launched;
  EXPECT_THAT(launched.message(), ::testing::HasSubstr("deadlock in CTA ("));
  EXPECT_EQ(hsap_emu::Launch(1, 1, 128, 0, false, [&] { hsap_dev::named_barrier_sync<1, 128>(); }),
            absl::OkStatus());
}

// The device code's own vector copy takes the 4-byte path when a pointer or the size is
// not 16-byte aligned, so it never faults.
TEST(CudaEmulation, CopySliceAvoidsMisalignedVectors) {
  alignas(16) unsigned char src[1024 + 16], dst[1024 + 16] = {};
  for (size_t i = 0; i < sizeof(src); ++i) src[i] = static_cast<unsigned char>(i * 13 + 5);
  for (auto [from, to, bytes] :
       {std::tuple{0, 0, 1024}, {4, 0, 1024}, {0, 12, 1000}, {8, 8, 1012}}) {
    std::fill(std::begin(dst), std::end(dst), 0);
    ASSERT_EQ(hsap_emu::Launch(
                  2, 1, 64, 0, false,
                  [&] { hsap_dev::copy_slice<64>(dst + to, src + from, bytes, blockIdx.x, 2); }),
              absl::OkStatus())
        << from << " " << to << " " << bytes;
    EXPECT_EQ(std::vector<unsigned char>(dst + to, dst + to + bytes),
              std::vector<unsigned char>(src + from, src + from + bytes))
        << from << " " << to << " " << bytes;
  }
}

// ---- The cuDNN engine's helpers (merge_entries, gather_stats, add_entries) --------------

// What cuDNN's fused attention computes for one ragged call, on the host in fp64 with its own
// mask rule (CudnnMask::Admits): each entry's O rows rounded to the storage dtype into `o`
// ([q_rows, Hq, D], the query buffer's rows) and its Stats = max + log(sum) of the scaled
// scores, natural log, into stats [B, Hq, S_max] (fp32).
void CudnnCallOnHost(const Problem& p, const std::vector<cuda::AttentionPiece>& pieces,
                     const cuda::CudnnCall& call, const Tensor& k, const Tensor& v, Tensor& o,
                     std::vector<float>& stats) {
  const int HQ = p.dims.heads_q, G = HQ / p.dims.heads_kv;
  const int64_t S = call.max_q_len;
  stats.assign(call.entries.size() * HQ * S, 0.0f);
  for (size_t b = 0; b < call.entries.size(); ++b) {
    const cuda::AttentionPiece& e = pieces[call.entries[b]];
    for (int h = 0; h < HQ; ++h) {
      for (int64_t i = 0; i < e.q_len; ++i) {
        const int64_t row = e.q_begin + i;
        std::vector<double> score(e.k_len, -INFINITY);
        double mx = -INFINITY;
        for (int64_t j = 0; j < e.k_len; ++j) {
          if (!e.mask.Admits(i, j, e.q_len, e.k_len)) continue;
          double dot = 0;
          for (int d = 0; d < kDim; ++d) {
            dot +=
                static_cast<double>(LoadAsFloat(p.dtype, p.q.data(), (row * HQ + h) * kDim + d)) *
                LoadAsFloat(p.dtype, k.data(), ((e.k_begin + j) * (HQ / G) + h / G) * kDim + d);
          }
          score[j] = dot * p.dims.scale;
          mx = std::max(mx, score[j]);
        }
        double z = 0;
        std::vector<double> acc(kDim, 0.0);
        for (int64_t j = 0; j < e.k_len; ++j) {
          if (std::isinf(score[j])) continue;
          const double w = std::exp(score[j] - mx);
          z += w;
          for (int d = 0; d < kDim; ++d) {
            acc[d] +=
                w * LoadAsFloat(p.dtype, v.data(), ((e.k_begin + j) * (HQ / G) + h / G) * kDim + d);
          }
        }
        stats[(b * HQ + h) * S + i] = static_cast<float>(mx + std::log(z));
        for (int d = 0; d < kDim; ++d) o.Set((row * HQ + h) * kDim + d, acc[d] / z);
      }
    }
  }
}

std::vector<hsap_dev::EntryRows> QueryEntries(const std::vector<cuda::AttentionPiece>& pieces,
                                              const cuda::CudnnCall& call, int64_t* total) {
  std::vector<hsap_dev::EntryRows> rows;
  *total = 0;
  for (size_t i : call.entries) {
    rows.push_back({pieces[i].q_begin, pieces[i].q_len});
    *total += pieces[i].q_len;
  }
  return rows;
}

// The forward as the cuDNN engine runs it: the keys split in two shards, the first attended
// by hsap's kernel into the fp32 accumulators, the second decomposed into cuDNN pieces and
// calls (a prefix-LM document's two slices are two calls over the same rows), each call's
// bf16 O and Stats merged in by merge_entries_kernel. Against the fp64 reference.
TEST(CudaEmulation, CudnnPartialsMergeIntoTheAccumulators) {
  using Cfg = SmallTileCfg<hsap_dev::bf16, kHeadsQ / kHeadsKv, true>;
  const Problem p = MakeProblem(MixedLayout(), DType::kBF16, 21);
  const int64_t T = p.T(), cut = 30;  // inside the first causal document
  const std::vector<TokenRun> all = {{0, 0, T}}, first = {{0, 0, cut}},
                              second = {{cut, 0, T - cut}};
  std::vector<float> out(T * kHeadsQ * kDim), lse(T * kHeadsQ);
  LaunchInit<Cfg>(out.data(), lse.data(), T);
  std::vector<int64_t> g1(cut), g2(T - cut);
  for (int64_t i = 0; i < T; ++i) (i < cut ? g1[i] : g2[i - cut]) = i;
  const Tensor k1 = Gather(p.k, g1, kHeadsKv), v1 = Gather(p.v, g1, kHeadsKv);
  const Tensor k2 = Gather(p.k, g2, kHeadsKv), v2 = Gather(p.v, g2, kHeadsKv);
  const WorkList w1 = *BuildWorkList(p.layout.slices(), all, first, 16);
  EXPECT_EQ(LaunchForward<Cfg>(p, w1, k1.data(), v1.data(), cut, out.data(), lse.data()), 0u);

  const WorkList w2 = *BuildWorkList(p.layout.slices(), all, second, 16);
  const std::vector<cuda::AttentionPiece> pieces = *cuda::DecomposeWorkList(w2);
  std::vector<size_t> every(pieces.size());
  for (size_t i = 0; i < every.size(); ++i) every[i] = i;
  const std::vector<cuda::CudnnCall> calls = cuda::GroupIntoCalls(pieces, every);
  ASSERT_GE(calls.size(), 2u);  // several masks: several calls over overlapping rows
  for (const cuda::CudnnCall& call : calls) {
    Tensor o(DType::kBF16, T * kHeadsQ * kDim);
    std::vector<float> stats;
    CudnnCallOnHost(p, pieces, call, k2, v2, o, stats);
    int64_t total = 0;
    const std::vector<hsap_dev::EntryRows> entries = QueryEntries(pieces, call, &total);
    hsap_dev::EntryMergeParams mp{out.data(),
                                  lse.data(),
                                  o.data(),
                                  stats.data(),
                                  entries.data(),
                                  T,
                                  kHeadsQ * call.max_q_len,
                                  call.max_q_len,
                                  total,
                                  static_cast<int>(entries.size()),
                                  kHeadsQ};
    ASSERT_EQ(
        hsap_emu::Launch(2, 1, 256, 0, false, [&] { hsap_dev::merge_entries_kernel<Cfg>(mp); }),
        absl::OkStatus());
  }
  const ReferenceInputs in{p.dims, p.dtype, p.q.data(), p.k.data(), p.v.data()};
  const ReferenceForwardResult ref = ReferenceForward(p.layout, in);
  const ReferenceForwardResult naive = NaiveForward(p.layout, in);
  ExpectWithinRule("merged out", out, naive.out, ref.out);
  ExpectWithinRule("merged lse", lse, naive.lse, ref.lse);
}

// The backward's side: hsap's final lse gathered into a call's Stats layout (a copy: exact),
// and cuDNN's bf16 dQ/dK/dV rows added into fp32 accumulators (one fp32 rounding of the fp64
// sum: within 2^-24 of it), rows outside the entries untouched.
TEST(CudaEmulation, CudnnStatsGatherAndGradientAdd) {
  using Cfg = SmallTileCfg<hsap_dev::bf16, kHeadsQ / kHeadsKv, true>;
  constexpr int64_t kRows = 57;
  std::mt19937_64 rng(33);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  const std::vector<hsap_dev::EntryRows> entries = {{2, 9}, {11, 1}, {20, 17}, {44, 13}};
  const int64_t S = 17, total = 9 + 1 + 17 + 13;
  std::vector<float> lse(kHeadsQ * kRows);
  for (float& x : lse) x = u(rng);
  std::vector<float> stats(entries.size() * kHeadsQ * S, -1.0f);
  hsap_dev::StatsGatherParams gp{lse.data(),     stats.data(),
                                 entries.data(), kRows,
                                 kHeadsQ * S,    S,
                                 total,          static_cast<int>(entries.size()),
                                 kHeadsQ};
  ASSERT_EQ(hsap_emu::Launch(3, 1, 64, 0, false, [&] { hsap_dev::gather_stats_kernel<Cfg>(gp); }),
            absl::OkStatus());
  for (size_t b = 0; b < entries.size(); ++b) {
    for (int h = 0; h < kHeadsQ; ++h) {
      for (int64_t i = 0; i < S; ++i) {
        const float want = i < entries[b].len ? lse[h * kRows + entries[b].begin + i] : -1.0f;
        ASSERT_EQ(stats[(b * kHeadsQ + h) * S + i], want) << b << " " << h << " " << i;
      }
    }
  }

  const int64_t row_elems = kHeadsKv * kDim;
  std::vector<float> dst(kRows * row_elems);
  for (float& x : dst) x = u(rng);
  const std::vector<float> before = dst;
  Tensor src(DType::kBF16, kRows * row_elems);
  for (int64_t i = 0; i < kRows * row_elems; ++i) src.Set(i, u(rng));
  hsap_dev::EntryAddParams ap{dst.data(), src.data(), entries.data(),
                              row_elems,  total,      static_cast<int>(entries.size())};
  ASSERT_EQ(hsap_emu::Launch(3, 1, 64, 0, false, [&] { hsap_dev::add_entries_kernel<Cfg>(ap); }),
            absl::OkStatus());
  std::vector<bool> in_entry(kRows, false);
  for (const hsap_dev::EntryRows& e : entries) {
    for (int64_t r = e.begin; r < e.begin + e.len; ++r) in_entry[r] = true;
  }
  for (int64_t i = 0; i < kRows * row_elems; ++i) {
    const double added = in_entry[i / row_elems] ? LoadAsFloat(DType::kBF16, src.data(), i) : 0.0;
    const double want = static_cast<double>(before[i]) + added;
    ASSERT_LE(std::abs(dst[i] - want), std::ldexp(std::abs(want), -24)) << i;
  }
}

}  // namespace
}  // namespace hsap
