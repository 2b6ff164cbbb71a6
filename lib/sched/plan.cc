#include "lib/sched/plan.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <numeric>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace hsap {
namespace {

absl::Status Invalid(const std::string& message) {
  return absl::InvalidArgumentError(absl::StrCat("plan: ", message));
}

bool FiniteNonNegative(double x) { return std::isfinite(x) && x >= 0; }

// splitmix64's finaliser: a well-mixed, platform-independent step of the fingerprint.
uint64_t Mix(uint64_t h, uint64_t v) {
  uint64_t z = h ^ (v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t MixDouble(uint64_t h, double v) { return Mix(h, std::bit_cast<uint64_t>(v)); }

}  // namespace

absl::Status Plan::Validate() const {
  // The C ABI's limits (hsap.h, Limits), checked before anything is sized from them.
  constexpr int kMaxRanks = 1 << 20, kMaxHeads = 65535;
  if (num_ranks < 1 || num_ranks > kMaxRanks) {
    return Invalid(absl::StrCat("num_ranks = ", num_ranks, " must be in [1, ", kMaxRanks, "]"));
  }
  for (const auto& [heads, name] : {std::pair{heads_q, "heads_q"}, {heads_kv, "heads_kv"}}) {
    if (heads < 1 || heads > kMaxHeads) {
      return Invalid(absl::StrCat(name, " = ", heads, " must be in [1, ", kMaxHeads, "]"));
    }
  }
  if (heads_q % heads_kv != 0) {
    return Invalid(absl::StrCat("heads_q = ", heads_q,
                                " must be a multiple of heads_kv = ", heads_kv, " (GQA/MQA)"));
  }
  if (groups.empty()) return Invalid("a plan needs at least one group");
  std::vector<int> owner(num_ranks, -1);
  for (size_t g = 0; g < groups.size(); ++g) {
    const PlanGroup& group = groups[g];
    const std::string name = absl::StrCat("group ", g);
    if (group.ranks.empty()) return Invalid(absl::StrCat(name, " has no ranks"));
    if (!std::isfinite(group.sequence_weight) || group.sequence_weight <= 0) {
      return Invalid(absl::StrCat(name, " has sequence weight ", group.sequence_weight,
                                  "; it must be finite and > 0 (a group with no tokens "
                                  "cannot compute anything; drop the group instead)"));
    }
    if (group.token_weights.size() != group.ranks.size()) {
      return Invalid(absl::StrCat(name, " has ", group.token_weights.size(), " token weights for ",
                                  group.ranks.size(), " ranks; give one per rank"));
    }
    if (group.heads.size() != group.ranks.size()) {
      return Invalid(absl::StrCat(name, " has ", group.heads.size(), " head lists for ",
                                  group.ranks.size(), " ranks; give one per rank"));
    }
    double token_sum = 0;
    for (size_t i = 0; i < group.ranks.size(); ++i) {
      const int r = group.ranks[i];
      if (r < 0 || r >= num_ranks) {
        return Invalid(absl::StrCat(name, " names rank ", r, ", outside [0, ", num_ranks, ")"));
      }
      if (owner[r] != -1) {
        return Invalid(owner[r] == static_cast<int>(g)
                           ? absl::StrCat("rank ", r, " appears twice in ", name)
                           : absl::StrCat("rank ", r, " is in two groups: ", owner[r], " and ", g,
                                          "; every rank belongs to exactly one group"));
      }
      owner[r] = static_cast<int>(g);
      if (!FiniteNonNegative(group.token_weights[i])) {
        return Invalid(absl::StrCat(name, " gives rank ", r, " token weight ",
                                    group.token_weights[i], "; it must be finite and >= 0"));
      }
      token_sum += group.token_weights[i];
    }
    if (!(token_sum > 0)) {
      return Invalid(absl::StrCat(name,
                                  " has all token weights zero; at least one rank must "
                                  "hold tokens"));
    }
    std::vector<int> head_owner(heads_q, -1);
    for (size_t i = 0; i < group.heads.size(); ++i) {
      for (int h : group.heads[i]) {
        if (h < 0 || h >= heads_q) {
          return Invalid(absl::StrCat(name, " gives rank ", group.ranks[i], " query head ", h,
                                      ", outside [0, ", heads_q, ")"));
        }
        if (head_owner[h] != -1) {
          return Invalid(absl::StrCat("query head ", h, " is owned twice in ", name, " (by ranks ",
                                      head_owner[h], " and ", group.ranks[i],
                                      "); every head must be owned exactly once per group"));
        }
        head_owner[h] = group.ranks[i];
      }
    }
    for (int h = 0; h < heads_q; ++h) {
      if (head_owner[h] == -1) {
        return Invalid(absl::StrCat("query head ", h, " is owned by no rank of ", name,
                                    "; every head must be owned exactly once per group"));
      }
    }
  }
  for (int r = 0; r < num_ranks; ++r) {
    if (owner[r] == -1) {
      return Invalid(absl::StrCat("rank ", r, " is in no group; every rank in [0, ", num_ranks,
                                  ") belongs to exactly one group"));
    }
  }
  if (!ring_order.empty()) {
    if (ring_order.size() != groups.size()) {
      return Invalid(absl::StrCat("ring_order has ", ring_order.size(), " entries for ",
                                  groups.size(), " groups; it must be a permutation of them"));
    }
    std::vector<bool> seen(groups.size(), false);
    for (int g : ring_order) {
      if (g < 0 || g >= static_cast<int>(groups.size()) || seen[g]) {
        return Invalid(absl::StrCat("ring_order names group ", g,
                                    " twice or out of range; it must be a permutation of 0..",
                                    groups.size() - 1));
      }
      seen[g] = true;
    }
  }
  if (!ranks.empty() && static_cast<int>(ranks.size()) != num_ranks) {
    return Invalid(absl::StrCat("predictions are given for ", ranks.size(), " ranks of ", num_ranks,
                                "; give one per rank or none"));
  }
  if (!FiniteNonNegative(predicted_forward_seconds) ||
      !FiniteNonNegative(predicted_backward_seconds)) {
    return Invalid("predicted times must be finite and >= 0");
  }
  return absl::OkStatus();
}

std::vector<int> Plan::GroupOfRank() const {
  std::vector<int> out(num_ranks, -1);
  for (size_t g = 0; g < groups.size(); ++g) {
    for (int r : groups[g].ranks) out[r] = static_cast<int>(g);
  }
  return out;
}

std::vector<int> Plan::IndexInGroup() const {
  std::vector<int> out(num_ranks, -1);
  for (const PlanGroup& group : groups) {
    for (size_t i = 0; i < group.ranks.size(); ++i) out[group.ranks[i]] = static_cast<int>(i);
  }
  return out;
}

std::vector<int> Plan::RingOrder() const {
  if (!ring_order.empty()) return ring_order;
  std::vector<int> order(groups.size());
  std::iota(order.begin(), order.end(), 0);
  return order;
}

std::vector<double> Plan::RankShares() const {
  std::vector<double> shares(num_ranks, 0.0);
  double total = 0;
  for (const PlanGroup& group : groups) total += group.sequence_weight;
  for (const PlanGroup& group : groups) {
    const double in_group =
        std::accumulate(group.token_weights.begin(), group.token_weights.end(), 0.0);
    for (size_t i = 0; i < group.ranks.size(); ++i) {
      shares[group.ranks[i]] = group.sequence_weight / total * group.token_weights[i] / in_group;
    }
  }
  return shares;
}

std::vector<int> Plan::KvHeadsOf(int group, int index) const {
  const int ratio = heads_q / heads_kv;
  std::vector<int> kv;
  for (int h : groups[group].heads[index]) kv.push_back(h / ratio);
  std::sort(kv.begin(), kv.end());
  kv.erase(std::unique(kv.begin(), kv.end()), kv.end());
  return kv;
}

uint64_t Plan::Fingerprint() const {
  uint64_t h = Mix(0x706c616eu /* "plan" */, static_cast<uint64_t>(num_ranks));
  h = Mix(h, static_cast<uint64_t>(heads_q));
  h = Mix(h, static_cast<uint64_t>(heads_kv));
  h = Mix(h, groups.size());
  for (const PlanGroup& g : groups) {
    h = Mix(h, g.ranks.size());
    for (int r : g.ranks) h = Mix(h, static_cast<uint64_t>(r));
    h = MixDouble(h, g.sequence_weight);
    h = Mix(h, g.token_weights.size());
    for (double w : g.token_weights) h = MixDouble(h, w);
    h = Mix(h, g.heads.size());
    for (const std::vector<int>& heads : g.heads) {
      h = Mix(h, heads.size());
      for (int head : heads) h = Mix(h, static_cast<uint64_t>(head));
    }
  }
  for (int g : RingOrder()) h = Mix(h, static_cast<uint64_t>(g));
  if (!node_stores) h = Mix(h, 0x6e6f6465u /* "node" */);
  return h;
}

std::string FormatHeads(const std::vector<int>& heads) {
  std::vector<int> sorted = heads;
  std::sort(sorted.begin(), sorted.end());
  std::string out;
  size_t i = 0;
  while (i < sorted.size()) {
    size_t j = i;
    while (j + 1 < sorted.size() && sorted[j + 1] == sorted[j] + 1) ++j;
    if (!out.empty()) out += ",";
    out += j == i ? absl::StrCat(sorted[i]) : absl::StrCat(sorted[i], "-", sorted[j]);
    i = j + 1;
  }
  return out;
}

absl::StatusOr<std::vector<int>> ParseHeads(absl::string_view text) {
  std::vector<int> heads;
  text = absl::StripAsciiWhitespace(text);
  if (text.empty()) return heads;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    part = absl::StripAsciiWhitespace(part);
    std::vector<absl::string_view> ends = absl::StrSplit(part, absl::MaxSplits('-', 1));
    int lo = 0, hi = 0;
    if (!absl::SimpleAtoi(ends[0], &lo) || (ends.size() == 2 && !absl::SimpleAtoi(ends[1], &hi)) ||
        lo < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot read head list item \"", part,
                       "\"; write heads like \"0-5,12\" (non-negative integers and ranges)"));
    }
    if (ends.size() == 1) hi = lo;
    if (hi < lo || hi - lo > (1 << 20)) {
      return absl::InvalidArgumentError(
          absl::StrCat("head range \"", part, "\" is empty or too large"));
    }
    for (int h = lo; h <= hi; ++h) heads.push_back(h);
  }
  std::sort(heads.begin(), heads.end());
  return heads;
}

std::string DescribePlan(const Plan& plan) {
  std::string out =
      absl::StrFormat("plan: %d ranks, %d query heads, %d KV heads, %d groups\n", plan.num_ranks,
                      plan.heads_q, plan.heads_kv, plan.groups.size());
  double total = 0;
  for (const PlanGroup& g : plan.groups) total += g.sequence_weight;
  const std::vector<int> order = plan.RingOrder();
  for (size_t pos = 0; pos < order.size(); ++pos) {
    const int g = order[pos];
    const PlanGroup& group = plan.groups[g];
    const double in_group =
        std::accumulate(group.token_weights.begin(), group.token_weights.end(), 0.0);
    absl::StrAppendFormat(&out, "  group %d (ring position %d): %d ranks, %.2f%% of the work\n", g,
                          pos, group.ranks.size(), 100.0 * group.sequence_weight / total);
    for (size_t i = 0; i < group.ranks.size(); ++i) {
      const int r = group.ranks[i];
      absl::StrAppendFormat(&out, "    rank %4d: tokens %6.2f%% of group, heads %-12s", r,
                            100.0 * group.token_weights[i] / in_group, FormatHeads(group.heads[i]));
      if (!plan.ranks.empty()) {
        const RankPrediction& p = plan.ranks[r];
        absl::StrAppendFormat(&out, " fwd %.3f ms bwd %.3f ms mem %.2f GiB  %s",
                              p.forward_seconds * 1e3, p.backward_seconds * 1e3,
                              p.memory_bytes / (1 << 30), p.reason);
      }
      out += "\n";
    }
  }
  if (plan.predicted_forward_seconds > 0 || plan.predicted_backward_seconds > 0) {
    absl::StrAppendFormat(&out, "  predicted per layer: forward %.3f ms, backward %.3f ms\n",
                          plan.predicted_forward_seconds * 1e3,
                          plan.predicted_backward_seconds * 1e3);
  }
  return out;
}

}  // namespace hsap
