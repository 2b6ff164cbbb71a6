// Topology-aware K/V delivery (lib/sched/schedule.h relays) on the host backend, with the
// nodes described by hsapCommConfig_t::rankNodes: results exact against the fp64
// reference and bitwise reproducible; inter-node bytes (hsapBatchGetLinkTraffic, counted
// from the messages) equal a node-level lower bound recomputed here by brute force; one
// node gives exactly the direct schedule.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "attention/kernel.h"
#include "gtest/gtest.h"
#include "hsap/hsap.h"
#include "lib/sched/partition.h"
#include "lib/sched/schedule.h"
#include "tests/support/distributed_harness.h"
#include "tests/support/random_layouts.h"

namespace hsap {
namespace {

using ::hsap::testing::CheckAgainstReference;
using ::hsap::testing::DistCase;
using ::hsap::testing::DocMix;
using ::hsap::testing::RandomLayout;
using ::hsap::testing::RowInputs;
using ::hsap::testing::RowOutputs;

DistCase Case(int ranks, std::vector<int> rank_nodes, DType dtype) {
  DistCase c;
  c.ranks = ranks;
  c.rank_nodes = std::move(rank_nodes);
  c.dtype = dtype;
  c.heads_q = 2;
  c.heads_kv = 1;
  c.head_dim = 32;
  return c;
}

// A random node of each rank: 2..ranks nodes with arbitrary, non-contiguous numbers.
std::vector<int> RandomNodes(int ranks, std::mt19937_64& rng) {
  const int nodes = 2 + static_cast<int>(rng() % (ranks - 1));
  std::vector<int> out(ranks);
  for (int r = 0; r < ranks; ++r) out[r] = 3 * static_cast<int>(rng() % nodes) + 1;
  return out;
}

// Rows that must cross into some node: for each node, the K/V rows its ranks' queries see
// that a rank of another node owns, each counted once per node (`per_node`); and the same
// counted once per needing rank, what direct delivery moves across nodes (`per_rank`).
struct ForeignRows {
  uint64_t per_node = 0, per_rank = 0;
};
ForeignRows NeededForeignRows(const Layout& layout, const RowOutputs& got, const DistCase& c) {
  const int64_t T = layout.num_tokens();
  std::vector<int> owner(T, -1);
  for (int r = 0; r < c.ranks; ++r) {
    for (size_t i = 0; i + 1 < got.ranges[r].size(); i += 2) {
      for (int64_t t = got.ranges[r][i]; t < got.ranges[r][i + 1]; ++t) owner[t] = r;
    }
  }
  std::set<std::pair<int, int64_t>> entering_node, entering_rank;  // (node or rank, row)
  for (int64_t q = 0; q < T; ++q) {
    const int node = c.rank_nodes[owner[q]];
    for (int64_t k = 0; k < T; ++k) {
      if (c.rank_nodes[owner[k]] != node && layout.Visible(q, k)) {
        entering_node.insert({node, k});
        entering_rank.insert({owner[q], k});
      }
    }
  }
  return {entering_node.size(), entering_rank.size()};
}

RowOutputs RunCase(const Layout& layout, const DistCase& c, uint64_t seed) {
  hsapLayout_t handle = testing::ToCLayout(layout);
  RowInputs in(c, layout.num_tokens(), seed);
  RowOutputs got = testing::RunDistributed(handle, c, in);
  hsapLayoutDestroy(handle);
  return got;
}

void ExpectInterNodeIsTheLowerBound(const Layout& layout, const DistCase& c,
                                    const RowOutputs& got) {
  const uint64_t rows = NeededForeignRows(layout, got, c).per_node;
  const uint64_t kv = 2ull * c.heads_kv * c.head_dim * DTypeSize(c.dtype);
  const uint64_t grad = 2ull * c.heads_kv * c.head_dim * sizeof(float);
  uint64_t fwd_sent = 0, fwd_recv = 0, bwd_sent = 0, bwd_recv = 0;
  for (int r = 0; r < c.ranks; ++r) {
    const hsapLinkTraffic_t& t = got.link_traffic[r];
    const hsapTraffic_t& all = got.traffic[r];
    SCOPED_TRACE(::testing::Message() << "rank " << r);
    // The link classes split the same messages hsapBatchGetTraffic counts.
    EXPECT_EQ(t.forwardIntraNodeBytesSent + t.forwardInterNodeBytesSent, all.forwardBytesSent);
    EXPECT_EQ(t.forwardIntraNodeBytesReceived + t.forwardInterNodeBytesReceived,
              all.forwardBytesReceived);
    EXPECT_EQ(t.backwardIntraNodeBytesSent + t.backwardInterNodeBytesSent, all.backwardBytesSent);
    EXPECT_EQ(t.backwardIntraNodeBytesReceived + t.backwardInterNodeBytesReceived,
              all.backwardBytesReceived);
    fwd_sent += t.forwardInterNodeBytesSent;
    fwd_recv += t.forwardInterNodeBytesReceived;
    bwd_sent += t.backwardInterNodeBytesSent;
    bwd_recv += t.backwardInterNodeBytesReceived;
  }
  EXPECT_EQ(fwd_sent, fwd_recv);
  EXPECT_EQ(bwd_sent, bwd_recv);
  EXPECT_EQ(fwd_recv, rows * kv);
  // Backward: the K/V once more, and their fp32 partials back across once.
  EXPECT_EQ(bwd_recv, rows * (kv + grad));
}

TEST(TopologyTest, RelayedDeliveryIsExactReproducibleAndCrossesEachNodeOnce) {
  std::mt19937_64 rng(2026);
  const DocMix mixes[] = {DocMix::kLongTail, DocMix::kOneHuge, DocMix::kSingle, DocMix::kUniform};
  const DType dtypes[] = {DType::kF32, DType::kBF16};
  int relayed_cases = 0;
  for (int i = 0; i < 8; ++i) {
    const int ranks = 3 + static_cast<int>(rng() % 4);
    const DistCase c = Case(ranks, RandomNodes(ranks, rng), dtypes[i % 2]);
    const Layout layout = RandomLayout(300 + 40 * i, mixes[i % 4], 500 + i, i % 3 == 0);
    SCOPED_TRACE(::testing::Message() << "case " << i << ": " << ranks << " ranks, nodes "
                                      << ::testing::PrintToString(c.rank_nodes));
    RowOutputs a = CheckAgainstReference(layout, c, 11 + i);
    ASSERT_TRUE(a.ok());
    ExpectInterNodeIsTheLowerBound(layout, c, a);
    RowOutputs b = RunCase(layout, c, 11 + i);
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(a.out.bytes, b.out.bytes);
    EXPECT_EQ(a.lse, b.lse);
    EXPECT_EQ(a.dq.bytes, b.dq.bytes);
    EXPECT_EQ(a.dk.bytes, b.dk.bytes);
    EXPECT_EQ(a.dv.bytes, b.dv.bytes);
    // Direct delivery sends a row once per needing rank across nodes; here once per node.
    const ForeignRows foreign = NeededForeignRows(layout, a, c);
    EXPECT_LE(foreign.per_node, foreign.per_rank);
    if (foreign.per_node < foreign.per_rank) ++relayed_cases;
    // The same bytes in all as direct delivery (a relayed row moves once per needing rank,
    // some hops inside the node): the outputs of a run without rankNodes agree.
    DistCase direct = c;
    direct.rank_nodes.clear();
    RowOutputs d = RunCase(layout, direct, 11 + i);
    ASSERT_TRUE(d.ok());
    uint64_t direct_bytes = 0, relayed_bytes = 0;
    for (int r = 0; r < ranks; ++r) {
      direct_bytes += d.traffic[r].forwardBytesReceived;
      relayed_bytes += a.traffic[r].forwardBytesReceived;
    }
    EXPECT_GE(relayed_bytes, direct_bytes);
  }
  EXPECT_GT(relayed_cases, 0) << "no case relayed anything; the test proves nothing";
}

TEST(TopologyTest, OneNodeGivesExactlyTheDirectSchedule) {
  for (int i = 0; i < 4; ++i) {
    const Layout layout =
        RandomLayout(500, i % 2 ? DocMix::kLongTail : DocMix::kOneHuge, 70 + i, false);
    const int R = 3 + i;
    absl::StatusOr<Partition> partition = Partition::Create(layout, R, {});
    ASSERT_TRUE(partition.ok());
    const std::vector<int> one_node(R, 7);
    for (int r = 0; r < R; ++r) {
      absl::StatusOr<Schedule> direct = BuildSchedule(layout, *partition, r, kKernelBlockQ);
      absl::StatusOr<Schedule> topo = BuildSchedule(layout, *partition, r, kKernelBlockQ, one_node);
      ASSERT_TRUE(direct.ok() && topo.ok());
      ASSERT_EQ(direct->stages.size(), topo->stages.size());
      EXPECT_EQ(topo->store_rows, 0);
      for (size_t s = 0; s < direct->stages.size(); ++s) {
        const Stage& a = direct->stages[s];
        const Stage& b = topo->stages[s];
        EXPECT_EQ(a.step, b.step);
        EXPECT_EQ(a.recv_from, b.recv_from);
        EXPECT_EQ(a.recv_runs, b.recv_runs);
        EXPECT_EQ(a.send_to, b.send_to);
        EXPECT_EQ(a.send_runs, b.send_runs);
        EXPECT_EQ(b.store_begin, -1);
        EXPECT_FALSE(b.send_from_store || b.send_grads_deferred);
      }
    }
  }
  // Through the C ABI: the same bytes as without rankNodes, all intra-node.
  const Layout layout = RandomLayout(400, DocMix::kLongTail, 9, false);
  RowOutputs with = RunCase(layout, Case(4, {2, 2, 2, 2}, DType::kBF16), 3);
  RowOutputs without = RunCase(layout, Case(4, {}, DType::kBF16), 3);
  ASSERT_TRUE(with.ok() && without.ok());
  EXPECT_EQ(with.out.bytes, without.out.bytes);
  EXPECT_EQ(with.dk.bytes, without.dk.bytes);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(with.traffic[r].forwardBytesReceived, without.traffic[r].forwardBytesReceived);
    EXPECT_EQ(with.traffic[r].backwardBytesSent, without.traffic[r].backwardBytesSent);
    EXPECT_EQ(with.link_traffic[r].forwardIntraNodeBytesReceived,
              with.traffic[r].forwardBytesReceived);
    EXPECT_EQ(with.link_traffic[r].backwardIntraNodeBytesSent, with.traffic[r].backwardBytesSent);
    EXPECT_EQ(with.link_traffic[r].forwardInterNodeBytesSent, 0u);
    EXPECT_EQ(without.link_traffic[r].forwardIntraNodeBytesSent,
              without.traffic[r].forwardBytesSent);
  }
}

TEST(TopologyTest, OneLongDocumentOnTwoNodesRelaysEveryRowOnce) {
  // A full (non-causal) document over 4 ranks on 2 nodes: every rank needs every row, so
  // each row enters the other node once instead of twice.
  absl::StatusOr<Layout> layout =
      Layout::FromDocuments(std::vector<int64_t>{0, 256}, std::vector<MaskKind>{MaskKind::kFull});
  ASSERT_TRUE(layout.ok());
  const DistCase c = Case(4, {0, 0, 1, 1}, DType::kF32);
  RowOutputs got = CheckAgainstReference(*layout, c, 5);
  ASSERT_TRUE(got.ok());
  ExpectInterNodeIsTheLowerBound(*layout, c, got);
  uint64_t inter = 0;
  for (const hsapLinkTraffic_t& t : got.link_traffic) inter += t.forwardInterNodeBytesReceived;
  const uint64_t kv = 2ull * c.heads_kv * c.head_dim * sizeof(float);
  EXPECT_EQ(inter, 256u * kv);  // 128 rows of each node enter the other once
}

TEST(TopologyCApiTest, RankNodesAreValidated) {
  hsapComm_t comms[3] = {};
  hsapCommConfig_t config = HSAP_COMM_CONFIG_INITIALIZER;
  const int bad[3] = {0, 1, -2};
  config.rankNodes = bad;
  EXPECT_EQ(hsapCommInitAll(comms, 3, &config), hsapInvalidArgument);
  EXPECT_NE(std::string(hsapGetLastError()).find("rankNodes[2] = -2"), std::string::npos)
      << hsapGetLastError();
  const int good[3] = {4, 0, 4};
  config.rankNodes = good;
  ASSERT_EQ(hsapCommInitAll(comms, 3, &config), hsapSuccess) << hsapGetLastError();
  for (hsapComm_t comm : comms) EXPECT_EQ(hsapCommDestroy(comm), hsapSuccess);
  // A caller built against the struct without rankNodes: not read.
  config.size = offsetof(hsapCommConfig_t, rankNodes);
  config.rankNodes = bad;
  ASSERT_EQ(hsapCommInitAll(comms, 3, &config), hsapSuccess) << hsapGetLastError();
  for (hsapComm_t comm : comms) EXPECT_EQ(hsapCommDestroy(comm), hsapSuccess);
}

TEST(TopologyCApiTest, GetLinkTrafficChecksItsArguments) {
  hsapLinkTraffic_t t;
  EXPECT_EQ(hsapBatchGetLinkTraffic(nullptr, &t), hsapInvalidArgument);
}

}  // namespace
}  // namespace hsap
