#include "lib/comm/topology.h"

#include <vector>

#include "gtest/gtest.h"
#include "lib/comm/communicator.h"

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

}  // namespace
}  // namespace hsap
