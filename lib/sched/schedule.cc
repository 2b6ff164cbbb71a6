#include "lib/sched/schedule.h"

#include <algorithm>
#include <utility>

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

}  // namespace

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
                                       int64_t block_q) {
  const int R = partition.num_ranks();
  if (rank < 0 || rank >= R) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " is outside the partition's ", R, " ranks"));
  }
  // Per peer p: the keys of p that this rank needs (recv), the keys of this rank that p
  // needs (send), and the slices behind the receives (for the work lists).
  std::vector<std::vector<TokenRange>> recv(R), send(R);
  std::vector<std::vector<size_t>> recv_slices(R);
  ScanNeeds(
      layout, partition, [&](int q, int k) { return k < 0 || q == rank || k == rank; },
      [&](int q, int k, TokenRange r, size_t slice) {
        if (q == rank) {
          recv[k].push_back(r);
          recv_slices[k].push_back(slice);
        } else {
          send[q].push_back(r);
        }
      });

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
  for (int t = 1; t < R; ++t) {
    const int src = (rank - t + R) % R, dst = (rank + t) % R;
    Stage stage;
    stage.step = t;
    SortAndMerge(recv[src]);
    if (!recv[src].empty()) {
      stage.recv_from = src;
      for (const TokenRange& r : recv[src]) {
        stage.recv_runs.push_back({r.begin, stage.recv_rows, r.size()});
        stage.recv_rows += r.size();
      }
      SortUnique(recv_slices[src]);
      HSAP_ASSIGN_OR_RETURN(WorkList work,
                            BuildWorkList(Pick(slices, recv_slices[src]), sched.local_runs,
                                          stage.recv_runs, block_q));
      stage.recv_work = std::move(work);
    }
    SortAndMerge(send[dst]);
    if (!send[dst].empty()) {
      size_t hint = 0;
      stage.send_to = dst;
      for (const TokenRange& r : send[dst]) {
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
  return sched;
}

}  // namespace hsap
