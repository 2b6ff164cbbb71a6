#include "lib/cuda/cudnn/attention_pieces.h"

#include <algorithm>
#include <optional>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "attention/layout.h"

namespace hsap::cuda {
namespace {

// A rectangle of buffer rows with a band in buffer-row coordinates: key row kr is visible to
// query row qr iff lo <= kr - qr <= hi (+-kNoDiagLimit: no bound), as a KeySegment.
struct BandPiece {
  int64_t q0 = 0, q1 = 0, k0 = 0, k1 = 0;
  int64_t lo = -kNoDiagLimit, hi = kNoDiagLimit;

  int64_t Pairs() const { return CountPairsInBand(q0, q1, k0, k1, lo, hi); }
};

bool NoLower(int64_t lo) { return lo <= -kNoDiagLimit; }
bool NoUpper(int64_t hi) { return hi >= kNoDiagLimit; }

// The band relative to the rectangle's corner: row i = qr - q0, key j = kr - k0 is visible
// iff lo <= j - i <= hi.
struct RelativeBand {
  int64_t lo, hi;
};
RelativeBand Relative(const BandPiece& p) {
  const int64_t d = p.k0 - p.q0;
  return {NoLower(p.lo) ? -kNoDiagLimit : p.lo - d, NoUpper(p.hi) ? kNoDiagLimit : p.hi - d};
}

// Drops the rows that see no key, then the keys no row sees (one pass suffices: a row that
// sees a key keeps all it saw). False when nothing is visible.
bool Clip(BandPiece& p) {
  if (p.q1 <= p.q0 || p.k1 <= p.k0) return false;
  const RelativeBand b = Relative(p);
  const int64_t lq = p.q1 - p.q0, lk = p.k1 - p.k0;
  // Row i sees [max(0, i + lo), min(lk - 1, i + hi)].
  const int64_t r0 = NoUpper(b.hi) ? 0 : std::max<int64_t>(0, -b.hi);
  const int64_t r1 = NoLower(b.lo) ? lq - 1 : std::min<int64_t>(lq - 1, lk - 1 - b.lo);
  if (r0 > r1) return false;
  const int64_t c0 = NoLower(b.lo) ? 0 : std::max<int64_t>(0, r0 + b.lo);
  const int64_t c1 = NoUpper(b.hi) ? lk - 1 : std::min<int64_t>(lk - 1, r1 + b.hi);
  if (c0 > c1) return false;
  const int64_t q0 = p.q0, k0 = p.k0;
  p.q0 = q0 + r0;
  p.q1 = q0 + r1 + 1;
  p.k0 = k0 + c0;
  p.k1 = k0 + c1 + 1;
  return true;
}

void Push(const BandPiece& p, CudnnMask mask, std::vector<AttentionPiece>* out) {
  out->push_back(AttentionPiece{p.q0, p.q1 - p.q0, p.k0, p.k1 - p.k0, mask, p.Pairs()});
}

// Emits `p` (any band) as pieces with cuDNN masks, cutting it by rows where one mask cannot
// cover it (see the header).
void Emit(BandPiece p, std::vector<AttentionPiece>* out) {
  if (!Clip(p)) return;
  const RelativeBand b = Relative(p);
  const int64_t lq = p.q1 - p.q0, lk = p.k1 - p.k0;
  const bool upper = !NoUpper(b.hi) && b.hi < lk - 1;     // some row loses keys on the right
  const bool lower = !NoLower(b.lo) && b.lo > -(lq - 1);  // some row loses keys on the left
  if (!upper && !lower) {
    Push(p, {CudnnMaskKind::kNone, 0}, out);
    return;
  }
  if (!upper) {  // clipped: b.lo <= 0, so the left bound is >= 1
    Push(p, {CudnnMaskKind::kLeftBandTopLeft, 1 - b.lo}, out);
    return;
  }
  // Clipped: b.hi >= 0 and b.hi >= lk - lq. The rows whose right edge falls inside the keys,
  // [0, lk - b.hi), take a bottom-right aligned mask (top-left when b.hi == 0); the rows
  // below see every key up to the end and go on as a piece of their own.
  const int64_t rows = lk - b.hi;
  BandPiece head = p;
  head.q1 = p.q0 + rows;
  const bool top_left = b.hi == 0;
  CudnnMask mask;
  if (lower && b.lo > -(rows - 1)) {  // the window still cuts some row of these
    mask = {top_left ? CudnnMaskKind::kWindowTopLeft : CudnnMaskKind::kWindowBottomRight,
            b.hi - b.lo + 1};
  } else {
    mask = {top_left ? CudnnMaskKind::kCausalTopLeft : CudnnMaskKind::kCausalBottomRight, 0};
  }
  if (Clip(head)) Push(head, mask, out);
  if (rows < lq) {
    BandPiece tail = p;
    tail.q0 = p.q0 + rows;
    Emit(tail, out);
  }
}

// `a` (rows just above `p`) and `p` as one piece, when one exists: the union of their
// rectangles under the tighter of their bands (the work list drops a side of a segment's band
// that no pair of its block needs, so the segments of one slice may differ there), provided
// that band keeps every pair of each (equal counts: it only removes) and the union holds no
// other pair (the union then holds both, so equal counts mean equal sets).
std::optional<BandPiece> Join(const BandPiece& a, int64_t a_pairs, const BandPiece& p,
                              int64_t p_pairs) {
  if (a.q1 != p.q0) return std::nullopt;
  const int64_t lo = std::max(a.lo, p.lo), hi = std::min(a.hi, p.hi);
  if (lo > hi) return std::nullopt;
  BandPiece ta = a, tp = p;
  ta.lo = tp.lo = lo;
  ta.hi = tp.hi = hi;
  if (ta.Pairs() != a_pairs || tp.Pairs() != p_pairs) return std::nullopt;
  BandPiece u{a.q0, p.q1, std::min(a.k0, p.k0), std::max(a.k1, p.k1), lo, hi};
  if (u.Pairs() != a_pairs + p_pairs) return std::nullopt;
  return u;
}

// The work list's segments as band pieces, segments of consecutive blocks that continue one
// another joined (Join), so that one slice of one run is one piece.
std::vector<BandPiece> JoinSegments(const WorkList& work) {
  std::vector<BandPiece> done, open, next;
  std::vector<int64_t> open_pairs, next_pairs;
  for (const QueryBlock& block : work.blocks) {
    std::vector<bool> used(open.size(), false);
    next.clear();
    next_pairs.clear();
    for (int64_t s = block.seg_begin; s < block.seg_end; ++s) {
      const KeySegment& seg = work.segments[static_cast<size_t>(s)];
      BandPiece p{block.q_begin, block.q_end, seg.k_begin, seg.k_end, seg.diag_lo, seg.diag_hi};
      if (!Clip(p)) continue;
      const int64_t pairs = p.Pairs();
      bool joined = false;
      for (size_t o = 0; o < open.size() && !joined; ++o) {
        if (used[o]) continue;
        const std::optional<BandPiece> u = Join(open[o], open_pairs[o], p, pairs);
        if (!u.has_value()) continue;
        used[o] = true;
        joined = true;
        next.push_back(*u);
        next_pairs.push_back(open_pairs[o] + pairs);
      }
      if (!joined) {
        next.push_back(p);
        next_pairs.push_back(pairs);
      }
    }
    for (size_t o = 0; o < open.size(); ++o) {
      if (!used[o]) done.push_back(open[o]);
    }
    std::swap(open, next);
    std::swap(open_pairs, next_pairs);
  }
  done.insert(done.end(), open.begin(), open.end());
  return done;
}

}  // namespace

bool CudnnMask::Admits(int64_t i, int64_t j, int64_t q_len, int64_t k_len) const {
  if (i < 0 || i >= q_len || j < 0 || j >= k_len) return false;
  bool bottom_right = false, right = false, left = false;
  switch (kind) {
    case CudnnMaskKind::kNone:
      return true;
    case CudnnMaskKind::kCausalTopLeft:
      right = true;
      break;
    case CudnnMaskKind::kCausalBottomRight:
      right = bottom_right = true;
      break;
    case CudnnMaskKind::kWindowTopLeft:
      right = left = true;
      break;
    case CudnnMaskKind::kWindowBottomRight:
      right = left = bottom_right = true;
      break;
    case CudnnMaskKind::kLeftBandTopLeft:
      left = true;
      break;
  }
  // cudnn-frontend's composite mask: the row index shifted by seq_len_kv - seq_len_q for a
  // bottom-right alignment; kept where row >= col (right bound 0) and col + l > row (left).
  const int64_t row = bottom_right ? i + k_len - q_len : i;
  if (right && !(row >= j)) return false;
  if (left && !(j + left_bound > row)) return false;
  return true;
}

std::string CudnnMask::ToString() const {
  switch (kind) {
    case CudnnMaskKind::kNone:
      return "none";
    case CudnnMaskKind::kCausalTopLeft:
      return "causal top-left";
    case CudnnMaskKind::kCausalBottomRight:
      return "causal bottom-right";
    case CudnnMaskKind::kWindowTopLeft:
      return absl::StrCat("window ", left_bound, " top-left");
    case CudnnMaskKind::kWindowBottomRight:
      return absl::StrCat("window ", left_bound, " bottom-right");
    case CudnnMaskKind::kLeftBandTopLeft:
      return absl::StrCat("left band ", left_bound, " top-left");
  }
  return "?";
}

int MinCudnnVersion(CudnnMaskKind kind) {
  switch (kind) {
    case CudnnMaskKind::kNone:
    case CudnnMaskKind::kCausalTopLeft:
      return 90000;
    case CudnnMaskKind::kWindowTopLeft:
      return 90200;
    case CudnnMaskKind::kCausalBottomRight:
    case CudnnMaskKind::kWindowBottomRight:
      return 90600;
    case CudnnMaskKind::kLeftBandTopLeft:
      return 91002;
  }
  return 1 << 30;
}

absl::StatusOr<std::vector<AttentionPiece>> DecomposeWorkList(const WorkList& work) {
  std::vector<AttentionPiece> pieces;
  for (const BandPiece& p : JoinSegments(work)) Emit(p, &pieces);
  std::sort(pieces.begin(), pieces.end(), [](const AttentionPiece& a, const AttentionPiece& b) {
    return std::tie(a.q_begin, a.k_begin) < std::tie(b.q_begin, b.k_begin);
  });
  int64_t pairs = 0;
  for (const AttentionPiece& p : pieces) pairs += p.pairs;
  if (pairs != work.visible_pairs) {
    return absl::InternalError(absl::StrCat("the cuDNN pieces of a work list hold ", pairs,
                                            " visible pairs per head; the work list ",
                                            work.visible_pairs));
  }
  return pieces;
}

std::vector<CudnnCall> GroupIntoCalls(absl::Span<const AttentionPiece> pieces,
                                      absl::Span<const size_t> which) {
  std::vector<size_t> order;
  for (size_t i : which) {
    if (i < pieces.size()) order.push_back(i);
  }
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return std::tie(pieces[a].q_begin, pieces[a].k_begin, a) <
           std::tie(pieces[b].q_begin, pieces[b].k_begin, b);
  });
  std::vector<CudnnCall> calls;
  for (size_t i : order) {
    const AttentionPiece& p = pieces[i];
    CudnnCall* into = nullptr;
    for (CudnnCall& c : calls) {
      const AttentionPiece& last = pieces[c.entries.back()];
      if (c.mask == p.mask && last.q_end() <= p.q_begin && last.k_end() <= p.k_begin) {
        into = &c;
        break;
      }
    }
    if (into == nullptr) {
      calls.emplace_back();
      into = &calls.back();
      into->mask = p.mask;
    }
    into->entries.push_back(i);
    into->max_q_len = std::max(into->max_q_len, p.q_len);
    into->max_k_len = std::max(into->max_k_len, p.k_len);
    into->pairs += p.pairs;
  }
  return calls;
}

PieceBand BandOfPiece(const AttentionPiece& piece) {
  const int64_t shift = piece.k_begin - piece.q_begin;  // buffer diagonal of the corner
  const int64_t br = piece.k_len - piece.q_len;         // bottom-right alignment
  const int64_t l = piece.mask.left_bound;
  int64_t lo = -kNoDiagLimit, hi = kNoDiagLimit;  // relative to the corner
  switch (piece.mask.kind) {
    case CudnnMaskKind::kNone:
      break;
    case CudnnMaskKind::kCausalTopLeft:
      hi = 0;
      break;
    case CudnnMaskKind::kCausalBottomRight:
      hi = br;
      break;
    case CudnnMaskKind::kWindowTopLeft:
      lo = 1 - l;
      hi = 0;
      break;
    case CudnnMaskKind::kWindowBottomRight:
      lo = br - l + 1;
      hi = br;
      break;
    case CudnnMaskKind::kLeftBandTopLeft:
      lo = 1 - l;
      break;
  }
  return {NoLower(lo) ? lo : lo + shift, NoUpper(hi) ? hi : hi + shift};
}

WorkList PiecesAsWorkList(const WorkList& work, absl::Span<const AttentionPiece> pieces,
                          absl::Span<const size_t> which) {
  std::vector<const AttentionPiece*> chosen;
  for (size_t i : which) {
    if (i < pieces.size()) chosen.push_back(&pieces[i]);
  }
  WorkList out;
  for (const QueryBlock& block : work.blocks) {
    std::vector<int64_t> cuts = {block.q_begin, block.q_end};
    for (const AttentionPiece* p : chosen) {
      for (int64_t row : {p->q_begin, p->q_end()}) {
        if (row > block.q_begin && row < block.q_end) cuts.push_back(row);
      }
    }
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    for (size_t c = 0; c + 1 < cuts.size(); ++c) {
      const int64_t r0 = cuts[c], r1 = cuts[c + 1];
      QueryBlock part{r0, r1, static_cast<int64_t>(out.segments.size()), 0};
      for (const AttentionPiece* p : chosen) {
        if (p->q_begin > r0 || p->q_end() < r1) continue;  // covers all rows of the part or none
        const PieceBand band = BandOfPiece(*p);
        KeySegment seg{p->k_begin, p->k_end(), band.lo, band.hi};
        if (!NoLower(band.lo)) seg.k_begin = std::max(seg.k_begin, r0 + band.lo);
        if (!NoUpper(band.hi)) seg.k_end = std::min(seg.k_end, r1 - 1 + band.hi + 1);
        const int64_t pairs = CountPairsInBand(r0, r1, seg.k_begin, seg.k_end, band.lo, band.hi);
        if (seg.k_begin >= seg.k_end || pairs == 0) continue;
        out.segments.push_back(seg);
        out.visible_pairs += pairs;
      }
      part.seg_end = static_cast<int64_t>(out.segments.size());
      if (part.seg_end == part.seg_begin) continue;
      std::sort(out.segments.begin() + part.seg_begin, out.segments.end(),
                [](const KeySegment& a, const KeySegment& b) { return a.k_begin < b.k_begin; });
      out.blocks.push_back(part);
    }
  }
  return out;
}

}  // namespace hsap::cuda
