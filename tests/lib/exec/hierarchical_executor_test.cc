// Hierarchical (head x context parallel) attention on host ranks against the single-device
// fp64 reference, under the foundation's rule: error <= 2 x the error of the naive
// computation in the storage precision (NaiveForward/NaiveBackward) + a small floor. Also:
// the bytes each rank moved equal the hierarchy's prediction (itself equal to the lower
// bound, see hierarchy_test), the degenerate plans equal the familiar schemes bitwise, and
// the result is reproducible bit for bit.
#include "lib/exec/hierarchical_executor.h"

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "attention/kernel.h"
#include "attention/reference.h"
#include "gtest/gtest.h"
#include "hsap/hsap.h"
#include "lib/api/batch.h"
#include "lib/comm/communicator.h"
#include "lib/exec/batch.h"
#include "lib/sched/hierarchy.h"
#include "tests/support/hier_plans.h"
#include "tests/support/random_layouts.h"
#include "tests/support/tolerance.h"

namespace hsap {
namespace {

using ::hsap::testing::DocMix;
using ::hsap::testing::HeadSplit;
using ::hsap::testing::MakePlan;
using ::hsap::testing::PlanSpec;

struct Tensor {
  DType dtype = DType::kF32;
  int64_t tokens = 0;
  int heads = 0, dim = 0;
  std::vector<uint8_t> bytes;
  Tensor() = default;
  Tensor(DType t, int64_t n, int h, int d) : dtype(t), tokens(n), heads(h), dim(d) {
    bytes.assign(static_cast<size_t>(n) * h * d * DTypeSize(t) + 1, 0);
  }
  size_t size() const { return static_cast<size_t>(tokens) * heads * dim; }
  size_t row_bytes() const { return static_cast<size_t>(heads) * dim * DTypeSize(dtype); }
  void Randomize(std::mt19937_64& rng) {
    std::normal_distribution<float> n(0.0f, 1.0f);
    for (size_t i = 0; i < size(); ++i) StoreFromFloat(dtype, bytes.data(), i, n(rng));
  }
  float At(size_t i) const { return LoadAsFloat(dtype, bytes.data(), i); }
};

// Rows of `row` at the token ranges of a shard, and back.
Tensor Slice(const Tensor& row, const std::vector<TokenRange>& shard) {
  int64_t n = 0;
  for (const TokenRange& r : shard) n += r.size();
  Tensor out(row.dtype, n, row.heads, row.dim);
  size_t at = 0;
  for (const TokenRange& r : shard) {
    std::memcpy(out.bytes.data() + at, row.bytes.data() + r.begin * row.row_bytes(),
                r.size() * row.row_bytes());
    at += r.size() * row.row_bytes();
  }
  return out;
}
void Unslice(const Tensor& part, const std::vector<TokenRange>& shard, Tensor& row) {
  size_t at = 0;
  for (const TokenRange& r : shard) {
    std::memcpy(row.bytes.data() + r.begin * row.row_bytes(), part.bytes.data() + at,
                r.size() * row.row_bytes());
    at += r.size() * row.row_bytes();
  }
}

struct Case {
  PlanSpec spec;
  DType dtype = DType::kF32;
  int head_dim = 32;
  int64_t tokens = 300;
  DocMix mix = DocMix::kLongTail;
  bool causal_only = false;
  bool slices = false;  // a user-slice layout instead of documents
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.spec.Name(); }

struct Result {
  Tensor out, dq, dk, dv;
  std::vector<float> lse;  // [heads_q, T]
  std::vector<HierTraffic> forward, backward, predicted_forward, predicted_backward;
  std::vector<std::string> errors;
};

struct Inputs {
  Tensor q, k, v, dout;
};

Inputs MakeInputs(const Plan& plan, DType dtype, int head_dim, int64_t T, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Inputs in{Tensor(dtype, T, plan.heads_q, head_dim), Tensor(dtype, T, plan.heads_kv, head_dim),
            Tensor(dtype, T, plan.heads_kv, head_dim), Tensor(dtype, T, plan.heads_q, head_dim)};
  in.q.Randomize(rng);
  in.k.Randomize(rng);
  in.v.Randomize(rng);
  in.dout.Randomize(rng);
  return in;
}

Result RunHier(const Layout& layout, const Plan& plan, const Inputs& in, int head_dim,
               const KernelSet& kernels = HandWrittenKernels()) {
  const int R = plan.num_ranks;
  const int64_t T = layout.num_tokens();
  const DType dtype = in.q.dtype;
  Result res;
  res.out = Tensor(dtype, T, plan.heads_q, head_dim);
  res.dq = Tensor(dtype, T, plan.heads_q, head_dim);
  res.dk = Tensor(dtype, T, plan.heads_kv, head_dim);
  res.dv = Tensor(dtype, T, plan.heads_kv, head_dim);
  res.lse.assign(static_cast<size_t>(T) * plan.heads_q, 0.0f);
  res.forward.resize(R);
  res.backward.resize(R);
  res.predicted_forward.resize(R);
  res.predicted_backward.resize(R);
  res.errors.assign(R, "");

  absl::StatusOr<Hierarchy> h = Hierarchy::Create(layout, plan);
  if (!h.ok()) {
    res.errors[0] = std::string(h.status().message());
    return res;
  }
  CommOptions options;
  options.timeout = absl::Seconds(60);
  options.num_threads = 1;
  auto world = Communicator::CreateHostWorld(R, options);
  if (!world.ok()) {
    res.errors[0] = std::string(world.status().message());
    return res;
  }
  std::vector<Tensor> out(R), dq(R), dk(R), dv(R);
  std::vector<std::vector<float>> lse(R);
  std::vector<std::thread> threads;
  for (int r = 0; r < R; ++r) {
    threads.emplace_back([&, r] {
      absl::StatusOr<RankHierarchy> rh = h->BuildRank(layout, r);
      if (!rh.ok()) {
        res.errors[r] = std::string(rh.status().message());
        (*world)[r]->Abort("build failed");
        return;
      }
      const std::vector<TokenRange>& shard = h->shard(r);
      const Tensor q = Slice(in.q, shard), k = Slice(in.k, shard), v = Slice(in.v, shard),
                   dout = Slice(in.dout, shard);
      const int64_t n = rh->shard_tokens;
      out[r] = Tensor(dtype, n, plan.heads_q, head_dim);
      dq[r] = Tensor(dtype, n, plan.heads_q, head_dim);
      dk[r] = Tensor(dtype, n, plan.heads_kv, head_dim);
      dv[r] = Tensor(dtype, n, plan.heads_kv, head_dim);
      lse[r].assign(static_cast<size_t>(n) * plan.heads_q, 0.0f);
      HierExecContext ctx;
      ctx.comm = (*world)[r].get();
      ctx.rank = &*rh;
      ctx.kernels = &kernels;
      ctx.dims = AttentionDims{plan.heads_q,
                               plan.heads_kv,
                               head_dim,
                               1.0f / std::sqrt(static_cast<float>(head_dim)),
                               {}};
      ctx.dtype = dtype;
      ctx.call_id = 1;
      absl::Status s = HierarchicalForward(ctx, q.bytes.data(), k.bytes.data(), v.bytes.data(),
                                           out[r].bytes.data(), lse[r].data(), &res.forward[r]);
      if (s.ok()) {
        ctx.call_id = 2;
        s = HierarchicalBackward(ctx, dout.bytes.data(), q.bytes.data(), k.bytes.data(),
                                 v.bytes.data(), out[r].bytes.data(), lse[r].data(),
                                 dq[r].bytes.data(), dk[r].bytes.data(), dv[r].bytes.data(),
                                 &res.backward[r]);
      }
      if (!s.ok()) {
        res.errors[r] = std::string(s.message());
        (*world)[r]->Abort("rank failed");
      }
      res.predicted_forward[r] = PredictForwardTraffic(*rh, head_dim, dtype);
      res.predicted_backward[r] = PredictBackwardTraffic(*rh, head_dim, dtype);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < R; ++r) {
    const std::vector<TokenRange>& shard = h->shard(r);
    Unslice(out[r], shard, res.out);
    Unslice(dq[r], shard, res.dq);
    Unslice(dk[r], shard, res.dk);
    Unslice(dv[r], shard, res.dv);
    int64_t at = 0;
    const int64_t n = h->shard_tokens(r);
    for (const TokenRange& range : shard) {
      for (int64_t t = range.begin; t < range.end; ++t, ++at) {
        for (int head = 0; head < plan.heads_q; ++head) {
          res.lse[head * T + t] = lse[r][head * n + at];
        }
      }
    }
  }
  return res;
}

using ::hsap::testing::ExpectMatchesReference;

Layout MakeLayout(const Case& c) {
  return c.slices ? testing::RandomSliceLayout(c.tokens, c.spec.seed + 50)
                  : testing::RandomLayout(c.tokens, c.mix, c.spec.seed * 13 + 5, c.causal_only);
}

void CheckAgainstReference(const Layout& layout, const Plan& plan, const Case& c) {
  const Inputs in = MakeInputs(plan, c.dtype, c.head_dim, layout.num_tokens(), c.spec.seed + 99);
  const Result got = RunHier(layout, plan, in, c.head_dim);
  for (int r = 0; r < plan.num_ranks; ++r) {
    ASSERT_EQ(got.errors[r], "") << "rank " << r;
    EXPECT_EQ(got.forward[r], got.predicted_forward[r]) << "forward bytes of rank " << r;
    EXPECT_EQ(got.backward[r], got.predicted_backward[r]) << "backward bytes of rank " << r;
  }
  ReferenceInputs ri;
  ri.dims = AttentionDims{plan.heads_q,
                          plan.heads_kv,
                          c.head_dim,
                          1.0f / std::sqrt(static_cast<float>(c.head_dim)),
                          {}};
  ri.dtype = c.dtype;
  ri.q = in.q.bytes.data();
  ri.k = in.k.bytes.data();
  ri.v = in.v.bytes.data();
  ExpectMatchesReference(layout, ri, in.dout.bytes.data(), got, /*backward=*/true);
}

class HierarchicalTest : public ::testing::TestWithParam<Case> {};

TEST_P(HierarchicalTest, MatchesSingleDeviceReference) {
  const Case& c = GetParam();
  CheckAgainstReference(MakeLayout(c), MakePlan(c.spec), c);
}

std::vector<Case> Cases() {
  std::vector<Case> out;
  uint64_t seed = 1;
  auto add = [&](std::vector<int> sizes, int hq, int hkv, HeadSplit split, bool uneven, DType t,
                 DocMix mix, int64_t tokens) {
    Case c;
    c.spec = PlanSpec{sizes, hq, hkv, split, uneven, seed++};
    c.dtype = t;
    c.mix = mix;
    c.tokens = tokens;
    out.push_back(c);
  };
  add({4}, 8, 8, HeadSplit::kContiguous, false, DType::kF32, DocMix::kLongTail, 300);  // Ulysses
  add({1, 1, 1, 1}, 4, 2, HeadSplit::kContiguous, true, DType::kBF16, DocMix::kOneHuge, 400);
  add({2, 2}, 4, 4, HeadSplit::kContiguous, false, DType::kF32, DocMix::kUniform, 300);  // 2x2
  add({2, 2, 2, 2}, 4, 4, HeadSplit::kContiguous, false, DType::kBF16, DocMix::kLongTail, 400);
  add({4, 4}, 8, 8, HeadSplit::kContiguous, true, DType::kF32, DocMix::kSingle, 256);  // 4x2
  add({4, 2}, 6, 6, HeadSplit::kRoundRobin, true, DType::kBF16, DocMix::kOneHuge, 400);
  add({3, 3, 2}, 7, 7, HeadSplit::kRandom, true, DType::kF32, DocMix::kLongTail, 350);
  add({1, 2, 5}, 5, 5, HeadSplit::kRandom, true, DType::kF16, DocMix::kUniform, 300);
  add({2, 3}, 16, 2, HeadSplit::kContiguous, true, DType::kBF16, DocMix::kLongTail, 240);  // GQA
  add({4, 2}, 8, 1, HeadSplit::kRoundRobin, true, DType::kF32, DocMix::kOneHuge, 300);     // MQA
  add({3, 3, 2}, 8, 1, HeadSplit::kRandom, false, DType::kBF16, DocMix::kTiny, 200);       // MQA
  add({2, 2}, 13, 13, HeadSplit::kRandom, true, DType::kF32, DocMix::kSingle, 200);
  Case slices;
  slices.spec = PlanSpec{{2, 3}, 5, 1, HeadSplit::kRoundRobin, true, seed++};
  slices.slices = true;
  slices.tokens = 300;
  out.push_back(slices);
  return out;
}

INSTANTIATE_TEST_SUITE_P(Plans, HierarchicalTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           const Case& c = info.param;
                           return c.spec.Name() + "_" + std::string(DTypeName(c.dtype)) +
                                  (c.slices ? std::string("_slices")
                                            : "_" + testing::DocMixName(c.mix));
                         });

TEST(HierarchicalMaskKinds, EveryKindAsOneDocumentAcrossGroups) {
  const MaskKind kinds[] = {MaskKind::kCausal, MaskKind::kFull, MaskKind::kPrefixLM,
                            MaskKind::kSlidingWindow};
  const Plan plan = MakePlan({{2, 1, 2}, 5, 5, HeadSplit::kRandom, true, 4});
  for (MaskKind kind : kinds) {
    const int64_t L = 250;
    const int64_t param = kind == MaskKind::kPrefixLM        ? 90
                          : kind == MaskKind::kSlidingWindow ? 37
                                                             : 0;
    absl::StatusOr<Layout> layout = Layout::FromDocuments(
        std::vector<int64_t>{0, L}, std::vector<MaskKind>{kind}, std::vector<int64_t>{param});
    ASSERT_TRUE(layout.ok());
    SCOPED_TRACE(::testing::Message() << "kind " << static_cast<int>(kind));
    Case c;
    c.spec.seed = 4;
    CheckAgainstReference(*layout, plan, c);
  }
}

TEST(HierarchicalDeterminism, BitwiseIdenticalAcrossRuns) {
  const Plan plan = MakePlan({{3, 2}, 8, 2, HeadSplit::kRandom, true, 12});
  const Layout layout = testing::RandomLayout(300, DocMix::kOneHuge, 3, false);
  const Inputs in = MakeInputs(plan, DType::kBF16, 32, layout.num_tokens(), 8);
  const Result a = RunHier(layout, plan, in, 32), b = RunHier(layout, plan, in, 32);
  EXPECT_EQ(a.out.bytes, b.out.bytes);
  EXPECT_EQ(a.lse, b.lse);
  EXPECT_EQ(a.dq.bytes, b.dq.bytes);
  EXPECT_EQ(a.dk.bytes, b.dk.bytes);
  EXPECT_EQ(a.dv.bytes, b.dv.bytes);
}

// Groups of one rank with every head: the issue-3 sequence-aware ring, bit for bit and
// byte for byte.
TEST(HierarchicalDegenerate, GroupsOfOneAreTheSequenceAwareRing) {
  const int R = 4;
  const Plan plan = MakePlan({{1, 1, 1, 1}, 4, 2, HeadSplit::kContiguous, false, 2});
  const Layout layout = testing::RandomLayout(360, DocMix::kLongTail, 21, false);
  const DType dtype = DType::kBF16;
  const Inputs in = MakeInputs(plan, dtype, 32, layout.num_tokens(), 5);
  const Result hier = RunHier(layout, plan, in, 32);

  CommOptions options;
  options.timeout = absl::Seconds(60);
  options.num_threads = 1;
  auto world = Communicator::CreateHostWorld(R, options);
  ASSERT_TRUE(world.ok());
  std::vector<std::thread> threads;
  std::vector<std::string> errors(R);
  Tensor out(dtype, layout.num_tokens(), 4, 32), dk(dtype, layout.num_tokens(), 2, 32);
  std::vector<BatchTraffic> traffic(R);
  std::vector<std::vector<TokenRange>> ranges(R);
  std::vector<Tensor> outs(R), dks(R);
  for (int r = 0; r < R; ++r) {
    threads.emplace_back([&, r] {
      BatchOptions bo;
      bo.dtype = dtype;
      bo.heads_q = 4;
      bo.heads_kv = 2;
      bo.head_dim = 32;
      auto batch = Batch::Create(*(*world)[r], layout, {}, bo);
      if (!batch.ok()) {
        errors[r] = std::string(batch.status().message());
        return;
      }
      ranges[r] = (*batch)->partition()->ranges(r);
      const Tensor q = Slice(in.q, ranges[r]), k = Slice(in.k, ranges[r]),
                   v = Slice(in.v, ranges[r]), dout = Slice(in.dout, ranges[r]);
      const int64_t n = (*batch)->local_tokens();
      outs[r] = Tensor(dtype, n, 4, 32);
      dks[r] = Tensor(dtype, n, 2, 32);
      Tensor dq(dtype, n, 4, 32), dv(dtype, n, 2, 32);
      std::vector<float> lse(n * 4 + 1);
      absl::Status s = (*batch)->Forward(q.bytes.data(), k.bytes.data(), v.bytes.data(),
                                         outs[r].bytes.data(), lse.data());
      if (s.ok()) {
        s = (*batch)->Backward(dout.bytes.data(), q.bytes.data(), k.bytes.data(), v.bytes.data(),
                               outs[r].bytes.data(), lse.data(), dq.bytes.data(),
                               dks[r].bytes.data(), dv.bytes.data());
      }
      if (!s.ok()) errors[r] = std::string(s.message());
      traffic[r] = (*batch)->traffic();
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < R; ++r) {
    ASSERT_EQ(errors[r], "");
    ASSERT_EQ(hier.errors[r], "");
    Unslice(outs[r], ranges[r], out);
    Unslice(dks[r], ranges[r], dk);
    EXPECT_EQ(hier.forward[r].a2a_sent + hier.forward[r].a2a_received, 0u);
    EXPECT_EQ(hier.forward[r].ring_sent, traffic[r].forward.sent());
    EXPECT_EQ(hier.forward[r].ring_received, traffic[r].forward.received());
    EXPECT_EQ(hier.backward[r].ring_sent, traffic[r].backward.sent());
    EXPECT_EQ(hier.backward[r].ring_received, traffic[r].backward.received());
  }
  EXPECT_EQ(hier.out.bytes, out.bytes);
  EXPECT_EQ(hier.dk.bytes, dk.bytes);
}

// One group: Ulysses. Every rank computes its heads over the whole row, so the output is
// the single-device kernel's, bit for bit, and nothing travels across groups.
TEST(HierarchicalDegenerate, OneGroupIsUlysses) {
  const Plan plan = MakePlan({{3}, 6, 3, HeadSplit::kRandom, true, 7});
  const Layout layout = testing::RandomLayout(300, DocMix::kUniform, 2, false);
  const DType dtype = DType::kF16;
  const Inputs in = MakeInputs(plan, dtype, 32, layout.num_tokens(), 6);
  const Result hier = RunHier(layout, plan, in, 32);
  for (int r = 0; r < 3; ++r) {
    ASSERT_EQ(hier.errors[r], "");
    EXPECT_EQ(hier.forward[r].ring_sent + hier.forward[r].ring_received, 0u);
  }
  const int64_t T = layout.num_tokens();
  std::vector<float> out32(T * 6 * 32), lse32(T * 6);
  InitPartial(out32.data(), lse32.data(), T, 6, 32);
  ForwardArgs args;
  args.dims = AttentionDims{6, 3, 32, 1.0f / std::sqrt(32.0f), {}};
  args.dtype = dtype;
  args.q = in.q.bytes.data();
  args.k = in.k.bytes.data();
  args.v = in.v.bytes.data();
  args.q_rows = args.k_rows = T;
  args.out = out32.data();
  args.lse = lse32.data();
  absl::StatusOr<WorkList> work = BuildWorkList(layout, kKernelBlockQ);
  ASSERT_TRUE(work.ok());
  ASSERT_TRUE(KernelForward(args, *work, 1).ok());
  std::vector<uint8_t> rounded(2);
  for (size_t i = 0; i < out32.size(); ++i) {
    StoreFromFloat(dtype, rounded.data(), 0, out32[i]);
    ASSERT_EQ(hier.out.At(i), LoadAsFloat(dtype, rounded.data(), 0)) << "element " << i;
  }
  EXPECT_EQ(hier.lse, lse32);
}

}  // namespace
}  // namespace hsap

namespace hsap {
namespace {

// A C plan handle for a Plan (through hsapPlanCreate's flat arrays).
hsapPlan_t ToCPlan(const Plan& plan) {
  std::vector<int> sizes, ranks, counts, heads, ring = plan.ring_order;
  std::vector<double> seq, tok;
  for (const PlanGroup& g : plan.groups) {
    sizes.push_back(static_cast<int>(g.ranks.size()));
    seq.push_back(g.sequence_weight);
    for (size_t i = 0; i < g.ranks.size(); ++i) {
      ranks.push_back(g.ranks[i]);
      tok.push_back(g.token_weights[i]);
      counts.push_back(static_cast<int>(g.heads[i].size()));
      heads.insert(heads.end(), g.heads[i].begin(), g.heads[i].end());
    }
  }
  hsapPlan_t handle = nullptr;
  EXPECT_EQ(
      hsapPlanCreate(&handle, plan.num_ranks, plan.heads_q, plan.heads_kv,
                     static_cast<int>(sizes.size()), sizes.data(), ranks.data(), seq.data(),
                     tok.data(), counts.data(), heads.data(), ring.empty() ? nullptr : ring.data()),
      hsapSuccess)
      << hsapGetLastError();
  return handle;
}

hsapDataType_t ToC(DType t) {
  return t == DType::kF32 ? hsapFloat32 : t == DType::kBF16 ? hsapBFloat16 : hsapFloat16;
}

// Through the C API: hsapBatchCreateWithPlan, the batch's partition, forward and backward
// with the same results and bytes as the executor, and the traffic split.
TEST(HierarchicalCApi, BatchWithPlanMatchesTheExecutor) {
  const Plan plan = MakePlan({{3, 2}, 6, 2, HeadSplit::kRoundRobin, true, 17});
  const Layout layout = testing::RandomLayout(260, DocMix::kLongTail, 4, false);
  const DType dtype = DType::kBF16;
  const int D = 32, R = plan.num_ranks;
  const Inputs in = MakeInputs(plan, dtype, D, layout.num_tokens(), 3);
  // The C API runs the kernels compiled at batch creation (the JIT set where this machine
  // can build it): the executor must run the same ones for a bitwise comparison.
  BatchOptions options;
  options.dtype = dtype;
  options.heads_q = plan.heads_q;
  options.heads_kv = plan.heads_kv;
  options.head_dim = D;
  absl::StatusOr<std::shared_ptr<const KernelSet>> kernels = HostKernelsForOptions(options, layout);
  ASSERT_TRUE(kernels.ok()) << kernels.status();
  const Result want = RunHier(layout, plan, in, D, **kernels);

  hsapLayout_t cl = nullptr;
  std::vector<int64_t> cu{0};
  std::vector<hsapMaskKind_t> kinds;
  std::vector<int64_t> params;
  for (const Document& d : layout.documents()) {
    cu.push_back(d.end);
    kinds.push_back(static_cast<hsapMaskKind_t>(d.kind));
    params.push_back(d.param);
  }
  ASSERT_EQ(hsapLayoutCreate(&cl, cu.data(), static_cast<int64_t>(kinds.size()), kinds.data(),
                             params.data()),
            hsapSuccess);
  hsapPlan_t cp = ToCPlan(plan);
  ASSERT_NE(cp, nullptr);
  std::vector<hsapComm_t> comms(R);
  hsapCommConfig_t cc = HSAP_COMM_CONFIG_INITIALIZER;
  cc.timeoutMs = 60000;
  cc.numThreads = 1;
  ASSERT_EQ(hsapCommInitAll(comms.data(), R, &cc), hsapSuccess);
  std::vector<std::string> errors(R);
  std::vector<Tensor> outs(R), dks(R);
  std::vector<std::vector<TokenRange>> ranges(R);
  std::vector<hsapTrafficDetail_t> detail(R);
  std::vector<hsapTraffic_t> totals(R);
  std::vector<std::thread> threads;
  for (int r = 0; r < R; ++r) {
    threads.emplace_back([&, r] {
      hsapBatchConfig_t bc = HSAP_BATCH_CONFIG_INITIALIZER;
      bc.dtype = ToC(dtype);
      bc.numHeadsQ = plan.heads_q;
      bc.numHeadsKV = plan.heads_kv;
      bc.headDim = D;
      hsapBatch_t batch = nullptr;
      if (hsapBatchCreateWithPlan(&batch, comms[r], cl, cp, &bc) != hsapSuccess) {
        errors[r] = hsapGetLastError();
        return;
      }
      hsapPartition_t part = nullptr;
      int64_t n = 0, nr = 0, n2 = 0;
      hsapBatchGetPartition(batch, &part);
      hsapBatchGetLocalTokens(batch, &n);
      hsapPartitionGetRanges(part, r, nullptr, &nr, &n2);
      std::vector<int64_t> flat(2 * nr);
      hsapPartitionGetRanges(part, r, flat.data(), &nr, nullptr);
      for (int64_t i = 0; i < nr; ++i) ranges[r].push_back({flat[2 * i], flat[2 * i + 1]});
      EXPECT_EQ(n, n2);
      Tensor q = Slice(in.q, ranges[r]), k = Slice(in.k, ranges[r]), v = Slice(in.v, ranges[r]),
             dout = Slice(in.dout, ranges[r]);
      outs[r] = Tensor(dtype, n, plan.heads_q, D);
      dks[r] = Tensor(dtype, n, plan.heads_kv, D);
      Tensor dq(dtype, n, plan.heads_q, D), dv(dtype, n, plan.heads_kv, D);
      std::vector<float> lse(n * plan.heads_q + 1);
      hsapTensor_t tq{q.bytes.data(), ToC(dtype), n, plan.heads_q, D},
          tk{k.bytes.data(), ToC(dtype), n, plan.heads_kv, D},
          tv{v.bytes.data(), ToC(dtype), n, plan.heads_kv, D},
          tout{outs[r].bytes.data(), ToC(dtype), n, plan.heads_q, D},
          tdout{dout.bytes.data(), ToC(dtype), n, plan.heads_q, D},
          tdq{dq.bytes.data(), ToC(dtype), n, plan.heads_q, D},
          tdk{dks[r].bytes.data(), ToC(dtype), n, plan.heads_kv, D},
          tdv{dv.bytes.data(), ToC(dtype), n, plan.heads_kv, D};
      if (hsapAttentionForward(batch, &tq, &tk, &tv, &tout, lse.data()) != hsapSuccess ||
          hsapAttentionBackward(batch, &tdout, &tq, &tk, &tv, &tout, lse.data(), &tdq, &tdk,
                                &tdv) != hsapSuccess) {
        errors[r] = hsapGetLastError();
      }
      hsapBatchGetTrafficDetail(batch, &detail[r]);
      hsapBatchGetTraffic(batch, &totals[r]);
      hsapBatchDestroy(batch);
    });
  }
  for (std::thread& t : threads) t.join();
  for (hsapComm_t c : comms) hsapCommDestroy(c);
  hsapPlanDestroy(cp);
  hsapLayoutDestroy(cl);
  Tensor out(dtype, layout.num_tokens(), plan.heads_q, D),
      dk(dtype, layout.num_tokens(), plan.heads_kv, D);
  for (int r = 0; r < R; ++r) {
    ASSERT_EQ(errors[r], "") << "rank " << r;
    Unslice(outs[r], ranges[r], out);
    Unslice(dks[r], ranges[r], dk);
    EXPECT_EQ(detail[r].forwardAllToAllBytesSent, want.forward[r].a2a_sent);
    EXPECT_EQ(detail[r].forwardAllToAllBytesReceived, want.forward[r].a2a_received);
    EXPECT_EQ(detail[r].forwardRingBytesSent, want.forward[r].ring_sent);
    EXPECT_EQ(detail[r].forwardRingBytesReceived, want.forward[r].ring_received);
    EXPECT_EQ(detail[r].backwardAllToAllBytesSent, want.backward[r].a2a_sent);
    EXPECT_EQ(detail[r].backwardRingBytesReceived, want.backward[r].ring_received);
    EXPECT_EQ(totals[r].forwardBytesSent, want.forward[r].sent());
    EXPECT_EQ(totals[r].backwardBytesReceived, want.backward[r].received());
  }
  EXPECT_EQ(out.bytes, want.out.bytes);
  EXPECT_EQ(dk.bytes, want.dk.bytes);
}

TEST(HierarchicalCApi, BadPlansAndMismatchesAreReported) {
  // hsapPlanCreate names the problem.
  hsapPlan_t plan = nullptr;
  const int sizes[] = {2}, ranks[] = {0, 1}, counts[] = {2, 2}, heads[] = {0, 1, 1, 2};
  EXPECT_EQ(
      hsapPlanCreate(&plan, 2, 3, 3, 1, sizes, ranks, nullptr, nullptr, counts, heads, nullptr),
      hsapInvalidArgument);
  EXPECT_NE(std::string(hsapGetLastError()).find("query head 1 is owned twice"), std::string::npos)
      << hsapGetLastError();

  // A plan for 3 ranks on a 2-rank communicator, and ranks holding different plans.
  const Layout layout = testing::RandomLayout(100, DocMix::kUniform, 1, true);
  std::vector<int64_t> cu{0};
  for (const Document& d : layout.documents()) cu.push_back(d.end);
  hsapLayout_t cl = nullptr;
  ASSERT_EQ(hsapLayoutCreate(&cl, cu.data(), static_cast<int64_t>(cu.size()) - 1, nullptr, nullptr),
            hsapSuccess);
  hsapPlan_t three = ToCPlan(MakePlan({{2, 1}, 4, 4, HeadSplit::kContiguous, false, 1}));
  hsapPlan_t a = ToCPlan(MakePlan({{1, 1}, 4, 4, HeadSplit::kContiguous, false, 1}));
  hsapPlan_t b = ToCPlan(MakePlan({{2}, 4, 4, HeadSplit::kContiguous, false, 1}));
  std::vector<hsapComm_t> comms(2);
  hsapCommConfig_t cc = HSAP_COMM_CONFIG_INITIALIZER;
  cc.timeoutMs = 20000;
  ASSERT_EQ(hsapCommInitAll(comms.data(), 2, &cc), hsapSuccess);
  for (int round = 0; round < 2; ++round) {
    std::vector<hsapResult_t> results(2);
    std::vector<std::string> errors(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        hsapBatchConfig_t bc = HSAP_BATCH_CONFIG_INITIALIZER;
        bc.dtype = hsapFloat32;
        bc.numHeadsQ = 4;
        bc.numHeadsKV = 4;
        bc.headDim = 32;
        hsapBatch_t batch = nullptr;
        hsapPlan_t mine = round == 0 ? three : (r == 0 ? a : b);
        results[r] = hsapBatchCreateWithPlan(&batch, comms[r], cl, mine, &bc);
        errors[r] = hsapGetLastError();
        if (batch != nullptr) hsapBatchDestroy(batch);
      });
    }
    for (std::thread& t : threads) t.join();
    for (int r = 0; r < 2; ++r) EXPECT_NE(results[r], hsapSuccess) << "round " << round;
    if (round == 0) {
      EXPECT_NE(errors[0].find("plan is for 3 ranks but the communicator has 2"), std::string::npos)
          << errors[0];
    } else {
      EXPECT_NE(errors[0].find("rank 1's plan differs from rank 0's"), std::string::npos)
          << errors[0];
    }
  }
  for (hsapComm_t c : comms) hsapCommDestroy(c);
  for (hsapPlan_t p : {three, a, b}) hsapPlanDestroy(p);
  hsapLayoutDestroy(cl);
}

}  // namespace
}  // namespace hsap

namespace hsap {
namespace {

// A rank with no tokens (token weight 0) and a rank with no heads take part correctly.
TEST(HierarchicalEdges, EmptyShardAndRankWithoutHeads) {
  Plan plan = MakePlan({{3, 2}, 4, 2, HeadSplit::kContiguous, false, 31});
  plan.groups[0].token_weights = {1, 0, 2};     // rank 1 holds no tokens
  plan.groups[0].heads = {{0, 1, 2}, {3}, {}};  // rank 2 computes nothing
  Case c;
  c.spec.seed = 31;
  c.dtype = DType::kBF16;
  CheckAgainstReference(testing::RandomLayout(220, DocMix::kOneHuge, 8, false), plan, c);
}

// A rank that never calls makes its peers fail with DeadlineExceeded naming the stage;
// an abort releases everyone.
TEST(HierarchicalFaults, MissingRankTimesOutAndAbortReleases) {
  const Plan plan = MakePlan({{2, 2}, 4, 4, HeadSplit::kContiguous, false, 2});
  const Layout layout = *Layout::FromDocuments({0, 128}, {MaskKind::kFull});
  absl::StatusOr<Hierarchy> h = Hierarchy::Create(layout, plan);
  ASSERT_TRUE(h.ok());
  for (bool abort : {false, true}) {
    CommOptions options;
    options.timeout = absl::Milliseconds(abort ? 20000 : 300);
    options.num_threads = 1;
    auto world = Communicator::CreateHostWorld(4, options);
    ASSERT_TRUE(world.ok());
    std::vector<absl::Status> status(4);
    std::vector<std::thread> threads;
    for (int r = 0; r < 3; ++r) {  // rank 3 never calls
      threads.emplace_back([&, r] {
        absl::StatusOr<RankHierarchy> rh = h->BuildRank(layout, r);
        const int64_t n = rh->shard_tokens;
        std::vector<float> q(n * 4 * 32 + 1), k(q.size()), out(q.size()), lse(n * 4 + 1);
        HierExecContext ctx{(*world)[r].get(),     &*rh,
                            &HandWrittenKernels(), AttentionDims{4, 4, 32, 0.125f, {}},
                            DType::kF32,           1};
        status[r] =
            HierarchicalForward(ctx, q.data(), k.data(), k.data(), out.data(), lse.data(), nullptr);
      });
    }
    if (abort) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      (*world)[3]->Abort("test abort");
    }
    for (std::thread& t : threads) t.join();
    for (int r = 0; r < 3; ++r) {
      if (abort) {
        EXPECT_EQ(status[r].code(), absl::StatusCode::kAborted) << status[r];
      } else if (r >= 2) {  // rank 3's group partner waits on it in the all-to-all
        EXPECT_EQ(status[r].code(), absl::StatusCode::kDeadlineExceeded) << status[r];
        EXPECT_NE(status[r].message().find("hier forward"), absl::string_view::npos) << status[r];
      } else {
        // Group 0 finishes its all-to-all, then waits on rank 3 (or on rank 2, which failed)
        // in the sub-ring or times out there.
        EXPECT_FALSE(status[r].ok());
      }
    }
  }
}

}  // namespace
}  // namespace hsap
