// The cuDNN baseline of the bench: its host geometry (ragged offsets, seq lens, strides, FLOP
// count) everywhere; the backward graph's plan (ops, tensors, overrides, scratch), its
// validation, and its gradients when an fp64 host interpreter runs it, against the reference,
// everywhere; libcudnn's own finalization of every descriptor of it where libcudnn is
// installed (no GPU needed); creation fails cleanly without a GPU or without
// libcudnn; on a GPU (ctest -R Cuda) cuDNN's forward output and backward gradients on a
// packed row match the fp64 reference.
#include "bench/cudnn_attention.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "attention/layout.h"
#include "attention/reference.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "lib/cuda/runtime/cuda_loader.h"
#include "tests/support/scoped_env.h"
#include "tests/support/sdpa_plan_interpreter.h"
#include "tests/support/tolerance.h"

namespace hsap::bench {
namespace {

using ::hsap::testing::ExpectWithinRule;
using ::hsap::testing::kCudaKernelFloor;
using ::hsap::testing::MaxAbs;
using ::hsap::testing::MaxAbsError;
using ::testing::AnyOf;
using ::testing::Contains;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::Not;

CudnnAttentionShape Shape(std::vector<int64_t> lengths, int hq = 8, int hkv = 2, int d = 64,
                          bool causal = true) {
  CudnnAttentionShape s;
  s.doc_lengths = std::move(lengths);
  s.heads_q = hq;
  s.heads_kv = hkv;
  s.head_dim = d;
  s.dtype = DType::kBF16;
  s.causal = causal;
  return s;
}

// The pairs the library counts for the same documents (all causal or all full).
int64_t LayoutPairs(const std::vector<int64_t>& lengths, bool causal) {
  std::vector<int64_t> cu{0};
  for (int64_t l : lengths) cu.push_back(cu.back() + l);
  std::vector<MaskKind> kinds(lengths.size(), causal ? MaskKind::kCausal : MaskKind::kFull);
  absl::StatusOr<Layout> layout = Layout::FromDocuments(cu, kinds);
  EXPECT_TRUE(layout.ok()) << layout.status();
  return layout.ok() ? layout->VisiblePairs() : -1;
}

TEST(CudnnGeometryTest, SingleDocument) {
  absl::StatusOr<CudnnRaggedGeometry> g = MakeRaggedGeometry(Shape({100}));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->batch, 1);
  EXPECT_EQ(g->max_seq_len, 100);
  EXPECT_EQ(g->total_tokens, 100);
  EXPECT_THAT(g->seq_lens, ElementsAre(100));
  EXPECT_THAT(g->qo_offsets, ElementsAre(0, 100 * 8 * 64));
  EXPECT_THAT(g->kv_offsets, ElementsAre(0, 100 * 2 * 64));
  // Our packed [T, H, D] rows seen as [B, H, S, D]: head stride D, token stride H * D.
  EXPECT_THAT(g->q_dims, ElementsAre(1, 8, 100, 64));
  EXPECT_THAT(g->q_strides, ElementsAre(100 * 8 * 64, 64, 8 * 64, 1));
  EXPECT_THAT(g->kt_dims, ElementsAre(1, 2, 64, 100));
  EXPECT_THAT(g->kt_strides, ElementsAre(100 * 2 * 64, 64, 1, 2 * 64));
  EXPECT_THAT(g->v_dims, ElementsAre(1, 2, 100, 64));
  EXPECT_THAT(g->v_strides, ElementsAre(100 * 2 * 64, 64, 2 * 64, 1));
  EXPECT_THAT(g->score_dims, ElementsAre(1, 8, 100, 100));
  EXPECT_THAT(g->score_strides, ElementsAre(8 * 100 * 100, 100 * 100, 100, 1));
  EXPECT_THAT(g->stats_dims, ElementsAre(1, 8, 100, 1));
  EXPECT_THAT(g->stats_strides, ElementsAre(8 * 100, 100, 1, 1));
  EXPECT_EQ(g->stats_elements, 8 * 100);
  EXPECT_EQ(VisiblePairs({100}, true), 100.0 * 101 / 2);
  EXPECT_EQ(ForwardFlops({100}, 8, 64, true), 4.0 * 64 * 8 * (100.0 * 101 / 2));
}

TEST(CudnnGeometryTest, UnevenLengthsAndEmptyDocuments) {
  // Lengths that are multiples of nothing, with empty documents cuDNN never sees.
  const std::vector<int64_t> lengths = {7, 0, 13, 1, 129, 0};
  absl::StatusOr<CudnnRaggedGeometry> g = MakeRaggedGeometry(Shape(lengths, 6, 3, 128));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->batch, 4);
  EXPECT_EQ(g->max_seq_len, 129);
  EXPECT_EQ(g->total_tokens, 150);
  EXPECT_THAT(g->seq_lens, ElementsAre(7, 13, 1, 129));
  const int64_t qrow = 6 * 128, kvrow = 3 * 128;
  EXPECT_THAT(g->qo_offsets, ElementsAre(0, 7 * qrow, 20 * qrow, 21 * qrow, 150 * qrow));
  EXPECT_THAT(g->kv_offsets, ElementsAre(0, 7 * kvrow, 20 * kvrow, 21 * kvrow, 150 * kvrow));
  EXPECT_THAT(g->q_dims, ElementsAre(4, 6, 129, 128));
  EXPECT_EQ(g->stats_elements, 4 * 6 * 129);
  for (bool causal : {true, false}) {
    EXPECT_EQ(VisiblePairs(lengths, causal), static_cast<double>(LayoutPairs(lengths, causal)));
  }
}

TEST(CudnnGeometryTest, ManyTinyDocuments) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int64_t> len(1, 16);
  std::vector<int64_t> lengths;
  int64_t total = 0;
  while (total < 5000) {
    lengths.push_back(std::min<int64_t>(len(rng), 5000 - total));
    total += lengths.back();
  }
  absl::StatusOr<CudnnRaggedGeometry> g = MakeRaggedGeometry(Shape(lengths, 16, 4, 128));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->batch, static_cast<int64_t>(lengths.size()));
  EXPECT_LE(g->max_seq_len, 16);
  EXPECT_EQ(g->total_tokens, 5000);
  ASSERT_EQ(g->qo_offsets.size(), lengths.size() + 1);
  int64_t cu = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    EXPECT_EQ(g->qo_offsets[i], cu * 16 * 128);
    EXPECT_EQ(g->kv_offsets[i], cu * 4 * 128);
    EXPECT_EQ(g->seq_lens[i], lengths[i]);
    cu += lengths[i];
  }
  EXPECT_EQ(g->qo_offsets.back(), 5000 * 16 * 128);
  EXPECT_EQ(VisiblePairs(lengths, true), static_cast<double>(LayoutPairs(lengths, true)));
  EXPECT_EQ(ForwardFlops(lengths, 16, 128, true),
            4.0 * 128 * 16 * static_cast<double>(LayoutPairs(lengths, true)));
}

TEST(CudnnGeometryTest, RejectsWhatCudnnCannotTake) {
  CudnnAttentionShape fp32 = Shape({64});
  fp32.dtype = DType::kF32;
  for (const CudnnAttentionShape& s :
       {fp32, Shape({64}, 6, 4), Shape({64}, 8, 0), Shape({64}, 8, 2, 100), Shape({64}, 8, 2, 512),
        Shape({}), Shape({0, 0}), Shape({5, -1})}) {
    absl::StatusOr<CudnnRaggedGeometry> g = MakeRaggedGeometry(s);
    EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument) << g.status();
    EXPECT_FALSE(g.status().message().empty());
  }
  // Element offsets beyond int32: 2^20 tokens x 64 heads x 128.
  absl::StatusOr<CudnnRaggedGeometry> big = MakeRaggedGeometry(Shape({1 << 20}, 64, 8, 128));
  EXPECT_EQ(big.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(big.status().message(), HasSubstr("int32"));
}

// ---------------------------------------------------------------------------------------
// The backward graph as data.

std::vector<std::string> OpNames(const CudnnGraphPlan& plan) {
  std::vector<std::string> names;
  for (const CudnnOpNode& op : plan.ops) names.push_back(op.name);
  return names;
}

const CudnnOpNode* FindOp(const CudnnGraphPlan& plan, const std::string& name) {
  for (const CudnnOpNode& op : plan.ops) {
    if (op.name == name) return &op;
  }
  return nullptr;
}

TEST(CudnnBackwardPlanTest, BackwardFlopsAreTwoAndAHalfForwards) {
  const std::vector<int64_t> lengths = {100, 0, 37};
  EXPECT_EQ(BackwardFlops(lengths, 8, 128, true), 2.5 * ForwardFlops(lengths, 8, 128, true));
  EXPECT_EQ(BackwardFlops(lengths, 8, 128, true),
            10.0 * 128 * 8 * static_cast<double>(LayoutPairs(lengths, true)));
  EXPECT_EQ(BackwardFlops({64}, 2, 64, false), 10.0 * 64 * 2 * 64 * 64);
}

TEST(CudnnBackwardPlanTest, CausalMhaGraph) {
  const CudnnAttentionShape shape = Shape({7, 0, 130, 64}, 4, 4, 128);
  absl::StatusOr<CudnnGraphPlan> plan = BackwardGraphPlan(shape, 91900);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(ValidateGraphPlan(*plan).ok()) << ValidateGraphPlan(*plan);
  EXPECT_THAT(OpNames(*plan),
              ElementsAre("mul_dO_O", "reduce_dO_O", "scale_one", "matmul_Q_KT", "mul_S_scale",
                          "padding_row_index", "padding_col_index", "padding_row_lt_seq_q",
                          "padding_col_lt_seq_kv", "padding_and", "padding_select",
                          "causal_row_index", "causal_col_index", "row_ge_col", "causal_select",
                          "sub_S_stats", "exp_S", "reshape_E", "matmul_ET_dO", "matmul_dO_VT",
                          "sub_dP_softmax_sum", "mul_dP_E", "mul_dS_scale", "reshape_dS",
                          "matmul_dST_Q", "reshape_K", "matmul_dS_K", "identity_dQ"));
  // What the variant pack binds: no GQA scratch, no second padding on 9.19.
  EXPECT_THAT(plan->BoundUids(), ElementsAre(kUidQ, kUidK, kUidV, kUidO, kUidStats, kUidSeqLenQ,
                                             kUidSeqLenKv, kUidOffsetQo, kUidOffsetKv, kUidScale,
                                             kUidLowestPadding, kUidLowestCausal, kUidDO, kUidDQ,
                                             kUidDK, kUidDV, kUidOne, kUidSoftmaxSum, kUidDQAccum));
  // The matmuls and their per-document extents.
  const CudnnOpNode* dv = FindOp(*plan, "matmul_ET_dO");
  ASSERT_NE(dv, nullptr);
  EXPECT_EQ(dv->output, kUidDV);
  EXPECT_EQ(dv->inputs[1], kUidDO);
  EXPECT_EQ(dv->m_override, kUidSeqLenKv);
  EXPECT_EQ(dv->k_override, kUidSeqLenQ);
  EXPECT_EQ(dv->n_override, 0);
  const CudnnOpNode* dp = FindOp(*plan, "matmul_dO_VT");
  ASSERT_NE(dp, nullptr);
  EXPECT_THAT(dp->inputs, ElementsAre(kUidDO, kUidV));
  EXPECT_EQ(dp->m_override, kUidSeqLenQ);
  EXPECT_EQ(dp->n_override, kUidSeqLenKv);
  const CudnnOpNode* dq = FindOp(*plan, "matmul_dS_K");
  ASSERT_NE(dq, nullptr);
  EXPECT_EQ(dq->output, kUidDQAccum);
  EXPECT_EQ(dq->k_override, kUidSeqLenKv);
  EXPECT_EQ(FindOp(*plan, "matmul_dST_Q")->output, kUidDK);
  EXPECT_EQ(FindOp(*plan, "identity_dQ")->output, kUidDQ);
  // Scratch: softmax_sum [B, Hq, S, 1] and the fp32 dQ accumulator in the packed [T, Hq, D]
  // layout (ragged like dQ).
  absl::StatusOr<CudnnRaggedGeometry> g = MakeRaggedGeometry(shape);
  ASSERT_TRUE(g.ok());
  const CudnnTensorNode* sum = plan->Find(kUidSoftmaxSum);
  ASSERT_NE(sum, nullptr);
  EXPECT_EQ(sum->scratch_bytes, static_cast<size_t>(g->stats_elements) * 4);
  EXPECT_EQ(sum->dims, g->stats_dims);
  const CudnnTensorNode* accum = plan->Find(kUidDQAccum);
  ASSERT_NE(accum, nullptr);
  EXPECT_EQ(accum->dtype, CudnnDataKind::kFloat);
  EXPECT_EQ(accum->scratch_bytes, static_cast<size_t>(201 * 4 * 128) * 4);
  EXPECT_EQ(accum->strides, g->q_strides);
  EXPECT_EQ(accum->ragged_offset_uid, kUidOffsetQo);
  // V enters transposed, in K^T's layout; dK and dV leave in V's.
  EXPECT_EQ(plan->Find(kUidV)->dims, g->kt_dims);
  EXPECT_EQ(plan->Find(kUidV)->strides, g->kt_strides);
  EXPECT_EQ(plan->Find(kUidDK)->strides, g->v_strides);
  EXPECT_EQ(plan->Find(kUidDV)->ragged_offset_uid, kUidOffsetKv);
  // The transposed scores (E^T, dS^T) are the I/O type, column-major over the same block.
  const CudnnTensorNode* et = plan->Find(FindOp(*plan, "reshape_E")->output);
  ASSERT_NE(et, nullptr);
  EXPECT_EQ(et->dtype, CudnnDataKind::kIo);
  EXPECT_THAT(et->strides, ElementsAre(4 * 130 * 130, 130 * 130, 1, 130));
}

TEST(CudnnBackwardPlanTest, FullAttentionHasNoCausalMask) {
  absl::StatusOr<CudnnGraphPlan> plan =
      BackwardGraphPlan(Shape({64, 32}, 4, 4, 64, /*causal=*/false), 91900);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(ValidateGraphPlan(*plan).ok()) << ValidateGraphPlan(*plan);
  EXPECT_THAT(OpNames(*plan), Not(Contains("causal_select")));
  EXPECT_THAT(OpNames(*plan), Contains("padding_select"));
  EXPECT_THAT(plan->BoundUids(), Not(Contains(kUidLowestCausal)));
  EXPECT_EQ(FindOp(*plan, "sub_S_stats")->inputs[0], FindOp(*plan, "padding_select")->output);
}

TEST(CudnnBackwardPlanTest, GqaComputesFullHeadsThenReduces) {
  const CudnnAttentionShape shape = Shape({50, 3}, 8, 2, 64);
  absl::StatusOr<CudnnGraphPlan> plan = BackwardGraphPlan(shape, 91900);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(ValidateGraphPlan(*plan).ok()) << ValidateGraphPlan(*plan);
  for (const auto& [matmul, reduce, full, out] :
       {std::tuple<const char*, const char*, int64_t, int64_t>{"matmul_ET_dO", "reduce_dV_heads",
                                                               kUidDVFullHeads, kUidDV},
        {"matmul_dST_Q", "reduce_dK_heads", kUidDKFullHeads, kUidDK}}) {
    SCOPED_TRACE(matmul);
    ASSERT_NE(FindOp(*plan, matmul), nullptr);
    EXPECT_EQ(FindOp(*plan, matmul)->output, full);
    const CudnnOpNode* red = FindOp(*plan, reduce);
    ASSERT_NE(red, nullptr);
    EXPECT_EQ(red->kind, CudnnOpKind::kReduction);
    EXPECT_THAT(red->inputs, ElementsAre(full));
    EXPECT_EQ(red->output, out);
    const CudnnTensorNode* f = plan->Find(full);
    ASSERT_NE(f, nullptr);
    EXPECT_THAT(f->dims, ElementsAre(2, 8, 50, 64));
    // Our [T, Hq, D] layout, ragged by the K/V offsets as cudnn-frontend does.
    EXPECT_THAT(f->strides, ElementsAre(50 * 8 * 64, 64, 8 * 64, 1));
    EXPECT_EQ(f->ragged_offset_uid, kUidOffsetKv);
    EXPECT_EQ(f->scratch_bytes, static_cast<size_t>(53 * 8 * 64) * 4);
    EXPECT_THAT(plan->Find(out)->dims, ElementsAre(2, 2, 50, 64));
  }
  // dQ reads K with its 2 heads broadcast over the 8 query heads.
  const CudnnOpNode* dq = FindOp(*plan, "matmul_dS_K");
  EXPECT_THAT(plan->Find(dq->inputs[1])->dims, ElementsAre(2, 2, 50, 64));
}

TEST(CudnnBackwardPlanTest, CudnnBefore910AppliesThePaddingAgain) {
  for (int version : {90000, 90500, 90900, 91000, 91900}) {
    SCOPED_TRACE(version);
    absl::StatusOr<CudnnGraphPlan> plan = BackwardGraphPlan(Shape({40, 9}), version);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_TRUE(ValidateGraphPlan(*plan).ok()) << ValidateGraphPlan(*plan);
    const CudnnOpNode* again = FindOp(*plan, "padding2_select");
    if (version < 91000) {
      ASSERT_NE(again, nullptr);
      EXPECT_EQ(again->inputs[0], FindOp(*plan, "sub_S_stats")->output);
      EXPECT_EQ(FindOp(*plan, "exp_S")->inputs[0], again->output);
      EXPECT_THAT(plan->BoundUids(), Contains(kUidLowestPadding2));
    } else {
      EXPECT_EQ(again, nullptr);
      EXPECT_THAT(plan->BoundUids(), Not(Contains(kUidLowestPadding2)));
    }
  }
}

TEST(CudnnBackwardPlanTest, RejectsWhatCudnnCannotTake) {
  CudnnAttentionShape fp32 = Shape({64});
  fp32.dtype = DType::kF32;
  for (const CudnnAttentionShape& s :
       {fp32, Shape({64}, 6, 4), Shape({64}, 8, 2, 100), Shape({})}) {
    EXPECT_EQ(BackwardGraphPlan(s, 91900).status().code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST(CudnnBackwardPlanTest, ValidationFindsBrokenPlans) {
  absl::StatusOr<CudnnGraphPlan> good = BackwardGraphPlan(Shape({40, 9}, 4, 2, 64), 91900);
  ASSERT_TRUE(good.ok());
  ASSERT_TRUE(ValidateGraphPlan(*good).ok());
  auto expect_broken = [](const CudnnGraphPlan& plan, const std::string& why) {
    absl::Status s = ValidateGraphPlan(plan);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << why;
    EXPECT_THAT(s.message(), HasSubstr(why));
  };
  {
    CudnnGraphPlan p = *good;  // exp before the subtraction it reads
    std::swap(p.ops[15], p.ops[16]);
    ASSERT_EQ(p.ops[15].name, "exp_S");
    expect_broken(p, "before any op writes it");
  }
  {
    CudnnGraphPlan p = *good;  // dQ's accumulator with the wrong head dim
    for (CudnnTensorNode& t : p.tensors) {
      if (t.uid == kUidDQAccum) t.dims[3] = 32;
    }
    expect_broken(p, "does not multiply");
  }
  {
    CudnnGraphPlan p = *good;  // dS written twice
    p.ops.push_back(p.ops[p.ops.size() - 1]);
    expect_broken(p, "written twice");
  }
  {
    CudnnGraphPlan p = *good;  // a comparison that writes int32
    for (CudnnTensorNode& t : p.tensors) {
      if (t.name == "causal_keep") t.dtype = CudnnDataKind::kInt32;
    }
    expect_broken(p, "comparison");
  }
  {
    CudnnGraphPlan p = *good;  // the causal mask dropped: its select's output never written
    std::erase_if(p.ops, [](const CudnnOpNode& op) { return op.name == "causal_select"; });
    expect_broken(p, "S_causal");
  }
  {
    CudnnGraphPlan p = *good;  // a virtual id among the bound ones
    p.tensors.front().is_virtual = true;
    expect_broken(p, "wrong side");
  }
}

// ---------------------------------------------------------------------------------------
// The backward plan executed on the host by tests/support/sdpa_plan_interpreter.h, its
// result compared with the fp64 reference.
struct InterpretedGradients {
  std::vector<double> dq, dk, dv;
};

// Runs `plan` on the host with the row's inputs (bf16 values as doubles) and the reference
// forward's out and log-sum-exp as O and Stats.
InterpretedGradients Interpret(const CudnnGraphPlan& plan, const CudnnRaggedGeometry& g,
                               const CudnnAttentionShape& shape, const std::vector<uint16_t>& q,
                               const std::vector<uint16_t>& k, const std::vector<uint16_t>& v,
                               const std::vector<uint16_t>& dout,
                               const ReferenceForwardResult& fwd) {
  auto doubles = [](const std::vector<uint16_t>& x) {
    std::vector<double> d(x.size());
    for (size_t i = 0; i < x.size(); ++i) d[i] = LoadAsFloat(DType::kBF16, x.data(), i);
    return d;
  };
  std::vector<double> qd = doubles(q), kd = doubles(k), vd = doubles(v), dod = doubles(dout);
  std::vector<double> od = fwd.out;
  // Stats [B, Hq, S, 1]: the reference's lse [Hq, T] of each document's rows; 0 past them.
  std::vector<double> stats(static_cast<size_t>(g.stats_elements), 0.0);
  const int64_t T = g.total_tokens, S = g.max_seq_len;
  for (int64_t b = 0, start = 0; b < g.batch; start += g.seq_lens[b], ++b) {
    for (int64_t h = 0; h < shape.heads_q; ++h) {
      for (int64_t s = 0; s < g.seq_lens[b]; ++s) {
        stats[static_cast<size_t>((b * shape.heads_q + h) * S + s)] =
            fwd.lse[static_cast<size_t>(h * T + start + s)];
      }
    }
  }
  InterpretedGradients grads;
  grads.dq.assign(qd.size(), std::nan(""));
  grads.dk.assign(kd.size(), std::nan(""));
  grads.dv.assign(vd.size(), std::nan(""));
  testing::RaggedEntries entries{g.seq_lens, g.seq_lens, g.qo_offsets, g.kv_offsets};
  testing::PlanInterpreter run(plan, entries, shape.heads_q, shape.heads_kv, shape.head_dim);
  run.Bind(kUidQ, &qd);
  run.Bind(kUidK, &kd);
  run.Bind(kUidV, &vd);
  run.Bind(kUidO, &od);
  run.Bind(kUidDO, &dod);
  run.Bind(kUidStats, &stats);
  run.Bind(kUidDQ, &grads.dq);
  run.Bind(kUidDK, &grads.dk);
  run.Bind(kUidDV, &grads.dv);
  run.Scalar(kUidScale, 1.0 / std::sqrt(static_cast<double>(shape.head_dim)));
  run.Scalar(kUidOne, 1.0);
  for (int64_t uid : {kUidLowestPadding, kUidLowestCausal, kUidLowestPadding2}) {
    run.Scalar(uid, std::numeric_limits<float>::lowest());
  }
  run.Run();
  return grads;
}

double MaxRelativeError(const std::vector<double>& got, const std::vector<double>& want) {
  double err = 0, scale = 1e-30;
  for (size_t i = 0; i < want.size(); ++i) scale = std::max(scale, std::abs(want[i]));
  for (size_t i = 0; i < want.size(); ++i) {
    const double e = std::abs(got[i] - want[i]);
    if (std::isnan(e)) return e;
    err = std::max(err, e);
  }
  return err / scale;
}

TEST(CudnnBackwardPlanTest, PlanComputesTheReferenceGradients) {
  // Uneven documents with an empty one and a single token; MHA and GQA; causal and full;
  // with and without the second padding of cuDNN 9.0 - 9.9.
  const std::vector<int64_t> lengths = {5, 1, 0, 12, 7};
  int64_t T = 0;
  for (int64_t l : lengths) T += l;
  for (int hkv : {4, 2, 1}) {
    for (bool causal : {true, false}) {
      for (int version : {91900, 90500}) {
        SCOPED_TRACE(absl::StrCat("hkv=", hkv, causal ? " causal" : " full", " v", version));
        const int hq = 4, d = 16;
        const CudnnAttentionShape shape = Shape(lengths, hq, hkv, d, causal);
        absl::StatusOr<CudnnRaggedGeometry> g = MakeRaggedGeometry(shape);
        absl::StatusOr<CudnnGraphPlan> plan = BackwardGraphPlan(shape, version);
        ASSERT_TRUE(g.ok() && plan.ok());
        std::vector<uint16_t> q(T * hq * d), k(T * hkv * d), v(T * hkv * d), dout(T * hq * d);
        std::mt19937 rng(11);
        std::normal_distribution<float> n(0.0f, 1.0f);
        for (auto* t : {&q, &k, &v, &dout}) {
          for (size_t i = 0; i < t->size(); ++i) StoreFromFloat(DType::kBF16, t->data(), i, n(rng));
        }
        std::vector<int64_t> cu{0};
        for (int64_t l : lengths) cu.push_back(cu.back() + l);
        std::vector<MaskKind> kinds(lengths.size(), causal ? MaskKind::kCausal : MaskKind::kFull);
        absl::StatusOr<Layout> layout = Layout::FromDocuments(cu, kinds);
        ASSERT_TRUE(layout.ok());
        ReferenceInputs ri;
        ri.dims.heads_q = hq;
        ri.dims.heads_kv = hkv;
        ri.dims.head_dim = d;
        ri.dims.scale = 1.0f / std::sqrt(static_cast<float>(d));
        ri.dtype = DType::kBF16;
        ri.q = q.data();
        ri.k = k.data();
        ri.v = v.data();
        const ReferenceForwardResult fwd = ReferenceForward(*layout, ri);
        const ReferenceGradients ref = ReferenceBackward(*layout, ri, dout.data());
        // The plan's scale is 1/sqrt(D) in fp64; the reference's is the float one.
        InterpretedGradients got = Interpret(*plan, *g, shape, q, k, v, dout, fwd);
        EXPECT_LT(MaxRelativeError(got.dq, ref.dq), 1e-6);
        EXPECT_LT(MaxRelativeError(got.dk, ref.dk), 1e-6);
        EXPECT_LT(MaxRelativeError(got.dv, ref.dv), 1e-6);
      }
    }
  }
}

TEST(CudnnBackwardPlanTest, InterpreterSeesAWrongPlan) {
  // dV from E instead of E^T: the same shapes (square score blocks), so the validator passes,
  // but the gradients differ from the reference.
  const std::vector<int64_t> lengths = {6, 9};
  const CudnnAttentionShape shape = Shape(lengths, 2, 2, 8, true);
  absl::StatusOr<CudnnRaggedGeometry> g = MakeRaggedGeometry(shape);
  absl::StatusOr<CudnnGraphPlan> plan = BackwardGraphPlan(shape, 91900);
  ASSERT_TRUE(g.ok() && plan.ok());
  const CudnnOpNode* exp_s = FindOp(*plan, "exp_S");
  for (CudnnOpNode& op : plan->ops) {
    if (op.name == "matmul_ET_dO") op.inputs[0] = exp_s->output;
  }
  std::erase_if(plan->ops, [](const CudnnOpNode& op) { return op.name == "reshape_E"; });
  std::erase_if(plan->tensors, [](const CudnnTensorNode& t) { return t.name == "E^T"; });
  ASSERT_TRUE(ValidateGraphPlan(*plan).ok()) << ValidateGraphPlan(*plan);
  std::vector<uint16_t> q(15 * 2 * 8), k(q.size()), v(q.size()), dout(q.size());
  std::mt19937 rng(2);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (auto* t : {&q, &k, &v, &dout}) {
    for (size_t i = 0; i < t->size(); ++i) StoreFromFloat(DType::kBF16, t->data(), i, n(rng));
  }
  absl::StatusOr<Layout> layout =
      Layout::FromDocuments({0, 6, 15}, {MaskKind::kCausal, MaskKind::kCausal});
  ASSERT_TRUE(layout.ok());
  ReferenceInputs ri;
  ri.dims.heads_q = 2;
  ri.dims.heads_kv = 2;
  ri.dims.head_dim = 8;
  ri.dims.scale = 1.0f / std::sqrt(8.0f);
  ri.dtype = DType::kBF16;
  ri.q = q.data();
  ri.k = k.data();
  ri.v = v.data();
  const ReferenceForwardResult fwd = ReferenceForward(*layout, ri);
  const ReferenceGradients ref = ReferenceBackward(*layout, ri, dout.data());
  InterpretedGradients got = Interpret(*plan, *g, shape, q, k, v, dout, fwd);
  EXPECT_LT(MaxRelativeError(got.dq, ref.dq), 1e-6);  // dQ does not read E^T
  EXPECT_GT(MaxRelativeError(got.dv, ref.dv), 1e-2);
}

// libcudnn's own checks of every tensor and operation descriptor of the backward plan (no
// GPU needed). At this stage cuDNN checks that each descriptor gets its required attributes
// with the right attribute types (what the lowering code could get wrong); shapes and data
// types across operations are checked only when the operation graph is finalized with a
// handle, which needs a GPU: left to BackwardOnPackedRowMatchesReference.
TEST(CudnnBackwardPlanTest, CudnnFinalizesEveryDescriptor) {
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    for (int d : {64, 128}) {
      for (bool causal : {true, false}) {
        for (int hkv : {8, 2}) {
          SCOPED_TRACE(absl::StrCat(std::string(DTypeName(dtype)), " d=", d,
                                    causal ? " causal" : " full", " hkv=", hkv));
          CudnnAttentionShape shape = Shape({37, 1, 200, 0, 64}, 8, hkv, d, causal);
          shape.dtype = dtype;
          absl::StatusOr<CudnnGraphPlan> plan = BackwardGraphPlan(shape, 91900);
          ASSERT_TRUE(plan.ok()) << plan.status();
          absl::Status s = FinalizePlanDescriptors(*plan, dtype);
          if (s.code() == absl::StatusCode::kUnimplemented &&
              (absl::StrContains(s.message(), "not found") ||
               absl::StrContains(s.message(), "built without"))) {
            GTEST_SKIP() << s.message();
          }
          EXPECT_TRUE(s.ok()) << s;
        }
      }
    }
  }
}

std::string EmptyDir() {
  const char* base = std::getenv("HSAP_TEST_TMPDIR");
  const std::filesystem::path dir =
      std::filesystem::path(base != nullptr ? base : "/tmp") / "cudnn_empty_lib_dir";
  std::filesystem::create_directories(dir);
  return dir.string();
}

TEST(CudnnAttentionTest, SearchPathHonoursTheVariable) {
  {
    testing::ScopedEnv path("HSAP_CUDA_LIB_PATH", "/a:/b");
    EXPECT_THAT(CudnnLibrarySearchPath(), ElementsAre("/a", "/b"));
  }
  if (std::getenv("HSAP_CUDA_LIB_PATH") == nullptr) {
    const std::vector<std::string> dirs = CudnnLibrarySearchPath();
    ASSERT_FALSE(dirs.empty());
    EXPECT_EQ(dirs.back(), "");  // the default loader path last
    EXPECT_THAT(dirs, ::testing::Contains("/usr/local/cuda-13.0/lib"));
  }
}

TEST(CudnnAttentionTest, WithoutLibraryCreateSaysWhatIsMissing) {
  testing::ScopedEnv path("HSAP_CUDA_LIB_PATH", EmptyDir().c_str());
  absl::StatusOr<std::unique_ptr<CudnnAttention>> attn = CudnnAttention::Create(Shape({64, 32}));
  ASSERT_FALSE(attn.ok());
  EXPECT_EQ(attn.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(attn.status().message(),
              AnyOf(HasSubstr("libcudnn.so.9 not found"), HasSubstr("built without")));
  std::vector<uint8_t> buf(96 * 8 * 64 * 2);
  absl::StatusOr<CudnnForwardRun> run =
      RunCudnnForward(Shape({64, 32}), buf.data(), buf.data(), buf.data(), 0, 1, nullptr);
  EXPECT_FALSE(run.ok());
  attn = CudnnAttention::Create(Shape({64, 32}), CudnnPass::kBackward);
  ASSERT_FALSE(attn.ok());
  EXPECT_EQ(attn.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(attn.status().message(),
              AnyOf(HasSubstr("libcudnn.so.9 not found"), HasSubstr("built without")));
  absl::StatusOr<CudnnBackwardRun> bwd =
      RunCudnnBackward(Shape({64, 32}), buf.data(), buf.data(), buf.data(), buf.data(), 0, 1,
                       nullptr, nullptr, nullptr);
  EXPECT_EQ(bwd.status().code(), absl::StatusCode::kUnimplemented);
  // Arguments are checked before anything is loaded.
  EXPECT_EQ(RunCudnnBackward(Shape({64, 32}), buf.data(), buf.data(), buf.data(), buf.data(), 0, 0,
                             nullptr, nullptr, nullptr)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CudnnAttentionTest, WithoutGpuCreateFailsCleanly) {
  if (cuda::CheckCudaDevice().ok()) GTEST_SKIP() << "a CUDA device is present";
  // Whether or not libcudnn is installed here, no GPU means a clear error, never a crash.
  absl::StatusOr<std::unique_ptr<CudnnAttention>> attn = CudnnAttention::Create(Shape({64, 32}));
  ASSERT_FALSE(attn.ok());
  EXPECT_EQ(attn.status().code(), absl::StatusCode::kUnimplemented) << attn.status();
  EXPECT_THAT(attn.status().message(), AnyOf(HasSubstr("no CUDA device"), HasSubstr("not found"),
                                             HasSubstr("built without")));
  attn = CudnnAttention::Create(Shape({64, 32}, 8, 8, 128), CudnnPass::kBackward);
  ASSERT_FALSE(attn.ok());
  EXPECT_EQ(attn.status().code(), absl::StatusCode::kUnimplemented) << attn.status();
  EXPECT_THAT(attn.status().message(), AnyOf(HasSubstr("no CUDA device"), HasSubstr("not found"),
                                             HasSubstr("built without")));
}

// On a GPU: cuDNN's forward on a packed row (GQA, uneven documents, one of a single token)
// against the fp64 reference under the tests' rule.
TEST(CudnnAttentionCudaTest, PackedRowMatchesReference) {
  if (absl::Status s = cuda::CheckCudaDevice(); !s.ok()) GTEST_SKIP() << s.message();
  const std::vector<int64_t> lengths = {37, 1, 200, 64, 130};
  for (bool causal : {true, false}) {
    SCOPED_TRACE(causal ? "causal" : "full");
    CudnnAttentionShape shape = Shape(lengths, 4, 2, 64, causal);
    int64_t T = 0;
    for (int64_t l : lengths) T += l;
    std::vector<uint16_t> q(T * 4 * 64), k(T * 2 * 64), v(T * 2 * 64), out(T * 4 * 64);
    std::mt19937 rng(3);
    std::normal_distribution<float> n(0.0f, 1.0f);
    for (auto* t : {&q, &k, &v}) {
      for (size_t i = 0; i < t->size(); ++i) StoreFromFloat(DType::kBF16, t->data(), i, n(rng));
    }
    absl::StatusOr<CudnnForwardRun> run =
        RunCudnnForward(shape, q.data(), k.data(), v.data(), 1, 2, out.data());
    if (!run.ok() && run.status().code() == absl::StatusCode::kUnimplemented &&
        (absl::StrContains(run.status().message(), "libcudnn.so.9 not found") ||
         absl::StrContains(run.status().message(), "built without"))) {
      GTEST_SKIP() << run.status().message();
    }
    ASSERT_TRUE(run.ok()) << run.status();
    EXPECT_GT(run->forward_ms, 0.0);
    std::vector<int64_t> cu{0};
    for (int64_t l : lengths) cu.push_back(cu.back() + l);
    std::vector<MaskKind> kinds(lengths.size(), causal ? MaskKind::kCausal : MaskKind::kFull);
    absl::StatusOr<Layout> layout = Layout::FromDocuments(cu, kinds);
    ASSERT_TRUE(layout.ok());
    ReferenceInputs ri;
    ri.dims.heads_q = 4;
    ri.dims.heads_kv = 2;
    ri.dims.head_dim = 64;
    ri.dims.scale = 1.0f / std::sqrt(64.0f);
    ri.dtype = DType::kBF16;
    ri.q = q.data();
    ri.k = k.data();
    ri.v = v.data();
    const ReferenceForwardResult ref = ReferenceForward(*layout, ri);
    const ReferenceForwardResult naive = NaiveForward(*layout, ri);
    std::vector<double> got(out.size());
    for (size_t i = 0; i < out.size(); ++i) got[i] = LoadAsFloat(DType::kBF16, out.data(), i);
    ExpectWithinRule("cuDNN out", MaxAbsError(got, ref.out), MaxAbsError(naive.out, ref.out),
                     MaxAbs(ref.out), DType::kBF16, kCudaKernelFloor);
  }
}

// On a GPU: cuDNN's backward on a packed row (uneven documents, one of a single token; MHA
// and GQA, causal and full) against the fp64 reference under the tests' rule.
TEST(CudnnAttentionCudaTest, BackwardOnPackedRowMatchesReference) {
  if (absl::Status s = cuda::CheckCudaDevice(); !s.ok()) GTEST_SKIP() << s.message();
  const std::vector<int64_t> lengths = {37, 1, 200, 64, 130};
  int64_t T = 0;
  for (int64_t l : lengths) T += l;
  for (int hkv : {4, 2}) {
    for (bool causal : {true, false}) {
      SCOPED_TRACE(absl::StrCat(causal ? "causal" : "full", " hkv=", hkv));
      const int hq = 4, d = 64;
      CudnnAttentionShape shape = Shape(lengths, hq, hkv, d, causal);
      std::vector<uint16_t> q(T * hq * d), k(T * hkv * d), v(T * hkv * d), dout(T * hq * d);
      std::vector<uint16_t> dq(q.size()), dk(k.size()), dv(v.size());
      std::mt19937 rng(5);
      std::normal_distribution<float> n(0.0f, 1.0f);
      for (auto* t : {&q, &k, &v, &dout}) {
        for (size_t i = 0; i < t->size(); ++i) StoreFromFloat(DType::kBF16, t->data(), i, n(rng));
      }
      absl::StatusOr<CudnnBackwardRun> run = RunCudnnBackward(
          shape, q.data(), k.data(), v.data(), dout.data(), 1, 2, dq.data(), dk.data(), dv.data());
      if (!run.ok() && run.status().code() == absl::StatusCode::kUnimplemented &&
          (absl::StrContains(run.status().message(), "libcudnn.so.9 not found") ||
           absl::StrContains(run.status().message(), "built without"))) {
        GTEST_SKIP() << run.status().message();
      }
      ASSERT_TRUE(run.ok()) << run.status();
      EXPECT_GT(run->backward_ms, 0.0);
      std::vector<int64_t> cu{0};
      for (int64_t l : lengths) cu.push_back(cu.back() + l);
      std::vector<MaskKind> kinds(lengths.size(), causal ? MaskKind::kCausal : MaskKind::kFull);
      absl::StatusOr<Layout> layout = Layout::FromDocuments(cu, kinds);
      ASSERT_TRUE(layout.ok());
      ReferenceInputs ri;
      ri.dims.heads_q = hq;
      ri.dims.heads_kv = hkv;
      ri.dims.head_dim = d;
      ri.dims.scale = 1.0f / std::sqrt(static_cast<float>(d));
      ri.dtype = DType::kBF16;
      ri.q = q.data();
      ri.k = k.data();
      ri.v = v.data();
      const ReferenceGradients ref = ReferenceBackward(*layout, ri, dout.data());
      const ReferenceGradients naive = NaiveBackward(*layout, ri, dout.data());
      for (const auto& [name, got_bf16, want, naive_grad] :
           {std::tuple<const char*, const std::vector<uint16_t>*, const std::vector<double>*,
                       const std::vector<double>*>{"cuDNN dq", &dq, &ref.dq, &naive.dq},
            {"cuDNN dk", &dk, &ref.dk, &naive.dk},
            {"cuDNN dv", &dv, &ref.dv, &naive.dv}}) {
        std::vector<double> got(got_bf16->size());
        for (size_t i = 0; i < got.size(); ++i) {
          got[i] = LoadAsFloat(DType::kBF16, got_bf16->data(), i);
        }
        ExpectWithinRule(name, MaxAbsError(got, *want), MaxAbsError(*naive_grad, *want),
                         MaxAbs(*want), DType::kBF16, kCudaKernelFloor);
      }
    }
  }
}

}  // namespace
}  // namespace hsap::bench
