#include "lib/sched/plan.h"

#include <algorithm>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "hsap/hsap.h"
#include "lib/api/handles.h"
#include "lib/sched/plan_json.h"

namespace hsap {
namespace {

using ::testing::HasSubstr;

// Groups {4 ranks, 2 ranks}, 16 query heads over 4 KV heads, non-contiguous head sets.
Plan ExamplePlan() {
  Plan plan;
  plan.num_ranks = 6;
  plan.heads_q = 16;
  plan.heads_kv = 4;
  PlanGroup fast;
  fast.ranks = {0, 1, 2, 3};
  fast.sequence_weight = 0.7;
  fast.token_weights = {1, 1, 2, 0};
  fast.heads = {{0, 1, 2, 3, 4, 5, 12}, {6, 7}, {8, 9, 10, 11}, {13, 14, 15}};
  PlanGroup slow;
  slow.ranks = {5, 4};
  slow.sequence_weight = 0.3;
  slow.token_weights = {1, 3};
  slow.heads = {{0, 1, 2, 3, 4, 5, 6, 7}, {8, 9, 10, 11, 12, 13, 14, 15}};
  plan.groups = {fast, slow};
  plan.ring_order = {1, 0};
  return plan;
}

TEST(PlanTest, ValidPlanPasses) { EXPECT_TRUE(ExamplePlan().Validate().ok()); }

TEST(PlanTest, HeadOwnedTwiceNamesHeadAndGroup) {
  Plan plan = ExamplePlan();
  plan.groups[0].heads[1].push_back(12);
  const absl::Status s = plan.Validate();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("query head 12 is owned twice in group 0"));
}

TEST(PlanTest, HeadOwnedByNobodyNamesHeadAndGroup) {
  Plan plan = ExamplePlan();
  plan.groups[1].heads[1].pop_back();
  EXPECT_THAT(plan.Validate().message(), HasSubstr("query head 15 is owned by no rank of group 1"));
}

TEST(PlanTest, RankInTwoGroupsOrNoneOrOutOfRange) {
  Plan plan = ExamplePlan();
  plan.groups[1].ranks = {5, 3};
  EXPECT_THAT(plan.Validate().message(), HasSubstr("rank 3 is in two groups"));
  plan = ExamplePlan();
  plan.num_ranks = 7;
  EXPECT_THAT(plan.Validate().message(), HasSubstr("rank 6 is in no group"));
  plan = ExamplePlan();
  plan.groups[1].ranks = {5, 9};
  EXPECT_THAT(plan.Validate().message(), HasSubstr("names rank 9"));
}

TEST(PlanTest, BadWeightsAndShapes) {
  Plan plan = ExamplePlan();
  plan.groups[1].sequence_weight = 0;
  EXPECT_THAT(plan.Validate().message(), HasSubstr("group 1 has sequence weight 0"));
  plan = ExamplePlan();
  plan.groups[0].token_weights[2] = std::nan("");
  EXPECT_THAT(plan.Validate().message(), HasSubstr("token weight"));
  plan = ExamplePlan();
  plan.groups[1].token_weights = {0, 0};
  EXPECT_THAT(plan.Validate().message(), HasSubstr("all token weights zero"));
  plan = ExamplePlan();
  plan.heads_kv = 3;
  EXPECT_THAT(plan.Validate().message(), HasSubstr("multiple of heads_kv"));
  plan = ExamplePlan();
  plan.ring_order = {0, 0};
  EXPECT_THAT(plan.Validate().message(), HasSubstr("ring_order"));
  plan = ExamplePlan();
  plan.groups[0].heads[0].push_back(16);
  EXPECT_THAT(plan.Validate().message(), HasSubstr("query head 16"));
}

TEST(PlanTest, DerivedQuantities) {
  const Plan plan = ExamplePlan();
  EXPECT_EQ(plan.GroupOfRank(), (std::vector<int>{0, 0, 0, 0, 1, 1}));
  EXPECT_EQ(plan.IndexInGroup(), (std::vector<int>{0, 1, 2, 3, 1, 0}));
  const std::vector<double> shares = plan.RankShares();
  EXPECT_DOUBLE_EQ(shares[2], 0.7 * 0.5);
  EXPECT_DOUBLE_EQ(shares[3], 0.0);
  EXPECT_DOUBLE_EQ(shares[4], 0.3 * 0.75);
  EXPECT_EQ(plan.KvHeadsOf(0, 0), (std::vector<int>{0, 1, 3}));
  EXPECT_EQ(plan.KvHeadsOf(1, 1), (std::vector<int>{2, 3}));
}

TEST(PlanTest, HeadsFormatAndParse) {
  EXPECT_EQ(FormatHeads({12, 0, 1, 2, 3, 4, 5}), "0-5,12");
  EXPECT_EQ(FormatHeads({}), "");
  EXPECT_EQ(*ParseHeads("0-5,12"), (std::vector<int>{0, 1, 2, 3, 4, 5, 12}));
  EXPECT_FALSE(ParseHeads("3-1").ok());
  EXPECT_FALSE(ParseHeads("a").ok());
}

TEST(PlanTest, FingerprintFollowsTheStructureOnly) {
  const Plan plan = ExamplePlan();
  const uint64_t base = plan.Fingerprint();
  EXPECT_EQ(ExamplePlan().Fingerprint(), base);

  // Predictions and the description do not change what the ranks do.
  Plan predicted = plan;
  predicted.predicted_forward_seconds = 0.5;
  predicted.ranks.resize(6);
  predicted.ranks[2].reason = "fast";
  predicted.description = "other";
  EXPECT_EQ(predicted.Fingerprint(), base);
  // The default ring order hashes like its expansion.
  Plan in_order = plan;
  in_order.ring_order = {0, 1};
  Plan defaulted = plan;
  defaulted.ring_order.clear();
  EXPECT_EQ(in_order.Fingerprint(), defaulted.Fingerprint());

  // Every structural field counts, including where a list is cut.
  std::vector<Plan> changed(9, plan);
  changed[0].heads_q = 32;
  changed[1].heads_kv = 8;
  changed[2].groups[0].ranks = {0, 1, 3, 2};
  changed[3].groups[1].sequence_weight = 0.31;
  changed[4].groups[0].token_weights[3] = 1e-9;
  changed[5].groups[0].heads[1] = {6};
  changed[5].groups[0].heads[2].insert(changed[5].groups[0].heads[2].begin(), 7);
  changed[6].ring_order = {0, 1};
  changed[7].num_ranks = 7;
  changed[8].node_stores = false;
  for (size_t i = 0; i < changed.size(); ++i) {
    EXPECT_NE(changed[i].Fingerprint(), base) << "change " << i;
    for (size_t j = 0; j < i; ++j) {
      EXPECT_NE(changed[i].Fingerprint(), changed[j].Fingerprint()) << i << " vs " << j;
    }
  }
}

TEST(PlanTest, JsonRoundTrip) {
  Plan plan = ExamplePlan();
  plan.predicted_forward_seconds = 0.01;
  plan.predicted_backward_seconds = 0.025;
  plan.ranks.resize(6);
  plan.ranks[3].reason = "no tokens: memory";
  plan.ranks[3].memory_bytes = 1e9;
  plan.description = "test";
  auto back = PlanFromJsonText(PlanToJsonText(plan));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, plan);
  // Node stores: on unless the JSON says false.
  EXPECT_TRUE(back->node_stores);
  plan.node_stores = false;
  const std::string text = PlanToJsonText(plan);
  EXPECT_THAT(text, HasSubstr("\"node_stores\": false"));
  back = PlanFromJsonText(text);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, plan);
}

TEST(PlanTest, JsonErrorsAreClear) {
  EXPECT_THAT(PlanFromJsonText("{").status().message(), HasSubstr("not valid JSON"));
  EXPECT_THAT(PlanFromJsonText("{\"num_ranks\": 2}").status().message(),
              HasSubstr("lacks the field \"heads_q\""));
  EXPECT_THAT(PlanFromJsonText(R"({"num_ranks": 1, "heads_q": 2, "heads_kv": 1,
      "groups": [{"ranks": [0], "sequence_weight": "x", "heads": ["0-1"]}]})")
                  .status()
                  .message(),
              HasSubstr("plan.groups[0].sequence_weight must be a number"));
  EXPECT_THAT(PlanFromJsonText(R"({"num_ranks": 1, "heads_q": 2, "heads_kv": 1,
      "groups": [{"ranks": [0], "sequence_weight": 1, "heads": ["0-1"]}],
      "node_stores": 0})")
                  .status()
                  .message(),
              HasSubstr("plan.node_stores must be true or false"));
  // Array head lists and default token weights are accepted.
  auto ok = PlanFromJsonText(R"({"num_ranks": 1, "heads_q": 2, "heads_kv": 1,
      "groups": [{"ranks": [0], "sequence_weight": 1, "heads": [[1, 0]]}]})");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->groups[0].heads[0], (std::vector<int>{0, 1}));
}

// Mutations of a valid plan's JSON (bytes replaced, spans deleted or repeated, numbers and
// tokens that push limits inserted): each text is a plan that survives a round trip or an
// invalid argument with a message, never a crash, hang or other error (run under the
// sanitizers in CI).
TEST(PlanTest, JsonMutationFuzzGivesAPlanOrAClearError) {
  Plan plan = ExamplePlan();
  plan.ranks.resize(6);
  const std::string valid = PlanToJsonText(plan);
  static const char* const kTokens[] = {"{",
                                        "}",
                                        "[",
                                        "]",
                                        ",",
                                        ":",
                                        "\"",
                                        "-1",
                                        "0",
                                        "1e308",
                                        "-1e308",
                                        "nan",
                                        "1e999",
                                        "65536",
                                        "[]",
                                        "{}",
                                        "null",
                                        "true",
                                        "99999999999999999999",
                                        "\"0-65535\"",
                                        "\"\\u0000\""};
  std::mt19937_64 rng(2026);
  int parsed = 0, rejected = 0;
  for (int i = 0; i < 3000; ++i) {
    std::string text = valid;
    const int edits = 1 + static_cast<int>(rng() % 3);
    for (int e = 0; e < edits && !text.empty(); ++e) {
      const size_t at = rng() % text.size();
      const size_t len = 1 + rng() % std::min<size_t>(16, text.size() - at);
      switch (rng() % 4) {
        case 0:
          text[at] = static_cast<char>(rng() % 256);
          break;
        case 1:
          text.erase(at, len);
          break;
        case 2:
          text.insert(at, text.substr(at, len));
          break;
        default:
          text.insert(at, kTokens[rng() % std::size(kTokens)]);
      }
    }
    absl::StatusOr<Plan> got = PlanFromJsonText(text);
    if (got.ok()) {
      ++parsed;
      absl::StatusOr<Plan> again = PlanFromJsonText(PlanToJsonText(*got));
      ASSERT_TRUE(again.ok()) << again.status() << "\nmutated text:\n" << text;
      EXPECT_EQ(*again, *got) << text;
    } else {
      ++rejected;
      ASSERT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument)
          << got.status() << "\nmutated text:\n"
          << text;
      ASSERT_FALSE(got.status().message().empty()) << text;
    }
  }
  EXPECT_GT(rejected, 0);
  RecordProperty("parsed", parsed);
  RecordProperty("rejected", rejected);
}

TEST(PlanCApiTest, CreateByHandToJsonAndBack) {
  // Groups {0,1,2,3} and {5,4} as in ExamplePlan.
  const int sizes[] = {4, 2};
  const int ranks[] = {0, 1, 2, 3, 5, 4};
  const double seq[] = {0.7, 0.3};
  const double tok[] = {1, 1, 2, 0, 1, 3};
  const int counts[] = {7, 2, 4, 3, 8, 8};
  const int heads[] = {0, 1, 2, 3, 4, 5, 12, 6, 7, 8, 9,  10, 11, 13, 14, 15,
                       0, 1, 2, 3, 4, 5, 6,  7, 8, 9, 10, 11, 12, 13, 14, 15};
  const int ring[] = {1, 0};
  hsapPlan_t plan = nullptr;
  ASSERT_EQ(hsapPlanCreate(&plan, 6, 16, 4, 2, sizes, ranks, seq, tok, counts, heads, ring),
            hsapSuccess)
      << hsapGetLastError();
  EXPECT_EQ(plan->plan, ExamplePlan());
  size_t size = 0;
  ASSERT_EQ(hsapPlanToJson(plan, nullptr, &size), hsapSuccess);
  std::string small(4, '\0');
  size_t small_size = small.size();
  EXPECT_EQ(hsapPlanToJson(plan, small.data(), &small_size), hsapInvalidArgument);
  EXPECT_EQ(small_size, size);
  std::string text(size, '\0');
  ASSERT_EQ(hsapPlanToJson(plan, text.data(), &size), hsapSuccess);
  hsapPlan_t back = nullptr;
  ASSERT_EQ(hsapPlanCreateFromJson(&back, text.c_str()), hsapSuccess) << hsapGetLastError();
  EXPECT_EQ(back->plan, plan->plan);
  double fwd = -1, bwd = -1;
  EXPECT_EQ(hsapPlanGetPredictedTime(back, &fwd, &bwd), hsapSuccess);
  EXPECT_EQ(fwd, 0.0);
  int nr = 0, hq = 0, hkv = 0, ng = 0;
  EXPECT_EQ(hsapPlanGetShape(back, &nr, &hq, &hkv, &ng), hsapSuccess);
  EXPECT_EQ(nr * 10000 + hq * 100 + hkv * 10 + ng, 6 * 10000 + 16 * 100 + 4 * 10 + 2);
  EXPECT_EQ(hsapPlanDestroy(back), hsapSuccess);
  EXPECT_EQ(hsapPlanDestroy(plan), hsapSuccess);
}

TEST(PlanCApiTest, InvalidInputsGiveClearErrors) {
  const int sizes[] = {1, 1};
  const int ranks[] = {0, 1};
  const int counts[] = {2, 1};
  const int heads[] = {0, 1, 1};  // group 1 owns head 1 only: head 0 is missing
  hsapPlan_t plan = nullptr;
  EXPECT_EQ(
      hsapPlanCreate(&plan, 2, 2, 1, 2, sizes, ranks, nullptr, nullptr, counts, heads, nullptr),
      hsapInvalidArgument);
  EXPECT_THAT(hsapGetLastError(), HasSubstr("query head 0 is owned by no rank of group 1"));
  EXPECT_EQ(plan, nullptr);
  const int bad_sizes[] = {1, 2};
  EXPECT_EQ(
      hsapPlanCreate(&plan, 2, 2, 1, 2, bad_sizes, ranks, nullptr, nullptr, counts, heads, nullptr),
      hsapInvalidArgument);
  EXPECT_THAT(hsapGetLastError(), HasSubstr("groupSizes add up to"));
  EXPECT_EQ(
      hsapPlanCreate(nullptr, 2, 2, 1, 2, sizes, ranks, nullptr, nullptr, counts, heads, nullptr),
      hsapInvalidArgument);
  EXPECT_EQ(hsapPlanCreateFromJson(&plan, "[1,2"), hsapInvalidArgument);
  EXPECT_THAT(hsapGetLastError(), HasSubstr("hsapPlanCreateFromJson"));
  EXPECT_EQ(hsapPlanToJson(nullptr, nullptr, nullptr), hsapInvalidArgument);
}

}  // namespace
}  // namespace hsap
