// The attention kernels, as templates over a configuration struct emitted by
// jit/codegen_cuda (compile-time tile shapes, dtype, head dim, GQA ratio, mask kinds and
// topology role); sequence lengths, offsets and work lists arrive at run time in the Params
// of hsap_params.cuh, passed by value.
//
// The arithmetic is deliberately plain (fp32 FMA loops over fp32 shared-memory tiles, one
// query row per group of kTPR adjacent lanes), so that it can be checked by reading:
//   - a CTA holds kBM query rows; thread t owns row r = t / kTPR and the head-dim columns
//     d = t % kTPR + j * kTPR of that row's accumulator, and the key columns
//     c = t % kTPR + j * kTPR of that row's score tile;
//   - row reductions (max, sum) are shuffles within the kTPR lanes of a row (same warp);
//   - shared-memory rows are padded by one float (kLd = D + 1) so the 32/kTPR distinct
//     rows read by a warp fall into distinct banks.
//
// Required members of Cfg:
//   using T;                       float, hsap_dev::bf16 or hsap_dev::f16
//   kHeadDim, kGqa                 head dim (multiple of 8 in [32, 256]), heads_q / heads_kv
//   kTensorCore                    the math (jit/codegen_cuda.h CudaMath): true selects the
//                                  mma kernels of hsap_attention_mma_*.cuh
//   kBlockM, kBlockN, kThreads     forward tile (query rows, key rows) and CTA size
//   kBwdBlockM, kBwdBlockN, kBwdThreads   backward tile and CTA size
//   kHasBand                       false: only full segments (no causal/window band)
//   kMaxSteps                      fused forward: steps per launch (0: not generated)
//   kFwdStages, kQInRegisters      tensor-core forward: cp.async K/V stages, Q held in registers
//   kFwdSmemBytes, kBwdSmemBytes   dynamic shared memory (checked against the formulas)
#ifndef HSAP_JIT_DEVICE_HSAP_ATTENTION_CUH_
#define HSAP_JIT_DEVICE_HSAP_ATTENTION_CUH_

#if defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(HSAP_DEVICE_EMULATION)

#include "hsap_attention_mma_fwd.cuh"
#include "hsap_device.cuh"
#include "hsap_params.cuh"
#include "hsap_sync.cuh"
#include "hsap_worklist.cuh"

namespace hsap_dev {

template <int kD_, int kBM_, int kBN_, int kThreads_>
struct TileShape {
  static constexpr int kD = kD_, kBM = kBM_, kBN = kBN_, kThreads = kThreads_;
  static constexpr int kTPR = kThreads / kBM;  // threads per query row
  static constexpr int kLd = kD + 1;           // padded K/V/Q row (floats)
  static constexpr int kPLd = kBN + 1;         // padded P row (floats)
  static constexpr int kDT = kD / kTPR;        // accumulator columns per thread
  static constexpr int kNT = kBN / kTPR;       // score columns per thread
  // Dynamic shared memory: forward Q, K, V tiles and the P tile; backward Q, dO, K, V tiles
  // and the P and dS tiles (jit/codegen_cuda.cc computes the same numbers).
  static constexpr int kFwdSmemBytes = 4 * ((kBM + 2 * kBN) * kLd + kBM * kPLd);
  static constexpr int kBwdSmemBytes = 4 * ((2 * kBM + 2 * kBN) * kLd + 2 * kBM * kPLd);
  static_assert(kD >= 32 && kD <= 256 && kD % 8 == 0,
                "hsap: unsupported head dim (must be a multiple of 8 in [32, 256])");
  static_assert(kThreads % kBM == 0 && kTPR >= 1 && kTPR <= 32 && (kTPR & (kTPR - 1)) == 0,
                "hsap: threads per row must be a power of two <= 32");
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "hsap: CTA size");
  static_assert(kD % kTPR == 0 && kBN % kTPR == 0, "hsap: tile not divisible among row threads");
};

template <class Cfg>
using FwdShape = TileShape<Cfg::kHeadDim, Cfg::kBlockM, Cfg::kBlockN, Cfg::kThreads>;
template <class Cfg>
using BwdShape = TileShape<Cfg::kHeadDim, Cfg::kBwdBlockM, Cfg::kBwdBlockN, Cfg::kBwdThreads>;

// rows x kD elements of head `head` of a [rows, heads, kD] tensor starting at row `row0`
// into dst (kLd-strided floats); rows [valid, kRows) are zero-filled.
template <typename T, int kRows, int kD, int kLd, int kThreads, bool kCoherent>
HSAP_DEV void load_tile(float* dst, const void* src, long long row0, int valid, int heads,
                        int head) {
  for (int i = threadIdx.x; i < kRows * kD; i += kThreads) {
    const int rr = i / kD, d = i % kD;
    float x = 0.0f;
    if (rr < valid) {
      const long long idx = ((row0 + rr) * heads + head) * static_cast<long long>(kD) + d;
      x = kCoherent ? load_float_cg<T>(src, idx) : load_float<T>(src, idx);
    }
    dst[rr * kLd + d] = x;
  }
}

// One key tile of the FMA forward, its K/V in Ks/Vs: row r's scores against the tile's
// columns c_j = tc + j * kTPR (visible: row < rows, column < cols, inside the band when
// `masked`), the online softmax update (P through Ps), and acc += P V. saw_key and
// non_finite note a visible key and a NaN or +inf score.
template <class Cfg>
HSAP_DEV void fma_fwd_tile(const float* Qs, const float* Ks, const float* Vs, float* Ps,
                           float (&acc)[FwdShape<Cfg>::kDT], OnlineSoftmax& sm, bool& saw_key,
                           bool& non_finite, const KeySegment& seg, bool masked, long long q0,
                           int rows, long long k0, int cols, int r, int tc, float scale_log2) {
  using S = FwdShape<Cfg>;
  constexpr int kD = S::kD, kBN = S::kBN, kTPR = S::kTPR, kLd = S::kLd, kPLd = S::kPLd;
  // Scores of row r against key columns c_j = tc + j * kTPR.
  float x[S::kNT];
  HSAP_UNROLL
  for (int j = 0; j < S::kNT; ++j) x[j] = 0.0f;
  HSAP_UNROLL_N(4)
  for (int kk = 0; kk < kD; ++kk) {
    const float qv = Qs[r * kLd + kk];
    HSAP_UNROLL
    for (int j = 0; j < S::kNT; ++j) x[j] += qv * Ks[(tc + j * kTPR) * kLd + kk];
  }
  float tile_max = neg_inf();
  HSAP_UNROLL
  for (int j = 0; j < S::kNT; ++j) {
    const int c = tc + j * kTPR;
    bool visible = r < rows && c < cols;
    if (masked && visible) {
      const long long diag = (k0 + c) - (q0 + r);
      visible = diag >= seg.diag_lo && diag <= seg.diag_hi;
    }
    x[j] = visible ? x[j] * scale_log2 : neg_inf();
    saw_key = saw_key || visible;
    non_finite = non_finite || !(x[j] < pos_inf());  // NaN or +inf
    tile_max = fmaxf(tile_max, x[j]);
  }
  tile_max = group_max<kTPR>(tile_max);
  const float rescale = sm.begin_tile(tile_max);
  float tile_sum = 0.0f;
  HSAP_UNROLL
  for (int j = 0; j < S::kNT; ++j) {
    const float p = sm.weight(x[j]);
    tile_sum += p;
    Ps[r * kPLd + tc + j * kTPR] = p;
  }
  sm.end_tile(group_sum<kTPR>(tile_sum));
  __syncwarp();  // the row's P entries come from the kTPR lanes of this warp

  HSAP_UNROLL
  for (int j = 0; j < S::kDT; ++j) acc[j] *= rescale;
  for (int c = 0; c < kBN; ++c) {  // P and V are 0 beyond `cols`
    const float p = Ps[r * kPLd + c];
    HSAP_UNROLL
    for (int j = 0; j < S::kDT; ++j) acc[j] += p * Vs[c * kLd + tc + j * kTPR];
  }
}

// Merges the partial result of a chunk (row r of the chunk at q0: acc, sm) into out/lse; a
// NaN partial makes the row NaN.
template <class Cfg>
HSAP_DEV void fma_fwd_merge(const float (&acc)[FwdShape<Cfg>::kDT], const OnlineSoftmax& sm,
                            bool saw_key, bool non_finite, float* out, float* lse, long long q_rows,
                            int heads_q, int h, long long q0, int rows, int r, int tc) {
  using S = FwdShape<Cfg>;
  constexpr int kD = S::kD, kTPR = S::kTPR;
  const bool row_saw_key = group_max<kTPR>(saw_key ? 1.0f : 0.0f) > 0.0f;
  const bool row_is_nan =
      group_max<kTPR>(non_finite ? 1.0f : 0.0f) > 0.0f || (row_saw_key && sm.lse() == neg_inf());
  const float lse2 = row_is_nan ? quiet_nan() : sm.lse();
  const float inv_l = row_is_nan ? lse2 : sm.inv_l();
  float* lse_ptr = lse + static_cast<long long>(h) * q_rows + (q0 + r);
  LseMerge merged{0.0f, 1.0f, 0.0f};
  if (r < rows) {
    merged = merge_lse(*lse_ptr, lse2);
    if (lse2 != neg_inf()) {
      float* o = out + ((q0 + r) * heads_q + h) * static_cast<long long>(kD);
      HSAP_UNROLL
      for (int j = 0; j < S::kDT; ++j) {
        const int d = tc + j * kTPR;
        o[d] = merged.w1 * o[d] + merged.w2 * (acc[j] * inv_l);
      }
    }
  }
  __syncwarp();  // every lane of the row has read the old lse
  if (r < rows && tc == 0 && lse2 != neg_inf()) *lse_ptr = merged.lse;
}

// ---------------------------------------------------------------------------------------
// Forward over one query block of one head: online softmax over the block's segments, then
// the merge of the partial (o, lse) into out/lse. kStaged: K/V were written by other CTAs of
// this kernel (fused path), so they are read with ld.global.cg.
template <class Cfg, bool kStaged>
__device__ void attend_block_fwd_fma(float* smem, const void* q, const void* k, const void* v,
                                     float* out, float* lse, long long q_rows, long long k_rows,
                                     int heads_q, int heads_kv, int h, int kvh, float scale,
                                     const QueryBlock qb, const KeySegment* segments,
                                     unsigned int* error_flag) {
  using S = FwdShape<Cfg>;
  using T = typename Cfg::T;
  constexpr int kD = S::kD, kBM = S::kBM, kBN = S::kBN, kTPR = S::kTPR, kLd = S::kLd;
  float* Qs = smem;
  float* Ks = Qs + kBM * kLd;
  float* Vs = Ks + kBN * kLd;
  float* Ps = Vs + kBN * kLd;
  const int r = threadIdx.x / kTPR;
  const int tc = threadIdx.x % kTPR;
  const float scale_log2 = scale * kLog2E;

  if (!block_rows_in_range(qb, q_rows, error_flag)) return;  // uniform over the CTA
  for (long long q0 = qb.q_begin; q0 < qb.q_end; q0 += kBM) {
    const int rows = static_cast<int>(min64(kBM, qb.q_end - q0));
    __syncthreads();  // the previous chunk is done with Qs
    load_tile<T, kBM, kD, kLd, S::kThreads, false>(Qs, q, q0, rows, heads_q, h);

    OnlineSoftmax sm;
    sm.init();
    // A naive softmax gives NaN for a row with a NaN or +inf score (inf - inf) or whose
    // visible scores are all -inf; m and l cannot show that, so each lane notes it.
    bool saw_key = false, non_finite = false;
    float acc[S::kDT];
    HSAP_UNROLL
    for (int j = 0; j < S::kDT; ++j) acc[j] = 0.0f;

    for (long long si = qb.seg_begin; si < qb.seg_end; ++si) {
      const KeySegment seg = segments[si];
      const bool full = segment_is_full(seg);
      if (!Cfg::kHasBand && !full) {
        report(error_flag, kErrorBandInFullOnlyVariant);
        continue;
      }
      if (seg.k_begin < 0 || seg.k_end > k_rows) {
        report(error_flag, kErrorRowsOutOfRange);
        continue;
      }
      long long k_lo, k_hi;
      visible_keys(seg, q0, rows, &k_lo, &k_hi);
      for (long long k0 = k_lo; k0 < k_hi; k0 += kBN) {
        const int cols = static_cast<int>(min64(kBN, k_hi - k0));
        __syncthreads();  // everyone is done with the previous Ks/Vs/Ps (and Qs is written)
        load_tile<T, kBN, kD, kLd, S::kThreads, kStaged>(Ks, k, k0, cols, heads_kv, kvh);
        load_tile<T, kBN, kD, kLd, S::kThreads, kStaged>(Vs, v, k0, cols, heads_kv, kvh);
        __syncthreads();
        const bool masked = Cfg::kHasBand && !full && !tile_inside_band(seg, q0, rows, k0, cols);
        fma_fwd_tile<Cfg>(Qs, Ks, Vs, Ps, acc, sm, saw_key, non_finite, seg, masked, q0, rows, k0,
                          cols, r, tc, scale_log2);
      }
    }
    fma_fwd_merge<Cfg>(acc, sm, saw_key, non_finite, out, lse, q_rows, heads_q, h, q0, rows, r, tc);
  }
}

// The forward core of Cfg's math: tensor cores (hsap_attention_mma_fwd.cuh) or FMA loops.
// Both the "fwd" and the "fused_fwd" kernel call it.
template <class Cfg, bool kStaged>
__device__ void attend_block_fwd(float* smem, const void* q, const void* k, const void* v,
                                 float* out, float* lse, long long q_rows, long long k_rows,
                                 int heads_q, int heads_kv, int h, int kvh, float scale,
                                 const QueryBlock qb, const KeySegment* segments,
                                 unsigned int* error_flag) {
  if constexpr (Cfg::kTensorCore) {
    attend_block_fwd_mma<Cfg, kStaged>(smem, q, k, v, out, lse, q_rows, k_rows, heads_q, heads_kv,
                                       h, kvh, scale, qb, segments, error_flag);
  } else {
    attend_block_fwd_fma<Cfg, kStaged>(smem, q, k, v, out, lse, q_rows, k_rows, heads_q, heads_kv,
                                       h, kvh, scale, qb, segments, error_flag);
  }
}

// The forward's dynamic shared memory by the device-side formula of Cfg's math.
template <class Cfg, bool kTensorCore = Cfg::kTensorCore>
struct FwdSmem {
  static constexpr int kBytes = FwdShape<Cfg>::kFwdSmemBytes;
};
template <class Cfg>
struct FwdSmem<Cfg, true> {
  static constexpr int kBytes = MmaFwdShapeOf<Cfg>::kSmemBytes;
};

// The tensor-core forward declares the 2 CTAs per SM its tiles are sized for: without it
// ptxas squeezed some head dims' kernels to 128 or 168 registers for 3-4 CTAs and spilled
// (8-84 bytes at D = 80, 176, 192, plain and fused).
template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kTensorCore ? 2 : 1)
    attn_fwd_kernel(const FwdParams p) {
  static_assert(Cfg::kFwdSmemBytes == FwdSmem<Cfg>::kBytes,
                "hsap: generator and device disagree on the forward shared memory size");
  float* smem = dynamic_smem();
  if (static_cast<int>(blockIdx.x) >= p.num_blocks || static_cast<int>(blockIdx.y) >= p.heads_q)
    return;
  const int h = blockIdx.y;
  const int kvh = kv_head<Cfg>(p.kv_head_of_q, p.heads_q, p.heads_kv, h, p.error_flag);
  if (kvh < 0) return;
  attend_block_fwd<Cfg, false>(smem, p.q, p.k, p.v, p.out, p.lse, p.q_rows, p.k_rows, p.heads_q,
                               p.heads_kv, h, kvh, p.scale, p.blocks[blockIdx.x], p.segments,
                               p.error_flag);
}

// ---------------------------------------------------------------------------------------
// Backward over one query block of one head (see BwdParams).
template <class Cfg>
__global__ void __launch_bounds__(Cfg::kBwdThreads) attn_bwd_kernel(const BwdParams p) {
  using S = BwdShape<Cfg>;
  using T = typename Cfg::T;
  static_assert(Cfg::kBwdSmemBytes == S::kBwdSmemBytes,
                "hsap: generator and device disagree on the backward shared memory size");
  constexpr int kD = S::kD, kBM = S::kBM, kBN = S::kBN, kTPR = S::kTPR, kLd = S::kLd,
                kPLd = S::kPLd;
  float* Qs = dynamic_smem();
  float* dOs = Qs + kBM * kLd;
  float* Ks = dOs + kBM * kLd;
  float* Vs = Ks + kBN * kLd;
  float* Ps = Vs + kBN * kLd;
  float* dSs = Ps + kBM * kPLd;

  if (static_cast<int>(blockIdx.x) >= p.num_blocks || static_cast<int>(blockIdx.y) >= p.heads_q)
    return;
  const int h = blockIdx.y;
  const int kvh = kv_head<Cfg>(p.kv_head_of_q, p.heads_q, p.heads_kv, h, p.error_flag);
  if (kvh < 0) return;
  const QueryBlock qb = p.blocks[blockIdx.x];
  if (!block_rows_in_range(qb, p.q_rows, p.error_flag)) return;
  const int r = threadIdx.x / kTPR;
  const int tc = threadIdx.x % kTPR;

  for (long long q0 = qb.q_begin; q0 < qb.q_end; q0 += kBM) {
    const int rows = static_cast<int>(min64(kBM, qb.q_end - q0));
    __syncthreads();
    load_tile<T, kBM, kD, kLd, S::kThreads, false>(Qs, p.q, q0, rows, p.heads_q, h);
    load_tile<T, kBM, kD, kLd, S::kThreads, false>(dOs, p.dout, q0, rows, p.heads_q, h);
    const long long stat = static_cast<long long>(h) * p.q_rows + (q0 + r);
    const float row_lse = r < rows ? p.lse[stat] : neg_inf();
    const float row_delta = r < rows ? p.delta[stat] : 0.0f;
    float dq[S::kDT];
    HSAP_UNROLL
    for (int j = 0; j < S::kDT; ++j) dq[j] = 0.0f;

    for (long long si = qb.seg_begin; si < qb.seg_end; ++si) {
      const KeySegment seg = p.segments[si];
      const bool full = segment_is_full(seg);
      if (!Cfg::kHasBand && !full) {
        report(p.error_flag, kErrorBandInFullOnlyVariant);
        continue;
      }
      if (seg.k_begin < 0 || seg.k_end > p.k_rows) {
        report(p.error_flag, kErrorRowsOutOfRange);
        continue;
      }
      long long k_lo, k_hi;
      visible_keys(seg, q0, rows, &k_lo, &k_hi);
      for (long long k0 = k_lo; k0 < k_hi; k0 += kBN) {
        const int cols = static_cast<int>(min64(kBN, k_hi - k0));
        __syncthreads();  // everyone is done with the previous K/V/P/dS tiles
        load_tile<T, kBN, kD, kLd, S::kThreads, false>(Ks, p.k, k0, cols, p.heads_kv, kvh);
        load_tile<T, kBN, kD, kLd, S::kThreads, false>(Vs, p.v, k0, cols, p.heads_kv, kvh);
        __syncthreads();
        const bool masked = Cfg::kHasBand && !full && !tile_inside_band(seg, q0, rows, k0, cols);

        float s[S::kNT], dp[S::kNT];
        HSAP_UNROLL
        for (int j = 0; j < S::kNT; ++j) s[j] = dp[j] = 0.0f;
        HSAP_UNROLL_N(2)
        for (int kk = 0; kk < kD; ++kk) {
          const float qv = Qs[r * kLd + kk];
          const float gv = dOs[r * kLd + kk];
          HSAP_UNROLL
          for (int j = 0; j < S::kNT; ++j) {
            s[j] += qv * Ks[(tc + j * kTPR) * kLd + kk];
            dp[j] += gv * Vs[(tc + j * kTPR) * kLd + kk];
          }
        }
        HSAP_UNROLL
        for (int j = 0; j < S::kNT; ++j) {
          const int c = tc + j * kTPR;
          bool visible = r < rows && c < cols && row_lse != neg_inf();
          if (masked && visible) {
            const long long diag = (k0 + c) - (q0 + r);
            visible = diag >= seg.diag_lo && diag <= seg.diag_hi;
          }
          const float prob = visible ? expf(s[j] * p.scale - row_lse) : 0.0f;
          Ps[r * kPLd + c] = prob;
          dSs[r * kPLd + c] = prob * (dp[j] - row_delta);
        }
        __syncthreads();  // P and dS of all rows are needed below

        // dq (row r, own columns): sum_c dS[r, c] K[c, d].
        for (int c = 0; c < kBN; ++c) {
          const float ds = dSs[r * kPLd + c];
          HSAP_UNROLL
          for (int j = 0; j < S::kDT; ++j) dq[j] += ds * Ks[c * kLd + tc + j * kTPR];
        }
        // dk, dv (key column c, dim d): sums over the tile's rows, then one atomic each.
        for (int i = threadIdx.x; i < kBN * kD; i += S::kThreads) {
          const int c = i / kD, d = i % kD;
          if (c >= cols) continue;
          float dk = 0.0f, dv = 0.0f;
          for (int rr = 0; rr < kBM; ++rr) {  // rows beyond `rows` have P = dS = 0
            dk += dSs[rr * kPLd + c] * Qs[rr * kLd + d];
            dv += Ps[rr * kPLd + c] * dOs[rr * kLd + d];
          }
          const long long idx = ((k0 + c) * p.heads_kv + kvh) * static_cast<long long>(kD) + d;
          if (dk != 0.0f) atomicAdd(p.dk + idx, dk * p.scale);
          if (dv != 0.0f) atomicAdd(p.dv + idx, dv);
        }
      }
    }
    if (r < rows) {
      float* g = p.dq + ((q0 + r) * p.heads_q + h) * static_cast<long long>(kD);
      HSAP_UNROLL
      for (int j = 0; j < S::kDT; ++j) g[tc + j * kTPR] += dq[j] * p.scale;
    }
  }
}

// ---------------------------------------------------------------------------------------
// Row-wise helper kernels: one warp per (row, head), 256 threads per CTA.

template <class Cfg>
__global__ void __launch_bounds__(256) attn_delta_kernel(const DeltaParams p) {
  using T = typename Cfg::T;
  constexpr int kD = Cfg::kHeadDim;
  const int lane = threadIdx.x % 32;
  const long long warps = static_cast<long long>(gridDim.x) * (blockDim.x / 32);
  // Warp-stride loop over items = row * heads + head; a warp's lanes iterate together.
  for (long long item = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
       item < p.rows * p.heads; item += warps) {
    const long long base = item * kD;
    float sum = 0.0f;
    for (int d = lane; d < kD; d += 32) {
      sum += load_float<T>(p.dout, base + d) * load_float<T>(p.out, base + d);
    }
    sum = warp_sum(sum);
    if (lane == 0) {
      const long long row = item / p.heads;
      const int head = static_cast<int>(item % p.heads);
      p.delta[head * p.rows + row] = sum;
    }
  }
}

template <class Cfg>
__global__ void __launch_bounds__(256) lse_merge_kernel(const MergeParams p) {
  constexpr int kD = Cfg::kHeadDim;
  const int lane = threadIdx.x % 32;
  const long long warps = static_cast<long long>(gridDim.x) * (blockDim.x / 32);
  for (long long item = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
       item < p.rows * p.heads; item += warps) {
    const long long row = item / p.heads;
    const int head = static_cast<int>(item % p.heads);
    float* lse1 = p.lse1 + head * p.lse_stride1 + row;
    const float lse2 = p.lse2[head * p.lse_stride2 + row];
    const LseMerge m = merge_lse(*lse1, lse2);
    if (lse2 != neg_inf()) {
      float* o1 = p.o1 + item * kD;
      const float* o2 = p.o2 + item * kD;
      for (int d = lane; d < kD; d += 32) o1[d] = m.w1 * o1[d] + m.w2 * o2[d];
    }
    __syncwarp();  // all lanes have read *lse1
    if (lane == 0) *lse1 = m.lse;
  }
}

template <class Cfg>
__global__ void __launch_bounds__(256) init_partial_kernel(const InitParams p) {
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  const long long first = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const long long n_out = p.rows * p.heads * Cfg::kHeadDim;
  for (long long i = first; i < n_out; i += stride) p.out[i] = 0.0f;
  for (long long i = first; i < p.rows * p.heads; i += stride) p.lse[i] = neg_inf();
}

template <class Cfg>
__global__ void __launch_bounds__(256) convert_out_kernel(const ConvertParams p) {
  using T = typename Cfg::T;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < p.count;
       i += stride) {
    static_cast<T*>(p.dst)[i] = from_float<T>(p.src[i]);
  }
}

template <class Cfg>
__global__ void __launch_bounds__(256) accumulate_kernel(const AccumulateParams p) {
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < p.count;
       i += stride) {
    p.dst[i] += p.src[i];
  }
}

template <class Cfg>
__global__ void __launch_bounds__(256) copy_chunks_kernel(const ChunksParams p) {
  for (long long c = blockIdx.x; c < p.num_chunks; c += gridDim.x) {
    const CopyChunk k = p.chunks[c];
    const char* src = static_cast<const char*>(p.src) + k.src;
    char* dst = static_cast<char*>(p.dst) + k.dst;
    if (((k.src | k.dst | k.bytes) & 3) == 0) {
      const unsigned int* s = reinterpret_cast<const unsigned int*>(src);
      unsigned int* d = reinterpret_cast<unsigned int*>(dst);
      for (long long i = threadIdx.x; i < k.bytes / 4; i += blockDim.x) d[i] = s[i];
    } else {
      for (long long i = threadIdx.x; i < k.bytes; i += blockDim.x) dst[i] = src[i];
    }
  }
}

template <class Cfg>
__global__ void __launch_bounds__(256) add_chunks_kernel(const ChunksParams p) {
  for (long long c = blockIdx.x; c < p.num_chunks; c += gridDim.x) {
    const CopyChunk k = p.chunks[c];
    const float* src = static_cast<const float*>(p.src) + k.src / 4;
    float* dst = static_cast<float*>(p.dst) + k.dst / 4;
    for (long long i = threadIdx.x; i < k.bytes / 4; i += blockDim.x) dst[i] += src[i];
  }
}

// ---------------------------------------------------------------------------------------
// Helpers of the cuDNN engine (EntryRows in hsap_params.cuh): each loops over the entries,
// and within an entry over its work with the whole grid.

template <class Cfg>
__global__ void __launch_bounds__(256) merge_entries_kernel(const EntryMergeParams p) {
  using T = typename Cfg::T;
  constexpr int kD = Cfg::kHeadDim;
  const int lane = threadIdx.x % 32;
  const long long warps = static_cast<long long>(gridDim.x) * (blockDim.x / 32);
  const long long warp = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  for (int b = 0; b < p.num_entries; ++b) {
    const EntryRows e = p.entries[b];
    for (long long item = warp; item < e.len * p.heads; item += warps) {
      const long long i = item / p.heads;
      const int head = static_cast<int>(item % p.heads);
      const long long row = e.begin + i;
      const float lse2 = p.stats[b * p.stats_entry_stride + head * p.stats_head_stride + i];
      float* lse1 = p.lse + head * p.lse_stride + row;
      const LseMerge m = merge_lse(*lse1, lse2);
      if (lse2 != neg_inf()) {
        const long long base = (row * p.heads + head) * static_cast<long long>(kD);
        for (int d = lane; d < kD; d += 32) {
          p.out[base + d] = m.w1 * p.out[base + d] + m.w2 * load_float<T>(p.o, base + d);
        }
      }
      __syncwarp();  // all lanes have read *lse1
      if (lane == 0) *lse1 = m.lse;
    }
  }
}

template <class Cfg>
__global__ void __launch_bounds__(256) gather_stats_kernel(const StatsGatherParams p) {
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  const long long first = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int b = 0; b < p.num_entries; ++b) {
    const EntryRows e = p.entries[b];
    for (long long x = first; x < e.len * p.heads; x += stride) {
      const int head = static_cast<int>(x / e.len);
      const long long i = x % e.len;
      p.stats[b * p.stats_entry_stride + head * p.stats_head_stride + i] =
          p.lse[head * p.lse_stride + e.begin + i];
    }
  }
}

template <class Cfg>
__global__ void __launch_bounds__(256) add_entries_kernel(const EntryAddParams p) {
  using T = typename Cfg::T;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  const long long first = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int b = 0; b < p.num_entries; ++b) {
    const EntryRows e = p.entries[b];
    const long long base = e.begin * p.row_elems;
    for (long long x = first; x < e.len * p.row_elems; x += stride) {
      p.dst[base + x] += load_float<T>(p.src, base + x);
    }
  }
}

// ---------------------------------------------------------------------------------------
// Fused forward: copy CTAs stage the next step's K/V from peers while compute CTAs attend
// to the current one (see FusedFwdParamsT).

// Copies `bytes` (a multiple of 4) from src to dst, split over `parts` CTAs of which this is
// `part`; 16-byte vectors when both pointers and the size allow.
template <int kThreads>
HSAP_DEV void copy_slice(void* dst, const void* src, long long bytes, int part, int parts) {
  const long long first = static_cast<long long>(part) * kThreads + threadIdx.x;
  const long long stride = static_cast<long long>(parts) * kThreads;
  const bool vec16 =
      ((reinterpret_cast<unsigned long long>(dst) | reinterpret_cast<unsigned long long>(src) |
        static_cast<unsigned long long>(bytes)) &
       15ull) == 0;
  if (vec16) {
    const long long n = bytes / 16;
    const uint4* s = static_cast<const uint4*>(src);
    uint4* d = static_cast<uint4*>(dst);
    for (long long i = first; i < n; i += stride) d[i] = s[i];
  } else {
    const long long n = bytes / 4;
    const unsigned int* s = static_cast<const unsigned int*>(src);
    unsigned int* d = static_cast<unsigned int*>(dst);
    for (long long i = first; i < n; i += stride) d[i] = s[i];
  }
}

// One task of the fused forward (see FusedFwdHead): copy `index` of `copy parts` of step s,
// or compute work item `index` (query block index % num_blocks of head index / num_blocks) of
// step s; `items` is what counters[2] (items done) must reach before the task may start.
struct FusedTask {
  int step;  // -1: no task (the ticket is past the launch's work)
  bool copy;
  unsigned int index;
  unsigned int items;
};

// The task of ticket t. Tickets run through copy(0), copy(1), then for each step s
// compute(s) and copy(s + 2): a task only ever waits for tasks of smaller tickets.
template <int kMaxSteps>
HSAP_DEV FusedTask fused_task(const FusedFwdParamsT<kMaxSteps>& p, unsigned int t,
                              unsigned int parts) {
  const int steps = p.head.num_steps;
  FusedTask task{-1, true, 0u, 0u};
  for (int s = 0; s < 2 && s < steps; ++s) {
    if (t < parts) return FusedTask{s, true, t, 0u};
    t -= parts;
  }
  unsigned int before = 0;  // items of the steps before s
  for (int s = 0; s < steps; ++s) {
    const unsigned int items =
        static_cast<unsigned int>(p.steps[s].num_blocks) * static_cast<unsigned int>(p.head.heads_q);
    if (t < items) return FusedTask{s, false, t, before};
    t -= items;
    before += items;
    if (s + 2 < steps) {
      // Buffer (s + 2) % 2 last held step s, whose items are all done once `before` are.
      if (t < parts) return FusedTask{s + 2, true, t, before};
      t -= parts;
    }
  }
  return task;
}

// Thread 0 of a CTA: waits until *flag >= value. With timeout_ns != 0 it gives up when none
// of the launch's four counters moved for two timeouts, and at least a second (a peer's wait
// lasts at most one timeout, after which its copy task moves a counter; the floor keeps a
// short timeout from calling a CTA that a busy machine has not run yet stalled), reports
// kErrorStalled and lets the CTA carry on, so that the kernel always ends.
HSAP_DEV void fused_wait(const unsigned int* flag, unsigned int value, const unsigned int* counters,
                         unsigned long long timeout_ns, unsigned int* error_flag) {
  constexpr unsigned long long kStallFloorNs = 1000000000ull;
  const unsigned long long window = 2 * timeout_ns > kStallFloorNs ? 2 * timeout_ns : kStallFloorNs;
  unsigned long long since = timeout_ns != 0 ? globaltimer_ns() : 0;
  unsigned int moved = 0;  // the counters' sum at `since` (they only grow)
  if (timeout_ns != 0) {
    for (int i = 0; i < 4; ++i) moved += ld_acquire_gpu(counters + i);
  }
  while (!counter_reached(ld_acquire_gpu(flag), value)) {
    if (timeout_ns != 0 && globaltimer_ns() - since > window) {
      unsigned int now = 0;
      for (int i = 0; i < 4; ++i) now += ld_acquire_gpu(counters + i);
      if (now == moved) {
        report(error_flag, kErrorStalled);
        return;
      }
      moved = now;
      since = globaltimer_ns();
    }
    __nanosleep(64);
  }
}

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kTensorCore ? 2 : 1)  // as attn_fwd_kernel
    fused_fwd_kernel(const FusedFwdParamsT<(Cfg::kMaxSteps > 0 ? Cfg::kMaxSteps : 1)> p) {
  static_assert(Cfg::kMaxSteps >= 1, "hsap: fused kernel generated without steps");
  static_assert(Cfg::kFwdSmemBytes == FwdSmem<Cfg>::kBytes,
                "hsap: generator and device disagree on the forward shared memory size");
  const FusedFwdHead& h = p.head;
  float* smem = dynamic_smem();
  const int parts = h.num_copy_ctas;
  if (parts < 1 || h.num_steps < 0 || h.num_steps > Cfg::kMaxSteps) {
    report(h.error_flag, kErrorRowsOutOfRange);
    return;  // every CTA takes this branch: nobody waits
  }
  unsigned int* ready = h.counters;           // [2]: copies into buffer b done, cumulative
  unsigned int* items_done = h.counters + 2;  // work items done, over every step
  unsigned int* tickets = h.counters + 3;     // tickets handed out
  unsigned int total = 0;                     // tasks of the launch
  for (int s = 0; s < h.num_steps; ++s) {
    total += static_cast<unsigned int>(parts) +
             static_cast<unsigned int>(p.steps[s].num_blocks) * static_cast<unsigned int>(h.heads_q);
  }
  // Shared word 0 carries thread 0's ticket, word 1 its copy verdict (between the tasks'
  // barriers, when no tile is in shared memory).
  volatile unsigned int* word = reinterpret_cast<volatile unsigned int*>(smem);
  int seen_step = -1;  // the last step whose inputs this CTA waited for (uniform)

  for (;;) {
    __syncthreads();  // the previous task is done with shared memory
    if (threadIdx.x == 0) word[0] = atomicAdd(tickets, 1u);
    __syncthreads();
    const unsigned int ticket = word[0];
    if (ticket >= total) return;  // uniform: no work left, or a CTA that started late
    const FusedTask task = fused_task(p, ticket, static_cast<unsigned int>(parts));
    const int s = task.step;
    const int b = s & 1;
    const FusedStep& step = p.steps[s];

    if (task.copy) {
      // Buffer b is free once every item of step s - 2 is done; then the peer's rows.
      if (threadIdx.x == 0) {
        if (s >= 2) fused_wait(items_done, task.items, h.counters, h.ready_timeout_ns, h.error_flag);
        bool arrived = true;
        if (step.ready_flag != nullptr) {
          arrived = wait_geq_sys_until(step.ready_flag, step.ready_value, h.ready_timeout_ns);
          if (!arrived) report(h.error_flag, kErrorPeerTimeout);
        }
        word[1] = arrived ? 1u : 0u;
      }
      __syncthreads();
      if (word[1] != 0) {
        const long long bytes = step.k_rows * h.heads_kv * Cfg::kHeadDim *
                                static_cast<long long>(sizeof(typename Cfg::T));
        copy_slice<Cfg::kThreads>(h.stage_k[b], step.k_src, bytes, task.index, parts);
        copy_slice<Cfg::kThreads>(h.stage_v[b], step.v_src, bytes, task.index, parts);
      }
      cta_signal_add_gpu(&ready[b], 1);
      if (step.consumed_flag != nullptr) cta_signal_add_sys(step.consumed_flag, 1);
      continue;
    }

    // A work item of step s: its K/V are staged, and every item of step s - 1 (which may
    // merge into the same output rows) is done. Checked once per step and CTA.
    if (s != seen_step) {
      if (threadIdx.x == 0) {
        fused_wait(&ready[b], static_cast<unsigned int>(((s >> 1) + 1) * parts), h.counters,
                   h.ready_timeout_ns, h.error_flag);
        fused_wait(items_done, task.items, h.counters, h.ready_timeout_ns, h.error_flag);
      }
      seen_step = s;
    }
    __syncthreads();  // thread 0's waits, and everyone read the ticket before tiles load
    const int block = static_cast<int>(task.index % static_cast<unsigned int>(step.num_blocks));
    const int hq = static_cast<int>(task.index / static_cast<unsigned int>(step.num_blocks));
    const int kvh = kv_head<Cfg>(h.kv_head_of_q, h.heads_q, h.heads_kv, hq, h.error_flag);
    if (kvh >= 0) {
      attend_block_fwd<Cfg, true>(smem, h.q, h.stage_k[b], h.stage_v[b], h.out, h.lse, h.q_rows,
                                  step.k_rows, h.heads_q, h.heads_kv, hq, kvh, h.scale,
                                  step.blocks[block], step.segments, h.error_flag);
    }
    cta_signal_add_gpu(items_done, 1);
  }
}

}  // namespace hsap_dev

#endif  // defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(HSAP_DEVICE_EMULATION)
#endif  // HSAP_JIT_DEVICE_HSAP_ATTENTION_CUH_
