#include "lib/sched/plan.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace hsap {
namespace {

using nlohmann::json;

absl::Status Invalid(const std::string& message) {
  return absl::InvalidArgumentError(absl::StrCat("plan: ", message));
}

bool FiniteNonNegative(double x) { return std::isfinite(x) && x >= 0; }

// JSON readers that turn a wrong type into a message naming the field.
absl::StatusOr<const json*> Field(const json& object, const char* name, const std::string& where,
                                  bool required = true) {
  if (!object.is_object()) return Invalid(absl::StrCat(where, " must be a JSON object"));
  auto it = object.find(name);
  if (it == object.end()) {
    if (!required) return nullptr;
    return Invalid(absl::StrCat(where, " lacks the field \"", name, "\""));
  }
  return &*it;
}

absl::StatusOr<int> ReadInt(const json& value, const std::string& what) {
  if (!value.is_number_integer()) return Invalid(absl::StrCat(what, " must be an integer"));
  const int64_t v = value.get<int64_t>();
  if (v < -(int64_t{1} << 30) || v > (int64_t{1} << 30)) {
    return Invalid(absl::StrCat(what, " = ", v, " is out of range"));
  }
  return static_cast<int>(v);
}

absl::StatusOr<double> ReadDouble(const json& value, const std::string& what) {
  if (!value.is_number()) return Invalid(absl::StrCat(what, " must be a number"));
  return value.get<double>();
}

absl::StatusOr<std::vector<int>> ReadHeadList(const json& value, const std::string& what) {
  if (value.is_string()) {
    auto heads = ParseHeads(value.get<std::string>());
    if (!heads.ok()) return Invalid(absl::StrCat(what, ": ", heads.status().message()));
    return heads;
  }
  if (!value.is_array()) {
    return Invalid(absl::StrCat(what, " must be a string like \"0-5,12\" or an array"));
  }
  std::vector<int> heads;
  for (size_t i = 0; i < value.size(); ++i) {
    auto h = ReadInt(value[i], absl::StrCat(what, "[", i, "]"));
    if (!h.ok()) return h.status();
    heads.push_back(*h);
  }
  std::sort(heads.begin(), heads.end());
  return heads;
}

}  // namespace

absl::Status Plan::Validate() const {
  if (num_ranks < 1) return Invalid(absl::StrCat("num_ranks = ", num_ranks, " must be >= 1"));
  if (heads_q < 1 || heads_kv < 1) {
    return Invalid(
        absl::StrCat("heads_q = ", heads_q, " and heads_kv = ", heads_kv, " must both be >= 1"));
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

nlohmann::json PlanToJson(const Plan& plan) {
  json j;
  j["num_ranks"] = plan.num_ranks;
  j["heads_q"] = plan.heads_q;
  j["heads_kv"] = plan.heads_kv;
  json groups = json::array();
  for (const PlanGroup& group : plan.groups) {
    json g;
    g["ranks"] = group.ranks;
    g["sequence_weight"] = group.sequence_weight;
    g["token_weights"] = group.token_weights;
    json heads = json::array();
    for (const auto& h : group.heads) heads.push_back(FormatHeads(h));
    g["heads"] = heads;
    groups.push_back(g);
  }
  j["groups"] = groups;
  if (!plan.ring_order.empty()) j["ring_order"] = plan.ring_order;
  if (plan.predicted_forward_seconds > 0 || plan.predicted_backward_seconds > 0 ||
      !plan.ranks.empty() || !plan.description.empty()) {
    json p;
    p["forward_seconds"] = plan.predicted_forward_seconds;
    p["backward_seconds"] = plan.predicted_backward_seconds;
    if (!plan.description.empty()) p["description"] = plan.description;
    json ranks = json::array();
    for (const RankPrediction& r : plan.ranks) {
      ranks.push_back({{"forward_seconds", r.forward_seconds},
                       {"backward_seconds", r.backward_seconds},
                       {"memory_bytes", r.memory_bytes},
                       {"reason", r.reason}});
    }
    if (!plan.ranks.empty()) p["ranks"] = ranks;
    j["predicted"] = p;
  }
  return j;
}

absl::StatusOr<Plan> PlanFromJson(const nlohmann::json& j) {
  Plan plan;
  auto get_int = [&](const json& obj, const char* name, const std::string& where,
                     int* out) -> absl::Status {
    auto f = Field(obj, name, where);
    if (!f.ok()) return f.status();
    auto v = ReadInt(**f, absl::StrCat(where, ".", name));
    if (!v.ok()) return v.status();
    *out = *v;
    return absl::OkStatus();
  };
  if (auto s = get_int(j, "num_ranks", "plan", &plan.num_ranks); !s.ok()) return s;
  if (auto s = get_int(j, "heads_q", "plan", &plan.heads_q); !s.ok()) return s;
  if (auto s = get_int(j, "heads_kv", "plan", &plan.heads_kv); !s.ok()) return s;
  auto groups = Field(j, "groups", "plan");
  if (!groups.ok()) return groups.status();
  if (!(*groups)->is_array()) return Invalid("plan.groups must be an array");
  for (size_t g = 0; g < (*groups)->size(); ++g) {
    const json& gj = (**groups)[g];
    const std::string where = absl::StrCat("plan.groups[", g, "]");
    PlanGroup group;
    auto ranks = Field(gj, "ranks", where);
    if (!ranks.ok()) return ranks.status();
    if (!(*ranks)->is_array()) return Invalid(absl::StrCat(where, ".ranks must be an array"));
    for (size_t i = 0; i < (*ranks)->size(); ++i) {
      auto r = ReadInt((**ranks)[i], absl::StrCat(where, ".ranks[", i, "]"));
      if (!r.ok()) return r.status();
      group.ranks.push_back(*r);
    }
    auto sw = Field(gj, "sequence_weight", where);
    if (!sw.ok()) return sw.status();
    auto swv = ReadDouble(**sw, absl::StrCat(where, ".sequence_weight"));
    if (!swv.ok()) return swv.status();
    group.sequence_weight = *swv;
    auto tw = Field(gj, "token_weights", where, /*required=*/false);
    if (!tw.ok()) return tw.status();
    if (*tw == nullptr) {
      group.token_weights.assign(group.ranks.size(), 1.0);
    } else {
      if (!(*tw)->is_array()) {
        return Invalid(absl::StrCat(where, ".token_weights must be an array"));
      }
      for (size_t i = 0; i < (*tw)->size(); ++i) {
        auto w = ReadDouble((**tw)[i], absl::StrCat(where, ".token_weights[", i, "]"));
        if (!w.ok()) return w.status();
        group.token_weights.push_back(*w);
      }
    }
    auto heads = Field(gj, "heads", where);
    if (!heads.ok()) return heads.status();
    if (!(*heads)->is_array()) return Invalid(absl::StrCat(where, ".heads must be an array"));
    for (size_t i = 0; i < (*heads)->size(); ++i) {
      auto h = ReadHeadList((**heads)[i], absl::StrCat(where, ".heads[", i, "]"));
      if (!h.ok()) return h.status();
      group.heads.push_back(*std::move(h));
    }
    plan.groups.push_back(std::move(group));
  }
  auto ring = Field(j, "ring_order", "plan", /*required=*/false);
  if (!ring.ok()) return ring.status();
  if (*ring != nullptr) {
    if (!(*ring)->is_array()) return Invalid("plan.ring_order must be an array");
    for (size_t i = 0; i < (*ring)->size(); ++i) {
      auto g = ReadInt((**ring)[i], absl::StrCat("plan.ring_order[", i, "]"));
      if (!g.ok()) return g.status();
      plan.ring_order.push_back(*g);
    }
  }
  auto predicted = Field(j, "predicted", "plan", /*required=*/false);
  if (!predicted.ok()) return predicted.status();
  if (*predicted != nullptr) {
    const json& p = **predicted;
    for (auto [name, out] : {std::pair{"forward_seconds", &plan.predicted_forward_seconds},
                             std::pair{"backward_seconds", &plan.predicted_backward_seconds}}) {
      auto f = Field(p, name, "plan.predicted", /*required=*/false);
      if (!f.ok()) return f.status();
      if (*f == nullptr) continue;
      auto v = ReadDouble(**f, absl::StrCat("plan.predicted.", name));
      if (!v.ok()) return v.status();
      *out = *v;
    }
    auto d = Field(p, "description", "plan.predicted", /*required=*/false);
    if (!d.ok()) return d.status();
    if (*d != nullptr && (*d)->is_string()) plan.description = (*d)->get<std::string>();
    auto ranks = Field(p, "ranks", "plan.predicted", /*required=*/false);
    if (!ranks.ok()) return ranks.status();
    if (*ranks != nullptr) {
      if (!(*ranks)->is_array()) return Invalid("plan.predicted.ranks must be an array");
      for (size_t i = 0; i < (*ranks)->size(); ++i) {
        const json& rj = (**ranks)[i];
        const std::string where = absl::StrCat("plan.predicted.ranks[", i, "]");
        RankPrediction r;
        for (auto [name, out] : {std::pair{"forward_seconds", &r.forward_seconds},
                                 std::pair{"backward_seconds", &r.backward_seconds},
                                 std::pair{"memory_bytes", &r.memory_bytes}}) {
          auto f = Field(rj, name, where, /*required=*/false);
          if (!f.ok()) return f.status();
          if (*f == nullptr) continue;
          auto v = ReadDouble(**f, absl::StrCat(where, ".", name));
          if (!v.ok()) return v.status();
          *out = *v;
        }
        auto reason = Field(rj, "reason", where, /*required=*/false);
        if (!reason.ok()) return reason.status();
        if (*reason != nullptr && (*reason)->is_string()) {
          r.reason = (*reason)->get<std::string>();
        }
        plan.ranks.push_back(std::move(r));
      }
    }
  }
  if (absl::Status s = plan.Validate(); !s.ok()) return s;
  return plan;
}

absl::StatusOr<Plan> PlanFromJsonText(absl::string_view text) {
  json j = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    return Invalid("the text is not valid JSON (check brackets, quotes and commas)");
  }
  return PlanFromJson(j);
}

std::string PlanToJsonText(const Plan& plan, int indent) { return PlanToJson(plan).dump(indent); }

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
