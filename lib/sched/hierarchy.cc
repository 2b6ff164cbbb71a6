#include "lib/sched/hierarchy.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <tuple>
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
  HSAP_RETURN_IF_ERROR(h.PlanStores(layout));
  return h;
}

absl::Status Hierarchy::PlanStores(const Layout& layout) {
  if (node_of_rank_.empty() || !plan_.node_stores) return absl::OkStatus();
  const int G = static_cast<int>(plan_.groups.size());
  const int K = plan_.heads_kv;
  // Per node: the groups with members there (increasing), and per (group, node) the KV
  // heads its members there hold.
  std::map<int, std::vector<int>> groups_on;
  absl::flat_hash_map<std::pair<int, int>, std::vector<char>> held;  // (group, node) -> heads
  for (int g = 0; g < G; ++g) {
    for (size_t i = 0; i < plan_.groups[g].ranks.size(); ++i) {
      const int node = node_of_rank_[plan_.groups[g].ranks[i]];
      std::vector<int>& list = groups_on[node];
      if (list.empty() || list.back() != g) list.push_back(g);
      std::vector<char>& heads = held[{g, node}];
      heads.resize(K, 0);
      for (int kv : kv_heads_[g][i]) heads[kv] = 1;
    }
  }
  std::vector<bool> crowded(G, false);  // by ring position: its group shares a node
  bool any = false;
  for (const auto& [node, groups] : groups_on) {
    if (groups.size() < 2) continue;
    any = true;
    for (int g : groups) crowded[position_of_[g]] = true;
  }
  if (!any) return absl::OkStatus();
  const absl::flat_hash_map<int64_t, std::vector<TokenRange>> needs =
      KeyRowsNeeded(layout, positions_, [&](int q, int) { return crowded[q]; });
  auto rows_of = [&](int source_group, int group) -> const std::vector<TokenRange>* {
    auto it = needs.find(int64_t{position_of_[source_group]} * G + position_of_[group]);
    return it == needs.end() || it->second.empty() ? nullptr : &it->second;
  };
  std::vector<int> receiving, candidates;
  std::vector<int64_t> store_load(plan_.num_ranks, 0);  // store rows each rank keeps
  // Per (source group, node): the rows of each candidate set seen so far (usually every
  // head has the same candidates), null when fewer than two of them overlap.
  std::vector<std::pair<std::vector<int>, std::shared_ptr<const StoreRows>>> shared;
  for (int gs = 0; gs < G; ++gs) {
    const int ps = position_of_[gs];
    auto step_of = [&](int g) { return (position_of_[g] - ps + G) % G; };
    for (const auto& [node, groups] : groups_on) {
      if (groups.size() < 2) continue;
      receiving.clear();
      for (int g : groups) {
        if (g != gs && rows_of(gs, g) != nullptr) receiving.push_back(g);
      }
      if (receiving.size() < 2) continue;
      auto here = held.find({gs, node});
      shared.clear();
      int block = -1;
      for (int h = 0; h < K; ++h) {
        if (here != held.end() && here->second[h]) continue;  // nothing crosses (SenderOf)
        candidates.clear();
        for (int g : receiving) {
          if (held.at({g, node})[h]) candidates.push_back(g);
        }
        if (candidates.size() < 2) continue;
        auto it = std::find_if(shared.begin(), shared.end(),
                               [&](const auto& s) { return s.first == candidates; });
        if (it == shared.end()) {
          std::vector<int> participants;
          for (int a : candidates) {
            for (int b : candidates) {
              if (a != b && !Intersect(*rows_of(gs, a), *rows_of(gs, b)).empty()) {
                participants.push_back(a);
                break;
              }
            }
          }
          std::shared_ptr<StoreRows> rows;
          if (participants.size() >= 2) {
            std::sort(participants.begin(), participants.end(),
                      [&](int a, int b) { return step_of(a) < step_of(b); });
            rows = std::make_shared<StoreRows>();
            for (int g : participants) {
              rows->groups.push_back(g);
              rows->steps.push_back(step_of(g));
              rows->rows.push_back(*rows_of(gs, g));
              int64_t count = 0;
              for (const TokenRange& r : rows->rows.back()) count += r.size();
              rows->counts.push_back(count);
              rows->all_rows.insert(rows->all_rows.end(), rows->rows.back().begin(),
                                    rows->rows.back().end());
            }
            SortAndMerge(rows->all_rows);
            for (const TokenRange& r : rows->all_rows) rows->all_count += r.size();
          }
          shared.push_back({candidates, std::move(rows)});
          it = shared.end() - 1;
        }
        if (it->second == nullptr) continue;
        // The keeper: among the participants' receivers of h on the node, the one with the
        // fewest store rows so far (ties: participant order, then group order), so that
        // the crossings spread over the node's links.
        int keeper = -1;
        for (int g : it->second->groups) {
          for (int rank : NodeReceivers(g, h, node)) {
            if (keeper < 0 || store_load[rank] < store_load[keeper]) keeper = rank;
          }
        }
        store_load[keeper] += it->second->all_count;
        if (block < 0) {
          block = static_cast<int>(store_heads_.size() / K);
          store_heads_.resize(store_heads_.size() + K, -1);
          store_blocks_[{gs, node}] = block;
        }
        store_heads_[static_cast<size_t>(block) * K + h] = static_cast<int>(stores_.size());
        stores_.push_back({gs, h, node, keeper, it->second});
      }
    }
  }
  return absl::OkStatus();
}

const Hierarchy::NodeStore* Hierarchy::StoreOf(int source_group, int kv_head, int node) const {
  auto it = store_blocks_.find({source_group, node});
  if (it == store_blocks_.end()) return nullptr;
  const int index = store_heads_[static_cast<size_t>(it->second) * plan_.heads_kv + kv_head];
  return index < 0 ? nullptr : &stores_[index];
}

bool Hierarchy::TakesFromStore(int source_group, int kv_head, int node, int group) const {
  const NodeStore* store = StoreOf(source_group, kv_head, node);
  if (store == nullptr) return false;
  const std::vector<int>& groups = store->rows->groups;
  return std::find(groups.begin(), groups.end(), group) != groups.end();
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

// BuildRank's steps for one rank: its group's members and heads, the layout of the stores
// it keeps, and per sub-ring step the transfers it takes part in.
class Hierarchy::RankBuilder {
 public:
  RankBuilder(const Hierarchy& h, int rank)
      : h_(h), rank_(rank), my_node_(h.node_of_rank_.empty() ? 0 : h.node_of_rank_[rank]) {}

  // The rank's place (group, index, ring position), its group's members, its shard and
  // its heads.
  void AddMembers(RankHierarchy* r) const {
    const Plan& plan = h_.plan_;
    r->rank = rank_;
    r->group = h_.group_of_[rank_];
    r->index = h_.index_of_[rank_];
    r->ring_position = h_.position_of_[r->group];
    const PlanGroup& group = plan.groups[r->group];
    const int ratio = plan.heads_q / plan.heads_kv;
    std::vector<int> holders_of_kv(plan.heads_kv, 0);
    for (size_t i = 0; i < group.ranks.size(); ++i) {
      GroupMember m;
      m.rank = group.ranks[i];
      m.row_begin = h_.member_rows_[r->group][i];
      m.tokens = h_.shard_tokens(m.rank);
      m.q_heads = group.heads[i];
      std::sort(m.q_heads.begin(), m.q_heads.end());
      m.kv_heads = h_.kv_heads_[r->group][i];
      for (int kv : m.kv_heads) ++holders_of_kv[kv];
      r->members.push_back(std::move(m));
    }
    r->kv_grad_partial =
        std::any_of(holders_of_kv.begin(), holders_of_kv.end(), [](int n) { return n > 1; });
    r->shard = h_.shards_[rank_];
    r->shard_tokens = h_.shard_tokens(rank_);
    r->q_heads = r->members[r->index].q_heads;
    r->kv_heads = r->members[r->index].kv_heads;
    for (int qh : r->q_heads) r->kv_head_of_q.push_back(IndexOf(r->kv_heads, qh / ratio));
  }

  // This rank's stores (as keeper), by (arrival step, source group, KV head): their rows
  // in its store (r->store_rows counts them).
  void LayOutStores(RankHierarchy* r) {
    for (const NodeStore& ns : h_.stores_) {
      if (ns.keeper == rank_) kept_.push_back(&ns);
    }
    std::sort(kept_.begin(), kept_.end(), [](const NodeStore* a, const NodeStore* b) {
      return std::tie(a->rows->steps[0], a->source_group, a->kv_head) <
             std::tie(b->rows->steps[0], b->source_group, b->kv_head);
    });
    for (const NodeStore* ns : kept_) {
      std::vector<TokenRun>& runs = store_runs_[ns];
      for (const TokenRange& range : ns->rows->all_rows) {
        runs.push_back({range.begin, r->store_rows, range.size()});
        r->store_rows += range.size();
      }
    }
  }

  // What the rank receives at stage `st`: per KV head, from its holder, through a gateway
  // or a store's keeper on its node (fan-out), or as the gateway or keeper that forwards.
  void AddReceives(const RankHierarchy& r, Stage& st, SubRingStep& step) const {
    step.recv_group = h_.ring_[st.recv_from];
    for (size_t l = 0; l < r.kv_heads.size(); ++l) {
      const int h = r.kv_heads[l];
      const int local = static_cast<int>(l);
      if (const NodeStore* ns =
              h_.stores_.empty() ? nullptr : h_.StoreOf(step.recv_group, h, my_node_);
          ns != nullptr && h_.TakesFromStore(step.recv_group, h, my_node_, r.group)) {
        if (ns->keeper != rank_) {
          AddHead(step.fan_out_recv, ns->keeper, h, local);
          continue;
        }
        // The keeper at its own group's step: its rows are copied out of the store; its
        // node receivers get theirs from it.
        const std::vector<int>& groups = ns->rows->groups;
        const size_t j = std::find(groups.begin(), groups.end(), r.group) - groups.begin();
        step.store_fill.push_back({-1, h, local, RunsInStore(ns, ns->rows->rows[j]), st.recv_rows});
        for (int peer : h_.NodeReceivers(r.group, h, my_node_)) {
          if (peer != rank_) AddHead(step.fan_out_send, peer, h, local);
        }
        continue;
      }
      const int gateway = h_.GatewayOf(st.step, step.recv_group, h, rank_);
      if (gateway >= 0 && gateway != rank_) {
        AddHead(step.fan_out_recv, gateway, h, local);
        continue;
      }
      AddHead(step.recv, h_.SenderOf(step.recv_group, h, rank_), h, local);
      if (gateway != rank_) continue;
      for (int peer : h_.NodeReceivers(r.group, h, my_node_)) {
        if (peer != rank_) AddHead(step.fan_out_send, peer, h, local);
      }
    }
    step.recv_runs = std::move(st.recv_runs);
    step.recv_rows = st.recv_rows;
    step.recv_work = std::move(st.recv_work);
  }

  // What the rank sends at stage `st`: to each member of the destination group, the heads
  // it reads from this rank directly (not from a store, not through a gateway).
  void AddSends(const RankHierarchy& r, Stage& st, SubRingStep& step) const {
    const int gd = h_.ring_[st.send_to];
    const PlanGroup& dst = h_.plan_.groups[gd];
    for (size_t j = 0; j < dst.ranks.size(); ++j) {
      KvTransfer t;
      t.peer = dst.ranks[j];
      for (int h : h_.kv_heads_[gd][j]) {
        if (!h_.stores_.empty() && h_.TakesFromStore(r.group, h, h_.node_of_rank_[t.peer], gd)) {
          continue;
        }
        const int gateway = h_.GatewayOf(st.step, r.group, h, t.peer);
        if (h_.SenderOf(r.group, h, t.peer) == rank_ && (gateway < 0 || gateway == t.peer)) {
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

  // Segments this rank sends to keepers (in store order), and their sums coming back.
  void AddStoreSegments(const RankHierarchy& r, std::map<int, SubRingStep>& steps) const {
    for (const NodeStore& ns : h_.stores_) {
      if (ns.source_group != r.group || h_.SenderOf(r.group, ns.kv_head, ns.keeper) != rank_) {
        continue;
      }
      SubRingStep& step = steps[ns.rows->steps[0]];
      step.step = ns.rows->steps[0];
      StoreTransfer out{ns.keeper, ns.kv_head, IndexOf(r.kv_heads, ns.kv_head), {}, 0};
      AppendRunsIn(ns.rows->all_rows, r.group_runs, 0, out.runs);
      out.rows = ns.rows->all_count;
      // The summed partials come back in the last participant's gradient group.
      SubRingStep& last = steps[ns.rows->steps.back()];
      last.step = ns.rows->steps.back();
      last.store_return_recv.push_back(out);
      step.store_send.push_back(std::move(out));
    }
  }

  // The keeper's segments arrive at the first participant's step, with its K/V; it forwards
  // from the store at the steps of the other participants.
  void AddKeptStores(const RankHierarchy& r, std::map<int, SubRingStep>& steps) const {
    for (const NodeStore* ns : kept_) {
      const StoreRows& rows = *ns->rows;
      SubRingStep& first = steps[rows.steps[0]];
      first.step = rows.steps[0];
      const StoreTransfer in{h_.SenderOf(ns->source_group, ns->kv_head, rank_), ns->kv_head,
                             IndexOf(r.kv_heads, ns->kv_head), store_runs_.at(ns), rows.all_count};
      first.store_recv.push_back(in);
      SubRingStep& last = steps[rows.steps.back()];
      last.step = rows.steps.back();
      last.store_return_send.push_back(in);
      for (size_t j = 0; j < rows.groups.size(); ++j) {
        if (rows.groups[j] == r.group) continue;
        SubRingStep& step = steps[rows.steps[j]];
        step.step = rows.steps[j];
        for (int peer : h_.NodeReceivers(rows.groups[j], ns->kv_head, ns->node)) {
          auto it = std::find_if(step.store_fan_send.begin(), step.store_fan_send.end(),
                                 [&](const StoreFanOut& f) { return f.peer == peer; });
          if (it == step.store_fan_send.end()) {
            step.store_fan_send.push_back({peer, rows.counts[j], {}, {}});
            it = step.store_fan_send.end() - 1;
          }
          it->heads.push_back(ns->kv_head);
          it->runs.push_back(RunsInStore(ns, rows.rows[j]));
        }
      }
    }
  }

  // Orders a step's transfers the same way on both sides of each.
  void SortTransfers(SubRingStep& step) const {
    const std::vector<int>& index_of = h_.index_of_;
    // Peers in group order (then rank), so that both sides list transfers alike.
    for (std::vector<KvTransfer>* list : {&step.recv, &step.fan_out_recv, &step.fan_out_send}) {
      std::sort(list->begin(), list->end(), [&](const KvTransfer& a, const KvTransfer& b) {
        return std::tie(index_of[a.peer], a.peer) < std::tie(index_of[b.peer], b.peer);
      });
    }
    // A keeper's heads for one peer arrive from stores in (step, head) order: by head, as
    // the receiver lists them.
    for (StoreFanOut& f : step.store_fan_send) {
      std::vector<size_t> order(f.heads.size());
      std::iota(order.begin(), order.end(), size_t{0});
      std::sort(order.begin(), order.end(),
                [&](size_t a, size_t b) { return f.heads[a] < f.heads[b]; });
      StoreFanOut sorted{f.peer, f.rows, {}, {}};
      for (size_t i : order) {
        sorted.heads.push_back(f.heads[i]);
        sorted.runs.push_back(std::move(f.runs[i]));
      }
      f = std::move(sorted);
    }
    std::sort(step.store_fan_send.begin(), step.store_fan_send.end(),
              [](const StoreFanOut& a, const StoreFanOut& b) { return a.peer < b.peer; });
    // Returns by (peer, head) on both sides: messages of one pair match in posting order.
    for (std::vector<StoreTransfer>* list : {&step.store_return_send, &step.store_return_recv}) {
      std::sort(list->begin(), list->end(), [](const StoreTransfer& a, const StoreTransfer& b) {
        return std::tie(a.peer, a.kv_head) < std::tie(b.peer, b.kv_head);
      });
    }
  }

 private:
  // The store rows (of a store this rank keeps) that hold the global `rows`.
  std::vector<TokenRun> RunsInStore(const NodeStore* ns,
                                    const std::vector<TokenRange>& rows) const {
    std::vector<TokenRun> runs;
    AppendRunsIn(rows, store_runs_.at(ns), 0, runs);
    return runs;
  }

  const Hierarchy& h_;
  const int rank_;
  const int my_node_;
  std::vector<const NodeStore*> kept_;
  std::map<const NodeStore*, std::vector<TokenRun>> store_runs_;  // global -> store rows
};

absl::StatusOr<RankHierarchy> Hierarchy::BuildRank(const Layout& layout, int rank,
                                                   int64_t block_q) const {
  if (rank < 0 || rank >= plan_.num_ranks) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " is outside the plan's ", plan_.num_ranks, " ranks"));
  }
  RankBuilder builder(*this, rank);
  RankHierarchy r;
  builder.AddMembers(&r);
  HSAP_ASSIGN_OR_RETURN(Schedule sched,
                        BuildSchedule(layout, positions_, r.ring_position, block_q));
  r.group_runs = sched.local_runs;
  r.group_tokens = sched.local_rows;
  if (r.q_heads.empty()) return r;  // no heads: only the all-to-all moves this rank's shard
  r.local_work = std::move(sched.local_work);
  builder.LayOutStores(&r);

  std::map<int, SubRingStep> steps;
  for (Stage& st : sched.stages) {
    SubRingStep& step = steps[st.step];
    step.step = st.step;
    if (st.recv_from >= 0) builder.AddReceives(r, st, step);
    if (st.send_to >= 0) builder.AddSends(r, st, step);
  }
  builder.AddStoreSegments(r, steps);
  builder.AddKeptStores(r, steps);
  for (auto& [t, step] : steps) {
    builder.SortTransfers(step);
    if (step.recv_group >= 0 || step.send_group >= 0 || !step.store_send.empty() ||
        !step.store_recv.empty() || !step.store_fan_send.empty() ||
        !step.store_return_send.empty() || !step.store_return_recv.empty()) {
      r.steps.push_back(std::move(step));
    }
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
    for (const StoreTransfer& x : s.store_send) t.ring_sent += 2 * x.rows * D * es;
    for (const StoreTransfer& x : s.store_recv) t.ring_received += 2 * x.rows * D * es;
    for (const StoreFanOut& f : s.store_fan_send) {
      t.ring_sent += 2 * f.rows * f.heads.size() * D * es;
    }
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
    // Node stores: K/V in with the step, summed partials back after the last step; the
    // forwards from the store and their partials back.
    for (const StoreTransfer& x : s.store_send) {
      t.ring_sent += 2 * x.rows * D * es;
      t.ring_received += 2 * x.rows * D * 4;
    }
    for (const StoreTransfer& x : s.store_recv) {
      t.ring_received += 2 * x.rows * D * es;
      t.ring_sent += 2 * x.rows * D * 4;
    }
    for (const StoreFanOut& f : s.store_fan_send) {
      t.ring_sent += 2 * f.rows * f.heads.size() * D * es;
      t.ring_received += 2 * f.rows * f.heads.size() * D * 4;
    }
  }
  return t;
}

}  // namespace hsap
