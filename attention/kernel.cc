#include "attention/kernel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "attention/layout.h"
#include "attention/merge.h"
#include "attention/parallel.h"

namespace hsap {
namespace {

// ---------------------------------------------------------------------------------------
// 8-lane fp32 vectors (GCC/Clang vector extensions): one AVX register with -march=native on
// x86, two SSE/NEON registers elsewhere. a * b + c contracts to FMA where available.
typedef float V8 __attribute__((vector_size(32)));
typedef int32_t V8i __attribute__((vector_size(32)));

constexpr int kTileQ = static_cast<int>(kKernelBlockQ);
constexpr int kTileK = static_cast<int>(kKernelBlockK);
static_assert(kTileK % 16 == 0 && kTileK <= 64, "column blocking assumes 16 | kTileK");
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline V8 Load(const float* p) {
  V8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void Store(float* p, V8 v) { std::memcpy(p, &v, sizeof(v)); }
inline V8 Splat(float x) { return V8{} + x; }
inline float HorizontalMax(V8 v) {
  float m = v[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, v[i]);
  return m;
}
inline float HorizontalSum(V8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// exp(x) to about 1 ulp for x <= 88, exactly 0 for x < -87 (so exp(-inf) = 0: masked
// scores vanish). exp(x) = 2^n e^r, n = round(x / ln 2), |r| <= ln2 / 2, e^r by its Taylor
// polynomial of degree 7 (truncation 5e-9 relative).
inline V8 VExp(V8 x) {
  const V8 xc = x < Splat(-88.0f) ? Splat(-88.0f) : (x > Splat(88.0f) ? Splat(88.0f) : x);
  const V8 magic = Splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const V8 n = (xc * Splat(1.44269504088896341f) + magic) - magic;
  V8 r = xc - n * Splat(0.693359375f);
  r = r - n * Splat(-2.12194440e-4f);
  V8 p = Splat(1.0f / 5040);
  p = p * r + Splat(1.0f / 720);
  p = p * r + Splat(1.0f / 120);
  p = p * r + Splat(1.0f / 24);
  p = p * r + Splat(1.0f / 6);
  p = p * r + Splat(0.5f);
  p = p * r + Splat(1.0f);
  p = p * r + Splat(1.0f);
  const V8i bits = (__builtin_convertvector(n, V8i) + 127) << 23;
  const V8 result = p * (V8)bits;  // a vector cast reinterprets the bits
  return x < Splat(-87.0f) ? Splat(0.0f) : (x != x ? x : result);
}

// ---------------------------------------------------------------------------------------
// Micro-kernels on fp32 tiles.

// The register blocks below are spelled out (named accumulators instead of small arrays
// with inner loops): at -O2 compilers otherwise keep the accumulators in memory.

// S[i][j] = sum_d A[i][d] * Bt[d][j] for i < rows, j < cols; cols a multiple of 8, <= 64;
// A row-major with leading dimension lda, Bt [dim][kTileK], S [rows][kTileK].
void GemmABt(const float* a, int lda, int rows, const float* bt, int dim, int cols, float* s) {
  int i = 0;
  for (; i + 4 <= rows; i += 4) {
    const float* a0 = a + i * lda;
    const float* a1 = a0 + lda;
    const float* a2 = a1 + lda;
    const float* a3 = a2 + lda;
    int j = 0;
    for (; j + 16 <= cols; j += 16) {
      V8 c00 = {}, c01 = {}, c10 = {}, c11 = {}, c20 = {}, c21 = {}, c30 = {}, c31 = {};
      for (int d = 0; d < dim; ++d) {
        const V8 b0 = Load(bt + d * kTileK + j), b1 = Load(bt + d * kTileK + j + 8);
        V8 x = Splat(a0[d]);
        c00 += x * b0;
        c01 += x * b1;
        x = Splat(a1[d]);
        c10 += x * b0;
        c11 += x * b1;
        x = Splat(a2[d]);
        c20 += x * b0;
        c21 += x * b1;
        x = Splat(a3[d]);
        c30 += x * b0;
        c31 += x * b1;
      }
      float* out = s + i * kTileK + j;
      Store(out, c00);
      Store(out + 8, c01);
      Store(out + kTileK, c10);
      Store(out + kTileK + 8, c11);
      Store(out + 2 * kTileK, c20);
      Store(out + 2 * kTileK + 8, c21);
      Store(out + 3 * kTileK, c30);
      Store(out + 3 * kTileK + 8, c31);
    }
    if (j < cols) {
      V8 c0 = {}, c1 = {}, c2 = {}, c3 = {};
      for (int d = 0; d < dim; ++d) {
        const V8 b0 = Load(bt + d * kTileK + j);
        c0 += Splat(a0[d]) * b0;
        c1 += Splat(a1[d]) * b0;
        c2 += Splat(a2[d]) * b0;
        c3 += Splat(a3[d]) * b0;
      }
      float* out = s + i * kTileK + j;
      Store(out, c0);
      Store(out + kTileK, c1);
      Store(out + 2 * kTileK, c2);
      Store(out + 3 * kTileK, c3);
    }
  }
  for (; i < rows; ++i) {
    for (int j = 0; j < cols; j += 8) {
      V8 acc = {};
      for (int d = 0; d < dim; ++d) acc += Splat(a[i * lda + d]) * Load(bt + d * kTileK + j);
      Store(s + i * kTileK + j, acc);
    }
  }
}

// Out[i][:dim] += sum_{j < inner} P[i][j] * X[j][:dim]; P with leading dimension ldp, X and
// Out with leading dimension dim (a multiple of 8).
void GemmAccumulate(const float* p, int ldp, int rows, int inner, const float* x, int dim,
                    float* out) {
  int i = 0;
  for (; i + 4 <= rows; i += 4) {
    const float* p0 = p + i * ldp;
    const float* p1 = p0 + ldp;
    const float* p2 = p1 + ldp;
    const float* p3 = p2 + ldp;
    float* o0 = out + i * dim;
    float* o1 = o0 + dim;
    float* o2 = o1 + dim;
    float* o3 = o2 + dim;
    int d = 0;
    for (; d + 16 <= dim; d += 16) {
      V8 c00 = Load(o0 + d), c01 = Load(o0 + d + 8), c10 = Load(o1 + d), c11 = Load(o1 + d + 8),
         c20 = Load(o2 + d), c21 = Load(o2 + d + 8), c30 = Load(o3 + d), c31 = Load(o3 + d + 8);
      for (int j = 0; j < inner; ++j) {
        const V8 x0 = Load(x + j * dim + d), x1 = Load(x + j * dim + d + 8);
        V8 w = Splat(p0[j]);
        c00 += w * x0;
        c01 += w * x1;
        w = Splat(p1[j]);
        c10 += w * x0;
        c11 += w * x1;
        w = Splat(p2[j]);
        c20 += w * x0;
        c21 += w * x1;
        w = Splat(p3[j]);
        c30 += w * x0;
        c31 += w * x1;
      }
      Store(o0 + d, c00);
      Store(o0 + d + 8, c01);
      Store(o1 + d, c10);
      Store(o1 + d + 8, c11);
      Store(o2 + d, c20);
      Store(o2 + d + 8, c21);
      Store(o3 + d, c30);
      Store(o3 + d + 8, c31);
    }
    if (d < dim) {
      V8 c0 = Load(o0 + d), c1 = Load(o1 + d), c2 = Load(o2 + d), c3 = Load(o3 + d);
      for (int j = 0; j < inner; ++j) {
        const V8 x0 = Load(x + j * dim + d);
        c0 += Splat(p0[j]) * x0;
        c1 += Splat(p1[j]) * x0;
        c2 += Splat(p2[j]) * x0;
        c3 += Splat(p3[j]) * x0;
      }
      Store(o0 + d, c0);
      Store(o1 + d, c1);
      Store(o2 + d, c2);
      Store(o3 + d, c3);
    }
  }
  for (; i < rows; ++i) {
    for (int d = 0; d < dim; d += 8) {
      V8 acc = Load(out + i * dim + d);
      for (int j = 0; j < inner; ++j) acc += Splat(p[i * ldp + j]) * Load(x + j * dim + d);
      Store(out + i * dim + d, acc);
    }
  }
}

// dst[c][r] = src[r][c] for r < rows, c < cols (both with leading dimension kTileK).
void TransposeTile(const float* src, int rows, int cols, float* dst) {
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) dst[c * kTileK + r] = src[r * kTileK + c];
}

// ---------------------------------------------------------------------------------------
// Conversion of storage tiles to fp32.

// dst[r][:dim] = rows [row0, row0 + rows) of head `head` of a [*, heads, dim] tensor.
template <typename T>
void LoadRows(const void* base, int heads, int head, int dim, int64_t row0, int rows, float* dst) {
  const T* src = static_cast<const T*>(base);
  for (int r = 0; r < rows; ++r) {
    const T* row = src + ((row0 + r) * heads + head) * static_cast<int64_t>(dim);
    for (int d = 0; d < dim; ++d) dst[r * dim + d] = ToFloat(row[d]);
  }
}

// dst[d][r] (leading dimension kTileK) = the same rows transposed; columns [rows, padded)
// are zero so that products with them stay finite.
template <typename T>
void LoadRowsTransposed(const void* base, int heads, int head, int dim, int64_t row0, int rows,
                        int padded, float* dst) {
  const T* src = static_cast<const T*>(base);
  for (int r = 0; r < rows; ++r) {
    const T* row = src + ((row0 + r) * heads + head) * static_cast<int64_t>(dim);
    for (int d = 0; d < dim; ++d) dst[d * kTileK + r] = ToFloat(row[d]);
  }
  for (int d = 0; d < dim; ++d)
    for (int r = rows; r < padded; ++r) dst[d * kTileK + r] = 0.0f;
}

int RoundUp8(int x) { return (x + 7) & ~7; }

// Visible columns [begin, end) of tile row i: query buffer row q, tile keys start at k0
// and number `cols`, band lo <= k - q <= hi (buffer rows).
struct ColumnRange {
  int begin, end;
};
inline ColumnRange VisibleColumns(const KeySegment& seg, int64_t q, int64_t k0, int cols) {
  int64_t b = 0, e = cols;
  if (seg.diag_lo > -kNoDiagLimit) b = std::max<int64_t>(b, seg.diag_lo + q - k0);
  if (seg.diag_hi < kNoDiagLimit) e = std::min<int64_t>(e, seg.diag_hi + q - k0 + 1);
  return {static_cast<int>(b), static_cast<int>(std::max(b, e))};
}

enum class TileVisibility { kEmpty, kFull, kPartial };

// Rows [q0, q1) against keys [k0, k1) under the segment's band.
TileVisibility Classify(const KeySegment& seg, int64_t q0, int64_t q1, int64_t k0, int64_t k1) {
  const int64_t min_rel = k0 - (q1 - 1), max_rel = (k1 - 1) - q0;
  const bool lo_all = seg.diag_lo <= -kNoDiagLimit || min_rel >= seg.diag_lo;
  const bool hi_all = seg.diag_hi >= kNoDiagLimit || max_rel <= seg.diag_hi;
  if ((seg.diag_lo > -kNoDiagLimit && max_rel < seg.diag_lo) ||
      (seg.diag_hi < kNoDiagLimit && min_rel > seg.diag_hi)) {
    return TileVisibility::kEmpty;
  }
  return lo_all && hi_all ? TileVisibility::kFull : TileVisibility::kPartial;
}

// Sets S[i][j] = -inf outside the visible columns of each row (and for j in [cols, padded)).
void MaskScores(const KeySegment& seg, TileVisibility vis, int64_t q0, int rows, int64_t k0,
                int cols, int padded, float* s) {
  for (int i = 0; i < rows; ++i) {
    float* row = s + i * kTileK;
    ColumnRange range{0, cols};
    if (vis == TileVisibility::kPartial) range = VisibleColumns(seg, q0 + i, k0, cols);
    for (int j = 0; j < std::min(range.begin, padded); ++j) row[j] = kNegInf;
    for (int j = std::max(range.end, range.begin); j < padded; ++j) row[j] = kNegInf;
  }
}

// Scratch memory of one thread, reused across tasks.
struct Scratch {
  std::vector<float> buffer;
  float* Get(size_t floats) {
    if (buffer.size() < floats) buffer.resize(floats);
    return buffer.data();
  }
};
Scratch& ThreadScratch() {
  thread_local Scratch scratch;
  return scratch;
}

absl::Status CheckWork(const WorkList& work, int64_t q_rows, int64_t k_rows) {
  const int64_t num_segments = static_cast<int64_t>(work.segments.size());
  for (size_t b = 0; b < work.blocks.size(); ++b) {
    const QueryBlock& blk = work.blocks[b];
    if (blk.q_begin < 0 || blk.q_begin > blk.q_end || blk.q_end > q_rows || blk.seg_begin < 0 ||
        blk.seg_begin > blk.seg_end || blk.seg_end > num_segments) {
      return absl::InvalidArgumentError(
          absl::StrCat("work.blocks[", b, "] = {q [", blk.q_begin, ", ", blk.q_end, "), segments [",
                       blk.seg_begin, ", ", blk.seg_end, ")} does not fit q_rows = ", q_rows,
                       " and ", num_segments, " segments; build the work list for these buffers"));
    }
  }
  for (size_t s = 0; s < work.segments.size(); ++s) {
    const KeySegment& seg = work.segments[s];
    if (seg.k_begin < 0 || seg.k_begin > seg.k_end || seg.k_end > k_rows ||
        seg.diag_lo > seg.diag_hi) {
      return absl::InvalidArgumentError(absl::StrCat(
          "work.segments[", s, "] = {k [", seg.k_begin, ", ", seg.k_end, "), ",
          DescribeDiagBand(seg.diag_lo, seg.diag_hi), "} does not fit k_rows = ", k_rows));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckBuffers(std::initializer_list<std::pair<const void*, const char*>> buffers) {
  for (const auto& [ptr, name] : buffers) {
    if (ptr == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(name, " is null"));
    }
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------
// Forward.

template <typename T>
void ForwardTask(const ForwardArgs& args, const WorkList& work, int head, int64_t block) {
  const int dim = args.dims.head_dim;
  const int hq = args.dims.heads_q, hkv = args.dims.heads_kv;
  const int kv_head = args.dims.KvHead(head);
  const float scale = args.dims.scale;
  const QueryBlock& blk = work.blocks[block];
  float* mem = ThreadScratch().Get(4 * kTileQ * dim + kTileQ * kTileK + 2 * kTileQ);
  float* q = mem;                  // [kTileQ][dim]
  float* kt = q + kTileQ * dim;    // [dim][kTileK]
  float* v = kt + kTileK * dim;    // [kTileK][dim]
  float* o = v + kTileK * dim;     // [kTileQ][dim]
  float* s = o + kTileQ * dim;     // [kTileQ][kTileK]
  float* m = s + kTileQ * kTileK;  // running max per row
  float* l = m + kTileQ;           // running sum per row

  for (int64_t q0 = blk.q_begin; q0 < blk.q_end; q0 += kTileQ) {
    const int rows = static_cast<int>(std::min<int64_t>(kTileQ, blk.q_end - q0));
    LoadRows<T>(args.q, hq, head, dim, q0, rows, q);
    std::fill(o, o + rows * dim, 0.0f);
    std::fill(m, m + rows, kNegInf);
    std::fill(l, l + rows, 0.0f);
    for (int64_t si = blk.seg_begin; si < blk.seg_end; ++si) {
      const KeySegment& seg = work.segments[si];
      for (int64_t k0 = seg.k_begin; k0 < seg.k_end; k0 += kTileK) {
        const int cols = static_cast<int>(std::min<int64_t>(kTileK, seg.k_end - k0));
        const TileVisibility vis = Classify(seg, q0, q0 + rows, k0, k0 + cols);
        if (vis == TileVisibility::kEmpty) continue;
        const int padded = RoundUp8(cols);
        LoadRowsTransposed<T>(args.k, hkv, kv_head, dim, k0, cols, padded, kt);
        LoadRows<T>(args.v, hkv, kv_head, dim, k0, cols, v);
        GemmABt(q, dim, rows, kt, dim, padded, s);
        MaskScores(seg, vis, q0, rows, k0, cols, padded, s);
        // Online softmax: rescale each row's running sums to its new maximum.
        for (int i = 0; i < rows; ++i) {
          float* row = s + i * kTileK;
          V8 mx = Splat(kNegInf);
          for (int j = 0; j < padded; j += 8) {
            const V8 x = Load(row + j) * scale;
            Store(row + j, x);
            mx = mx > x ? mx : x;
          }
          const float m_new = std::max(m[i], HorizontalMax(mx));
          if (m_new == kNegInf) {  // this row sees no key of the tile (nor before)
            std::fill(row, row + padded, 0.0f);
            continue;
          }
          const float alpha = std::exp(m[i] - m_new);  // 0 when m[i] = -inf
          V8 sum = {};
          for (int j = 0; j < padded; j += 8) {
            const V8 p = VExp(Load(row + j) - m_new);
            Store(row + j, p);
            sum += p;
          }
          l[i] = alpha * l[i] + HorizontalSum(sum);
          m[i] = m_new;
          if (alpha != 1.0f) {
            for (int d = 0; d < dim; ++d) o[i * dim + d] *= alpha;
          }
        }
        GemmAccumulate(s, kTileK, rows, cols, v, dim, o);
      }
    }
    for (int i = 0; i < rows; ++i) {
      if (l[i] == 0.0f) continue;  // no visible key: the partial is (0, -inf)
      const float inv = 1.0f / l[i];
      for (int d = 0; d < dim; ++d) o[i * dim + d] *= inv;
      const int64_t r = q0 + i;
      MergePartialRow(args.out + (r * hq + head) * static_cast<int64_t>(dim),
                      args.lse + head * args.q_rows + r, o + i * dim, m[i] + std::log(l[i]), dim);
    }
  }
}

// ---------------------------------------------------------------------------------------
// Backward. One tile: rows [q0, q0 + rows) of head `head`, keys [k0, k0 + cols) whose
// fp32 copies are given; computes P (in p) and dS (in ds), both [rows][kTileK] with zeros
// at masked entries.
struct BackwardRows {
  const float* q;      // [rows][dim]
  const float* dout;   // [rows][dim]
  const float* lse;    // [rows]
  const float* delta;  // [rows]
};

void TileProbabilitiesAndGradients(const BackwardRows& in, int rows, int dim, float scale,
                                   const KeySegment& seg, TileVisibility vis, int64_t q0,
                                   int64_t k0, int cols, int col_offset, const float* kt,
                                   const float* vt, float* p, float* ds) {
  // kt / vt hold keys from k0 - col_offset on; columns outside [col_offset, col_offset +
  // cols) are masked.
  const int padded = RoundUp8(col_offset + cols);
  GemmABt(in.q, dim, rows, kt, dim, padded, p);
  GemmABt(in.dout, dim, rows, vt, dim, padded, ds);
  for (int i = 0; i < rows; ++i) {
    float* prow = p + i * kTileK;
    float* drow = ds + i * kTileK;
    ColumnRange range{0, cols};
    if (vis == TileVisibility::kPartial) range = VisibleColumns(seg, q0 + i, k0, cols);
    const int begin = col_offset + range.begin, end = col_offset + range.end;
    const float lse = in.lse[i];
    if (begin >= end || lse == kNegInf) {
      std::fill(prow, prow + padded, 0.0f);
      std::fill(drow, drow + padded, 0.0f);
      continue;
    }
    for (int j = 0; j < begin; ++j) prow[j] = kNegInf;
    for (int j = end; j < padded; ++j) prow[j] = kNegInf;
    const V8 delta = Splat(in.delta[i]);
    for (int j = 0; j < padded; j += 8) {
      const V8 pj = VExp(Load(prow + j) * scale - lse);
      Store(prow + j, pj);
      Store(drow + j, pj * (Load(drow + j) - delta));
    }
  }
}

// Key-side pass: dk, dv of key rows [c0, c0 + kTileK) of kv head `kv_head`.
template <typename T>
void BackwardKeyTask(const BackwardArgs& args, const WorkList& work,
                     const std::vector<int>& heads_of_group, int kv_head, int64_t c0,
                     const std::vector<std::pair<int64_t, int64_t>>& block_segments) {
  const int dim = args.dims.head_dim;
  const int hq = args.dims.heads_q, hkv = args.dims.heads_kv;
  const float scale = args.dims.scale;
  const int chunk = static_cast<int>(std::min<int64_t>(kTileK, args.k_rows - c0));
  float* mem = ThreadScratch().Get(6 * kTileQ * dim + 4 * kTileQ * kTileK + 2 * kTileQ);
  float* kt = mem;                   // [dim][kTileK]
  float* vt = kt + kTileK * dim;     // [dim][kTileK]
  float* dk = vt + kTileK * dim;     // [kTileK][dim]
  float* dv = dk + kTileK * dim;     // [kTileK][dim]
  float* q = dv + kTileK * dim;      // [kTileQ][dim]
  float* dout = q + kTileQ * dim;    // [kTileQ][dim]
  float* p = dout + kTileQ * dim;    // [kTileQ][kTileK]
  float* ds = p + kTileQ * kTileK;   // [kTileQ][kTileK]
  float* pt = ds + kTileQ * kTileK;  // [kTileK][kTileQ]
  float* dst = pt + kTileQ * kTileK;
  float* lse = dst + kTileQ * kTileK;
  float* delta = lse + kTileQ;
  const int padded_chunk = RoundUp8(chunk);
  LoadRowsTransposed<T>(args.k, hkv, kv_head, dim, c0, chunk, padded_chunk, kt);
  LoadRowsTransposed<T>(args.v, hkv, kv_head, dim, c0, chunk, padded_chunk, vt);
  std::fill(dk, dk + kTileK * dim, 0.0f);
  std::fill(dv, dv + kTileK * dim, 0.0f);
  for (const auto& [block, si] : block_segments) {
    const QueryBlock& blk = work.blocks[block];
    const KeySegment& seg = work.segments[si];
    const int64_t k0 = std::max(seg.k_begin, c0);
    const int64_t k1 = std::min(seg.k_end, c0 + chunk);
    const int cols = static_cast<int>(k1 - k0), offset = static_cast<int>(k0 - c0);
    for (int head : heads_of_group) {
      for (int64_t q0 = blk.q_begin; q0 < blk.q_end; q0 += kTileQ) {
        const int rows = static_cast<int>(std::min<int64_t>(kTileQ, blk.q_end - q0));
        const TileVisibility vis = Classify(seg, q0, q0 + rows, k0, k1);
        if (vis == TileVisibility::kEmpty) continue;
        LoadRows<T>(args.q, hq, head, dim, q0, rows, q);
        LoadRows<T>(args.dout, hq, head, dim, q0, rows, dout);
        for (int i = 0; i < rows; ++i) {
          lse[i] = args.lse[head * args.q_rows + q0 + i];
          delta[i] = args.delta[head * args.q_rows + q0 + i];
        }
        TileProbabilitiesAndGradients({q, dout, lse, delta}, rows, dim, scale, seg, vis, q0, k0,
                                      cols, offset, kt, vt, p, ds);
        // dv[j] += sum_i P[i][j] dout[i]; dk[j] += sum_i dS[i][j] q[i] (scaled at the end).
        TransposeTile(p, rows, offset + cols, pt);
        TransposeTile(ds, rows, offset + cols, dst);
        GemmAccumulate(pt + offset * kTileK, kTileK, cols, rows, dout, dim, dv + offset * dim);
        GemmAccumulate(dst + offset * kTileK, kTileK, cols, rows, q, dim, dk + offset * dim);
      }
    }
  }
  for (int j = 0; j < chunk; ++j) {
    float* dk_out = args.dk + ((c0 + j) * hkv + kv_head) * static_cast<int64_t>(dim);
    float* dv_out = args.dv + ((c0 + j) * hkv + kv_head) * static_cast<int64_t>(dim);
    for (int d = 0; d < dim; ++d) {
      dk_out[d] += scale * dk[j * dim + d];
      dv_out[d] += dv[j * dim + d];
    }
  }
}

// Query-side pass: dq of one block of query head `head`.
template <typename T>
void BackwardQueryTask(const BackwardArgs& args, const WorkList& work, int head, int64_t block) {
  const int dim = args.dims.head_dim;
  const int hq = args.dims.heads_q, hkv = args.dims.heads_kv;
  const int kv_head = args.dims.KvHead(head);
  const float scale = args.dims.scale;
  const QueryBlock& blk = work.blocks[block];
  float* mem = ThreadScratch().Get(6 * kTileQ * dim + 2 * kTileQ * kTileK + 2 * kTileQ);
  float* kt = mem;                  // [dim][kTileK]
  float* vt = kt + kTileK * dim;    // [dim][kTileK]
  float* k = vt + kTileK * dim;     // [kTileK][dim]
  float* q = k + kTileK * dim;      // [kTileQ][dim]
  float* dout = q + kTileQ * dim;   // [kTileQ][dim]
  float* dq = dout + kTileQ * dim;  // [kTileQ][dim]
  float* p = dq + kTileQ * dim;     // [kTileQ][kTileK]
  float* ds = p + kTileQ * kTileK;  // [kTileQ][kTileK]
  float* lse = ds + kTileQ * kTileK;
  float* delta = lse + kTileQ;
  for (int64_t q0 = blk.q_begin; q0 < blk.q_end; q0 += kTileQ) {
    const int rows = static_cast<int>(std::min<int64_t>(kTileQ, blk.q_end - q0));
    LoadRows<T>(args.q, hq, head, dim, q0, rows, q);
    LoadRows<T>(args.dout, hq, head, dim, q0, rows, dout);
    for (int i = 0; i < rows; ++i) {
      lse[i] = args.lse[head * args.q_rows + q0 + i];
      delta[i] = args.delta[head * args.q_rows + q0 + i];
    }
    std::fill(dq, dq + rows * dim, 0.0f);
    for (int64_t si = blk.seg_begin; si < blk.seg_end; ++si) {
      const KeySegment& seg = work.segments[si];
      for (int64_t k0 = seg.k_begin; k0 < seg.k_end; k0 += kTileK) {
        const int cols = static_cast<int>(std::min<int64_t>(kTileK, seg.k_end - k0));
        const TileVisibility vis = Classify(seg, q0, q0 + rows, k0, k0 + cols);
        if (vis == TileVisibility::kEmpty) continue;
        const int padded = RoundUp8(cols);
        LoadRowsTransposed<T>(args.k, hkv, kv_head, dim, k0, cols, padded, kt);
        LoadRowsTransposed<T>(args.v, hkv, kv_head, dim, k0, cols, padded, vt);
        LoadRows<T>(args.k, hkv, kv_head, dim, k0, cols, k);
        TileProbabilitiesAndGradients({q, dout, lse, delta}, rows, dim, scale, seg, vis, q0, k0,
                                      cols, 0, kt, vt, p, ds);
        GemmAccumulate(ds, kTileK, rows, cols, k, dim, dq);
      }
    }
    for (int i = 0; i < rows; ++i) {
      float* dq_out = args.dq + ((q0 + i) * hq + head) * static_cast<int64_t>(dim);
      for (int d = 0; d < dim; ++d) dq_out[d] += scale * dq[i * dim + d];
    }
  }
}

class HandWritten final : public KernelSet {
 public:
  absl::Status Forward(const ForwardArgs& args, const WorkList& work,
                       int num_threads) const override {
    return KernelForward(args, work, num_threads);
  }
  absl::Status Backward(const BackwardArgs& args, const WorkList& work,
                        int num_threads) const override {
    return KernelBackward(args, work, num_threads);
  }
  std::string_view name() const override { return "host-handwritten"; }
};

}  // namespace

absl::Status ValidateDims(const AttentionDims& dims) {
  if (dims.heads_q <= 0 || dims.heads_kv <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "heads_q = ", dims.heads_q, ", heads_kv = ", dims.heads_kv, "; both must be positive"));
  }
  if (dims.kv_head_of_q.empty()) {
    if (dims.heads_q % dims.heads_kv != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "heads_q = ", dims.heads_q, " is not a multiple of heads_kv = ", dims.heads_kv,
          "; pass kv_head_of_q for an irregular grouping"));
    }
  } else {
    if (static_cast<int>(dims.kv_head_of_q.size()) != dims.heads_q) {
      return absl::InvalidArgumentError(
          absl::StrCat("kv_head_of_q has ", dims.kv_head_of_q.size(),
                       " entries; it needs heads_q = ", dims.heads_q));
    }
    for (size_t h = 0; h < dims.kv_head_of_q.size(); ++h) {
      if (dims.kv_head_of_q[h] < 0 || dims.kv_head_of_q[h] >= dims.heads_kv) {
        return absl::InvalidArgumentError(
            absl::StrCat("kv_head_of_q[", h, "] = ", dims.kv_head_of_q[h],
                         " is not a kv head in [0, ", dims.heads_kv, ")"));
      }
    }
  }
  if (dims.head_dim < 32 || dims.head_dim > 256 || dims.head_dim % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_dim = ", dims.head_dim, "; it must be a multiple of 8 in [32, 256]"));
  }
  if (!std::isfinite(dims.scale) || dims.scale <= 0.0f) {
    return absl::InvalidArgumentError(absl::StrCat(
        "scale = ", dims.scale, "; it must be finite and positive (usually 1/sqrt(head_dim))"));
  }
  return absl::OkStatus();
}

void InitPartial(float* out, float* lse, int64_t rows, int heads, int head_dim) {
  std::fill(out, out + rows * heads * static_cast<int64_t>(head_dim), 0.0f);
  std::fill(lse, lse + rows * heads, kNegInf);
}

absl::Status KernelForward(const ForwardArgs& args, const WorkList& work, int num_threads) {
  if (absl::Status s = ValidateDims(args.dims); !s.ok()) return s;
  if (args.q_rows < 0 || args.k_rows < 0) {
    return absl::InvalidArgumentError("q_rows and k_rows must be non-negative");
  }
  if (absl::Status s = CheckWork(work, args.q_rows, args.k_rows); !s.ok()) return s;
  if (work.blocks.empty()) return absl::OkStatus();
  if (absl::Status s = CheckBuffers(
          {{args.q, "q"}, {args.k, "k"}, {args.v, "v"}, {args.out, "out"}, {args.lse, "lse"}});
      !s.ok()) {
    return s;
  }
  const int64_t blocks = static_cast<int64_t>(work.blocks.size());
  DispatchDType(args.dtype, [&]<typename T>() {
    ParallelFor(blocks * args.dims.heads_q, num_threads, [&](int64_t task) {
      ForwardTask<T>(args, work, static_cast<int>(task % args.dims.heads_q),
                     task / args.dims.heads_q);
    });
  });
  return absl::OkStatus();
}

absl::Status KernelBackward(const BackwardArgs& args, const WorkList& work, int num_threads) {
  if (absl::Status s = ValidateDims(args.dims); !s.ok()) return s;
  if (args.q_rows < 0 || args.k_rows < 0) {
    return absl::InvalidArgumentError("q_rows and k_rows must be non-negative");
  }
  if (absl::Status s = CheckWork(work, args.q_rows, args.k_rows); !s.ok()) return s;
  if (work.blocks.empty()) return absl::OkStatus();
  if (absl::Status s = CheckBuffers({{args.q, "q"},
                                     {args.dout, "dout"},
                                     {args.lse, "lse"},
                                     {args.delta, "delta"},
                                     {args.k, "k"},
                                     {args.v, "v"},
                                     {args.dq, "dq"},
                                     {args.dk, "dk"},
                                     {args.dv, "dv"}});
      !s.ok()) {
    return s;
  }
  const AttentionDims& dims = args.dims;
  // Key chunks of kTileK rows and, for each, the (block, segment) pairs that touch it, in
  // work-list order: the fixed order in which their contributions are summed.
  const int64_t num_chunks = (args.k_rows + kTileK - 1) / kTileK;
  std::vector<std::vector<std::pair<int64_t, int64_t>>> touching(num_chunks);
  for (int64_t b = 0; b < static_cast<int64_t>(work.blocks.size()); ++b) {
    const QueryBlock& blk = work.blocks[b];
    if (blk.q_begin >= blk.q_end) continue;
    for (int64_t s = blk.seg_begin; s < blk.seg_end; ++s) {
      const KeySegment& seg = work.segments[s];
      if (seg.k_begin >= seg.k_end) continue;
      for (int64_t c = seg.k_begin / kTileK; c <= (seg.k_end - 1) / kTileK; ++c) {
        touching[c].emplace_back(b, s);
      }
    }
  }
  std::vector<int64_t> busy_chunks;
  for (int64_t c = 0; c < num_chunks; ++c) {
    if (!touching[c].empty()) busy_chunks.push_back(c);
  }
  std::vector<std::vector<int>> heads_of_group(dims.heads_kv);
  for (int h = 0; h < dims.heads_q; ++h) heads_of_group[dims.KvHead(h)].push_back(h);
  const int64_t blocks = static_cast<int64_t>(work.blocks.size());
  const int64_t key_tasks = static_cast<int64_t>(busy_chunks.size()) * dims.heads_kv;
  DispatchDType(args.dtype, [&]<typename T>() {
    ParallelFor(key_tasks, num_threads, [&](int64_t task) {
      const int g = static_cast<int>(task % dims.heads_kv);
      const int64_t c = busy_chunks[task / dims.heads_kv];
      if (heads_of_group[g].empty()) return;
      BackwardKeyTask<T>(args, work, heads_of_group[g], g, c * kTileK, touching[c]);
    });
    ParallelFor(blocks * dims.heads_q, num_threads, [&](int64_t task) {
      BackwardQueryTask<T>(args, work, static_cast<int>(task % dims.heads_q), task / dims.heads_q);
    });
  });
  return absl::OkStatus();
}

const KernelSet& HandWrittenKernels() {
  static const HandWritten* const kernels = new HandWritten();
  return *kernels;
}

void ComputeDelta(DType dtype, const void* dout, const void* out, int64_t rows, int heads,
                  int head_dim, float* delta) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int h = 0; h < heads; ++h) {
      const size_t base = (static_cast<size_t>(r) * heads + h) * head_dim;
      float sum = 0.0f;
      for (int d = 0; d < head_dim; ++d) {
        sum += LoadAsFloat(dtype, dout, base + d) * LoadAsFloat(dtype, out, base + d);
      }
      delta[h * rows + r] = sum;
    }
  }
}

}  // namespace hsap
