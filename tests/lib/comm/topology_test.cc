#include "lib/comm/topology.h"

#include <thread>
#include <vector>

#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "lib/comm/communicator.h"
#include "lib/comm/host_transport.h"
#include "tests/support/scoped_env.h"

namespace hsap {
namespace {

TEST(TopologyTest, NodesOfRanksAndRanksOfNodes) {
  absl::StatusOr<Topology> t = Topology::FromRankNodes(std::vector<int>{3, 0, 3, 7});
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->num_ranks(), 4);
  EXPECT_FALSE(t->single_node());
  EXPECT_TRUE(t->SameNode(0, 2));
  EXPECT_FALSE(t->SameNode(0, 1));
  EXPECT_EQ(t->node_of(3), 7);
  EXPECT_EQ(t->RanksOf(3), (std::vector<int>{0, 2}));
  EXPECT_TRUE(t->RanksOf(5).empty());
  EXPECT_TRUE(Topology::SingleNode(5).single_node());
  EXPECT_TRUE(Topology::FromRankNodes(std::vector<int>{2, 2})->single_node());
}

TEST(TopologyTest, RejectsNegativeNodesNamingTheEntry) {
  absl::StatusOr<Topology> t = Topology::FromRankNodes(std::vector<int>{0, 1, -1});
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("rankNodes[2] = -1"), absl::string_view::npos) << t.status();
}

TEST(TopologyTest, CommunicatorsCarryTheirTopology) {
  CommOptions options;
  options.rank_nodes = {0, 0, 1};
  auto comms = Communicator::CreateHostWorld(3, options);
  ASSERT_TRUE(comms.ok()) << comms.status();
  for (const auto& c : *comms) {
    EXPECT_EQ(c->topology().node_of_rank(), options.rank_nodes);
  }
  options.rank_nodes = {0, 1};
  EXPECT_EQ(Communicator::CreateHostWorld(3, options).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto plain = Communicator::CreateHostWorld(2, CommOptions{});
  ASSERT_TRUE(plain.ok());
  EXPECT_TRUE((*plain)[0]->topology().single_node());
}

// ---- Node discovery (CUDA communicators): host hashes, all-gathered --------------------

TEST(HostHashTest, HostnameAndBootIdBothCount) {
  const uint64_t a = HostHash("gpu-node-1", "3f1c0d2e-aaaa");
  EXPECT_EQ(a, HostHash("gpu-node-1", "3f1c0d2e-aaaa"));
  EXPECT_NE(a, HostHash("gpu-node-2", "3f1c0d2e-aaaa"));
  // Cloned hosts with one name differ by boot id.
  EXPECT_NE(a, HostHash("gpu-node-1", "3f1c0d2e-bbbb"));
  // A host id replaces both (as NCCL_HOSTID does for NCCL).
  EXPECT_EQ(HostHash("gpu-node-1", "x", "rack7"), HostHash("other", "y", "rack7"));
  EXPECT_NE(HostHash("gpu-node-1", "x", "rack7"), HostHash("gpu-node-1", "x", "rack8"));
  // FNV-1a of the empty string is its offset basis (the hash is the documented one).
  EXPECT_EQ(HostHash("", ""), 0xcbf29ce484222325ull);
}

TEST(HostHashTest, LocalHostHashFollowsNcclHostId) {
  testing::ScopedEnv id("NCCL_HOSTID", "node-x");
  EXPECT_EQ(LocalHostHash(), HostHash("", "", "node-x"));
  id.Set(nullptr);
  // Without it: this machine's name and boot id, stable within the boot.
  EXPECT_EQ(LocalHostHash(), LocalHostHash());
  EXPECT_NE(LocalHostHash(), HostHash("", "", "node-x"));
}

TEST(HostHashTest, NodesNumberedByFirstAppearance) {
  const Topology t = Topology::FromHostHashes(std::vector<uint64_t>{77, 5, 77, 9, 5, 5});
  EXPECT_EQ(t.node_of_rank(), (std::vector<int>{0, 1, 0, 2, 1, 1}));
  EXPECT_FALSE(t.single_node());
  EXPECT_EQ(t.RanksOf(1), (std::vector<int>{1, 4, 5}));
  EXPECT_TRUE(Topology::FromHostHashes(std::vector<uint64_t>{3, 3, 3}).single_node());
  EXPECT_EQ(Topology::FromHostHashes(std::vector<uint64_t>{3, 3}), Topology::SingleNode(2));
}

TEST(HostHashTest, DiscoveredOverTheTransportAlikeOnEveryRank) {
  const int R = 5;
  const uint64_t hashes[R] = {HostHash("b", "1"), HostHash("a", "1"), HostHash("b", "1"),
                              HostHash("a", "1"), HostHash("c", "1")};
  auto transports = CreateHostTransports(R, absl::Seconds(30));
  ASSERT_TRUE(transports.ok()) << transports.status();
  std::vector<absl::StatusOr<Topology>> got(R, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < R; ++r) {
    threads.emplace_back([&, r] { got[r] = DiscoverTopology(*(*transports)[r], hashes[r]); });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < R; ++r) {
    ASSERT_TRUE(got[r].ok()) << "rank " << r << ": " << got[r].status();
    EXPECT_EQ(got[r]->node_of_rank(), (std::vector<int>{0, 1, 0, 1, 2})) << "rank " << r;
  }
}

// rankNodes on every rank: the described topology replaces discovery; on some ranks only,
// or different ones: refused on every rank.
TEST(HostHashTest, ADescribedTopologyOverridesDiscoveryAndMustAgree) {
  const int R = 3;
  auto run = [&](std::vector<std::vector<int>> described) {
    auto transports = CreateHostTransports(R, absl::Seconds(30));
    EXPECT_TRUE(transports.ok()) << transports.status();
    std::vector<absl::StatusOr<Topology>> got(R, absl::UnknownError("not run"));
    std::vector<std::thread> threads;
    for (int r = 0; r < R; ++r) {
      threads.emplace_back([&, r] {
        got[r] = DiscoverTopology(*(*transports)[r], HostHash("one", ""), described[r]);
      });
    }
    for (std::thread& t : threads) t.join();
    return got;
  };
  for (const auto& t : run({{5, 2, 5}, {5, 2, 5}, {5, 2, 5}})) {
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(t->node_of_rank(), (std::vector<int>{5, 2, 5}));
  }
  for (const auto& t : run({{0, 1, 1}, {}, {0, 1, 1}})) {
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
    EXPECT_NE(t.status().message().find("rank 1 describes no topology"), absl::string_view::npos)
        << t.status();
  }
  for (const auto& t : run({{0, 1, 1}, {0, 1, 1}, {0, 0, 1}})) {
    EXPECT_NE(t.status().message().find("rank 2 describes a different topology"),
              absl::string_view::npos)
        << t.status();
  }
}

TEST(HostHashTest, DiscoveryTimesOutNamingTheStage) {
  auto transports = CreateHostTransports(2, absl::Milliseconds(200));
  ASSERT_TRUE(transports.ok()) << transports.status();
  // Rank 1 never joins.
  absl::StatusOr<Topology> t = DiscoverTopology(*(*transports)[0], 1, {}, "init node discovery");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kDeadlineExceeded) << t.status();
  EXPECT_NE(t.status().message().find("init node discovery"), absl::string_view::npos)
      << t.status();
}

}  // namespace
}  // namespace hsap
