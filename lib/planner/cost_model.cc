#include "lib/planner/cost_model.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "lib/sched/json_text.h"
#include "nlohmann/json.hpp"

namespace hsap {
namespace {

struct Preset {
  const char* key;
  ModelSpec spec;
};

const std::vector<Preset>& Presets() {
  // Architecture figures from the models' published configurations (config.json of the
  // Hugging Face releases): layers, heads, KV heads, head dim, hidden, FFN, vocabulary.
  static const std::vector<Preset> presets = {
      {"llama-3b", {"Llama 3.2 3B", 28, 24, 8, 128, 3072, 8192, 128256, 2}},
      {"llama-7b", {"Llama 2 7B", 32, 32, 32, 128, 4096, 11008, 32000, 2}},
      {"llama-13b", {"Llama 2 13B", 40, 40, 40, 128, 5120, 13824, 32000, 2}},
      {"llama-70b", {"Llama 2 70B (GQA)", 80, 64, 8, 128, 8192, 28672, 32000, 2}},
  };
  return presets;
}

// Traffic accounting: every flow loads the egress port of its source and the ingress port
// of its destination (PortMap). A set of concurrent flows finishes no sooner than the most
// loaded port allows (load / bandwidth); the model takes that bound as the time.
class PortLoads {
 public:
  explicit PortLoads(const Cluster& cluster)
      : map_(cluster), load_(map_.size(), 0.0), efficiency_(cluster.link_efficiency) {}
  void Clear() { std::fill(load_.begin(), load_.end(), 0.0); }
  void Add(int src, int dst, double bytes) {
    auto [a, b] = map_.Ports(src, dst);
    load_[a] += bytes;
    load_[b] += bytes;
  }
  // Time for the flow src -> dst given every load added: its more loaded port.
  double Time(int src, int dst) const {
    auto [a, b] = map_.Ports(src, dst);
    return std::max(load_[a] / map_.bandwidth(a), load_[b] / map_.bandwidth(b)) / efficiency_;
  }

 private:
  PortMap map_;
  std::vector<double> load_;
  double efficiency_;  // NCCL's protocol efficiency on the links (Cluster::link_efficiency)
};

// Position of every group in the ring order.
std::vector<int> RingPositions(const std::vector<int>& order) {
  std::vector<int> position(order.size());
  for (size_t p = 0; p < order.size(); ++p) position[order[p]] = static_cast<int>(p);
  return position;
}

}  // namespace

double ModelSpec::Parameters() const {
  const double attention = 2.0 * hidden * heads_q * head_dim + 2.0 * hidden * heads_kv * head_dim;
  const double mlp = 3.0 * hidden * ffn_hidden;
  return layers * (attention + mlp) + 2.0 * vocab * hidden;
}

absl::StatusOr<ModelSpec> ModelPreset(absl::string_view name) {
  const std::string key = absl::AsciiStrToLower(name);
  for (const Preset& p : Presets()) {
    if (key == p.key) return p.spec;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown model preset \"", name, "\"; known: ", absl::StrJoin(ModelPresetNames(), ", ")));
}

std::vector<std::string> ModelPresetNames() {
  std::vector<std::string> names;
  for (const Preset& p : Presets()) names.push_back(p.key);
  return names;
}

absl::StatusOr<ModelSpec> ModelFromJsonText(absl::string_view text) {
  absl::StatusOr<nlohmann::json> parsed = ParseJsonText(text);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("model: ", parsed.status().message()));
  }
  const nlohmann::json& j = *parsed;
  if (!j.is_object()) {
    return absl::InvalidArgumentError("model: the text is not a JSON object");
  }
  ModelSpec m;
  m.name = j.contains("name") && j["name"].is_string() ? j["name"].get<std::string>() : "custom";
  struct Field {
    const char* name;
    int* out;
    int fallback;  // 0: required
  };
  const Field fields[] = {{"layers", &m.layers, 0},     {"heads_q", &m.heads_q, 0},
                          {"heads_kv", &m.heads_kv, 0}, {"head_dim", &m.head_dim, 0},
                          {"hidden", &m.hidden, 0},     {"ffn_hidden", &m.ffn_hidden, -1},
                          {"vocab", &m.vocab, 32000},   {"dtype_bytes", &m.dtype_bytes, 2}};
  for (const Field& f : fields) {
    auto it = j.find(f.name);
    if (it == j.end()) {
      if (f.fallback == 0) {
        return absl::InvalidArgumentError(absl::StrCat("model lacks the field \"", f.name, "\""));
      }
      *f.out = f.fallback;
      continue;
    }
    if (!it->is_number_integer() || it->get<int64_t>() < 1 || it->get<int64_t>() > (1 << 24)) {
      return absl::InvalidArgumentError(
          absl::StrCat("model.", f.name, " must be an integer in [1, 2^24]"));
    }
    *f.out = static_cast<int>(it->get<int64_t>());
  }
  if (m.ffn_hidden < 0) m.ffn_hidden = 4 * m.hidden;
  if (m.heads_q % m.heads_kv != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model: heads_q = ", m.heads_q, " must be a multiple of heads_kv = ", m.heads_kv));
  }
  return m;
}

double Workload::VisiblePairs() const {
  if (visible_pairs > 0) return visible_pairs;
  const double s = static_cast<double>(seq_len);
  return causal ? s * (s + 1) / 2 : s * s;
}

double Workload::ForwardFlops() const {
  return 4.0 * model.head_dim * VisiblePairs() * model.heads_q;
}

double Workload::BackwardFlops() const { return kBackwardFactor * ForwardFlops(); }

double ModelStateBytesPerDevice(const Cluster& cluster, const Workload& workload) {
  if (workload.budget.model_state_bytes >= 0) return workload.budget.model_state_bytes;
  return 16.0 * workload.model.Parameters() / cluster.size();
}

double UsableMemoryBytes(const Cluster& cluster, const Workload& workload, int device) {
  return cluster.kind_of(device).memory_bytes * (1.0 - workload.budget.margin_fraction);
}

double RankMemoryBytes(const Cluster& cluster, const Workload& workload, double tokens,
                       double group_tokens, int heads, int kv_heads, double block_tokens,
                       bool has_ring) {
  const ModelSpec& m = workload.model;
  const double b = m.dtype_bytes, d = m.head_dim;
  const double working = 34.0 * m.hidden * tokens;  // one layer's activations
  const double activations = workload.budget.activation_checkpointing
                                 ? tokens * m.hidden * b * m.layers + working
                                 : working * m.layers;
  // q, out, k, v of the group's tokens for this rank's heads, and their gradients.
  const double attention = 2.0 * group_tokens * (2.0 * heads + 2.0 * kv_heads) * d * b;
  // Two K/V blocks in flight (double buffering), and dK/dV travelling in backward.
  const double ring = has_ring ? 2.0 * 2.0 * block_tokens * 2.0 * kv_heads * d * b : 0.0;
  // Send and receive staging of the all-to-all over the rank's own shard.
  const double staging = 2.0 * tokens * (m.heads_q + 2.0 * m.heads_kv) * d * b;
  return ModelStateBytesPerDevice(cluster, workload) + activations + attention + ring + staging;
}

double IdealSeconds(const Cluster& cluster, const Workload& workload) {
  // Every device at its rate for the whole row as one block (head parallelism could give it
  // that; shorter blocks are slower): a bound, not a layout.
  const double block = static_cast<double>(workload.seq_len);
  double forward = 0, backward = 0;
  for (int d = 0; d < cluster.size(); ++d) {
    forward += cluster.kind_of(d).AttentionRate(false, block, workload.model.head_dim);
    backward += cluster.kind_of(d).AttentionRate(true, block, workload.model.head_dim);
  }
  return workload.ForwardFlops() / forward + workload.BackwardFlops() / backward;
}

double HardwareBoundSeconds(const Cluster& cluster, const Workload& workload) {
  double peak = 0;
  for (int d = 0; d < cluster.size(); ++d) peak += cluster.kind_of(d).peak_flops;
  return (workload.ForwardFlops() + workload.BackwardFlops()) / peak;
}

double DenseForwardFlopsPerToken(const ModelSpec& m) {
  const double projections =
      static_cast<double>(m.hidden) * (2.0 * m.heads_q + 2.0 * m.heads_kv) * m.head_dim;
  const double mlp = 3.0 * m.hidden * static_cast<double>(m.ffn_hidden);
  return 2.0 * (projections + mlp);
}

double DenseLayerSeconds(const Cluster& cluster, const Workload& workload, const Plan& plan) {
  // fwd + 2x bwd, and the forward again where activations are recomputed (checkpointing).
  const double passes = workload.budget.activation_checkpointing ? 4.0 : 3.0;
  const double per_token = passes * DenseForwardFlopsPerToken(workload.model);
  const std::vector<double> shares = plan.RankShares();
  double slowest = 0;
  for (int r = 0; r < cluster.size() && r < static_cast<int>(shares.size()); ++r) {
    const double tokens = shares[r] * static_cast<double>(workload.seq_len);
    slowest = std::max(slowest, tokens * per_token / cluster.kind_of(r).GemmFlops());
  }
  return slowest;
}

std::vector<RingFlow> RingFlows(const Plan& plan) {
  std::vector<RingFlow> flows;
  const int num_groups = static_cast<int>(plan.groups.size());
  if (num_groups < 2) return flows;
  const std::vector<int> order = plan.RingOrder();
  const std::vector<int> position = RingPositions(order);
  std::vector<int> holder(plan.heads_kv);
  for (int g = 0; g < num_groups; ++g) {
    const int pred = order[(position[g] + num_groups - 1) % num_groups];
    const PlanGroup& pg = plan.groups[pred];
    std::fill(holder.begin(), holder.end(), -1);
    for (int i = static_cast<int>(pg.ranks.size()) - 1; i >= 0; --i) {
      for (int k : plan.KvHeadsOf(pred, i)) holder[k] = pg.ranks[i];
    }
    const PlanGroup& group = plan.groups[g];
    for (size_t i = 0; i < group.ranks.size(); ++i) {
      // The rank's KV heads grouped by sender, in order of first appearance.
      std::vector<std::pair<int, int>> by_sender;
      for (int k : plan.KvHeadsOf(g, static_cast<int>(i))) {
        auto it = std::find_if(by_sender.begin(), by_sender.end(),
                               [&](const auto& e) { return e.first == holder[k]; });
        if (it == by_sender.end()) {
          by_sender.push_back({holder[k], 1});
        } else {
          ++it->second;
        }
      }
      for (auto [src, count] : by_sender) flows.push_back({group.ranks[i], src, count});
    }
  }
  return flows;
}

namespace {

// The plan must be valid and fit the cluster and the model it is priced for.
absl::Status CheckPlanFits(const Cluster& cluster, const Workload& workload, const Plan& plan) {
  HSAP_RETURN_IF_ERROR(plan.Validate());
  const ModelSpec& m = workload.model;
  if (plan.num_ranks != cluster.size()) {
    return absl::InvalidArgumentError(absl::StrCat("the plan has ", plan.num_ranks,
                                                   " ranks but the cluster has ", cluster.size(),
                                                   " devices"));
  }
  if (plan.heads_q != m.heads_q || plan.heads_kv != m.heads_kv) {
    return absl::InvalidArgumentError(
        absl::StrCat("the plan is for ", plan.heads_q, "/", plan.heads_kv,
                     " query/KV heads but the model has ", m.heads_q, "/", m.heads_kv));
  }
  if (workload.seq_len < 1) {
    return absl::InvalidArgumentError("the sequence length must be >= 1");
  }
  return absl::OkStatus();
}

// tau_g of every group: its work share, which is its token share (zigzag).
std::vector<double> GroupShares(const Plan& plan) {
  const int num_groups = static_cast<int>(plan.groups.size());
  double weight_sum = 0;
  for (const PlanGroup& g : plan.groups) weight_sum += g.sequence_weight;
  std::vector<double> share(num_groups);
  for (int g = 0; g < num_groups; ++g) share[g] = plan.groups[g].sequence_weight / weight_sum;
  return share;
}

// Per rank: the query heads it computes after the all-to-all and the KV heads they use.
struct RankHeads {
  std::vector<int> heads, kv_heads;
};

// Fills every rank's tokens, compute and memory into `cost`.
RankHeads PriceRanks(const Cluster& cluster, const Workload& workload, const Plan& plan,
                     const std::vector<double>& share, PlanCost* cost) {
  const int n = cluster.size();
  const int num_groups = static_cast<int>(plan.groups.size());
  const double seq = static_cast<double>(workload.seq_len);
  const double d = workload.model.head_dim;
  const double pairs = workload.VisiblePairs();
  const double max_share = *std::max_element(share.begin(), share.end());
  RankHeads rh{std::vector<int>(n), std::vector<int>(n)};
  for (int g = 0; g < num_groups; ++g) {
    const PlanGroup& group = plan.groups[g];
    const double token_sum =
        std::accumulate(group.token_weights.begin(), group.token_weights.end(), 0.0);
    for (size_t i = 0; i < group.ranks.size(); ++i) {
      const int r = group.ranks[i];
      RankCost& rc = cost->ranks[r];
      rc.tokens = seq * share[g] * group.token_weights[i] / token_sum;
      rh.heads[r] = static_cast<int>(group.heads[i].size());
      rh.kv_heads[r] = static_cast<int>(plan.KvHeadsOf(g, static_cast<int>(i)).size());
      // The group's block: its tokens, all of them against its own and each step's.
      const double flops = 4.0 * d * pairs * share[g] * rh.heads[r];
      const DeviceKind& kind = cluster.kind_of(r);
      rc.compute_forward =
          flops / kind.AttentionRate(false, seq * share[g], workload.model.head_dim);
      rc.compute_backward = kBackwardFactor * flops /
                            kind.AttentionRate(true, seq * share[g], workload.model.head_dim);
      rc.memory_bytes = RankMemoryBytes(cluster, workload, rc.tokens, seq * share[g], rh.heads[r],
                                        rh.kv_heads[r], seq * max_share, num_groups > 1);
      rc.memory_capacity = UsableMemoryBytes(cluster, workload, r);
    }
  }
  return rh;
}

// Sets the rank with the least memory headroom (the first of equals) and whether it fits.
void FindWorstMemoryRank(PlanCost* cost) {
  double least_headroom = 0;
  for (int r = 0; r < static_cast<int>(cost->ranks.size()); ++r) {
    const double headroom = cost->ranks[r].memory_capacity - cost->ranks[r].memory_bytes;
    if (cost->worst_memory_rank < 0 || headroom < least_headroom) {
      least_headroom = headroom;
      cost->worst_memory_rank = r;
    }
  }
  cost->fits_memory = least_headroom >= 0;
}

// One all-to-all phase: bytes_of(src, dst) for a pair of ranks of one group. Every group
// runs its all-to-all at the same time, so groups sharing a NIC slow each other down.
// Adds each group's time to its ranks in `per_rank`; returns the slowest group's time.
template <typename BytesOf>
double AllToAllPhase(const Cluster& cluster, const Plan& plan, BytesOf bytes_of, PortLoads* ports,
                     std::vector<double>* per_rank) {
  ports->Clear();
  for (const PlanGroup& group : plan.groups) {
    for (int src : group.ranks) {
      for (int dst : group.ranks) {
        if (src != dst) ports->Add(src, dst, bytes_of(src, dst));
      }
    }
  }
  double phase = 0;
  for (const PlanGroup& group : plan.groups) {
    if (group.ranks.size() < 2) continue;
    double t = 0, latency = 0;
    for (int src : group.ranks) {
      for (int dst : group.ranks) {
        if (src == dst) continue;
        t = std::max(t, ports->Time(src, dst));
        latency = std::max(latency, cluster.Latency(src, dst));
      }
    }
    for (int r : group.ranks) (*per_rank)[r] += t + latency;
    phase = std::max(phase, t + latency);
  }
  return phase;
}

// Seconds of the phases around the ring: forward in and out, backward in and out.
struct AllToAllSeconds {
  double forward_in, forward_out, backward_in, backward_out;
};

// Prices the four all-to-all phases and fills every rank's a2a_forward and a2a_backward.
AllToAllSeconds PriceAllToAll(const Cluster& cluster, const Workload& workload, const Plan& plan,
                              const RankHeads& rh, PortLoads* ports, PlanCost* cost) {
  const int n = cluster.size();
  const double d = workload.model.head_dim, b = workload.model.dtype_bytes;
  // src holds tokens[src]; dst owns heads[dst] query and kv_heads[dst] KV heads.
  auto qkv = [&](int src, int dst) {
    return cost->ranks[src].tokens * (rh.heads[dst] + 2.0 * rh.kv_heads[dst]) * d * b;
  };
  auto q_only = [&](int src, int dst) { return cost->ranks[src].tokens * rh.heads[dst] * d * b; };
  auto out = [&](int s, int t) { return q_only(t, s); };
  auto grads = [&](int s, int t) { return qkv(t, s); };  // dq, dk, dv
  std::vector<double> a2a_fwd(n, 0.0), a2a_bwd(n, 0.0);
  AllToAllSeconds seconds;
  seconds.forward_in = AllToAllPhase(cluster, plan, qkv, ports, &a2a_fwd);
  seconds.forward_out = AllToAllPhase(cluster, plan, out, ports, &a2a_fwd);
  seconds.backward_in = AllToAllPhase(cluster, plan, q_only, ports, &a2a_bwd);  // dout
  seconds.backward_out = AllToAllPhase(cluster, plan, grads, ports, &a2a_bwd);
  for (int r = 0; r < n; ++r) {
    cost->ranks[r].a2a_forward = a2a_fwd[r];
    cost->ranks[r].a2a_backward = a2a_bwd[r];
  }
  return seconds;
}

// The slowest compute (forward or backward) among each group's ranks.
std::vector<double> GroupCompute(const Plan& plan, const PlanCost& cost, bool backward) {
  std::vector<double> group_compute(plan.groups.size(), 0.0);
  for (size_t g = 0; g < plan.groups.size(); ++g) {
    for (int r : plan.groups[g].ranks) {
      const RankCost& rc = cost.ranks[r];
      group_compute[g] =
          std::max(group_compute[g], backward ? rc.compute_backward : rc.compute_forward);
    }
  }
  return group_compute;
}

// Per group: the transfer time of a full-sequence unit of K/V for its ranks' KV heads,
// received from the holders of those heads in the ring predecessor group and priced with
// every group's ring flow in flight (contention); and the largest latency of those flows.
struct RingTransfers {
  std::vector<double> transfer, latency;
};

// Also fills every rank's ring_transfer_forward. Two groups at least.
RingTransfers PriceRingTransfers(const Cluster& cluster, const Workload& workload, const Plan& plan,
                                 const std::vector<double>& share, PortLoads* ports,
                                 PlanCost* cost) {
  const int num_groups = static_cast<int>(plan.groups.size());
  const double seq = static_cast<double>(workload.seq_len);
  const double d = workload.model.head_dim, b = workload.model.dtype_bytes;
  const std::vector<RingFlow> flows = RingFlows(plan);
  ports->Clear();
  auto unit_bytes = [&](const RingFlow& f) { return seq * 2.0 * f.kv_heads * d * b; };
  for (const RingFlow& f : flows) ports->Add(f.src, f.dst, unit_bytes(f));
  RingTransfers rt{std::vector<double>(num_groups, 0.0), std::vector<double>(num_groups, 0.0)};
  const std::vector<int> group_of = plan.GroupOfRank();
  for (const RingFlow& f : flows) {
    const int g = group_of[f.dst];
    const double t = ports->Time(f.src, f.dst);
    rt.transfer[g] = std::max(rt.transfer[g], t);
    cost->ranks[f.dst].ring_transfer_forward =
        std::max(cost->ranks[f.dst].ring_transfer_forward, t * (1.0 - share[g]));
    rt.latency[g] = std::max(rt.latency[g], cluster.Latency(f.src, f.dst));
  }
  return rt;
}

// One pass of the ring (forward or backward) under RingPricing::kPipelined. Compute and
// transfer times are the forward ones scaled by compute_factor and transfer_factor.
double PipelinedRingSeconds(const Plan& plan, const std::vector<double>& group_compute,
                            const RingTransfers& rt, const std::vector<double>& share,
                            double compute_factor, double transfer_factor) {
  const double cf = compute_factor, xf = transfer_factor;
  const int num_groups = static_cast<int>(plan.groups.size());
  const std::vector<int> order = plan.RingOrder();
  const std::vector<int> position = RingPositions(order);
  // arrive[g]: when group g had the block of the current step; done[g]: end of its
  // compute so far.
  // two_back[g]: end of g's compute two steps back; its buffer takes the next block.
  std::vector<double> arrive(num_groups, 0.0), done(num_groups, 0.0), next(num_groups);
  std::vector<double> two_back(num_groups, 0.0), last(num_groups, 0.0);
  for (int g = 0; g < num_groups; ++g) done[g] = cf * group_compute[g] * share[g];
  for (int s = 1; s < num_groups; ++s) {
    for (int g = 0; g < num_groups; ++g) {
      const int pred = order[(position[g] + num_groups - 1) % num_groups];
      const int src = order[(position[g] + num_groups - s) % num_groups];
      const double buffer_free = s >= 2 ? two_back[g] : 0.0;
      next[g] = std::max({arrive[pred], arrive[g], buffer_free}) +
                xf * rt.transfer[g] * share[src] + rt.latency[g];
    }
    arrive.swap(next);
    last = done;
    for (int g = 0; g < num_groups; ++g) {
      const int src = order[(position[g] + num_groups - s) % num_groups];
      done[g] = std::max(done[g], arrive[g]) + cf * group_compute[g] * share[src];
    }
    two_back.swap(last);
  }
  return *std::max_element(done.begin(), done.end());
}

// One pass of the ring under RingPricing::kOverlapBound, scaled as above.
double OverlapBoundRingSeconds(const std::vector<double>& group_compute, const RingTransfers& rt,
                               const std::vector<double>& share, double compute_factor,
                               double transfer_factor) {
  const double cf = compute_factor, xf = transfer_factor;
  const int num_groups = static_cast<int>(group_compute.size());
  double total = 0;
  for (int g = 0; g < num_groups; ++g) {
    const double rest = 1.0 - share[g];
    const double t = cf * group_compute[g] * share[g] +
                     std::max(cf * group_compute[g] * rest,
                              xf * rt.transfer[g] * rest + (num_groups - 1) * rt.latency[g]);
    total = std::max(total, t);
  }
  return total;
}

struct RingSeconds {
  double forward = 0, backward = 0;
};

// The ring phase. compute: slowest rank of each group; transfer: per full-sequence unit of
// K/V (PriceRingTransfers). Fills every rank's ring_transfer_forward.
RingSeconds PriceRing(const Cluster& cluster, const Workload& workload, const Plan& plan,
                      const std::vector<double>& share, RingPricing pricing, PortLoads* ports,
                      PlanCost* cost) {
  const std::vector<double> compute[2] = {GroupCompute(plan, *cost, false),
                                          GroupCompute(plan, *cost, true)};
  if (plan.groups.size() == 1) return {compute[0][0], compute[1][0]};
  const RingTransfers rt = PriceRingTransfers(cluster, workload, plan, share, ports, cost);
  // Backward: its own compute; K/V forward and dK/dV partial sums along the ring: bytes x2.
  RingSeconds seconds;
  for (int pass = 0; pass < 2; ++pass) {
    const std::vector<double>& group_compute = compute[pass];
    const double cf = 1.0;
    const double xf = pass == 0 ? 1.0 : 2.0;
    const double total = pricing == RingPricing::kPipelined
                             ? PipelinedRingSeconds(plan, group_compute, rt, share, cf, xf)
                             : OverlapBoundRingSeconds(group_compute, rt, share, cf, xf);
    (pass == 0 ? seconds.forward : seconds.backward) = total;
  }
  return seconds;
}

}  // namespace

absl::StatusOr<PlanCost> EvaluatePlan(const Cluster& cluster, const Workload& workload,
                                      const Plan& plan, RingPricing pricing) {
  HSAP_RETURN_IF_ERROR(CheckPlanFits(cluster, workload, plan));
  const std::vector<double> share = GroupShares(plan);
  PlanCost cost;
  cost.ranks.resize(cluster.size());
  const RankHeads rank_heads = PriceRanks(cluster, workload, plan, share, &cost);
  FindWorstMemoryRank(&cost);
  PortLoads ports(cluster);
  const AllToAllSeconds a2a = PriceAllToAll(cluster, workload, plan, rank_heads, &ports, &cost);
  const RingSeconds ring = PriceRing(cluster, workload, plan, share, pricing, &ports, &cost);
  cost.forward_seconds = a2a.forward_in + ring.forward + a2a.forward_out;
  cost.backward_seconds = a2a.backward_in + ring.backward + a2a.backward_out;
  return cost;
}

}  // namespace hsap
