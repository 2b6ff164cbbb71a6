// The tensor-core forward: the compute core of the "fwd" and "fused_fwd" kernels of
// hsap_attention.cuh for configurations whose math is CudaMath::kTensorCore (bf16/f16, head
// dim a multiple of 16 in [64, 256], sm_80+). Same Params, same work lists, same partial
// (out, lse) merge and the same masking and NaN/inf rules as the FMA core
// (attend_block_fwd_fma); only the arithmetic differs.
//
// Structure (FlashAttention-2 forward, written in the CUTLASS/ThunderKittens manner with the
// instructions of hsap_mma.cuh):
//   - a CTA of kWarps warps holds kBM = 16 * kRowBlocks * kWarps query rows: warp w owns
//     kRowBlocks m16 row blocks, rows [16 kRowBlocks w, 16 kRowBlocks (w + 1)), so every
//     softmax statistic of a row lives in the four lanes of a quad (lanes 4g..4g+3 hold rows
//     g and g + 8 of each block). With two row blocks (FlashAttention-2's 128-row tile on 4
//     warps) every K and V fragment a warp loads from shared memory, and every K/V tile the
//     CTA copies, serves twice the rows;
//   - the Q tile is copied to shared memory with cp.async, then (kQInRegs: head dim 64)
//     loaded once per query chunk into A fragments with ldmatrix.x4; at larger head dims
//     holding them costs registers the accumulators need (ChooseMmaForwardTiles), so they
//     are re-read from shared memory per k-step;
//   - K/V tiles of kBN keys stream through a kStages-deep cp.async ring (tile i + kStages - 1
//     is in flight while tile i is computed); rows past the tile's valid keys are
//     zero-filled, so P V never reads garbage;
//   - S = Q K^T: mma m16n8k16, B fragments of K by ldmatrix.x4 (non-transposed: a K row is a
//     column of B);
//   - online softmax in fp32 on the S accumulator fragments, the scale folded into the
//     exponent (FoldedOnlineSoftmax of hsap_device.cuh: an FFMA and an ex2.approx per score),
//     row max/sum over the quad with __shfl_xor_sync;
//   - P is rounded to the storage type and repacked from the C fragments into A fragments
//     in registers (the C layout of two adjacent n8 tiles is the A layout of one k16 step);
//   - O += P V: B fragments of V by ldmatrix.x4.trans (a V row is a row of B);
//   - the epilogue merges (O / l, lse) into out/lse exactly as the FMA core does.
// Shared-memory rows are padded by 16 bytes (kLdh = D + 8 elements) so that the eight rows
// an ldmatrix phase reads start in eight different 16-byte bank groups (no conflicts).
#ifndef HSAP_JIT_DEVICE_HSAP_ATTENTION_MMA_FWD_CUH_
#define HSAP_JIT_DEVICE_HSAP_ATTENTION_MMA_FWD_CUH_

#if defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(HSAP_DEVICE_EMULATION)

#include "hsap_device.cuh"
#include "hsap_mma.cuh"
#include "hsap_params.cuh"
#include "hsap_worklist.cuh"

namespace hsap_dev {

template <int kD_, int kBM_, int kBN_, int kThreads_, int kStages_, bool kQInRegs_>
struct MmaFwdShape {
  static constexpr int kD = kD_, kBM = kBM_, kBN = kBN_, kThreads = kThreads_;
  static constexpr int kStages = kStages_;
  static constexpr bool kQInRegs = kQInRegs_;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kRowBlocks = kBM / (16 * kWarps);  // m16 row blocks per warp
  static constexpr int kLdh = kD + 8;       // shared-memory row, in 16-bit elements
  static constexpr int kKSteps = kD / 16;   // k16 steps of Q K^T
  static constexpr int kNTiles = kBN / 8;   // n8 tiles of S per warp
  static constexpr int kPSteps = kBN / 16;  // k16 steps of P V
  static constexpr int kDTiles = kD / 8;    // n8 tiles of O per warp
  // Q tile, then kStages K tiles, then kStages V tiles, then kInfoSlots KeyTileInfo and the
  // key-tile walk (jit/codegen_cuda.cc: same formula).
  static constexpr int kInfoSlots = kStages + 1;
  static constexpr int kInfoOffset = 2 * (kBM + 2 * kStages * kBN) * kLdh;
  static constexpr int kWalkOffset = kInfoOffset + 32 * kInfoSlots;
  static constexpr int kWalkBytes = 128;
  static constexpr int kSmemBytes = kWalkOffset + kWalkBytes;
  static_assert(kD >= 64 && kD <= 256 && kD % 16 == 0,
                "hsap: the tensor-core kernels need a head dim that is a multiple of 16 in "
                "[64, 256]");
  static_assert(kThreads % 32 == 0 && (kRowBlocks == 1 || kRowBlocks == 2) &&
                    kBM == 16 * kRowBlocks * kWarps,
                "hsap: tensor-core forward: one or two m16 row blocks per warp (kBM = 16 or 32 "
                "* warps)");
  static_assert(kBN % 16 == 0 && kBN >= 16, "hsap: tensor-core forward: kBN a multiple of 16");
  static_assert(kStages >= 2, "hsap: the cp.async pipeline needs at least two stages");
};

// kOneRowBlock: the fused forward's shape, one m16 row block per warp whatever Cfg::kBlockM
// (its step loop keeps more state live: with two row blocks at head dim 64 ptxas spilled
// 84-108 bytes); it fits in the shared memory Cfg sizes for two.
template <class Cfg, bool kOneRowBlock = false>
using MmaFwdShapeOf =
    MmaFwdShape<Cfg::kHeadDim, kOneRowBlock ? 16 * (Cfg::kThreads / 32) : Cfg::kBlockM,
                Cfg::kBlockN, Cfg::kThreads, Cfg::kFwdStages, Cfg::kQInRegisters>;

// What the math of a K/V tile needs of the work list, written into shared memory by the
// thread that walks it when the tile's copy is issued (the mma.sync forward) or by the TMA
// producer (the sm_90a forward), so that the threads doing the math hold no walk in
// registers.
struct KeyTileInfo {
  long long k0;                // first key row of the tile
  long long diag_lo, diag_hi;  // the segment's band
  int cols;                    // valid keys, <= kBN
  int masked;                  // 1: some score of the tile is outside the band
};
static_assert(sizeof(KeyTileInfo) == 32, "MmaFwdShape / WgmmaFwdShape assume 32 bytes");

// The visibility of a tile's scores in 32-bit arithmetic, relative to the tile's corner:
// score (r, c) (chunk row r, tile column c) is visible iff r < rows, c < cols and, where
// `masked`, lo <= c - r <= hi. (The key-minus-query offset of (r, c) is k0 - q0 + c - r;
// lo and hi are the band's limits minus k0 - q0, clamped to +-2^30, which c - r, within
// (-kBM, kBN), never reaches.)
struct TileMask {
  int rows, cols, lo, hi;
  bool masked;
};
HSAP_DEV TileMask tile_mask(const KeyTileInfo& info, long long q0, int rows) {
  const long long base = info.k0 - q0;
  constexpr long long kClamp = 1LL << 30;
  const int lo = static_cast<int>(max64(-kClamp, min64(kClamp, info.diag_lo - base)));
  const int hi = static_cast<int>(max64(-kClamp, min64(kClamp, info.diag_hi - base)));
  return TileMask{rows, info.cols, lo, hi, info.masked != 0};
}

// Walks the key tiles of one query chunk in work-list order: the segments [si, seg_end),
// each over its visible key range for the chunk's rows, kBN keys per tile. Segments that
// break the contract are reported and skipped, as the FMA core does.
template <bool kHasBand, int kBN>
struct KeyTileWalk {
  const KeySegment* segments;
  long long si, seg_end;
  long long q0;
  int rows;
  long long k_rows;
  unsigned int* error_flag;
  KeySegment seg;
  bool full;
  long long k0, k_hi;

  HSAP_DEV bool valid() const { return si < seg_end; }
  HSAP_DEV int cols() const { return static_cast<int>(min64(kBN, k_hi - k0)); }
  // The tile the walk is on.
  HSAP_DEV KeyTileInfo info() const {
    const int c = cols();
    const bool masked = kHasBand && !full && !tile_inside_band(seg, q0, rows, k0, c);
    return KeyTileInfo{k0, seg.diag_lo, seg.diag_hi, c, masked ? 1 : 0};
  }
  // Settles on the first tile of segment si or a later one (or on the end).
  HSAP_DEV void enter() {
    for (; si < seg_end; ++si) {
      seg = segments[si];
      full = segment_is_full(seg);
      if (!kHasBand && !full) {
        report(error_flag, kErrorBandInFullOnlyVariant);
        continue;
      }
      if (seg.k_begin < 0 || seg.k_end > k_rows) {
        report(error_flag, kErrorRowsOutOfRange);
        continue;
      }
      visible_keys(seg, q0, rows, &k0, &k_hi);
      if (k0 < k_hi) return;
    }
  }
  HSAP_DEV void next() {
    k0 += kBN;
    if (k0 >= k_hi) {
      ++si;
      enter();
    }
  }
};

// S = Q K^T for one key tile: this warp's kRowBlocks x 16 query rows (A fragments: qf when
// kQInRegs, else read from q_row, row block b 16 rows further per b) against the tile's kBN
// keys of K (k_row: this lane's ldmatrix row). Each K fragment serves every row block.
// ldmatrix.x4 on K: matrices (keys j*8.., dims +0), (keys j*8.., dims +8), (keys (j+1)*8..,
// dims +0), (keys (j+1)*8.., dims +8) = b0, b1 of n-tiles j, j + 1.
template <class S, class Ops>
HSAP_DEV void mma_fwd_scores(float (&s)[S::kRowBlocks][S::kNTiles][4],
                             const unsigned (&qf)[S::kRowBlocks][S::kQInRegs ? S::kKSteps : 1][4],
                             const unsigned short* q_row, const unsigned short* k_row) {
  constexpr int kLdh = S::kLdh, kRB = S::kRowBlocks;
  HSAP_UNROLL
  for (int rb = 0; rb < kRB; ++rb) {
    HSAP_UNROLL
    for (int j = 0; j < S::kNTiles; ++j)
      s[rb][j][0] = s[rb][j][1] = s[rb][j][2] = s[rb][j][3] = 0.0f;
  }
  HSAP_UNROLL
  for (int kk = 0; kk < S::kKSteps; ++kk) {
    unsigned a[kRB][4];
    HSAP_UNROLL
    for (int rb = 0; rb < kRB; ++rb) {
      if constexpr (S::kQInRegs) {
        a[rb][0] = qf[rb][kk][0], a[rb][1] = qf[rb][kk][1];
        a[rb][2] = qf[rb][kk][2], a[rb][3] = qf[rb][kk][3];
      } else {
        ldmatrix_x4(a[rb], q_row + rb * 16 * kLdh + kk * 16);
      }
    }
    HSAP_UNROLL
    for (int j = 0; j < S::kNTiles; j += 2) {
      unsigned b[4];
      ldmatrix_x4(b, k_row + j * 8 * kLdh + kk * 16);
      const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
      HSAP_UNROLL
      for (int rb = 0; rb < kRB; ++rb) {
        Ops::mma(s[rb][j], a[rb], b0);
        Ops::mma(s[rb][j + 1], a[rb], b1);
      }
    }
  }
}

// Masks the tile's scores (visible: row < rows, column < cols, inside the band when
// `masked`), then the online softmax of rows g (hr = 0: c0, c1) and g + 8 (hr = 1: c2, c3):
// s (raw scores) becomes P, and rescale[hr] is the factor the row's accumulator must be
// multiplied by before P V is added to it. This lane holds key columns j * 8 + 2t + e.
// saw_key notes, per row, a visible key; NaN and +inf scores need no test
// (FoldedOnlineSoftmax). (The sm_90a forward calls this while the previous tile's P V is
// still in flight on its accumulator.)
// kWhole: the caller knows every score of the warp's 16 rows visible (a full tile of keys,
// all 16 rows valid, no band cut): no per-score test at all (the band cuts few tiles of a
// long causal row; the test was ~8 instructions per score, docs/gpu_backend.md). Per score
// this leaves an FMNMX, an FFMA, an ex2.approx and an FADD.
template <class S, bool kWhole>
HSAP_DEV void mma_fwd_softmax_scores(float (&s)[S::kNTiles][4], float (&rescale)[2],
                                     FoldedOnlineSoftmax (&sm)[2], bool (&saw_key)[2],
                                     const TileMask& mask, int row0, int t, float scale_log2) {
  HSAP_UNROLL
  for (int hr = 0; hr < 2; ++hr) {
    const int r = row0 + 8 * hr;
    float tile_max = neg_inf();
    HSAP_UNROLL
    for (int j = 0; j < S::kNTiles; ++j) {
      HSAP_UNROLL
      for (int e = 0; e < 2; ++e) {
        if constexpr (!kWhole) {
          const int c = j * 8 + 2 * t + e;
          bool visible = r < mask.rows && c < mask.cols;
          if (mask.masked) visible = visible && c - r >= mask.lo && c - r <= mask.hi;
          saw_key[hr] = saw_key[hr] || visible;
          if (!visible) s[j][2 * hr + e] = neg_inf();
        }
        tile_max = fmaxf(tile_max, s[j][2 * hr + e]);
      }
    }
    if constexpr (kWhole) saw_key[hr] = true;
    rescale[hr] = sm[hr].begin_tile(group_max<4>(tile_max), scale_log2);
    float tile_sum = 0.0f;
    HSAP_UNROLL
    for (int j = 0; j < S::kNTiles; ++j) {
      HSAP_UNROLL
      for (int e = 0; e < 2; ++e) {
        const float p = sm[hr].weight(s[j][2 * hr + e], scale_log2);
        tile_sum += p;
        s[j][2 * hr + e] = p;
      }
    }
    sm[hr].end_tile(group_sum<4>(tile_sum));
  }
}

// o *= rescale, per row (rows g: c0, c1; g + 8: c2, c3).
template <class S>
HSAP_DEV void mma_fwd_rescale(float (&o)[S::kDTiles][4], const float (&rescale)[2]) {
  HSAP_UNROLL
  for (int j = 0; j < S::kDTiles; ++j) {
    o[j][0] *= rescale[0];
    o[j][1] *= rescale[0];
    o[j][2] *= rescale[1];
    o[j][3] *= rescale[1];
  }
}

// mma_fwd_softmax_scores, then the accumulator rescaled: s becomes P, o is ready for P V.
template <class S, bool kWhole>
HSAP_DEV void mma_fwd_softmax(float (&s)[S::kNTiles][4], float (&o)[S::kDTiles][4],
                              FoldedOnlineSoftmax (&sm)[2], bool (&saw_key)[2],
                              const TileMask& mask, int row0, int t, float scale_log2) {
  float rescale[2];
  mma_fwd_softmax_scores<S, kWhole>(s, rescale, sm, saw_key, mask, row0, t, scale_log2);
  mma_fwd_rescale<S>(o, rescale);
}

// O += P V for every row block of the warp. The C fragments of n-tiles 2kc and 2kc + 1 are
// the A fragment of k-step kc. Each V fragment serves every row block.
// ldmatrix.x4.trans on V (v_row: this lane's row): matrices (keys +0, dims j*8..), (keys +8,
// dims j*8..), (keys +0, dims (j+1)*8..), (keys +8, dims (j+1)*8..) = b0, b1 of d-tiles j,
// j + 1.
template <class S, class Ops>
HSAP_DEV void mma_fwd_pv(float (&o)[S::kRowBlocks][S::kDTiles][4],
                         const float (&s)[S::kRowBlocks][S::kNTiles][4],
                         const unsigned short* v_row) {
  constexpr int kLdh = S::kLdh, kRB = S::kRowBlocks;
  HSAP_UNROLL
  for (int kc = 0; kc < S::kPSteps; ++kc) {
    unsigned a[kRB][4];
    HSAP_UNROLL
    for (int rb = 0; rb < kRB; ++rb) {
      a[rb][0] = Ops::pack(s[rb][2 * kc][0], s[rb][2 * kc][1]);
      a[rb][1] = Ops::pack(s[rb][2 * kc][2], s[rb][2 * kc][3]);
      a[rb][2] = Ops::pack(s[rb][2 * kc + 1][0], s[rb][2 * kc + 1][1]);
      a[rb][3] = Ops::pack(s[rb][2 * kc + 1][2], s[rb][2 * kc + 1][3]);
    }
    HSAP_UNROLL
    for (int j = 0; j < S::kDTiles; j += 2) {
      unsigned b[4];
      ldmatrix_x4_trans(b, v_row + kc * 16 * kLdh + j * 8);
      const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
      HSAP_UNROLL
      for (int rb = 0; rb < kRB; ++rb) {
        Ops::mma(o[rb][j], a[rb], b0);
        Ops::mma(o[rb][j + 1], a[rb], b1);
      }
    }
  }
}

// Merges this chunk's partial rows g and g + 8 of one row block (row0 = its row g) into
// out/lse: the FMA core's epilogue, per quad.
template <class S>
HSAP_DEV void mma_fwd_merge(const float (&o)[S::kDTiles][4], const FoldedOnlineSoftmax (&sm)[2],
                            const bool (&saw_key)[2], float scale_log2, float* out, float* lse,
                            long long q_rows, int heads_q, int h, long long q0, int rows, int row0,
                            int t) {
  constexpr int kD = S::kD;
  LseMerge merged[2];
  float lse2[2];
  HSAP_UNROLL
  for (int hr = 0; hr < 2; ++hr) {
    const int r = row0 + 8 * hr;
    // l is the quad's sum (group_sum in the softmax), the same in its four lanes.
    const bool row_saw_key = group_max<4>(saw_key[hr] ? 1.0f : 0.0f) > 0.0f;
    const bool row_is_nan = sm[hr].row_is_nan(row_saw_key);
    lse2[hr] = row_is_nan ? quiet_nan() : sm[hr].lse(scale_log2);
    const float inv_l = row_is_nan ? lse2[hr] : sm[hr].inv_l();
    merged[hr] = LseMerge{0.0f, 1.0f, 0.0f};
    if (r < rows) {
      merged[hr] = merge_lse(lse[static_cast<long long>(h) * q_rows + (q0 + r)], lse2[hr]);
      if (lse2[hr] != neg_inf()) {
        float* orow = out + ((q0 + r) * heads_q + h) * static_cast<long long>(kD);
        HSAP_UNROLL
        for (int j = 0; j < S::kDTiles; ++j) {
          HSAP_UNROLL
          for (int e = 0; e < 2; ++e) {
            const int d = j * 8 + 2 * t + e;
            orow[d] = merged[hr].w1 * orow[d] + merged[hr].w2 * (o[j][2 * hr + e] * inv_l);
          }
        }
      }
    }
  }
  __syncwarp();  // every lane of the quad has read the old lse
  HSAP_UNROLL
  for (int hr = 0; hr < 2; ++hr) {
    const int r = row0 + 8 * hr;
    if (r < rows && t == 0 && lse2[hr] != neg_inf()) {
      lse[static_cast<long long>(h) * q_rows + (q0 + r)] = merged[hr].lse;
    }
  }
}

// Forward over one query block of one head with tensor cores; the contract of
// attend_block_fwd_fma (hsap_attention.cuh). kStaged: K/V were written by other CTAs of this
// kernel (fused path); cp.async.cg reads through L2 like ld.global.cg, so it sees them. The
// fused path runs one row block per warp (MmaFwdShapeOf's kOneRowBlock).
template <class Cfg, bool kStaged>
__device__ void attend_block_fwd_mma(float* smem_f, const void* q, const void* k, const void* v,
                                     float* out, float* lse, long long q_rows, long long k_rows,
                                     int heads_q, int heads_kv, int h, int kvh, float scale,
                                     const QueryBlock qb, const KeySegment* segments,
                                     unsigned int* error_flag) {
  using S = MmaFwdShapeOf<Cfg, /*kOneRowBlock=*/kStaged>;
  static_assert(S::kSmemBytes <= MmaFwdShapeOf<Cfg>::kSmemBytes, "hsap: the fused shape fits");
  using T = typename Cfg::T;
  using Ops = MmaOps<T>;
  constexpr int kD = S::kD, kBM = S::kBM, kBN = S::kBN, kLdh = S::kLdh, kStages = S::kStages;
  constexpr int kRB = S::kRowBlocks;
  using Walk = KeyTileWalk<Cfg::kHasBand, kBN>;
  static_assert(sizeof(Walk) <= S::kWalkBytes, "hsap: MmaFwdShape::kWalkBytes");
  unsigned short* Qs = reinterpret_cast<unsigned short*>(smem_f);
  unsigned short* Ks = Qs + kBM * kLdh;
  unsigned short* Vs = Ks + kStages * kBN * kLdh;
  unsigned char* smem_b = reinterpret_cast<unsigned char*>(smem_f);
  KeyTileInfo* infos = reinterpret_cast<KeyTileInfo*>(smem_b + S::kInfoOffset);
  Walk* walk = reinterpret_cast<Walk*>(smem_b + S::kWalkOffset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;  // quad (row pair g, g + 8) and lane in the quad
  const float scale_log2 = scale * kLog2E;

  if (!block_rows_in_range(qb, q_rows, error_flag)) return;  // uniform over the CTA
  if (!tensors_aligned16(error_flag, q, k, v)) return;
  // The key tiles of a chunk are walked by thread 0 alone, a tile ahead of the copies: the
  // walk lives in shared memory and tile j's KeyTileInfo in slot j % kInfoSlots (cols = 0:
  // no tile j), so that no thread holds walk state in registers across the tile loop (the
  // accumulators of two row blocks need them). Thread 0 writes tile j's slot before the
  // barrier after which it is first read (to issue its copies), and only once every warp
  // has read the tile that had the slot before (kInfoSlots = kStages + 1: the slot of tile
  // it - 1 receives tile it + kStages while tiles it .. it + kStages - 1 are in use).
  // Thread 0: tile j's slot, and the walk past it (in place: a step touches a few of the
  // walk's fields, k0 and k_hi).
  auto walk_to = [&](int j) {
    Walk& w = *walk;
    KeyTileInfo info{0, 0, 0, 0, 0};
    if (w.valid()) {
      info = w.info();
      w.next();
    }
    infos[j % S::kInfoSlots] = info;
  };
  auto issue = [&](const KeyTileInfo& info, int stage) {  // tile `info` into ring slot `stage`
    cp_async_rows<kBN, kD, kLdh, S::kThreads>(Ks + stage * kBN * kLdh, k, info.k0, info.cols,
                                              heads_kv, kvh);
    cp_async_rows<kBN, kD, kLdh, S::kThreads>(Vs + stage * kBN * kLdh, v, info.k0, info.cols,
                                              heads_kv, kvh);
  };
  for (long long q0 = qb.q_begin; q0 < qb.q_end; q0 += kBM) {
    const int rows = static_cast<int>(min64(kBM, qb.q_end - q0));
    __syncthreads();  // the previous chunk is done with every shared tile
    cp_async_rows<kBM, kD, kLdh, S::kThreads>(Qs, q, q0, rows, heads_q, h);
    cp_async_commit();
    if (threadIdx.x == 0) {
      *walk = Walk{segments,   qb.seg_begin, qb.seg_end, q0, rows, k_rows,
                   error_flag, KeySegment{}, false,      0,  0};
      walk->enter();
      for (int j = 0; j < kStages; ++j) walk_to(j);
    }
    __syncthreads();  // tiles 0 .. kStages - 1 described
    // Prologue: tiles 0 .. kStages - 2 in flight, one group each (empty groups past the end
    // keep the group count, and so cp_async_wait's meaning, uniform).
    HSAP_UNROLL
    for (int st = 0; st < kStages - 1; ++st) {
      const KeyTileInfo info = infos[st];
      if (info.cols > 0) issue(info, st);
      cp_async_commit();
    }
    cp_async_wait<kStages - 1>();  // the Q group
    __syncthreads();

    // Q as A fragments: matrix i of ldmatrix.x4 is rows (i & 1) * 8.., cols (i >> 1) * 8..
    // of a 16 x 16 block, i.e. a0..a3 of the m16n8k16 A layout. Row block rb of the warp
    // starts at chunk row block_row0 + 16 rb.
    const int block_row0 = warp * 16 * kRB;
    const unsigned short* q_row = Qs + (block_row0 + (lane & 15)) * kLdh + (lane >> 4) * 8;
    unsigned qf[kRB][S::kQInRegs ? S::kKSteps : 1][4];
    if constexpr (S::kQInRegs) {
      HSAP_UNROLL
      for (int rb = 0; rb < kRB; ++rb) {
        HSAP_UNROLL
        for (int kk = 0; kk < S::kKSteps; ++kk) {
          ldmatrix_x4(qf[rb][kk], q_row + rb * 16 * kLdh + kk * 16);
        }
      }
    }

    FoldedOnlineSoftmax sm[kRB][2];
    bool saw_key[kRB][2];  // per row (g, g + 8) of each block: a key was visible
    float o[kRB][S::kDTiles][4];
    HSAP_UNROLL
    for (int rb = 0; rb < kRB; ++rb) {
      sm[rb][0].init();
      sm[rb][1].init();
      saw_key[rb][0] = saw_key[rb][1] = false;
      HSAP_UNROLL
      for (int j = 0; j < S::kDTiles; ++j)
        o[rb][j][0] = o[rb][j][1] = o[rb][j][2] = o[rb][j][3] = 0.0f;
    }

    for (int it = 0;; ++it) {
      __syncthreads();  // every warp is done with tile it - 1, whose ring slot is refilled now
      {
        const int next = it + kStages - 1;
        const KeyTileInfo info = infos[next % S::kInfoSlots];
        if (info.cols > 0) issue(info, next % kStages);
      }
      cp_async_commit();
      cp_async_wait<kStages - 1>();  // tile it has landed (this thread's copies) ...
      __syncthreads();               // ... and everyone's
      const KeyTileInfo info = infos[it % S::kInfoSlots];
      if (info.cols == 0) break;  // uniform: no tile it
      const unsigned short* Kt = Ks + (it % kStages) * kBN * kLdh;
      const unsigned short* Vt = Vs + (it % kStages) * kBN * kLdh;
      const TileMask mask = tile_mask(info, q0, rows);

      float s[kRB][S::kNTiles][4];
      mma_fwd_scores<S, Ops>(s, qf, q_row,
                             Kt + ((lane >> 4) * 8 + (lane & 7)) * kLdh + ((lane >> 3) & 1) * 8);
      HSAP_UNROLL
      for (int rb = 0; rb < kRB; ++rb) {
        const int row0 = block_row0 + 16 * rb;
        // Warp-uniform: the per-score test only where the band or the tile's edges cut it.
        if (!mask.masked && mask.cols == kBN && row0 + 16 <= rows) {
          mma_fwd_softmax<S, true>(s[rb], o[rb], sm[rb], saw_key[rb], mask, row0 + g, t,
                                   scale_log2);
        } else {
          mma_fwd_softmax<S, false>(s[rb], o[rb], sm[rb], saw_key[rb], mask, row0 + g, t,
                                    scale_log2);
        }
      }
      mma_fwd_pv<S, Ops>(o, s, Vt + (((lane >> 3) & 1) * 8 + (lane & 7)) * kLdh + (lane >> 4) * 8);
      if (threadIdx.x == 0) walk_to(it + kStages);  // into tile it - 1's slot, read by all
    }
    cp_async_wait<0>();  // only empty groups remain; none may outlive the chunk

    // Merge this chunk's partial rows into out/lse (the FMA core's epilogue, per quad).
    HSAP_UNROLL
    for (int rb = 0; rb < kRB; ++rb) {
      mma_fwd_merge<S>(o[rb], sm[rb], saw_key[rb], scale_log2, out, lse, q_rows, heads_q, h, q0,
                       rows, block_row0 + 16 * rb + g, t);
    }
  }
}

}  // namespace hsap_dev

#endif  // defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(HSAP_DEVICE_EMULATION)
#endif  // HSAP_JIT_DEVICE_HSAP_ATTENTION_MMA_FWD_CUH_
