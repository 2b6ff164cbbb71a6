#include "lib/sched/schedule.h"

#include <algorithm>
#include <map>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace hsap {
namespace {

// Calls emit(query_rank, key_rank, key range, slice index) for every piece of the (query,
// key) plane where queries of query_rank see keys of key_rank: for each slice and each
// placement meeting its query range, the keys seen by those queries (a band over a run of
// consecutive queries sees one contiguous key range), cut at the key placements. `want`
// filters by (query_rank, key_rank) before the key placements are visited.
template <typename Want, typename Emit>
void ScanNeeds(const Layout& layout, const Partition& partition, Want&& want, Emit&& emit) {
  const std::vector<Placement>& pls = partition.placements();
  const std::vector<MaskSlice>& slices = layout.slices();
  size_t first_q = 0;  // slices come sorted by q_begin: the query placement only advances
  for (size_t i = 0; i < slices.size(); ++i) {
    const MaskSlice& s = slices[i];
    if (s.q_begin >= s.q_end || s.k_begin >= s.k_end) continue;
    const int64_t shift = s.k_begin - s.q_begin;
    const bool no_lo = s.diag_lo <= -kNoDiagLimit, no_hi = s.diag_hi >= kNoDiagLimit;
    while (pls[first_q].end <= s.q_begin) ++first_q;
    for (size_t qi = first_q; qi < pls.size() && pls[qi].begin < s.q_end; ++qi) {
      const Placement& qp = pls[qi];
      if (!want(qp.rank, -1)) continue;
      const int64_t q0 = std::max(s.q_begin, qp.begin), q1 = std::min(s.q_end, qp.end);
      // Keys k with diag_lo <= (k - q) - shift <= diag_hi for some q in [q0, q1).
      const int64_t k0 = no_lo ? s.k_begin : std::max(s.k_begin, q0 + shift + s.diag_lo);
      const int64_t k1 = no_hi ? s.k_end : std::min(s.k_end, q1 - 1 + shift + s.diag_hi + 1);
      if (k0 >= k1) continue;
      // Keys are usually near their queries (documents): search from the query placement.
      for (size_t ki = partition.PlacementIndexOf(k0, qi); ki < pls.size() && pls[ki].begin < k1;
           ++ki) {
        const Placement& kp = pls[ki];
        if (!want(qp.rank, kp.rank)) continue;
        emit(qp.rank, kp.rank, TokenRange{std::max(k0, kp.begin), std::min(k1, kp.end)}, i);
      }
    }
  }
}

}  // namespace

void SortAndMerge(std::vector<TokenRange>& ranges) {
  std::sort(ranges.begin(), ranges.end(),
            [](const TokenRange& a, const TokenRange& b) { return a.begin < b.begin; });
  size_t n = 0;
  for (const TokenRange& r : ranges) {
    if (n > 0 && ranges[n - 1].end >= r.begin) {
      ranges[n - 1].end = std::max(ranges[n - 1].end, r.end);
    } else {
      ranges[n++] = r;
    }
  }
  ranges.resize(n);
}

namespace {

void SortUnique(std::vector<size_t>& v) {
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
}

std::vector<MaskSlice> Pick(const std::vector<MaskSlice>& slices,
                            const std::vector<size_t>& index) {
  std::vector<MaskSlice> out;
  out.reserve(index.size());
  for (size_t i : index) out.push_back(slices[i]);
  return out;
}

int64_t CountRows(const std::vector<TokenRange>& ranges) {
  int64_t n = 0;
  for (const TokenRange& r : ranges) n += r.size();
  return n;
}

// a minus b; both sorted and merged.
std::vector<TokenRange> Subtract(const std::vector<TokenRange>& a,
                                 const std::vector<TokenRange>& b) {
  std::vector<TokenRange> out;
  size_t j = 0;
  for (TokenRange r : a) {
    while (j < b.size() && b[j].end <= r.begin) ++j;
    for (size_t k = j; k < b.size() && b[k].begin < r.end; ++k) {
      if (b[k].begin > r.begin) out.push_back({r.begin, b[k].begin});
      r.begin = std::max(r.begin, b[k].end);
    }
    if (r.begin < r.end) out.push_back(r);
  }
  return out;
}

}  // namespace

std::vector<TokenRange> Intersect(const std::vector<TokenRange>& a,
                                  const std::vector<TokenRange>& b) {
  std::vector<TokenRange> out;
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const int64_t lo = std::max(a[i].begin, b[j].begin), hi = std::min(a[i].end, b[j].end);
    if (lo < hi) out.push_back({lo, hi});
    (a[i].end < b[j].end) ? ++i : ++j;
  }
  return out;
}

namespace {

// The rows covered by at least two of `lists` (each sorted and merged).
std::vector<TokenRange> CoveredTwice(const std::vector<const std::vector<TokenRange>*>& lists) {
  std::vector<std::pair<int64_t, int>> events;
  for (const auto* list : lists) {
    for (const TokenRange& r : *list) {
      events.push_back({r.begin, +1});
      events.push_back({r.end, -1});
    }
  }
  std::sort(events.begin(), events.end());
  std::vector<TokenRange> out;
  int depth = 0;
  int64_t open = 0;
  for (const auto& [at, delta] : events) {
    const int before = depth;
    depth += delta;
    if (before < 2 && depth >= 2) open = at;
    if (before >= 2 && depth < 2 && open < at) {
      if (!out.empty() && out.back().end == open) {
        out.back().end = at;
      } else {
        out.push_back({open, at});
      }
    }
  }
  return out;
}

// The relay of the rows of one owner shared by several ranks of one node.
struct Relay {
  int gateway = -1;
  std::vector<TokenRange> shared;  // sorted, merged
};

// Relays of every (owner, node) pair with shared rows, from the key rows every rank needs
// of every rank on another node (`foreign`, keyed owner * R + query rank, merged).
std::map<std::pair<int, int>, Relay> PlanRelays(
    int R, absl::Span<const int> node_of_rank,
    const absl::flat_hash_map<int64_t, std::vector<TokenRange>>& foreign) {
  std::map<int, std::vector<int>> ranks_of_node;
  for (int r = 0; r < R; ++r) ranks_of_node[node_of_rank[r]].push_back(r);
  std::vector<int64_t> load(R, 0);  // shared rows each rank relays so far
  std::map<std::pair<int, int>, Relay> relays;
  for (int o = 0; o < R; ++o) {
    for (const auto& [node, members] : ranks_of_node) {
      if (node == node_of_rank[o]) continue;
      std::vector<const std::vector<TokenRange>*> needs;
      std::vector<int> needing;
      for (int m : members) {
        auto it = foreign.find(int64_t{o} * R + m);
        if (it == foreign.end() || it->second.empty()) continue;
        needs.push_back(&it->second);
        needing.push_back(m);
      }
      if (needs.size() < 2) continue;
      Relay relay;
      relay.shared = CoveredTwice(needs);
      if (relay.shared.empty()) continue;
      for (size_t i = 0; i < needing.size(); ++i) {
        if (Intersect(*needs[i], relay.shared).empty()) continue;
        if (relay.gateway < 0 || load[needing[i]] < load[relay.gateway]) {
          relay.gateway = needing[i];
        }
      }
      load[relay.gateway] += CountRows(relay.shared);
      relays.emplace(std::make_pair(o, node), std::move(relay));
    }
  }
  return relays;
}

const Relay* FindRelay(const std::map<std::pair<int, int>, Relay>& relays, int owner, int node) {
  auto it = relays.find({owner, node});
  return it == relays.end() ? nullptr : &it->second;
}

}  // namespace

std::vector<TokenRange> LocalRows(const std::vector<TokenRun>& runs) {
  std::vector<TokenRange> rows;
  rows.reserve(runs.size());
  for (const TokenRun& run : runs) rows.push_back({run.local_begin, run.local_begin + run.length});
  return rows;
}

void AppendRunsIn(const std::vector<TokenRange>& ranges, const std::vector<TokenRun>& runs,
                  int64_t offset, std::vector<TokenRun>& out) {
  size_t j = 0;
  for (const TokenRange& r : ranges) {
    int64_t at = r.begin;
    while (at < r.end) {
      while (runs[j].global_begin + runs[j].length <= at) ++j;
      const TokenRun& run = runs[j];
      const int64_t end = std::min(r.end, run.global_begin + run.length);
      out.push_back({at, offset + run.local_begin + (at - run.global_begin), end - at});
      at = end;
    }
  }
}

absl::flat_hash_map<int64_t, std::vector<TokenRange>> KeyRowsNeeded(
    const Layout& layout, const Partition& partition,
    absl::FunctionRef<bool(int query_rank, int key_rank)> want) {
  const int64_t R = partition.num_ranks();
  absl::flat_hash_map<int64_t, std::vector<TokenRange>> needs;
  ScanNeeds(
      layout, partition, [&](int q, int k) { return q != k && want(q, k); },
      [&](int q, int k, TokenRange r, size_t) { needs[k * R + q].push_back(r); });
  for (auto& [pair, ranges] : needs) SortAndMerge(ranges);
  return needs;
}

size_t Schedule::first_fan_out() const {
  for (size_t i = 0; i < stages.size(); ++i) {
    if (stages[i].step >= num_ranks) return i;
  }
  return stages.size();
}

int64_t Schedule::rows_sent() const {
  int64_t n = 0;
  for (const Stage& s : stages) n += s.send_rows;
  return n;
}

int64_t Schedule::rows_received() const {
  int64_t n = 0;
  for (const Stage& s : stages) n += s.recv_rows;
  return n;
}

namespace {

// BuildSchedule's state for one rank: what it needs of every peer and every peer of it,
// the relays across nodes, and the buffers it keeps as a gateway.
class ScheduleBuilder {
 public:
  ScheduleBuilder(const Layout& layout, const Partition& partition, int rank, int64_t block_q,
                  absl::Span<const int> node_of_rank, bool multi_node)
      : layout_(layout),
        partition_(partition),
        rank_(rank),
        block_q_(block_q),
        node_of_rank_(node_of_rank),
        R_(partition.num_ranks()),
        multi_node_(multi_node),
        my_node_(multi_node ? node_of_rank[rank] : 0),
        recv_(R_),
        send_(R_),
        recv_slices_(R_) {}

  // Per peer p: the keys of p that this rank needs (recv), the keys of this rank that p
  // needs (send), and the slices behind the receives (for the work lists). On several
  // nodes also every pair across nodes (foreign, keyed owner * R + query rank), which the
  // relays are planned on.
  void ScanPeers() {
    const int R = R_, rank = rank_;
    ScanNeeds(
        layout_, partition_,
        [&](int q, int k) { return k < 0 || q == rank || k == rank || Cross(q, k); },
        [&](int q, int k, TokenRange r, size_t slice) {
          if (q == rank) {
            recv_[k].push_back(r);
            recv_slices_[k].push_back(slice);
          } else if (k == rank) {
            send_[q].push_back(r);
          }
          if (Cross(q, k)) foreign_[int64_t{k} * R + q].push_back(r);
        });
    for (auto& [pair, ranges] : foreign_) SortAndMerge(ranges);
    if (multi_node_) relays_ = PlanRelays(R, node_of_rank_, foreign_);
  }

  // The schedule's rows and its local work.
  absl::Status AddLocal(Schedule* sched) {
    sched->rank = rank_;
    sched->num_ranks = R_;
    sched->local_rows = partition_.local_tokens(rank_);
    sched->local_runs = partition_.Runs(rank_);
    SortUnique(recv_slices_[rank_]);
    HSAP_ASSIGN_OR_RETURN(WorkList local,
                          BuildWorkList(Pick(layout_.slices(), recv_slices_[rank_]),
                                        sched->local_runs, sched->local_runs, block_q_));
    sched->local_work = std::move(local);
    return absl::OkStatus();
  }

  // The ring's steps t = 1 .. R-1: from rank - t, to rank + t.
  absl::Status AddRingStages(Schedule* sched) {
    for (int t = 1; t < R_; ++t) {
      const int src = (rank_ - t + R_) % R_, dst = (rank_ + t) % R_;
      Stage stage;
      stage.step = t;
      HSAP_RETURN_IF_ERROR(AddRingReceive(src, &stage, sched));
      AddRingSend(dst, &stage);
      if (stage.recv_from >= 0 || stage.send_to >= 0) sched->stages.push_back(std::move(stage));
    }
    return absl::OkStatus();
  }

  // Fan-out (several nodes only): the relays into this rank's node, by gateway; steps
  // R + d, from rank - d and to rank + d on this node.
  absl::Status AddFanOutStages(Schedule* sched) {
    std::vector<std::pair<int, const Relay*>> into_node;  // (owner, relay), increasing owner
    for (const auto& [key, relay] : relays_) {
      if (key.second == my_node_) into_node.push_back({key.first, &relay});
    }
    for (int d = 1; d < R_; ++d) {
      const int from = (rank_ - d + R_) % R_, to = (rank_ + d) % R_;
      Stage stage;
      stage.step = R_ + d;
      if (!Cross(from, rank_))
        HSAP_RETURN_IF_ERROR(AddFanOutReceive(into_node, from, &stage, *sched));
      if (!Cross(rank_, to)) AddFanOutSend(into_node, to, &stage);
      if (stage.recv_from >= 0 || stage.send_to >= 0) sched->stages.push_back(std::move(stage));
    }
    return absl::OkStatus();
  }

 private:
  bool Cross(int a, int b) const { return multi_node_ && node_of_rank_[a] != node_of_rank_[b]; }

  // The rows of `src` this rank receives at its ring step (less those a relay brings, plus
  // the relay's shared rows when this rank is its gateway, which it keeps) and their work.
  absl::Status AddRingReceive(int src, Stage* stage, Schedule* sched) {
    SortAndMerge(recv_[src]);
    SortUnique(recv_slices_[src]);
    std::vector<TokenRange> recv_rows = recv_[src];
    bool keep = false;
    if (const Relay* relay = Cross(src, rank_) ? FindRelay(relays_, src, my_node_) : nullptr) {
      recv_rows = Subtract(recv_rows, relay->shared);
      if (relay->gateway == rank_) {
        recv_rows.insert(recv_rows.end(), relay->shared.begin(), relay->shared.end());
        SortAndMerge(recv_rows);
        keep = true;
      }
    }
    if (recv_rows.empty()) return absl::OkStatus();
    stage->recv_from = src;
    for (const TokenRange& r : recv_rows) {
      stage->recv_runs.push_back({r.begin, stage->recv_rows, r.size()});
      stage->recv_rows += r.size();
    }
    HSAP_ASSIGN_OR_RETURN(
        WorkList work, BuildWorkList(Pick(layout_.slices(), recv_slices_[src]), sched->local_runs,
                                     stage->recv_runs, block_q_));
    stage->recv_work = std::move(work);
    if (keep) {
      stage->store_begin = sched->store_rows;
      sched->store_rows += stage->recv_rows;
      kept_[src] = Kept{stage->recv_runs, stage->store_begin};
    }
    return absl::OkStatus();
  }

  // The rows of this rank `dst` needs at its ring step (less those a relay brings, plus the
  // relay's shared rows when `dst` is its gateway, whose gradients come back later).
  void AddRingSend(int dst, Stage* stage) {
    SortAndMerge(send_[dst]);
    std::vector<TokenRange> send_rows = send_[dst];
    if (const Relay* relay =
            Cross(rank_, dst) ? FindRelay(relays_, rank_, node_of_rank_[dst]) : nullptr) {
      send_rows = Subtract(send_rows, relay->shared);
      if (relay->gateway == dst) {
        send_rows.insert(send_rows.end(), relay->shared.begin(), relay->shared.end());
        SortAndMerge(send_rows);
        stage->send_grads_deferred = true;
      }
    }
    if (send_rows.empty()) return;
    const std::vector<Placement>& pls = partition_.placements();
    size_t hint = 0;
    stage->send_to = dst;
    for (const TokenRange& r : send_rows) {
      // A merged range of this rank's keys lies inside one of its placements (adjacent
      // placements of one rank are merged by the partition).
      const Placement& pl = pls[partition_.PlacementIndexOf(r.begin, hint)];
      hint = static_cast<size_t>(&pl - pls.data());
      stage->send_runs.push_back({r.begin, pl.local_begin + (r.begin - pl.begin), r.size()});
      stage->send_rows += r.size();
    }
  }

  // From the gateway `from` on this node: this rank's rows of the relays it kept.
  absl::Status AddFanOutReceive(const std::vector<std::pair<int, const Relay*>>& into_node,
                                int from, Stage* stage, const Schedule& sched) const {
    std::vector<TokenRange> rows;
    std::vector<size_t> used;
    for (const auto& [owner, relay] : into_node) {
      if (relay->gateway != from) continue;
      std::vector<TokenRange> mine = Intersect(recv_[owner], relay->shared);
      if (mine.empty()) continue;
      rows.insert(rows.end(), mine.begin(), mine.end());
      used.insert(used.end(), recv_slices_[owner].begin(), recv_slices_[owner].end());
    }
    SortAndMerge(rows);
    if (rows.empty()) return absl::OkStatus();
    stage->recv_from = from;
    for (const TokenRange& r : rows) {
      stage->recv_runs.push_back({r.begin, stage->recv_rows, r.size()});
      stage->recv_rows += r.size();
    }
    SortUnique(used);
    HSAP_ASSIGN_OR_RETURN(
        WorkList work,
        BuildWorkList(Pick(layout_.slices(), used), sched.local_runs, stage->recv_runs, block_q_));
    stage->recv_work = std::move(work);
    return absl::OkStatus();
  }

  // As a gateway: the rows of the relays it kept that `to` (on this node) needs, from the
  // store.
  void AddFanOutSend(const std::vector<std::pair<int, const Relay*>>& into_node, int to,
                     Stage* stage) const {
    for (const auto& [owner, relay] : into_node) {
      if (relay->gateway != rank_) continue;
      auto it = foreign_.find(int64_t{owner} * R_ + to);
      if (it == foreign_.end()) continue;
      const Kept& k = kept_.at(owner);
      AppendRunsIn(Intersect(it->second, relay->shared), k.runs, k.store_begin, stage->send_runs);
    }
    std::sort(stage->send_runs.begin(), stage->send_runs.end(),
              [](const TokenRun& a, const TokenRun& b) { return a.global_begin < b.global_begin; });
    for (const TokenRun& run : stage->send_runs) stage->send_rows += run.length;
    if (!stage->send_runs.empty()) {
      stage->send_to = to;
      stage->send_from_store = true;
    }
  }

  // A receive buffer this rank keeps as a gateway: its layout and store offset.
  struct Kept {
    std::vector<TokenRun> runs;
    int64_t store_begin = 0;
  };

  const Layout& layout_;
  const Partition& partition_;
  const int rank_;
  const int64_t block_q_;
  const absl::Span<const int> node_of_rank_;
  const int R_;
  const bool multi_node_;
  const int my_node_;
  std::vector<std::vector<TokenRange>> recv_, send_;
  std::vector<std::vector<size_t>> recv_slices_;
  absl::flat_hash_map<int64_t, std::vector<TokenRange>> foreign_;
  std::map<std::pair<int, int>, Relay> relays_;
  std::map<int, Kept> kept_;  // by owner
};

}  // namespace

absl::StatusOr<Schedule> BuildSchedule(const Layout& layout, const Partition& partition, int rank,
                                       int64_t block_q, absl::Span<const int> node_of_rank) {
  const int R = partition.num_ranks();
  if (rank < 0 || rank >= R) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " is outside the partition's ", R, " ranks"));
  }
  if (!node_of_rank.empty() && static_cast<int>(node_of_rank.size()) != R) {
    return absl::InvalidArgumentError(
        absl::StrCat("the topology has ", node_of_rank.size(), " ranks but the partition ", R));
  }
  const bool multi_node =
      !node_of_rank.empty() && std::any_of(node_of_rank.begin(), node_of_rank.end(),
                                           [&](int n) { return n != node_of_rank[0]; });
  if (multi_node && 2 * static_cast<int64_t>(R) > (int64_t{1} << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat(R, " ranks on several nodes: fan-out steps (R + d) must stay below 2^20"));
  }
  ScheduleBuilder builder(layout, partition, rank, block_q, node_of_rank, multi_node);
  builder.ScanPeers();
  Schedule sched;
  HSAP_RETURN_IF_ERROR(builder.AddLocal(&sched));
  HSAP_RETURN_IF_ERROR(builder.AddRingStages(&sched));
  if (!multi_node) return sched;
  HSAP_RETURN_IF_ERROR(builder.AddFanOutStages(&sched));
  return sched;
}

}  // namespace hsap
