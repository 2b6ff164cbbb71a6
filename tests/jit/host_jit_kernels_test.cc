#include "jit/host_jit_kernels.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "attention/kernel.h"
#include "attention/merge.h"
#include "attention/reference.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "jit/codegen_host.h"
#include "jit/compile_error.h"
#include "jit/host_compiler.h"
#include "lib/api/result.h"
#include "tests/support/attention_test_util.h"
#include "tests/support/nonfinite.h"
#include "tests/support/scoped_env.h"
#include "tests/support/sweep.h"
#include "tests/support/test_files.h"

namespace hsap::jit {
namespace {

using ::testing::HasSubstr;

std::string MakeTempDir() { return testing::MakeTestTempDir("hsap_host_jit_test"); }

// One isolated cache for the whole file; modules compiled once and shared by the tests.
CompileCache& TestCache() {
  static CompileCache* cache = [] {
    CompileCache::Options options;
    options.dir = MakeTempDir() + "/cache";
    return new CompileCache(options);
  }();
  return *cache;
}

const HostJitKernelSet& Kernels(const HostKernelSpec& spec) {
  auto k = GetHostJitKernels(spec, &TestCache());
  EXPECT_TRUE(k.ok()) << k.status();
  if (!k.ok()) std::abort();
  static std::vector<std::shared_ptr<const HostJitKernelSet>>* keep =
      new std::vector<std::shared_ptr<const HostJitKernelSet>>();
  keep->push_back(*k);
  return **k;
}

AttentionDims Dims(int hq, int hkv, int dim) {
  AttentionDims d;
  d.heads_q = hq;
  d.heads_kv = hkv;
  d.head_dim = dim;
  d.scale = 1.0f / std::sqrt(static_cast<float>(dim));
  return d;
}

// A tensor stored in `dtype` (raw bytes) from normal(0, 1) values.
std::vector<uint8_t> RandomTensor(std::mt19937_64& rng, size_t n, DType dtype) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint8_t> bytes(n * DTypeSize(dtype));
  for (size_t i = 0; i < n; ++i) StoreFromFloat(dtype, bytes.data(), i, normal(rng));
  return bytes;
}

double MaxAbsError(const std::vector<double>& ref, const std::vector<float>& got) {
  double m = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double e = std::abs(ref[i] - static_cast<double>(got[i]));
    if (std::isnan(e)) return INFINITY;
    m = std::max(m, e);
  }
  return m;
}

double MaxAbsError(const std::vector<double>& ref, const std::vector<double>& got) {
  double m = 0;
  for (size_t i = 0; i < ref.size(); ++i) m = std::max(m, std::abs(ref[i] - got[i]));
  return m;
}

double MaxAbs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::abs(x));
  return m;
}

// The rule of the hand-written kernel: at most twice the error of the naive computation in
// the same storage precision, plus a small floor relative to the values.
void ExpectWithinRule(const char* what, const std::vector<double>& ref,
                      const std::vector<double>& naive, const std::vector<float>& got) {
  const double naive_err = MaxAbsError(ref, naive);
  const double err = MaxAbsError(ref, got);
  const double floor = 2e-6 * (1.0 + MaxAbs(ref));
  EXPECT_LE(err, 2.0 * naive_err + floor)
      << what << ": kernel error " << err << ", naive error " << naive_err;
}

// lse with -inf rows compared exactly on -inf, by the rule elsewhere.
void ExpectLseWithinRule(const std::vector<double>& ref, const std::vector<double>& naive,
                         const std::vector<float>& got) {
  std::vector<double> r, n;
  std::vector<float> g;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isinf(ref[i])) {
      EXPECT_TRUE(std::isinf(got[i]) && got[i] < 0) << "lse " << i << " = " << got[i];
      continue;
    }
    r.push_back(ref[i]);
    n.push_back(std::isinf(naive[i]) ? ref[i] : naive[i]);
    g.push_back(got[i]);
  }
  ExpectWithinRule("lse", r, n, g);
}

struct Case {
  DType dtype;
  int head_dim;
  int gqa;
  bool band;  // false: a layout of full documents only, kernels without band masks
  HostIsa isa = HostIsa::kAuto;
  bool operator==(const Case&) const = default;
};

std::string CaseName(const Case& c) {
  return std::string(DTypeName(c.dtype)) + "_d" + std::to_string(c.head_dim) + "_g" +
         std::to_string(c.gqa) + (c.band ? "_band" : "_full") + "_" + HostIsaName(c.isa);
}

Layout CaseLayout(std::mt19937_64& rng, const Case& c, int64_t tokens) {
  if (c.band) return testing::RandomDocumentLayout(rng, tokens, 140);
  std::vector<int64_t> cu = {0};
  std::vector<MaskKind> kinds;
  while (cu.back() < tokens) {
    cu.push_back(std::min(tokens, cu.back() + testing::RandomDocLength(rng, 140) + 1));
    kinds.push_back(MaskKind::kFull);
  }
  return *Layout::FromDocuments(cu, kinds);
}

// Every dtype, head dim (64/128/256) and GQA ratio (1/4/8) appears, with and without band
// masks; each case is one compile. A sweep: the sanitizer pass runs 4 of the 9
// (testing::Sweep's picks: bf16 d128 GQA 4 band, bf16 d64 GQA 8 full, f16 d128 full, f32 d72
// band: every dtype, band and full, GQA 1/4/8).
const std::vector<Case>& GridCases() {
  static const std::vector<Case> cases = {
      Case{DType::kBF16, 128, 4, true},  Case{DType::kF32, 64, 1, true},
      Case{DType::kBF16, 64, 8, false},  Case{DType::kF16, 256, 8, true},
      Case{DType::kF16, 64, 4, true},    Case{DType::kF16, 128, 1, false},
      Case{DType::kF32, 256, 4, false},  Case{DType::kBF16, 128, 4, true, HostIsa::kAvx2},
      Case{DType::kF32, 72, 1, true}};
  return cases;
}
class HostJitCaseTest : public ::testing::TestWithParam<Case> {};

// Forward and backward of the JIT kernels against the fp64 reference, under the same rule
// as the hand-written kernel, on a random packed layout (every mask kind for band cases).
TEST_P(HostJitCaseTest, MatchesReference) {
  const Case c = GetParam();
  if (!testing::SweepIncludes(GridCases(), c, 4)) {
    GTEST_SKIP() << "not in the sweep's subset (HSAP_TEST_SWEEP=subset)";
  }
  HostKernelSpec spec;
  spec.dtype = c.dtype;
  spec.head_dim = c.head_dim;
  spec.gqa_ratio = c.gqa;
  spec.band_masks = c.band;
  spec.isa = c.isa;
  if (c.isa == HostIsa::kAvx512 && !HostHasAvx512()) GTEST_SKIP() << "no AVX-512";
  const HostJitKernelSet& kernels = Kernels(spec);

  std::mt19937_64 rng(1000 + c.head_dim + 7 * c.gqa + static_cast<int>(c.dtype));
  const int64_t tokens = c.head_dim >= 256 ? 200 : 300;
  const Layout layout = CaseLayout(rng, c, tokens);
  const int hkv = c.gqa >= 8 ? 1 : 2;
  const AttentionDims dims = Dims(hkv * c.gqa, hkv, c.head_dim);
  const int64_t qn = tokens * dims.heads_q * dims.head_dim;
  const int64_t kn = tokens * dims.heads_kv * dims.head_dim;
  const auto q = RandomTensor(rng, qn, c.dtype);
  const auto k = RandomTensor(rng, kn, c.dtype);
  const auto v = RandomTensor(rng, kn, c.dtype);
  const auto dout = RandomTensor(rng, qn, c.dtype);
  const ReferenceInputs in{dims, c.dtype, q.data(), k.data(), v.data()};

  auto work = BuildWorkList(layout, spec.block_q);
  ASSERT_TRUE(work.ok()) << work.status();
  ASSERT_EQ(HasBandMasks(*work), c.band);

  // Forward.
  std::vector<float> out(qn), lse(dims.heads_q * tokens);
  InitPartial(out.data(), lse.data(), tokens, dims.heads_q, dims.head_dim);
  ForwardArgs fa;
  fa.dims = dims;
  fa.dtype = c.dtype;
  fa.q = q.data();
  fa.q_rows = tokens;
  fa.k = k.data();
  fa.v = v.data();
  fa.k_rows = tokens;
  fa.out = out.data();
  fa.lse = lse.data();
  ASSERT_TRUE(kernels.Forward(fa, *work, 2).ok());
  const ReferenceForwardResult ref = ReferenceForward(layout, in);
  const ReferenceForwardResult naive = NaiveForward(layout, in);
  ExpectWithinRule("out", ref.out, naive.out, out);
  ExpectLseWithinRule(ref.lse, naive.lse, lse);

  // Backward from the exact lse and delta (the kernel's own error is what is measured).
  std::vector<float> ref_lse(ref.lse.begin(), ref.lse.end());
  std::vector<float> delta(dims.heads_q * tokens);
  for (int h = 0; h < dims.heads_q; ++h) {
    for (int64_t i = 0; i < tokens; ++i) {
      double s = 0;
      for (int d = 0; d < dims.head_dim; ++d) {
        const size_t idx = (i * dims.heads_q + h) * dims.head_dim + d;
        s += LoadAsFloat(c.dtype, dout.data(), idx) * ref.out[idx];
      }
      delta[h * tokens + i] = static_cast<float>(s);
    }
  }
  std::vector<float> dq(qn, 0.0f), dk(kn, 0.0f), dv(kn, 0.0f);
  BackwardArgs ba;
  ba.dims = dims;
  ba.dtype = c.dtype;
  ba.q = q.data();
  ba.dout = dout.data();
  ba.lse = ref_lse.data();
  ba.delta = delta.data();
  ba.q_rows = tokens;
  ba.k = k.data();
  ba.v = v.data();
  ba.k_rows = tokens;
  ba.dq = dq.data();
  ba.dk = dk.data();
  ba.dv = dv.data();
  ASSERT_TRUE(kernels.Backward(ba, *work, 2).ok());
  const ReferenceGradients gref = ReferenceBackward(layout, in, dout.data());
  const ReferenceGradients gnaive = NaiveBackward(layout, in, dout.data());
  ExpectWithinRule("dq", gref.dq, gnaive.dq, dq);
  ExpectWithinRule("dk", gref.dk, gnaive.dk, dk);
  ExpectWithinRule("dv", gref.dv, gnaive.dv, dv);
}

// The grid: GridCases() above.
INSTANTIATE_TEST_SUITE_P(Grid, HostJitCaseTest, ::testing::ValuesIn(GridCases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return CaseName(info.param);
                         });

// A rank's view: queries and keys are shards held in shuffled buffer order, and the keys
// arrive in two buffers; two forward calls merge into one result (the merge-into contract),
// and the backward over both buffers adds up. Also: the result does not depend on threads.
TEST(HostJitKernelsTest, ShardedBuffersComposeAndAreDeterministic) {
  HostKernelSpec spec;  // the bf16/128/GQA-4 case of the grid (compiled once)
  spec.dtype = DType::kBF16;
  spec.head_dim = 128;
  spec.gqa_ratio = 4;
  const HostJitKernelSet& kernels = Kernels(spec);
  std::mt19937_64 rng(7);
  const int64_t tokens = 400;
  const Layout layout = testing::RandomDocumentLayout(rng, tokens, 180);
  const AttentionDims dims = Dims(4, 1, 128);
  const DType dt = spec.dtype;
  const int64_t row_q = dims.heads_q * dims.head_dim, row_k = dims.heads_kv * dims.head_dim;
  const auto q = RandomTensor(rng, tokens * row_q, dt);
  const auto k = RandomTensor(rng, tokens * row_k, dt);
  const auto v = RandomTensor(rng, tokens * row_k, dt);
  const ReferenceForwardResult ref =
      ReferenceForward(layout, {dims, dt, q.data(), k.data(), v.data()});
  const ReferenceForwardResult naive =
      NaiveForward(layout, {dims, dt, q.data(), k.data(), v.data()});

  // Query shard: random runs; key buffers: alternate runs of a random split.
  const std::vector<TokenRun> q_runs = testing::RandomRuns(rng, tokens, 6, 0.7);
  std::vector<TokenRun> all_k = testing::RandomRuns(rng, tokens, 7, 1.0);
  std::vector<TokenRun> k_runs[2];
  for (size_t i = 0; i < all_k.size(); ++i) k_runs[i % 2].push_back(all_k[i]);
  for (auto& runs : k_runs) {  // each buffer packs its own runs from row 0
    int64_t local = 0;
    for (TokenRun& r : runs) {
      r.local_begin = local;
      local += r.length;
    }
  }
  auto gather = [&](const std::vector<uint8_t>& src, const std::vector<TokenRun>& runs,
                    int64_t row) {
    const std::vector<int64_t> global = testing::GlobalOfLocal(runs);
    const size_t es = DTypeSize(dt);
    std::vector<uint8_t> out(global.size() * row * es);
    for (size_t r = 0; r < global.size(); ++r) {
      std::copy_n(src.data() + global[r] * row * es, row * es, out.data() + r * row * es);
    }
    return out;
  };
  const int64_t q_rows = testing::RunRows(q_runs);
  const auto q_local = gather(q, q_runs, row_q);
  std::vector<float> results[2];
  std::vector<float> lses[2];
  for (int threads : {1, 3}) {
    std::vector<float> out(q_rows * row_q), lse(dims.heads_q * q_rows);
    InitPartial(out.data(), lse.data(), q_rows, dims.heads_q, dims.head_dim);
    for (int b = 0; b < 2; ++b) {
      const auto k_local = gather(k, k_runs[b], row_k);
      const auto v_local = gather(v, k_runs[b], row_k);
      auto work = BuildWorkList(layout.slices(), q_runs, k_runs[b], spec.block_q);
      ASSERT_TRUE(work.ok()) << work.status();
      ForwardArgs fa;
      fa.dims = dims;
      fa.dtype = dt;
      fa.q = q_local.data();
      fa.q_rows = q_rows;
      fa.k = k_local.data();
      fa.v = v_local.data();
      fa.k_rows = testing::RunRows(k_runs[b]);
      fa.out = out.data();
      fa.lse = lse.data();
      ASSERT_TRUE(kernels.Forward(fa, *work, threads).ok());
    }
    results[threads == 1 ? 0 : 1] = out;
    lses[threads == 1 ? 0 : 1] = lse;
  }
  EXPECT_EQ(results[0], results[1]);  // bitwise, whatever the thread count
  EXPECT_EQ(lses[0], lses[1]);
  // Compare the rows of the shard with the reference rows of their global positions.
  const std::vector<int64_t> global = testing::GlobalOfLocal(q_runs);
  std::vector<double> ref_rows, naive_rows;
  std::vector<float> got_rows;
  for (size_t r = 0; r < global.size(); ++r) {
    if (global[r] < 0) continue;
    for (int64_t e = 0; e < row_q; ++e) {
      ref_rows.push_back(ref.out[global[r] * row_q + e]);
      naive_rows.push_back(naive.out[global[r] * row_q + e]);
      got_rows.push_back(results[0][r * row_q + e]);
    }
  }
  ExpectWithinRule("sharded out", ref_rows, naive_rows, got_rows);
}

// The fused backward adds every key tile's share of a query block's dq in tile order (tasks
// wait their turn); each dq, dk and dv element must sum its contributions in the same order
// whatever the number of threads, also with several segments per block (documents of every
// mask kind) and grouped query heads.
TEST(HostJitKernelsTest, BackwardIsBitwiseTheSameOnAnyThreadCount) {
  HostKernelSpec spec;  // the bf16/128/GQA-4 case of the grid (compiled once)
  spec.dtype = DType::kBF16;
  spec.head_dim = 128;
  spec.gqa_ratio = 4;
  const HostJitKernelSet& kernels = Kernels(spec);
  std::mt19937_64 rng(11);
  const int64_t tokens = 500;
  const Layout layout = CaseLayout(rng, Case{spec.dtype, 128, 4, true}, tokens);
  const AttentionDims dims = Dims(8, 2, 128);
  const int64_t qn = tokens * dims.heads_q * dims.head_dim;
  const int64_t kn = tokens * dims.heads_kv * dims.head_dim;
  const auto q = RandomTensor(rng, qn, spec.dtype);
  const auto k = RandomTensor(rng, kn, spec.dtype);
  const auto v = RandomTensor(rng, kn, spec.dtype);
  const auto dout = RandomTensor(rng, qn, spec.dtype);
  std::normal_distribution<float> normal;
  std::vector<float> lse(dims.heads_q * tokens), delta(lse.size());
  for (size_t i = 0; i < lse.size(); ++i) {
    lse[i] = 3.0f + normal(rng);
    delta[i] = normal(rng);
  }
  auto work = BuildWorkList(layout, spec.block_q);
  ASSERT_TRUE(work.ok()) << work.status();
  std::vector<float> grads[2][3];
  for (int run = 0; run < 2; ++run) {
    std::vector<float> dq(qn, 0.5f), dk(kn, -0.25f), dv(kn, 1.0f);  // added into
    BackwardArgs ba;
    ba.dims = dims;
    ba.dtype = spec.dtype;
    ba.q = q.data();
    ba.dout = dout.data();
    ba.lse = lse.data();
    ba.delta = delta.data();
    ba.q_rows = ba.k_rows = tokens;
    ba.k = k.data();
    ba.v = v.data();
    ba.dq = dq.data();
    ba.dk = dk.data();
    ba.dv = dv.data();
    ASSERT_TRUE(kernels.Backward(ba, *work, run == 0 ? 1 : 3).ok());
    grads[run][0] = dq;
    grads[run][1] = dk;
    grads[run][2] = dv;
  }
  for (int g = 0; g < 3; ++g) {
    ASSERT_EQ(grads[0][g].size(), grads[1][g].size());
    EXPECT_EQ(
        0, std::memcmp(grads[0][g].data(), grads[1][g].data(), grads[0][g].size() * sizeof(float)))
        << "gradient "
        << "qkv"[g] << " differs between 1 and 3 threads";
  }
}

TEST(HostJitKernelsTest, MergeKernelMatchesMergePartial) {
  HostKernelSpec spec;
  spec.dtype = DType::kF32;
  spec.head_dim = 64;
  const HostJitKernelSet& kernels = Kernels(spec);
  std::mt19937_64 rng(3);
  std::normal_distribution<float> normal;
  const int64_t rows = 150;
  const int heads = 3, dim = 64;
  std::vector<float> o1(rows * heads * dim), o2(o1.size()), lse1(heads * rows), lse2(heads * rows);
  for (float& x : o1) x = normal(rng);
  for (float& x : o2) x = normal(rng);
  for (size_t i = 0; i < lse1.size(); ++i) {
    lse1[i] = i % 7 == 0 ? -INFINITY : 3 * normal(rng);
    lse2[i] = i % 5 == 0 ? -INFINITY : 3 * normal(rng);
  }
  for (int h = 0; h < heads; ++h) {
    for (int64_t r = 0; r < rows; ++r) {
      if (std::isinf(lse1[h * rows + r])) {
        std::fill_n(o1.begin() + (r * heads + h) * dim, dim, 0.0f);  // contract: o = 0
      }
    }
  }
  std::vector<float> want_o = o1, want_lse = lse1, got_o = o1, got_lse = lse1;
  MergePartial(want_o.data(), want_lse.data(), o2.data(), lse2.data(), rows, heads, dim, rows,
               rows);
  ASSERT_TRUE(kernels
                  .Merge(got_o.data(), got_lse.data(), o2.data(), lse2.data(), rows, heads, dim,
                         rows, rows, 2)
                  .ok());
  for (size_t i = 0; i < want_o.size(); ++i) ASSERT_NEAR(got_o[i], want_o[i], 2e-6) << i;
  for (size_t i = 0; i < want_lse.size(); ++i) {
    if (std::isinf(want_lse[i])) {
      EXPECT_EQ(got_lse[i], want_lse[i]);
    } else {
      EXPECT_NEAR(got_lse[i], want_lse[i], 2e-6) << i;
    }
  }
  EXPECT_FALSE(kernels
                   .Merge(got_o.data(), got_lse.data(), o2.data(), lse2.data(), rows, heads, 128,
                          rows, rows, 1)
                   .ok());
}

TEST(HostJitKernelsTest, ArgumentsThatDoNotMatchTheSpecAreRejected) {
  HostKernelSpec spec;
  spec.dtype = DType::kBF16;
  spec.head_dim = 64;
  spec.gqa_ratio = 8;
  spec.band_masks = false;
  const HostJitKernelSet& kernels = Kernels(spec);
  std::vector<float> buf(64 * 8 * 64 * 2, 0.0f), out(64 * 8 * 64), lse(8 * 64);
  const Layout causal = *Layout::FromDocuments(std::vector<int64_t>{0, 64});
  const Layout full =
      *Layout::FromDocuments(std::vector<int64_t>{0, 64}, std::vector<MaskKind>{MaskKind::kFull});
  const WorkList causal_work = *BuildWorkList(causal, 64);
  const WorkList full_work = *BuildWorkList(full, 64);
  ForwardArgs fa;
  fa.dims = Dims(8, 1, 64);
  fa.dtype = DType::kBF16;
  fa.q = fa.k = fa.v = buf.data();
  fa.q_rows = fa.k_rows = 64;
  fa.out = out.data();
  fa.lse = lse.data();
  InitPartial(out.data(), lse.data(), 64, 8, 64);
  EXPECT_TRUE(kernels.Forward(fa, full_work, 1).ok());
  auto expect_invalid = [&](ForwardArgs a, const WorkList& w, const char* needle) {
    const absl::Status s = kernels.Forward(a, w, 1);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << needle << ": " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(needle));
  };
  expect_invalid(fa, causal_work, "band");
  ForwardArgs a = fa;
  a.dtype = DType::kF16;
  expect_invalid(a, full_work, "dtype");
  a = fa;
  a.dims = Dims(8, 2, 64);
  expect_invalid(a, full_work, "GQA");
  a = fa;
  a.dims = Dims(8, 1, 128);
  expect_invalid(a, full_work, "head_dim");
  a = fa;
  a.q_rows = 32;
  expect_invalid(a, full_work, "outside");
  a = fa;
  a.lse = nullptr;
  expect_invalid(a, full_work, "non-null");
}

TEST(HostJitKernelsTest, InvalidSpecIsInvalidArgument) {
  HostKernelSpec spec;
  spec.head_dim = 100;
  auto k = GetHostJitKernels(spec, &TestCache());
  EXPECT_EQ(k.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(k.status().message()), HasSubstr("head_dim 100"));
  spec.head_dim = 64;
  spec.block_k = 24;
  EXPECT_EQ(GetHostJitKernels(spec, &TestCache()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// A head dim the generator does not support, forced past validation: the generated
// static_assert fails, and the failure comes back as CompileError (hsapCompileError) with
// the compiler's log and the path of the kept source.
TEST(HostJitKernelsTest, UnsupportedHeadDimForcedThroughIsACompileError) {
  HostKernelSpec spec;
  spec.dtype = DType::kF32;
  spec.head_dim = 100;
  auto k = CompileHostJitKernelsUnchecked(spec, TestCache());
  ASSERT_FALSE(k.ok());
  EXPECT_TRUE(IsCompileError(k.status())) << k.status();
  EXPECT_EQ(ResultFromStatus(k.status()), hsapCompileError);
  const std::string msg(k.status().message());
  EXPECT_THAT(msg, HasSubstr("unsupported head dim"));
  const std::string marker = "source kept at ";
  const size_t at = msg.find(marker);
  ASSERT_NE(at, std::string::npos) << msg;
  const std::string path = msg.substr(at + marker.size(), msg.find('\n', at) - at - marker.size());
  std::ifstream kept(path);
  std::stringstream ss;
  ss << kept.rdbuf();
  EXPECT_THAT(ss.str(), HasSubstr("constexpr int kD = 100;")) << path;
}

// Concurrent requests for one spec compile once and share one kernel set.
TEST(HostJitKernelsTest, ConcurrentRequestsShareOneCompile) {
  CompileCache::Options options;
  options.dir = MakeTempDir() + "/cache";
  CompileCache cache(options);
  HostKernelSpec spec;
  spec.dtype = DType::kF32;
  spec.head_dim = 32;
  spec.band_masks = false;
  std::vector<std::shared_ptr<const HostJitKernelSet>> got(4);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      auto k = GetHostJitKernels(spec, &cache);
      if (k.ok()) got[t] = *k;
    });
  }
  for (auto& th : threads) th.join();
  for (const auto& k : got) {
    ASSERT_NE(k, nullptr);
    EXPECT_EQ(k, got[0]);
  }
  EXPECT_EQ(cache.stats().compiles, 1);
}

TEST(HostJitKernelsTest, HostKernelsForBatchPicksTheJitSet) {
  // The process-wide cache is built from the environment on first use: keep it in a
  // private directory (no other test of this binary uses it).
  testing::ScopedEnv cache_dir("HSAP_CACHE_DIR", (MakeTempDir() + "/global-cache").c_str());
  const Layout causal = *Layout::FromDocuments(std::vector<int64_t>{0, 10, 30});
  auto k = HostKernelsForBatch(Dims(4, 1, 64), DType::kBF16, causal);
  ASSERT_TRUE(k.ok()) << k.status();
  EXPECT_THAT(std::string((*k)->name()), HasSubstr("host-jit/"));
  EXPECT_THAT(std::string((*k)->name()), HasSubstr("/band"));
  const Layout full = *Layout::FromDocuments(
      std::vector<int64_t>{0, 10, 30}, std::vector<MaskKind>{MaskKind::kFull, MaskKind::kFull});
  k = HostKernelsForBatch(Dims(4, 1, 64), DType::kBF16, full);
  ASSERT_TRUE(k.ok()) << k.status();
  EXPECT_THAT(std::string((*k)->name()), HasSubstr("/full"));
  AttentionDims bad = Dims(4, 1, 64);
  bad.scale = 0.0f;
  EXPECT_EQ(HostKernelsForBatch(bad, DType::kBF16, full).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// A compiler that hangs: the compile is killed at HSAP_JIT_COMPILE_TIMEOUT_MS and the batch
// runs the hand-written kernels, saying why on stderr; a second batch does not wait again.
// Runs in a fresh process (threadsafe death test) since the compiler is found once per process.
TEST(HostJitKernelsTest, HangingCompilerTimesOutAndFallsBackToHandWritten) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const std::string dir = MakeTempDir();
  const std::string fake = dir + "/hanging-cxx";
  {
    std::ofstream script(fake);
    script << "#!/bin/sh\n"
              "if [ \"$1\" = --version ]; then echo 'hanging-cxx 1.0'; exit 0; fi\n"
              "exec sleep 600\n";
  }
  ASSERT_EQ(chmod(fake.c_str(), 0700), 0);
  EXPECT_EXIT(
      {
        testing::ScopedEnv cxx("HSAP_HOST_CXX", fake.c_str());
        testing::ScopedEnv timeout("HSAP_JIT_COMPILE_TIMEOUT_MS", "300");
        testing::ScopedEnv cache_dir("HSAP_CACHE_DIR", (dir + "/cache").c_str());
        const Layout causal = *Layout::FromDocuments(std::vector<int64_t>{0, 10, 30});
        const auto start = std::chrono::steady_clock::now();
        for (int batch = 0; batch < 2; ++batch) {
          auto k = HostKernelsForBatch(Dims(4, 1, 64), DType::kBF16, causal);
          if (!k.ok() || k->get() != &HandWrittenKernels()) std::_Exit(1);
        }
        const double seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        std::_Exit(seconds < 5 ? 0 : 2);
      },
      ::testing::ExitedWithCode(0), "timed out after 300ms");
}

// A second process (a fresh cache object on the same directory) compiles nothing.
TEST(HostJitKernelsTest, SecondRunCompilesNothing) {
  CompileCache::Options options;
  options.dir = MakeTempDir() + "/cache";
  options.dump_dir = MakeTempDir();
  HostKernelSpec spec;
  spec.dtype = DType::kF16;
  spec.head_dim = 64;
  spec.band_masks = false;
  {
    CompileCache first(options);
    auto k = CompileHostJitKernelsUnchecked(spec, first);
    ASSERT_TRUE(k.ok()) << k.status();
    EXPECT_EQ(first.stats().compiles, 1);
  }
  CompileCache second(options);
  auto k = CompileHostJitKernelsUnchecked(spec, second);
  ASSERT_TRUE(k.ok()) << k.status();
  EXPECT_EQ(second.stats().compiles, 0);
  EXPECT_EQ(second.stats().disk_hits, 1);
  // The dump directory (HSAP_JIT_DUMP) holds the generated source.
  const std::string source = GenerateHostKernelSource(ResolveHostKernelSpec(spec));
  int dumped = 0;
  for (const auto& e : std::filesystem::directory_iterator(options.dump_dir)) {
    std::ifstream in(e.path());
    std::stringstream ss;
    ss << in.rdbuf();
    if (ss.str() == source) ++dumped;
  }
  EXPECT_EQ(dumped, 1);
}

// NaN and infinity as a naive softmax has them (hsap.h): each ISA, band masks on and off.
TEST(HostJitKernelsTest, NaNAndInfinityPropagateLikeANaiveSoftmax) {
  for (HostIsa isa : {HostIsa::kAvx2, HostIsa::kAvx512}) {
    if (isa == HostIsa::kAvx512 && !HostHasAvx512()) continue;
    for (bool band : {true, false}) {
      HostKernelSpec spec;
      spec.dtype = DType::kF32;
      spec.head_dim = 64;
      spec.gqa_ratio = 2;
      spec.band_masks = band;
      spec.isa = isa;
      SCOPED_TRACE(std::string(HostIsaName(isa)) + (band ? " band" : " full"));
      testing::ExpectKernelSetPropagatesNaN(Kernels(spec), Dims(4, 2, 64), spec.block_q,
                                            testing::NonFiniteLayout(band));
    }
  }
}

}  // namespace
}  // namespace hsap::jit
