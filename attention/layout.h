// Layouts: the attention mask of one packed row.
//
// A packed row of `num_tokens` tokens holds documents; attention never crosses a document.
// Every layout compiles to mask slices: rectangles of the (query, key) plane with a band
// restriction on the diagonal. Slices of a layout never overlap, so every visible
// (query, key) pair belongs to exactly one slice.
#ifndef HSAP_ATTENTION_LAYOUT_H_
#define HSAP_ATTENTION_LAYOUT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace hsap {

enum class MaskKind {
  kCausal = 0,         // token i sees 0..i of its document
  kFull = 1,           // bidirectional
  kPrefixLM = 2,       // bidirectional over the first `param` tokens, causal after them
  kSlidingWindow = 3,  // causal within the last `param` tokens: (i - param, i]
};

// Half-open token positions [begin, end) of the packed row.
struct TokenRange {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
  friend bool operator==(const TokenRange&, const TokenRange&) = default;
};

// The most tokens a row (a layout) may hold. Every count derived from a row, its visible
// pairs (at most tokens^2 = 2^62) and their sums over non-overlapping slices included, then
// fits int64 without checks at each use.
inline constexpr int64_t kMaxRowTokens = int64_t{1} << 31;

// Larger than any token count; stands for "no limit" on a diagonal bound.
inline constexpr int64_t kNoDiagLimit = int64_t{1} << 60;

// Key k is visible to query q iff q in [q_begin, q_end), k in [k_begin, k_end) and
//   diag_lo <= (k - k_begin) - (q - q_begin) <= diag_hi.
// Full: (-kNoDiagLimit, kNoDiagLimit); causal: (-kNoDiagLimit, 0); causal within window w:
// (-(w - 1), 0).
struct MaskSlice {
  int64_t q_begin = 0, q_end = 0;
  int64_t k_begin = 0, k_end = 0;
  int64_t diag_lo = -kNoDiagLimit;
  int64_t diag_hi = kNoDiagLimit;

  static MaskSlice Full(int64_t q_begin, int64_t q_end, int64_t k_begin, int64_t k_end);
  // window == 0: plain causal.
  static MaskSlice Causal(int64_t q_begin, int64_t q_end, int64_t k_begin, int64_t k_end,
                          int64_t window = 0);

  bool Visible(int64_t q, int64_t k) const {
    if (q < q_begin || q >= q_end || k < k_begin || k >= k_end) return false;
    const int64_t d = (k - k_begin) - (q - q_begin);
    return d >= diag_lo && d <= diag_hi;
  }
  bool IsFull() const { return diag_lo <= -kNoDiagLimit && diag_hi >= kNoDiagLimit; }
  // Number of visible keys of query q (0 outside the slice); O(1).
  int64_t VisibleKeys(int64_t q) const;
  // Number of visible (q, k) pairs with q in [qb, qe) and k in [kb, ke); O(1) closed form.
  int64_t VisiblePairsIn(int64_t qb, int64_t qe, int64_t kb, int64_t ke) const;
  int64_t VisiblePairs() const { return VisiblePairsIn(q_begin, q_end, k_begin, k_end); }
  // The slice as its author wrote it, for messages: "{q [0, 8), k [0, 8), causal, window 4}"
  // (see DescribeDiagBand).
  std::string ToString() const;

  friend bool operator==(const MaskSlice&, const MaskSlice&) = default;
};

// A diagonal band in the user's words, never with the kNoDiagLimit sentinel: "full",
// "causal", "causal, window w" (the bands of MaskSlice::Full and MaskSlice::Causal), else
// "diag [lo, hi]" with "-inf" / "+inf" for an unlimited side.
std::string DescribeDiagBand(int64_t diag_lo, int64_t diag_hi);

// #{(q, k) : q in [q_begin, q_end), k in [k_begin, k_end), lo <= k - q <= hi}, in O(1).
// lo <= -kNoDiagLimit / hi >= kNoDiagLimit mean no bound on that side.
int64_t CountPairsInBand(int64_t q_begin, int64_t q_end, int64_t k_begin, int64_t k_end, int64_t lo,
                         int64_t hi);

struct Document {
  int64_t begin = 0, end = 0;
  MaskKind kind = MaskKind::kCausal;
  int64_t param = 0;  // prefix length (prefix-LM) or window (sliding window)

  friend bool operator==(const Document&, const Document&) = default;
};

class Layout {
 public:
  // Documents from cu_seqlens (size num_docs + 1, starting at 0, non-decreasing, at most
  // kMaxRowTokens tokens). `kinds` empty means all causal; `params` may be empty when no document
  // needs one. A prefix length must be in [0, doc length] (longer is an error); a window
  // must be >= 1 and applies per document: one longer than its document is clamped to the
  // document's length (Document::param holds the clamped value), i.e. the whole document,
  // causal. Empty documents are allowed and their params ignored. Errors
  // name the offending argument and index. Compilation: causal -> Causal(b, e, b, e);
  // full -> Full(b, e, b, e); prefix-LM n -> Full(b, e, b, b + n) + Causal(b + n, e, b + n,
  // e); sliding window w -> Causal(b, e, b, e, w); empty slices are skipped.
  static absl::StatusOr<Layout> FromDocuments(absl::Span<const int64_t> cu_seqlens,
                                              absl::Span<const MaskKind> kinds = {},
                                              absl::Span<const int64_t> params = {});
  // Arbitrary block-sparse mask. Slices must lie inside [0, num_tokens)^2, be non-empty
  // rectangles with diag_lo <= diag_hi whose band meets the rectangle, and not overlap one
  // another (checked in O(n log n + overlapping rectangles * log n); rectangles may overlap
  // when their bands are disjoint there). Diagonal bounds beyond +-kNoDiagLimit are
  // clamped to it.
  static absl::StatusOr<Layout> FromSlices(int64_t num_tokens, std::vector<MaskSlice> slices);

  int64_t num_tokens() const { return num_tokens_; }
  // The slices, sorted by (q_begin, k_begin).
  const std::vector<MaskSlice>& slices() const { return slices_; }
  // The documents of a document layout; empty for a layout built from slices.
  const std::vector<Document>& documents() const { return documents_; }

  int64_t VisiblePairs() const;
  // Visible keys of every query position, size num_tokens.
  std::vector<int64_t> VisibleKeysPerQuery() const;
  // Whether key k is visible to query q (a scan of the slices: for tests and references).
  bool Visible(int64_t q, int64_t k) const;
  // A hash of the mask (token count and slices), equal for equal masks; used to check that
  // ranks agree on a batch.
  uint64_t Fingerprint() const;

 private:
  int64_t num_tokens_ = 0;
  std::vector<MaskSlice> slices_;
  std::vector<Document> documents_;
};

}  // namespace hsap

#endif  // HSAP_ATTENTION_LAYOUT_H_
