#include "lib/sched/hierarchy.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace hsap {
namespace {

bool Contains(const std::vector<int>& sorted, int x) {
  return std::binary_search(sorted.begin(), sorted.end(), x);
}

// Index of x in sorted (x must be there).
int IndexOf(const std::vector<int>& sorted, int x) {
  return static_cast<int>(std::lower_bound(sorted.begin(), sorted.end(), x) - sorted.begin());
}

// Global ranges of rows [row0, row1) of a buffer laid out by `runs` (increasing local rows).
std::vector<TokenRange> RowsToRanges(const std::vector<TokenRun>& runs, int64_t row0,
                                     int64_t row1) {
  std::vector<TokenRange> out;
  for (const TokenRun& run : runs) {
    const int64_t b = std::max(row0, run.local_begin);
    const int64_t e = std::min(row1, run.local_begin + run.length);
    if (b < e)
      out.push_back(
          {run.global_begin + (b - run.local_begin), run.global_begin + (e - run.local_begin)});
  }
  return out;
}

// Adds KV head `head` (index `local` in this rank's kv_heads) to the transfer with `peer`.
void AddHead(std::vector<KvTransfer>& transfers, int peer, int head, int local) {
  auto it = std::find_if(transfers.begin(), transfers.end(),
                         [&](const KvTransfer& t) { return t.peer == peer; });
  if (it == transfers.end()) {
    transfers.push_back({peer, {}, {}});
    it = transfers.end() - 1;
  }
  it->heads.push_back(head);
  it->local_heads.push_back(local);
}

}  // namespace

std::vector<int64_t> SplitByWeights(int64_t total, const std::vector<double>& weights) {
  const double sum = std::accumulate(weights.begin(), weights.end(), 0.0);
  std::vector<int64_t> counts(weights.size(), 0);
  std::vector<std::pair<double, size_t>> remainders;
  int64_t given = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const double exact = static_cast<double>(total) * weights[i] / sum;
    counts[i] = static_cast<int64_t>(std::floor(exact));
    given += counts[i];
    remainders.push_back({exact - static_cast<double>(counts[i]), i});
  }
  // Largest remainder first; ties to the lower index. Only ranks with weight > 0 take more.
  std::stable_sort(remainders.begin(), remainders.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  for (size_t k = 0; given < total; k = (k + 1) % remainders.size()) {
    if (weights[remainders[k].second] > 0) {
      ++counts[remainders[k].second];
      ++given;
    }
  }
  return counts;
}

absl::StatusOr<Hierarchy> Hierarchy::Create(const Layout& layout, const Plan& plan,
                                            absl::Span<const int> node_of_rank) {
  HSAP_RETURN_IF_ERROR(plan.Validate());
  if (!node_of_rank.empty() && static_cast<int>(node_of_rank.size()) != plan.num_ranks) {
    return absl::InvalidArgumentError(absl::StrCat("the topology has ", node_of_rank.size(),
                                                   " ranks but the plan ", plan.num_ranks));
  }
  Hierarchy h;
  h.plan_ = plan;
  h.node_of_rank_.assign(node_of_rank.begin(), node_of_rank.end());
  const int G = static_cast<int>(plan.groups.size());
  h.ring_ = plan.RingOrder();
  h.position_of_.assign(G, 0);
  for (int p = 0; p < G; ++p) h.position_of_[h.ring_[p]] = p;
  h.group_of_ = plan.GroupOfRank();
  h.index_of_ = plan.IndexInGroup();

  std::vector<double> weights(G);
  for (int p = 0; p < G; ++p) weights[p] = plan.groups[h.ring_[p]].sequence_weight;
  HSAP_ASSIGN_OR_RETURN(Partition positions, Partition::Create(layout, G, weights));
  h.positions_ = std::move(positions);

  h.shards_.assign(plan.num_ranks, {});
  h.member_rows_.assign(G, {});
  h.kv_heads_.assign(G, {});
  for (int g = 0; g < G; ++g) {
    const PlanGroup& group = plan.groups[g];
    const std::vector<TokenRun> runs = h.positions_.Runs(h.position_of_[g]);
    const int64_t n = h.positions_.local_tokens(h.position_of_[g]);
    const std::vector<int64_t> counts = SplitByWeights(n, group.token_weights);
    int64_t row = 0;
    for (size_t i = 0; i < group.ranks.size(); ++i) {
      h.member_rows_[g].push_back(row);
      h.shards_[group.ranks[i]] = RowsToRanges(runs, row, row + counts[i]);
      row += counts[i];
      h.kv_heads_[g].push_back(plan.KvHeadsOf(g, static_cast<int>(i)));
    }
  }
  return h;
}

int64_t Hierarchy::shard_tokens(int rank) const {
  int64_t n = 0;
  for (const TokenRange& r : shards_[rank]) n += r.size();
  return n;
}

int64_t Hierarchy::group_tokens(int group) const {
  return positions_.local_tokens(position_of_[group]);
}

int Hierarchy::SenderOf(int source_group, int kv_head, int receiver) const {
  const std::vector<std::vector<int>>& kv = kv_heads_[source_group];
  std::vector<int> holders;
  for (size_t i = 0; i < kv.size(); ++i) {
    if (Contains(kv[i], kv_head)) holders.push_back(static_cast<int>(i));
  }
  // Every KV head has at least one query head, owned by some member of every group.
  const std::vector<int>& ranks = plan_.groups[source_group].ranks;
  if (!node_of_rank_.empty()) {
    std::vector<int> near;  // holders on the receiver's node
    for (int i : holders) {
      if (node_of_rank_[ranks[i]] == node_of_rank_[receiver]) near.push_back(i);
    }
    if (!near.empty()) holders = std::move(near);
  }
  return ranks[holders[index_of_[receiver] % holders.size()]];
}

std::vector<int> Hierarchy::NodeReceivers(int group, int kv_head, int node) const {
  std::vector<int> out;
  const std::vector<int>& ranks = plan_.groups[group].ranks;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (node_of_rank_[ranks[i]] == node && Contains(kv_heads_[group][i], kv_head)) {
      out.push_back(ranks[i]);
    }
  }
  return out;
}

int Hierarchy::GatewayOf(int step, int source_group, int kv_head, int receiver) const {
  if (node_of_rank_.empty()) return -1;
  const int node = node_of_rank_[receiver];
  if (node_of_rank_[SenderOf(source_group, kv_head, receiver)] == node) return -1;
  // No holder is on this node, so every node receiver's holder is on another one.
  const std::vector<int> receivers = NodeReceivers(group_of_[receiver], kv_head, node);
  if (receivers.size() < 2) return -1;
  return receivers[(kv_head + step) % receivers.size()];
}

absl::StatusOr<RankHierarchy> Hierarchy::BuildRank(const Layout& layout, int rank,
                                                   int64_t block_q) const {
  if (rank < 0 || rank >= plan_.num_ranks) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " is outside the plan's ", plan_.num_ranks, " ranks"));
  }
  RankHierarchy r;
  r.rank = rank;
  r.group = group_of_[rank];
  r.index = index_of_[rank];
  r.ring_position = position_of_[r.group];
  const PlanGroup& group = plan_.groups[r.group];
  const int ratio = plan_.heads_q / plan_.heads_kv;
  std::vector<int> holders_of_kv(plan_.heads_kv, 0);
  for (size_t i = 0; i < group.ranks.size(); ++i) {
    GroupMember m;
    m.rank = group.ranks[i];
    m.row_begin = member_rows_[r.group][i];
    m.tokens = shard_tokens(m.rank);
    m.q_heads = group.heads[i];
    std::sort(m.q_heads.begin(), m.q_heads.end());
    m.kv_heads = kv_heads_[r.group][i];
    for (int kv : m.kv_heads) ++holders_of_kv[kv];
    r.members.push_back(std::move(m));
  }
  r.kv_grad_partial =
      std::any_of(holders_of_kv.begin(), holders_of_kv.end(), [](int n) { return n > 1; });
  r.shard = shards_[rank];
  r.shard_tokens = shard_tokens(rank);
  r.q_heads = r.members[r.index].q_heads;
  r.kv_heads = r.members[r.index].kv_heads;
  for (int qh : r.q_heads) r.kv_head_of_q.push_back(IndexOf(r.kv_heads, qh / ratio));

  HSAP_ASSIGN_OR_RETURN(Schedule sched,
                        BuildSchedule(layout, positions_, r.ring_position, block_q));
  r.group_runs = sched.local_runs;
  r.group_tokens = sched.local_rows;
  if (r.q_heads.empty()) return r;  // no heads: only the all-to-all moves this rank's shard
  r.local_work = std::move(sched.local_work);

  for (Stage& st : sched.stages) {
    SubRingStep step;
    step.step = st.step;
    if (st.recv_from >= 0) {
      step.recv_group = ring_[st.recv_from];
      for (size_t l = 0; l < r.kv_heads.size(); ++l) {
        const int h = r.kv_heads[l];
        const int gateway = GatewayOf(st.step, step.recv_group, h, rank);
        if (gateway >= 0 && gateway != rank) {
          AddHead(step.fan_out_recv, gateway, h, static_cast<int>(l));
          continue;
        }
        AddHead(step.recv, SenderOf(step.recv_group, h, rank), h, static_cast<int>(l));
        if (gateway != rank) continue;
        for (int peer : NodeReceivers(r.group, h, node_of_rank_[rank])) {
          if (peer != rank) AddHead(step.fan_out_send, peer, h, static_cast<int>(l));
        }
      }
      // Peers in group order, so that both sides list transfers alike.
      for (std::vector<KvTransfer>* list : {&step.recv, &step.fan_out_recv, &step.fan_out_send}) {
        std::sort(list->begin(), list->end(), [&](const KvTransfer& a, const KvTransfer& b) {
          return index_of_[a.peer] < index_of_[b.peer];
        });
      }
      step.recv_runs = std::move(st.recv_runs);
      step.recv_rows = st.recv_rows;
      step.recv_work = std::move(st.recv_work);
    }
    if (st.send_to >= 0) {
      const int gd = ring_[st.send_to];
      const PlanGroup& dst = plan_.groups[gd];
      for (size_t j = 0; j < dst.ranks.size(); ++j) {
        KvTransfer t;
        t.peer = dst.ranks[j];
        for (int h : kv_heads_[gd][j]) {
          const int gateway = GatewayOf(st.step, r.group, h, t.peer);
          if (SenderOf(r.group, h, t.peer) == rank && (gateway < 0 || gateway == t.peer)) {
            t.heads.push_back(h);
            t.local_heads.push_back(IndexOf(r.kv_heads, h));
          }
        }
        if (!t.heads.empty()) step.send.push_back(std::move(t));
      }
      if (!step.send.empty()) {
        step.send_group = gd;
        step.send_runs = std::move(st.send_runs);
        step.send_rows = st.send_rows;
      }
    }
    if (step.recv_group >= 0 || step.send_group >= 0) r.steps.push_back(std::move(step));
  }
  return r;
}

HierTraffic PredictForwardTraffic(const RankHierarchy& r, int head_dim, DType dtype) {
  const uint64_t es = DTypeSize(dtype), D = static_cast<uint64_t>(head_dim);
  const GroupMember& me = r.members[r.index];
  HierTraffic t;
  for (const GroupMember& m : r.members) {
    if (m.rank == r.rank) continue;
    const uint64_t mine = static_cast<uint64_t>(me.tokens),
                   theirs = static_cast<uint64_t>(m.tokens);
    // Q, K, V of my shard to m (m's heads); of m's shard to me (my heads).
    t.a2a_sent += mine * (m.q_heads.size() + 2 * m.kv_heads.size()) * D * es;
    t.a2a_received += theirs * (me.q_heads.size() + 2 * me.kv_heads.size()) * D * es;
    // out (storage) and lse (fp32) of m's rows for my heads back to m; and of mine from m.
    t.a2a_sent += theirs * me.q_heads.size() * (D * es + 4);
    t.a2a_received += mine * m.q_heads.size() * (D * es + 4);
  }
  for (const SubRingStep& s : r.steps) {
    for (const KvTransfer& x : s.recv) t.ring_received += 2 * s.recv_rows * x.heads.size() * D * es;
    for (const KvTransfer& x : s.fan_out_recv) {
      t.ring_received += 2 * s.recv_rows * x.heads.size() * D * es;
    }
    for (const KvTransfer& x : s.fan_out_send) {
      t.ring_sent += 2 * s.recv_rows * x.heads.size() * D * es;
    }
    for (const KvTransfer& x : s.send) t.ring_sent += 2 * s.send_rows * x.heads.size() * D * es;
  }
  return t;
}

HierTraffic PredictBackwardTraffic(const RankHierarchy& r, int head_dim, DType dtype) {
  const uint64_t es = DTypeSize(dtype), D = static_cast<uint64_t>(head_dim);
  const uint64_t kv_grad_es = r.kv_grad_partial ? 4 : es;
  const GroupMember& me = r.members[r.index];
  HierTraffic t;
  for (const GroupMember& m : r.members) {
    if (m.rank == r.rank) continue;
    const uint64_t mine = static_cast<uint64_t>(me.tokens),
                   theirs = static_cast<uint64_t>(m.tokens);
    // In: Q and dout, K and V (storage), lse and delta (fp32).
    t.a2a_sent += mine * (2 * m.q_heads.size() * D * es + 2 * m.kv_heads.size() * D * es +
                          m.q_heads.size() * 8);
    t.a2a_received += theirs * (2 * me.q_heads.size() * D * es + 2 * me.kv_heads.size() * D * es +
                                me.q_heads.size() * 8);
    // Out: dQ (storage), dK and dV.
    t.a2a_sent += theirs * (me.q_heads.size() * D * es + 2 * me.kv_heads.size() * D * kv_grad_es);
    t.a2a_received += mine * (m.q_heads.size() * D * es + 2 * m.kv_heads.size() * D * kv_grad_es);
  }
  for (const SubRingStep& s : r.steps) {
    for (const KvTransfer& x : s.recv) {
      t.ring_received += 2 * s.recv_rows * x.heads.size() * D * es;
      t.ring_sent += 2 * s.recv_rows * x.heads.size() * D * 4;
    }
    for (const KvTransfer& x : s.send) {
      t.ring_sent += 2 * s.send_rows * x.heads.size() * D * es;
      t.ring_received += 2 * s.send_rows * x.heads.size() * D * 4;
    }
    // Fan-out: K/V from the gateway, fp32 partials back to it.
    for (const KvTransfer& x : s.fan_out_recv) {
      t.ring_received += 2 * s.recv_rows * x.heads.size() * D * es;
      t.ring_sent += 2 * s.recv_rows * x.heads.size() * D * 4;
    }
    for (const KvTransfer& x : s.fan_out_send) {
      t.ring_sent += 2 * s.recv_rows * x.heads.size() * D * es;
      t.ring_received += 2 * s.recv_rows * x.heads.size() * D * 4;
    }
  }
  return t;
}

}  // namespace hsap
