// The cuDNN pieces of work lists: exact (every visible pair in exactly one piece, under
// cuDNN's own mask rule), and an fp64 interpreter of the pieces with cuDNN's semantics
// (partial O and LSE per piece, merged by LSE; gradients per piece with the final LSE)
// equals hsap's fp64 reference for every mask kind, on randomized layouts and buffers.
#include "lib/cuda/cudnn/attention_pieces.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <set>
#include <vector>

#include "attention/layout.h"
#include "attention/reference.h"
#include "attention/worklist.h"
#include "gtest/gtest.h"
#include "tests/support/attention_test_util.h"

namespace hsap::cuda {
namespace {

using ::hsap::testing::GlobalOfLocal;
using ::hsap::testing::RandomDocumentLayout;
using ::hsap::testing::RunRows;
using ::hsap::testing::SharedPromptLayout;

constexpr double kInf = std::numeric_limits<double>::infinity();

std::vector<AttentionPiece> Pieces(const Layout& layout, const std::vector<TokenRun>& q_runs,
                                   const std::vector<TokenRun>& k_runs, int64_t block_q) {
  absl::StatusOr<WorkList> work = BuildWorkList(layout.slices(), q_runs, k_runs, block_q);
  EXPECT_TRUE(work.ok()) << work.status();
  absl::StatusOr<std::vector<AttentionPiece>> pieces = DecomposeWorkList(*work);
  EXPECT_TRUE(pieces.ok()) << pieces.status();
  return pieces.ok() ? *pieces : std::vector<AttentionPiece>{};
}

std::vector<TokenRun> WholeRow(int64_t tokens) { return {TokenRun{0, 0, tokens}}; }

// Checks that the pieces of the (q_runs x k_runs) work of `layout` hold every visible pair
// once and no other, by cuDNN's rule; records the mask kinds seen.
void ExpectExact(const Layout& layout, const std::vector<TokenRun>& q_runs,
                 const std::vector<TokenRun>& k_runs, const std::vector<AttentionPiece>& pieces,
                 std::set<CudnnMaskKind>* kinds = nullptr) {
  const std::vector<int64_t> gq = GlobalOfLocal(q_runs), gk = GlobalOfLocal(k_runs);
  const int64_t qr = RunRows(q_runs), kr = RunRows(k_runs);
  std::vector<int> hits(static_cast<size_t>(qr * kr), 0);
  for (const AttentionPiece& p : pieces) {
    ASSERT_GE(p.q_begin, 0);
    ASSERT_GE(p.k_begin, 0);
    ASSERT_GT(p.q_len, 0);
    ASSERT_GT(p.k_len, 0);
    ASSERT_LE(p.q_end(), qr);
    ASSERT_LE(p.k_end(), kr);
    if (kinds != nullptr) kinds->insert(p.mask.kind);
    int64_t pairs = 0;
    std::vector<bool> row_sees(static_cast<size_t>(p.q_len), false);
    std::vector<bool> key_seen(static_cast<size_t>(p.k_len), false);
    for (int64_t i = 0; i < p.q_len; ++i) {
      for (int64_t j = 0; j < p.k_len; ++j) {
        if (!p.mask.Admits(i, j, p.q_len, p.k_len)) continue;
        ++pairs;
        row_sees[static_cast<size_t>(i)] = key_seen[static_cast<size_t>(j)] = true;
        ++hits[static_cast<size_t>((p.q_begin + i) * kr + p.k_begin + j)];
      }
    }
    EXPECT_EQ(pairs, p.pairs) << p.mask.ToString();
    // No row and no key of a piece is idle (cuDNN would compute masked rows for nothing).
    EXPECT_EQ(std::count(row_sees.begin(), row_sees.end(), false), 0) << p.mask.ToString();
    EXPECT_EQ(std::count(key_seen.begin(), key_seen.end(), false), 0) << p.mask.ToString();
    if (p.mask.kind != CudnnMaskKind::kNone && p.mask.kind != CudnnMaskKind::kCausalTopLeft &&
        p.mask.kind != CudnnMaskKind::kCausalBottomRight) {
      EXPECT_GE(p.mask.left_bound, 1) << p.mask.ToString();
    }
  }
  for (int64_t a = 0; a < qr; ++a) {
    for (int64_t b = 0; b < kr; ++b) {
      const bool visible = gq[a] >= 0 && gk[b] >= 0 && layout.Visible(gq[a], gk[b]);
      ASSERT_EQ(hits[static_cast<size_t>(a * kr + b)], visible ? 1 : 0)
          << "query row " << a << " (position " << gq[a] << "), key row " << b << " (position "
          << gk[b] << ")";
    }
  }
}

TEST(CudnnMaskTest, AdmitsFollowsCudnnsRule) {
  // 3 x 5 entry: bottom-right shifts the diagonal by k_len - q_len = 2.
  const CudnnMask tl{CudnnMaskKind::kCausalTopLeft, 0};
  const CudnnMask br{CudnnMaskKind::kCausalBottomRight, 0};
  const CudnnMask wbr{CudnnMaskKind::kWindowBottomRight, 2};
  const CudnnMask left{CudnnMaskKind::kLeftBandTopLeft, 2};
  EXPECT_TRUE(tl.Admits(1, 1, 3, 5));
  EXPECT_FALSE(tl.Admits(1, 2, 3, 5));
  EXPECT_TRUE(br.Admits(0, 2, 3, 5));
  EXPECT_FALSE(br.Admits(0, 3, 3, 5));
  EXPECT_TRUE(wbr.Admits(2, 4, 3, 5));
  EXPECT_TRUE(wbr.Admits(2, 3, 3, 5));
  EXPECT_FALSE(wbr.Admits(2, 2, 3, 5));  // j - i = 0 <= 2 - 2
  EXPECT_TRUE(left.Admits(0, 4, 3, 5));
  EXPECT_TRUE(left.Admits(2, 1, 3, 5));
  EXPECT_FALSE(left.Admits(2, 0, 3, 5));
  EXPECT_FALSE(tl.Admits(3, 0, 3, 5));  // outside the entry
  EXPECT_EQ(wbr.ToString(), "window 2 bottom-right");
}

TEST(CudnnMaskTest, VersionsGrowWithTheMasks) {
  EXPECT_EQ(MinCudnnVersion(CudnnMaskKind::kNone), 90000);
  EXPECT_EQ(MinCudnnVersion(CudnnMaskKind::kCausalTopLeft), 90000);
  EXPECT_EQ(MinCudnnVersion(CudnnMaskKind::kWindowTopLeft), 90200);
  EXPECT_EQ(MinCudnnVersion(CudnnMaskKind::kCausalBottomRight), 90600);
  EXPECT_EQ(MinCudnnVersion(CudnnMaskKind::kWindowBottomRight), 90600);
  EXPECT_EQ(MinCudnnVersion(CudnnMaskKind::kLeftBandTopLeft), 91002);
}

// A whole causal document is one top-left piece, not one per query block.
TEST(AttentionPiecesTest, ADocumentsDiagonalIsOnePiece) {
  const Layout layout = *Layout::FromDocuments({0, 200});
  const std::vector<AttentionPiece> pieces = Pieces(layout, WholeRow(200), WholeRow(200), 64);
  ASSERT_EQ(pieces.size(), 1u);
  EXPECT_EQ(pieces[0],
            (AttentionPiece{0, 200, 0, 200, {CudnnMaskKind::kCausalTopLeft, 0}, 200 * 201 / 2}));
}

// The later half of a causal document against all of its keys (a ring step's local work
// after a split): its diagonal meets the bottom-right corner.
TEST(AttentionPiecesTest, LaterQueriesAgainstTheWholeDocumentAreBottomRight) {
  const Layout layout = *Layout::FromDocuments({0, 100});
  const std::vector<AttentionPiece> pieces =
      Pieces(layout, {TokenRun{50, 0, 50}}, WholeRow(100), 64);
  ASSERT_EQ(pieces.size(), 1u);
  EXPECT_EQ(pieces[0].mask.kind, CudnnMaskKind::kCausalBottomRight);
  EXPECT_EQ(pieces[0].q_len, 50);
  EXPECT_EQ(pieces[0].k_len, 100);
}

// Keys entirely before the queries: no mask. Keys that reach past the first query: the rows
// whose diagonal falls inside the keys are bottom-right, the rest see every key.
TEST(AttentionPiecesTest, ACausalBandThatMeetsNoCornerIsCutByRows) {
  const Layout layout = *Layout::FromDocuments({0, 100});
  const std::vector<AttentionPiece> before =
      Pieces(layout, {TokenRun{50, 0, 50}}, {TokenRun{0, 0, 50}}, 64);
  ASSERT_EQ(before.size(), 1u);
  EXPECT_EQ(before[0].mask.kind, CudnnMaskKind::kNone);
  const std::vector<AttentionPiece> cut =
      Pieces(layout, {TokenRun{50, 0, 50}}, {TokenRun{0, 0, 60}}, 64);
  ASSERT_EQ(cut.size(), 2u);
  EXPECT_EQ(cut[0],
            (AttentionPiece{0, 10, 0, 60, {CudnnMaskKind::kCausalBottomRight, 0}, 10 * 51 + 45}));
  EXPECT_EQ(cut[1], (AttentionPiece{10, 40, 0, 60, {CudnnMaskKind::kNone, 0}, 40 * 60}));
  ExpectExact(layout, {TokenRun{50, 0, 50}}, {TokenRun{0, 0, 60}}, cut);
}

TEST(AttentionPiecesTest, PrefixAndWindowDocuments) {
  const Layout layout = *Layout::FromDocuments(
      {0, 100, 180}, {MaskKind::kPrefixLM, MaskKind::kSlidingWindow}, {30, 16});
  const std::vector<AttentionPiece> pieces = Pieces(layout, WholeRow(180), WholeRow(180), 64);
  ASSERT_EQ(pieces.size(), 3u);
  EXPECT_EQ(pieces[0], (AttentionPiece{0, 100, 0, 30, {CudnnMaskKind::kNone, 0}, 3000}));
  EXPECT_EQ(pieces[1].mask.kind, CudnnMaskKind::kCausalTopLeft);
  EXPECT_EQ(pieces[1].q_begin, 30);
  EXPECT_EQ(pieces[2].mask, (CudnnMask{CudnnMaskKind::kWindowTopLeft, 16}));
  EXPECT_EQ(pieces[2].q_begin, 100);
  ExpectExact(layout, WholeRow(180), WholeRow(180), pieces);
}

// A window document's later queries against the keys before them: a bottom-right window for
// the rows whose window ends inside the keys, a left band for the rows below.
TEST(AttentionPiecesTest, AWindowAgainstEarlierKeys) {
  const Layout layout = *Layout::FromDocuments({0, 100}, {MaskKind::kSlidingWindow}, {20});
  const std::vector<TokenRun> q = {TokenRun{40, 0, 40}}, k = {TokenRun{20, 0, 30}};
  const std::vector<AttentionPiece> pieces = Pieces(layout, q, k, 16);
  ASSERT_EQ(pieces.size(), 2u);
  EXPECT_EQ(pieces[0].mask.kind, CudnnMaskKind::kWindowBottomRight);
  EXPECT_EQ(pieces[1].mask.kind, CudnnMaskKind::kLeftBandTopLeft);
  ExpectExact(layout, q, k, pieces);
}

TEST(AttentionPiecesTest, EmptyWorkHasNoPieces) {
  EXPECT_TRUE(DecomposeWorkList(WorkList{})->empty());
}

// A slice layout with arbitrary bands on disjoint rectangles.
Layout RandomSliceLayout(std::mt19937_64& rng, int64_t tokens) {
  std::vector<MaskSlice> slices;
  std::uniform_int_distribution<int64_t> pos(0, tokens);
  int64_t q = 0;
  while (q < tokens) {
    const int64_t q_end = std::min(tokens, q + std::uniform_int_distribution<int64_t>(1, 60)(rng));
    int64_t k = 0;
    while (k < tokens) {
      const int64_t k_end =
          std::min(tokens, k + std::uniform_int_distribution<int64_t>(1, 80)(rng));
      if (std::bernoulli_distribution(0.35)(rng)) {
        MaskSlice s = MaskSlice::Full(q, q_end, k, k_end);
        const int shape = std::uniform_int_distribution<int>(0, 3)(rng);
        std::uniform_int_distribution<int64_t> off(-70, 70);
        if (shape >= 1) s.diag_hi = off(rng);
        if (shape >= 2) s.diag_lo = std::min(s.diag_hi, off(rng));
        if (shape == 3) {  // a lower bound only
          s.diag_lo = s.diag_hi;
          s.diag_hi = kNoDiagLimit;
        }
        if (s.VisiblePairs() > 0) {
          slices.push_back(s);
        }
      }
      k = k_end;
    }
    q = q_end;
  }
  absl::StatusOr<Layout> layout = Layout::FromSlices(tokens, slices);
  EXPECT_TRUE(layout.ok()) << layout.status();
  return *layout;
}

// Buffers of a rank: random runs of the row in a shuffled order.
std::vector<TokenRun> RandomBuffer(std::mt19937_64& rng, int64_t tokens, double keep) {
  std::vector<TokenRun> runs = ::hsap::testing::RandomRuns(rng, tokens, 6, keep);
  return runs;
}

TEST(AttentionPiecesTest, RandomLayoutsAndBuffersAreExact) {
  std::set<CudnnMaskKind> kinds;
  for (uint64_t seed = 1; seed <= 40; ++seed) {
    std::mt19937_64 rng(seed);
    const int64_t tokens = std::uniform_int_distribution<int64_t>(1, 220)(rng);
    const Layout layout = seed % 4 == 0 ? RandomSliceLayout(rng, tokens)
                          : seed % 4 == 1
                              ? SharedPromptLayout(tokens / 3, {tokens / 5, tokens / 4}, 7)
                              : RandomDocumentLayout(rng, tokens, 120);
    const int64_t block_q = seed % 3 == 0 ? 16 : 64;
    const int64_t t = layout.num_tokens();
    for (int trial = 0; trial < 3; ++trial) {
      const std::vector<TokenRun> q = trial == 0 ? WholeRow(t) : RandomBuffer(rng, t, 0.7);
      const std::vector<TokenRun> k = trial == 0 ? WholeRow(t) : RandomBuffer(rng, t, 0.6);
      const std::vector<AttentionPiece> pieces = Pieces(layout, q, k, block_q);
      SCOPED_TRACE(::testing::Message() << "seed " << seed << ", trial " << trial);
      ExpectExact(layout, q, k, pieces, &kinds);
      // A document's slices over the whole row take one piece each at most (not one per
      // block; slices that continue one another exactly, e.g. windows of 1, may share one).
      if (trial == 0 && !layout.documents().empty()) {
        EXPECT_LE(pieces.size(), layout.slices().size());
      }
    }
  }
  // Every mask kind was exercised.
  EXPECT_EQ(kinds.size(), static_cast<size_t>(kNumCudnnMaskKinds));
}

// PiecesAsWorkList: for a random split of a work list's pieces, the work list of one part holds
// exactly that part's pairs (checked pair by pair against the pieces' masks), its blocks are
// disjoint, sorted and inside the original blocks, and each block's segments are sorted.
TEST(AttentionPiecesTest, APartOfThePiecesAsAWorkList) {
  int64_t checked = 0;  // pairs over the cases
  for (uint64_t seed = 1; seed <= 24; ++seed) {
    std::mt19937_64 rng(seed + 1000);
    const int64_t tokens = std::uniform_int_distribution<int64_t>(1, 200)(rng);
    const Layout layout =
        seed % 3 == 0 ? RandomSliceLayout(rng, tokens) : RandomDocumentLayout(rng, tokens, 120);
    const int64_t t = layout.num_tokens();
    const std::vector<TokenRun> q = seed % 2 == 0 ? WholeRow(t) : RandomBuffer(rng, t, 0.7);
    const std::vector<TokenRun> k = seed % 2 == 0 ? WholeRow(t) : RandomBuffer(rng, t, 0.6);
    absl::StatusOr<WorkList> work = BuildWorkList(layout.slices(), q, k, seed % 3 == 1 ? 16 : 64);
    ASSERT_TRUE(work.ok()) << work.status();
    absl::StatusOr<std::vector<AttentionPiece>> pieces = DecomposeWorkList(*work);
    ASSERT_TRUE(pieces.ok()) << pieces.status();
    std::vector<size_t> part;
    for (size_t i = 0; i < pieces->size(); ++i) {
      if (std::bernoulli_distribution(0.5)(rng)) part.push_back(i);
    }
    part.push_back(pieces->size() + 3);  // out of range: skipped
    SCOPED_TRACE(::testing::Message() << "seed " << seed << ", " << part.size() - 1 << " of "
                                      << pieces->size() << " pieces");
    const WorkList sub = PiecesAsWorkList(*work, *pieces, part);
    const int64_t qr = RunRows(q), kr = RunRows(k);
    std::vector<int> want(static_cast<size_t>(qr * kr), 0), got(want.size(), 0);
    int64_t want_pairs = 0;
    for (size_t i : part) {
      if (i >= pieces->size()) continue;
      const AttentionPiece& p = (*pieces)[i];
      want_pairs += p.pairs;
      const PieceBand band = BandOfPiece(p);
      for (int64_t a = 0; a < p.q_len; ++a) {
        for (int64_t b = 0; b < p.k_len; ++b) {
          const bool admits = p.mask.Admits(a, b, p.q_len, p.k_len);
          const int64_t d = (p.k_begin + b) - (p.q_begin + a);
          EXPECT_EQ(admits, d >= band.lo && d <= band.hi) << p.mask.ToString();
          if (admits) ++want[static_cast<size_t>((p.q_begin + a) * kr + p.k_begin + b)];
        }
      }
    }
    EXPECT_EQ(sub.visible_pairs, want_pairs);
    int64_t prev_end = 0;
    for (const QueryBlock& blk : sub.blocks) {
      ASSERT_GE(blk.q_begin, prev_end);
      ASSERT_LT(blk.q_begin, blk.q_end);
      ASSERT_LT(blk.seg_begin, blk.seg_end);
      prev_end = blk.q_end;
      for (int64_t s = blk.seg_begin; s < blk.seg_end; ++s) {
        const KeySegment& seg = sub.segments[static_cast<size_t>(s)];
        if (s > blk.seg_begin) {
          EXPECT_LE(sub.segments[static_cast<size_t>(s - 1)].k_begin, seg.k_begin);
        }
        for (int64_t a = blk.q_begin; a < blk.q_end; ++a) {
          for (int64_t b = seg.k_begin; b < seg.k_end; ++b) {
            if (b - a >= seg.diag_lo && b - a <= seg.diag_hi)
              ++got[static_cast<size_t>(a * kr + b)];
          }
        }
      }
    }
    EXPECT_EQ(got, want);
    checked += want_pairs;
  }
  EXPECT_GT(checked, 10000);
}

// ---- The fp64 interpreter ------------------------------------------------------------------

struct Tensors {
  AttentionDims dims;
  int64_t tokens = 0;
  std::vector<float> q, k, v, dout;
  const float* Q(int64_t t, int h) const { return &q[(t * dims.heads_q + h) * dims.head_dim]; }
  const float* K(int64_t t, int h) const { return &k[(t * dims.heads_kv + h) * dims.head_dim]; }
  const float* V(int64_t t, int h) const { return &v[(t * dims.heads_kv + h) * dims.head_dim]; }
  const float* DO(int64_t t, int h) const { return &dout[(t * dims.heads_q + h) * dims.head_dim]; }
};

double Dot(const float* a, const float* b, int d) {
  double s = 0;
  for (int i = 0; i < d; ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

// Forward of the pieces of one (query buffer, key buffer) pair with cuDNN's semantics, each
// piece's (O, Stats = max + log(sum)) merged into out / lse ([T, Hq, D] / [Hq, T], global).
void InterpretForward(const Tensors& x, const std::vector<TokenRun>& q_runs,
                      const std::vector<TokenRun>& k_runs,
                      const std::vector<AttentionPiece>& pieces, std::vector<double>& out,
                      std::vector<double>& lse) {
  const std::vector<int64_t> gq = GlobalOfLocal(q_runs), gk = GlobalOfLocal(k_runs);
  const int d = x.dims.head_dim;
  for (const AttentionPiece& p : pieces) {
    for (int h = 0; h < x.dims.heads_q; ++h) {
      const int hk = x.dims.KvHead(h);
      for (int64_t i = 0; i < p.q_len; ++i) {
        const int64_t tq = gq[static_cast<size_t>(p.q_begin + i)];
        std::vector<double> s;
        std::vector<int64_t> keys;
        for (int64_t j = 0; j < p.k_len; ++j) {
          if (!p.mask.Admits(i, j, p.q_len, p.k_len)) continue;
          const int64_t tk = gk[static_cast<size_t>(p.k_begin + j)];
          s.push_back(x.dims.scale * Dot(x.Q(tq, h), x.K(tk, hk), d));
          keys.push_back(tk);
        }
        if (s.empty()) continue;
        const double m = *std::max_element(s.begin(), s.end());
        double z = 0;
        for (double e : s) z += std::exp(e - m);
        const double stats = m + std::log(z);
        std::vector<double> o(static_cast<size_t>(d), 0.0);
        for (size_t n = 0; n < s.size(); ++n) {
          const double w = std::exp(s[n] - stats);
          const float* vv = x.V(keys[n], hk);
          for (int c = 0; c < d; ++c) o[static_cast<size_t>(c)] += w * vv[c];
        }
        // Merge by LSE (attention/merge.h's rule).
        double& l = lse[static_cast<size_t>(h) * x.tokens + tq];
        const double merged =
            l == -kInf ? stats
                       : std::max(l, stats) + std::log(std::exp(l - std::max(l, stats)) +
                                                       std::exp(stats - std::max(l, stats)));
        const double a = l == -kInf ? 0.0 : std::exp(l - merged), b = std::exp(stats - merged);
        double* row = &out[static_cast<size_t>((tq * x.dims.heads_q + h) * d)];
        for (int c = 0; c < d; ++c) row[c] = a * row[c] + b * o[static_cast<size_t>(c)];
        l = merged;
      }
    }
  }
}

// Backward of the pieces with the final lse and delta = rowsum(dO * O), as cuDNN's backward
// per step with the merged O and LSE: gradients added into dq/dk/dv (global).
void InterpretBackward(const Tensors& x, const std::vector<TokenRun>& q_runs,
                       const std::vector<TokenRun>& k_runs,
                       const std::vector<AttentionPiece>& pieces, const std::vector<double>& lse,
                       const std::vector<double>& delta, ReferenceGradients& g) {
  const std::vector<int64_t> gq = GlobalOfLocal(q_runs), gk = GlobalOfLocal(k_runs);
  const int d = x.dims.head_dim;
  for (const AttentionPiece& p : pieces) {
    for (int h = 0; h < x.dims.heads_q; ++h) {
      const int hk = x.dims.KvHead(h);
      for (int64_t i = 0; i < p.q_len; ++i) {
        const int64_t tq = gq[static_cast<size_t>(p.q_begin + i)];
        const double l = lse[static_cast<size_t>(h) * x.tokens + tq];
        const double dl = delta[static_cast<size_t>(h) * x.tokens + tq];
        for (int64_t j = 0; j < p.k_len; ++j) {
          if (!p.mask.Admits(i, j, p.q_len, p.k_len)) continue;
          const int64_t tk = gk[static_cast<size_t>(p.k_begin + j)];
          const double pr = std::exp(x.dims.scale * Dot(x.Q(tq, h), x.K(tk, hk), d) - l);
          const double dp = Dot(x.DO(tq, h), x.V(tk, hk), d);
          const double ds = pr * (dp - dl) * x.dims.scale;
          for (int c = 0; c < d; ++c) {
            g.dv[static_cast<size_t>((tk * x.dims.heads_kv + hk) * d + c)] += pr * x.DO(tq, h)[c];
            g.dq[static_cast<size_t>((tq * x.dims.heads_q + h) * d + c)] += ds * x.K(tk, hk)[c];
            g.dk[static_cast<size_t>((tk * x.dims.heads_kv + hk) * d + c)] += ds * x.Q(tq, h)[c];
          }
        }
      }
    }
  }
}

double MaxDiff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isinf(a[i]) && a[i] == b[i]) continue;
    m = std::max(m, std::abs(a[i] - b[i]));
  }
  return m;
}

// The row's queries in one shuffled buffer, its keys split over several buffers (the steps
// of a rank): the pieces of all pairs, interpreted and merged, are the reference.
TEST(AttentionPiecesTest, InterpretedPiecesMatchTheFp64Reference) {
  for (uint64_t seed = 1; seed <= 12; ++seed) {
    std::mt19937_64 rng(100 + seed);
    const int64_t tokens = std::uniform_int_distribution<int64_t>(20, 150)(rng);
    const Layout layout =
        seed % 3 == 0 ? RandomSliceLayout(rng, tokens) : RandomDocumentLayout(rng, tokens, 90);
    Tensors x;
    x.tokens = layout.num_tokens();
    x.dims.heads_q = 4;
    x.dims.heads_kv = 2;
    x.dims.head_dim = 8;
    x.dims.scale = 0.35f;
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (auto* t : {&x.q, &x.dout}) {
      t->resize(static_cast<size_t>(x.tokens * x.dims.heads_q * x.dims.head_dim));
    }
    for (auto* t : {&x.k, &x.v}) {
      t->resize(static_cast<size_t>(x.tokens * x.dims.heads_kv * x.dims.head_dim));
    }
    for (auto* t : {&x.q, &x.k, &x.v, &x.dout}) {
      for (float& f : *t) f = normal(rng);
    }
    const ReferenceInputs in{x.dims, DType::kF32, x.q.data(), x.k.data(), x.v.data()};
    const ReferenceForwardResult ref = ReferenceForward(layout, in);
    const ReferenceGradients ref_g = ReferenceBackward(layout, in, x.dout.data());

    // Queries: the whole row in shuffled runs; keys: the runs of another tiling dealt to 3
    // buffers.
    const std::vector<TokenRun> q_runs = ::hsap::testing::RandomRuns(rng, x.tokens, 5, 1.0);
    std::vector<std::vector<TokenRun>> k_bufs(3);
    for (const TokenRun& r : ::hsap::testing::RandomRuns(rng, x.tokens, 7, 1.0)) {
      std::vector<TokenRun>& b = k_bufs[std::uniform_int_distribution<size_t>(0, 2)(rng)];
      b.push_back({r.global_begin, RunRows(b), r.length});
    }
    std::vector<double> out(ref.out.size(), 0.0), lse(ref.lse.size(), -kInf);
    std::vector<std::vector<AttentionPiece>> pieces;
    for (const std::vector<TokenRun>& k_runs : k_bufs) {
      pieces.push_back(Pieces(layout, q_runs, k_runs, seed % 2 == 0 ? 16 : 64));
      InterpretForward(x, q_runs, k_runs, pieces.back(), out, lse);
    }
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    EXPECT_LE(MaxDiff(out, ref.out), 1e-9);
    EXPECT_LE(MaxDiff(lse, ref.lse), 1e-9);

    std::vector<double> delta(lse.size(), 0.0);
    for (int64_t t = 0; t < x.tokens; ++t) {
      for (int h = 0; h < x.dims.heads_q; ++h) {
        const double* o = &out[static_cast<size_t>((t * x.dims.heads_q + h) * x.dims.head_dim)];
        delta[static_cast<size_t>(h) * x.tokens + t] = [&] {
          double s = 0;
          for (int c = 0; c < x.dims.head_dim; ++c) s += o[c] * x.DO(t, h)[c];
          return s;
        }();
      }
    }
    ReferenceGradients g{std::vector<double>(ref_g.dq.size(), 0.0),
                         std::vector<double>(ref_g.dk.size(), 0.0),
                         std::vector<double>(ref_g.dv.size(), 0.0)};
    for (size_t b = 0; b < k_bufs.size(); ++b) {
      InterpretBackward(x, q_runs, k_bufs[b], pieces[b], lse, delta, g);
    }
    EXPECT_LE(MaxDiff(g.dq, ref_g.dq), 1e-9);
    EXPECT_LE(MaxDiff(g.dk, ref_g.dk), 1e-9);
    EXPECT_LE(MaxDiff(g.dv, ref_g.dv), 1e-9);
  }
}

// ---- Calls -----------------------------------------------------------------------------------

TEST(GroupIntoCallsTest, EntriesShareAMaskAndHaveIncreasingDisjointRows) {
  for (uint64_t seed = 1; seed <= 30; ++seed) {
    std::mt19937_64 rng(500 + seed);
    const int64_t tokens = std::uniform_int_distribution<int64_t>(1, 300)(rng);
    const Layout layout = RandomDocumentLayout(rng, tokens, 100);
    const std::vector<TokenRun> q = RandomBuffer(rng, tokens, 0.8);
    const std::vector<TokenRun> k = RandomBuffer(rng, tokens, 0.8);
    const std::vector<AttentionPiece> pieces = Pieces(layout, q, k, 64);
    std::vector<size_t> all(pieces.size());
    for (size_t i = 0; i < all.size(); ++i) all[i] = i;
    const std::vector<CudnnCall> calls = GroupIntoCalls(pieces, all);
    std::vector<int> placed(pieces.size(), 0);
    for (const CudnnCall& c : calls) {
      ASSERT_FALSE(c.entries.empty());
      int64_t pairs = 0, max_q = 0, max_k = 0;
      for (size_t e = 0; e < c.entries.size(); ++e) {
        const AttentionPiece& p = pieces[c.entries[e]];
        ++placed[c.entries[e]];
        EXPECT_EQ(p.mask, c.mask);
        pairs += p.pairs;
        max_q = std::max(max_q, p.q_len);
        max_k = std::max(max_k, p.k_len);
        if (e > 0) {
          const AttentionPiece& prev = pieces[c.entries[e - 1]];
          EXPECT_LE(prev.q_end(), p.q_begin);
          EXPECT_LE(prev.k_end(), p.k_begin);
        }
      }
      EXPECT_EQ(c.pairs, pairs);
      EXPECT_EQ(c.max_q_len, max_q);
      EXPECT_EQ(c.max_k_len, max_k);
    }
    EXPECT_EQ(std::count(placed.begin(), placed.end(), 1), static_cast<long>(pieces.size()));
  }
}

TEST(GroupIntoCallsTest, DocumentsOfARowShareOneCall) {
  const Layout layout = *Layout::FromDocuments({0, 70, 100, 230});
  const std::vector<AttentionPiece> pieces = Pieces(layout, WholeRow(230), WholeRow(230), 64);
  ASSERT_EQ(pieces.size(), 3u);
  const std::vector<CudnnCall> calls = GroupIntoCalls(pieces, {0, 1, 2, 7});
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(calls[0].entries, (std::vector<size_t>{0, 1, 2}));
  EXPECT_EQ(calls[0].max_q_len, 130);
}

}  // namespace
}  // namespace hsap::cuda
