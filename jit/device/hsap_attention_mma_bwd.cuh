// The tensor-core backward (FlashAttention-2 structure) for bf16/f16 storage: mma.sync
// m16n8k16 with fp32 accumulation, ldmatrix fragment loads, cp.async double-buffered tiles.
// Same contract as attn_bwd_kernel (BwdParams of hsap_params.cuh): same arguments, any grid
// (the generator launches (num_blocks, heads_q)), dq/dk/dv fp32 and added into.
//
// Work. The CTAs of the grid walk, grid-stride, over two kinds of item:
//   1. key items (key tile kt of kBN rows, kv head): the CTA keeps dK and dV of its keys in
//      registers (fp32 accumulators), walks every query head of the kv head (GQA: the group's
//      gradients are summed in registers) and every (query block, segment) of the work list
//      whose visible rows meet its keys, in kBM-row query tiles, and per tile recomputes
//        S^T = K Q^T, P^T = exp(scale S^T - lse), dP^T = V dO^T, dS^T = P^T (dP^T - delta),
//        dV += P^T dO, dK += dS^T Q
//      (the exponential as prob_from_log2 of hsap_device.cuh: an FFMA and an ex2.approx on
//      the rows' lse kept in log2 units, no branch)
//      then adds dK * scale and dV to dk/dv once: one CTA per (key rows, kv head), so dk/dv
//      are bitwise deterministic (the plain kernel's are not).
//   2. dq. kDeterministicDq (default): query items (query block, head), exactly the plain
//      kernel's organisation: the CTA owns kQM query rows, walks the block's segments
//      and key tiles in order, recomputes S, P, dP, dS and accumulates dQ = dS K in registers,
//      then adds dQ * scale to its rows: a fixed reduction order, bitwise reproducible, at the
//      price of recomputing S and dP (7 instead of 5 tile products; see docs/gpu_backend.md).
//      Otherwise the key items write dS^T to shared memory and add dQ += dS K with fp32
//      atomicAdd (FlashAttention-2's choice: fewer flops, not bitwise reproducible).
//
// Warps and fragments (m16n8k16, layouts in hsap_mma.cuh). Key items: warp w owns the 16
// keys 16 * (w % kKeyGroups) .. + 16 of the tile and the dK/dV columns of its part
// w / kKeyGroups of the head dim (kDSplit parts). S^T and dP^T are computed with the keys as
// the M side, so their accumulators are already the A fragments (keys x queries) of
// dV += P^T dO and dK += dS^T Q: no shared-memory round trip for P or dS. Q and dO are the
// B operand of S^T/dP^T (stored [query][d], i.e. "column-major" B: ldmatrix without .trans)
// and of dV/dK (k = query: ldmatrix.trans).
// Query items: warp w owns 16 query rows w % kDqRowGroups and the dQ columns of its part
// w / kDqRowGroups of the head dim; S = Q K^T, dP = dO V^T (B = K, V rows: plain ldmatrix),
// dQ += dS K (A = dS from the accumulators, B = K with ldmatrix.trans).
//
// Registers (fp32 accumulators per thread; 255 is the hardware limit, the compile test asks
// for zero spills): key items hold dK + dV = 2 * 16 * kDW / 32 = kDW and S^T, dP^T =
// 2 * 16 * kBM / 32 = kBM; query items dQ = 16 * D / kDqSplit / 32 and S, dP of 32-key tiles
// (32). The generator's tiles (MmaBwdTileFor), 4 warps:
//   D = 64:        kBN = 64, kBM = 32: 16 keys x all of D per warp (64 + 32 floats);
//   64 < D <= 128: kBN = 64, kBM = 16 (128 + 16 at D = 128; with 32, ptxas spilled);
//   D > 128:       kBN = 32, kBM = 16, D split over two warps (kDW = D / 2 <= 128): both
//                  warps of a key group compute the same S^T, dP^T (the price of keeping dK,
//                  dV in registers); query items split D the same way (kDqSplit = 2, 64
//                  floats of dQ at D = 256 instead of 128, which spilled).
// ptxas (CUDA 13) gives 170-250 registers and no spills for these on sm_80 and sm_90, bf16 and
// f16, deterministic and atomic dq (docs/gpu_backend.md has the table). The kernel declares the
// 2 CTAs per SM it is sized for (__launch_bounds__ minimum): without it, once the precomputed
// cp.async addresses had brought the D = 64 kernel to ~185 registers, ptxas chose 3 CTAs per SM
// on its own, capped it at 168 and spilled the item loop's step count (8 bytes, sm_80 bf16 GQA-8).
// At D = 128 and 256 the declaration changes nothing (same registers, same instruction mix).
//
// Shared memory (storage type, rows padded by 8 elements = 16 bytes so that the 8 rows an
// ldmatrix reads fall into distinct bank groups): key items K, V tiles [kBN][kLd], two stages
// of Q, dO [kBM][kLd] with their lse and delta, and dS^T [kBN][kBM + 8] (atomic dq only);
// query items Q, dO [kQM = 16 kWarps / kDqSplit][kLd] (lse, delta in registers) and two
// stages of K, V [kDqBN = 32][kLd]. Both start after 256 bytes of walk state that
// thread 0 advances and shares (a uniform walk in every thread's registers would cost ~20 of them
// in the compute loop); they reuse the same memory (MmaBwdShape::kSmemBytes = the larger).
//
// Masking is per element exactly as attn_bwd_kernel: a (query, key) pair counts for a
// segment iff the key is in [k_begin, k_end), diag_lo <= key - query <= diag_hi and the
// query's lse is not -inf; P and dS are 0 (selected, not multiplied) elsewhere. Work lists
// never contain fully masked tiles; key items find the query rows of a segment that see
// their keys from the band (q in [k - diag_hi, k - diag_lo]). NaN/inf as include/hsap/hsap.h
// states: a NaN lse, q or dout row makes NaN what the naive computation does, and may reach
// rows or keys of the same tile through the tile products.
// Contract violations are reported in error_flag exactly as attn_bwd_kernel does; in
// addition q, k, v and dout must be 16-byte aligned (cp.async moves 16-byte rows), else
// kErrorMisaligned is reported and nothing is computed.
//
// Required members of Cfg, beyond those of hsap_attention.cuh:
//   kBwdBlockM, kBwdBlockN, kBwdThreads: query tile kBM, key tile kBN, CTA size
//   kDeterministicDq                   : dq by query items (true) or atomics (false)
//   kBwdSmemBytes                      : MmaBwdShape<Cfg>::kSmemBytes (checked)
#ifndef HSAP_JIT_DEVICE_HSAP_ATTENTION_MMA_BWD_CUH_
#define HSAP_JIT_DEVICE_HSAP_ATTENTION_MMA_BWD_CUH_

#if defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(HSAP_DEVICE_EMULATION)

#include "hsap_device.cuh"
#include "hsap_mma.cuh"
#include "hsap_params.cuh"
#include "hsap_worklist.cuh"

namespace hsap_dev {

// The largest divisor of n that is at most m (register chunking of the atomic dq).
template <int n, int m>
struct MmaLargestDivisor {
  static constexpr int value = n % m == 0 ? m : MmaLargestDivisor<n, m - 1>::value;
};
template <int n>
struct MmaLargestDivisor<n, 1> {
  static constexpr int value = 1;
};

template <class Cfg>
struct MmaBwdShape {
  using T = typename Cfg::T;
  static constexpr int kD = Cfg::kHeadDim;
  static constexpr int kBM = Cfg::kBwdBlockM;  // query rows per tile of a key item
  static constexpr int kBN = Cfg::kBwdBlockN;  // key rows per tile
  static constexpr int kThreads = Cfg::kBwdThreads;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kKeyGroups = kBN / 16;          // warps along the keys of a tile
  static constexpr int kDSplit = kWarps / kKeyGroups;  // warps sharing a key group
  static constexpr int kDW = kD / kDSplit;             // dK/dV columns per warp
  // Query items: above head dim 128 two warps share 16 query rows, each accumulating dQ of
  // half of D (dQ of all 256 columns would be 128 floats per thread next to S and dP).
  static constexpr int kDqSplit = kD > 128 ? 2 : 1;
  static constexpr int kDqRowGroups = kWarps / kDqSplit;
  static constexpr int kDqW = kD / kDqSplit;     // dQ columns per warp
  static constexpr int kQM = 16 * kDqRowGroups;  // query rows of a query item's chunk
  static constexpr int kLd = kD + 8;             // padded tile row (elements)
  static constexpr int kSLd = kBM + 8;           // padded dS^T row (elements)
  // Atomic dq: warp w adds the 16 query rows w % kRowGroups, columns of part w / kRowGroups
  // (kDqParts parts of whole 8-column tiles: the warps of a row group, or two of them when
  // D / 8 does not divide by their number, e.g. D = 80 or 144 on 4 warps; the others idle).
  static constexpr int kRowGroups = kBM / 16;
  static constexpr int kWarpsPerRowGroup = kWarps / kRowGroups > 0 ? kWarps / kRowGroups : 1;
  static constexpr int kDqParts = (kD / 8) % kWarpsPerRowGroup == 0 ? kWarpsPerRowGroup
                                  : (kD / 8) % 2 == 0 && kWarpsPerRowGroup % 2 == 0 ? 2
                                                                                    : 1;
  static constexpr int kDQW = kD / kDqParts;
  static constexpr int kDQChunkTiles = MmaLargestDivisor<kDQW / 8, 8>::value;

  // The dq pass's key tile: 32 keys (S and dP of 32 keys next to dQ; half the shared memory
  // of 64-key stages, so that head dim 128 fits the 99 KB of sm_86/89); 16 under explicit
  // key tiles of 16 (jit/codegen_cuda.cc MmaDqBlockN: the same rule).
  static constexpr int kDqBN = kBN < 32 ? 16 : 32;
  // The walk and tile descriptors that thread 0 shares (MmaKeyWalk / MmaQueryWalk, MmaTile).
  static constexpr int kCtrlBytes = 256;
  static constexpr int kRowBytes = kLd * 2;
  static constexpr int kKeyPhaseBytes = kCtrlBytes + 2 * kBN * kRowBytes + 2 * 2 * kBM * kRowBytes +
                                        2 * 2 * kBM * 4 +
                                        (Cfg::kDeterministicDq ? 0 : kBN * kSLd * 2);
  static constexpr int kQueryPhaseBytes =
      kCtrlBytes + 2 * kQM * kRowBytes + 2 * 2 * kDqBN * kRowBytes;
  static constexpr int kSmemBytes =
      kKeyPhaseBytes > kQueryPhaseBytes ? kKeyPhaseBytes : kQueryPhaseBytes;

  static_assert(sizeof(T) == 2, "hsap: the mma backward takes bf16 or f16 storage");
  static_assert(kD % 16 == 0 && kD >= 64 && kD <= 256,
                "hsap: the mma backward needs a head dim multiple of 16 in [64, 256]");
  static_assert(kThreads % 32 == 0 && kWarps >= 1 && kWarps <= 16, "hsap: CTA size");
  static_assert(kBN % 16 == 0 && kWarps % kKeyGroups == 0 && kKeyGroups >= 1,
                "hsap: key tile must be 16 keys per warp group");
  static_assert(kD % kDSplit == 0 && kDW % 8 == 0, "hsap: head dim split over warps");
  static_assert(kBM % 16 == 0 && kBM >= 16, "hsap: query tile must be a multiple of 16 rows");
  static_assert(kWarps % kDqSplit == 0 && kDqW % 8 == 0, "hsap: dQ columns split over warps");
  static_assert(Cfg::kDeterministicDq ||
                    (kWarps % kRowGroups == 0 && kDQW % 8 == 0 && kD % kDQW == 0),
                "hsap: atomic dq needs the query tile's row groups to divide the warps");
};

// A 16x16 A fragment of a row-major smem matrix: rows row0.., columns col0...
template <typename T, int kLdA>
HSAP_DEV void load_a(unsigned (&a)[4], const T* base, int row0, int col0, int lane) {
  ldmatrix_x4(a, base + (row0 + (lane & 15)) * kLdA + col0 + (lane >> 4) * 8);
}
// The same A fragment (rows = m, columns = k) from a matrix stored transposed, [k][m].
template <typename T, int kLdA>
HSAP_DEV void load_a_transposed(unsigned (&a)[4], const T* base, int row0, int col0, int lane) {
  ldmatrix_x4_trans(
      a, base + (col0 + (lane & 7) + (lane >> 4) * 8) * kLdA + row0 + ((lane >> 3) & 1) * 8);
}

// acc[n] += A * B_n for kNT n-tiles, B stored [n][k] (rows brow0 + 8n.., columns kcol0..+16):
// plain ldmatrix gives the "column-major" B fragment.
template <typename T, int kNT, int kLdB>
HSAP_DEV void mma_b_rows(float (&acc)[kNT][4], const unsigned (&a)[4], const T* b, int brow0,
                         int kcol0, int lane) {
  HSAP_UNROLL
  for (int n = 0; n + 1 < kNT; n += 2) {
    unsigned r[4];
    ldmatrix_x4(r, b + (brow0 + n * 8 + (lane & 7) + (lane >> 4) * 8) * kLdB + kcol0 +
                       ((lane >> 3) & 1) * 8);
    const unsigned b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
    MmaOps<T>::mma(acc[n], a, b0);
    MmaOps<T>::mma(acc[n + 1], a, b1);
  }
  if constexpr (kNT % 2 == 1) {
    unsigned r[2];
    ldmatrix_x2(r, b + (brow0 + (kNT - 1) * 8 + (lane & 7)) * kLdB + kcol0 + ((lane >> 3) & 1) * 8);
    MmaOps<T>::mma(acc[kNT - 1], a, r);
  }
}

// acc[n] += A * B_n for kNT n-tiles, B stored [k][n] (rows krow0..+16, columns col0 + 8n..):
// ldmatrix.trans gives the B fragment.
template <typename T, int kNT, int kLdB>
HSAP_DEV void mma_b_cols(float (&acc)[kNT][4], const unsigned (&a)[4], const T* b, int krow0,
                         int col0, int lane) {
  const T* row = b + (krow0 + (lane & 7) + ((lane >> 3) & 1) * 8) * kLdB + col0;
  HSAP_UNROLL
  for (int n = 0; n + 1 < kNT; n += 2) {
    unsigned r[4];
    ldmatrix_x4_trans(r, row + n * 8 + (lane >> 4) * 8);
    const unsigned b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
    MmaOps<T>::mma(acc[n], a, b0);
    MmaOps<T>::mma(acc[n + 1], a, b1);
  }
  if constexpr (kNT % 2 == 1) {
    unsigned r[2];
    ldmatrix_x2_trans(r, row + (kNT - 1) * 8);
    MmaOps<T>::mma(acc[kNT - 1], a, r);
  }
}

// The A fragment (16 x 16, k-chunk kk) made of the accumulators of n-tiles 2kk, 2kk + 1:
// the C layout of two m16n8 tiles is the A layout of one m16k16 (hsap_mma.cuh).
template <typename T, int kNT>
HSAP_DEV void accumulators_as_a(unsigned (&a)[4], const float (&c)[kNT][4], int kk) {
  a[0] = MmaOps<T>::pack(c[2 * kk][0], c[2 * kk][1]);
  a[1] = MmaOps<T>::pack(c[2 * kk][2], c[2 * kk][3]);
  a[2] = MmaOps<T>::pack(c[2 * kk + 1][0], c[2 * kk + 1][1]);
  a[3] = MmaOps<T>::pack(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

template <int kNT>
HSAP_DEV void zero_acc(float (&acc)[kNT][4]) {
  HSAP_UNROLL
  for (int n = 0; n < kNT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
}

// Bounds of the band relative to a tile: a pair (key kc, query qc) of local indices of a
// tile whose first key is k0 and first query q0 is visible iff lo <= kc - qc <= hi, with
// lo = diag_lo - (k0 - q0), hi = diag_hi - (k0 - q0), clamped to what a tile can reach
// (|kc - qc| < 2^20) so that the per-element test is on 32-bit integers.
constexpr int kMmaRelLimit = 1 << 20;
HSAP_DEV int mma_rel_lo(long long diag_lo, long long shift) {
  if (diag_lo <= -kNoDiagLimit) return -kMmaRelLimit;
  const long long x = diag_lo - shift;
  return x < -kMmaRelLimit ? -kMmaRelLimit
                           : (x > kMmaRelLimit ? kMmaRelLimit : static_cast<int>(x));
}
HSAP_DEV int mma_rel_hi(long long diag_hi, long long shift) {
  if (diag_hi >= kNoDiagLimit) return kMmaRelLimit;
  const long long x = diag_hi - shift;
  return x < -kMmaRelLimit ? -kMmaRelLimit
                           : (x > kMmaRelLimit ? kMmaRelLimit : static_cast<int>(x));
}

// One tile of work as every thread of the CTA reads it (written by thread 0 into shared
// memory, copied to registers after a barrier): the query rows [q0, q0 + rows) of head h
// against key rows [k0 + lo_key, k0 + hi_key) of the key tile starting at k0, the band as
// relative bounds (mma_rel_lo / _hi).
struct MmaTile {
  long long q0, k0;
  int h, rows;
  int key_lo, key_hi;  // visible keys, local to the key tile
  int rel_lo, rel_hi;
  int valid;
};

// The walk of a key item over its query tiles (kept in shared memory, advanced by thread 0
// only, so that it costs no registers in the compute loop): query heads of the kv head,
// blocks, segments, query tiles. The order is fixed: dk/dv are deterministic.
struct MmaKeyWalk {
  long long si, seg_end;     // segment of block b, end of its segments
  long long q_begin, q_end;  // block b's rows
  long long q0, q_hi;        // current query tile, end of the rows that see the keys
  long long ka, kb;          // visible key rows of the tile in the current segment
  long long diag_lo, diag_hi;
  int h, b;
};

// The lse (in log2 units: lse * log2(e), for prob_from_log2) and delta of a thread's two
// accumulator rows, r0 and r0 + 8 of the query chunk at q0 (its first `rows` rows are real):
// -inf and 0 past them, so those rows' P is 0.
HSAP_DEV void load_row_stats(const BwdParams& p, int h, long long q0, int rows, int r0,
                             float (&lse)[2], float (&delta)[2]) {
  HSAP_UNROLL
  for (int i = 0; i < 2; ++i) {
    const int r = r0 + 8 * i;
    const long long stat = static_cast<long long>(h) * p.q_rows + (q0 + r);
    lse[i] = r < rows ? p.lse[stat] * kLog2E : neg_inf();
    delta[i] = r < rows ? p.delta[stat] : 0.0f;
  }
}

template <class Cfg>
HSAP_DEV void start_key_walk(MmaKeyWalk& w, const BwdParams& p) {
  w.h = -1;
  w.b = p.num_blocks;
  w.si = w.seg_end = 0;
  w.q0 = w.q_hi = 0;
}

// Advances w to the next query tile that sees keys [kt0, kt1) of kv head kvh and describes
// it in *t (t->valid = 0 at the end). Thread 0 only.
template <class Cfg>
HSAP_DEV void next_key_tile(MmaKeyWalk& w, const BwdParams& p, int kvh, long long kt0,
                            long long kt1, MmaTile* t) {
  constexpr int kBM = Cfg::kBwdBlockM;
  t->valid = 0;
  if (w.q0 + kBM < w.q_hi) {
    w.q0 += kBM;
  } else {
    if (p.num_blocks <= 0) return;
    for (;;) {
      ++w.si;
      if (w.si >= w.seg_end) {
        ++w.b;
        if (w.b >= p.num_blocks) {
          for (++w.h; w.h < p.heads_q; ++w.h) {
            int mapped = -1;
            if (p.kv_head_of_q != nullptr) {
              mapped = p.kv_head_of_q[w.h];
            } else if (p.heads_q == p.heads_kv * Cfg::kGqa) {
              mapped = w.h / Cfg::kGqa;
            }
            if (mapped < 0 || mapped >= p.heads_kv) {
              report(p.error_flag, kErrorHeads);
            }
            if (mapped == kvh) break;
          }
          if (w.h >= p.heads_q) return;
          w.b = 0;
        }
        const QueryBlock qb = p.blocks[w.b];
        w.si = w.seg_end = 0;
        if (!block_rows_in_range(qb, p.q_rows, p.error_flag)) continue;
        w.q_begin = qb.q_begin;
        w.q_end = qb.q_end;
        w.si = qb.seg_begin - 1;
        w.seg_end = qb.seg_end;
        continue;
      }
      const KeySegment seg = p.segments[w.si];
      if (!Cfg::kHasBand && !segment_is_full(seg)) {
        report(p.error_flag, kErrorBandInFullOnlyVariant);
        continue;
      }
      if (seg.k_begin < 0 || seg.k_end > p.k_rows) {
        report(p.error_flag, kErrorRowsOutOfRange);
        continue;
      }
      const long long ka = max64(kt0, seg.k_begin), kb = min64(kt1, seg.k_end);
      if (ka >= kb) continue;
      // Query rows q that see a key k of [ka, kb): k - diag_hi <= q <= k - diag_lo.
      long long qa = w.q_begin, qz = w.q_end;
      if (seg.diag_hi < kNoDiagLimit) qa = max64(qa, ka - seg.diag_hi);
      if (seg.diag_lo > -kNoDiagLimit) qz = min64(qz, kb - seg.diag_lo);
      if (qa >= qz) continue;
      w.ka = ka;
      w.kb = kb;
      w.diag_lo = seg.diag_lo;
      w.diag_hi = seg.diag_hi;
      w.q0 = qa;
      w.q_hi = qz;
      break;
    }
  }
  t->q0 = w.q0;
  t->k0 = kt0;
  t->h = w.h;
  t->rows = static_cast<int>(min64(kBM, w.q_hi - w.q0));
  t->key_lo = static_cast<int>(w.ka - kt0);
  t->key_hi = static_cast<int>(w.kb - kt0);
  t->rel_lo = mma_rel_lo(w.diag_lo, kt0 - w.q0);
  t->rel_hi = mma_rel_hi(w.diag_hi, kt0 - w.q0);
  t->valid = 1;
}

// A key item's query tile t into stage st: its Q and dO rows and the rows' lse and delta
// ([stage][lse, delta][kBM]; rows past t.rows: 0), all by cp.async, not committed.
template <class Cfg>
HSAP_DEV void mma_bwd_issue_stage(const BwdParams& p, typename Cfg::T* stages, float* stats, int st,
                                  const MmaTile& t) {
  using S = MmaBwdShape<Cfg>;
  using T = typename Cfg::T;
  constexpr int kD = S::kD, kBM = S::kBM, kLd = S::kLd, kThreads = S::kThreads;
  constexpr int kStage = 2 * kBM * kLd;
  T* q_tile = stages + st * kStage;
  cp_async_rows_pair<kBM, kD, kLd, kThreads, kBM * kLd>(q_tile, p.q, p.dout, t.q0, t.rows,
                                                       p.heads_q, t.h);
  // lse (natural units: mma_bwd_probs_t converts) and delta of the tile's rows, copied with
  // the stage's group rather than loaded and stored: no thread waits for them here. Rows past
  // t.rows are zero-filled; mma_bwd_probs_t masks them (qc < rows).
  float* st_stats = stats + st * 2 * kBM;
  for (int r = threadIdx.x; r < kBM; r += kThreads) {
    const bool valid = r < t.rows;
    const long long stat = static_cast<long long>(t.h) * p.q_rows + (t.q0 + (valid ? r : 0));
    cp_async_4_zfill(st_stats + r, p.lse + stat, valid);
    cp_async_4_zfill(st_stats + kBM + r, p.delta + stat, valid);
  }
}

// P^T and dS^T of a key item's tile, computed in place from S^T (s) and dP^T (dp) of this
// warp's 16 keys (key group kg), masked per element (keys: rows of the C fragment). `cur` is
// taken by value: by reference, ptxas allocated the D = 64 sm_90 backward 25 registers fewer
// than the code inline, which changes its occupancy.
template <class S>
HSAP_DEV void mma_bwd_probs_t(float (&s)[S::kBM / 8][4], float (&dp)[S::kBM / 8][4],
                              const float* lse_s, const float* delta_s, const MmaTile cur,
                              const BwdParams& p, int kg, int g, int t4) {
  constexpr int kQT = S::kBM / 8;
  HSAP_UNROLL
  for (int j = 0; j < kQT; ++j) {
    HSAP_UNROLL
    for (int e = 0; e < 4; ++e) {
      const int kc = 16 * kg + g + 8 * (e >> 1);
      const int qc = 8 * j + 2 * t4 + (e & 1);
      const float row_lse = lse_s[qc] * kLog2E;  // log2 units
      const bool visible = kc >= cur.key_lo && kc < cur.key_hi && qc < cur.rows &&
                           kc - qc >= cur.rel_lo && kc - qc <= cur.rel_hi && row_lse != neg_inf();
      const float prob = visible ? prob_from_log2(s[j][e], p.scale * kLog2E, row_lse) : 0.0f;
      dp[j][e] = visible ? prob * (dp[j][e] - delta_s[qc]) : 0.0f;
      s[j][e] = prob;
    }
  }
}

// Atomic dq: dS^T (dp) of the tile to shared memory (dsT), then dq += dS K by rows of the
// query tile, added atomically. Every thread of the CTA calls it (a barrier inside).
template <class Cfg>
HSAP_DEV void mma_bwd_atomic_dq(const BwdParams& p, const float (&dp)[MmaBwdShape<Cfg>::kBM / 8][4],
                                typename Cfg::T* dsT, const typename Cfg::T* Ks, const MmaTile& cur,
                                int warp, int kg, int dh, int g, int t4, int lane) {
  using S = MmaBwdShape<Cfg>;
  using T = typename Cfg::T;
  constexpr int kD = S::kD, kBN = S::kBN, kLd = S::kLd, kSLd = S::kSLd;
  constexpr int kQT = S::kBM / 8;
  if (dh == 0) {
    HSAP_UNROLL
    for (int j = 0; j < kQT; ++j) {
      T* row = dsT + (16 * kg + g) * kSLd + 8 * j + 2 * t4;
      *reinterpret_cast<unsigned*>(row) = MmaOps<T>::pack(dp[j][0], dp[j][1]);
      *reinterpret_cast<unsigned*>(row + 8 * kSLd) = MmaOps<T>::pack(dp[j][2], dp[j][3]);
    }
  }
  __syncthreads();
  const int rg = warp % S::kRowGroups, part = warp / S::kRowGroups;
  constexpr int kCT = S::kDQChunkTiles;
  const int c_end =
      S::kDqParts == S::kWarpsPerRowGroup || part < S::kDqParts ? (part + 1) * S::kDQW : 0;
  HSAP_UNROLL_N(1)
  for (int c0 = part * S::kDQW; c0 < c_end; c0 += 8 * kCT) {
    float acc[kCT][4];
    zero_acc(acc);
    HSAP_UNROLL
    for (int kk = 0; kk < kBN / 16; ++kk) {
      unsigned a[4];
      load_a_transposed<T, kSLd>(a, dsT, 16 * rg, 16 * kk, lane);
      mma_b_cols<T, kCT, kLd>(acc, a, Ks, 16 * kk, c0, lane);
    }
    HSAP_UNROLL
    for (int n = 0; n < kCT; ++n) {
      HSAP_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int r = 16 * rg + g + 8 * (e >> 1);
        if (r < cur.rows && acc[n][e] != 0.0f) {
          const long long idx = ((cur.q0 + r) * p.heads_q + cur.h) * static_cast<long long>(kD) +
                                c0 + 8 * n + 2 * t4 + (e & 1);
          atomicAdd(p.dq + idx, acc[n][e] * p.scale);
        }
      }
    }
  }
}

// Key item: dK, dV of key rows [kt0, kt1) (tile kt) of kv head kvh; with atomic dq, also the
// dq contributions of these keys.
template <class Cfg>
__device__ void mma_bwd_key_item(const BwdParams& p, int kvh, long long kt0, long long kt1,
                                 unsigned char* smem) {
  using S = MmaBwdShape<Cfg>;
  using T = typename Cfg::T;
  constexpr int kD = S::kD, kBM = S::kBM, kBN = S::kBN, kLd = S::kLd;
  constexpr int kDW = S::kDW, kThreads = S::kThreads;
  constexpr int kQT = kBM / 8;           // n-tiles of S^T (query columns)
  constexpr int kDT = kDW / 8;           // n-tiles of dK/dV (head-dim columns)
  constexpr int kStage = 2 * kBM * kLd;  // Q then dO of one stage (elements)
  MmaKeyWalk* walk = reinterpret_cast<MmaKeyWalk*>(smem);
  MmaTile* shared_tile = reinterpret_cast<MmaTile*>(smem + sizeof(MmaKeyWalk));
  T* Ks = reinterpret_cast<T*>(smem + S::kCtrlBytes);
  T* Vs = Ks + kBN * kLd;
  T* stages = Vs + kBN * kLd;  // stage st: Q at stages + st * kStage, dO kBM rows later
  float* stats = reinterpret_cast<float*>(stages + 2 * kStage);  // [stage][lse, delta][kBM]
  T* dsT = reinterpret_cast<T*>(stats + 4 * kBM);                // [kBN][kSLd], atomic dq only

  if (threadIdx.x == 0) {
    start_key_walk<Cfg>(*walk, p);
    next_key_tile<Cfg>(*walk, p, kvh, kt0, kt1, shared_tile);
  }
  __syncthreads();
  MmaTile cur = *shared_tile;
  if (!cur.valid) {
    __syncthreads();  // everyone has read the tile before thread 0 starts the next item
    return;           // no query sees these keys
  }

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane >> 2, t4 = lane & 3;
  const int kg = warp % S::kKeyGroups, dh = warp / S::kKeyGroups;

  cp_async_rows_pair<kBN, kD, kLd, kThreads, kBN * kLd>(Ks, p.k, p.v, kt0,
                                                       static_cast<int>(kt1 - kt0), p.heads_kv, kvh);
  mma_bwd_issue_stage<Cfg>(p, stages, stats, 0, cur);
  cp_async_commit();

  float dk[kDT][4], dv[kDT][4];
  zero_acc(dk);
  zero_acc(dv);
  for (int st = 0;; st ^= 1) {
    // Thread 0 finds the next tile while the others wait; everyone prefetches it.
    __syncthreads();  // (also: every warp is done with stage st ^ 1 and dS^T)
    if (threadIdx.x == 0) next_key_tile<Cfg>(*walk, p, kvh, kt0, kt1, shared_tile);
    __syncthreads();
    const MmaTile nxt = *shared_tile;
    if (nxt.valid) mma_bwd_issue_stage<Cfg>(p, stages, stats, st ^ 1, nxt);
    cp_async_commit();
    cp_async_wait<1>();  // K, V and stage st have landed (stage st ^ 1 may be in flight)
    __syncthreads();

    const T* Qs = stages + st * kStage;
    const T* dOs = Qs + kBM * kLd;
    const float* lse_s = stats + st * 2 * kBM;
    const float* delta_s = lse_s + kBM;
    // S^T and dP^T of this warp's 16 keys against the kBM queries of the tile.
    float s[kQT][4], dp[kQT][4];
    zero_acc(s);
    zero_acc(dp);
    HSAP_UNROLL_N(1)
    for (int kk = 0; kk < kD / 16; ++kk) {
      unsigned a[4];
      load_a<T, kLd>(a, Ks, 16 * kg, 16 * kk, lane);
      mma_b_rows<T, kQT, kLd>(s, a, Qs, 0, 16 * kk, lane);
      load_a<T, kLd>(a, Vs, 16 * kg, 16 * kk, lane);
      mma_b_rows<T, kQT, kLd>(dp, a, dOs, 0, 16 * kk, lane);
    }
    mma_bwd_probs_t<S>(s, dp, lse_s, delta_s, cur, p, kg, g, t4);
    // dV += P^T dO, dK += dS^T Q over the tile's queries (k = query).
    HSAP_UNROLL
    for (int kk = 0; kk < kBM / 16; ++kk) {
      unsigned a[4];
      accumulators_as_a<T, kQT>(a, s, kk);
      mma_b_cols<T, kDT, kLd>(dv, a, dOs, 16 * kk, dh * kDW, lane);
      accumulators_as_a<T, kQT>(a, dp, kk);
      mma_b_cols<T, kDT, kLd>(dk, a, Qs, 16 * kk, dh * kDW, lane);
    }
    if constexpr (!Cfg::kDeterministicDq) {
      mma_bwd_atomic_dq<Cfg>(p, dp, dsT, Ks, cur, warp, kg, dh, g, t4, lane);
    }
    if (!nxt.valid) break;
    cur = nxt;
  }
  cp_async_wait<0>();

  // One writer per (key row, kv head): plain adds, deterministic.
  HSAP_UNROLL
  for (int n = 0; n < kDT; ++n) {
    HSAP_UNROLL
    for (int e = 0; e < 4; ++e) {
      const long long kr = kt0 + 16 * kg + g + 8 * (e >> 1);
      if (kr < kt1) {
        const long long idx = (kr * p.heads_kv + kvh) * static_cast<long long>(kD) + dh * kDW +
                              8 * n + 2 * t4 + (e & 1);
        p.dk[idx] += dk[n][e] * p.scale;
        p.dv[idx] += dv[n][e];
      }
    }
  }
  __syncthreads();  // shared memory is reused by the next item
}

// The walk of a query item's chunk over its key tiles (shared memory, thread 0 only):
// the block's segments in order, kBN keys at a time from each visible range.
struct MmaQueryWalk {
  long long si, k0, k_hi;
  long long diag_lo, diag_hi;
};

// Advances w to the next key tile (kBN keys: the dq pass's by default) of query rows
// [q0, q0 + rows) of block qb and describes it in *t. Thread 0 only.
template <class Cfg, int kBN = MmaBwdShape<Cfg>::kDqBN>
HSAP_DEV void next_query_tile(MmaQueryWalk& w, const BwdParams& p, const QueryBlock& qb,
                              long long q0, int rows, MmaTile* t) {
  t->valid = 0;
  if (w.k0 + kBN < w.k_hi) {
    w.k0 += kBN;
  } else {
    for (++w.si;; ++w.si) {
      if (w.si >= qb.seg_end) return;
      const KeySegment seg = p.segments[w.si];
      if (!Cfg::kHasBand && !segment_is_full(seg)) {
        report(p.error_flag, kErrorBandInFullOnlyVariant);
        continue;
      }
      if (seg.k_begin < 0 || seg.k_end > p.k_rows) {
        report(p.error_flag, kErrorRowsOutOfRange);
        continue;
      }
      long long k_lo, k_hi;
      visible_keys(seg, q0, rows, &k_lo, &k_hi);
      if (k_lo >= k_hi) continue;
      w.k0 = k_lo;
      w.k_hi = k_hi;
      w.diag_lo = seg.diag_lo;
      w.diag_hi = seg.diag_hi;
      break;
    }
  }
  t->q0 = q0;
  t->k0 = w.k0;
  t->rows = rows;
  t->key_lo = 0;
  t->key_hi = static_cast<int>(min64(kBN, w.k_hi - w.k0));
  t->rel_lo = mma_rel_lo(w.diag_lo, w.k0 - q0);
  t->rel_hi = mma_rel_hi(w.diag_hi, w.k0 - q0);
  t->valid = 1;
}

// Query item (deterministic dq): dq of block b of query head h, in kQM-row chunks, over the
// block's segments and their key tiles in order.
template <class Cfg>
__device__ void mma_bwd_query_item(const BwdParams& p, int b, int h, unsigned char* smem) {
  using S = MmaBwdShape<Cfg>;
  using T = typename Cfg::T;
  constexpr int kD = S::kD, kBN = S::kDqBN, kLd = S::kLd, kQM = S::kQM, kThreads = S::kThreads;
  constexpr int kKT = kBN / 8;           // n-tiles of S (key columns)
  constexpr int kDT = S::kDqW / 8;       // n-tiles of this warp's dQ columns
  constexpr int kStage = 2 * kBN * kLd;  // K then V of one stage (elements)
  const int kvh = kv_head<Cfg>(p.kv_head_of_q, p.heads_q, p.heads_kv, h, p.error_flag);
  if (kvh < 0) return;
  const QueryBlock qb = p.blocks[b];
  if (!block_rows_in_range(qb, p.q_rows, p.error_flag)) return;
  MmaQueryWalk* walk = reinterpret_cast<MmaQueryWalk*>(smem);
  MmaTile* shared_tile = reinterpret_cast<MmaTile*>(smem + sizeof(MmaKeyWalk));
  T* Qs = reinterpret_cast<T*>(smem + S::kCtrlBytes);
  T* dOs = Qs + kQM * kLd;
  T* stages = dOs + kQM * kLd;  // stage st: K at stages + st * kStage, V kBN rows later

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane >> 2, t4 = lane & 3;
  // This warp's 16 query rows (row group) and dQ columns (part of D).
  const int rg = warp % S::kDqRowGroups, col0 = (warp / S::kDqRowGroups) * S::kDqW;

  for (long long q0 = qb.q_begin; q0 < qb.q_end; q0 += kQM) {
    const int rows = static_cast<int>(min64(kQM, qb.q_end - q0));
    // The two query rows of this thread's accumulator fragments: 16 rg + g (+ 8).
    float row_lse[2], row_delta[2];
    load_row_stats(p, h, q0, rows, 16 * rg + g, row_lse, row_delta);
    auto issue = [&](int st, const MmaTile& t) {
      T* k_tile = stages + st * kStage;
      cp_async_rows_pair<kBN, kD, kLd, kThreads, kBN * kLd>(k_tile, p.k, p.v, t.k0, t.key_hi,
                                                           p.heads_kv, kvh);
    };
    if (threadIdx.x == 0) {
      walk->si = qb.seg_begin - 1;
      walk->k0 = walk->k_hi = 0;
      next_query_tile<Cfg>(*walk, p, qb, q0, rows, shared_tile);
    }
    __syncthreads();
    MmaTile cur = *shared_tile;
    cp_async_rows_pair<kQM, kD, kLd, kThreads, kQM * kLd>(Qs, p.q, p.dout, q0, rows, p.heads_q,
                                                         h);  // dOs = Qs + kQM * kLd
    if (cur.valid) issue(0, cur);
    cp_async_commit();  // Q, dO (and the first K, V)

    float dq[kDT][4];
    zero_acc(dq);
    for (int st = 0; cur.valid; st ^= 1) {
      __syncthreads();  // everyone read the tile; every warp is done with stage st ^ 1
      if (threadIdx.x == 0) next_query_tile<Cfg>(*walk, p, qb, q0, rows, shared_tile);
      __syncthreads();
      const MmaTile nxt = *shared_tile;
      if (nxt.valid) issue(st ^ 1, nxt);
      cp_async_commit();
      cp_async_wait<1>();
      __syncthreads();

      const T* Ks = stages + st * kStage;
      const T* Vs = Ks + kBN * kLd;
      float s[kKT][4], dp[kKT][4];
      zero_acc(s);
      zero_acc(dp);
      HSAP_UNROLL_N(1)
      for (int kk = 0; kk < kD / 16; ++kk) {
        unsigned a[4];
        load_a<T, kLd>(a, Qs, 16 * rg, 16 * kk, lane);
        mma_b_rows<T, kKT, kLd>(s, a, Ks, 0, 16 * kk, lane);
        load_a<T, kLd>(a, dOs, 16 * rg, 16 * kk, lane);
        mma_b_rows<T, kKT, kLd>(dp, a, Vs, 0, 16 * kk, lane);
      }
      HSAP_UNROLL
      for (int j = 0; j < kKT; ++j) {
        HSAP_UNROLL
        for (int e = 0; e < 4; ++e) {
          const int r = 16 * rg + g + 8 * (e >> 1);
          const int c = 8 * j + 2 * t4 + (e & 1);
          const float lse_r = row_lse[e >> 1];
          const bool visible = r < rows && c < cur.key_hi && c - r >= cur.rel_lo &&
                               c - r <= cur.rel_hi && lse_r != neg_inf();
          const float prob = visible ? prob_from_log2(s[j][e], p.scale * kLog2E, lse_r) : 0.0f;
          dp[j][e] = visible ? prob * (dp[j][e] - row_delta[e >> 1]) : 0.0f;
        }
      }
      // dQ += dS K (k = key).
      HSAP_UNROLL
      for (int kk = 0; kk < kBN / 16; ++kk) {
        unsigned a[4];
        accumulators_as_a<T, kKT>(a, dp, kk);
        mma_b_cols<T, kDT, kLd>(dq, a, Ks, 16 * kk, col0, lane);
      }
      cur = nxt;
    }
    cp_async_wait<0>();
    HSAP_UNROLL
    for (int n = 0; n < kDT; ++n) {
      HSAP_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int r = 16 * rg + g + 8 * (e >> 1);
        if (r < rows) {
          float* out = p.dq + ((q0 + r) * p.heads_q + h) * static_cast<long long>(kD) + col0;
          out[8 * n + 2 * t4 + (e & 1)] += dq[n][e] * p.scale;
        }
      }
    }
    __syncthreads();  // Q, dO, K, V and the walk are reused by the next chunk or item
  }
}

// The tensor-core backward (see the top of this file). Any grid: CTAs take the key items
// (key tile, kv head) and, with kDeterministicDq, the query items (block, query head) in a
// grid-stride loop. At least 2 CTAs per SM: the register budget of the top of this file.
template <class Cfg>
__global__ void __launch_bounds__(Cfg::kBwdThreads, 2) attn_bwd_mma_kernel(const BwdParams p) {
  using S = MmaBwdShape<Cfg>;
  static_assert(Cfg::kBwdSmemBytes == S::kSmemBytes,
                "hsap: generator and device disagree on the mma backward shared memory size");
  static_assert(sizeof(MmaKeyWalk) + sizeof(MmaTile) <= S::kCtrlBytes &&
                    sizeof(MmaQueryWalk) <= sizeof(MmaKeyWalk),
                "hsap: the shared walk state outgrew its shared memory");
  unsigned char* smem = reinterpret_cast<unsigned char*>(dynamic_smem());
  if (!tensors_aligned16(p.error_flag, p.q, p.k, p.v, p.dout)) return;  // uniform
  const long long key_tiles = (p.k_rows + S::kBN - 1) / S::kBN;
  const long long key_items = key_tiles * p.heads_kv;
  const long long query_items =
      Cfg::kDeterministicDq ? static_cast<long long>(p.num_blocks) * p.heads_q : 0;
  // The walk's only register across the items is the 32-bit step count; item is rebuilt from
  // blockIdx and gridDim (special and constant registers) each step.
  for (unsigned int step = 0;; ++step) {
    const long long item = static_cast<long long>(blockIdx.y) * gridDim.x + blockIdx.x +
                           static_cast<long long>(step) * gridDim.x * gridDim.y;
    if (item >= key_items + query_items) break;
    // item = kvh * key_tiles + kt, then key_items + h * num_blocks + b: split by subtraction
    // (at most heads_kv, heads_q steps), since a 64-bit division is a call to a division
    // routine around which ptxas keeps live registers in local memory (reported as spills).
    if (item < key_items) {
      long long kt = item;
      int kvh = 0;
      while (kt >= key_tiles) {
        kt -= key_tiles;
        ++kvh;
      }
      mma_bwd_key_item<Cfg>(p, kvh, kt * S::kBN, min64((kt + 1) * S::kBN, p.k_rows), smem);
    } else {
      long long b = item - key_items;
      int h = 0;
      while (b >= p.num_blocks) {
        b -= p.num_blocks;
        ++h;
      }
      mma_bwd_query_item<Cfg>(p, static_cast<int>(b), h, smem);
    }
  }
}

}  // namespace hsap_dev

#endif  // defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(HSAP_DEVICE_EMULATION)
#endif  // HSAP_JIT_DEVICE_HSAP_ATTENTION_MMA_BWD_CUH_
