// The fixed part of every host attention kernel that jit/codegen_host.cc generates. Not
// compiled by the build: the library embeds this file (.incbin), and the generator puts the
// constants of one configuration before it (HSAP_AVX512, HSAP_DTYPE, HSAP_BAND, and kD, kBQ,
// kBK, kGqa, kVL, kRA, kCA, kRB, kCB in an anonymous namespace); the host compiler then
// specialises everything below on them. "hsap_host_abi.h" is written next to the generated
// source from jit/host_abi.h; the kernels export its extern "C" entry points.

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "hsap_host_abi.h"

#define HSAP_EXPORT extern "C" __attribute__((visibility("default")))
#define HSAP_INLINE static inline __attribute__((always_inline))
#if defined(__clang__)
#define HSAP_UNROLL _Pragma("unroll")
#else
#define HSAP_UNROLL _Pragma("GCC unroll 32")
#endif

namespace {

static_assert(kD >= 32 && kD <= 256 && kD % 8 == 0,
              "hsap JIT: unsupported head dim (must be a multiple of 8 in [32, 256])");
constexpr int kDP = (kD + kVL - 1) / kVL * kVL;  // head dim padded to whole vectors
constexpr int kDV = kDP / kVL;                   // vectors per padded row
constexpr int kKV = kBK / kVL;                   // vectors per row of a key tile
constexpr int kBQA = (kBQ + kRA - 1) / kRA * kRA;
static_assert(kBK % kVL == 0 && kKV % kCA == 0, "hsap JIT: block_k does not fit the ISA");
static_assert(kDV % kCB == 0, "hsap JIT: head-dim blocking");
static_assert(kBQ % kRB == 0 && kBK % kRB == 0, "hsap JIT: tile rows");
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -__builtin_inff();

// ---- vectors of kVL floats ----
#if HSAP_AVX512
static_assert(kVL == 16, "");
typedef __m512 vf;
HSAP_INLINE vf vload(const float* p) { return _mm512_loadu_ps(p); }
HSAP_INLINE void vstore(float* p, vf x) { _mm512_storeu_ps(p, x); }
HSAP_INLINE vf vset1(float x) { return _mm512_set1_ps(x); }
HSAP_INLINE vf vzero() { return _mm512_setzero_ps(); }
HSAP_INLINE vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
HSAP_INLINE vf vfmsub(vf a, vf b, vf c) { return _mm512_fmsub_ps(a, b, c); }
HSAP_INLINE vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
HSAP_INLINE vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
HSAP_INLINE vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
HSAP_INLINE vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
HSAP_INLINE float vsum(vf x) { return _mm512_reduce_add_ps(x); }
HSAP_INLINE float vhmax(vf x) { return _mm512_reduce_max_ps(x); }
// Whether some lane is NaN or +inf.
HSAP_INLINE bool vany_nan_or_inf(vf x) {
  return _mm512_cmp_ps_mask(x, vset1(__builtin_inff()), _CMP_NLT_UQ) != 0;
}
// Lanes whose index j0 + lane lies outside [a, b) become `fill`.
HSAP_INLINE vf vkeep(vf x, int j0, int a, int b, float fill) {
  const __m512i idx =
      _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                       _mm512_set1_epi32(j0));
  const __mmask16 m = _mm512_cmpge_epi32_mask(idx, _mm512_set1_epi32(a)) &
                      _mm512_cmplt_epi32_mask(idx, _mm512_set1_epi32(b));
  return _mm512_mask_blend_ps(m, _mm512_set1_ps(fill), x);
}
// 2^x for x <= 0 (scores minus their maximum); 0 for x < -126 and for -inf; NaN for NaN.
HSAP_INLINE vf vexp2(vf x) {
  const vf xc = _mm512_max_ps(vset1(-127.0f), x);  // NaN stays NaN (max returns operand 2)
  const vf n = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const vf f = vmul(vsub(xc, n), vset1(kLn2));  // |f| <= ln2 / 2
  // e^f by Taylor to degree 7: relative error below 6e-9 on the interval.
  vf p = vset1(1.0f / 5040.0f);
  p = vfma(p, f, vset1(1.0f / 720.0f));
  p = vfma(p, f, vset1(1.0f / 120.0f));
  p = vfma(p, f, vset1(1.0f / 24.0f));
  p = vfma(p, f, vset1(1.0f / 6.0f));
  p = vfma(p, f, vset1(0.5f));
  p = vfma(p, f, vset1(1.0f));
  p = vfma(p, f, vset1(1.0f));
  const vf r = _mm512_scalef_ps(p, n);
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, vset1(-126.0f), _CMP_NLT_UQ), r);
}
#else  // AVX2 + FMA + F16C
static_assert(kVL == 8, "");
typedef __m256 vf;
HSAP_INLINE vf vload(const float* p) { return _mm256_loadu_ps(p); }
HSAP_INLINE void vstore(float* p, vf x) { _mm256_storeu_ps(p, x); }
HSAP_INLINE vf vset1(float x) { return _mm256_set1_ps(x); }
HSAP_INLINE vf vzero() { return _mm256_setzero_ps(); }
HSAP_INLINE vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
HSAP_INLINE vf vfmsub(vf a, vf b, vf c) { return _mm256_fmsub_ps(a, b, c); }
HSAP_INLINE vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
HSAP_INLINE vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
HSAP_INLINE vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
HSAP_INLINE vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
HSAP_INLINE float vsum(vf x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
HSAP_INLINE float vhmax(vf x) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
HSAP_INLINE bool vany_nan_or_inf(vf x) {
  return _mm256_movemask_ps(_mm256_cmp_ps(x, vset1(__builtin_inff()), _CMP_NLT_UQ)) != 0;
}
HSAP_INLINE vf vkeep(vf x, int j0, int a, int b, float fill) {
  const __m256i idx =
      _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(j0));
  const __m256i in = _mm256_and_si256(_mm256_cmpgt_epi32(idx, _mm256_set1_epi32(a - 1)),
                                      _mm256_cmpgt_epi32(_mm256_set1_epi32(b), idx));
  return _mm256_blendv_ps(_mm256_set1_ps(fill), x, _mm256_castsi256_ps(in));
}
HSAP_INLINE vf vexp2(vf x) {
  const vf xc = _mm256_max_ps(vset1(-126.0f), x);  // NaN stays NaN
  const vf n = _mm256_round_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const vf f = vmul(vsub(xc, n), vset1(kLn2));
  vf p = vset1(1.0f / 5040.0f);
  p = vfma(p, f, vset1(1.0f / 720.0f));
  p = vfma(p, f, vset1(1.0f / 120.0f));
  p = vfma(p, f, vset1(1.0f / 24.0f));
  p = vfma(p, f, vset1(1.0f / 6.0f));
  p = vfma(p, f, vset1(0.5f));
  p = vfma(p, f, vset1(1.0f));
  p = vfma(p, f, vset1(1.0f));
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const vf r = vmul(p, _mm256_castsi256_ps(bits));
  return _mm256_and_ps(r, _mm256_cmp_ps(x, vset1(-126.0f), _CMP_NLT_UQ));
}
#endif

// ---- storage rows ----
#if HSAP_DTYPE == 0
typedef float storage_t;
HSAP_INLINE __m256 load8(const storage_t* p) { return _mm256_loadu_ps(p); }
#elif HSAP_DTYPE == 1
typedef uint16_t storage_t;  // bf16: the high half of an fp32
HSAP_INLINE __m256 load8(const storage_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
#else
typedef uint16_t storage_t;  // fp16
HSAP_INLINE __m256 load8(const storage_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

// dst[0, kDP) = src[0, kD) * mul, zero padded.
HSAP_INLINE void load_row(const storage_t* src, float* dst, float mul) {
  const __m256 m = _mm256_set1_ps(mul);
  for (int d = 0; d < kD; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(load8(src + d), m));
  for (int d = kD; d < kDP; ++d) dst[d] = 0.0f;
}

HSAP_INLINE void zero_floats(float* p, int64_t n) {
  for (int64_t i = 0; i < n; ++i) p[i] = 0.0f;
}

// S[r][0, kBK) = sum_d A[r][d] * BT[d][0, kBK) for r < round_up(rows, kRA); rows of A are
// `lda` floats apart and must exist up to that bound.
static void gemm_abt(const float* __restrict A, int64_t lda, const float* __restrict BT,
                     float* __restrict S, int rows) {
  for (int r0 = 0; r0 < rows; r0 += kRA) {
    const float* a = A + r0 * lda;
    for (int c0 = 0; c0 < kKV; c0 += kCA) {
      vf acc[kRA][kCA];
      HSAP_UNROLL for (int r = 0; r < kRA; ++r) {
        HSAP_UNROLL for (int c = 0; c < kCA; ++c) acc[r][c] = vzero();
      }
      const float* b = BT + c0 * kVL;
      for (int d = 0; d < kD; ++d) {
        vf bv[kCA];
        HSAP_UNROLL for (int c = 0; c < kCA; ++c) bv[c] = vload(b + d * kBK + c * kVL);
        HSAP_UNROLL for (int r = 0; r < kRA; ++r) {
          const vf av = vset1(a[r * lda + d]);
          HSAP_UNROLL for (int c = 0; c < kCA; ++c) acc[r][c] = vfma(av, bv[c], acc[r][c]);
        }
      }
      HSAP_UNROLL for (int r = 0; r < kRA; ++r) {
        HSAP_UNROLL for (int c = 0; c < kCA; ++c) {
          vstore(S + (r0 + r) * kBK + (c0 + c) * kVL, acc[r][c]);
        }
      }
    }
  }
}

// C[r][0, kDP) += sum_{n < nn} P[r * ps_r + n * ps_n] * B[n * ldb + (0, kDP)] for
// r < round_up(rows, kRB).
static void gemm_pb(const float* __restrict P, int64_t ps_r, int64_t ps_n, int nn,
                    const float* __restrict B, int64_t ldb, float* __restrict C, int64_t ldc,
                    int rows) {
  for (int r0 = 0; r0 < rows; r0 += kRB) {
    for (int c0 = 0; c0 < kDV; c0 += kCB) {
      vf acc[kRB][kCB];
      HSAP_UNROLL for (int r = 0; r < kRB; ++r) {
        HSAP_UNROLL for (int c = 0; c < kCB; ++c) {
          acc[r][c] = vload(C + (r0 + r) * ldc + (c0 + c) * kVL);
        }
      }
      const float* p = P + r0 * ps_r;
      const float* b = B + c0 * kVL;
      for (int n = 0; n < nn; ++n) {
        vf bv[kCB];
        HSAP_UNROLL for (int c = 0; c < kCB; ++c) bv[c] = vload(b + n * ldb + c * kVL);
        HSAP_UNROLL for (int r = 0; r < kRB; ++r) {
          const vf av = vset1(p[r * ps_r + n * ps_n]);
          HSAP_UNROLL for (int c = 0; c < kCB; ++c) acc[r][c] = vfma(av, bv[c], acc[r][c]);
        }
      }
      HSAP_UNROLL for (int r = 0; r < kRB; ++r) {
        HSAP_UNROLL for (int c = 0; c < kCB; ++c) {
          vstore(C + (r0 + r) * ldc + (c0 + c) * kVL, acc[r][c]);
        }
      }
    }
  }
}

// Keys [a, b) of the tile starting at key kt0 that query row q sees in segment s.
HSAP_INLINE void row_interval(int64_t k_begin, int64_t k_end, int64_t diag_lo, int64_t diag_hi,
                              int64_t q, int64_t kt0, int* a, int* b) {
  int64_t lo = k_begin, hi = k_end;
#if HSAP_BAND
  if (q + diag_lo > lo) lo = q + diag_lo;
  if (q + diag_hi + 1 < hi) hi = q + diag_hi + 1;
#endif
  if (lo < kt0) lo = kt0;
  if (hi > kt0 + kBK) hi = kt0 + kBK;
  if (hi < lo) hi = lo;
  *a = static_cast<int>(lo - kt0);
  *b = static_cast<int>(hi - kt0);
}

// Whether every row of [q_begin, q_end) sees every key of the tile at kt0.
HSAP_INLINE bool tile_is_full(int64_t k_begin, int64_t k_end, int64_t diag_lo, int64_t diag_hi,
                              int64_t q_begin, int64_t q_end, int64_t kt0) {
  bool full = k_begin <= kt0 && kt0 + kBK <= k_end;
#if HSAP_BAND
  full = full && kt0 - (q_end - 1) >= diag_lo && kt0 + kBK - 1 - q_begin <= diag_hi;
#endif
  return full;
}

// Keys [lo, hi) that some row of [q_begin, q_end) sees.
HSAP_INLINE void block_key_range(int64_t k_begin, int64_t k_end, int64_t diag_lo, int64_t diag_hi,
                                 int64_t q_begin, int64_t q_end, int64_t* lo, int64_t* hi) {
  *lo = k_begin;
  *hi = k_end;
#if HSAP_BAND
  if (q_begin + diag_lo > *lo) *lo = q_begin + diag_lo;
  if (q_end - 1 + diag_hi + 1 < *hi) *hi = q_end - 1 + diag_hi + 1;
#endif
}

// What a query row has met among its visible scores so far. A naive softmax gives NaN
// (out and lse) for a row with a NaN or +inf score (inf - inf) or whose scores are all -inf;
// the online softmax cannot see that in m and l, so the row keeps this state.
constexpr float kRowSawNoKey = 0.0f;
constexpr float kRowSawKey = 1.0f;
constexpr float kRowIsNaN = 2.0f;

// One row of the online softmax over a tile: s holds the raw scores q.k, becomes
// probabilities relative to the running max m of s * scale (natural units, as the lse and
// the backward's p = e^(s * scale - lse): an lse formed in base 2 from pre-scaled queries
// would carry |lse| ulps of the base change that the backward's p does not, a per-row
// scaling of dq); l and the output row o are rescaled; `state`
// is updated as above (a NaN row keeps m, l, o and gets zero probabilities).
HSAP_INLINE void online_softmax_row(float* s, int a, int b, bool full, float scale, float* m,
                                    float* l, float* o, float* state) {
  vf x[kKV];
  vf mx = vset1(kNegInf);
  bool non_finite = false;
  const vf sv = vset1(scale), log2e = vset1(kLog2e);
  HSAP_UNROLL for (int c = 0; c < kKV; ++c) {
    x[c] = vmul(vload(s + c * kVL), sv);
    if (!full) x[c] = vkeep(x[c], c * kVL, a, b, kNegInf);
    non_finite = non_finite || vany_nan_or_inf(x[c]);
    mx = vmax(mx, x[c]);
  }
  if (full || a < b)
    *state = non_finite ? kRowIsNaN : (*state == kRowIsNaN ? kRowIsNaN : kRowSawKey);
  const float tile_max = vhmax(mx);
  if (*state == kRowIsNaN || tile_max == kNegInf) {  // nothing more to add to this row
    HSAP_UNROLL for (int c = 0; c < kKV; ++c) vstore(s + c * kVL, vzero());
    return;
  }
  const float m_old = *m;
  const float m_new = tile_max > m_old ? tile_max : m_old;
  const vf mv = vset1(m_new);
  vf sum = vzero();
  HSAP_UNROLL for (int c = 0; c < kKV; ++c) {
    const vf p = vexp2(vmul(vsub(x[c], mv), log2e));
    vstore(s + c * kVL, p);
    sum = vadd(sum, p);
  }
  const float alpha = m_old == kNegInf ? 0.0f : expf(m_old - m_new);
  *l = *l * alpha + vsum(sum);
  if (alpha != 1.0f) {
    const vf av = vset1(alpha);
    HSAP_UNROLL for (int d = 0; d < kDV; ++d) vstore(o + d * kVL, vmul(vload(o + d * kVL), av));
  }
  *m = m_new;
}

// Backward row: p = e^(s * scale - lse) on the visible keys (0 elsewhere), ds = p * (dp -
// delta); a NaN lse, score or dp makes the row's p or ds NaN on its visible keys, as a naive
// backward. Leaves p in s and ds in dp. The exponent is formed in the natural domain, one
// rounding of s * scale - lse, then taken to base 2: its error scales with |s * scale - lse|
// (small where p matters). Forming s * (scale * log2e) - lse * log2e instead rounds both
// products apart, an error of |lse| ulps in every p of the row (dq over the rule on long rows).
HSAP_INLINE void probs_and_dscores_row(float* s, float* dp, int a, int b, bool full, float lse,
                                       float delta, float scale) {
  if (lse == kNegInf) {  // the row sees no key at all
    HSAP_UNROLL for (int c = 0; c < kKV; ++c) {
      vstore(s + c * kVL, vzero());
      vstore(dp + c * kVL, vzero());
    }
    return;
  }
  const vf sv = vset1(scale), lv = vset1(lse), dv = vset1(delta), log2e = vset1(kLog2e);
  HSAP_UNROLL for (int c = 0; c < kKV; ++c) {
    vf p = vexp2(vmul(vfmsub(vload(s + c * kVL), sv, lv), log2e));
    if (!full) p = vkeep(p, c * kVL, a, b, 0.0f);
    vstore(s + c * kVL, p);
    vstore(dp + c * kVL, vmul(p, vsub(vload(dp + c * kVL), dv)));
  }
}

// Merges the partial (o2 * o2_mul, lse2) into (o1, *lse1); kD floats.
HSAP_INLINE void merge_row(float* o1, float* lse1, const float* o2, float o2_mul, float lse2) {
  if (lse2 == kNegInf) return;
  const float l1 = *lse1;
  if (l1 == kNegInf) {
    const __m256 w = _mm256_set1_ps(o2_mul);
    for (int d = 0; d < kD; d += 8) {
      _mm256_storeu_ps(o1 + d, _mm256_mul_ps(w, _mm256_loadu_ps(o2 + d)));
    }
    *lse1 = lse2;
    return;
  }
  const float hi = l1 > lse2 ? l1 : lse2;
  const float lo = l1 > lse2 ? lse2 : l1;
  const float lse = hi + log1pf(expf(lo - hi));
  const __m256 w1 = _mm256_set1_ps(expf(l1 - lse));
  const __m256 w2 = _mm256_set1_ps(expf(lse2 - lse) * o2_mul);
  for (int d = 0; d < kD; d += 8) {
    _mm256_storeu_ps(o1 + d, _mm256_fmadd_ps(w2, _mm256_loadu_ps(o2 + d),
                                             _mm256_mul_ps(w1, _mm256_loadu_ps(o1 + d))));
  }
  *lse1 = lse;
}

constexpr int64_t kScratchForward = 2 * kBQA * kDP + kBQA * kBK + 3 * kBQA;
constexpr int64_t kScratchBackward = 2 * kBQA * kBK + 2 * kBK * kDP + kBQA * kDP;
constexpr int64_t kScratchFloats =
    kScratchForward > kScratchBackward ? kScratchForward : kScratchBackward;

}  // namespace

HSAP_EXPORT void hsap_kernel_info(HsapHostKernelInfo* info) {
  info->abi_version = HSAP_HOST_ABI_VERSION;
  info->head_dim = kD;
  info->padded_head_dim = kDP;
  info->block_q = kBQ;
  info->block_k = kBK;
  info->gqa = kGqa;
  info->dtype = HSAP_DTYPE;
  info->masked = HSAP_BAND;
  info->vector_width = kVL;
  info->spare_rows = kRA;
  info->scratch_floats = kScratchFloats;
}

HSAP_EXPORT void hsap_pack(const HsapHostPackTask* t) {
  const storage_t* src = static_cast<const storage_t*>(t->src) + t->head * kD;
  alignas(64) float row[kDP];
  for (int j = 0; j < kBK; ++j) {
    const int64_t k = t->tile * kBK + j;
    if (k < t->rows) {
      load_row(src + k * t->row_stride, row, 1.0f);
    } else {
      zero_floats(row, kDP);
    }
    if (t->transposed) {
      for (int d = 0; d < kDP; ++d) t->dst[d * kBK + j] = row[d];
    } else {
      for (int d = 0; d < kDP; ++d) t->dst[j * kDP + d] = row[d];
    }
  }
}

HSAP_EXPORT void hsap_convert(const HsapHostConvertTask* t) {
  const storage_t* src = static_cast<const storage_t*>(t->src);
  for (int64_t r = t->row_begin; r < t->row_end; ++r) {
    for (int h = 0; h < t->heads; ++h) {
      load_row(src + r * t->row_stride + h * kD, t->dst + (r * t->heads + h) * kDP, 1.0f);
    }
  }
}

HSAP_EXPORT void hsap_forward(const HsapHostForwardTask* t) {
  const int nr = static_cast<int>(t->q_end - t->q_begin);
  float* const qs = t->scratch;      // [kBQA][kDP] queries (fp32)
  float* const o = qs + kBQA * kDP;  // [kBQA][kDP] unnormalised output
  float* const s = o + kBQA * kDP;   // [kBQA][kBK] scores, then probabilities
  float* const m = s + kBQA * kBK;   // running max of s * scale
  float* const l = m + kBQA;         // running sum
  float* const state = l + kBQA;     // kRowSawNoKey, kRowSawKey or kRowIsNaN
  const storage_t* q = static_cast<const storage_t*>(t->q) + t->q_head * kD;
  for (int r = 0; r < kBQA; ++r) {
    if (r < nr) {
      load_row(q + (t->q_begin + r) * t->q_row_stride, qs + r * kDP, 1.0f);
    } else {
      zero_floats(qs + r * kDP, kDP);
    }
    zero_floats(o + r * kDP, kDP);
    zero_floats(s + r * kBK, kBK);
    m[r] = kNegInf;
    l[r] = 0.0f;
    state[r] = kRowSawNoKey;
  }
  for (int64_t si = 0; si < t->num_segments; ++si) {
    const HsapHostSegment g = t->segments[si];
    int64_t lo, hi;
    block_key_range(g.k_begin, g.k_end, g.diag_lo, g.diag_hi, t->q_begin, t->q_end, &lo, &hi);
    if (hi <= lo) continue;
    for (int64_t tile = lo / kBK; tile * kBK < hi; ++tile) {
      const int64_t kt0 = tile * kBK;
      const bool full =
          tile_is_full(g.k_begin, g.k_end, g.diag_lo, g.diag_hi, t->q_begin, t->q_end, kt0);
      gemm_abt(qs, kDP, t->kt + tile * (kBK * kDP), s, nr);
      for (int r = 0; r < nr; ++r) {
        int a = 0, b = kBK;
        if (!full)
          row_interval(g.k_begin, g.k_end, g.diag_lo, g.diag_hi, t->q_begin + r, kt0, &a, &b);
        online_softmax_row(s + r * kBK, a, b, full, t->scale, m + r, l + r, o + r * kDP,
                           state + r);
      }
      gemm_pb(s, kBK, 1, kBK, t->v + tile * (kBK * kDP), kDP, o, kDP, nr);
    }
  }
  for (int r = 0; r < nr; ++r) {
    const int64_t row = t->q_begin + r;
    if (state[r] == kRowIsNaN || (state[r] == kRowSawKey && l[r] == 0.0f)) {
      // Merging a NaN partial makes the row NaN whatever it held.
      float* out = t->out + row * t->out_row_stride + t->q_head * kD;
      for (int d = 0; d < kD; ++d) out[d] = __builtin_nanf("");
      t->lse[row] = __builtin_nanf("");
      continue;
    }
    if (l[r] == 0.0f) continue;  // no visible key: the partial (0, -inf) changes nothing
    merge_row(t->out + row * t->out_row_stride + t->q_head * kD, t->lse + row, o + r * kDP,
              1.0f / l[r], m[r] + logf(l[r]));
  }
}

HSAP_EXPORT void hsap_backward(const HsapHostBackwardTask* t) {
  float* const s = t->scratch;        // [kBQA][kBK] scores -> probabilities
  float* const dp = s + kBQA * kBK;   // [kBQA][kBK] dO.V^T -> dS
  float* const dk = dp + kBQA * kBK;  // [kBK][kDP]
  float* const dv = dk + kBK * kDP;   // [kBK][kDP]
  float* const dq = dv + kBK * kDP;   // [kBQA][kDP] dS.K of one item and head
  zero_floats(s, 2 * kBQA * kBK + 2 * kBK * kDP);
  const int64_t kt0 = t->tile * kBK;
  const __m256 sc = _mm256_set1_ps(t->scale);
  for (int64_t ii = 0; ii < t->num_items; ++ii) {
    const HsapHostKvItem it = t->items[ii];
    const int nr = static_cast<int>(it.q_end - it.q_begin);
    const bool full =
        tile_is_full(it.k_begin, it.k_end, it.diag_lo, it.diag_hi, it.q_begin, it.q_end, kt0);
    for (int gi = 0; gi < t->num_q_heads; ++gi) {
      const int h = t->q_heads[gi];
      const float* qa = t->q32 + it.q_begin * t->qd_row_stride + h * kDP;
      const float* da = t->do32 + it.q_begin * t->qd_row_stride + h * kDP;
      const float* lse = t->lse + h * t->lse_stride;
      const float* delta = t->delta + h * t->lse_stride;
      gemm_abt(qa, t->qd_row_stride, t->kt_tile, s, nr);
      gemm_abt(da, t->qd_row_stride, t->vt_tile, dp, nr);
      for (int r = 0; r < nr; ++r) {
        const int64_t row = it.q_begin + r;
        int a = 0, b = kBK;
        if (!full) row_interval(it.k_begin, it.k_end, it.diag_lo, it.diag_hi, row, kt0, &a, &b);
        probs_and_dscores_row(s + r * kBK, dp + r * kBK, a, b, full, lse[row], delta[row],
                              t->scale);
      }
      gemm_pb(s, 1, kBK, nr, da, t->qd_row_stride, dv, kDP, kBK);   // dV += P^T dO
      gemm_pb(dp, 1, kBK, nr, qa, t->qd_row_stride, dk, kDP, kBK);  // dK += dS^T Q
      if (gi == 0 && t->before_item) t->before_item(t->ctx, ii);    // may add to dq now
      zero_floats(dq, kBQA * kDP);
      gemm_pb(dp, kBK, 1, kBK, t->krow_tile, kDP, dq, kDP, nr);  // dQ = dS K
      for (int r = 0; r < nr; ++r) {
        float* out = t->dq + (it.q_begin + r) * t->dq_row_stride + h * kD;
        for (int d = 0; d < kD; d += 8) {
          _mm256_storeu_ps(out + d, _mm256_fmadd_ps(_mm256_loadu_ps(dq + r * kDP + d), sc,
                                                    _mm256_loadu_ps(out + d)));
        }
      }
    }
  }
  for (int j = 0; j < kBK; ++j) {
    const int64_t row = kt0 + j;
    if (row >= t->k_rows) break;
    float* outk = t->dk + row * t->kv_row_stride + t->kv_head * kD;
    float* outv = t->dv + row * t->kv_row_stride + t->kv_head * kD;
    for (int d = 0; d < kD; d += 8) {
      _mm256_storeu_ps(outk + d, _mm256_fmadd_ps(_mm256_loadu_ps(dk + j * kDP + d), sc,
                                                 _mm256_loadu_ps(outk + d)));
      _mm256_storeu_ps(outv + d,
                       _mm256_add_ps(_mm256_loadu_ps(dv + j * kDP + d), _mm256_loadu_ps(outv + d)));
    }
  }
}

HSAP_EXPORT void hsap_merge(const HsapHostMergeTask* t) {
  for (int64_t r = t->row_begin; r < t->row_end; ++r) {
    for (int h = 0; h < t->heads; ++h) {
      const int64_t off = (r * t->heads + h) * kD;
      merge_row(t->o1 + off, t->lse1 + h * t->lse_stride1 + r, t->o2 + off, 1.0f,
                t->lse2[h * t->lse_stride2 + r]);
    }
  }
}
