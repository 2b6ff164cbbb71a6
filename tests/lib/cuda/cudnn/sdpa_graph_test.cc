// The cuDNN attention graphs of libhsap's piece runner (lib/cuda/cudnn/sdpa_graph.h): well
// formed for every mask kind, MHA and GQA, forward and backward (with O or with softmax_sum);
// the version gates of engine_choice.h applied; bad specs refused; and, run by the fp64 host
// interpreter (tests/support/sdpa_plan_interpreter.h) on random ragged calls of every mask kind
// (fixed seeds, entries with gaps between them), equal to the host fake of cuDNN
// (tests/support/fake_cudnn_runner.h, which evaluates the runner's definition with
// CudnnMask::Admits) under the rule below. Also the runner's graph cache and its clean
// failure without a GPU (tests/lib/cuda/cudnn/libcudnn_runner_test.cc would need one).
#include "lib/cuda/cudnn/sdpa_graph.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "attention/dtype.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "lib/cuda/cudnn/cudnn_descriptors.h"
#include "lib/cuda/cudnn/libcudnn_runner.h"
#include "tests/support/fake_cudnn_runner.h"
#include "tests/support/scoped_env.h"
#include "tests/support/sdpa_plan_interpreter.h"

namespace hsap::cuda {
namespace {

using ::hsap::testing::FakeCudnnRunner;
using ::hsap::testing::PlanInterpreter;
using ::hsap::testing::RaggedEntries;
using ::testing::HasSubstr;

constexpr CudnnMaskKind kKinds[] = {CudnnMaskKind::kNone,
                                    CudnnMaskKind::kCausalTopLeft,
                                    CudnnMaskKind::kCausalBottomRight,
                                    CudnnMaskKind::kWindowTopLeft,
                                    CudnnMaskKind::kWindowBottomRight,
                                    CudnnMaskKind::kLeftBandTopLeft};

bool Banded(CudnnMaskKind k) {
  return k == CudnnMaskKind::kWindowTopLeft || k == CudnnMaskKind::kWindowBottomRight ||
         k == CudnnMaskKind::kLeftBandTopLeft;
}

SdpaGraphSpec Spec(CudnnMaskKind kind, int hq, int hkv, int64_t batch = 3) {
  SdpaGraphSpec s;
  s.head_dim = 8;
  s.heads_q = hq;
  s.heads_kv = hkv;
  s.mask.kind = kind;
  s.mask.left_bound = Banded(kind) ? 2 : 0;
  s.batch = batch;
  s.max_q_len = 9;
  s.max_k_len = 11;
  s.q_rows = 40;
  s.k_rows = 50;
  s.version = 91900;
  return s;
}

TEST(SdpaGraphTest, EveryMaskKindBuildsValidGraphs) {
  for (CudnnMaskKind kind : kKinds) {
    for (int hkv : {4, 2}) {
      for (bool with_o : {true, false}) {
        SdpaGraphSpec spec = Spec(kind, 4, hkv);
        spec.softmax_sum_input = !with_o;
        SCOPED_TRACE(absl::StrCat(spec.mask.ToString(), " hkv ", hkv, with_o ? " O" : " sum"));
        absl::StatusOr<CudnnGraphPlan> fwd = SdpaForwardPlan(spec);
        absl::StatusOr<CudnnGraphPlan> bwd = SdpaBackwardPlan(spec);
        ASSERT_TRUE(fwd.ok()) << fwd.status();
        ASSERT_TRUE(bwd.ok()) << bwd.status();
        EXPECT_TRUE(ValidateGraphPlan(*fwd).ok()) << ValidateGraphPlan(*fwd);
        EXPECT_TRUE(ValidateGraphPlan(*bwd).ok()) << ValidateGraphPlan(*bwd);
        EXPECT_EQ(bwd->Find(kUidLeftBound) != nullptr, Banded(kind));
        EXPECT_EQ(bwd->Find(kUidO) != nullptr, with_o);
        // softmax_sum: scratch with O, a bound input without.
        ASSERT_NE(bwd->Find(kUidSoftmaxSum), nullptr);
        EXPECT_EQ(bwd->Find(kUidSoftmaxSum)->scratch_bytes > 0, with_o);
        // Stats in the caller's padded layout [B, Hq, S_q].
        const CudnnTensorNode* stats = fwd->Find(kUidStats);
        EXPECT_EQ(stats->dims, (Dims4{3, 4, 9, 1}));
        EXPECT_EQ(stats->strides, (Dims4{36, 9, 1, 1}));
      }
    }
  }
}

// libcudnn's own checks of every tensor and operation descriptor of every graph (no GPU
// needed: each descriptor gets its required attributes with the right attribute types; the
// operation graph and its engines need a handle, hence a GPU).
TEST(SdpaGraphTest, CudnnFinalizesEveryDescriptor) {
  for (CudnnMaskKind kind : kKinds) {
    for (bool backward : {false, true}) {
      for (bool with_o : {true, false}) {
        if (!backward && !with_o) continue;
        SdpaGraphSpec spec = Spec(kind, 4, 2);
        spec.softmax_sum_input = !with_o;
        absl::StatusOr<CudnnGraphPlan> plan =
            backward ? SdpaBackwardPlan(spec) : SdpaForwardPlan(spec);
        ASSERT_TRUE(plan.ok()) << plan.status();
        const absl::Status s = FinalizePlanDescriptors(*plan, DType::kBF16);
        if (s.code() == absl::StatusCode::kUnimplemented &&
            (absl::StrContains(s.message(), "not found") ||
             absl::StrContains(s.message(), "without cudnn_graph.h"))) {
          GTEST_SKIP() << s;
        }
        EXPECT_TRUE(s.ok()) << spec.mask.ToString() << (backward ? " backward" : " forward") << ": "
                            << s;
      }
    }
  }
}

TEST(SdpaGraphTest, RefusesWhatNoGraphTakes) {
  auto expect = [](SdpaGraphSpec s, absl::StatusCode code, const char* text) {
    const absl::Status st = SdpaForwardPlan(s).status();
    EXPECT_EQ(st.code(), code) << st;
    EXPECT_THAT(st.message(), HasSubstr(text));
  };
  SdpaGraphSpec s = Spec(CudnnMaskKind::kCausalBottomRight, 4, 2);
  s.version = 90500;  // bottom-right needs 9.6.0 (MinCudnnVersion)
  expect(s, absl::StatusCode::kFailedPrecondition, "needs cuDNN 9.6.0");
  s = Spec(CudnnMaskKind::kLeftBandTopLeft, 4, 2);
  s.version = 91001;
  expect(s, absl::StatusCode::kFailedPrecondition, "needs cuDNN 9.10.2");
  s = Spec(CudnnMaskKind::kWindowTopLeft, 4, 2);
  s.mask.left_bound = 0;
  expect(s, absl::StatusCode::kInvalidArgument, "left bound 0");
  s = Spec(CudnnMaskKind::kNone, 4, 3);
  expect(s, absl::StatusCode::kInvalidArgument, "multiple of kv heads");
  s = Spec(CudnnMaskKind::kNone, 4, 2);
  s.dtype = DType::kF32;
  expect(s, absl::StatusCode::kInvalidArgument, "bf16 or fp16");
  s = Spec(CudnnMaskKind::kNone, 4, 2);
  s.q_rows = 5;
  expect(s, absl::StatusCode::kInvalidArgument, "cannot hold");
  s = Spec(CudnnMaskKind::kNone, 4, 2);
  s.k_rows = int64_t{1} << 28;
  expect(s, absl::StatusCode::kInvalidArgument, "int32");
}

// One random ragged call: entries with increasing, disjoint rows and gaps, no idle row.
struct RandomCall {
  CudnnMask mask;
  std::vector<int32_t> seq_q, seq_kv, q_off, kv_off;  // offsets in elements, B + 1
  int64_t max_q = 0, max_k = 0, q_rows = 0, k_rows = 0;
};

RandomCall MakeCall(CudnnMaskKind kind, int hq, int hkv, int d, std::mt19937& rng) {
  RandomCall c;
  c.mask.kind = kind;
  c.mask.left_bound = Banded(kind) ? std::uniform_int_distribution<int>(1, 4)(rng) : 0;
  std::uniform_int_distribution<int> len(1, 9), gap(0, 3);
  int64_t q = gap(rng), k = gap(rng);
  while (c.seq_q.size() < 3) {
    const int lq = len(rng), lk = len(rng);
    bool idle_row = false;
    for (int i = 0; i < lq; ++i) {
      bool any = false;
      for (int j = 0; j < lk; ++j) any |= c.mask.Admits(i, j, lq, lk);
      idle_row |= !any;
    }
    if (idle_row) continue;  // pieces have none (DecomposeWorkList drops them)
    c.seq_q.push_back(lq);
    c.seq_kv.push_back(lk);
    c.q_off.push_back(static_cast<int32_t>(q * hq * d));
    c.kv_off.push_back(static_cast<int32_t>(k * hkv * d));
    q += lq + gap(rng);
    k += lk + gap(rng);
    c.max_q = std::max<int64_t>(c.max_q, lq);
    c.max_k = std::max<int64_t>(c.max_k, lk);
  }
  c.q_off.push_back(static_cast<int32_t>(q * hq * d));
  c.kv_off.push_back(static_cast<int32_t>(k * hkv * d));
  c.q_rows = q;
  c.k_rows = k;
  return c;
}

std::vector<double> Doubles(const std::vector<uint16_t>& x) {
  std::vector<double> d(x.size());
  for (size_t i = 0; i < x.size(); ++i) d[i] = LoadAsFloat(DType::kBF16, x.data(), i);
  return d;
}

// The rule: the fake rounds its fp64 result to bf16 (relative 2^-8) or fp32 (Stats); both
// sides compute in fp64, so beyond that only summation order differs (1e-9 of the largest),
// or what the caller names as an absolute bound (`abs`).
void ExpectClose(const char* what, const std::vector<double>& interp,
                 const std::vector<double>& fake, const std::vector<bool>& at, double rel,
                 bool ragged = true, double abs = 0) {
  double top = 0;
  for (size_t i = 0; i < fake.size(); ++i) {
    if (at[i]) top = std::max(top, std::abs(fake[i]));
  }
  int64_t bad = 0, checked = 0;
  for (size_t i = 0; i < fake.size(); ++i) {
    if (!at[i]) {
      // A ragged tensor: the graph writes nothing outside the entries (Stats are padded).
      if (ragged && !std::isnan(interp[i])) ++bad;
      continue;
    }
    ++checked;
    if (!(std::abs(interp[i] - fake[i]) <= rel * std::abs(interp[i]) + std::max(abs, 1e-9 * top))) {
      if (bad == 0) {
        ADD_FAILURE() << what << "[" << i << "]: graph " << interp[i] << ", fake " << fake[i];
      }
      ++bad;
    }
  }
  EXPECT_GT(checked, 0) << what;
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << fake.size() << " elements";
}

TEST(SdpaGraphTest, InterpretedGraphsEqualTheFakesDefinition) {
  constexpr int d = 8;
  std::mt19937 rng(26);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (CudnnMaskKind kind : kKinds) {
    for (int hkv : {2, 1}) {
      const int hq = 2;
      const RandomCall c = MakeCall(kind, hq, hkv, d, rng);
      SCOPED_TRACE(absl::StrCat(c.mask.ToString(), " hq ", hq, " hkv ", hkv));
      const int64_t qn = c.q_rows * hq * d, kn = c.k_rows * hkv * d;
      std::vector<uint16_t> q(qn), k(kn), v(kn), dout(qn);
      for (auto* t : {&q, &k, &v, &dout}) {
        for (size_t i = 0; i < t->size(); ++i)
          StoreFromFloat(DType::kBF16, t->data(), i, normal(rng));
      }
      const int64_t b = static_cast<int64_t>(c.seq_q.size());
      const SdpaShape shape{DType::kBF16, d, hq, hkv, 1.0f / std::sqrt(static_cast<float>(d))};
      SdpaCall call;
      call.mask = c.mask;
      call.num_entries = static_cast<int>(b);
      call.max_q_len = c.max_q;
      call.max_k_len = c.max_k;
      call.seq_q = c.seq_q.data();
      call.seq_kv = c.seq_kv.data();
      call.q_offsets = c.q_off.data();
      call.kv_offsets = c.kv_off.data();
      call.q_rows = c.q_rows;
      call.k_rows = c.k_rows;
      // Where the entries' rows are (per element), and Stats' valid slots.
      std::vector<bool> q_at(qn, false), k_at(kn, false), st_at(b * hq * c.max_q, false);
      for (int64_t e = 0; e < b; ++e) {
        std::fill_n(q_at.begin() + c.q_off[e], c.seq_q[e] * hq * d, true);
        std::fill_n(k_at.begin() + c.kv_off[e], c.seq_kv[e] * hkv * d, true);
        for (int h = 0; h < hq; ++h) {
          std::fill_n(st_at.begin() + (e * hq + h) * c.max_q, c.seq_q[e], true);
        }
      }

      // The fake, run at once on host memory.
      FakeCudnnRunner fake([](cudaStream, std::function<void()> op) {
        op();
        return absl::OkStatus();
      });
      std::vector<uint16_t> o(qn, 0), dq(qn, 0), dk(kn, 0), dv(kn, 0);
      std::vector<float> stats(b * hq * c.max_q, 0.0f);
      ASSERT_TRUE(
          fake.Forward(shape, call, {q.data(), k.data(), v.data(), o.data(), stats.data()}, nullptr)
              .ok());
      // delta = rowsum(dO * O) per head and buffer row, and in the Stats layout.
      std::vector<float> delta(hq * c.q_rows, 0.0f), delta_stats(stats.size(), 0.0f);
      for (int h = 0; h < hq; ++h) {
        for (int64_t r = 0; r < c.q_rows; ++r) {
          double s = 0;
          for (int x = 0; x < d; ++x) {
            const size_t i = static_cast<size_t>((r * hq + h) * d + x);
            s += static_cast<double>(LoadAsFloat(DType::kBF16, dout.data(), i)) *
                 LoadAsFloat(DType::kBF16, o.data(), i);
          }
          delta[h * c.q_rows + r] = static_cast<float>(s);
        }
      }
      for (int64_t e = 0; e < b; ++e) {
        for (int h = 0; h < hq; ++h) {
          for (int i = 0; i < c.seq_q[e]; ++i) {
            delta_stats[(e * hq + h) * c.max_q + i] =
                delta[h * c.q_rows + c.q_off[e] / (hq * d) + i];
          }
        }
      }
      SdpaBackwardArgs bargs{q.data(),     k.data(), v.data(), o.data(),  dout.data(), stats.data(),
                             delta.data(), c.q_rows, nullptr,  dq.data(), dk.data(),   dv.data()};
      ASSERT_TRUE(fake.Backward(shape, call, bargs, nullptr).ok());
      ASSERT_EQ(fake.error(), "");

      // The graphs, interpreted.
      SdpaGraphSpec spec;
      spec.head_dim = d;
      spec.heads_q = hq;
      spec.heads_kv = hkv;
      spec.mask = c.mask;
      spec.batch = b;
      spec.max_q_len = c.max_q;
      spec.max_k_len = c.max_k;
      spec.q_rows = c.q_rows;
      spec.k_rows = c.k_rows;
      spec.version = 91900;
      const RaggedEntries entries{c.seq_q, c.seq_kv, c.q_off, c.kv_off};
      std::vector<double> qd = Doubles(q), kd = Doubles(k), vd = Doubles(v), dod = Doubles(dout);
      std::vector<double> od = Doubles(o);
      auto scalars = [&](PlanInterpreter& run) {
        run.Scalar(kUidScale, shape.scale);
        run.Scalar(kUidOne, 1.0);
        run.Scalar(kUidLeftBound, static_cast<double>(c.mask.left_bound));
        for (int64_t uid : {kUidLowestPadding, kUidLowestCausal, kUidLowestPadding2}) {
          run.Scalar(uid, std::numeric_limits<float>::lowest());
        }
      };
      {
        absl::StatusOr<CudnnGraphPlan> plan = SdpaForwardPlan(spec);
        ASSERT_TRUE(plan.ok()) << plan.status();
        std::vector<double> o_got(qn, std::nan("")), st_got(stats.size(), std::nan(""));
        PlanInterpreter run(*plan, entries, hq, hkv, d);
        run.Bind(kUidQ, &qd);
        run.Bind(kUidK, &kd);
        run.Bind(kUidV, &vd);
        run.Bind(kUidO, &o_got);
        run.Bind(kUidStats, &st_got);
        scalars(run);
        run.Run();
        ExpectClose("O", o_got, od, q_at, 1.0 / 256);
        ExpectClose("Stats", st_got, std::vector<double>(stats.begin(), stats.end()), st_at,
                    1.0 / (1 << 23), /*ragged=*/false);
      }
      for (bool with_o : {true, false}) {
        SCOPED_TRACE(with_o ? "backward with O" : "backward with softmax_sum");
        spec.softmax_sum_input = !with_o;
        absl::StatusOr<CudnnGraphPlan> plan = SdpaBackwardPlan(spec);
        ASSERT_TRUE(plan.ok()) << plan.status();
        std::vector<double> dq_got(qn, std::nan("")), dk_got(kn, std::nan("")),
            dv_got(kn, std::nan(""));
        std::vector<double> st(stats.begin(), stats.end());
        std::vector<double> sum(delta_stats.begin(), delta_stats.end());
        PlanInterpreter run(*plan, entries, hq, hkv, d);
        run.Bind(kUidQ, &qd);
        run.Bind(kUidK, &kd);
        run.Bind(kUidV, &vd);
        run.Bind(kUidDO, &dod);
        run.Bind(kUidStats, &st);
        if (with_o) run.Bind(kUidO, &od);
        if (!with_o) run.Bind(kUidSoftmaxSum, &sum);
        run.Bind(kUidDQ, &dq_got);
        run.Bind(kUidDK, &dk_got);
        run.Bind(kUidDV, &dv_got);
        scalars(run);
        run.Run();
        // The fake's delta is fp32, the graph's sum_row(dO * O) fp64: where dP - delta
        // cancels (a row with one key) that leaves 2^-24 of delta (|delta| < 16 here) times
        // |K| or |Q| and the scale: below 1e-6, absolute.
        const double abs = with_o ? 1e-6 : 0.0;
        ExpectClose("dQ", dq_got, Doubles(dq), q_at, 1.0 / 256, true, abs);
        ExpectClose("dK", dk_got, Doubles(dk), k_at, 1.0 / 256, true, abs);
        ExpectClose("dV", dv_got, Doubles(dv), k_at, 1.0 / 256, true, abs);
      }
    }
  }
}

TEST(SdpaGraphTest, AWrongMaskIsSeen) {
  // The interpreter tells masks apart: a bottom-right graph run where the fake applies
  // top-left (entries with k_len > q_len) differs.
  constexpr int d = 8, hq = 1, hkv = 1;
  RandomCall c;
  c.mask.kind = CudnnMaskKind::kCausalTopLeft;
  c.seq_q = {3};
  c.seq_kv = {6};
  c.q_off = {0, 3 * d};
  c.kv_off = {0, 6 * d};
  c.max_q = 3;
  c.max_k = 6;
  SdpaGraphSpec spec = Spec(CudnnMaskKind::kCausalBottomRight, hq, hkv, 1);
  spec.max_q_len = 3;
  spec.max_k_len = 6;
  spec.q_rows = 3;
  spec.k_rows = 6;
  absl::StatusOr<CudnnGraphPlan> plan = SdpaForwardPlan(spec);
  ASSERT_TRUE(plan.ok());
  std::mt19937 rng(3);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> q(3 * d), k(6 * d), v(6 * d), o(3 * d, 0), st(3, 0);
  for (auto* t : {&q, &k, &v}) {
    for (double& x : *t) x = normal(rng);
  }
  PlanInterpreter run(*plan, RaggedEntries{c.seq_q, c.seq_kv, c.q_off, c.kv_off}, hq, hkv, d);
  run.Bind(kUidQ, &q);
  run.Bind(kUidK, &k);
  run.Bind(kUidV, &v);
  run.Bind(kUidO, &o);
  run.Bind(kUidStats, &st);
  run.Scalar(kUidScale, 0.5);
  run.Scalar(kUidLowestPadding, std::numeric_limits<float>::lowest());
  run.Scalar(kUidLowestCausal, std::numeric_limits<float>::lowest());
  run.Run();
  // Row 0 under top-left sees key 0 only: its O would be V row 0.
  double diff = 0;
  for (int x = 0; x < d; ++x) diff = std::max(diff, std::abs(o[x] - v[x]));
  EXPECT_GT(diff, 1e-3);
}

TEST(LibCudnnRunnerTest, KeysAndSpecs) {
  const SdpaShape shape{DType::kF16, 64, 8, 2, 0.125f};
  SdpaCall call;
  call.mask = {CudnnMaskKind::kWindowBottomRight, 128};
  call.num_entries = 5;
  call.max_q_len = 300;
  call.max_k_len = 700;
  const SdpaGraphKey fwd = KeyOfCall(shape, call, false, false);
  EXPECT_TRUE(fwd.with_o);  // the forward has no O input to miss
  const SdpaGraphKey bwd = KeyOfCall(shape, call, true, false);
  EXPECT_FALSE(bwd.with_o);
  EXPECT_NE(fwd, bwd);
  SdpaCall other = call;
  other.mask.left_bound = 64;  // bound by value: the same graph
  EXPECT_EQ(KeyOfCall(shape, other, false, true), fwd);
  other.max_k_len = 701;
  EXPECT_NE(KeyOfCall(shape, other, false, true), fwd);
  const SdpaGraphSpec spec = SpecOfKey(bwd, 1000, 2000, 91900);
  EXPECT_TRUE(spec.softmax_sum_input);
  EXPECT_EQ(spec.mask.left_bound, 1);
  EXPECT_EQ(spec.batch, 5);
  EXPECT_TRUE(SdpaBackwardPlan(spec).ok());
}

TEST(LibCudnnRunnerTest, GraphCacheIsLeastRecentlyUsed) {
  SdpaGraphCache<int> cache(2);
  SdpaGraphKey a, b, c;
  a.batch = 1;
  b.batch = 2;
  c.batch = 3;
  EXPECT_EQ(cache.Find(a), nullptr);
  cache.Insert(a, std::make_unique<int>(1));
  cache.Insert(b, std::make_unique<int>(2));
  ASSERT_NE(cache.Find(a), nullptr);  // a is now the most recent
  cache.Insert(c, std::make_unique<int>(3));
  EXPECT_EQ(cache.Find(b), nullptr);  // b was evicted
  ASSERT_NE(cache.Find(a), nullptr);
  EXPECT_EQ(*cache.Find(c), 3);
  EXPECT_EQ(cache.size(), 2u);
  EXPECT_EQ(cache.evictions(), 1);
}

TEST(LibCudnnRunnerTest, WithoutLibraryOrGpuCreationFailsCleanly) {
  {
    testing::ScopedEnv env("HSAP_CUDA_LIB_PATH", "/nonexistent-hsap-dir");
    absl::StatusOr<std::shared_ptr<CudnnPieceRunner>> r = NewLibCudnnPieceRunner();
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kUnimplemented) << r.status();
  }
  absl::StatusOr<std::shared_ptr<CudnnPieceRunner>> r = NewLibCudnnPieceRunner();
  if (r.ok()) GTEST_SKIP() << "a GPU with cuDNN is present: " << (*r)->name();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnimplemented) << r.status();
}

}  // namespace
}  // namespace hsap::cuda
