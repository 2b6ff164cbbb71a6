// The sm_90a backward: the "bwd" kernel of configurations generated for arch "sm_90a" with
// deterministic dq (jit/codegen_cuda.h CudaWgmmaBackwardApplies: bf16/f16, head dim 64 or
// 128). Same contract as attn_bwd_mma_kernel (BwdParams of hsap_params.cuh; dq, dk, dv fp32
// and added into; any grid), whose work items, walks, masks and NaN/inf rules it keeps
// (hsap_attention_mma_bwd.cuh), all on wgmma: the CTAs walk, grid-stride, over
//   1. key items (64 key rows kt0..kt1 of kv head kvh): the CTA's one warpgroup keeps dK and
//      dV of its 64 keys in registers (wgmma accumulators: warp w holds keys 16w..16w+15) and
//      walks the query tiles that see the keys (next_key_tile: every query head of the kv head,
//      every block and segment, kBM = 64 rows at a time), per tile
//        S^T = K Q^T, dP^T = V dO^T            (wgmma m64n64k16, A and B from shared memory)
//        P^T = exp(scale S^T - lse), dS^T = P^T (dP^T - delta)   (mma_bwd_probs_t, per element)
//        dV += P^T dO, dK += dS^T Q            (wgmma m64nDk16, A = P^T / dS^T packed in
//                                               registers, B = dO / Q by MN-major descriptors)
//      and adds dK * scale and dV to dk / dv once: one writer per (key row, kv head), so dk and
//      dv are bitwise deterministic;
//   2. dq items (query block, head; kDeterministicDq's organisation, mma_bwd_query_item's):
//      64-row chunks of the block, each walking the block's segments and their 64-key tiles in
//      order (next_query_tile), per tile
//        S = Q K^T, dP = dO V^T                (wgmma m64n64k16 from shared memory)
//        dS = P (dP - delta)                   (per element, as mma_bwd_query_item)
//        dQ += dS K                            (wgmma m64nDk16, dS from registers, K MN-major)
//      then adds dQ * scale to the chunk's rows: a fixed reduction order, bitwise reproducible.
//      Atomic-dq configurations keep the mma.sync backward.
// Loads: thread 0 issues TMA loads (hsap_tma.cuh) of an item's fixed tiles (key item: K and V,
// boxes of 64 keys; dq item: the chunk's Q and dO, boxes of 64 rows; past the tensor's end
// zero-filled; mbarrier kv_full) and of each walked tile (key item: Q and dO; dq item: K and
// V) into two stages guarded by mbarriers (full[stage], arrive.expect_tx), the next tile's
// while the warpgroup computes this one; lse and delta go to shared memory (key items) or
// registers (dq items) with plain loads. Rows a box reads past the tile's valid ones (other
// rows of the tensor, e.g. the next document's) are zeroed in shared memory where a product
// would multiply them by a zero (key items: Q and dO rows past the tile's query rows; dq
// items: K rows past its valid keys), so that a NaN or inf there cannot reach dK, dV or dQ
// as 0 * inf; elsewhere the per-element select masks them.
// Overlap: within a tile the GEMMs are separate wgmma groups and the elementwise work runs
// while the next group is on the tensor cores (wgmma_bwd_tile, wgmma_bwd_dq_tile); the next
// tile's TMA loads run during the whole tile; while the tile's last GEMM (dK, or dQ) runs,
// the warpgroup loads the next tile's lse and delta into shared memory and thread 0 walks to
// the tile after it (two tile descriptors in shared memory, by parity), so that neither the
// stats' global loads nor the walk's scan wait between tiles (one barrier per tile).
// Simplified against FlashAttention-3 (correctness first): one warpgroup of 64 keys (or 64
// query rows) per CTA, no producer warpgroup or setmaxnreg (thread 0 issues the next tile's
// loads between tiles), no overlap of GEMMs across tiles, and dq recomputing S and dP in its
// own items (7 tile products instead of 5, like the mma.sync backward's deterministic mode)
// rather than a dS^T round trip through shared memory.
//
// Layouts (as the forward, hsap_attention_wgmma_fwd.cuh, whose header states them): every tile
// is kD / 64 panels of [64 rows][64 elements], 128-byte rows written by TMA with the 128-byte
// swizzle, each panel on a 1024-byte atom. The A operands (K, V; dq items: Q, dO) and the B
// operands of S^T / S and dP^T / dP (Q, dO; dq items: K, V) are read K-major (the forward's Q
// and K); the B operands of dV, dK (dO, Q) and dQ (K) MN-major (the forward's V: leading byte
// offset = the panel distance 64 * 128, stride byte offset 1024). The accumulators (64 rows
// x 64 columns) are mma.sync's C fragments per warp, so mma_bwd_probs_t and the dq pass's
// per-element code apply unchanged, and packed in pairs they are the A fragments of the RS
// wgmma (the forward's P).
//
// Shared memory from the first 1024-aligned byte of the dynamic window: K, V [64 keys] (dq
// items: Q, dO), two stages of Q and dO [64 rows] (dq items: K, V), lse and delta [2][2][64],
// the walk's state (MmaKeyWalk or MmaQueryWalk, MmaTile), the mbarriers kv_full and full[2]
// (WgmmaBwdShape::kSmemBytes; jit/codegen_cuda.cc WgmmaBwdSmemBytes: same formula).
//
// Required members of Cfg, beyond those of hsap_attention.cuh: kDeterministicDq (true),
// kWgmmaBwd, kWgmmaBwdBlockM (64), kWgmmaBwdSmemBytes (WgmmaBwdShape<Cfg>::kSmemBytes, checked).
#ifndef HSAP_JIT_DEVICE_HSAP_ATTENTION_WGMMA_BWD_CUH_
#define HSAP_JIT_DEVICE_HSAP_ATTENTION_WGMMA_BWD_CUH_

#if defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(HSAP_DEVICE_EMULATION)

#include "hsap_attention_mma_bwd.cuh"
#include "hsap_attention_wgmma_fwd.cuh"
#include "hsap_device.cuh"
#include "hsap_params.cuh"
#include "hsap_tma.cuh"
#include "hsap_wgmma.cuh"

namespace hsap_dev {

template <class Cfg>
struct WgmmaBwdShape {
  static constexpr int kD = Cfg::kHeadDim;
  static constexpr int kBN = 64;                    // key rows per item: wgmma M
  static constexpr int kBM = Cfg::kWgmmaBwdBlockM;  // query rows per tile: N of S^T
  static constexpr int kThreads = 128;              // one warpgroup
  static constexpr int kPanels = kD / 64;
  static constexpr int kKBytes = kBN * kD * 2;  // K or V
  static constexpr int kQBytes = kBM * kD * 2;  // Q or dO of one stage
  static constexpr int kVOffset = kKBytes;
  static constexpr int kQOffset = 2 * kKBytes;  // stage s: Q, then dO kQBytes further
  static constexpr int kStatsOffset = kQOffset + 4 * kQBytes;  // float [2][lse, delta][kBM]
  static constexpr int kCtrlOffset = kStatsOffset + 16 * kBM;
  static constexpr int kBarOffset = kCtrlOffset + 256;
  static constexpr int kNumBars = 3;  // kv_full, full[2]
  static constexpr int kSmemBytes = 1024 + kBarOffset + 8 * kNumBars;
  static_assert(kD == 64 || kD == 128,
                "hsap: the sm_90a backward takes head dims 64 and 128 (dK + dV of 64 keys are "
                "D fp32 registers per thread of one warpgroup)");
  static_assert(kBM == kBN,
                "hsap: the sm_90a backward's query items use the key items' tiles the other way "
                "round (Q, dO where K, V are; K, V stages where Q, dO stages are)");
  static_assert(Cfg::kDeterministicDq,
                "hsap: the sm_90a backward computes dq in a fixed order only (kDeterministicDq)");
  static_assert(kQBytes % 1024 == 0 && kKBytes % 1024 == 0,
                "hsap: every tile must start on a 1024-byte swizzle atom");
};

// The key walk with the sm_90a backward's query tile (next_key_tile reads kBwdBlockM).
template <class Cfg>
struct WgmmaBwdWalkCfg : Cfg {
  static constexpr int kBwdBlockM = Cfg::kWgmmaBwdBlockM;
};

template <class S>
struct WgmmaBwdSmem {
  unsigned char* k;
  unsigned char* v;
  unsigned char* q;  // stage s at q + s * 2 * kQBytes, its dO kQBytes further
  float* stats;
  MmaKeyWalk* walk;
  MmaTile* tile;  // [2]: the walked tiles, slot i % 2 for an item's tile i
  unsigned long long* kv_full;
  unsigned long long* full;  // [2]

  HSAP_DEV explicit WgmmaBwdSmem(void* raw) {
    unsigned char* base = static_cast<unsigned char*>(raw);
    base += (1024u - shared_window_offset(base) % 1024u) % 1024u;
    k = base;
    v = base + S::kVOffset;
    q = base + S::kQOffset;
    stats = reinterpret_cast<float*>(base + S::kStatsOffset);
    walk = reinterpret_cast<MmaKeyWalk*>(base + S::kCtrlOffset);
    tile = reinterpret_cast<MmaTile*>(base + S::kCtrlOffset + sizeof(MmaKeyWalk));
    kv_full = reinterpret_cast<unsigned long long*>(base + S::kBarOffset);
    full = kv_full + 1;
  }
  HSAP_DEV unsigned char* q_stage(int s) const { return q + s * 2 * S::kQBytes; }
  HSAP_DEV unsigned char* do_stage(int s) const { return q_stage(s) + S::kQBytes; }
  HSAP_DEV float* lse_stage(int s) const { return stats + s * 2 * S::kBM; }
};

// The four tensor maps (q, k, v, dout), as the kernel receives them.
struct WgmmaBwdMaps {
  const TensorMap *q, *k, *v, *dout;
};

// Query tile t into stage st: thread 0 arms full[st] and issues the TMA loads of its Q and dO.
template <class S>
HSAP_DEV void wgmma_bwd_issue_stage(const WgmmaBwdSmem<S>& sm, const WgmmaBwdMaps& maps, int st,
                                    const MmaTile& t) {
  if (threadIdx.x != 0) return;
  mbarrier_arrive_expect_tx(&sm.full[st], 2 * S::kQBytes);
  const int q0 = static_cast<int>(t.q0);
  HSAP_UNROLL
  for (int pn = 0; pn < S::kPanels; ++pn) {
    tma_load_3d(sm.q_stage(st) + pn * S::kBM * 128, maps.q, pn * 64, t.h, q0, &sm.full[st]);
    tma_load_3d(sm.do_stage(st) + pn * S::kBM * 128, maps.dout, pn * 64, t.h, q0, &sm.full[st]);
  }
}

// lse and delta of query tile t's rows into stage st (rows past t.rows: -inf and 0); every
// thread writes its rows.
template <class S>
HSAP_DEV void wgmma_bwd_stage_stats(const WgmmaBwdSmem<S>& sm, const BwdParams& p, int st,
                                    const MmaTile& t) {
  float* stats = sm.lse_stage(st);
  for (int r = threadIdx.x; r < S::kBM; r += S::kThreads) {
    const long long stat = static_cast<long long>(t.h) * p.q_rows + (t.q0 + r);
    stats[r] = r < t.rows ? p.lse[stat] * kLog2E : neg_inf();  // log2 units
    stats[S::kBM + r] = r < t.rows ? p.delta[stat] : 0.0f;
  }
}

// Zeroes rows [rows, kBM) of stage st's Q and dO (every panel; the swizzle permutes 16-byte
// chunks within a 128-byte row only) and hands them to the async proxy. Every thread calls it.
template <class S>
HSAP_DEV void wgmma_bwd_zero_tail(const WgmmaBwdSmem<S>& sm, int st, int rows) {
  const int chunks = (S::kBM - rows) * 8;  // 16-byte chunks per panel
  for (int i = threadIdx.x; i < 2 * S::kPanels * chunks; i += S::kThreads) {
    const int tensor = i / (S::kPanels * chunks), rest = i % (S::kPanels * chunks);
    const int pn = rest / chunks, c = rest % chunks;
    unsigned char* base = tensor == 0 ? sm.q_stage(st) : sm.do_stage(st);
    unsigned* dst = reinterpret_cast<unsigned*>(base + pn * S::kBM * 128 + rows * 128 + c * 16);
    dst[0] = dst[1] = dst[2] = dst[3] = 0u;
  }
  fence_proxy_async_shared();  // the generic-proxy stores, before wgmma reads them
  __syncthreads();
}

// fp32 pairs of an m64nNk16 accumulator (N = 16 kc-steps) packed into the A fragments of the
// wgmma whose K is that N (k-step kc: the 8-column blocks 2kc and 2kc + 1).
template <int N, class Ops>
HSAP_DEV void wgmma_bwd_pack(unsigned (&a)[N / 16][4], const float (&x)[N / 2]) {
  HSAP_UNROLL
  for (int kc = 0; kc < N / 16; ++kc) {
    const float* y = x + 8 * kc;
    a[kc][0] = Ops::pack(y[0], y[1]);
    a[kc][1] = Ops::pack(y[2], y[3]);
    a[kc][2] = Ops::pack(y[4], y[5]);
    a[kc][3] = Ops::pack(y[6], y[7]);
  }
}

// P^T of a key item's tile in place from S^T (s): exp(scale S^T - lse) where the pair is
// visible, else 0 (selected), exactly as mma_bwd_probs_t; returns the visibility bits (bit i:
// element i of s), which dS^T reuses.
template <class S>
HSAP_DEV unsigned wgmma_bwd_probs(float (&s)[S::kBM / 2], const float* lse_s, const MmaTile cur,
                                  float scale, int warp, int g, int t) {
  static_assert(S::kBM / 2 <= 32, "hsap: one visibility bit per accumulator element");
  unsigned visible_bits = 0;
  HSAP_UNROLL
  for (int i = 0; i < S::kBM / 2; ++i) {
    const int kc = 16 * warp + g + 8 * ((i % 4) >> 1);
    const int qc = 8 * (i / 4) + 2 * t + (i & 1);
    const float row_lse = lse_s[qc];
    const bool visible = kc >= cur.key_lo && kc < cur.key_hi && qc < cur.rows &&
                         kc - qc >= cur.rel_lo && kc - qc <= cur.rel_hi && row_lse != neg_inf();
    s[i] = visible ? prob_from_log2(s[i], scale * kLog2E, row_lse) : 0.0f;
    visible_bits |= (visible ? 1u : 0u) << i;
  }
  return visible_bits;
}

// dS^T in place from dP^T (dp) and P^T (s): P^T (dP^T - delta) where visible, else 0.
template <class S>
HSAP_DEV void wgmma_bwd_dsoft(float (&dp)[S::kBM / 2], const float (&s)[S::kBM / 2],
                              const float* delta_s, unsigned visible_bits, int t) {
  HSAP_UNROLL
  for (int i = 0; i < S::kBM / 2; ++i) {
    const int qc = 8 * (i / 4) + 2 * t + (i & 1);
    dp[i] = (visible_bits >> i) & 1u ? s[i] * (dp[i] - delta_s[qc]) : 0.0f;
  }
}

// One query tile of a key item, pipelined within the warpgroup: S^T and dP^T issued as two
// wgmma groups; P^T computed once S^T is in (dP^T still running), dV += P^T dO issued; dS^T
// computed once dP^T is in (dV still running), dK += dS^T Q issued; then meanwhile() (work
// for the next tiles that touches none of the tile's operands: it runs while dK is on the
// tensor cores), and all waited for.
template <class Cfg, class S, class Meanwhile>
HSAP_DEV void wgmma_bwd_tile(float (&dk)[S::kD / 2], float (&dv)[S::kD / 2],
                             const WgmmaBwdSmem<S>& sm, int st, const MmaTile& cur,
                             const BwdParams& p, int warp, int g, int t, Meanwhile&& meanwhile) {
  using Ops = MmaOps<typename Cfg::T>;
  constexpr bool kBf16 = WgmmaIsBf16<typename Cfg::T>::kValue;
  constexpr int kBM = S::kBM;
  const unsigned char* qt = sm.q_stage(st);
  const unsigned char* dot = sm.do_stage(st);
  float s[kBM / 2], dp[kBM / 2];
  HSAP_UNROLL
  for (int i = 0; i < kBM / 2; ++i) s[i] = dp[i] = 0.0f;
  wgmma_fence_operand(s);
  wgmma_fence_operand(dp);
  wgmma_fence();
  HSAP_UNROLL
  for (int kk = 0; kk < S::kD / 16; ++kk) {
    const int off_k = (kk / 4) * S::kBN * 128 + (kk % 4) * 32;
    const int off_q = (kk / 4) * kBM * 128 + (kk % 4) * 32;
    wgmma_m64k16_ss<kBM, kBf16, false>(s, wgmma_desc(sm.k + off_k, 16, 1024, kSwizzle128B),
                                       wgmma_desc(qt + off_q, 16, 1024, kSwizzle128B), kk > 0);
  }
  wgmma_commit_group();
  HSAP_UNROLL
  for (int kk = 0; kk < S::kD / 16; ++kk) {
    const int off_k = (kk / 4) * S::kBN * 128 + (kk % 4) * 32;
    const int off_q = (kk / 4) * kBM * 128 + (kk % 4) * 32;
    wgmma_m64k16_ss<kBM, kBf16, false>(dp, wgmma_desc(sm.v + off_k, 16, 1024, kSwizzle128B),
                                       wgmma_desc(dot + off_q, 16, 1024, kSwizzle128B), kk > 0);
  }
  wgmma_commit_group();
  wgmma_wait_group<1>();  // S^T; dP^T may still run
  wgmma_fence_operand(s);
  const float* lse_s = sm.lse_stage(st);
  const unsigned visible_bits = wgmma_bwd_probs<S>(s, lse_s, cur, p.scale, warp, g, t);
  unsigned pa[kBM / 16][4], da[kBM / 16][4];
  wgmma_bwd_pack<kBM, Ops>(pa, s);
  wgmma_fence_operand(dv);
  wgmma_fence();
  HSAP_UNROLL
  for (int kc = 0; kc < kBM / 16; ++kc) {
    wgmma_m64k16_rs<S::kD, kBf16, true>(
        dv, pa[kc], wgmma_desc(dot + kc * 16 * 128, kBM * 128, 1024, kSwizzle128B), true);
  }
  wgmma_commit_group();
  wgmma_wait_group<1>();  // dP^T; dV may still run
  wgmma_fence_operand(dp);
  wgmma_bwd_dsoft<S>(dp, s, lse_s + kBM, visible_bits, t);
  wgmma_bwd_pack<kBM, Ops>(da, dp);
  wgmma_fence_operand(dk);
  wgmma_fence();
  HSAP_UNROLL
  for (int kc = 0; kc < kBM / 16; ++kc) {
    wgmma_m64k16_rs<S::kD, kBf16, true>(
        dk, da[kc], wgmma_desc(qt + kc * 16 * 128, kBM * 128, 1024, kSwizzle128B), true);
  }
  wgmma_commit_group();
  meanwhile();
  wgmma_wait_group<0>();
  wgmma_fence_operand(dv);
  wgmma_fence_operand(dk);
  HSAP_UNROLL
  for (int kc = 0; kc < kBM / 16; ++kc) {
    wgmma_fwd_pin(pa[kc]);
    wgmma_fwd_pin(da[kc]);
  }
}

// Key item: dK, dV of key rows [kt0, kt1) of kv head kvh. `tiles` counts the query tiles the
// CTA has loaded (stage and mbarrier parity), `kv_loads` its K/V loads.
template <class Cfg>
HSAP_DEV void wgmma_bwd_key_item(const BwdParams& p, const WgmmaBwdSmem<WgmmaBwdShape<Cfg>>& sm,
                                 const WgmmaBwdMaps& maps, int kvh, long long kt0, long long kt1,
                                 unsigned* tiles, unsigned* kv_loads) {
  using S = WgmmaBwdShape<Cfg>;
  using WalkCfg = WgmmaBwdWalkCfg<Cfg>;
  if (threadIdx.x == 0) {
    start_key_walk<WalkCfg>(*sm.walk, p);
    next_key_tile<WalkCfg>(*sm.walk, p, kvh, kt0, kt1, &sm.tile[0]);
  }
  // The walk's tile is read after this barrier; a query item's generic stores to this memory
  // are ordered before the TMA loads that overwrite it.
  fence_proxy_async_shared();
  __syncthreads();
  MmaTile cur = sm.tile[0];
  if (!cur.valid) {
    __syncthreads();  // everyone has read the tile before thread 0 starts the next item
    return;           // no query sees these keys
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  if (threadIdx.x == 0) {
    mbarrier_arrive_expect_tx(sm.kv_full, 2 * S::kKBytes);
    HSAP_UNROLL
    for (int pn = 0; pn < S::kPanels; ++pn) {
      tma_load_3d(sm.k + pn * S::kBN * 128, maps.k, pn * 64, kvh, static_cast<int>(kt0),
                  sm.kv_full);
      tma_load_3d(sm.v + pn * S::kBN * 128, maps.v, pn * 64, kvh, static_cast<int>(kt0),
                  sm.kv_full);
    }
  }
  unsigned n = *tiles;
  wgmma_bwd_issue_stage<S>(sm, maps, static_cast<int>(n & 1u), cur);
  wgmma_bwd_stage_stats<S>(sm, p, static_cast<int>(n & 1u), cur);
  if (threadIdx.x == 0) next_key_tile<WalkCfg>(*sm.walk, p, kvh, kt0, kt1, &sm.tile[1]);
  float dk[S::kD / 2], dv[S::kD / 2];
  HSAP_UNROLL
  for (int i = 0; i < S::kD / 2; ++i) dk[i] = dv[i] = 0.0f;
  mbarrier_wait_parity(sm.kv_full, (*kv_loads)++ & 1u);
  // Tile i of the item (stage n % 2) in hand, tile i + 1 described in slot (i + 1) % 2. The
  // next tile's stats and the walk to tile i + 2 (into slot i % 2, whose tile every thread
  // read before this iteration's barrier) run while tile i's dK is on the tensor cores, so
  // that their global loads and the walk's scan are off the warpgroup's critical path.
  for (unsigned i = 0;; ++i, ++n) {
    const int st = static_cast<int>(n & 1u);
    // Every thread is done with stage st ^ 1 (its wgmma waited) and wrote stage st's stats;
    // thread 0 described tile i + 1.
    __syncthreads();
    const MmaTile nxt = sm.tile[(i + 1) & 1u];
    if (nxt.valid) wgmma_bwd_issue_stage<S>(sm, maps, st ^ 1, nxt);
    mbarrier_wait_parity(&sm.full[st], (n >> 1) & 1u);
    if (cur.rows < S::kBM) wgmma_bwd_zero_tail<S>(sm, st, cur.rows);
    wgmma_bwd_tile<Cfg, S>(dk, dv, sm, st, cur, p, warp, g, t, [&] {
      if (!nxt.valid) return;  // uniform
      wgmma_bwd_stage_stats<S>(sm, p, st ^ 1, nxt);
      if (threadIdx.x == 0) next_key_tile<WalkCfg>(*sm.walk, p, kvh, kt0, kt1, &sm.tile[i & 1u]);
      __syncwarp();  // warp 0 reconverges before the .aligned wait_group
    });
    if (!nxt.valid) break;
    cur = nxt;
  }
  *tiles = n + 1;
  // One writer per (key row, kv head): plain adds, deterministic. Accumulator element 4j + e:
  // key 16 warp + g + 8 (e >> 1), column 8j + 2t + (e & 1).
  HSAP_UNROLL
  for (int j = 0; j < S::kD / 8; ++j) {
    HSAP_UNROLL
    for (int e = 0; e < 4; ++e) {
      const long long kr = kt0 + 16 * warp + g + 8 * (e >> 1);
      if (kr < kt1) {
        const long long idx =
            (kr * p.heads_kv + kvh) * static_cast<long long>(S::kD) + 8 * j + 2 * t + (e & 1);
        p.dk[idx] += dk[4 * j + e] * p.scale;
        p.dv[idx] += dv[4 * j + e];
      }
    }
  }
  __syncthreads();  // shared memory is reused by the next item
}

// One key tile of a dq item: S = Q K^T and dP = dO V^T (64 query rows x 64 keys; two wgmma
// groups, P computed while dP runs), then dS = P (dP - delta) masked per element exactly as
// mma_bwd_query_item, then dQ += dS K (K through the MN-major descriptor: K = keys, N = head
// dim). Q and dO are in sm.k and sm.v,
// the key tile's K and V in stage st's Q and dO places.
template <class Cfg, class S, class Meanwhile>
HSAP_DEV void wgmma_bwd_dq_tile(float (&dq)[S::kD / 2], const WgmmaBwdSmem<S>& sm, int st,
                                const MmaTile& cur, const float (&row_lse)[2],
                                const float (&row_delta)[2], float scale, int warp, int g, int t,
                                Meanwhile&& meanwhile) {
  using Ops = MmaOps<typename Cfg::T>;
  constexpr bool kBf16 = WgmmaIsBf16<typename Cfg::T>::kValue;
  constexpr int kBN = S::kBN;
  const unsigned char* kt = sm.q_stage(st);
  const unsigned char* vt = sm.do_stage(st);
  float s[kBN / 2], dp[kBN / 2];
  HSAP_UNROLL
  for (int i = 0; i < kBN / 2; ++i) s[i] = dp[i] = 0.0f;
  wgmma_fence_operand(s);
  wgmma_fence_operand(dp);
  wgmma_fence();
  HSAP_UNROLL
  for (int kk = 0; kk < S::kD / 16; ++kk) {
    const int off = (kk / 4) * 64 * 128 + (kk % 4) * 32;
    wgmma_m64k16_ss<kBN, kBf16, false>(s, wgmma_desc(sm.k + off, 16, 1024, kSwizzle128B),
                                       wgmma_desc(kt + off, 16, 1024, kSwizzle128B), kk > 0);
  }
  wgmma_commit_group();
  HSAP_UNROLL
  for (int kk = 0; kk < S::kD / 16; ++kk) {
    const int off = (kk / 4) * 64 * 128 + (kk % 4) * 32;
    wgmma_m64k16_ss<kBN, kBf16, false>(dp, wgmma_desc(sm.v + off, 16, 1024, kSwizzle128B),
                                       wgmma_desc(vt + off, 16, 1024, kSwizzle128B), kk > 0);
  }
  wgmma_commit_group();
  wgmma_wait_group<1>();  // S; dP may still run: P meanwhile
  wgmma_fence_operand(s);
  unsigned visible_bits = 0;
  HSAP_UNROLL
  for (int i = 0; i < kBN / 2; ++i) {
    const int r = 16 * warp + g + 8 * ((i % 4) >> 1);
    const int c = 8 * (i / 4) + 2 * t + (i & 1);
    const float lse_r = row_lse[(i % 4) >> 1];
    const bool visible = r < cur.rows && c < cur.key_hi && c - r >= cur.rel_lo &&
                         c - r <= cur.rel_hi && lse_r != neg_inf();
    s[i] = visible ? prob_from_log2(s[i], scale * kLog2E, lse_r) : 0.0f;
    visible_bits |= (visible ? 1u : 0u) << i;
  }
  wgmma_wait_group<0>();
  wgmma_fence_operand(dp);
  HSAP_UNROLL
  for (int i = 0; i < kBN / 2; ++i) {
    dp[i] = (visible_bits >> i) & 1u ? s[i] * (dp[i] - row_delta[(i % 4) >> 1]) : 0.0f;
  }
  unsigned da[kBN / 16][4];
  wgmma_bwd_pack<kBN, Ops>(da, dp);
  wgmma_fence_operand(dq);
  wgmma_fence();
  HSAP_UNROLL
  for (int kc = 0; kc < kBN / 16; ++kc) {
    wgmma_m64k16_rs<S::kD, kBf16, true>(
        dq, da[kc], wgmma_desc(kt + kc * 16 * 128, 64 * 128, 1024, kSwizzle128B), true);
  }
  wgmma_commit_group();
  meanwhile();
  wgmma_wait_group<0>();
  wgmma_fence_operand(dq);
  HSAP_UNROLL
  for (int kc = 0; kc < kBN / 16; ++kc) wgmma_fwd_pin(da[kc]);
}

// Key tile t of a dq item into stage st: thread 0 arms full[st] and loads its K and V (the
// boxes of 64 keys from t.k0) where a key item's Q and dO go.
template <class S>
HSAP_DEV void wgmma_bwd_issue_keys(const WgmmaBwdSmem<S>& sm, const WgmmaBwdMaps& maps, int kvh,
                                   int st, const MmaTile& t) {
  if (threadIdx.x != 0) return;
  mbarrier_arrive_expect_tx(&sm.full[st], 2 * S::kKBytes);
  const int k0 = static_cast<int>(t.k0);
  HSAP_UNROLL
  for (int pn = 0; pn < S::kPanels; ++pn) {
    tma_load_3d(sm.q_stage(st) + pn * 64 * 128, maps.k, pn * 64, kvh, k0, &sm.full[st]);
    tma_load_3d(sm.do_stage(st) + pn * 64 * 128, maps.v, pn * 64, kvh, k0, &sm.full[st]);
  }
}

// Zeroes K rows [cols, 64) of stage st (keys past the tile's valid ones, e.g. the next
// document's, whose non-finite values would reach dQ as 0 * inf) for the async proxy.
template <class S>
HSAP_DEV void wgmma_bwd_zero_key_tail(const WgmmaBwdSmem<S>& sm, int st, int cols) {
  const int chunks = (64 - cols) * 8;
  for (int i = threadIdx.x; i < S::kPanels * chunks; i += S::kThreads) {
    const int pn = i / chunks, c = i % chunks;
    unsigned* dst =
        reinterpret_cast<unsigned*>(sm.q_stage(st) + pn * 64 * 128 + cols * 128 + c * 16);
    dst[0] = dst[1] = dst[2] = dst[3] = 0u;
  }
  fence_proxy_async_shared();
  __syncthreads();
}

// dq item (deterministic dq, mma_bwd_query_item's organisation on wgmma): dq of block b of
// query head h in 64-row chunks, over the block's segments and their 64-key tiles in order;
// dQ in registers, added once per chunk: a fixed reduction order, bitwise reproducible.
template <class Cfg>
HSAP_DEV void wgmma_bwd_query_item(const BwdParams& p, const WgmmaBwdSmem<WgmmaBwdShape<Cfg>>& sm,
                                   const WgmmaBwdMaps& maps, int b, int h, unsigned* tiles,
                                   unsigned* qd_loads) {
  using S = WgmmaBwdShape<Cfg>;
  const int kvh = kv_head<Cfg>(p.kv_head_of_q, p.heads_q, p.heads_kv, h, p.error_flag);
  if (kvh < 0) return;
  const QueryBlock qb = p.blocks[b];
  if (!block_rows_in_range(qb, p.q_rows, p.error_flag)) return;
  MmaQueryWalk* walk = reinterpret_cast<MmaQueryWalk*>(sm.walk);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  unsigned n = *tiles;
  for (long long q0 = qb.q_begin; q0 < qb.q_end; q0 += 64) {
    const int rows = static_cast<int>(min64(64, qb.q_end - q0));
    float row_lse[2], row_delta[2];
    load_row_stats(p, h, q0, rows, 16 * warp + g, row_lse, row_delta);
    if (threadIdx.x == 0) {
      walk->si = qb.seg_begin - 1;
      walk->k0 = walk->k_hi = 0;
      next_query_tile<Cfg, 64>(*walk, p, qb, q0, rows, &sm.tile[0]);
    }
    fence_proxy_async_shared();  // earlier generic stores, before the TMA loads below
    __syncthreads();
    MmaTile cur = sm.tile[0];
    if (!cur.valid) {
      __syncthreads();  // no key is visible to the chunk: its dq is unchanged
      continue;
    }
    if (threadIdx.x == 0) {
      mbarrier_arrive_expect_tx(sm.kv_full, 2 * S::kKBytes);
      HSAP_UNROLL
      for (int pn = 0; pn < S::kPanels; ++pn) {
        tma_load_3d(sm.k + pn * 64 * 128, maps.q, pn * 64, h, static_cast<int>(q0), sm.kv_full);
        tma_load_3d(sm.v + pn * 64 * 128, maps.dout, pn * 64, h, static_cast<int>(q0), sm.kv_full);
      }
    }
    wgmma_bwd_issue_keys<S>(sm, maps, kvh, static_cast<int>(n & 1u), cur);
    if (threadIdx.x == 0) next_query_tile<Cfg, 64>(*walk, p, qb, q0, rows, &sm.tile[1]);
    float dq[S::kD / 2];
    HSAP_UNROLL
    for (int i = 0; i < S::kD / 2; ++i) dq[i] = 0.0f;
    mbarrier_wait_parity(sm.kv_full, (*qd_loads)++ & 1u);
    // As the key items: tile i in hand, tile i + 1 in slot (i + 1) % 2, the walk to tile
    // i + 2 while tile i's dQ is on the tensor cores.
    for (unsigned i = 0;; ++i, ++n) {
      const int st = static_cast<int>(n & 1u);
      __syncthreads();  // every thread is done with stage st ^ 1; tile i + 1 is described
      const MmaTile nxt = sm.tile[(i + 1) & 1u];
      if (nxt.valid) wgmma_bwd_issue_keys<S>(sm, maps, kvh, st ^ 1, nxt);
      mbarrier_wait_parity(&sm.full[st], (n >> 1) & 1u);
      if (cur.key_hi < 64) wgmma_bwd_zero_key_tail<S>(sm, st, cur.key_hi);
      wgmma_bwd_dq_tile<Cfg, S>(dq, sm, st, cur, row_lse, row_delta, p.scale, warp, g, t, [&] {
        if (threadIdx.x == 0 && nxt.valid) {
          next_query_tile<Cfg, 64>(*walk, p, qb, q0, rows, &sm.tile[i & 1u]);
        }
        __syncwarp();  // warp 0 reconverges before the .aligned wait_group
      });
      if (!nxt.valid) break;
      cur = nxt;
    }
    ++n;
    HSAP_UNROLL
    for (int j = 0; j < S::kD / 8; ++j) {
      HSAP_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int r = 16 * warp + g + 8 * (e >> 1);
        if (r < rows) {
          float* out = p.dq + ((q0 + r) * p.heads_q + h) * static_cast<long long>(S::kD);
          out[8 * j + 2 * t + (e & 1)] += dq[4 * j + e] * p.scale;
        }
      }
    }
    __syncthreads();  // Q, dO, the stages and the walk are reused by the next chunk or item
  }
  *tiles = n;
}

// attn_bwd_wgmma_kernel<Cfg>: BwdParams' contract (attn_bwd_mma_kernel) on 128 threads with
// Cfg::kWgmmaBwdSmemBytes of dynamic shared memory and the tensor maps of p.q, p.k, p.v and
// p.dout (lib/cuda/exec/wgmma_tensor_maps.h EncodeWgmmaBackwardMaps: boxes of 64 elements x 1
// head x kWgmmaBwdBlockM rows for q and dout, 64 rows for k and v, 128-byte swizzle).
template <class Cfg>
__global__ void __launch_bounds__(128, 1)
    attn_bwd_wgmma_kernel(const BwdParams p, const __grid_constant__ TensorMap tq,
                          const __grid_constant__ TensorMap tk,
                          const __grid_constant__ TensorMap tv,
                          const __grid_constant__ TensorMap tdo) {
  using S = WgmmaBwdShape<Cfg>;
  static_assert(Cfg::kWgmmaBwd && Cfg::kWgmmaBwdSmemBytes == S::kSmemBytes,
                "hsap: generator and device disagree on the sm_90a backward's shared memory");
  static_assert(sizeof(MmaKeyWalk) + 2 * sizeof(MmaTile) <= 256 &&
                    sizeof(MmaQueryWalk) <= sizeof(MmaKeyWalk) && sizeof(MmaKeyWalk) % 8 == 0,
                "hsap: the walk's state and two tiles outgrew their shared memory");
  if (!tensors_aligned16(p.error_flag, p.q, p.k, p.v, p.dout)) return;  // uniform
  const WgmmaBwdSmem<S> sm(dynamic_smem());
  const WgmmaBwdMaps maps{&tq, &tk, &tv, &tdo};
  if (threadIdx.x == 0) {
    mbarrier_init(sm.kv_full, 1);
    mbarrier_init(&sm.full[0], 1);
    mbarrier_init(&sm.full[1], 1);
    fence_barrier_init();
    prefetch_tensormap(&tq);
    prefetch_tensormap(&tk);
    prefetch_tensormap(&tv);
    prefetch_tensormap(&tdo);
  }
  __syncthreads();
  const long long key_tiles = (p.k_rows + S::kBN - 1) / S::kBN;
  const long long key_items = key_tiles * p.heads_kv;
  const long long query_items = static_cast<long long>(p.num_blocks) * p.heads_q;
  unsigned tiles = 0, kv_loads = 0;
  for (unsigned int step = 0;; ++step) {
    const long long item = static_cast<long long>(blockIdx.y) * gridDim.x + blockIdx.x +
                           static_cast<long long>(step) * gridDim.x * gridDim.y;
    if (item >= key_items + query_items) break;
    if (item < key_items) {  // split by subtraction, as attn_bwd_mma_kernel
      long long kt = item;
      int kvh = 0;
      while (kt >= key_tiles) {
        kt -= key_tiles;
        ++kvh;
      }
      wgmma_bwd_key_item<Cfg>(p, sm, maps, kvh, kt * S::kBN, min64((kt + 1) * S::kBN, p.k_rows),
                              &tiles, &kv_loads);
    } else {
      long long b = item - key_items;
      int h = 0;
      while (b >= p.num_blocks) {
        b -= p.num_blocks;
        ++h;
      }
      wgmma_bwd_query_item<Cfg>(p, sm, maps, static_cast<int>(b), h, &tiles, &kv_loads);
    }
  }
}

}  // namespace hsap_dev

#endif  // defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(HSAP_DEVICE_EMULATION)
#endif  // HSAP_JIT_DEVICE_HSAP_ATTENTION_WGMMA_BWD_CUH_
