// The sm_90a backward's data and per-tile math (the kernel, its roles and their protocol:
// hsap_attention_wgmma_bwd.cuh, whose header states the design): the CTA's shape and shared
// memory, the stage slot the producer fills, and one consumer warpgroup's work on one stage
// tile, of a key item (wgmma_bwd_tile: S^T, dP^T, P^T, dS^T, dV, dK) or of a dq chunk
// (wgmma_bwd_dq_tile: S, dP, dS, dQ), both on accumulators in registers with the mma.sync
// backward's per-element rules.
#ifndef HSAP_JIT_DEVICE_HSAP_ATTENTION_WGMMA_BWD_TILE_CUH_
#define HSAP_JIT_DEVICE_HSAP_ATTENTION_WGMMA_BWD_TILE_CUH_

#if defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(HSAP_DEVICE_EMULATION)

#include "hsap_attention_mma_bwd.cuh"
#include "hsap_attention_wgmma_fwd.cuh"
#include "hsap_device.cuh"
#include "hsap_params.cuh"
#include "hsap_sync.cuh"
#include "hsap_tma.cuh"
#include "hsap_wgmma.cuh"

namespace hsap_dev {

template <class Cfg>
struct WgmmaBwdShape {
  static constexpr int kD = Cfg::kHeadDim;
  // A consumer warpgroup's keys of a key item, or rows of a dq chunk: wgmma M.
  static constexpr int kBN = 64;
  static constexpr int kItemKeys = 2 * kBN;   // keys per key item (both warpgroups)
  static constexpr int kChunkRows = 2 * kBN;  // query rows per dq chunk (both warpgroups)
  // A stage's tile: a key item's query rows (N of S^T, dP^T; K of dV, dK) or a dq chunk's
  // keys (N of S, dP; K of dQ).
  static constexpr int kBM = Cfg::kWgmmaBwdBlockM;
  static constexpr int kBoxRows = Cfg::kWgmmaBwdBoxRows;  // TMA boxes' rows, all four maps
  static constexpr int kStages = 2;                       // WgmmaBwdPipe counts them in two bits
  static constexpr int kThreads = 384;                    // producer + 2 consumer warpgroups
  static constexpr int kConsumerThreads = 256;
  // setmaxnreg's counts. They share the registers the launch gave the CTA, kLaunchRegs per
  // thread (ptxas' count under __launch_bounds__(384, 1); the compile test holds the kernel
  // to it): a .inc waits for registers a .dec released, so counts summing to more would hang
  // (the emulator faults). 40 + 2 x 232 = 3 x 168. The producer's walk spills at 24 and 32,
  // and the consumers' dK, dV (D), S^T, dP^T (kBM) and the rest fit 232 at the tiles chosen.
  static constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;
  static constexpr int kProducerRegs = 40, kConsumerRegs = 232;
  static constexpr int kPanels = kD / 64;
  static constexpr int kHalfBytes = kBN * kD * 2;  // one warpgroup's K or V (dq: Q or dO)
  static constexpr int kKBytes = 2 * kHalfBytes;   // K or V of the item
  static constexpr int kQBytes = kBM * kD * 2;     // Q or dO of one stage (dq: K or V)
  static constexpr int kVOffset = kKBytes;
  static constexpr int kQOffset = 2 * kKBytes;  // stage s: Q, then dO kQBytes further
  static constexpr int kPBytes = kBN * 128;     // P^T or dS^T of a warpgroup: 128-byte rows
  static constexpr int kPOffset = kQOffset + kStages * 2 * kQBytes;  // [warpgroup][P^T, dS^T]
  static constexpr int kStatsOffset = kPOffset + 4 * kPBytes;        // [stage][lse, delta][kBM]
  static constexpr int kCtrlOffset = kStatsOffset + kStages * 2 * kBM * 4;
  static constexpr int kBarOffset = kCtrlOffset + 256;
  static constexpr int kNumBars = 2 + 2 * kStages;  // fixed_full, fixed_empty, full[], empty[]
  static constexpr int kSmemBytes = 1024 + kBarOffset + 8 * kNumBars;
  static_assert(kD == 64 || kD == 128,
                "hsap: the sm_90a backward takes head dims 64 and 128 (dK + dV of 64 keys are "
                "D fp32 registers per thread of a consumer warpgroup)");
  static_assert(kBM % 16 == 0 && kBM >= 16 && kBM <= 64,
                "hsap: the stage tile is 16..64 rows in steps of 16 (the K of dV, dK and dQ; a "
                "row of P^T fits one 128-byte swizzled row; one visibility bit per element)");
  static_assert(kBoxRows > 0 && kBM % kBoxRows == 0 && kBN % kBoxRows == 0 &&
                    (kBoxRows == 64 || kBoxRows == 32 || kBoxRows == 16) &&
                    (kBM % (2 * kBoxRows) != 0 || kBN % (2 * kBoxRows) != 0),
                "hsap: the generator's box rows must be gcd(64, kBM) (jit::WgmmaBwdBoxRows)");
  static_assert(Cfg::kDeterministicDq,
                "hsap: the sm_90a backward computes dq in a fixed order only (kDeterministicDq)");
  static_assert(kQBytes % 1024 == 0 && kHalfBytes % 1024 == 0 && kPBytes % 1024 == 0,
                "hsap: every tile must start on a 1024-byte swizzle atom");
  static_assert(kProducerRegs * 128 + kConsumerRegs * kConsumerThreads <= kLaunchRegs * kThreads,
                "hsap: setmaxnreg's counts take more registers than the launch gave the CTA (the "
                "consumers' .inc would wait forever)");
  static_assert(kStages == 2, "hsap: WgmmaBwdPipe counts the stages in two bits");
};

// What the producer says of a stage (its slot, which the consumers read after `full` and
// until they release the stage): a tile of a key item or of a dq chunk, with its Q and dO (or
// K and V) loaded into the stage; the end of a key item or dq chunk (no data), with what its
// epilogue writes; or the end of the CTA's work. The consumers keep no item state of their
// own (FlashAttention-3's scheduler publishes its work tiles the same way): all their
// registers go to the tile loop.
enum WgmmaBwdSlotKind : int {
  kBwdKeyTile,    // tile: a query tile of the key item
  kBwdQueryTile,  // tile: a key tile of the dq chunk
  kBwdKeyEnd,     // keys [lo, hi) of kv head `head` are done
  kBwdQueryEnd,   // rows [lo, hi) of query head `head` are done
  kBwdDone,       // no more work
};
struct WgmmaBwdSlot {
  MmaTile tile;
  int kind;          // WgmmaBwdSlotKind
  int head;          // key item: kv head; dq chunk: query head
  long long lo, hi;  // key item: keys [lo, hi); dq chunk: rows [lo, hi)
};

// The CTA's shared memory: every address is a constant offset from the aligned base (one
// register for all of them in the consumers' code).
template <class S>
struct WgmmaBwdSmem {
  unsigned char* base;

  HSAP_DEV explicit WgmmaBwdSmem(void* raw) {
    base = static_cast<unsigned char*>(raw);
    base += (1024u - shared_window_offset(base) % 1024u) % 1024u;
  }
  // K and V of a key item (dq: Q and dO of the chunk), warpgroup w's 64 rows of each.
  HSAP_DEV unsigned char* k_half(int w) const { return base + w * S::kHalfBytes; }
  HSAP_DEV unsigned char* v_half(int w) const { return base + S::kVOffset + w * S::kHalfBytes; }
  // Stage s: Q, then dO kQBytes further (dq: K, V); its lse and delta [lse, delta][kBM].
  HSAP_DEV unsigned char* q_stage(int s) const { return base + S::kQOffset + s * 2 * S::kQBytes; }
  HSAP_DEV unsigned char* do_stage(int s) const { return q_stage(s) + S::kQBytes; }
  // Warpgroup w's P^T (i = 0) or dS^T (i = 1): [64 keys][kBM queries] in rows of 128 bytes,
  // K-major, 128-byte swizzle (the A operand of dV += P^T dO, dK += dS^T Q).
  HSAP_DEV unsigned char* p_tile(int w, int i) const {
    return base + S::kPOffset + (2 * w + i) * S::kPBytes;
  }
  HSAP_DEV float* lse_stage(int s) const {
    return reinterpret_cast<float*>(base + S::kStatsOffset) + s * 2 * S::kBM;
  }
  HSAP_DEV MmaKeyWalk* walk() const {  // the producer's
    return reinterpret_cast<MmaKeyWalk*>(base + S::kCtrlOffset);
  }
  HSAP_DEV WgmmaBwdSlot* slot(int s) const {  // what the producer says of stage s
    return reinterpret_cast<WgmmaBwdSlot*>(base + S::kCtrlOffset + sizeof(MmaKeyWalk)) + s;
  }
  // The producer's item counter (its `step`), kept here like the walk: the producer has 40
  // registers, and the walk needs them.
  HSAP_DEV unsigned* producer_step() const {
    return reinterpret_cast<unsigned*>(base + S::kCtrlOffset + 252);
  }
  HSAP_DEV unsigned long long* bar(int i) const {
    int offset = S::kBarOffset + 8 * i;
    wgmma_opaque(offset);  // formed at each use, not hoisted out of the loops and held
    return reinterpret_cast<unsigned long long*>(base + offset);
  }
  // The item's fixed tiles (K and V; dq: the chunk's Q and dO) arrived / are released.
  HSAP_DEV unsigned long long* fixed_full() const { return bar(0); }
  HSAP_DEV unsigned long long* fixed_empty() const { return bar(1); }
  HSAP_DEV unsigned long long* full(int s) const { return bar(2 + s); }
  HSAP_DEV unsigned long long* empty(int s) const { return bar(2 + S::kStages + s); }
};

// Whether keys [key_lo, key_hi) and query rows [row_lo, row_hi) of tile t (local to its
// corner) hold a visible pair of its band (t.rel_lo <= key - row <= t.rel_hi): a consumer
// warpgroup whose part of the tile holds none skips the tile's GEMMs (exact: its P and dS
// would be 0), so that a key item's warpgroup does not multiply another document's rows.
HSAP_DEV bool wgmma_bwd_part_sees(const MmaTile& t, int key_lo, int key_hi, int row_lo,
                                  int row_hi) {
  key_lo = key_lo > t.key_lo ? key_lo : t.key_lo;
  key_hi = key_hi < t.key_hi ? key_hi : t.key_hi;
  row_hi = row_hi < t.rows ? row_hi : t.rows;
  return key_lo < key_hi && row_lo < row_hi && key_hi - 1 - row_lo >= t.rel_lo &&
         key_lo - (row_hi - 1) <= t.rel_hi;
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

// P^T of a key item's tile in place from S^T (s) of the warpgroup's keys (from key_off of
// the item): exp(scale S^T - lse) where the pair is visible, else 0 (selected), exactly as
// mma_bwd_probs_t; returns the visibility bits (bit i: element i of s), which dS^T reuses.
template <class S>
HSAP_DEV unsigned wgmma_bwd_probs(float (&s)[S::kBM / 2], const float* lse_s, const MmaTile cur,
                                  int key_off, float scale, int warp, int g, int t) {
  static_assert(S::kBM / 2 <= 32, "hsap: one visibility bit per accumulator element");
  // Element i is key k0 + h (h = 8 ((i % 4) >> 1)) and query column q0 + c (c = 8 (i / 4) +
  // (i & 1)). The tests compare the thread's k0, q0 and k0 - q0 with the tile's bounds shifted
  // by the element's constants: the bounds are loaded after the GEMMs, so the shifted ones
  // are formed there and die at once, where per-element key and column indices would be
  // formed by ptxas before the GEMMs complete and held across them.
  const int k0 = key_off + 16 * warp + g, q0 = 2 * t, d0 = k0 - q0;
  unsigned visible_bits = 0;
  HSAP_UNROLL
  for (int i = 0; i < S::kBM / 2; ++i) {
    const int h = 8 * ((i % 4) >> 1), c = 8 * (i / 4) + (i & 1);
    const float row_lse = lse_s[q0 + c];
    const bool visible = k0 >= cur.key_lo - h && k0 < cur.key_hi - h && q0 < cur.rows - c &&
                         d0 >= cur.rel_lo - h + c && d0 <= cur.rel_hi - h + c &&
                         row_lse != neg_inf();
    s[i] = visible ? prob_from_log2(s[i], scale * kLog2E, row_lse) : 0.0f;
    visible_bits |= (visible ? 1u : 0u) << i;
  }
  return visible_bits;
}

// dS^T in place from dP^T (dp) and P^T (s): P^T (dP^T - delta) where visible, else 0.
template <class S>
HSAP_DEV void wgmma_bwd_dsoft(float (&dp)[S::kBM / 2], const float (&s)[S::kBM / 2],
                              const float* delta_s, unsigned visible_bits, int t) {
  const float* delta_t = delta_s + 2 * t;
  HSAP_UNROLL
  for (int i = 0; i < S::kBM / 2; ++i) {
    const float delta = delta_t[8 * (i / 4) + (i & 1)];
    dp[i] = (visible_bits >> i) & 1u ? s[i] * (dp[i] - delta) : 0.0f;
  }
}

// This thread's elements of an m64nNk16 accumulator x (N <= 64), rounded to the storage
// type, into a K-major tile of 64 rows of 128 bytes with the 128-byte swizzle (the layout TMA
// gives K, so the A descriptor is K's; columns past N unused): element (r, c) at byte
// r * 128 + ((2c / 16) ^ (r % 8)) * 16 + 2c % 16. Accumulator element 4j + e is row
// 16 warp + g + 8 (e >> 1), column 8j + 2t + (e & 1), so r % 8 = g, and a warp's 32 stores
// of column block j fall into 32 distinct banks.
template <int N, class Ops>
HSAP_DEV void wgmma_bwd_store_a(unsigned char* tile, const float (&x)[N / 2], int warp, int g,
                                int t) {
  static_assert(N % 16 == 0 && N <= 64, "hsap: one 128-byte swizzled row per accumulator row");
  HSAP_UNROLL
  for (int j = 0; j < N / 8; ++j) {
    HSAP_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int r = 16 * warp + g + 8 * h;
      *reinterpret_cast<unsigned*>(tile + r * 128 + (j ^ g) * 16 + 4 * t) =
          Ops::pack(x[4 * j + 2 * h], x[4 * j + 2 * h + 1]);
    }
  }
}

// The warpgroup's stores of an A tile, before its wgmma reads them: handed to the async proxy,
// then a barrier of the warpgroup's 128 threads (named barrier 2 + wg; 1 is both consumer
// warpgroups').
HSAP_DEV void wgmma_bwd_publish_a(int wg) {
  fence_proxy_async_shared();
  if (wg == 0) {
    named_barrier_sync<2, 128>();
  } else {
    named_barrier_sync<3, 128>();
  }
}

// A tile's two score products, each its own wgmma group, from zero: s = A B^T, then
// dp = A' B'^T (m64nNk16 over the head dim, both operands K-major in shared memory). A (a
// consumer warpgroup's K, or a dq chunk's Q: kBN rows per panel) has A' kVOffset after it
// (V, or dO); B (the stage's Q, or K: N = kBM rows per panel) has B' kQBytes after it (dO,
// or V). The key tiles' S^T, dP^T and the dq tiles' S, dP.
template <class S, int N, bool kBf16>
HSAP_DEV void wgmma_bwd_issue_scores(float (&s)[N / 2], float (&dp)[N / 2],
                                     unsigned long long a_desc, unsigned long long b_desc) {
  HSAP_UNROLL
  for (int i = 0; i < N / 2; ++i) s[i] = dp[i] = 0.0f;
  wgmma_fence_operand(s);
  wgmma_fence_operand(dp);
  wgmma_fence();
  HSAP_UNROLL
  for (int product = 0; product < 2; ++product) {
    HSAP_UNROLL
    for (int kk = 0; kk < S::kD / 16; ++kk) {  // k-step kk: panel kk / 4, byte (kk % 4) * 32
      const unsigned off_a = product * S::kVOffset + (kk / 4) * S::kBN * 128 + (kk % 4) * 32;
      const unsigned off_b = product * S::kQBytes + (kk / 4) * N * 128 + (kk % 4) * 32;
      wgmma_m64k16_ss<N, kBf16, false>(product == 0 ? s : dp, wgmma_desc_advance(a_desc, off_a),
                                       wgmma_desc_advance(b_desc, off_b), kk > 0);
    }
    wgmma_commit_group();
  }
}

// acc += A B, one wgmma group (m64nDk16, K = the tile's kBM query rows): A the warpgroup's
// P^T or dS^T in shared memory (K-major, k-step kc at byte kc * 32), B the stage's dO or Q
// read MN-major (k-step kc: rows 16 kc..). A key tile's dV and dK.
template <class S, bool kBf16>
HSAP_DEV void wgmma_bwd_issue_grad(float (&acc)[S::kD / 2], unsigned long long a_desc,
                                   unsigned long long b_mn_desc) {
  wgmma_fence_operand(acc);
  wgmma_fence();
  HSAP_UNROLL
  for (int kc = 0; kc < S::kBM / 16; ++kc) {
    wgmma_m64k16_ss<S::kD, kBf16, true>(acc, wgmma_desc_advance(a_desc, kc * 32),
                                        wgmma_desc_advance(b_mn_desc, kc * 16 * 128), true);
  }
  wgmma_commit_group();
}

// One query tile of a key item for the warpgroup's 64 keys (from key_off of the item),
// pipelined within the warpgroup: S^T and dP^T issued as two wgmma groups; P^T computed once
// S^T is in (dP^T still running), stored to shared memory, dV += P^T dO issued; dS^T computed
// once dP^T is in (dV still running), stored, dK += dS^T Q issued; then all waited for. P^T
// and dS^T go through shared memory (FlashAttention-3's way) rather than as register A
// fragments: next to dK and dV of 64 keys (D registers) and S^T and dP^T (kBM), the
// fragments' kBM / 2 more left ptxas spilling at head dim 128, even with 240 registers.
template <class Cfg, class S>
HSAP_DEV void wgmma_bwd_tile(float (&dk)[S::kD / 2], float (&dv)[S::kD / 2],
                             const WgmmaBwdSmem<S>& sm, int st, int key_off, const BwdParams& p,
                             int warp, int g, int t) {
  using Ops = MmaOps<typename Cfg::T>;
  constexpr bool kBf16 = WgmmaIsBf16<typename Cfg::T>::kValue;
  constexpr int kBM = S::kBM;
  const int wg = key_off / 64;
  // Every operand's descriptor derives from two: the warpgroup's K (V kVOffset after it) and
  // the stage's Q (dO kQBytes after it), so that ptxas holds two, not six, across the GEMMs.
  const unsigned long long k_desc = wgmma_desc(sm.k_half(wg), 16, 1024, kSwizzle128B);
  const unsigned long long q_desc = wgmma_desc(sm.q_stage(st), 16, 1024, kSwizzle128B);
  const unsigned long long do_desc = wgmma_desc_advance(q_desc, S::kQBytes);
  float s[kBM / 2], dp[kBM / 2];
  wgmma_bwd_issue_scores<S, kBM, kBf16>(s, dp, k_desc, q_desc);  // S^T = K Q^T, dP^T = V dO^T
  wgmma_wait_group<1>();  // S^T; dP^T may still run
  wgmma_fence_operand(s);
  // The masks' indices and the stores' addresses are derived from these here, in the tile,
  // not hoisted out of the tile loop by the compiler and held next to the accumulators (which
  // spilled: the compile test holds the kernel to none).
  wgmma_opaque(warp);
  wgmma_opaque(g);
  wgmma_opaque(t);
  const float* lse_s = sm.lse_stage(st);
  // The tile's bounds from its slot (valid until the stage is released), read here rather
  // than held in registers while the GEMMs run.
  const MmaTile cur = sm.slot(st)->tile;
  const unsigned visible_bits = wgmma_bwd_probs<S>(s, lse_s, cur, key_off, p.scale, warp, g, t);
  unsigned char* pt = sm.p_tile(wg, 0);
  wgmma_bwd_store_a<kBM, Ops>(pt, s, warp, g, t);
  wgmma_bwd_publish_a(wg);
  // A = P^T (K-major, k-step kc: byte kc * 32), B = dO MN-major (k-step kc: rows 16 kc..).
  const unsigned long long pt_desc = wgmma_desc(pt, 16, 1024, kSwizzle128B);
  const unsigned long long do_mn_desc = wgmma_desc_with_lbo(do_desc, kBM * 128);
  wgmma_bwd_issue_grad<S, kBf16>(dv, pt_desc, do_mn_desc);  // dV += P^T dO
  wgmma_wait_group<1>();  // dP^T; dV may still run
  wgmma_fence_operand(dp);
  wgmma_opaque(warp);
  wgmma_opaque(g);
  wgmma_opaque(t);
  wgmma_bwd_dsoft<S>(dp, s, lse_s + kBM, visible_bits, t);
  wgmma_bwd_store_a<kBM, Ops>(sm.p_tile(wg, 1), dp, warp, g, t);
  wgmma_bwd_publish_a(wg);
  const unsigned long long dst_desc = wgmma_desc_advance(pt_desc, S::kPBytes);  // dS^T
  const unsigned long long q_mn_desc = wgmma_desc_with_lbo(q_desc, kBM * 128);
  wgmma_bwd_issue_grad<S, kBf16>(dk, dst_desc, q_mn_desc);  // dK += dS^T Q
  wgmma_wait_group<0>();  // before the next tile's stores overwrite P^T and dS^T
  wgmma_fence_operand(dv);
  wgmma_fence_operand(dk);
}

// One key tile of a dq item for the warpgroup's 64 query rows (from row_off of the chunk):
// S = Q K^T and dP = dO V^T (64 query rows x kBM keys; two wgmma groups, P computed while dP
// runs), then dS = P (dP - delta) masked per element exactly as mma_bwd_query_item, then
// dQ += dS K (K through the MN-major descriptor: K = keys, N = head dim). The rows' Q and dO
// are in the warpgroup's halves of sm.k and sm.v, the key tile's K and V in stage st's Q and
// dO places.
template <class Cfg, class S>
HSAP_DEV void wgmma_bwd_dq_tile(float (&dq)[S::kD / 2], const WgmmaBwdSmem<S>& sm, int st,
                                int row_off, const float (&row_lse)[2], const float (&row_delta)[2],
                                float scale, int warp, int g, int t) {
  using Ops = MmaOps<typename Cfg::T>;
  constexpr bool kBf16 = WgmmaIsBf16<typename Cfg::T>::kValue;
  constexpr int kKeys = S::kBM;  // the key tile's
  const unsigned long long q_desc = wgmma_desc(sm.k_half(row_off / 64), 16, 1024, kSwizzle128B);
  const unsigned long long k_desc = wgmma_desc(sm.q_stage(st), 16, 1024, kSwizzle128B);
  float s[kKeys / 2], dp[kKeys / 2];
  wgmma_bwd_issue_scores<S, kKeys, kBf16>(s, dp, q_desc, k_desc);  // S = Q K^T, dP = dO V^T
  wgmma_wait_group<1>();  // S; dP may still run: P meanwhile
  wgmma_fence_operand(s);
  wgmma_opaque(warp);  // as wgmma_bwd_tile
  wgmma_opaque(g);
  wgmma_opaque(t);
  const MmaTile cur = sm.slot(st)->tile;  // as wgmma_bwd_tile
  unsigned visible_bits = 0;
  HSAP_UNROLL
  for (int i = 0; i < kKeys / 2; ++i) {
    const int r = row_off + 16 * warp + g + 8 * ((i % 4) >> 1);
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
  for (int i = 0; i < kKeys / 2; ++i) {
    dp[i] = (visible_bits >> i) & 1u ? s[i] * (dp[i] - row_delta[(i % 4) >> 1]) : 0.0f;
  }
  unsigned da[kKeys / 16][4];
  wgmma_bwd_pack<kKeys, Ops>(da, dp);
  const unsigned long long k_mn_desc = wgmma_desc_with_lbo(k_desc, kKeys * 128);
  wgmma_fence_operand(dq);
  wgmma_fence();
  HSAP_UNROLL
  for (int kc = 0; kc < kKeys / 16; ++kc) {
    wgmma_m64k16_rs<S::kD, kBf16, true>(dq, da[kc], wgmma_desc_advance(k_mn_desc, kc * 16 * 128),
                                        true);
  }
  wgmma_commit_group();
  wgmma_wait_group<0>();
  wgmma_fence_operand(dq);
  HSAP_UNROLL
  for (int kc = 0; kc < kKeys / 16; ++kc) wgmma_fwd_pin(da[kc]);
}

}  // namespace hsap_dev

#endif  // defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(HSAP_DEVICE_EMULATION)
#endif  // HSAP_JIT_DEVICE_HSAP_ATTENTION_WGMMA_BWD_TILE_CUH_
