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
  auto cross = [&](int a, int b) { return multi_node && node_of_rank[a] != node_of_rank[b]; };
  // Per peer p: the keys of p that this rank needs (recv), the keys of this rank that p
  // needs (send), and the slices behind the receives (for the work lists). On several
  // nodes also every pair across nodes (foreign, keyed owner * R + query rank), which the
  // relays are planned on.
  std::vector<std::vector<TokenRange>> recv(R), send(R);
  std::vector<std::vector<size_t>> recv_slices(R);
  absl::flat_hash_map<int64_t, std::vector<TokenRange>> foreign;
  ScanNeeds(
      layout, partition,
      [&](int q, int k) { return k < 0 || q == rank || k == rank || cross(q, k); },
      [&](int q, int k, TokenRange r, size_t slice) {
        if (q == rank) {
          recv[k].push_back(r);
          recv_slices[k].push_back(slice);
        } else if (k == rank) {
          send[q].push_back(r);
        }
        if (cross(q, k)) foreign[int64_t{k} * R + q].push_back(r);
      });
  for (auto& [pair, ranges] : foreign) SortAndMerge(ranges);
  const std::map<std::pair<int, int>, Relay> relays =
      multi_node ? PlanRelays(R, node_of_rank, foreign) : std::map<std::pair<int, int>, Relay>{};

  Schedule sched;
  sched.rank = rank;
  sched.num_ranks = R;
  sched.local_rows = partition.local_tokens(rank);
  sched.local_runs = partition.Runs(rank);
  const std::vector<MaskSlice>& slices = layout.slices();
  {
    SortUnique(recv_slices[rank]);
    HSAP_ASSIGN_OR_RETURN(WorkList local,
                          BuildWorkList(Pick(slices, recv_slices[rank]), sched.local_runs,
                                        sched.local_runs, block_q));
    sched.local_work = std::move(local);
  }
  const std::vector<Placement>& pls = partition.placements();
  const int my_node = multi_node ? node_of_rank[rank] : 0;
  // The receive buffers this rank keeps as a gateway, by owner: layout and store offset.
  struct Kept {
    std::vector<TokenRun> runs;
    int64_t store_begin = 0;
  };
  std::map<int, Kept> kept;
  for (int t = 1; t < R; ++t) {
    const int src = (rank - t + R) % R, dst = (rank + t) % R;
    Stage stage;
    stage.step = t;
    SortAndMerge(recv[src]);
    SortUnique(recv_slices[src]);
    std::vector<TokenRange> recv_rows = recv[src];
    bool keep = false;
    if (const Relay* relay = cross(src, rank) ? FindRelay(relays, src, my_node) : nullptr) {
      recv_rows = Subtract(recv_rows, relay->shared);
      if (relay->gateway == rank) {
        recv_rows.insert(recv_rows.end(), relay->shared.begin(), relay->shared.end());
        SortAndMerge(recv_rows);
        keep = true;
      }
    }
    if (!recv_rows.empty()) {
      stage.recv_from = src;
      for (const TokenRange& r : recv_rows) {
        stage.recv_runs.push_back({r.begin, stage.recv_rows, r.size()});
        stage.recv_rows += r.size();
      }
      HSAP_ASSIGN_OR_RETURN(WorkList work,
                            BuildWorkList(Pick(slices, recv_slices[src]), sched.local_runs,
                                          stage.recv_runs, block_q));
      stage.recv_work = std::move(work);
      if (keep) {
        stage.store_begin = sched.store_rows;
        sched.store_rows += stage.recv_rows;
        kept[src] = Kept{stage.recv_runs, stage.store_begin};
      }
    }
    SortAndMerge(send[dst]);
    std::vector<TokenRange> send_rows = send[dst];
    if (const Relay* relay =
            cross(rank, dst) ? FindRelay(relays, rank, node_of_rank[dst]) : nullptr) {
      send_rows = Subtract(send_rows, relay->shared);
      if (relay->gateway == dst) {
        send_rows.insert(send_rows.end(), relay->shared.begin(), relay->shared.end());
        SortAndMerge(send_rows);
        stage.send_grads_deferred = true;
      }
    }
    if (!send_rows.empty()) {
      size_t hint = 0;
      stage.send_to = dst;
      for (const TokenRange& r : send_rows) {
        // A merged range of this rank's keys lies inside one of its placements (adjacent
        // placements of one rank are merged by the partition).
        const Placement& pl = pls[partition.PlacementIndexOf(r.begin, hint)];
        hint = static_cast<size_t>(&pl - pls.data());
        stage.send_runs.push_back({r.begin, pl.local_begin + (r.begin - pl.begin), r.size()});
        stage.send_rows += r.size();
      }
    }
    if (stage.recv_from >= 0 || stage.send_to >= 0) sched.stages.push_back(std::move(stage));
  }
  if (!multi_node) return sched;

  // Fan-out: the relays into this rank's node, by gateway.
  std::vector<std::pair<int, const Relay*>> into_node;  // (owner, relay), increasing owner
  for (const auto& [key, relay] : relays) {
    if (key.second == my_node) into_node.push_back({key.first, &relay});
  }
  for (int d = 1; d < R; ++d) {
    const int from = (rank - d + R) % R, to = (rank + d) % R;
    Stage stage;
    stage.step = R + d;
    if (!cross(from, rank)) {
      std::vector<TokenRange> rows;
      std::vector<size_t> used;
      for (const auto& [owner, relay] : into_node) {
        if (relay->gateway != from) continue;
        std::vector<TokenRange> mine = Intersect(recv[owner], relay->shared);
        if (mine.empty()) continue;
        rows.insert(rows.end(), mine.begin(), mine.end());
        used.insert(used.end(), recv_slices[owner].begin(), recv_slices[owner].end());
      }
      SortAndMerge(rows);
      if (!rows.empty()) {
        stage.recv_from = from;
        for (const TokenRange& r : rows) {
          stage.recv_runs.push_back({r.begin, stage.recv_rows, r.size()});
          stage.recv_rows += r.size();
        }
        SortUnique(used);
        HSAP_ASSIGN_OR_RETURN(WorkList work, BuildWorkList(Pick(slices, used), sched.local_runs,
                                                           stage.recv_runs, block_q));
        stage.recv_work = std::move(work);
      }
    }
    if (!cross(rank, to)) {
      for (const auto& [owner, relay] : into_node) {
        if (relay->gateway != rank) continue;
        auto it = foreign.find(int64_t{owner} * R + to);
        if (it == foreign.end()) continue;
        const Kept& k = kept.at(owner);
        AppendRunsIn(Intersect(it->second, relay->shared), k.runs, k.store_begin, stage.send_runs);
      }
      std::sort(
          stage.send_runs.begin(), stage.send_runs.end(),
          [](const TokenRun& a, const TokenRun& b) { return a.global_begin < b.global_begin; });
      for (const TokenRun& run : stage.send_runs) stage.send_rows += run.length;
      if (!stage.send_runs.empty()) {
        stage.send_to = to;
        stage.send_from_store = true;
      }
    }
    if (stage.recv_from >= 0 || stage.send_to >= 0) sched.stages.push_back(std::move(stage));
  }
  return sched;
}

}  // namespace hsap
