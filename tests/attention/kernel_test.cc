// The hand-written kernels against the fp64 reference.
//
// Tolerance: the rule of attention/tolerance.h with the kernels' floor (kKernelFloor), the
// same for out, lse, dq, dk and dv.
#include "attention/kernel.h"

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attention/reference.h"
#include "attention/tolerance.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/attention_test_util.h"
#include "tests/support/nonfinite.h"

namespace hsap {
namespace {

using ::testing::HasSubstr;

// A tensor in a storage type.
struct Tensor {
  DType dtype = DType::kF32;
  std::vector<unsigned char> bytes;
  Tensor() = default;
  Tensor(DType t, size_t n) : dtype(t), bytes(n * DTypeSize(t)) {}
  size_t size() const { return bytes.size() / DTypeSize(dtype); }
  const void* data() const { return bytes.data(); }
  void* data() { return bytes.data(); }
  float Get(size_t i) const { return LoadAsFloat(dtype, bytes.data(), i); }
  void Set(size_t i, float f) { StoreFromFloat(dtype, bytes.data(), i, f); }
};

Tensor RandomTensor(std::mt19937_64& rng, DType dtype, size_t n) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Tensor t(dtype, n);
  for (size_t i = 0; i < n; ++i) t.Set(i, normal(rng));
  return t;
}

AttentionDims Dims(int hq, int hkv, int dim) {
  AttentionDims d;
  d.heads_q = hq;
  d.heads_kv = hkv;
  d.head_dim = dim;
  d.scale = 1.0f / std::sqrt(static_cast<float>(dim));
  return d;
}

struct Problem {
  Layout layout;
  AttentionDims dims;
  DType dtype;
  Tensor q, k, v, dout;
  int64_t T() const { return layout.num_tokens(); }
};

Problem MakeProblem(Layout layout, AttentionDims dims, DType dtype, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Problem p{std::move(layout), std::move(dims), dtype, {}, {}, {}, {}};
  const size_t nq = p.T() * p.dims.heads_q * p.dims.head_dim;
  const size_t nk = p.T() * p.dims.heads_kv * p.dims.head_dim;
  p.q = RandomTensor(rng, dtype, nq);
  p.k = RandomTensor(rng, dtype, nk);
  p.v = RandomTensor(rng, dtype, nk);
  p.dout = RandomTensor(rng, dtype, nq);
  return p;
}

struct KernelResult {
  std::vector<float> out, lse, dq, dk, dv;
};

// Forward, then backward from the kernel's own (out, lse) with out stored in the storage
// type (as a trainer receives it), single device, whole-row work list.
KernelResult RunKernels(const Problem& p, int threads,
                        const KernelSet& kernels = HandWrittenKernels()) {
  const int64_t T = p.T();
  const AttentionDims& d = p.dims;
  absl::StatusOr<WorkList> work = BuildWorkList(p.layout, kKernelBlockQ);
  EXPECT_TRUE(work.ok()) << work.status();
  KernelResult r;
  r.out.resize(T * d.heads_q * d.head_dim);
  r.lse.resize(T * d.heads_q);
  InitPartial(r.out.data(), r.lse.data(), T, d.heads_q, d.head_dim);
  ForwardArgs fa;
  fa.dims = d;
  fa.dtype = p.dtype;
  fa.q = p.q.data();
  fa.k = p.k.data();
  fa.v = p.v.data();
  fa.q_rows = fa.k_rows = T;
  fa.out = r.out.data();
  fa.lse = r.lse.data();
  absl::Status st = kernels.Forward(fa, *work, threads);
  EXPECT_TRUE(st.ok()) << st;
  Tensor out_stored(p.dtype, r.out.size());
  for (size_t i = 0; i < r.out.size(); ++i) out_stored.Set(i, r.out[i]);
  std::vector<float> delta(T * d.heads_q);
  ComputeDelta(p.dtype, p.dout.data(), out_stored.data(), T, d.heads_q, d.head_dim, delta.data());
  r.dq.assign(r.out.size(), 0.0f);
  r.dk.assign(T * d.heads_kv * d.head_dim, 0.0f);
  r.dv.assign(r.dk.size(), 0.0f);
  BackwardArgs ba;
  ba.dims = d;
  ba.dtype = p.dtype;
  ba.q = p.q.data();
  ba.dout = p.dout.data();
  ba.lse = r.lse.data();
  ba.delta = delta.data();
  ba.q_rows = ba.k_rows = T;
  ba.k = p.k.data();
  ba.v = p.v.data();
  ba.dq = r.dq.data();
  ba.dk = r.dk.data();
  ba.dv = r.dv.data();
  st = kernels.Backward(ba, *work, threads);
  EXPECT_TRUE(st.ok()) << st;
  return r;
}

double MaxAbs(const std::vector<double>& x) {
  double m = 0;
  for (double v : x)
    if (std::isfinite(v)) m = std::max(m, std::abs(v));
  return m;
}

// max |a - ref| over entries where ref is finite; entries where ref is -inf (rows that see
// nothing) must be exactly -inf in a.
template <typename A>
double MaxError(const std::vector<A>& a, const std::vector<double>& ref, const char* name) {
  EXPECT_EQ(a.size(), ref.size()) << name;
  double e = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isinf(ref[i])) {
      EXPECT_EQ(static_cast<double>(a[i]), ref[i]) << name << "[" << i << "]";
      continue;
    }
    const double diff = std::abs(static_cast<double>(a[i]) - ref[i]);
    if (!(diff <= e)) e = diff;  // NaN propagates as the error
  }
  return e;
}

void ExpectWithinRule(const char* name, double kernel_err, double naive_err,
                      const std::vector<double>& ref) {
  const double bound = ToleranceBound(naive_err, MaxAbs(ref), kKernelFloor);
  EXPECT_LE(kernel_err, bound) << name << ": kernel error " << kernel_err << ", naive error "
                               << naive_err;
}

void CheckAgainstReference(const Problem& p, int threads,
                           const KernelSet& kernels = HandWrittenKernels()) {
  const ReferenceInputs in{p.dims, p.dtype, p.q.data(), p.k.data(), p.v.data()};
  const ReferenceForwardResult ref = ReferenceForward(p.layout, in);
  const ReferenceForwardResult naive = NaiveForward(p.layout, in);
  const ReferenceGradients gref = ReferenceBackward(p.layout, in, p.dout.data());
  const ReferenceGradients gnaive = NaiveBackward(p.layout, in, p.dout.data());
  const KernelResult r = RunKernels(p, threads, kernels);
  // Rows without keys: out exactly 0 (the reference has 0 there too, checked as finite).
  ExpectWithinRule("out", MaxError(r.out, ref.out, "out"), MaxError(naive.out, ref.out, "n"),
                   ref.out);
  ExpectWithinRule("lse", MaxError(r.lse, ref.lse, "lse"), MaxError(naive.lse, ref.lse, "n"),
                   ref.lse);
  ExpectWithinRule("dq", MaxError(r.dq, gref.dq, "dq"), MaxError(gnaive.dq, gref.dq, "n"), gref.dq);
  ExpectWithinRule("dk", MaxError(r.dk, gref.dk, "dk"), MaxError(gnaive.dk, gref.dk, "n"), gref.dk);
  ExpectWithinRule("dv", MaxError(r.dv, gref.dv, "dv"), MaxError(gnaive.dv, gref.dv, "n"), gref.dv);
}

// ---------------------------------------------------------------------------------------
// Layout families.
enum class Family {
  kRandomMix,     // random kinds and lengths
  kEmptyAndTiny,  // many empty and 1-token documents
  kTileEdges,     // documents of 63, 64, 65, 129 ... tokens
  kOneDocument,   // one document covering the row (kind varies with the seed)
  kHundredsTiny,  // hundreds of 1..3-token documents
  kSharedPrompt,  // user slices: documents sharing a prompt
};

Layout MakeLayout(Family f, uint64_t seed) {
  std::mt19937_64 rng(seed);
  switch (f) {
    case Family::kRandomMix:
      return testing::RandomDocumentLayout(rng, 320, 200);
    case Family::kEmptyAndTiny: {
      std::vector<int64_t> cu{0};
      std::vector<MaskKind> kinds;
      std::vector<int64_t> params;
      for (int i = 0; i < 60; ++i) {
        const int64_t len = i % 3 == 0 ? 0 : i % 3 == 1 ? 1 : 1 + rng() % 30;
        cu.push_back(cu.back() + len);
        kinds.push_back(static_cast<MaskKind>(rng() % 4));
        params.push_back(len == 0 ? 0 : 1 + static_cast<int64_t>(rng() % len));
      }
      return *Layout::FromDocuments(cu, kinds, params);
    }
    case Family::kTileEdges: {
      const std::vector<int64_t> cu = {0, 63, 127, 192, 321, 322, 386};
      std::vector<MaskKind> kinds;
      std::vector<int64_t> params;
      for (size_t i = 0; i + 1 < cu.size(); ++i) {
        kinds.push_back(static_cast<MaskKind>((i + seed) % 4));
        params.push_back(std::max<int64_t>(1, (cu[i + 1] - cu[i]) / 3));
      }
      return *Layout::FromDocuments(cu, kinds, params);
    }
    case Family::kOneDocument: {
      const auto kind = static_cast<MaskKind>(seed % 4);
      return *Layout::FromDocuments(std::vector<int64_t>{0, 300}, std::vector<MaskKind>{kind},
                                    std::vector<int64_t>{70});
    }
    case Family::kHundredsTiny: {
      std::vector<int64_t> cu{0};
      while (cu.back() < 400) cu.push_back(cu.back() + 1 + static_cast<int64_t>(rng() % 3));
      return *Layout::FromDocuments(cu);
    }
    case Family::kSharedPrompt:
      return testing::SharedPromptLayout(70, {40, 1, 90}, 30);
  }
  return Layout();
}

struct Case {
  Family family;
  int hq, hkv, dim;
  DType dtype;
};

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  static const char* kFamilies[] = {"RandomMix",   "EmptyAndTiny", "TileEdges",
                                    "OneDocument", "HundredsTiny", "SharedPrompt"};
  const Case& c = info.param;
  return absl::StrCat(kFamilies[static_cast<int>(c.family)], "_h", c.hq, "x", c.hkv, "_d", c.dim,
                      "_", std::string(DTypeName(c.dtype)), "_", info.index);
}

class KernelVsReferenceTest : public ::testing::TestWithParam<Case> {};

TEST_P(KernelVsReferenceTest, WithinTolerance) {
  const Case& c = GetParam();
  // Two seeds in fp32; one in bf16/fp16, whose naive yardstick (every operation rounded
  // in software) is the slow part of this test.
  const int seeds = c.dtype == DType::kF32 ? 2 : 1;
  for (int seed = 1; seed <= seeds; ++seed) {
    SCOPED_TRACE(seed);
    CheckAgainstReference(
        MakeProblem(MakeLayout(c.family, seed), Dims(c.hq, c.hkv, c.dim), c.dtype, seed * 31), 2);
  }
}

// A sampled grid: every family, GQA ratio 1/4/8, head dim 64/128/256 and storage type
// appears several times, without the full cartesian product.
INSTANTIATE_TEST_SUITE_P(Grid, KernelVsReferenceTest,
                         ::testing::Values(Case{Family::kRandomMix, 2, 2, 64, DType::kF32},
                                           Case{Family::kRandomMix, 4, 1, 128, DType::kBF16},
                                           Case{Family::kRandomMix, 8, 1, 64, DType::kF16},
                                           Case{Family::kEmptyAndTiny, 4, 1, 64, DType::kF32},
                                           Case{Family::kEmptyAndTiny, 2, 2, 256, DType::kBF16},
                                           Case{Family::kTileEdges, 2, 2, 128, DType::kF32},
                                           Case{Family::kTileEdges, 8, 1, 64, DType::kBF16},
                                           Case{Family::kTileEdges, 1, 1, 256, DType::kF16},
                                           Case{Family::kOneDocument, 4, 1, 64, DType::kF32},
                                           Case{Family::kOneDocument, 1, 1, 128, DType::kF16},
                                           Case{Family::kHundredsTiny, 8, 1, 128, DType::kF32},
                                           Case{Family::kHundredsTiny, 2, 2, 64, DType::kBF16},
                                           Case{Family::kSharedPrompt, 4, 1, 64, DType::kF32},
                                           Case{Family::kSharedPrompt, 8, 1, 64, DType::kF16},
                                           Case{Family::kSharedPrompt, 1, 1, 256, DType::kF32}),
                         CaseName);

TEST(KernelTest, IndependentOfThreadCount) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    const Problem p = MakeProblem(MakeLayout(Family::kRandomMix, 5), Dims(4, 2, 64), dtype, 9);
    const KernelResult one = RunKernels(p, 1);
    const KernelResult three = RunKernels(p, 3);
    for (auto member : {&KernelResult::out, &KernelResult::lse, &KernelResult::dq,
                        &KernelResult::dk, &KernelResult::dv}) {
      ASSERT_EQ((one.*member).size(), (three.*member).size());
      EXPECT_EQ(0, std::memcmp((one.*member).data(), (three.*member).data(),
                               (one.*member).size() * sizeof(float)));
    }
  }
}

// ---------------------------------------------------------------------------------------
// The copies for each instruction set (the library is built for the baseline ISA and picks
// the best copy the CPU supports at run time).

constexpr KernelIsa kAllIsas[] = {KernelIsa::kBaseline, KernelIsa::kAvx2, KernelIsa::kAvx512};

bool BitwiseEqual(const KernelResult& a, const KernelResult& b) {
  for (auto member : {&KernelResult::out, &KernelResult::lse, &KernelResult::dq, &KernelResult::dk,
                      &KernelResult::dv}) {
    if ((a.*member).size() != (b.*member).size() ||
        std::memcmp((a.*member).data(), (b.*member).data(), (a.*member).size() * sizeof(float)) !=
            0) {
      return false;
    }
  }
  return true;
}

TEST(KernelIsaTest, EveryCopyWithinTolerance) {
  for (KernelIsa isa : kAllIsas) {
    if (!CpuSupportsKernelIsa(isa)) continue;  // KernelIsaTest.UnsupportedCopyRefuses
    SCOPED_TRACE(std::string(KernelIsaName(isa)));
    const KernelSet& kernels = HandWrittenKernels(isa);
    CheckAgainstReference(
        MakeProblem(MakeLayout(Family::kTileEdges, 1), Dims(2, 2, 128), DType::kF32, 31), 2,
        kernels);
    CheckAgainstReference(
        MakeProblem(MakeLayout(Family::kRandomMix, 2), Dims(4, 1, 64), DType::kBF16, 62), 2,
        kernels);
    CheckAgainstReference(
        MakeProblem(MakeLayout(Family::kSharedPrompt, 1), Dims(1, 1, 256), DType::kF16, 31), 2,
        kernels);
  }
}

TEST(KernelIsaTest, EveryCopyIsDeterministic) {
  const Problem p = MakeProblem(MakeLayout(Family::kRandomMix, 5), Dims(4, 2, 64), DType::kBF16, 9);
  for (KernelIsa isa : kAllIsas) {
    if (!CpuSupportsKernelIsa(isa)) continue;
    SCOPED_TRACE(std::string(KernelIsaName(isa)));
    const KernelResult one = RunKernels(p, 1, HandWrittenKernels(isa));
    EXPECT_TRUE(BitwiseEqual(one, RunKernels(p, 3, HandWrittenKernels(isa))));
    EXPECT_TRUE(BitwiseEqual(one, RunKernels(p, 1, HandWrittenKernels(isa))));
  }
}

TEST(KernelIsaTest, DefaultRunsTheBestCopy) {
  const KernelIsa best = BestKernelIsa();
  EXPECT_TRUE(CpuSupportsKernelIsa(best));
  for (KernelIsa isa : kAllIsas) {
    if (static_cast<int>(isa) > static_cast<int>(best)) {
      EXPECT_FALSE(CpuSupportsKernelIsa(isa));
    }
  }
  EXPECT_TRUE(CpuSupportsKernelIsa(KernelIsa::kBaseline));
  EXPECT_EQ(HandWrittenKernels().name(), "host-handwritten");
  EXPECT_EQ(HandWrittenKernels(KernelIsa::kAvx2).name(), "host-handwritten/avx2");
  const Problem p = MakeProblem(MakeLayout(Family::kRandomMix, 3), Dims(2, 2, 64), DType::kF32, 5);
  const KernelResult by_default = RunKernels(p, 2);
  EXPECT_TRUE(BitwiseEqual(by_default, RunKernels(p, 2, HandWrittenKernels(best))));
#if defined(__OPTIMIZE__)
  // FMA contraction rounds differently: proof that the default is not the baseline copy.
  // (An unoptimized build contracts nothing, so there every copy rounds alike.)
  if (best != KernelIsa::kBaseline) {
    EXPECT_FALSE(
        BitwiseEqual(by_default, RunKernels(p, 2, HandWrittenKernels(KernelIsa::kBaseline))));
  }
#endif
}

TEST(KernelIsaTest, UnsupportedCopyRefuses) {
  int unsupported = 0;
  for (KernelIsa isa : kAllIsas) {
    if (CpuSupportsKernelIsa(isa)) continue;
    ++unsupported;
    const Problem p =
        MakeProblem(MakeLayout(Family::kOneDocument, 1), Dims(1, 1, 64), DType::kF32, 1);
    const WorkList work = *BuildWorkList(p.layout, kKernelBlockQ);
    std::vector<float> out(p.T() * 64), lse(p.T());
    ForwardArgs fa;
    fa.dims = p.dims;
    fa.q = p.q.data();
    fa.k = p.k.data();
    fa.v = p.v.data();
    fa.q_rows = fa.k_rows = p.T();
    fa.out = out.data();
    fa.lse = lse.data();
    const absl::Status st = HandWrittenKernels(isa).Forward(fa, work, 1);
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(st.message(), HasSubstr(std::string(KernelIsaName(isa))));
  }
  if (unsupported == 0) GTEST_SKIP() << "this CPU runs every copy";
}

// Keys split over two buffers (like two ranks' shards, in shuffled local order): forward
// calls merge into one (out, lse) and backward calls add into the gradients; the result
// equals a single call up to fp32 rounding (the merge and the order of sums differ).
TEST(KernelTest, CallsOverDisjointKeySetsCompose) {
  const Problem p = MakeProblem(MakeLayout(Family::kRandomMix, 7), Dims(4, 2, 64), DType::kF32, 3);
  const int64_t T = p.T();
  const AttentionDims& d = p.dims;
  const KernelResult whole = RunKernels(p, 2);
  std::mt19937_64 rng(4);
  const std::vector<TokenRun> runs = testing::RandomRuns(rng, T, 8, 1.0);
  std::vector<TokenRun> parts[2];
  for (size_t i = 0; i < runs.size(); ++i) parts[i % 2].push_back(runs[i]);
  const std::vector<TokenRun> all_q = {{0, 0, T}};
  std::vector<float> out(T * d.heads_q * d.head_dim), lse(T * d.heads_q);
  InitPartial(out.data(), lse.data(), T, d.heads_q, d.head_dim);
  std::vector<float> dq(out.size(), 0.0f), dk(T * d.heads_kv * d.head_dim, 0.0f),
      dv(dk.size(), 0.0f);
  std::vector<float> delta(T * d.heads_q);
  ComputeDelta(DType::kF32, p.dout.data(), whole.out.data(), T, d.heads_q, d.head_dim,
               delta.data());
  for (int pass = 0; pass < 2; ++pass) {
    for (auto& part : parts) {
      // Gather this part's keys into its own buffer, re-numbering the runs.
      std::vector<TokenRun> local = part;
      int64_t rows = 0;
      for (TokenRun& r : local) {
        r.local_begin = rows;
        rows += r.length;
      }
      const size_t row_size = d.heads_kv * d.head_dim;
      std::vector<float> k(rows * row_size), v(rows * row_size);
      for (const TokenRun& r : local) {
        for (int64_t i = 0; i < r.length; ++i) {
          for (size_t e = 0; e < row_size; ++e) {
            k[(r.local_begin + i) * row_size + e] = p.k.Get((r.global_begin + i) * row_size + e);
            v[(r.local_begin + i) * row_size + e] = p.v.Get((r.global_begin + i) * row_size + e);
          }
        }
      }
      absl::StatusOr<WorkList> work = BuildWorkList(p.layout.slices(), all_q, local, kKernelBlockQ);
      ASSERT_TRUE(work.ok());
      if (pass == 0) {
        ForwardArgs fa;
        fa.dims = d;
        fa.q = p.q.data();
        fa.q_rows = T;
        fa.k = k.data();
        fa.v = v.data();
        fa.k_rows = rows;
        fa.out = out.data();
        fa.lse = lse.data();
        ASSERT_TRUE(KernelForward(fa, *work, 2).ok());
        continue;
      }
      std::vector<float> part_dk(k.size(), 0.0f), part_dv(k.size(), 0.0f);
      BackwardArgs ba;
      ba.dims = d;
      ba.q = p.q.data();
      ba.dout = p.dout.data();
      ba.lse = whole.lse.data();
      ba.delta = delta.data();
      ba.q_rows = T;
      ba.k = k.data();
      ba.v = v.data();
      ba.k_rows = rows;
      ba.dq = dq.data();
      ba.dk = part_dk.data();
      ba.dv = part_dv.data();
      ASSERT_TRUE(KernelBackward(ba, *work, 2).ok());
      for (const TokenRun& r : local) {
        for (int64_t i = 0; i < r.length; ++i) {
          for (size_t e = 0; e < row_size; ++e) {
            dk[(r.global_begin + i) * row_size + e] += part_dk[(r.local_begin + i) * row_size + e];
            dv[(r.global_begin + i) * row_size + e] += part_dv[(r.local_begin + i) * row_size + e];
          }
        }
      }
    }
  }
  auto expect_close = [](const std::vector<float>& a, const std::vector<float>& b,
                         const char* name) {
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      if (std::isinf(b[i])) {
        EXPECT_EQ(a[i], b[i]) << name << i;
      } else {
        EXPECT_NEAR(a[i], b[i], 2e-5 * (1 + std::abs(b[i]))) << name << "[" << i << "]";
      }
    }
  };
  expect_close(out, whole.out, "out");
  expect_close(lse, whole.lse, "lse");
  expect_close(dq, whole.dq, "dq");
  expect_close(dk, whole.dk, "dk");
  expect_close(dv, whole.dv, "dv");
}

// Non-contiguous head ranges (HexiSeq): query heads map to kv heads through an explicit
// table, in no particular order, and one kv head has no query head at all.
TEST(KernelTest, ExplicitKvHeadTable) {
  AttentionDims dims = Dims(3, 3, 64);
  dims.kv_head_of_q = {2, 0, 2};
  ASSERT_TRUE(ValidateDims(dims).ok());
  CheckAgainstReference(MakeProblem(MakeLayout(Family::kRandomMix, 4), dims, DType::kF32, 6), 2);
  const KernelResult r =
      RunKernels(MakeProblem(MakeLayout(Family::kRandomMix, 4), dims, DType::kF32, 6), 2);
  for (size_t t = 0; t < r.dk.size() / (3 * 64); ++t) {
    for (int d = 0; d < 64; ++d) {
      ASSERT_EQ(r.dk[(t * 3 + 1) * 64 + d], 0.0f);  // kv head 1 is read by no query head
      ASSERT_EQ(r.dv[(t * 3 + 1) * 64 + d], 0.0f);
    }
  }
}

// Blocks of any size (smaller than, larger than, not a multiple of the kernel's tile) give
// the same attention up to fp32 rounding.
TEST(KernelTest, AnyBlockSizeWorks) {
  const Problem p = MakeProblem(MakeLayout(Family::kTileEdges, 3), Dims(2, 1, 64), DType::kF32, 8);
  const KernelResult expected = RunKernels(p, 2);
  const int64_t T = p.T();
  for (int64_t block_q : {1, 17, 100, 1000}) {
    SCOPED_TRACE(block_q);
    const WorkList work = *BuildWorkList(p.layout, block_q);
    std::vector<float> out(expected.out.size()), lse(expected.lse.size());
    InitPartial(out.data(), lse.data(), T, 2, 64);
    ForwardArgs fa;
    fa.dims = p.dims;
    fa.q = p.q.data();
    fa.k = p.k.data();
    fa.v = p.v.data();
    fa.q_rows = fa.k_rows = T;
    fa.out = out.data();
    fa.lse = lse.data();
    ASSERT_TRUE(KernelForward(fa, work, 2).ok());
    std::vector<float> delta(T * 2), dq(out.size(), 0.0f), dk(T * 64, 0.0f), dv(T * 64, 0.0f);
    ComputeDelta(DType::kF32, p.dout.data(), expected.out.data(), T, 2, 64, delta.data());
    BackwardArgs ba;
    ba.dims = p.dims;
    ba.q = p.q.data();
    ba.dout = p.dout.data();
    ba.lse = expected.lse.data();
    ba.delta = delta.data();
    ba.q_rows = ba.k_rows = T;
    ba.k = p.k.data();
    ba.v = p.v.data();
    ba.dq = dq.data();
    ba.dk = dk.data();
    ba.dv = dv.data();
    ASSERT_TRUE(KernelBackward(ba, work, 2).ok());
    for (auto [a, b] : {std::pair{&out, &expected.out}, std::pair{&lse, &expected.lse},
                        std::pair{&dq, &expected.dq}, std::pair{&dk, &expected.dk},
                        std::pair{&dv, &expected.dv}}) {
      for (size_t i = 0; i < b->size(); ++i) {
        if (std::isinf((*b)[i])) {
          ASSERT_EQ((*a)[i], (*b)[i]);
        } else {
          ASSERT_NEAR((*a)[i], (*b)[i], 2e-5 * (1 + std::abs((*b)[i]))) << i;
        }
      }
    }
  }
}

TEST(KernelTest, RejectsBadArguments) {
  AttentionDims dims = Dims(4, 3, 64);
  EXPECT_THAT(ValidateDims(dims).message(), HasSubstr("multiple of heads_kv"));
  dims = Dims(4, 2, 60);
  EXPECT_THAT(ValidateDims(dims).message(), HasSubstr("head_dim"));
  dims = Dims(4, 2, 64);
  dims.scale = 0;
  EXPECT_THAT(ValidateDims(dims).message(), HasSubstr("scale"));
  dims = Dims(3, 2, 64);
  dims.kv_head_of_q = {0, 1, 2};
  EXPECT_THAT(ValidateDims(dims).message(), HasSubstr("kv_head_of_q[2]"));
  dims.kv_head_of_q = {0, 1, 1};
  EXPECT_TRUE(ValidateDims(dims).ok());

  const Problem p =
      MakeProblem(MakeLayout(Family::kOneDocument, 0), Dims(2, 2, 64), DType::kF32, 1);
  WorkList work = *BuildWorkList(p.layout, kKernelBlockQ);
  std::vector<float> out(p.T() * 2 * 64), lse(p.T() * 2);
  ForwardArgs fa;
  fa.dims = p.dims;
  fa.q = p.q.data();
  fa.k = p.k.data();
  fa.v = p.v.data();
  fa.q_rows = fa.k_rows = p.T();
  fa.out = out.data();
  fa.lse = nullptr;
  EXPECT_THAT(KernelForward(fa, work, 1).message(), HasSubstr("lse is null"));
  fa.lse = lse.data();
  fa.k_rows = 10;  // the work list reaches further
  EXPECT_THAT(KernelForward(fa, work, 1).message(), HasSubstr("k_rows"));
  fa.k_rows = p.T();
  work.blocks[0].seg_end = 1000;
  EXPECT_THAT(KernelForward(fa, work, 1).message(), HasSubstr("work.blocks[0]"));
  BackwardArgs ba;
  ba.dims = p.dims;
  EXPECT_THAT(KernelBackward(ba, *BuildWorkList(p.layout, 64), 1).message(), HasSubstr("q_rows"));
}

// NaN and infinity as a naive softmax has them (hsap.h), in every copy the CPU runs.
TEST(KernelIsaTest, EveryCopyPropagatesNaNLikeANaiveSoftmax) {
  for (KernelIsa isa : kAllIsas) {
    if (!CpuSupportsKernelIsa(isa)) continue;
    SCOPED_TRACE(std::string(KernelIsaName(isa)));
    testing::ExpectKernelSetPropagatesNaN(HandWrittenKernels(isa), Dims(4, 2, 64), kKernelBlockQ,
                                          testing::NonFiniteLayout());
  }
}

}  // namespace
}  // namespace hsap
