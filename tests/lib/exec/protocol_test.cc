#include "lib/exec/protocol.h"

#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "lib/exec/staged.h"

namespace hsap {
namespace {

using protocol::PlanPayload;

TEST(Protocol, TagFieldsNeverCollide) {
  std::set<uint64_t> tags;
  for (uint64_t call : {uint64_t{0}, uint64_t{1}, protocol::kCallMask}) {
    for (int step : {0, 1, (1 << 20) - 1}) {
      for (uint64_t p = 1; p <= 4; ++p) {
        const uint64_t t = protocol::RingTag(call, static_cast<protocol::Payload>(p), step);
        EXPECT_EQ(t & (kCollectiveTagBit | protocol::kPlanBit), 0u);
        EXPECT_TRUE(tags.insert(t).second);
      }
      for (uint64_t p = 1; p <= static_cast<uint64_t>(PlanPayload::kKvStoreGrad); ++p) {
        const uint64_t t =
            protocol::PlanTag(call, protocol::PlanMessage(static_cast<PlanPayload>(p), step));
        EXPECT_NE(t & protocol::kPlanBit, 0u);
        EXPECT_EQ(t & kCollectiveTagBit, 0u);
        EXPECT_TRUE(tags.insert(t).second);
      }
    }
  }
  // The call id wraps at 37 bits instead of spilling into the plan bit.
  EXPECT_EQ(protocol::RingTag(protocol::kCallMask + 1, protocol::Payload::kKey, 3),
            protocol::RingTag(0, protocol::Payload::kKey, 3));
}

TEST(Protocol, BackwardPostingOrderInterleavesGradientsOneStepLate) {
  auto names = [](const std::vector<protocol::BackwardGroup>& order,
                  const std::vector<int>& steps) {
    std::vector<std::string> out;
    for (const auto& g : order) out.push_back(absl::StrCat(g.is_grad ? "g" : "kv", steps[g.index]));
    return out;
  };
  const std::vector<int> steps = {1, 2, 3};
  EXPECT_THAT(names(protocol::BackwardPostingOrder(steps), steps),
              ::testing::ElementsAre("kv1", "kv2", "g1", "kv3", "g2", "g3"));
  const std::vector<int> gaps = {1, 5};  // a rank with stages at steps 1 and 5 only
  EXPECT_THAT(names(protocol::BackwardPostingOrder(gaps), gaps),
              ::testing::ElementsAre("kv1", "g1", "kv5", "g5"));
}

// A pending group that records when it is waited for.
class RecordedPending : public Transport::Pending {
 public:
  RecordedPending(std::vector<std::string>& log, std::string name)
      : log_(log), name_(std::move(name)) {}
  absl::Status Wait() override {
    log_.push_back("wait " + name_);
    return absl::OkStatus();
  }

 private:
  std::vector<std::string>& log_;
  std::string name_;
};

TEST(RunBackwardStages, PostsComputesAndAddsInProtocolOrder) {
  std::vector<std::string> log;
  BackwardStages hooks;
  hooks.post_kv = [&](size_t i) -> absl::StatusOr<std::unique_ptr<Transport::Pending>> {
    log.push_back(absl::StrCat("post kv", i));
    return std::make_unique<RecordedPending>(log, absl::StrCat("kv", i));
  };
  hooks.local = [&] {
    log.push_back("local");
    return absl::OkStatus();
  };
  hooks.compute = [&](size_t i) {
    log.push_back(absl::StrCat("compute", i));
    return absl::OkStatus();
  };
  hooks.post_grad = [&](size_t i) -> absl::StatusOr<std::unique_ptr<Transport::Pending>> {
    log.push_back(absl::StrCat("post g", i));
    return std::make_unique<RecordedPending>(log, absl::StrCat("g", i));
  };
  hooks.add_returned = [&](size_t i) {
    log.push_back(absl::StrCat("add", i));
    return absl::OkStatus();
  };
  ASSERT_TRUE(RunBackwardStages(std::vector<int>{1, 2, 3}, hooks).ok());
  EXPECT_THAT(log, ::testing::ElementsAre("post kv0", "local", "post kv1", "wait kv0", "compute0",
                                          "post g0", "post kv2", "wait kv1", "compute1", "post g1",
                                          "wait g0", "add0", "wait kv2", "compute2", "post g2",
                                          "wait g1", "add1", "wait g2", "add2"));
  log.clear();
  ASSERT_TRUE(RunBackwardStages({}, hooks).ok());
  EXPECT_THAT(log, ::testing::ElementsAre("local"));
}

TEST(RunBackwardStages, StopsAtTheFirstError) {
  int computed = 0;
  BackwardStages hooks;
  hooks.post_kv = [&](size_t) -> absl::StatusOr<std::unique_ptr<Transport::Pending>> {
    return absl::DeadlineExceededError("peer silent");
  };
  hooks.local = [] { return absl::OkStatus(); };
  hooks.compute = [&](size_t) {
    ++computed;
    return absl::OkStatus();
  };
  hooks.post_grad = hooks.post_kv;
  hooks.add_returned = [](size_t) { return absl::OkStatus(); };
  EXPECT_EQ(RunBackwardStages(std::vector<int>{1, 2}, hooks).code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(computed, 0);
}

}  // namespace
}  // namespace hsap
