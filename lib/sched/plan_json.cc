#include "lib/sched/plan_json.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "lib/sched/json_text.h"
#include "nlohmann/json.hpp"

namespace hsap {
namespace {

using nlohmann::json;

absl::Status Invalid(const std::string& message) {
  return absl::InvalidArgumentError(absl::StrCat("plan: ", message));
}

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

json PlanToJson(const Plan& plan) {
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
  if (!plan.node_stores) j["node_stores"] = false;
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

absl::StatusOr<Plan> PlanFromJson(const json& j) {
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
  auto stores = Field(j, "node_stores", "plan", /*required=*/false);
  if (!stores.ok()) return stores.status();
  if (*stores != nullptr) {
    if (!(*stores)->is_boolean()) return Invalid("plan.node_stores must be true or false");
    plan.node_stores = (*stores)->get<bool>();
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
  HSAP_RETURN_IF_ERROR(plan.Validate());
  return plan;
}

}  // namespace

absl::StatusOr<Plan> PlanFromJsonText(absl::string_view text) {
  absl::StatusOr<json> j = ParseJsonText(text);
  if (!j.ok()) return Invalid(std::string(j.status().message()));
  return PlanFromJson(*j);
}

std::string PlanToJsonText(const Plan& plan, int indent) { return PlanToJson(plan).dump(indent); }

}  // namespace hsap
