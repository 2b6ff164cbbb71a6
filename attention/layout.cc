#include "attention/layout.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <queue>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace hsap {
namespace {

// sum_{t=0}^{x-1} clamp(t, 0, width): the number of (i, j) pairs counted by RampSum below.
int64_t ClampedRampPrefix(int64_t x, int64_t width) {
  if (x <= 0) return 0;
  if (x <= width + 1) return x * (x - 1) / 2;
  return width * (width + 1) / 2 + (x - width - 1) * width;
}

// #{(q, k) : q in [q0, q1), k in [k0, k1), k - q <= c}.
int64_t PairsAtOrBelow(int64_t q0, int64_t q1, int64_t k0, int64_t k1, int64_t c) {
  // Beyond these bounds the count is constant; clamping keeps the arithmetic small.
  c = std::clamp(c, k0 - q1, k1 - q0);
  // For query q the keys k <= q + c number clamp(q + c - k0 + 1, 0, width).
  const int64_t width = k1 - k0;
  const int64_t a = c - k0 + 1;
  return ClampedRampPrefix(q1 + a, width) - ClampedRampPrefix(q0 + a, width);
}

int64_t ClampDiag(int64_t d) { return std::clamp(d, -kNoDiagLimit, kNoDiagLimit); }

// The band of a slice in absolute coordinates: lo <= k - q <= hi (saturated at the limits).
std::pair<int64_t, int64_t> AbsoluteBand(const MaskSlice& s) {
  const int64_t shift = s.k_begin - s.q_begin;
  const int64_t lo = s.diag_lo <= -kNoDiagLimit ? -kNoDiagLimit : ClampDiag(s.diag_lo) + shift;
  const int64_t hi = s.diag_hi >= kNoDiagLimit ? kNoDiagLimit : ClampDiag(s.diag_hi) + shift;
  return {lo, hi};
}

// splitmix64's finaliser: a well-mixed, platform-independent step of the fingerprint.
uint64_t Mix(uint64_t h, uint64_t v) {
  uint64_t z = h ^ (v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Reports every pair of slices whose rectangles overlap, in O(n log n + overlapping pairs
// * log n): a sweep over query rows keeps the slices that contain the current row in a
// max-segment-tree over the slices sorted by k_begin (value: k_end of an active slice), so
// that the slices meeting a key range are found without visiting the others.
absl::Status CheckNoOverlap(const std::vector<MaskSlice>& slices) {
  const int n = static_cast<int>(slices.size());
  if (n < 2) return absl::OkStatus();
  std::vector<int> by_k(n);
  for (int i = 0; i < n; ++i) by_k[i] = i;
  std::sort(by_k.begin(), by_k.end(),
            [&](int a, int b) { return slices[a].k_begin < slices[b].k_begin; });
  std::vector<int> leaf_of(n);
  std::vector<int64_t> sorted_k_begin(n);
  for (int p = 0; p < n; ++p) {
    leaf_of[by_k[p]] = p;
    sorted_k_begin[p] = slices[by_k[p]].k_begin;
  }
  int size = 1;
  while (size < n) size *= 2;
  constexpr int64_t kInactive = std::numeric_limits<int64_t>::min();
  std::vector<int64_t> tree(2 * size, kInactive);
  auto set_leaf = [&](int p, int64_t value) {
    int node = p + size;
    tree[node] = value;
    for (node /= 2; node >= 1; node /= 2) tree[node] = std::max(tree[2 * node], tree[2 * node + 1]);
  };

  std::vector<int> by_q(n);
  for (int i = 0; i < n; ++i) by_q[i] = i;
  std::sort(by_q.begin(), by_q.end(),
            [&](int a, int b) { return slices[a].q_begin < slices[b].q_begin; });
  using EndAndId = std::pair<int64_t, int>;
  std::priority_queue<EndAndId, std::vector<EndAndId>, std::greater<>> active_by_q_end;
  std::vector<int> stack;
  for (int id : by_q) {
    const MaskSlice& s = slices[id];
    while (!active_by_q_end.empty() && active_by_q_end.top().first <= s.q_begin) {
      set_leaf(leaf_of[active_by_q_end.top().second], kInactive);
      active_by_q_end.pop();
    }
    // Active slices with k_begin < s.k_end (a prefix of the leaves) and k_end > s.k_begin.
    const int prefix =
        static_cast<int>(std::lower_bound(sorted_k_begin.begin(), sorted_k_begin.end(), s.k_end) -
                         sorted_k_begin.begin());
    stack.assign(1, 1);
    while (!stack.empty()) {
      const int node = stack.back();
      stack.pop_back();
      if (tree[node] <= s.k_begin) continue;
      int first = node;  // the leftmost leaf below `node`
      while (first < size) first *= 2;
      const int lo = first - size;
      if (lo >= prefix) continue;
      if (node >= size) {
        const int other_id = by_k[lo];
        const MaskSlice& o = slices[other_id];
        // Both contain row s.q_begin and their key ranges meet: the rectangles overlap.
        // They conflict iff some (q, k) of the intersection lies in both bands.
        const int64_t q0 = std::max(s.q_begin, o.q_begin), q1 = std::min(s.q_end, o.q_end);
        const int64_t k0 = std::max(s.k_begin, o.k_begin), k1 = std::min(s.k_end, o.k_end);
        const auto [lo_s, hi_s] = AbsoluteBand(s);
        const auto [lo_o, hi_o] = AbsoluteBand(o);
        const int64_t lo_band = std::max({lo_s, lo_o, k0 - (q1 - 1)});
        const int64_t hi_band = std::min({hi_s, hi_o, (k1 - 1) - q0});
        if (lo_band <= hi_band) {
          return absl::InvalidArgumentError(absl::StrCat(
              "slices overlap: slices[", std::min(id, other_id), "] ",
              slices[std::min(id, other_id)].ToString(), " and slices[", std::max(id, other_id),
              "] ", slices[std::max(id, other_id)].ToString(),
              " share visible (query, key) pairs; every pair must belong to one slice"));
        }
        continue;
      }
      stack.push_back(2 * node);
      stack.push_back(2 * node + 1);
    }
    set_leaf(leaf_of[id], s.k_end);
    active_by_q_end.emplace(s.q_end, id);
  }
  return absl::OkStatus();
}

void SortSlices(std::vector<MaskSlice>& slices) {
  std::stable_sort(slices.begin(), slices.end(), [](const MaskSlice& a, const MaskSlice& b) {
    return a.q_begin != b.q_begin ? a.q_begin < b.q_begin : a.k_begin < b.k_begin;
  });
}

}  // namespace

int64_t CountPairsInBand(int64_t q_begin, int64_t q_end, int64_t k_begin, int64_t k_end, int64_t lo,
                         int64_t hi) {
  if (q_begin >= q_end || k_begin >= k_end || lo > hi) return 0;
  const int64_t below_hi = PairsAtOrBelow(q_begin, q_end, k_begin, k_end, hi);
  const int64_t below_lo =
      lo <= -kNoDiagLimit ? 0 : PairsAtOrBelow(q_begin, q_end, k_begin, k_end, lo - 1);
  return below_hi - below_lo;
}

std::string DescribeDiagBand(int64_t diag_lo, int64_t diag_hi) {
  const bool open_below = diag_lo <= -kNoDiagLimit, open_above = diag_hi >= kNoDiagLimit;
  if (open_below && open_above) return "full";
  if (diag_hi == 0 && open_below) return "causal";
  if (diag_hi == 0 && diag_lo <= 0) return absl::StrCat("causal, window ", 1 - diag_lo);
  return absl::StrCat("diag [", open_below ? "-inf" : absl::StrCat(diag_lo), ", ",
                      open_above ? "+inf" : absl::StrCat(diag_hi), "]");
}

std::string MaskSlice::ToString() const {
  return absl::StrCat("{q [", q_begin, ", ", q_end, "), k [", k_begin, ", ", k_end, "), ",
                      DescribeDiagBand(diag_lo, diag_hi), "}");
}

MaskSlice MaskSlice::Full(int64_t q_begin, int64_t q_end, int64_t k_begin, int64_t k_end) {
  MaskSlice s;
  s.q_begin = q_begin;
  s.q_end = q_end;
  s.k_begin = k_begin;
  s.k_end = k_end;
  return s;
}

MaskSlice MaskSlice::Causal(int64_t q_begin, int64_t q_end, int64_t k_begin, int64_t k_end,
                            int64_t window) {
  MaskSlice s = Full(q_begin, q_end, k_begin, k_end);
  s.diag_hi = 0;
  if (window > 0) s.diag_lo = -(window - 1);
  return s;
}

int64_t MaskSlice::VisibleKeys(int64_t q) const {
  if (q < q_begin || q >= q_end || k_begin >= k_end) return 0;
  const auto [lo, hi] = AbsoluteBand(*this);
  // Visible keys of q: [max(k_begin, q + lo), min(k_end - 1, q + hi)].
  const int64_t first = lo <= -kNoDiagLimit ? k_begin : std::max(k_begin, q + lo);
  const int64_t last = hi >= kNoDiagLimit ? k_end - 1 : std::min(k_end - 1, q + hi);
  return std::max<int64_t>(0, last - first + 1);
}

int64_t MaskSlice::VisiblePairsIn(int64_t qb, int64_t qe, int64_t kb, int64_t ke) const {
  const auto [lo, hi] = AbsoluteBand(*this);
  return CountPairsInBand(std::max(qb, q_begin), std::min(qe, q_end), std::max(kb, k_begin),
                          std::min(ke, k_end), lo, hi);
}

absl::StatusOr<Layout> Layout::FromDocuments(absl::Span<const int64_t> cu_seqlens,
                                             absl::Span<const MaskKind> kinds,
                                             absl::Span<const int64_t> params) {
  if (cu_seqlens.empty()) {
    return absl::InvalidArgumentError(
        "cu_seqlens is empty; it needs num_docs + 1 entries, starting with 0");
  }
  if (cu_seqlens[0] != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cu_seqlens[0] is ", cu_seqlens[0], "; it must be 0"));
  }
  const size_t num_docs = cu_seqlens.size() - 1;
  for (size_t i = 1; i < cu_seqlens.size(); ++i) {
    if (cu_seqlens[i] < cu_seqlens[i - 1]) {
      return absl::InvalidArgumentError(
          absl::StrCat("cu_seqlens must be non-decreasing, but cu_seqlens[", i,
                       "] = ", cu_seqlens[i], " < cu_seqlens[", i - 1, "] = ", cu_seqlens[i - 1]));
    }
  }
  if (cu_seqlens.back() > kMaxRowTokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cu_seqlens ends at ", cu_seqlens.back(), "; a row holds at most 2^31 = ", kMaxRowTokens,
        " tokens (so that its visible pairs, up to tokens^2, fit int64)"));
  }
  if (!kinds.empty() && kinds.size() != num_docs) {
    return absl::InvalidArgumentError(absl::StrCat("kinds has ", kinds.size(),
                                                   " entries; it must be empty (all causal) or "
                                                   "have one per document (",
                                                   num_docs, ")"));
  }
  if (!params.empty() && params.size() != num_docs) {
    return absl::InvalidArgumentError(
        absl::StrCat("params has ", params.size(),
                     " entries; it must be empty or have one per document (", num_docs, ")"));
  }
  Layout layout;
  layout.num_tokens_ = cu_seqlens.back();
  layout.documents_.reserve(num_docs);
  layout.slices_.reserve(num_docs);
  for (size_t i = 0; i < num_docs; ++i) {
    Document doc;
    doc.begin = cu_seqlens[i];
    doc.end = cu_seqlens[i + 1];
    doc.kind = kinds.empty() ? MaskKind::kCausal : kinds[i];
    const int64_t length = doc.end - doc.begin;
    switch (doc.kind) {
      case MaskKind::kCausal:
      case MaskKind::kFull:
        break;
      case MaskKind::kPrefixLM:
      case MaskKind::kSlidingWindow: {
        if (length == 0) break;  // an empty document's parameter is ignored
        const bool prefix = doc.kind == MaskKind::kPrefixLM;
        if (params.empty()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "params is empty but document ", i, " is ", prefix ? "prefix-LM" : "sliding-window",
              " and needs its ", prefix ? "prefix length" : "window"));
        }
        doc.param = params[i];
        if (prefix && (doc.param < 0 || doc.param > length)) {
          return absl::InvalidArgumentError(absl::StrCat(
              "params[", i, "] = ", doc.param, ": the prefix length of document ", i,
              " must be in [0, ", length, "] (the document has ", length, " tokens)",
              doc.param > length ? "; a prefix longer than the document" : ""));
        }
        if (!prefix && doc.param < 1) {
          return absl::InvalidArgumentError(absl::StrCat(
              "params[", i, "] = ", doc.param, ": the window of document ", i,
              " must be at least 1 (1: each token sees only itself)"));
        }
        // A window applies per document: one at least as long as the document is the whole
        // document (plain causal), stored as the document's length so that equal masks
        // compare and fingerprint equal.
        if (!prefix) doc.param = std::min(doc.param, length);
        break;
      }
      default:
        return absl::InvalidArgumentError(absl::StrCat(
            "kinds[", i, "] = ", static_cast<int>(doc.kind), " is not a mask kind (0..3)"));
    }
    layout.documents_.push_back(doc);
    if (length == 0) continue;
    const int64_t b = doc.begin, e = doc.end;
    switch (doc.kind) {
      case MaskKind::kCausal:
        layout.slices_.push_back(MaskSlice::Causal(b, e, b, e));
        break;
      case MaskKind::kFull:
        layout.slices_.push_back(MaskSlice::Full(b, e, b, e));
        break;
      case MaskKind::kPrefixLM:
        if (doc.param > 0) layout.slices_.push_back(MaskSlice::Full(b, e, b, b + doc.param));
        if (doc.param < length) {
          layout.slices_.push_back(MaskSlice::Causal(b + doc.param, e, b + doc.param, e));
        }
        break;
      case MaskKind::kSlidingWindow:
        layout.slices_.push_back(MaskSlice::Causal(b, e, b, e, doc.param));
        break;
    }
  }
  SortSlices(layout.slices_);
  return layout;
}

absl::StatusOr<Layout> Layout::FromSlices(int64_t num_tokens, std::vector<MaskSlice> slices) {
  if (num_tokens < 0 || num_tokens > kMaxRowTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_tokens = ", num_tokens, "; it must be in [0, 2^31 = ", kMaxRowTokens,
                     "] (so that the row's visible pairs, up to tokens^2, fit int64)"));
  }
  for (size_t i = 0; i < slices.size(); ++i) {
    MaskSlice& s = slices[i];
    const std::string where = absl::StrCat("slices[", i, "] ", s.ToString());
    if (s.q_begin < 0 || s.q_end > num_tokens || s.k_begin < 0 || s.k_end > num_tokens) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " lies outside the row [0, ", num_tokens, ")"));
    }
    if (s.q_begin >= s.q_end || s.k_begin >= s.k_end) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " is empty; a slice needs q_begin < q_end and k_begin < k_end"));
    }
    if (s.diag_lo > s.diag_hi) {
      return absl::InvalidArgumentError(absl::StrCat(where, " has diag_lo > diag_hi"));
    }
    s.diag_lo = ClampDiag(s.diag_lo);
    s.diag_hi = ClampDiag(s.diag_hi);
    if (s.VisiblePairs() == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " has no visible pair: its diagonal band misses the rectangle"));
    }
  }
  HSAP_RETURN_IF_ERROR(CheckNoOverlap(slices));
  Layout layout;
  layout.num_tokens_ = num_tokens;
  layout.slices_ = std::move(slices);
  SortSlices(layout.slices_);
  return layout;
}

int64_t Layout::VisiblePairs() const {
  int64_t total = 0;
  for (const MaskSlice& s : slices_) total += s.VisiblePairs();
  return total;
}

std::vector<int64_t> Layout::VisibleKeysPerQuery() const {
  std::vector<int64_t> counts(num_tokens_, 0);
  for (const MaskSlice& s : slices_) {
    for (int64_t q = s.q_begin; q < s.q_end; ++q) counts[q] += s.VisibleKeys(q);
  }
  return counts;
}

bool Layout::Visible(int64_t q, int64_t k) const {
  for (const MaskSlice& s : slices_) {
    if (s.Visible(q, k)) return true;
  }
  return false;
}

uint64_t Layout::Fingerprint() const {
  uint64_t h = Mix(0x68736170u /* "hsap" */, static_cast<uint64_t>(num_tokens_));
  h = Mix(h, slices_.size());
  for (const MaskSlice& s : slices_) {
    for (int64_t v : {s.q_begin, s.q_end, s.k_begin, s.k_end, s.diag_lo, s.diag_hi}) {
      h = Mix(h, static_cast<uint64_t>(v));
    }
  }
  return h;
}

}  // namespace hsap
