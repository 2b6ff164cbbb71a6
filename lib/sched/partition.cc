#include "lib/sched/partition.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace hsap {
namespace {

// A unit that fits no rank's remaining capacity still goes whole when it overshoots the
// roomiest rank by at most this fraction of the smallest target.
constexpr double kWholeOvershoot = 0.01;

// A piece of the row that is placed as a whole or cut: a document, or the whole row of a
// slice layout. `folded` units are cut in zigzag order. Its slices in each layout are
// RowUnits::spans[spans_begin + l] for layout l.
struct Unit {
  int64_t begin = 0, end = 0;
  bool folded = false;
  int64_t work = 0;
  size_t spans_begin = 0;
};

// Slices [begin, end) of one layout's Layout::slices().
struct SliceSpan {
  size_t begin = 0, end = 0;
};

// Work of each token of a unit, summed over the layouts (1 per token when balancing memory
// only).
std::vector<int64_t> UnitTokenWork(const Unit& u, absl::Span<const Layout* const> layouts,
                                   const std::vector<SliceSpan>& spans, bool memory_only) {
  std::vector<int64_t> work(u.end - u.begin, memory_only ? 1 : 0);
  if (memory_only) return work;
  for (size_t l = 0; l < layouts.size(); ++l) {
    const std::vector<MaskSlice>& slices = layouts[l]->slices();
    const SliceSpan span = spans[u.spans_begin + l];
    for (size_t i = span.begin; i < span.end; ++i) {
      const MaskSlice& s = slices[i];
      const int64_t q1 = std::min(s.q_end, u.end);
      for (int64_t q = std::max(s.q_begin, u.begin); q < q1; ++q)
        work[q - u.begin] += s.VisibleKeys(q);
    }
  }
  return work;
}

// The positions of a unit in cutting order. Position f of a folded unit of length L holds
// tokens f and L-1-f (one token in the middle when L is odd); of a plain unit, token f.
class UnitPositions {
 public:
  // token_work: the unit's own tokens, from its first.
  UnitPositions(const Unit& u, const std::vector<int64_t>& token_work) : unit_(u) {
    const int64_t len = u.end - u.begin;
    const int64_t n = u.folded ? (len + 1) / 2 : len;
    prefix_.assign(n + 1, 0);
    for (int64_t f = 0; f < n; ++f) {
      int64_t w = token_work[f];
      if (u.folded && len - 1 - f != f) w += token_work[len - 1 - f];
      prefix_[f + 1] = prefix_[f] + w;
    }
  }
  int64_t size() const { return static_cast<int64_t>(prefix_.size()) - 1; }
  int64_t prefix(int64_t f) const { return prefix_[f]; }
  int64_t max_work() const {
    int64_t m = 0;
    for (size_t i = 1; i < prefix_.size(); ++i) m = std::max(m, prefix_[i] - prefix_[i - 1]);
    return m;
  }
  // The cut c in [lo, size()] whose prefix is nearest to `want` (ties: the smaller c).
  int64_t NearestCut(int64_t lo, double want) const {
    auto it = std::lower_bound(prefix_.begin() + lo, prefix_.end(), want,
                               [](int64_t p, double w) { return static_cast<double>(p) < w; });
    int64_t c = it - prefix_.begin();
    if (c > size()) c = size();
    if (c > lo && std::abs(static_cast<double>(prefix_[c - 1]) - want) <=
                      std::abs(static_cast<double>(prefix_[c]) - want)) {
      --c;
    }
    return c;
  }
  // Token ranges of positions [f0, f1).
  void AppendTokens(int64_t f0, int64_t f1, std::vector<TokenRange>& out) const {
    if (f0 >= f1) return;
    const int64_t b = unit_.begin, len = unit_.end - unit_.begin;
    if (!unit_.folded) {
      out.push_back({b + f0, b + f1});
      return;
    }
    out.push_back({b + f0, b + f1});
    const int64_t tail_begin = std::max(len - f1, f1);
    if (tail_begin < len - f0) out.push_back({b + tail_begin, b + len - f0});
  }

 private:
  Unit unit_;
  std::vector<int64_t> prefix_;
};

absl::Status ValidateWeights(int num_ranks, absl::Span<const double> weights) {
  if (num_ranks < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("nranks is ", num_ranks, "; a partition needs at least one rank"));
  }
  if (weights.empty()) return absl::OkStatus();
  if (static_cast<int64_t>(weights.size()) != num_ranks) {
    return absl::InvalidArgumentError(absl::StrCat("weights has ", weights.size(),
                                                   " entries; pass one per rank (", num_ranks,
                                                   ") or none for equal weights"));
  }
  bool any_positive = false;
  for (int r = 0; r < num_ranks; ++r) {
    if (!std::isfinite(weights[r]) || weights[r] < 0.0) {
      return absl::InvalidArgumentError(
          absl::StrCat("weights[", r, "] is ", weights[r],
                       "; every weight must be finite and >= 0 (0: the rank holds no token)"));
    }
    any_positive = any_positive || weights[r] > 0.0;
  }
  if (!any_positive) {
    return absl::InvalidArgumentError(
        "every weight is 0; at least one rank needs a positive weight to hold the row");
  }
  return absl::OkStatus();
}

// Weights normalised to sum 1; equal when none are given.
std::vector<double> NormalizedWeights(int num_ranks, absl::Span<const double> weights) {
  std::vector<double> normalized(num_ranks, 1.0 / num_ranks);
  if (!weights.empty()) {
    const double sum = std::accumulate(weights.begin(), weights.end(), 0.0);
    for (int r = 0; r < num_ranks; ++r) normalized[r] = weights[r] / sum;
  }
  return normalized;
}

// The units of a row, each with its work, and the row's total work (over every layout).
struct RowUnits {
  std::vector<Unit> units;
  std::vector<SliceSpan> spans;  // layouts.size() per unit
  int64_t total_work = 0;
  bool memory_only = false;  // nothing to compute: work counts tokens, to balance memory
};

// The non-empty documents of a document layout as ranges; empty for a slice layout.
std::vector<TokenRange> NonEmptyDocuments(const Layout& layout) {
  std::vector<TokenRange> docs;
  for (const Document& d : layout.documents()) {
    if (d.end > d.begin) docs.push_back({d.begin, d.end});
  }
  return docs;
}

// Whether every layout is a document layout with the same non-empty documents as the
// first: then documents are the units, else the whole row is one.
bool SameDocuments(absl::Span<const Layout* const> layouts) {
  if (layouts.front()->documents().empty()) return false;
  const std::vector<TokenRange> first = NonEmptyDocuments(*layouts.front());
  for (size_t l = 1; l < layouts.size(); ++l) {
    if (layouts[l]->documents().empty() || NonEmptyDocuments(*layouts[l]) != first) return false;
  }
  return true;
}

// Units and their slices (slices are sorted by q_begin; a document's slices lie inside
// it). Work comes from the slices' closed forms, so no per-token pass over the row. A
// document is folded when it is causal or prefix-LM in some layout (that layout's work
// then grows towards its end, and the zigzag cut keeps memory with work).
RowUnits CollectUnits(absl::Span<const Layout* const> layouts) {
  const size_t num_layouts = layouts.size();
  const int64_t num_tokens = layouts.front()->num_tokens();
  RowUnits row;
  std::vector<Unit>& units = row.units;
  if (SameDocuments(layouts)) {
    std::vector<size_t> next_slice(num_layouts, 0);
    std::vector<size_t> next_doc(num_layouts, 0);
    for (const TokenRange& range : NonEmptyDocuments(*layouts.front())) {
      Unit u{range.begin, range.end, false, 0, row.spans.size()};
      for (size_t l = 0; l < num_layouts; ++l) {
        const std::vector<Document>& docs = layouts[l]->documents();
        while (docs[next_doc[l]].end <= docs[next_doc[l]].begin) ++next_doc[l];
        const MaskKind kind = docs[next_doc[l]++].kind;
        u.folded = u.folded || kind == MaskKind::kCausal || kind == MaskKind::kPrefixLM;
        const std::vector<MaskSlice>& slices = layouts[l]->slices();
        SliceSpan span{next_slice[l], next_slice[l]};
        while (span.end < slices.size() && slices[span.end].q_begin < range.end) ++span.end;
        next_slice[l] = span.end;
        row.spans.push_back(span);
      }
      units.push_back(u);
    }
  } else if (num_tokens > 0) {
    units.push_back({0, num_tokens, false, 0, 0});
    for (const Layout* layout : layouts) row.spans.push_back({0, layout->slices().size()});
  }
  for (Unit& u : units) {
    for (size_t l = 0; l < num_layouts; ++l) {
      const std::vector<MaskSlice>& slices = layouts[l]->slices();
      const SliceSpan span = row.spans[u.spans_begin + l];
      for (size_t i = span.begin; i < span.end; ++i) u.work += slices[i].VisiblePairs();
    }
    row.total_work += u.work;
  }
  row.memory_only = row.total_work == 0;
  if (row.memory_only) {
    row.total_work = 0;
    for (Unit& u : units) row.total_work += (u.work = u.end - u.begin);
  }
  return row;
}

// Indices of the units by decreasing work (ties: position in the row).
std::vector<size_t> ByDecreasingWork(const std::vector<Unit>& units) {
  std::vector<size_t> order(units.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return units[a].work > units[b].work; });
  return order;
}

// Steps 2 and 3 of the algorithm (partition.h): gives units, in the order placed, to the
// ranks of positive weight, whole where one fits, else cut across the roomiest ranks.
class UnitPlacer {
 public:
  UnitPlacer(const std::vector<double>& weights, const std::vector<double>& target,
             absl::Span<const Layout* const> layouts, const std::vector<SliceSpan>& spans,
             bool memory_only)
      : layouts_(layouts),
        spans_(spans),
        memory_only_(memory_only),
        remaining_(target),
        work_(weights.size(), 0),
        pieces_(weights.size()) {
    // Ranks of weight 0 take no part: they receive nothing.
    for (int r = 0; r < static_cast<int>(weights.size()); ++r) {
      if (weights[r] > 0.0) holders_.push_back(r);
    }
    for (int r : holders_) {
      if (min_target_ == 0.0 || target[r] < min_target_) min_target_ = target[r];
    }
  }

  void Place(const Unit& u) {
    if (!PlaceWhole(u)) Split(u);
  }

  const std::vector<int64_t>& work() const { return work_; }
  // The token ranges each rank received, in the order given; the placer is spent after.
  std::vector<std::vector<TokenRange>> TakePieces() { return std::move(pieces_); }
  int64_t max_position_work() const { return max_position_work_; }
  int64_t split_units() const { return split_units_; }

 private:
  // Best fit: the smallest remaining capacity that holds the unit whole, or the roomiest
  // rank when the unit overshoots it only a little. False: the unit must be split.
  bool PlaceWhole(const Unit& u) {
    const double w = static_cast<double>(u.work);
    int best = -1, largest = holders_.front();
    for (int r : holders_) {
      if (remaining_[r] >= w && (best < 0 || remaining_[r] < remaining_[best])) best = r;
      if (remaining_[r] > remaining_[largest]) largest = r;
    }
    if (best < 0 && w - remaining_[largest] <= kWholeOvershoot * min_target_) {
      best = largest;
    }
    if (best < 0) return false;
    remaining_[best] -= w;
    work_[best] += u.work;
    pieces_[best].push_back({u.begin, u.end});
    return true;
  }

  // Fills the ranks with the most room first.
  void Split(const Unit& u) {
    UnitPositions pos(u, UnitTokenWork(u, layouts_, spans_, memory_only_));
    max_position_work_ = std::max(max_position_work_, pos.max_work());
    by_remaining_ = holders_;
    std::stable_sort(by_remaining_.begin(), by_remaining_.end(),
                     [&](int a, int b) { return remaining_[a] > remaining_[b]; });
    const int num_holders = static_cast<int>(by_remaining_.size());
    int num_positive = 0;
    while (num_positive < num_holders && remaining_[by_remaining_[num_positive]] > 0) {
      ++num_positive;
    }
    num_positive = std::max(num_positive, 1);
    // Cuts at the cumulative capacities, so that rounding to whole positions does not
    // accumulate along the unit (a rank whose capacity is under half a position may get
    // nothing).
    int64_t f = 0;
    int pieces_made = 0;
    double cumulative = 0;
    for (int i = 0; i < num_positive && f < pos.size(); ++i) {
      const int r = by_remaining_[i];
      cumulative += remaining_[r];
      const int64_t cut = i + 1 < num_positive ? pos.NearestCut(f, cumulative) : pos.size();
      if (cut == f) continue;
      pos.AppendTokens(f, cut, pieces_[r]);
      remaining_[r] -= static_cast<double>(pos.prefix(cut) - pos.prefix(f));
      work_[r] += pos.prefix(cut) - pos.prefix(f);
      f = cut;
      ++pieces_made;
    }
    if (pieces_made > 1) ++split_units_;
  }

  absl::Span<const Layout* const> layouts_;
  const std::vector<SliceSpan>& spans_;
  const bool memory_only_;
  std::vector<int> holders_;  // ranks of positive weight
  double min_target_ = 0.0;   // the smallest target of a holder
  std::vector<double> remaining_;
  std::vector<int64_t> work_;
  std::vector<std::vector<TokenRange>> pieces_;
  std::vector<int> by_remaining_;  // scratch of Split
  int64_t max_position_work_ = 0;
  int64_t split_units_ = 0;
};

// Shards from the pieces each rank received: sorted, merged ranges, and the placements of
// all of them sorted by position.
void AssembleShards(std::vector<std::vector<TokenRange>> pieces,
                    std::vector<std::vector<TokenRange>>* ranges,
                    std::vector<int64_t>* local_tokens, std::vector<Placement>* placements) {
  const int num_ranks = static_cast<int>(pieces.size());
  ranges->resize(num_ranks);
  local_tokens->assign(num_ranks, 0);
  for (int r = 0; r < num_ranks; ++r) {
    std::vector<TokenRange>& in = pieces[r];
    std::sort(in.begin(), in.end(),
              [](const TokenRange& a, const TokenRange& b) { return a.begin < b.begin; });
    std::vector<TokenRange>& out = (*ranges)[r];
    for (const TokenRange& t : in) {
      if (!out.empty() && out.back().end == t.begin) {
        out.back().end = t.end;
      } else {
        out.push_back(t);
      }
    }
    int64_t local = 0;
    for (const TokenRange& t : out) {
      placements->push_back({t.begin, t.end, r, local});
      local += t.size();
    }
    (*local_tokens)[r] = local;
  }
  std::sort(placements->begin(), placements->end(),
            [](const Placement& a, const Placement& b) { return a.begin < b.begin; });
}

// splitmix64's finaliser, as the layout's fingerprint uses it.
uint64_t Mix(uint64_t h, uint64_t v) {
  uint64_t z = h ^ (v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Internal invariant of Create: the placements tile [0, num_tokens).
absl::Status CheckTiling(const std::vector<Placement>& placements, int64_t num_tokens) {
  int64_t expect = 0;
  for (const Placement& pl : placements) {
    if (pl.begin != expect) {
      return absl::InternalError(absl::StrCat("partition does not tile the row at token ", expect,
                                              " (next range starts at ", pl.begin, ")"));
    }
    expect = pl.end;
  }
  if (expect != num_tokens) {
    return absl::InternalError(
        absl::StrCat("partition covers ", expect, " of ", num_tokens, " tokens"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Partition> Partition::Create(const Layout& layout, int num_ranks,
                                            absl::Span<const double> weights) {
  const Layout* const layouts[] = {&layout};
  return Create(absl::MakeConstSpan(layouts), num_ranks, weights);
}

absl::StatusOr<Partition> Partition::Create(absl::Span<const Layout* const> layouts, int num_ranks,
                                            absl::Span<const double> weights) {
  HSAP_RETURN_IF_ERROR(ValidateWeights(num_ranks, weights));
  if (layouts.empty()) {
    return absl::InvalidArgumentError("layouts is empty; pass the mask of every layer (at least one)");
  }
  for (size_t l = 0; l < layouts.size(); ++l) {
    if (layouts[l] == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("layouts[", l, "] is null"));
    }
    if (layouts[l]->num_tokens() != layouts[0]->num_tokens()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layouts[", l, "] has ", layouts[l]->num_tokens(), " tokens but layouts[0] has ",
          layouts[0]->num_tokens(), "; the masks of one partition describe the same row"));
    }
  }
  Partition p;
  p.num_tokens_ = layouts[0]->num_tokens();
  p.weights_ = NormalizedWeights(num_ranks, weights);
  const RowUnits row = CollectUnits(layouts);
  p.target_.resize(num_ranks);
  for (int r = 0; r < num_ranks; ++r) {
    p.target_[r] = static_cast<double>(row.total_work) * p.weights_[r];
  }
  UnitPlacer placer(p.weights_, p.target_, layouts, row.spans, row.memory_only);
  for (size_t ui : ByDecreasingWork(row.units)) placer.Place(row.units[ui]);
  p.work_ = placer.work();
  p.max_position_work_ = placer.max_position_work();
  p.split_units_ = placer.split_units();
  AssembleShards(placer.TakePieces(), &p.ranges_, &p.local_tokens_, &p.placements_);
  HSAP_RETURN_IF_ERROR(CheckTiling(p.placements_, p.num_tokens_));
  return p;
}

absl::StatusOr<Partition> Partition::FromRanges(const Layout& layout,
                                                std::vector<std::vector<TokenRange>> ranges) {
  const int num_ranks = static_cast<int>(ranges.size());
  if (num_ranks < 1) return absl::InvalidArgumentError("ranges: at least one rank is needed");
  const int64_t num_tokens = layout.num_tokens();
  Partition p;
  p.num_tokens_ = num_tokens;
  p.ranges_.assign(num_ranks, {});
  p.local_tokens_.assign(num_ranks, 0);
  p.work_.assign(num_ranks, 0);
  const std::vector<int64_t> token_work = layout.VisibleKeysPerQuery();
  for (int r = 0; r < num_ranks; ++r) {
    int64_t local = 0;
    for (const TokenRange& t : ranges[r]) {
      if (t.begin < 0 || t.end > num_tokens || t.begin > t.end) {
        return absl::InvalidArgumentError(absl::StrCat("ranges[", r, "] holds [", t.begin, ", ",
                                                       t.end, "), not inside [0, ", num_tokens,
                                                       ")"));
      }
      if (t.begin == t.end) continue;
      std::vector<TokenRange>& out = p.ranges_[r];
      if (!out.empty() && out.back().end > t.begin) {
        return absl::InvalidArgumentError(absl::StrCat(
            "ranges[", r, "] is not increasing and disjoint at [", t.begin, ", ", t.end, ")"));
      }
      if (!out.empty() && out.back().end == t.begin) {
        out.back().end = t.end;
        p.placements_.back().end = t.end;
      } else {
        out.push_back(t);
        p.placements_.push_back({t.begin, t.end, r, local});
      }
      local += t.size();
      for (int64_t i = t.begin; i < t.end; ++i) p.work_[r] += token_work[i];
    }
    p.local_tokens_[r] = local;
  }
  std::sort(p.placements_.begin(), p.placements_.end(),
            [](const Placement& a, const Placement& b) { return a.begin < b.begin; });
  int64_t expect = 0;
  for (const Placement& pl : p.placements_) {
    if (pl.begin != expect) {
      return absl::InvalidArgumentError(
          absl::StrCat("ranges do not tile the row: token ", std::min(expect, pl.begin),
                       pl.begin > expect ? " belongs to no rank" : " belongs to two ranks"));
    }
    expect = pl.end;
  }
  if (expect != num_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("ranges do not tile the row: token ", expect, " belongs to no rank"));
  }
  int64_t total = 0;
  for (int64_t w : p.work_) total += w;
  p.weights_.assign(num_ranks, 0.0);
  p.target_.assign(num_ranks, 0.0);
  for (int r = 0; r < num_ranks; ++r) {
    p.target_[r] = static_cast<double>(p.work_[r]);
    p.weights_[r] = total > 0 ? static_cast<double>(p.work_[r]) / static_cast<double>(total)
                    : num_tokens > 0
                        ? static_cast<double>(p.local_tokens_[r]) / static_cast<double>(num_tokens)
                        : 1.0 / num_ranks;
  }
  return p;
}

uint64_t Partition::Fingerprint() const {
  uint64_t h = Mix(0x70617274u /* "part" */, static_cast<uint64_t>(num_tokens_));
  h = Mix(h, static_cast<uint64_t>(ranges_.size()));
  for (const Placement& pl : placements_) {
    h = Mix(Mix(Mix(h, static_cast<uint64_t>(pl.begin)), static_cast<uint64_t>(pl.end)),
            static_cast<uint64_t>(pl.rank));
  }
  return h;
}

std::vector<TokenRun> Partition::Runs(int rank) const {
  std::vector<TokenRun> runs;
  runs.reserve(ranges_[rank].size());
  int64_t local = 0;
  for (const TokenRange& t : ranges_[rank]) {
    runs.push_back({t.begin, local, t.size()});
    local += t.size();
  }
  return runs;
}

size_t Partition::PlacementIndexOf(int64_t position) const {
  auto it = std::upper_bound(placements_.begin(), placements_.end(), position,
                             [](int64_t pos, const Placement& pl) { return pos < pl.begin; });
  return static_cast<size_t>(it - placements_.begin()) - 1;
}

size_t Partition::PlacementIndexOf(int64_t position, size_t hint) const {
  const size_t n = placements_.size();
  size_t i = std::min(hint, n - 1);
  for (int step = 0; step < 8; ++step) {
    if (position < placements_[i].begin) {
      if (i == 0) break;
      --i;
    } else if (position >= placements_[i].end) {
      if (i + 1 == n) break;
      ++i;
    } else {
      return i;
    }
  }
  return PlacementIndexOf(position);
}

void Partition::Scatter(const void* row, size_t bytes_per_token, void* const* shards) const {
  const char* src = static_cast<const char*>(row);
  for (const Placement& pl : placements_) {
    const size_t bytes = static_cast<size_t>(pl.end - pl.begin) * bytes_per_token;
    if (bytes == 0) continue;
    std::memcpy(static_cast<char*>(shards[pl.rank]) + pl.local_begin * bytes_per_token,
                src + pl.begin * bytes_per_token, bytes);
  }
}

void Partition::Gather(const void* const* shards, size_t bytes_per_token, void* row) const {
  char* dst = static_cast<char*>(row);
  for (const Placement& pl : placements_) {
    const size_t bytes = static_cast<size_t>(pl.end - pl.begin) * bytes_per_token;
    if (bytes == 0) continue;
    std::memcpy(dst + pl.begin * bytes_per_token,
                static_cast<const char*>(shards[pl.rank]) + pl.local_begin * bytes_per_token,
                bytes);
  }
}

}  // namespace hsap
