#include "lib/planner/group_programs.h"

#include <algorithm>
#include <tuple>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "lib/sched/hierarchy.h"
#include "lib/sched/partition.h"

namespace hsap {
namespace {

// Hierarchy::SenderOf and GatewayOf as tables: holders_[g][kv] lists the members of group g
// holding KV head kv (group order). A receiver of index i in its own group reads from holder
// i mod count, among the holders on its node when there are any (hierarchy.h, 4. and 5.).
class Holders {
 public:
  Holders(const Plan& plan, absl::Span<const int> node_of_rank)
      : plan_(plan), index_of_(plan.IndexInGroup()), node_of_rank_(node_of_rank) {
    holders_.resize(plan.groups.size());
    shared_on_a_node_.resize(plan.groups.size());
    for (size_t g = 0; g < plan.groups.size(); ++g) {
      const std::vector<int>& ranks = plan.groups[g].ranks;
      holders_[g].assign(plan.heads_kv, {});
      for (size_t i = 0; i < ranks.size(); ++i) {
        for (int kv : plan.KvHeadsOf(static_cast<int>(g), static_cast<int>(i))) {
          holders_[g][kv].push_back(static_cast<int>(i));
        }
      }
      shared_on_a_node_[g].assign(plan.heads_kv, false);
      if (node_of_rank.empty()) continue;
      for (int kv = 0; kv < plan.heads_kv; ++kv) {
        const std::vector<int>& h = holders_[g][kv];
        for (size_t a = 0; a < h.size() && !shared_on_a_node_[g][kv]; ++a) {
          for (size_t b = a + 1; b < h.size(); ++b) {
            if (node_of_rank[ranks[h[a]]] == node_of_rank[ranks[h[b]]]) {
              shared_on_a_node_[g][kv] = true;
              break;
            }
          }
        }
      }
    }
  }

  int SenderOf(int source_group, int kv_head, int receiver) const {
    const std::vector<int>& h = holders_[source_group][kv_head];
    const std::vector<int>& ranks = plan_.groups[source_group].ranks;
    const int index = index_of_[receiver];
    if (!node_of_rank_.empty() && h.size() > 1) {
      const int node = node_of_rank_[receiver];
      int near = 0;
      for (int i : h) near += node_of_rank_[ranks[i]] == node;
      if (near > 0) {
        int wanted = index % near;
        for (int i : h) {
          if (node_of_rank_[ranks[i]] == node && wanted-- == 0) return ranks[i];
        }
      }
    }
    return ranks[h[index % h.size()]];
  }

  // Hierarchy::GatewayOf: -1 (direct), `receiver` (it is the gateway) or the gateway.
  int GatewayOf(int step, int source_group, int receiving_group, int kv_head, int receiver) const {
    if (!shared_on_a_node_[receiving_group][kv_head]) return -1;  // no node has two receivers
    const int node = node_of_rank_[receiver];
    if (node_of_rank_[SenderOf(source_group, kv_head, receiver)] == node) return -1;
    const int count = NodeReceivers(receiving_group, kv_head, node, nullptr);
    if (count < 2) return -1;
    int wanted = (kv_head + step) % count;
    const std::vector<int>& ranks = plan_.groups[receiving_group].ranks;
    for (int i : holders_[receiving_group][kv_head]) {
      if (node_of_rank_[ranks[i]] == node && wanted-- == 0) return ranks[i];
    }
    return -1;  // not reached
  }

  // The members of `group` on `node` holding `kv_head` (world ranks, group order), appended
  // to `out` when given; returns their number.
  int NodeReceivers(int group, int kv_head, int node, std::vector<int>* out) const {
    const std::vector<int>& ranks = plan_.groups[group].ranks;
    int count = 0;
    for (int i : holders_[group][kv_head]) {
      if (node_of_rank_[ranks[i]] != node) continue;
      ++count;
      if (out != nullptr) out->push_back(ranks[i]);
    }
    return count;
  }

  int IndexOf(int rank) const { return index_of_[rank]; }
  bool InterNode(int a, int b) const {
    return !node_of_rank_.empty() && node_of_rank_[a] != node_of_rank_[b];
  }
  int NodeOf(int rank) const { return node_of_rank_.empty() ? 0 : node_of_rank_[rank]; }

 private:
  const Plan& plan_;
  std::vector<int> index_of_;
  absl::Span<const int> node_of_rank_;
  std::vector<std::vector<std::vector<int>>> holders_;  // [group][kv head] -> member indices
  // [group][kv head]: some node holds two members of the group holding the head (the
  // precondition of a fan-out; always false on one node).
  std::vector<std::vector<bool>> shared_on_a_node_;
};

// What every ring position needs from every other, from one scan of the mask over the
// partition's placements (lib/sched/schedule.cc's ScanNeeds, every pair at once): rows(q, k)
// is the number of k's key rows that q's queries see (the union of the needed ranges, as
// BuildSchedule merges them), pairs(q, k) the visible pairs between q's queries and k's keys
// (what BuildWorkList counts over those rows). O(placements^2) in all, where a schedule per
// position would scan them once per position.
class PositionNeeds {
 public:
  PositionNeeds(const Layout& layout, const Partition& partition)
      : num_(partition.num_ranks()),
        rows_(static_cast<size_t>(num_) * num_, 0),
        pairs_(static_cast<size_t>(num_) * num_, 0) {
    const std::vector<Placement>& pls = partition.placements();
    const std::vector<MaskSlice>& slices = layout.slices();
    std::vector<std::vector<std::pair<int, TokenRange>>> needed(num_);  // [q] -> (k, keys)
    size_t first_q = 0;
    for (const MaskSlice& s : slices) {
      if (s.q_begin >= s.q_end || s.k_begin >= s.k_end) continue;
      const int64_t shift = s.k_begin - s.q_begin;
      const bool no_lo = s.diag_lo <= -kNoDiagLimit, no_hi = s.diag_hi >= kNoDiagLimit;
      while (pls[first_q].end <= s.q_begin) ++first_q;
      for (size_t qi = first_q; qi < pls.size() && pls[qi].begin < s.q_end; ++qi) {
        const Placement& qp = pls[qi];
        const int64_t q0 = std::max(s.q_begin, qp.begin), q1 = std::min(s.q_end, qp.end);
        const int64_t k0 = no_lo ? s.k_begin : std::max(s.k_begin, q0 + shift + s.diag_lo);
        const int64_t k1 = no_hi ? s.k_end : std::min(s.k_end, q1 - 1 + shift + s.diag_hi + 1);
        if (k0 >= k1) continue;
        for (size_t ki = partition.PlacementIndexOf(k0, qi); ki < pls.size() && pls[ki].begin < k1;
             ++ki) {
          const Placement& kp = pls[ki];
          const TokenRange keys{std::max(k0, kp.begin), std::min(k1, kp.end)};
          needed[qp.rank].push_back({kp.rank, keys});
          pairs_[Index(qp.rank, kp.rank)] += s.VisiblePairsIn(q0, q1, keys.begin, keys.end);
        }
      }
    }
    for (int q = 0; q < num_; ++q) {
      std::vector<std::pair<int, TokenRange>>& list = needed[q];
      std::sort(list.begin(), list.end(), [](const auto& a, const auto& b) {
        return a.first != b.first ? a.first < b.first : a.second.begin < b.second.begin;
      });
      // The union's size, per key position.
      for (size_t i = 0; i < list.size();) {
        const int k = list[i].first;
        int64_t end = list[i].second.begin, rows = 0;
        for (; i < list.size() && list[i].first == k; ++i) {
          const TokenRange& r = list[i].second;
          rows += std::max<int64_t>(0, r.end - std::max(r.begin, end));
          end = std::max(end, r.end);
        }
        rows_[Index(q, k)] = rows;
      }
    }
  }

  int64_t rows(int q, int k) const { return rows_[Index(q, k)]; }
  int64_t pairs(int q, int k) const { return pairs_[Index(q, k)]; }

 private:
  size_t Index(int q, int k) const { return static_cast<size_t>(q) * num_ + k; }

  int num_;
  std::vector<int64_t> rows_, pairs_;  // [q * num + k]
};

// Adds `heads` heads for `peer` to a (peer, heads) list.
void AddHeads(std::vector<std::pair<int, int>>& list, int peer, int heads) {
  auto it = std::find_if(list.begin(), list.end(), [&](const auto& x) { return x.first == peer; });
  if (it == list.end()) {
    list.push_back({peer, heads});
  } else {
    it->second += heads;
  }
}

// The node stores of each rank (hierarchy.h, 6.), by step: the segments it sends (as
// (keeper, rows), in the hierarchy's store order), and as a keeper the segments it receives
// (as (holder, rows), by source group and head) and its forwards from the store (as
// (receiver, rows), one per head).
struct StoresByRank {
  StoresByRank(const Hierarchy& h, const Holders& holders, const std::vector<int>& group_of,
               int num_ranks)
      : sent(num_ranks),
        received(num_ranks),
        forwarded(num_ranks),
        returned(num_ranks),
        taken_back(num_ranks) {
    std::vector<int> receivers;
    for (const Hierarchy::NodeStore& ns : h.stores()) {
      const Hierarchy::StoreRows& rows = *ns.rows;
      const int holder = holders.SenderOf(ns.source_group, ns.kv_head, ns.keeper);
      sent[holder].push_back({rows.steps[0], ns.keeper, rows.all_count});
      received[ns.keeper].push_back(
          {rows.steps[0], holder, rows.all_count, ns.source_group, ns.kv_head});
      returned[ns.keeper].push_back(
          {rows.steps.back(), holder, rows.all_count, holder, ns.kv_head});
      taken_back[holder].push_back(
          {rows.steps.back(), ns.keeper, rows.all_count, ns.keeper, ns.kv_head});
      for (size_t j = 0; j < rows.groups.size(); ++j) {
        if (rows.groups[j] == group_of[ns.keeper]) continue;
        receivers.clear();
        holders.NodeReceivers(rows.groups[j], ns.kv_head, ns.node, &receivers);
        for (int peer : receivers) {
          forwarded[ns.keeper].push_back({rows.steps[j], peer, rows.counts[j]});
        }
      }
    }
    for (auto* lists : {&sent, &received, &forwarded, &returned, &taken_back}) {
      for (std::vector<Entry>& list : *lists) {
        std::stable_sort(list.begin(), list.end(), [](const Entry& a, const Entry& b) {
          return std::tie(a.step, a.source_group, a.kv_head) <
                 std::tie(b.step, b.source_group, b.kv_head);
        });
      }
    }
  }
  struct Entry {
    int step;
    int peer;
    int64_t rows;
    // BuildRank's order within a step: received by (source group, head), returns by
    // (peer, head).
    int source_group = 0, kv_head = 0;
  };
  // [rank], by step; returned / taken_back: a store's summed partials, keeper / holder.
  std::vector<std::vector<Entry>> sent, received, forwarded, returned, taken_back;
};

// The peers of one ring step of one rank. (peer, heads), in the peer's group order: receives
// from holders, the fan-out received from a gateway and forwarded by this rank as a gateway,
// and sends to the next group. Node stores (hierarchy.h, 6.), as (peer, rows): segments sent
// and received, and the summed partials returned and taken back; forwards from this rank's
// store as (peer, heads, rows).
struct StepPeers {
  std::vector<std::pair<int, int>> recv, fan_recv, fan_send, send;
  std::vector<std::pair<int, int64_t>> store_send, store_recv, store_return_send, store_return_recv;
  std::vector<std::tuple<int, int, int64_t>> store_fan;

  void Clear() {
    recv.clear();
    fan_recv.clear();
    fan_send.clear();
    send.clear();
    store_send.clear();
    store_recv.clear();
    store_return_send.clear();
    store_return_recv.clear();
    store_fan.clear();
  }
};

// The K/V stages of member `self` of the group at ring position `position`, appended to
// both passes of `program`: Hierarchy::BuildRank's sub-ring steps (at step t the position
// receives from position - t the rows its queries see and sends to position + t the rows
// that position's queries see; a head whose holder is on another node comes through the
// node's gateway, which forwards it to the other receivers on its node; steps that move
// nothing are absent) written as ProgramOf (lib/sched/transfers.cc) writes them: per stage
// the sends then the receives, one message per peer with K and V of its heads, then the
// fan-out (forwarded, then received); backward adds the fp32 dK/dV partials of the fan-out
// back to the gateway, then those of the received rows to their sender and of the sent
// rows from their receiver.
class RankStages {
 public:
  RankStages(const PositionNeeds& needs, int position, const RankHierarchy& self,
             const std::vector<int>& ring,
             const std::vector<std::vector<std::vector<int>>>& kv_heads, const Plan& plan,
             const Holders& holders, const Hierarchy& hierarchy, const StoresByRank& stores,
             int head_dim, uint64_t element_bytes)
      : needs_(needs),
        position_(position),
        self_(self),
        ring_(ring),
        kv_heads_(kv_heads),
        plan_(plan),
        holders_(holders),
        hierarchy_(hierarchy),
        head_dim_(head_dim),
        element_bytes_(element_bytes),
        node_(holders.NodeOf(self.rank)),
        any_store_(!hierarchy.stores().empty()),
        sent_stores_(stores.sent[self.rank]),
        received_(stores.received[self.rank]),
        forwarded_(stores.forwarded[self.rank]),
        returned_(stores.returned[self.rank]),
        taken_back_(stores.taken_back[self.rank]) {}

  void Append(RankProgram* program) {
    const int num_positions = static_cast<int>(ring_.size());
    StepPeers peers;
    for (int t = 1; t < num_positions; ++t) {
      const int src = (position_ - t + num_positions) % num_positions;
      const int dst = (position_ + t) % num_positions;
      const int64_t recv_rows = needs_.rows(position_, src);
      const int64_t send_rows = needs_.rows(dst, position_);
      peers.Clear();
      if (recv_rows > 0) CollectReceives(t, src, &peers);
      if (send_rows > 0) CollectSends(t, dst, &peers);
      CollectStoreEntries(t, &peers);
      if (recv_rows == 0 && peers.send.empty() && peers.store_send.empty() &&
          peers.store_recv.empty() && peers.store_fan.empty() && peers.store_return_send.empty() &&
          peers.store_return_recv.empty()) {
        continue;
      }
      for (PassProgram* pass : {&program->forward, &program->backward}) {
        ProgramStage& s = pass->stages.emplace_back();
        s.step = t;
        s.pairs = recv_rows == 0 ? 0 : needs_.pairs(position_, src);
        WriteKv(peers, recv_rows, send_rows, &s);
        if (pass == &program->backward) WriteGrad(peers, recv_rows, send_rows, &s);
      }
    }
  }

 private:
  // The heads this rank receives at step t from ring position `src`: from their holder, from
  // a gateway or a node store's keeper on its node (fan_recv), or as the gateway or keeper
  // that forwards them to the other receivers on its node (fan_send).
  void CollectReceives(int t, int src, StepPeers* p) {
    for (int h : self_.kv_heads) {
      if (any_store_ && hierarchy_.TakesFromStore(ring_[src], h, node_, self_.group)) {
        const Hierarchy::NodeStore* ns = hierarchy_.StoreOf(ring_[src], h, node_);
        if (ns->keeper != self_.rank) {
          AddHeads(p->fan_recv, ns->keeper, 1);
          continue;
        }
        node_receivers_.clear();
        holders_.NodeReceivers(self_.group, h, node_, &node_receivers_);
        for (int peer : node_receivers_) {
          if (peer != self_.rank) AddHeads(p->fan_send, peer, 1);
        }
        continue;
      }
      const int gateway = holders_.GatewayOf(t, ring_[src], self_.group, h, self_.rank);
      if (gateway >= 0 && gateway != self_.rank) {
        AddHeads(p->fan_recv, gateway, 1);
        continue;
      }
      AddHeads(p->recv, holders_.SenderOf(ring_[src], h, self_.rank), 1);
      if (gateway != self_.rank) continue;
      node_receivers_.clear();
      holders_.NodeReceivers(self_.group, h, holders_.NodeOf(self_.rank), &node_receivers_);
      for (int peer : node_receivers_) {
        if (peer != self_.rank) AddHeads(p->fan_send, peer, 1);
      }
    }
    const auto by_index = [&](const auto& a, const auto& b) {
      return std::make_pair(holders_.IndexOf(a.first), a.first) <
             std::make_pair(holders_.IndexOf(b.first), b.first);
    };
    for (auto* list : {&p->recv, &p->fan_recv, &p->fan_send}) {
      std::sort(list->begin(), list->end(), by_index);
    }
  }

  // The heads this rank sends at step t to each member of the group at ring position `dst`
  // that reads them from this rank directly (not through a gateway or a node store).
  void CollectSends(int t, int dst, StepPeers* p) const {
    const int gd = ring_[dst];
    const PlanGroup& to = plan_.groups[gd];
    for (size_t j = 0; j < to.ranks.size(); ++j) {
      const int peer = to.ranks[j];
      int heads = 0;
      for (int h : kv_heads_[gd][j]) {
        if (holders_.SenderOf(self_.group, h, peer) != self_.rank) continue;
        if (any_store_ && hierarchy_.TakesFromStore(self_.group, h, holders_.NodeOf(peer), gd)) {
          continue;
        }
        const int gateway = holders_.GatewayOf(t, self_.group, gd, h, peer);
        heads += gateway < 0 || gateway == peer;
      }
      if (heads > 0) p->send.push_back({peer, heads});
    }
  }

  // This rank's node-store entries of step t (the lists are by step; each cursor moves on).
  void CollectStoreEntries(int t, StepPeers* p) {
    for (; next_sent_ < sent_stores_.size() && sent_stores_[next_sent_].step == t; ++next_sent_) {
      p->store_send.push_back({sent_stores_[next_sent_].peer, sent_stores_[next_sent_].rows});
    }
    for (; next_received_ < received_.size() && received_[next_received_].step == t;
         ++next_received_) {
      p->store_recv.push_back({received_[next_received_].peer, received_[next_received_].rows});
    }
    for (; next_returned_ < returned_.size() && returned_[next_returned_].step == t;
         ++next_returned_) {
      p->store_return_send.push_back(
          {returned_[next_returned_].peer, returned_[next_returned_].rows});
    }
    for (; next_taken_back_ < taken_back_.size() && taken_back_[next_taken_back_].step == t;
         ++next_taken_back_) {
      p->store_return_recv.push_back(
          {taken_back_[next_taken_back_].peer, taken_back_[next_taken_back_].rows});
    }
    for (; next_forwarded_ < forwarded_.size() && forwarded_[next_forwarded_].step == t;
         ++next_forwarded_) {
      const StoresByRank::Entry& f = forwarded_[next_forwarded_];
      auto it = std::find_if(p->store_fan.begin(), p->store_fan.end(),
                             [&](const auto& x) { return std::get<0>(x) == f.peer; });
      if (it == p->store_fan.end()) {
        p->store_fan.push_back({f.peer, 1, f.rows});
      } else {
        ++std::get<1>(*it);
      }
    }
    std::sort(p->store_fan.begin(), p->store_fan.end());
  }

  // K and V (dK and dV) of `rows` rows of `heads` heads.
  Transfer Message(int peer, bool out, TransferKind kind, int64_t rows, int heads,
                   uint64_t bytes_per_element) const {
    Transfer m{peer, out, kind,
               2 * static_cast<uint64_t>(rows) * heads * head_dim_ * bytes_per_element};
    m.inter_node = holders_.InterNode(self_.rank, peer);
    return m;
  }

  // Both passes: K and V sent, then received, then the fan-out (forwarded, then received).
  void WriteKv(const StepPeers& p, int64_t recv_rows, int64_t send_rows, ProgramStage* s) const {
    const uint64_t eb = element_bytes_;
    for (auto [peer, heads] : p.send) {
      s->kv.push_back(Message(peer, true, TransferKind::kKv, send_rows, heads, eb));
    }
    for (auto [peer, rows] : p.store_send) {
      s->kv.push_back(Message(peer, true, TransferKind::kKvStore, rows, 1, eb));
    }
    for (auto [peer, heads] : p.recv) {
      s->kv.push_back(Message(peer, false, TransferKind::kKv, recv_rows, heads, eb));
    }
    for (auto [peer, rows] : p.store_recv) {
      s->kv.push_back(Message(peer, false, TransferKind::kKvStore, rows, 1, eb));
    }
    for (auto [peer, heads] : p.fan_send) {
      s->fan_out_kv.push_back(Message(peer, true, TransferKind::kKvFanOut, recv_rows, heads, eb));
    }
    for (auto [peer, heads, rows] : p.store_fan) {
      s->fan_out_kv.push_back(Message(peer, true, TransferKind::kKvFanOut, rows, heads, eb));
    }
    for (auto [peer, heads] : p.fan_recv) {
      s->fan_out_kv.push_back(Message(peer, false, TransferKind::kKvFanOut, recv_rows, heads, eb));
    }
  }

  // Backward: the fp32 dK/dV partials of the fan-out back to the gateway, then those of the
  // received rows to their sender and of the sent rows from their receiver, then a node
  // store's summed partials, in its last participant's gradient group.
  void WriteGrad(const StepPeers& p, int64_t recv_rows, int64_t send_rows, ProgramStage* s) const {
    constexpr uint64_t kF32 = sizeof(float);
    for (auto [peer, heads] : p.fan_recv) {
      s->fan_in_grad.push_back(
          Message(peer, true, TransferKind::kKvGradFanIn, recv_rows, heads, kF32));
    }
    for (auto [peer, heads] : p.fan_send) {
      s->fan_in_grad.push_back(
          Message(peer, false, TransferKind::kKvGradFanIn, recv_rows, heads, kF32));
    }
    for (auto [peer, heads, rows] : p.store_fan) {
      s->fan_in_grad.push_back(Message(peer, false, TransferKind::kKvGradFanIn, rows, heads, kF32));
    }
    for (auto [peer, heads] : p.recv) {
      s->grad.push_back(Message(peer, true, TransferKind::kKvGrad, recv_rows, heads, kF32));
    }
    for (auto [peer, heads] : p.send) {
      s->grad.push_back(Message(peer, false, TransferKind::kKvGrad, send_rows, heads, kF32));
    }
    for (auto [peer, rows] : p.store_return_send) {
      s->grad.push_back(Message(peer, true, TransferKind::kKvGradReturn, rows, 1, kF32));
    }
    for (auto [peer, rows] : p.store_return_recv) {
      s->grad.push_back(Message(peer, false, TransferKind::kKvGradReturn, rows, 1, kF32));
    }
  }

  const PositionNeeds& needs_;
  const int position_;
  const RankHierarchy& self_;
  const std::vector<int>& ring_;
  const std::vector<std::vector<std::vector<int>>>& kv_heads_;
  const Plan& plan_;
  const Holders& holders_;
  const Hierarchy& hierarchy_;
  const int head_dim_;
  const uint64_t element_bytes_;
  const int node_;
  const bool any_store_;  // else no lookups (a hash each)
  const std::vector<StoresByRank::Entry>& sent_stores_;
  const std::vector<StoresByRank::Entry>& received_;
  const std::vector<StoresByRank::Entry>& forwarded_;
  const std::vector<StoresByRank::Entry>& returned_;
  const std::vector<StoresByRank::Entry>& taken_back_;
  size_t next_sent_ = 0, next_received_ = 0, next_forwarded_ = 0, next_returned_ = 0,
         next_taken_back_ = 0;
  std::vector<int> node_receivers_;  // scratch
};

// RankStages(...).Append(program): the K/V stages of one rank, both passes.
void AppendStages(const PositionNeeds& needs, int position, const RankHierarchy& self,
                  const std::vector<int>& ring,
                  const std::vector<std::vector<std::vector<int>>>& kv_heads, const Plan& plan,
                  const Holders& holders, const Hierarchy& hierarchy, const StoresByRank& stores,
                  int head_dim, uint64_t element_bytes, RankProgram* program) {
  RankStages(needs, position, self, ring, kv_heads, plan, holders, hierarchy, stores, head_dim,
             element_bytes)
      .Append(program);
}

}  // namespace

absl::StatusOr<std::vector<RankProgram>> PlanProgramsByGroup(const Layout& layout, const Plan& plan,
                                                             const LayerShape& shape) {
  return PlanProgramsByGroup(layout, plan, absl::Span<const int>(), shape);
}

absl::StatusOr<std::vector<RankProgram>> PlanProgramsByGroup(const Layout& layout, const Plan& plan,
                                                             absl::Span<const int> node_of_rank,
                                                             const LayerShape& shape) {
  if (plan.heads_q != shape.heads_q || plan.heads_kv != shape.heads_kv) {
    return absl::InvalidArgumentError(
        absl::StrCat("the plan is for ", plan.heads_q, "/", plan.heads_kv,
                     " query/KV heads but the layer has ", shape.heads_q, "/", shape.heads_kv));
  }
  HSAP_ASSIGN_OR_RETURN(Hierarchy h, Hierarchy::Create(layout, plan, node_of_rank));
  const int num_groups = static_cast<int>(plan.groups.size());
  const std::vector<int> ring = plan.RingOrder();
  std::vector<int> position_of(num_groups);
  for (int p = 0; p < num_groups; ++p) position_of[ring[p]] = p;
  std::vector<std::vector<std::vector<int>>> kv_heads(num_groups);
  for (int g = 0; g < num_groups; ++g) {
    for (size_t i = 0; i < plan.groups[g].ranks.size(); ++i) {
      kv_heads[g].push_back(plan.KvHeadsOf(g, static_cast<int>(i)));
    }
  }
  const Holders holders(plan, node_of_rank);
  const PositionNeeds needs(layout, h.positions());
  const StoresByRank stores(h, holders, plan.GroupOfRank(), plan.num_ranks);

  std::vector<RankProgram> programs(plan.num_ranks);
  for (int g = 0; g < num_groups; ++g) {
    const PlanGroup& group = plan.groups[g];
    const int position = position_of[g];
    RankHierarchy r;
    r.group = g;
    r.ring_position = position;
    r.group_tokens = h.positions().local_tokens(position);
    std::vector<int> holders_of_kv(plan.heads_kv, 0);
    int64_t row = 0;
    for (size_t i = 0; i < group.ranks.size(); ++i) {
      GroupMember m;
      m.rank = group.ranks[i];
      m.row_begin = row;
      m.tokens = h.shard_tokens(m.rank);
      row += m.tokens;
      m.q_heads = group.heads[i];
      std::sort(m.q_heads.begin(), m.q_heads.end());
      m.kv_heads = kv_heads[g][i];
      for (int kv : m.kv_heads) ++holders_of_kv[kv];
      r.members.push_back(std::move(m));
    }
    r.kv_grad_partial =
        std::any_of(holders_of_kv.begin(), holders_of_kv.end(), [](int n) { return n > 1; });
    for (size_t i = 0; i < group.ranks.size(); ++i) {
      r.rank = group.ranks[i];
      r.index = static_cast<int>(i);
      r.shard_tokens = r.members[i].tokens;
      r.q_heads = r.members[i].q_heads;
      r.kv_heads = r.members[i].kv_heads;
      // The all-to-alls from ProgramOf; the stages of a rank with heads appended here.
      r.local_work.visible_pairs = r.q_heads.empty() ? 0 : needs.pairs(position, position);
      RankProgram& program = programs[r.rank] =
          ProgramOf(r, shape.head_dim, shape.dtype, node_of_rank);
      if (!r.q_heads.empty()) {
        AppendStages(needs, position, r, ring, kv_heads, plan, holders, h, stores, shape.head_dim,
                     DTypeSize(shape.dtype), &program);
      }
    }
  }
  return programs;
}

absl::StatusOr<RunSimulation> SimulateRun(const Cluster& cluster, const Workload& workload,
                                          const Plan& plan) {
  const int64_t cu[] = {0, workload.seq_len};
  const MaskKind kind[] = {workload.causal ? MaskKind::kCausal : MaskKind::kFull};
  HSAP_ASSIGN_OR_RETURN(Layout row, Layout::FromDocuments(cu, kind));
  const ModelSpec& m = workload.model;
  const LayerShape shape{m.heads_q, m.heads_kv, m.head_dim,
                         m.dtype_bytes == 4 ? DType::kF32 : DType::kBF16};
  std::vector<int> node_of_rank;
  for (const Device& d : cluster.devices) node_of_rank.push_back(d.node);
  HSAP_ASSIGN_OR_RETURN(std::vector<RankProgram> programs,
                        PlanProgramsByGroup(row, plan, node_of_rank, shape));
  return SimulatePrograms(cluster, programs, m.head_dim);
}

absl::Status ChooseNodeStores(const Cluster& cluster, const Workload& workload, Plan* plan,
                              RunSimulation* run) {
  if (cluster.size() > kNodeStoreDevices) return absl::OkStatus();
  // Stores need two groups on one node.
  absl::flat_hash_map<int, int> group_on;  // node -> a group with a member there
  bool shared = false;
  for (size_t g = 0; g < plan->groups.size() && !shared; ++g) {
    for (int rank : plan->groups[g].ranks) {
      auto [it, inserted] = group_on.emplace(cluster.devices[rank].node, static_cast<int>(g));
      if (!inserted && it->second != static_cast<int>(g)) shared = true;
    }
  }
  if (!shared) return absl::OkStatus();
  Plan with = *plan;
  with.node_stores = true;
  HSAP_ASSIGN_OR_RETURN(RunSimulation priced, SimulateRun(cluster, workload, with));
  if (priced.Seconds() < run->Seconds()) {
    *plan = std::move(with);
    *run = std::move(priced);
  }
  return absl::OkStatus();
}

}  // namespace hsap
