// C entry points of the "Plans" section of hsap.h.
#include <algorithm>
#include <cstring>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "lib/api/checks.h"
#include "lib/api/handles.h"
#include "lib/api/result.h"
#include "lib/sched/plan_json.h"

namespace hsap {
namespace {

absl::Status NotNull(const void* p, const char* name) {
  if (p == nullptr) return absl::InvalidArgumentError(absl::StrCat(name, " is null"));
  return absl::OkStatus();
}

absl::Status PlanCreate(hsapPlan_t* out, int num_ranks, int heads_q, int heads_kv, int num_groups,
                        const int* group_sizes, const int* group_ranks,
                        const double* sequence_weights, const double* token_weights,
                        const int* head_counts, const int* heads, const int* ring_order) {
  if (auto s = NotNull(out, "plan"); !s.ok()) return s;
  *out = nullptr;
  if (num_ranks < 1 || num_ranks > (1 << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("numRanks = ", num_ranks, " must be in [1, 2^20]"));
  }
  if (num_groups < 1 || num_groups > num_ranks) {
    return absl::InvalidArgumentError(
        absl::StrCat("numGroups = ", num_groups, " must be in [1, numRanks = ", num_ranks, "]"));
  }
  HSAP_RETURN_IF_ERROR(CheckHeadCount(heads_q, "numHeadsQ"));
  HSAP_RETURN_IF_ERROR(CheckHeadCount(heads_kv, "numHeadsKV"));
  for (auto [p, name] : {std::pair<const void*, const char*>{group_sizes, "groupSizes"},
                         {group_ranks, "groupRanks"},
                         {head_counts, "headCounts"}}) {
    if (auto s = NotNull(p, name); !s.ok()) return s;
  }
  // Sizes are checked before any array is walked past them.
  int64_t total_ranks = 0;
  for (int g = 0; g < num_groups; ++g) {
    if (group_sizes[g] < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("groupSizes[", g, "] = ", group_sizes[g], " must be >= 1"));
    }
    total_ranks += group_sizes[g];
    if (total_ranks > num_ranks) break;
  }
  if (total_ranks != num_ranks) {
    return absl::InvalidArgumentError(absl::StrCat("groupSizes add up to ", total_ranks,
                                                   " (or more) but numRanks = ", num_ranks,
                                                   "; every rank belongs to exactly one group"));
  }
  int64_t total_heads = 0;
  for (int i = 0; i < num_ranks; ++i) {
    if (head_counts[i] < 0 || head_counts[i] > heads_q) {
      return absl::InvalidArgumentError(absl::StrCat("headCounts[", i, "] = ", head_counts[i],
                                                     " must be in [0, numHeadsQ = ", heads_q, "]"));
    }
    total_heads += head_counts[i];
  }
  if (total_heads > 0) {
    if (auto s = NotNull(heads, "heads"); !s.ok()) return s;
  }
  Plan plan;
  plan.num_ranks = num_ranks;
  plan.heads_q = heads_q;
  plan.heads_kv = heads_kv;
  int entry = 0;
  int64_t head_pos = 0;
  for (int g = 0; g < num_groups; ++g) {
    PlanGroup group;
    group.sequence_weight = sequence_weights ? sequence_weights[g] : 1.0;
    for (int i = 0; i < group_sizes[g]; ++i, ++entry) {
      group.ranks.push_back(group_ranks[entry]);
      group.token_weights.push_back(token_weights ? token_weights[entry] : 1.0);
      std::vector<int> h(heads + head_pos, heads + head_pos + head_counts[entry]);
      std::sort(h.begin(), h.end());
      head_pos += head_counts[entry];
      group.heads.push_back(std::move(h));
    }
    plan.groups.push_back(std::move(group));
  }
  if (ring_order != nullptr) plan.ring_order.assign(ring_order, ring_order + num_groups);
  if (auto s = plan.Validate(); !s.ok()) return s;
  *out = new hsapPlan_st{std::move(plan)};
  return absl::OkStatus();
}

}  // namespace
}  // namespace hsap

extern "C" {

hsapResult_t hsapPlanCreate(hsapPlan_t* plan, int numRanks, int numHeadsQ, int numHeadsKV,
                            int numGroups, const int* groupSizes, const int* groupRanks,
                            const double* sequenceWeights, const double* tokenWeights,
                            const int* headCounts, const int* heads, const int* ringOrder) {
  return hsap::RunApi("hsapPlanCreate", [&] {
    return hsap::PlanCreate(plan, numRanks, numHeadsQ, numHeadsKV, numGroups, groupSizes,
                            groupRanks, sequenceWeights, tokenWeights, headCounts, heads,
                            ringOrder);
  });
}

hsapResult_t hsapPlanCreateFromJson(hsapPlan_t* plan, const char* json) {
  return hsap::RunApi("hsapPlanCreateFromJson", [&]() -> absl::Status {
    if (auto s = hsap::NotNull(plan, "plan"); !s.ok()) return s;
    *plan = nullptr;
    if (auto s = hsap::NotNull(json, "json"); !s.ok()) return s;
    auto parsed = hsap::PlanFromJsonText(json);
    if (!parsed.ok()) return parsed.status();
    *plan = new hsapPlan_st{*std::move(parsed)};
    return absl::OkStatus();
  });
}

hsapResult_t hsapPlanToJson(hsapPlan_t plan, char* buffer, size_t* size) {
  return hsap::RunApi("hsapPlanToJson", [&]() -> absl::Status {
    if (auto s = hsap::NotNull(plan, "plan"); !s.ok()) return s;
    if (auto s = hsap::NotNull(size, "size"); !s.ok()) return s;
    const std::string text = hsap::PlanToJsonText(plan->plan);
    const size_t needed = text.size() + 1;
    if (buffer == nullptr) {
      *size = needed;
      return absl::OkStatus();
    }
    if (*size < needed) {
      const size_t capacity = *size;
      *size = needed;
      return absl::InvalidArgumentError(
          absl::StrCat("buffer holds ", capacity, " bytes but the plan needs ", needed,
                       "; call with buffer = NULL to query the size"));
    }
    std::memcpy(buffer, text.c_str(), needed);
    *size = needed;
    return absl::OkStatus();
  });
}

hsapResult_t hsapPlanDestroy(hsapPlan_t plan) {
  return hsap::RunApi("hsapPlanDestroy", [&]() -> absl::Status {
    delete plan;
    return absl::OkStatus();
  });
}

hsapResult_t hsapPlanGetPredictedTime(hsapPlan_t plan, double* forwardSeconds,
                                      double* backwardSeconds) {
  return hsap::RunApi("hsapPlanGetPredictedTime", [&]() -> absl::Status {
    if (auto s = hsap::NotNull(plan, "plan"); !s.ok()) return s;
    if (forwardSeconds) *forwardSeconds = plan->plan.predicted_forward_seconds;
    if (backwardSeconds) *backwardSeconds = plan->plan.predicted_backward_seconds;
    return absl::OkStatus();
  });
}

hsapResult_t hsapPlanGetShape(hsapPlan_t plan, int* numRanks, int* numHeadsQ, int* numHeadsKV,
                              int* numGroups) {
  return hsap::RunApi("hsapPlanGetShape", [&]() -> absl::Status {
    if (auto s = hsap::NotNull(plan, "plan"); !s.ok()) return s;
    if (numRanks) *numRanks = plan->plan.num_ranks;
    if (numHeadsQ) *numHeadsQ = plan->plan.heads_q;
    if (numHeadsKV) *numHeadsKV = plan->plan.heads_kv;
    if (numGroups) *numGroups = static_cast<int>(plan->plan.groups.size());
    return absl::OkStatus();
  });
}

}  // extern "C"
