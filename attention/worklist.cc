#include "attention/worklist.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace hsap {
namespace {

constexpr int64_t kMaxPosition = int64_t{1} << 40;

// Validates the runs of one buffer and returns the non-empty ones sorted by global position.
absl::StatusOr<std::vector<TokenRun>> SortedRuns(absl::Span<const TokenRun> runs,
                                                 const char* name) {
  std::vector<TokenRun> sorted;
  sorted.reserve(runs.size());
  std::vector<size_t> index;
  index.reserve(runs.size());
  for (size_t i = 0; i < runs.size(); ++i) {
    const TokenRun& r = runs[i];
    if (r.length < 0 || r.global_begin < 0 || r.local_begin < 0 || r.length > kMaxPosition ||
        r.global_begin > kMaxPosition || r.local_begin > kMaxPosition) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, "[", i, "] = {global_begin ", r.global_begin, ", local_begin ", r.local_begin,
          ", length ", r.length, "}: positions and length must be in [0, 2^40]"));
    }
    if (r.length == 0) continue;
    sorted.push_back(r);
    index.push_back(i);
  }
  // Overlap checks in both coordinates; the error names the original indices.
  std::vector<size_t> order(sorted.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  for (const bool global : {false, true}) {
    auto begin_of = [&](size_t i) {
      return global ? sorted[i].global_begin : sorted[i].local_begin;
    };
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return begin_of(a) != begin_of(b) ? begin_of(a) < begin_of(b) : a < b;
    });
    for (size_t j = 1; j < order.size(); ++j) {
      const size_t a = order[j - 1], b = order[j];
      if (begin_of(a) + sorted[a].length > begin_of(b)) {
        return absl::InvalidArgumentError(absl::StrCat(name, "[", index[a], "] and ", name, "[",
                                                       index[b], "] overlap in ",
                                                       global ? "global" : "local (buffer)",
                                                       " positions; the runs of a buffer must be "
                                                       "disjoint"));
      }
    }
  }
  // `order` is now sorted by global position.
  std::vector<TokenRun> result;
  result.reserve(sorted.size());
  for (size_t i : order) result.push_back(sorted[i]);
  return result;
}

// The band of a slice in absolute coordinates, lo <= k - q <= hi, infinite sides kept
// infinite.
void AbsoluteBand(const MaskSlice& s, int64_t& lo, int64_t& hi) {
  const int64_t shift = s.k_begin - s.q_begin;
  lo = s.diag_lo <= -kNoDiagLimit ? -kNoDiagLimit : s.diag_lo + shift;
  hi = s.diag_hi >= kNoDiagLimit ? kNoDiagLimit : s.diag_hi + shift;
}

struct RunOutput {
  std::vector<QueryBlock> blocks;
  std::vector<KeySegment> segments;
};

class Builder {
 public:
  Builder(absl::Span<const MaskSlice> slices, std::vector<TokenRun> k_runs, int64_t block_q)
      : slices_(slices), k_runs_(std::move(k_runs)), block_q_(block_q) {
    for (int i = 0; i < static_cast<int>(slices.size()); ++i) {
      if (slices[i].q_begin < slices[i].q_end && slices[i].k_begin < slices[i].k_end) {
        by_start_.push_back(i);
      }
    }
    by_end_ = by_start_;
    std::sort(by_start_.begin(), by_start_.end(),
              [&](int a, int b) { return slices[a].q_begin < slices[b].q_begin; });
    std::sort(by_end_.begin(), by_end_.end(),
              [&](int a, int b) { return slices[a].q_end < slices[b].q_end; });
    position_in_active_.assign(slices.size(), -1);
    k_run_begins_.reserve(k_runs_.size());
    for (const TokenRun& r : k_runs_) k_run_begins_.push_back(r.global_begin);
  }

  // Processes one query run; runs must come in increasing global order.
  void AddQueryRun(const TokenRun& run, RunOutput& out) {
    const int64_t offset = run.local_begin - run.global_begin;
    int64_t cur = run.global_begin;
    const int64_t end = run.global_begin + run.length;
    Advance(cur);
    while (cur < end) {
      const int64_t next = std::min(end, NextEvent());
      if (!active_.empty()) {
        for (int64_t b = cur; b < next; b += block_q_) {
          AddBlock(b, std::min(next, b + block_q_), offset, out);
        }
      }
      cur = next;
      Advance(cur);
    }
  }

  int64_t visible_pairs() const { return visible_pairs_; }

 private:
  // Makes `active_` the slices whose query range contains position p.
  void Advance(int64_t p) {
    while (next_start_ < by_start_.size() && slices_[by_start_[next_start_]].q_begin <= p) {
      const int id = by_start_[next_start_++];
      position_in_active_[id] = static_cast<int>(active_.size());
      active_.push_back(id);
    }
    while (next_end_ < by_end_.size() && slices_[by_end_[next_end_]].q_end <= p) {
      const int id = by_end_[next_end_++];
      const int pos = position_in_active_[id];
      position_in_active_[active_.back()] = pos;
      active_[pos] = active_.back();
      active_.pop_back();
      position_in_active_[id] = -1;
    }
  }

  int64_t NextEvent() const {
    int64_t next = kMaxPosition * 4;
    if (next_start_ < by_start_.size()) next = slices_[by_start_[next_start_]].q_begin;
    if (next_end_ < by_end_.size()) next = std::min(next, slices_[by_end_[next_end_]].q_end);
    return next;
  }

  // Query rows [q0, q1) (global positions) of one run whose buffer rows are shifted by
  // `q_offset`; every active slice covers all of them.
  void AddBlock(int64_t q0, int64_t q1, int64_t q_offset, RunOutput& out) {
    block_segments_.clear();
    for (int id : active_) {
      const MaskSlice& s = slices_[id];
      int64_t lo, hi;
      AbsoluteBand(s, lo, hi);
      // Keys that some row of the block sees: k - q in [lo, hi] for a q in [q0, q1).
      const int64_t k0 = std::max(s.k_begin, lo <= -kNoDiagLimit ? s.k_begin : q0 + lo);
      const int64_t k1 = std::min(s.k_end, hi >= kNoDiagLimit ? s.k_end : q1 + hi);
      if (k0 >= k1) continue;
      // Key runs meeting [k0, k1): from the last run starting at or before k0.
      size_t r = static_cast<size_t>(
          std::upper_bound(k_run_begins_.begin(), k_run_begins_.end(), k0) - k_run_begins_.begin());
      if (r > 0) --r;
      for (; r < k_runs_.size() && k_runs_[r].global_begin < k1; ++r) {
        const TokenRun& kr = k_runs_[r];
        const int64_t g0 = std::max(k0, kr.global_begin);
        const int64_t g1 = std::min(k1, kr.global_begin + kr.length);
        if (g0 >= g1) continue;
        // Buffer coordinates: kr - qr = (k - q) + (k_offset - q_offset).
        const int64_t shift = (kr.local_begin - kr.global_begin) - q_offset;
        KeySegment seg;
        seg.k_begin = g0 + kr.local_begin - kr.global_begin;
        seg.k_end = g1 + kr.local_begin - kr.global_begin;
        seg.diag_lo = lo <= -kNoDiagLimit ? -kNoDiagLimit : lo + shift;
        seg.diag_hi = hi >= kNoDiagLimit ? kNoDiagLimit : hi + shift;
        const int64_t lq0 = q0 + q_offset, lq1 = q1 + q_offset;
        // A side of the band that every pair of the rectangle satisfies is dropped, so that
        // fully visible ranges are marked full.
        if (seg.k_begin - (lq1 - 1) >= seg.diag_lo) seg.diag_lo = -kNoDiagLimit;
        if ((seg.k_end - 1) - lq0 <= seg.diag_hi) seg.diag_hi = kNoDiagLimit;
        visible_pairs_ +=
            CountPairsInBand(lq0, lq1, seg.k_begin, seg.k_end, seg.diag_lo, seg.diag_hi);
        block_segments_.push_back(seg);
      }
    }
    if (block_segments_.empty()) return;
    std::sort(block_segments_.begin(), block_segments_.end(),
              [](const KeySegment& a, const KeySegment& b) {
                if (a.k_begin != b.k_begin) return a.k_begin < b.k_begin;
                if (a.diag_lo != b.diag_lo) return a.diag_lo < b.diag_lo;
                return a.k_end < b.k_end;
              });
    QueryBlock block;
    block.q_begin = q0 + q_offset;
    block.q_end = q1 + q_offset;
    block.seg_begin = static_cast<int64_t>(out.segments.size());
    for (const KeySegment& seg : block_segments_) {
      // Adjacent key ranges under the same band merge: the union is exactly their pairs.
      if (static_cast<int64_t>(out.segments.size()) > block.seg_begin) {
        KeySegment& last = out.segments.back();
        if (last.k_end == seg.k_begin && last.diag_lo == seg.diag_lo &&
            last.diag_hi == seg.diag_hi) {
          last.k_end = seg.k_end;
          continue;
        }
      }
      out.segments.push_back(seg);
    }
    block.seg_end = static_cast<int64_t>(out.segments.size());
    out.blocks.push_back(block);
  }

  absl::Span<const MaskSlice> slices_;
  std::vector<TokenRun> k_runs_;
  std::vector<int64_t> k_run_begins_;
  int64_t block_q_;
  std::vector<int> by_start_, by_end_;
  size_t next_start_ = 0, next_end_ = 0;
  std::vector<int> active_;
  std::vector<int> position_in_active_;
  std::vector<KeySegment> block_segments_;
  int64_t visible_pairs_ = 0;
};

}  // namespace

absl::StatusOr<WorkList> BuildWorkList(absl::Span<const MaskSlice> slices,
                                       absl::Span<const TokenRun> q_runs,
                                       absl::Span<const TokenRun> k_runs, int64_t block_q) {
  if (block_q <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("block_q = ", block_q, "; it must be positive (e.g. kKernelBlockQ)"));
  }
  for (size_t i = 0; i < slices.size(); ++i) {
    const MaskSlice& s = slices[i];
    if (s.q_begin < 0 || s.k_begin < 0 || s.q_begin > s.q_end || s.k_begin > s.k_end ||
        s.q_end > kMaxPosition || s.k_end > kMaxPosition || s.diag_lo > s.diag_hi) {
      return absl::InvalidArgumentError(
          absl::StrCat("slices[", i,
                       "] is malformed: ranges must be ordered within [0, 2^40] and "
                       "diag_lo <= diag_hi (build slices with Layout::FromSlices to check them)"));
    }
  }
  HSAP_ASSIGN_OR_RETURN(std::vector<TokenRun> q_sorted, SortedRuns(q_runs, "q_runs"));
  HSAP_ASSIGN_OR_RETURN(std::vector<TokenRun> k_sorted, SortedRuns(k_runs, "k_runs"));

  Builder builder(slices, std::move(k_sorted), block_q);
  std::vector<RunOutput> outputs(q_sorted.size());
  for (size_t i = 0; i < q_sorted.size(); ++i) builder.AddQueryRun((q_sorted)[i], outputs[i]);

  // Blocks of one run are in buffer order; concatenating the runs in buffer order sorts all.
  std::vector<size_t> by_local(q_sorted.size());
  for (size_t i = 0; i < by_local.size(); ++i) by_local[i] = i;
  std::sort(by_local.begin(), by_local.end(), [&](size_t a, size_t b) {
    return (q_sorted)[a].local_begin < (q_sorted)[b].local_begin;
  });
  WorkList work;
  size_t num_blocks = 0, num_segments = 0;
  for (const RunOutput& o : outputs) {
    num_blocks += o.blocks.size();
    num_segments += o.segments.size();
  }
  work.blocks.reserve(num_blocks);
  work.segments.reserve(num_segments);
  for (size_t i : by_local) {
    const int64_t shift = static_cast<int64_t>(work.segments.size());
    for (QueryBlock b : outputs[i].blocks) {
      b.seg_begin += shift;
      b.seg_end += shift;
      work.blocks.push_back(b);
    }
    work.segments.insert(work.segments.end(), outputs[i].segments.begin(),
                         outputs[i].segments.end());
  }
  work.visible_pairs = builder.visible_pairs();
  return work;
}

absl::StatusOr<WorkList> BuildWorkList(const Layout& layout, int64_t block_q) {
  const TokenRun whole{0, 0, layout.num_tokens()};
  return BuildWorkList(layout.slices(), absl::MakeConstSpan(&whole, 1),
                       absl::MakeConstSpan(&whole, 1), block_q);
}

}  // namespace hsap
