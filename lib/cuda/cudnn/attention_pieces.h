// A step's attention work as cuDNN's fused attention takes it: pieces, masks and calls.
//
// A ring step or plan stage attends the rows of a query buffer to the rows of a key buffer
// along a work list (attention/worklist.h: query blocks, each with key segments under a
// diagonal band in buffer rows). cuDNN's fused attention (the composite SDPA graph with
// ragged, THD, offsets) takes a batch of entries instead: entry b attends q_len query rows
// from a query offset to k_len key rows from a key offset, under one mask for the whole
// batch, expressed relative to the entry's own rectangle (cudnn-frontend's SDPA attributes,
// docs/operations/Attention.md):
//   - no mask: every (row i, key j) of the rectangle, 0 <= i < q_len, 0 <= j < k_len;
//   - a right bound r = 0 (causal) with diagonal alignment a: j - i <= a, where a = 0 for
//     TOP_LEFT and a = k_len - q_len for BOTTOM_RIGHT (from the entry's actual lengths);
//   - a left bound l >= 1 (sliding window): j - i > a - l; with the right bound a window of
//     l keys, alone a band open to the right.
// (cudnn-frontend's CompositeDiagonalBandMaskNode builds exactly these comparisons from
// GEN_INDEX row/col, the seq_len tensors and the bounds.)
//
// DecomposeWorkList turns a work list into pieces, each one rectangle (query rows, key rows)
// with one such mask, exactly: every visible pair of the work list lies in exactly one
// piece, and a piece's mask admits no other pair. Segments of consecutive query blocks that
// continue one another (one slice of one run) are joined first, so a document's diagonal is
// one piece, not one per block. A band that no cuDNN mask expresses over the whole rectangle
// is cut by rows: a causal band whose diagonal meets neither corner becomes a
// bottom-right-aligned piece plus a fully visible one below it; a window band likewise a
// bottom-right window plus a left-bounded band; rows and keys that see nothing are dropped
// (so a band starting below the rectangle's top-left corner becomes top-left aligned).
// Every band hsap produces (causal with any offset, full, prefix-LM's two slices, sliding
// windows, any slice of a layout built from slices) therefore decomposes; which pieces run
// on cuDNN is then a matter of the loaded version, the device and the batch's shape
// (lib/cuda/cudnn/engine_choice.h).
//
// GroupIntoCalls packs pieces of one mask into ragged batches (one cuDNN execution each):
// the entries of a call have disjoint query rows (each writes its own O, Stats and dQ rows)
// and disjoint key rows (the backward writes dK, dV), both increasing, so that the ragged
// offsets of Q/O and K/V are non-decreasing, as in cuDNN's THD layout.
//
// Pure host code: no CUDA, no cuDNN.
#ifndef HSAP_LIB_CUDA_CUDNN_ATTENTION_PIECES_H_
#define HSAP_LIB_CUDA_CUDNN_ATTENTION_PIECES_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "attention/worklist.h"

namespace hsap::cuda {

// The diagonal masks of cuDNN's fused attention that a piece may carry (see above).
enum class CudnnMaskKind {
  kNone,               // every pair of the rectangle
  kCausalTopLeft,      // right bound 0, TOP_LEFT:      j - i <= 0
  kCausalBottomRight,  // right bound 0, BOTTOM_RIGHT:  j - i <= k_len - q_len
  kWindowTopLeft,      // left bound l, right bound 0, TOP_LEFT:  -l < j - i <= 0
  kWindowBottomRight,  // left bound l, right bound 0, BOTTOM_RIGHT:
                       //   k_len - q_len - l < j - i <= k_len - q_len
  kLeftBandTopLeft,    // left bound l only, TOP_LEFT:  j - i > -l
};
inline constexpr int kNumCudnnMaskKinds = 6;

struct CudnnMask {
  CudnnMaskKind kind = CudnnMaskKind::kNone;
  int64_t left_bound = 0;  // the window kinds and kLeftBandTopLeft: l >= 1; else 0

  // Whether cuDNN's mask admits key j for row i of a q_len x k_len entry, by cuDNN's rule
  // (above), written independently of hsap's diagonal bands.
  bool Admits(int64_t i, int64_t j, int64_t q_len, int64_t k_len) const;
  // "none", "causal top-left", "window 128 bottom-right", "left band 3 top-left".
  std::string ToString() const;
  friend bool operator==(const CudnnMask&, const CudnnMask&) = default;
};

// The oldest cuDNN (cudnnGetVersion(): major * 10000 + minor * 100 + patch) whose fused
// attention takes `kind` on ragged (THD) entries of any lengths; docs/gpu_backend.md says
// where each figure comes from. 9.0.0 for no mask and top-left causal, 9.2.0 for the
// top-left window, 9.6.0 for bottom-right alignment (before it, only with lengths that are
// multiples of 64, or with s_q == s_kv for windows), 9.10.2 for a left bound without a right
// one.
int MinCudnnVersion(CudnnMaskKind kind);

// One rectangle of a step's work with its mask.
struct AttentionPiece {
  int64_t q_begin = 0, q_len = 0;  // rows [q_begin, q_begin + q_len) of the query buffer
  int64_t k_begin = 0, k_len = 0;  // rows [k_begin, k_begin + k_len) of the key buffer
  CudnnMask mask;
  int64_t pairs = 0;  // visible (query, key) pairs, per head

  int64_t q_end() const { return q_begin + q_len; }
  int64_t k_end() const { return k_begin + k_len; }
  friend bool operator==(const AttentionPiece&, const AttentionPiece&) = default;
};

// The pieces of `work` (any work list of BuildWorkList: a whole row, a rank's local work, a
// stage's received rows), sorted by (q_begin, k_begin). Their pairs add up to
// work.visible_pairs (checked: InternalError otherwise, naming both counts). Empty for an
// empty work list. O(segments x the pieces a block continues).
absl::StatusOr<std::vector<AttentionPiece>> DecomposeWorkList(const WorkList& work);

// One ragged batch: the entries (indices into the pieces) of one cuDNN execution.
struct CudnnCall {
  CudnnMask mask;
  std::vector<size_t> entries;           // increasing and disjoint query rows and key rows
  int64_t max_q_len = 0, max_k_len = 0;  // the graph's S_q and S_kv
  int64_t pairs = 0;                     // per head, over the entries
};

// Packs pieces[i] for i in `which` (any order) into calls: pieces of one mask, each placed in
// the first call (in creation order) whose last entry ends at or before its query and key
// rows, else in a new one. Calls ordered by their first entry's (q_begin, k_begin). An index
// out of range is skipped.
std::vector<CudnnCall> GroupIntoCalls(absl::Span<const AttentionPiece> pieces,
                                      absl::Span<const size_t> which);

// Key row kr is visible to query row qr of `piece` iff lo <= kr - qr <= hi (buffer rows,
// +-kNoDiagLimit: no bound), inside its rectangle: its mask as a work list's band.
struct PieceBand {
  int64_t lo, hi;
};
PieceBand BandOfPiece(const AttentionPiece& piece);

// pieces[i] for i in `which` (pieces of `work`, DecomposeWorkList) as a work list the JIT
// kernels run in place of `work` when cuDNN takes the other pieces: each block of `work` is
// cut at the pieces' first and last rows inside it, and each part keeps as segments the
// pieces that cover its rows (key range clipped to what its rows see); parts without
// segments are dropped. Its pairs are those of the chosen pieces. Indices out of range are
// skipped.
WorkList PiecesAsWorkList(const WorkList& work, absl::Span<const AttentionPiece> pieces,
                          absl::Span<const size_t> which);

}  // namespace hsap::cuda

#endif  // HSAP_LIB_CUDA_CUDNN_ATTENTION_PIECES_H_
