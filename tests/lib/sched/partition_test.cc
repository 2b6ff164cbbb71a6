#include "lib/sched/partition.h"

#include <cstdint>
#include <numeric>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/random_layouts.h"

namespace hsap {
namespace {

using ::hsap::testing::DocMix;
using ::hsap::testing::RandomLayout;
using ::hsap::testing::RandomSliceLayout;

// Work of each rank recomputed from the mask by brute force over Layout::Visible.
std::vector<int64_t> BruteForceWork(const Layout& layout, const Partition& p) {
  std::vector<int64_t> work(p.num_ranks(), 0);
  for (int r = 0; r < p.num_ranks(); ++r) {
    for (const TokenRange& t : p.ranges(r)) {
      for (int64_t q = t.begin; q < t.end; ++q) {
        for (int64_t k = 0; k < layout.num_tokens(); ++k) work[r] += layout.Visible(q, k);
      }
    }
  }
  return work;
}

// The invariants every partition keeps: the ranks' ranges tile the row, each rank's
// ranges are increasing and disjoint, and the balance rule of partition.h holds.
// With several layouts (a partition shared by several masks), work is summed over them.
void ExpectValidAndBalanced(absl::Span<const Layout* const> layouts, const Partition& p) {
  const Layout& layout = *layouts.front();
  const int64_t T = layout.num_tokens();
  std::vector<int> owner(T, -1);
  int64_t total_local = 0;
  for (int r = 0; r < p.num_ranks(); ++r) {
    int64_t prev_end = -1, local = 0;
    for (const TokenRange& t : p.ranges(r)) {
      EXPECT_LT(t.begin, t.end) << "rank " << r;
      EXPECT_GT(t.begin, prev_end) << "rank " << r << ": ranges must be increasing, unmerged";
      prev_end = t.end;
      for (int64_t i = t.begin; i < t.end; ++i) {
        ASSERT_EQ(owner[i], -1) << "token " << i << " held twice";
        owner[i] = r;
      }
      local += t.size();
    }
    EXPECT_EQ(local, p.local_tokens(r));
    total_local += local;
  }
  EXPECT_EQ(total_local, T);
  for (int64_t i = 0; i < T; ++i) ASSERT_NE(owner[i], -1) << "token " << i << " unassigned";

  int64_t total_work = 0;
  for (const Layout* l : layouts) {
    const std::vector<int64_t> per_token = l->VisibleKeysPerQuery();
    total_work += std::accumulate(per_token.begin(), per_token.end(), int64_t{0});
  }
  double min_target = 1e300, sum_target = 0;
  for (int r = 0; r < p.num_ranks(); ++r) {
    if (p.weights()[r] == 0.0) {
      EXPECT_EQ(p.local_tokens(r), 0) << "rank " << r << " has weight 0";
      EXPECT_EQ(p.work(r), 0) << "rank " << r << " has weight 0";
      continue;
    }
    min_target = std::min(min_target, p.target(r));
    sum_target += p.target(r);
  }
  if (total_work > 0) EXPECT_NEAR(sum_target, static_cast<double>(total_work), 1e-6 * total_work);
  const double tolerance = 0.02 * min_target + 2.0 * static_cast<double>(p.max_position_work());
  for (int r = 0; r < p.num_ranks(); ++r) {
    EXPECT_LE(std::abs(static_cast<double>(p.work(r)) - p.target(r)), tolerance)
        << "rank " << r << " work " << p.work(r) << " target " << p.target(r);
  }
}

void ExpectValidAndBalanced(const Layout& layout, const Partition& p) {
  const Layout* const layouts[] = {&layout};
  ExpectValidAndBalanced(layouts, p);
}

// The masks of a hybrid model's layers over one row: causal, a sliding window (longer than
// many of the documents), full and prefix-LM, same documents.
std::vector<Layout> LayerLayouts(const Layout& row, int64_t window) {
  std::vector<int64_t> cu = {0};
  for (const Document& d : row.documents()) cu.push_back(d.end);
  const size_t n = cu.size() - 1;
  std::vector<Layout> layers;
  layers.push_back(*Layout::FromDocuments(cu, std::vector<MaskKind>(n, MaskKind::kCausal)));
  layers.push_back(*Layout::FromDocuments(cu, std::vector<MaskKind>(n, MaskKind::kSlidingWindow),
                                          std::vector<int64_t>(n, window)));
  layers.push_back(*Layout::FromDocuments(cu, std::vector<MaskKind>(n, MaskKind::kFull)));
  layers.push_back(*Layout::FromDocuments(cu, std::vector<MaskKind>(n, MaskKind::kPrefixLM),
                                          std::vector<int64_t>(n, 0)));
  return layers;
}

TEST(PartitionTest, SharedBySeveralMasksBalancesTheirSum) {
  for (DocMix mix : {DocMix::kLongTail, DocMix::kOneHuge, DocMix::kSingle}) {
    for (uint64_t seed = 1; seed <= 20; ++seed) {
      const std::vector<Layout> layers =
          LayerLayouts(RandomLayout(900, mix, seed, /*causal_only=*/true), 48);
      for (const std::vector<const Layout*>& set :
           {std::vector<const Layout*>{&layers[0], &layers[1]},
            std::vector<const Layout*>{&layers[1], &layers[1], &layers[1], &layers[0]},
            std::vector<const Layout*>{&layers[0], &layers[1], &layers[2], &layers[3]}}) {
        for (const std::vector<double>& w : {std::vector<double>{}, std::vector<double>{3, 1, 2}}) {
          const int R = w.empty() ? 4 : 3;
          SCOPED_TRACE(::testing::Message() << testing::DocMixName(mix) << " seed " << seed
                                            << " layouts " << set.size() << " ranks " << R);
          absl::StatusOr<Partition> p = Partition::Create(set, R, w);
          ASSERT_TRUE(p.ok()) << p.status();
          ExpectValidAndBalanced(set, *p);
          // Work per rank is the brute-force sum over the masks.
          if (seed == 1) {
            std::vector<int64_t> sum(R, 0);
            for (const Layout* l : set) {
              const std::vector<int64_t> brute = BruteForceWork(*l, *p);
              for (int r = 0; r < R; ++r) sum[r] += brute[r];
            }
            for (int r = 0; r < R; ++r) EXPECT_EQ(p->work(r), sum[r]) << "rank " << r;
          }
        }
      }
    }
  }
}

TEST(PartitionTest, SharedByOneMaskIsThatMasksPartition) {
  const Layout layout = RandomLayout(700, DocMix::kLongTail, 5, /*causal_only=*/false);
  const Layout* const one[] = {&layout};
  absl::StatusOr<Partition> shared = Partition::Create(one, 3, std::vector<double>{1, 2, 1});
  absl::StatusOr<Partition> own = Partition::Create(layout, 3, std::vector<double>{1, 2, 1});
  ASSERT_TRUE(shared.ok() && own.ok());
  for (int r = 0; r < 3; ++r) EXPECT_EQ(shared->ranges(r), own->ranges(r));
  EXPECT_EQ(shared->Fingerprint(), own->Fingerprint());
  absl::StatusOr<Partition> other = Partition::Create(layout, 3);
  ASSERT_TRUE(other.ok());
  EXPECT_NE(other->Fingerprint(), own->Fingerprint());
  // A slice layout among document layouts: the row is cut as one piece, still balanced.
  const Layout slices = RandomSliceLayout(700, 9);
  const Layout* const mixed[] = {&layout, &slices};
  absl::StatusOr<Partition> p = Partition::Create(mixed, 4);
  ASSERT_TRUE(p.ok()) << p.status();
  ExpectValidAndBalanced(mixed, *p);
}

TEST(PartitionTest, SharedPartitionRejectsLayoutsOfDifferentRows) {
  const Layout a = *Layout::FromDocuments(std::vector<int64_t>{0, 10, 20});
  const Layout b = *Layout::FromDocuments(std::vector<int64_t>{0, 10, 21});
  const Layout* const both[] = {&a, &b};
  absl::StatusOr<Partition> p = Partition::Create(both, 2);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(p.status().message(), ::testing::HasSubstr("layouts[1] has 21 tokens"));
  EXPECT_FALSE(Partition::Create(absl::Span<const Layout* const>(), 2).ok());
}

TEST(PartitionTest, BalancedForEqualAndUnevenWeights) {
  const std::vector<std::vector<double>> weight_sets = {
      {}, {3, 1, 1, 3}, {1, 2}, {5, 1, 1, 1, 1, 1, 1, 5}, {1, 1, 1}, {2, 0, 1, 1}, {0, 1}};
  for (DocMix mix : {DocMix::kLongTail, DocMix::kUniform, DocMix::kOneHuge, DocMix::kTiny}) {
    for (uint64_t seed = 1; seed <= 100; ++seed) {
      const Layout layout = RandomLayout(1200, mix, seed, /*causal_only=*/false);
      for (const std::vector<double>& w : weight_sets) {
        const int R = w.empty() ? 4 : static_cast<int>(w.size());
        SCOPED_TRACE(::testing::Message()
                     << testing::DocMixName(mix) << " seed " << seed << " ranks " << R);
        absl::StatusOr<Partition> p = Partition::Create(layout, R, w);
        ASSERT_TRUE(p.ok()) << p.status();
        ExpectValidAndBalanced(layout, *p);
      }
    }
  }
}

TEST(PartitionTest, WorkMatchesBruteForceVisibility) {
  const Layout layout = RandomLayout(300, DocMix::kLongTail, 11, /*causal_only=*/false);
  absl::StatusOr<Partition> p = Partition::Create(layout, 3, std::vector<double>{1, 2, 1});
  ASSERT_TRUE(p.ok()) << p.status();
  const std::vector<int64_t> brute = BruteForceWork(layout, *p);
  for (int r = 0; r < 3; ++r) EXPECT_EQ(p->work(r), brute[r]);
}

TEST(PartitionTest, CausalDocumentIsCutHeadToTail) {
  // One causal document of 1001 tokens on 4 ranks: every rank gets an early chunk and the
  // mirrored late chunk (the middle rank's two chunks meet), and holds about a quarter of
  // the tokens, since folded positions carry equal work.
  const int64_t L = 1001;
  absl::StatusOr<Layout> layout = Layout::FromDocuments(std::vector<int64_t>{0, L});
  ASSERT_TRUE(layout.ok());
  absl::StatusOr<Partition> p = Partition::Create(*layout, 4);
  ASSERT_TRUE(p.ok()) << p.status();
  ExpectValidAndBalanced(*layout, *p);
  for (int r = 0; r < 4; ++r) {
    const std::vector<TokenRange>& ranges = p->ranges(r);
    ASSERT_GE(ranges.size(), 1u);
    ASSERT_LE(ranges.size(), 2u);
    EXPECT_NEAR(static_cast<double>(p->local_tokens(r)), L / 4.0, 3.0) << "rank " << r;
    if (ranges.size() == 2) {
      // Head [a, b) pairs with tail [L - b, L - a).
      EXPECT_EQ(ranges[0].begin, L - ranges[1].end) << "rank " << r;
      EXPECT_EQ(ranges[0].end, L - ranges[1].begin) << "rank " << r;
    } else {
      // The middle piece is symmetric around the centre.
      EXPECT_EQ(ranges[0].begin, L - ranges[0].end) << "rank " << r;
    }
  }
}

TEST(PartitionTest, UnevenWeightsGiveProportionalZigzagPieces) {
  absl::StatusOr<Layout> layout = Layout::FromDocuments(std::vector<int64_t>{0, 800});
  ASSERT_TRUE(layout.ok());
  absl::StatusOr<Partition> p = Partition::Create(*layout, 4, std::vector<double>{3, 1, 1, 3});
  ASSERT_TRUE(p.ok()) << p.status();
  ExpectValidAndBalanced(*layout, *p);
  // Memory follows work inside a split causal document.
  EXPECT_NEAR(static_cast<double>(p->local_tokens(0)), 300.0, 3.0);
  EXPECT_NEAR(static_cast<double>(p->local_tokens(1)), 100.0, 3.0);
}

TEST(PartitionTest, DocumentsShorterThanRankCount) {
  absl::StatusOr<Layout> layout =
      Layout::FromDocuments(std::vector<int64_t>{0, 2, 5, 6, 9},
                            std::vector<MaskKind>{MaskKind::kCausal, MaskKind::kFull,
                                                  MaskKind::kCausal, MaskKind::kFull});
  ASSERT_TRUE(layout.ok());
  for (int R : {2, 5, 8}) {
    absl::StatusOr<Partition> p = Partition::Create(*layout, R);
    ASSERT_TRUE(p.ok()) << p.status();
    ExpectValidAndBalanced(*layout, *p);
  }
}

TEST(PartitionTest, OneTokenDocumentsStayWhole) {
  std::vector<int64_t> cu(101);
  std::iota(cu.begin(), cu.end(), 0);
  absl::StatusOr<Layout> layout = Layout::FromDocuments(cu);
  ASSERT_TRUE(layout.ok());
  absl::StatusOr<Partition> p = Partition::Create(*layout, 3);
  ASSERT_TRUE(p.ok()) << p.status();
  ExpectValidAndBalanced(*layout, *p);
  EXPECT_EQ(p->split_units(), 0);
  EXPECT_EQ(p->local_tokens(0) + p->local_tokens(1) + p->local_tokens(2), 100);
}

TEST(PartitionTest, SmallDocumentsAreNotSplit) {
  // 600 documents of 3..6 tokens: each is below 2% of a rank's target, so none is cut.
  std::vector<int64_t> cu{0};
  for (int i = 0; i < 600; ++i) cu.push_back(cu.back() + 3 + i % 4);
  absl::StatusOr<Layout> layout = Layout::FromDocuments(cu);
  ASSERT_TRUE(layout.ok());
  for (int R : {2, 3, 4}) {
    absl::StatusOr<Partition> p = Partition::Create(*layout, R, {});
    ASSERT_TRUE(p.ok());
    ExpectValidAndBalanced(*layout, *p);
    EXPECT_EQ(p->split_units(), 0) << R << " ranks";
  }
}

TEST(PartitionTest, OneDocumentCoveringTheRowNoDivisibilityRule) {
  for (MaskKind kind :
       {MaskKind::kCausal, MaskKind::kFull, MaskKind::kSlidingWindow, MaskKind::kPrefixLM}) {
    for (int64_t L : {1, 7, 997}) {
      const int64_t param = kind == MaskKind::kSlidingWindow ? std::min<int64_t>(L, 33)
                            : kind == MaskKind::kPrefixLM    ? L / 3
                                                             : 0;
      absl::StatusOr<Layout> layout = Layout::FromDocuments(
          std::vector<int64_t>{0, L}, std::vector<MaskKind>{kind}, std::vector<int64_t>{param});
      ASSERT_TRUE(layout.ok()) << layout.status();
      for (int R : {1, 2, 3, 5, 8}) {
        SCOPED_TRACE(::testing::Message()
                     << "kind " << static_cast<int>(kind) << " L " << L << " R " << R);
        absl::StatusOr<Partition> p = Partition::Create(*layout, R);
        ASSERT_TRUE(p.ok()) << p.status();
        ExpectValidAndBalanced(*layout, *p);
        if (kind == MaskKind::kFull || kind == MaskKind::kSlidingWindow) {
          for (int r = 0; r < R; ++r) EXPECT_LE(p->ranges(r).size(), 1u) << "contiguous";
        }
      }
    }
  }
}

TEST(PartitionTest, SliceLayoutsGetContiguousPieces) {
  const Layout layout = RandomSliceLayout(900, 5);
  for (int R : {1, 3, 4}) {
    absl::StatusOr<Partition> p = Partition::Create(layout, R, {});
    ASSERT_TRUE(p.ok()) << p.status();
    ExpectValidAndBalanced(layout, *p);
    for (int r = 0; r < R; ++r) EXPECT_LE(p->ranges(r).size(), 1u);
  }
}

TEST(PartitionTest, EmptyRowAndDeterminism) {
  absl::StatusOr<Layout> empty = Layout::FromDocuments(std::vector<int64_t>{0});
  ASSERT_TRUE(empty.ok());
  absl::StatusOr<Partition> p = Partition::Create(*empty, 4);
  ASSERT_TRUE(p.ok()) << p.status();
  for (int r = 0; r < 4; ++r) EXPECT_EQ(p->local_tokens(r), 0);

  const Layout layout = RandomLayout(1000, DocMix::kLongTail, 9, false);
  absl::StatusOr<Partition> a = Partition::Create(layout, 5, std::vector<double>{1, 2, 3, 4, 5});
  absl::StatusOr<Partition> b = Partition::Create(layout, 5, std::vector<double>{1, 2, 3, 4, 5});
  ASSERT_TRUE(a.ok() && b.ok());
  for (int r = 0; r < 5; ++r) EXPECT_EQ(a->ranges(r), b->ranges(r));
}

TEST(PartitionTest, RejectsBadArguments) {
  absl::StatusOr<Layout> layout = Layout::FromDocuments(std::vector<int64_t>{0, 10});
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ(Partition::Create(*layout, 0).status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<Partition> wrong_size = Partition::Create(*layout, 3, std::vector<double>{1, 2});
  EXPECT_EQ(wrong_size.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(wrong_size.status().message(), ::testing::HasSubstr("one per rank"));
  absl::StatusOr<Partition> negative = Partition::Create(*layout, 2, std::vector<double>{1, -1});
  EXPECT_THAT(negative.status().message(), ::testing::HasSubstr("weights[1]"));
  EXPECT_FALSE(Partition::Create(*layout, 2, std::vector<double>{1, std::nan("")}).ok());
  absl::StatusOr<Partition> all_zero = Partition::Create(*layout, 2, std::vector<double>{0, 0});
  EXPECT_EQ(all_zero.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(all_zero.status().message(), ::testing::HasSubstr("every weight is 0"));
}

TEST(PartitionTest, ScatterGatherRoundTrip) {
  const Layout layout = RandomLayout(500, DocMix::kUniform, 3, false);
  absl::StatusOr<Partition> p = Partition::Create(layout, 3, std::vector<double>{2, 1, 1});
  ASSERT_TRUE(p.ok());
  const size_t bpt = 6;
  std::vector<unsigned char> row(500 * bpt), back(500 * bpt, 0);
  for (size_t i = 0; i < row.size(); ++i) row[i] = static_cast<unsigned char>(i * 31 + 7);
  std::vector<std::vector<unsigned char>> shards(3);
  std::vector<void*> shard_ptrs;
  for (int r = 0; r < 3; ++r) {
    shards[r].resize(p->local_tokens(r) * bpt);
    shard_ptrs.push_back(shards[r].data());
  }
  p->Scatter(row.data(), bpt, shard_ptrs.data());
  // The first token of rank r's shard is the first token of its first range.
  for (int r = 0; r < 3; ++r) {
    if (p->ranges(r).empty()) continue;
    EXPECT_EQ(shards[r][0], row[p->ranges(r)[0].begin * bpt]);
  }
  std::vector<const void*> const_ptrs(shard_ptrs.begin(), shard_ptrs.end());
  p->Gather(const_ptrs.data(), bpt, back.data());
  EXPECT_EQ(row, back);
}

}  // namespace
}  // namespace hsap
