#include "lib/sched/schedule.h"

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "attention/kernel.h"
#include "gtest/gtest.h"
#include "lib/sched/partition.h"
#include "tests/support/random_layouts.h"

namespace hsap {
namespace {

using ::hsap::testing::DocMix;
using ::hsap::testing::RandomLayout;
using ::hsap::testing::RandomSliceLayout;

// Global position of buffer row `row` of a buffer laid out by `runs`.
int64_t GlobalOf(const std::vector<TokenRun>& runs, int64_t row) {
  for (const TokenRun& r : runs) {
    if (row >= r.local_begin && row < r.local_begin + r.length) {
      return r.global_begin + (row - r.local_begin);
    }
  }
  ADD_FAILURE() << "row " << row << " is in no run";
  return -1;
}

// Adds 1 to hits[q * T + k] for every (query, key) pair the work list computes.
void CountPairs(const WorkList& work, const std::vector<TokenRun>& q_runs,
                const std::vector<TokenRun>& k_runs, int64_t T, std::vector<int>& hits) {
  int64_t listed = 0;
  for (const QueryBlock& b : work.blocks) {
    for (int64_t qr = b.q_begin; qr < b.q_end; ++qr) {
      const int64_t q = GlobalOf(q_runs, qr);
      for (int64_t s = b.seg_begin; s < b.seg_end; ++s) {
        const KeySegment& seg = work.segments[s];
        for (int64_t kr = seg.k_begin; kr < seg.k_end; ++kr) {
          if (kr - qr < seg.diag_lo || kr - qr > seg.diag_hi) continue;
          ++hits[q * T + GlobalOf(k_runs, kr)];
          ++listed;
        }
      }
    }
  }
  EXPECT_EQ(listed, work.visible_pairs);
}

struct Built {
  Partition partition;
  std::vector<Schedule> schedules;
};

Built BuildAll(const Layout& layout, int R, const std::vector<double>& weights) {
  absl::StatusOr<Partition> p = Partition::Create(layout, R, weights);
  EXPECT_TRUE(p.ok()) << p.status();
  Built b{*p, {}};
  for (int r = 0; r < R; ++r) {
    absl::StatusOr<Schedule> s = BuildSchedule(layout, b.partition, r, kKernelBlockQ);
    EXPECT_TRUE(s.ok()) << s.status();
    b.schedules.push_back(*std::move(s));
  }
  return b;
}

// The invariants of schedule.h, checked by brute force over Layout::Visible.
void CheckSchedules(const Layout& layout, const Built& b) {
  const int64_t T = layout.num_tokens();
  const int R = b.partition.num_ranks();
  std::vector<char> visible(T * T);
  for (int64_t q = 0; q < T; ++q) {
    for (int64_t k = 0; k < T; ++k) visible[q * T + k] = layout.Visible(q, k);
  }
  std::vector<int> owner(T);
  for (const Placement& pl : b.partition.placements()) {
    for (int64_t i = pl.begin; i < pl.end; ++i) owner[i] = pl.rank;
  }

  // Every visible pair is computed exactly once, and no other pair.
  std::vector<int> hits(T * T, 0);
  for (const Schedule& s : b.schedules) {
    CountPairs(s.local_work, s.local_runs, s.local_runs, T, hits);
    for (const Stage& st : s.stages) {
      if (st.recv_from >= 0) CountPairs(st.recv_work, s.local_runs, st.recv_runs, T, hits);
    }
  }
  for (int64_t q = 0; q < T; ++q) {
    for (int64_t k = 0; k < T; ++k) {
      ASSERT_EQ(hits[q * T + k], visible[q * T + k] ? 1 : 0) << "pair (" << q << ", " << k << ")";
    }
  }

  for (int r = 0; r < R; ++r) {
    const Schedule& s = b.schedules[r];
    // The rows r needs from others, by brute force.
    std::vector<char> needed(T, 0);
    for (int64_t q = 0; q < T; ++q) {
      if (owner[q] != r) continue;
      for (int64_t k = 0; k < T; ++k) {
        if (owner[k] != r && visible[q * T + k]) needed[k] = 1;
      }
    }
    // Each arrives exactly once, from its owner, and nothing else arrives.
    std::vector<int> arrived(T, 0);
    int prev_step = 0;
    for (const Stage& st : s.stages) {
      EXPECT_GT(st.step, prev_step) << "stages in increasing order";
      prev_step = st.step;
      EXPECT_TRUE(st.recv_from >= 0 || st.send_to >= 0) << "empty stage listed";
      if (st.recv_from >= 0) {
        EXPECT_EQ(st.recv_from, (r - st.step + R) % R);
        int64_t rows = 0;
        for (const TokenRun& run : st.recv_runs) {
          EXPECT_EQ(run.local_begin, rows);
          rows += run.length;
          for (int64_t i = 0; i < run.length; ++i) {
            EXPECT_EQ(owner[run.global_begin + i], st.recv_from);
            ++arrived[run.global_begin + i];
          }
        }
        EXPECT_EQ(rows, st.recv_rows);
        EXPECT_GT(rows, 0);
      }
      if (st.send_to >= 0) EXPECT_EQ(st.send_to, (r + st.step) % R);
    }
    for (int64_t k = 0; k < T; ++k) {
      ASSERT_EQ(arrived[k], needed[k] ? 1 : 0) << "rank " << r << " key row " << k;
    }
    // Stage agreement: every send matches the peer's receive at the same step, row for row.
    for (const Stage& st : s.stages) {
      if (st.send_to < 0) continue;
      const Schedule& peer = b.schedules[st.send_to];
      const Stage* match = nullptr;
      for (const Stage& ps : peer.stages) {
        if (ps.step == st.step) match = &ps;
      }
      ASSERT_NE(match, nullptr) << "rank " << st.send_to << " lacks step " << st.step;
      EXPECT_EQ(match->recv_from, r);
      ASSERT_EQ(match->recv_runs.size(), st.send_runs.size());
      for (size_t i = 0; i < st.send_runs.size(); ++i) {
        EXPECT_EQ(match->recv_runs[i].global_begin, st.send_runs[i].global_begin);
        EXPECT_EQ(match->recv_runs[i].length, st.send_runs[i].length);
        // The local rows packed by the sender hold exactly those positions.
        for (int64_t j = 0; j < st.send_runs[i].length; ++j) {
          EXPECT_EQ(GlobalOf(s.local_runs, st.send_runs[i].local_begin + j),
                    st.send_runs[i].global_begin + j);
        }
      }
      EXPECT_EQ(match->recv_rows, st.send_rows);
    }
    // ...and every receive has its sender.
    for (const Stage& st : s.stages) {
      if (st.recv_from < 0) continue;
      bool found = false;
      for (const Stage& ps : b.schedules[st.recv_from].stages) {
        found |= ps.step == st.step && ps.send_to == r;
      }
      EXPECT_TRUE(found) << "rank " << r << " step " << st.step;
    }
  }
}

TEST(ScheduleTest, RandomDocumentLayouts) {
  int cases = 0;
  for (DocMix mix :
       {DocMix::kLongTail, DocMix::kUniform, DocMix::kTiny, DocMix::kOneHuge, DocMix::kSingle}) {
    for (int R : {1, 2, 3, 4, 5, 8}) {
      const uint64_t seed = 100 + R;
      const Layout layout = RandomLayout(260, mix, seed, /*causal_only=*/false);
      std::vector<double> weights;
      if (R == 4) weights = {3, 1, 1, 3};
      if (R == 3) weights = {1, 2, 1};
      SCOPED_TRACE(::testing::Message() << testing::DocMixName(mix) << " R " << R);
      CheckSchedules(layout, BuildAll(layout, R, weights));
      ++cases;
    }
  }
  EXPECT_EQ(cases, 30);
}

TEST(ScheduleTest, SliceLayouts) {
  for (int R : {2, 3, 5}) {
    const Layout layout = RandomSliceLayout(300, 40 + R);
    SCOPED_TRACE(::testing::Message() << "R " << R);
    CheckSchedules(layout, BuildAll(layout, R, {}));
  }
}

TEST(ScheduleTest, DenseCausalRowIsRingOrderedAndSkipsNothingNeeded) {
  // One causal document over 4 ranks in zigzag: every rank holds early and late tokens,
  // so every rank needs keys of every other rank: all three steps are used by all.
  absl::StatusOr<Layout> layout = Layout::FromDocuments(std::vector<int64_t>{0, 400});
  ASSERT_TRUE(layout.ok());
  Built b = BuildAll(*layout, 4, {});
  CheckSchedules(*layout, b);
  for (const Schedule& s : b.schedules) {
    ASSERT_EQ(s.stages.size(), 3u);
    for (const Stage& st : s.stages) {
      EXPECT_GE(st.recv_from, 0);
      EXPECT_GE(st.send_to, 0);
    }
  }
}

TEST(ScheduleTest, LocalDocumentsMoveNothing) {
  // Eight equal causal documents on four ranks: each rank holds two whole documents.
  std::vector<int64_t> cu;
  for (int i = 0; i <= 8; ++i) cu.push_back(50 * i);
  absl::StatusOr<Layout> layout = Layout::FromDocuments(cu);
  ASSERT_TRUE(layout.ok());
  Built b = BuildAll(*layout, 4, {});
  CheckSchedules(*layout, b);
  for (const Schedule& s : b.schedules) {
    EXPECT_TRUE(s.stages.empty()) << "rank " << s.rank;
    EXPECT_EQ(s.rows_received(), 0);
    EXPECT_EQ(s.rows_sent(), 0);
  }
}

TEST(ScheduleTest, RejectsRankOutOfRange) {
  absl::StatusOr<Layout> layout = Layout::FromDocuments(std::vector<int64_t>{0, 10});
  absl::StatusOr<Partition> p = Partition::Create(*layout, 2);
  ASSERT_TRUE(p.ok());
  EXPECT_FALSE(BuildSchedule(*layout, *p, 2, kKernelBlockQ).ok());
  EXPECT_FALSE(BuildSchedule(*layout, *p, -1, kKernelBlockQ).ok());
}

}  // namespace
}  // namespace hsap
