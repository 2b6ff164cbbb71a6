// The sm_90a forward: the "fwd" kernel of configurations generated for arch "sm_90a"
// (jit/codegen_cuda.h CudaWgmmaForwardApplies: bf16/f16, head dim 64, 128 or 256), in the
// manner of FlashAttention-3: TMA loads into a ring of shared-memory stages guarded by
// mbarriers (hsap_tma.cuh), wgmma with fp32 accumulators in registers (hsap_wgmma.cuh), and
// warp specialization with register reallocation. Same Params, work lists, masking, NaN/inf
// rules and partial (out, lse) merge as the mma.sync core (hsap_attention_mma_fwd.cuh), whose
// softmax (mma_fwd_softmax_scores) and epilogue (mma_fwd_merge) it calls on the same fragment
// layout.
//
// CTA: 384 threads, three warpgroups (grid (num_blocks, heads_q), one work-list block of one
// head per CTA, walked in chunks of kBM = 128 query rows):
//   - warpgroup 0, the producer, gives registers back (setmaxnreg.dec to 24); its thread 0
//     walks the chunks and their key tiles in work-list order (KeyTileWalk) and issues the TMA
//     loads: the chunk's Q tile once into q_full (with the chunk's tile count), then each K/V
//     tile of kBN keys into stage n % kStages after waiting for that stage's `empty` barrier,
//     writing the tile's descriptor (KeyTileInfo: first key, band, valid keys, masked) into
//     the stage's slot and arming `full[stage]` with the tile's bytes
//     (mbarrier.arrive.expect_tx; the loads complete the transaction);
//   - warpgroups 1 and 2, the consumers (setmaxnreg.inc to 240), own query rows [0, 64) and
//     [64, 128) of the chunk. Per tile: wait full[stage]; S = Q K^T by wgmma m64nKBNk16 with
//     both operands in shared memory (kD / 16 k-steps); online softmax in fp32 on the
//     accumulator registers; P rounded to bf16/f16 in registers as the A operand of
//     O += P V by wgmma m64nDk16 (A from registers, V through a transposed descriptor);
//     release the stage (every consumer thread arrives on empty[stage]). After the chunk's
//     last tile they release Q (q_empty) and merge (O / l, lse) into out/lse.
// Overlap: while the consumers compute tile n the producer has the next kStages - 1 tiles in
// flight; within a consumer warpgroup, FlashAttention-3's two-stage pipelining (S of tile
// n + 1 and P V of tile n issued together, the softmax of tile n + 1 running while P V of
// tile n is on the tensor cores; wgmma_fwd_consume); across the two consumer warpgroups, at
// head dims 64 and 128, FlashAttention-3's ping-pong (wgmma_fwd_take_turn: they take turns at
// issuing their GEMMs on two named barriers, so that one's softmax overlaps the other's
// GEMMs). An mbarrier pair instead of the named barriers spilled 16-112 bytes at d 128 and
// 256 (the try_wait loops inside the pipelined region).
//
// Shared memory (the base aligned up to 1024 bytes of the CTA's shared window, so that every
// tile starts on a 1024-byte atom of the 128-byte swizzle with the descriptors' base offset 0):
//   Q: kD / 64 panels of [128 rows][64 elements]; K and V stages: kD / 64 panels of
//   [kBN rows][64 elements] each; a panel row is 128 bytes, TMA writes it with the 128-byte
//   swizzle (CU_TENSOR_MAP_SWIZZLE_128B): within each 1024-byte group of 8 rows the 16-byte
//   chunk c of row r lands at chunk c ^ (r % 8) (tests/support/emulated_swizzle.h);
//   then the mbarriers full[kStages], empty[kStages], q_full, q_empty, fix, the tile
//   descriptors [kStages] and the chunk's tile count.
// Tensor maps (built on the host, lib/cuda/exec/wgmma_tensor_maps.h, passed by value as
// __grid_constant__ parameters): 3-D over (head dim, heads, rows) of the 16-bit q, k, v
// tensors ([rows, heads, D]), boxes of (64, 1, 128) for Q and (64, 1, kBN) for K and V,
// 128-byte swizzle, out-of-bounds elements zero-filled. A box that crosses the tensor's end
// reads zeros; one that crosses a segment's end reads other documents' rows: their scores are
// masked, and V rows past the tile's valid keys are zeroed in shared memory before P V (a
// NaN or inf there would otherwise reach O as 0 * inf).
//
// wgmma operand layouts (PTX ISA, "Asynchronous Warpgroup Level Matrix Shared Memory Layout",
// "Matrix Descriptor Format"; the same canonical layouts CUTLASS names GMMA K-major and
// MN-major SW128):
//   - Q (A of S = Q K^T) and K (B, K-major: a key's head-dim elements are contiguous): the
//     128-byte swizzled K-major layout, 8-row groups 1024 bytes apart (stride byte offset
//     1024; the leading byte offset is unused for swizzled K-major layouts). k-step kk of 16
//     elements (32 bytes) starts at panel kk / 4, byte (kk % 4) * 32 of the row: the
//     descriptor's start address advances by 32 bytes inside the atom, and the unit applies
//     the swizzle to the address it forms.
//   - V (B of O = P V, MN-major: a key row holds the N = head-dim elements contiguously;
//     imm-trans-b = 1): the 128-byte swizzled MN-major layout: 64 N-elements per 128-byte row,
//     8 K-rows (keys) per 1024-byte atom; leading byte offset = the distance between 64-wide
//     N panels (kBN * 128 bytes), stride byte offset = the distance between 8-key groups
//     (1024). k-step kc of 16 keys starts 16 * 128 bytes further.
// Accumulator layout (PTX ISA, "Register Fragments and Shared Memory Matrix Layouts" for
// wgmma .m64nNk16, matrix D): warp w of the warpgroup holds rows [16w, 16w + 16); in it lane
// 4g + t holds, for each 8-column block j < N / 8, d[4j + 0..1] = (row g, columns 8j + 2t,
// 8j + 2t + 1) and d[4j + 2..3] = (row g + 8, same columns): mma.sync m16n8's C fragment
// repeated along N. Seen as float[N / 8][4] it is the mma.sync core's s[j][4] / o[j][4], so
// its softmax and epilogue apply unchanged (row statistics over the four lanes of a quad).
// The A operand from registers (wgmma .m64nNk16 with A in registers, .bf16/.f16) has
// mma.sync m16n8k16's A layout per warp: a0 = (g, 2t..2t+1), a1 = (g + 8, 2t..), a2 =
// (g, 2t + 8..), a3 = (g + 8, 2t + 8..): the packed S fragments of 8-column blocks 2kc and
// 2kc + 1 (as in mma_fwd_pv).
#ifndef HSAP_JIT_DEVICE_HSAP_ATTENTION_WGMMA_FWD_CUH_
#define HSAP_JIT_DEVICE_HSAP_ATTENTION_WGMMA_FWD_CUH_

#if defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(HSAP_DEVICE_EMULATION)

#include "hsap_attention.cuh"
#include "hsap_attention_mma_fwd.cuh"
#include "hsap_device.cuh"
#include "hsap_params.cuh"
#include "hsap_tma.cuh"
#include "hsap_wgmma.cuh"
#include "hsap_worklist.cuh"

namespace hsap_dev {

template <int kD_, int kBN_, int kStages_>
struct WgmmaFwdShape {
  static constexpr int kD = kD_, kBN = kBN_, kStages = kStages_;
  static constexpr int kBM = 128;           // query rows per CTA: 64 per consumer warpgroup
  static constexpr int kThreads = 384;      // producer + 2 consumer warpgroups
  static constexpr int kPanels = kD / 64;   // 64-element (128-byte) panels of the head dim
  static constexpr int kNTiles = kBN / 8;   // 8-column blocks of S (mma_fwd_softmax)
  static constexpr int kDTiles = kD / 8;    // 8-column blocks of O (mma_fwd_softmax, _merge)
  static constexpr int kQBytes = kBM * kD * 2;
  static constexpr int kTileBytes = kBN * kD * 2;  // one K or V tile
  static constexpr int kKOffset = kQBytes;
  static constexpr int kVOffset = kKOffset + kStages * kTileBytes;
  static constexpr int kBarOffset = kVOffset + kStages * kTileBytes;
  static constexpr int kNumBars = 2 * kStages + 3;
  static constexpr int kInfoOffset = kBarOffset + 8 * kNumBars;    // KeyTileInfo[kStages]
  static constexpr int kChunkOffset = kInfoOffset + 32 * kStages;  // the chunk's tile count
  // 1 KiB of alignment slack first (jit/codegen_cuda.cc WgmmaFwdSmemBytes: same formula).
  static constexpr int kSmemBytes = 1024 + kChunkOffset + 16;
  static constexpr int kConsumerThreads = 256;
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;  // 128*24 + 256*240 <= 65536
  // The consumers take turns at issuing their GEMMs (wgmma_fwd_take_turn) at head dims up to
  // 128, where FlashAttention-3 does; at 256 they run side by side until a GPU compares both.
  static constexpr bool kPingPong = kD <= 128;
  static_assert(kD == 64 || kD == 128 || kD == 256,
                "hsap: the sm_90a forward takes head dims 64, 128 and 256 (64-element panels)");
  static_assert(kBN % 16 == 0 && kBN >= 16 && kBN <= 256,
                "hsap: the sm_90a forward's key tile is a multiple of 16 in [16, 256] (wgmma N)");
  static_assert(kStages >= 2, "hsap: the TMA ring needs at least two stages");
  static_assert(kTileBytes % 1024 == 0 && kQBytes % 1024 == 0,
                "hsap: every tile must start on a 1024-byte swizzle atom");
};

template <class Cfg>
using WgmmaFwdShapeOf = WgmmaFwdShape<Cfg::kHeadDim, Cfg::kWgmmaBlockN, Cfg::kWgmmaStages>;

// wgmma's operand type: .bf16 for bf16 storage, .f16 for f16.
template <class T>
struct WgmmaIsBf16 {
  static constexpr bool kValue = false;
};
template <>
struct WgmmaIsBf16<bf16> {
  static constexpr bool kValue = true;
};

// The offset of `p` in the CTA's shared window (the address the swizzle is applied to).
HSAP_DEV unsigned shared_window_offset(const void* p) {
#ifdef HSAP_DEVICE_EMULATION
  return static_cast<unsigned>(reinterpret_cast<const char*>(p) -
                               reinterpret_cast<const char*>(hsap_emu_dynamic_smem()));
#else
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
#endif
}

// The shared-memory tiles and barriers of one CTA.
template <class S>
struct WgmmaFwdSmem {
  unsigned char* q;  // 1024-aligned in the shared window
  unsigned char* k;
  unsigned char* v;
  unsigned long long* full;   // [kStages]: the stage's K and V tiles have landed
  unsigned long long* empty;  // [kStages]: both consumer warpgroups are done with the stage
  unsigned long long* q_full;
  unsigned long long* q_empty;
  unsigned long long* fix;  // the consumers zeroed a tile's V rows past its valid keys
  KeyTileInfo* info;        // [kStages]
  int* chunk_tiles;         // the tiles of the chunk whose Q is in q (written with Q)

  HSAP_DEV explicit WgmmaFwdSmem(void* raw) {
    unsigned char* base = static_cast<unsigned char*>(raw);
    base += (1024u - shared_window_offset(base) % 1024u) % 1024u;
    q = base;
    k = base + S::kKOffset;
    v = base + S::kVOffset;
    full = reinterpret_cast<unsigned long long*>(base + S::kBarOffset);
    empty = full + S::kStages;
    q_full = empty + S::kStages;
    q_empty = q_full + 1;
    fix = q_empty + 1;
    info = reinterpret_cast<KeyTileInfo*>(base + S::kInfoOffset);
    chunk_tiles = reinterpret_cast<int*>(base + S::kChunkOffset);
  }
  HSAP_DEV unsigned char* k_stage(int s) const { return k + s * S::kTileBytes; }
  HSAP_DEV unsigned char* v_stage(int s) const { return v + s * S::kTileBytes; }
};

// The producer: thread 0 of warpgroup 0 issues every TMA load of the CTA's block.
template <class Cfg, class S>
HSAP_DEV void wgmma_fwd_produce(const WgmmaFwdSmem<S>& sm, const TensorMap* tq,
                                const TensorMap* tk, const TensorMap* tv, long long k_rows,
                                int h, int kvh, const QueryBlock qb, const KeySegment* segments,
                                unsigned int* error_flag) {
  prefetch_tensormap(tq);
  prefetch_tensormap(tk);
  prefetch_tensormap(tv);
  unsigned n = 0, chunk = 0;  // tiles and chunks issued so far
  for (long long q0 = qb.q_begin; q0 < qb.q_end; q0 += S::kBM, ++chunk) {
    const int rows = static_cast<int>(min64(S::kBM, qb.q_end - q0));
    // A fresh barrier's phase 0 is incomplete, so waiting on parity 1 (the phase "before"
    // it) passes at once: the first use of every empty barrier does not wait.
    mbarrier_wait_parity(sm.q_empty, (chunk & 1u) ^ 1u);
    using Walk = KeyTileWalk<Cfg::kHasBand, S::kBN>;
    Walk walk{segments, qb.seg_begin, qb.seg_end, q0, rows, k_rows, error_flag, KeySegment{},
              false,    0,            0};
    int tiles = 0;
    for (walk.enter(); walk.valid(); walk.next()) ++tiles;
    *sm.chunk_tiles = tiles;  // published by the arrive on q_full
    mbarrier_arrive_expect_tx(sm.q_full, S::kQBytes);
    HSAP_UNROLL
    for (int p = 0; p < S::kPanels; ++p) {
      tma_load_3d(sm.q + p * S::kBM * 128, tq, p * 64, h, static_cast<int>(q0), sm.q_full);
    }
    walk = Walk{segments, qb.seg_begin, qb.seg_end, q0, rows, k_rows, nullptr, KeySegment{},
                false,    0,            0};  // the same tiles again (reported above)
    for (walk.enter(); walk.valid(); walk.next(), ++n) {
      const int stage = static_cast<int>(n % S::kStages);
      mbarrier_wait_parity(&sm.empty[stage], ((n / S::kStages) & 1u) ^ 1u);
      sm.info[stage] = walk.info();
      mbarrier_arrive_expect_tx(&sm.full[stage], 2 * S::kTileBytes);
      const int k0 = static_cast<int>(walk.k0);
      HSAP_UNROLL
      for (int p = 0; p < S::kPanels; ++p) {
        tma_load_3d(sm.k_stage(stage) + p * S::kBN * 128, tk, p * 64, kvh, k0, &sm.full[stage]);
        tma_load_3d(sm.v_stage(stage) + p * S::kBN * 128, tv, p * 64, kvh, k0, &sm.full[stage]);
      }
    }
  }
}

// Zeroes rows [cols, kBN) of the V tile (every panel; a row is 128 bytes whatever the
// swizzle, which only permutes the chunks inside it) and hands it to the async proxy. The
// 256 consumer threads split the rows and meet at the `fix` barrier (its `phase`).
template <class S>
HSAP_DEV void wgmma_fwd_zero_v_tail(unsigned char* vt, int cols, int ct, unsigned long long* fix,
                                    unsigned phase) {
  const int chunks = (S::kBN - cols) * 8;  // 16-byte chunks per panel
  for (int i = ct; i < chunks * S::kPanels; i += S::kConsumerThreads) {
    const int p = i / chunks, c = i % chunks;
    unsigned* dst = reinterpret_cast<unsigned*>(vt + p * S::kBN * 128 + cols * 128 + c * 16);
    dst[0] = dst[1] = dst[2] = dst[3] = 0u;
  }
  fence_proxy_async_shared();  // the generic-proxy stores, before wgmma reads them
  mbarrier_arrive(fix);
  mbarrier_wait_parity(fix, phase);
}

// Pins P's registers around the asynchronous window of the P V that reads them, as
// wgmma_fence_operand does for accumulators (hsap_wgmma.cuh): the compiler must not move the
// next tile's packing above the wait.
HSAP_DEV void wgmma_fwd_pin(unsigned (&p)[4]) {
#ifndef HSAP_DEVICE_EMULATION
  asm volatile("" : "+r"(p[0]), "+r"(p[1]), "+r"(p[2]), "+r"(p[3])::"memory");
#endif
}

// Issues S = Q K^T for this warpgroup's 64 rows (q_wg: its first row in panel 0) and the
// tile's kBN keys as one wgmma group (kD / 16 k-steps); s is written when the group completes.
template <class S, bool kBf16>
HSAP_DEV void wgmma_fwd_issue_scores(float (&s)[S::kBN / 2], const unsigned char* q_wg,
                                     const unsigned char* kt) {
  HSAP_UNROLL
  for (int i = 0; i < S::kBN / 2; ++i) s[i] = 0.0f;
  wgmma_fence_operand(s);  // the zeros stay before the fence (hsap_wgmma.cuh)
  wgmma_fence();           // s was written by ordinary instructions
  HSAP_UNROLL
  for (int kk = 0; kk < S::kD / 16; ++kk) {
    const int panel = kk / 4, byte = (kk % 4) * 32;
    const unsigned long long a =
        wgmma_desc(q_wg + panel * S::kBM * 128 + byte, 16, 1024, kSwizzle128B);
    const unsigned long long b =
        wgmma_desc(kt + panel * S::kBN * 128 + byte, 16, 1024, kSwizzle128B);
    wgmma_m64k16_ss<S::kBN, kBf16, false>(s, a, b, kk > 0);
  }
  wgmma_commit_group();
}

// Issues O += P V as one wgmma group: p holds P packed to bf16/f16 pairs in the A layout
// (k-step kc: the S blocks 2kc and 2kc + 1), V goes through the MN-major descriptor. o and p
// must not be touched until the group completes.
template <class S, bool kBf16>
HSAP_DEV void wgmma_fwd_issue_pv(float (&o)[S::kD / 2], const unsigned (&p)[S::kBN / 16][4],
                                 const unsigned char* vt) {
  wgmma_fence_operand(o);  // the rescale stays before the fence
  wgmma_fence();           // o (rescaled) and p were written by ordinary instructions
  HSAP_UNROLL
  for (int kc = 0; kc < S::kBN / 16; ++kc) {
    const unsigned long long b = wgmma_desc(vt + kc * 16 * 128, S::kBN * 128, 1024, kSwizzle128B);
    wgmma_m64k16_rs<S::kD, kBf16, true>(o, p[kc], b, true);
  }
  wgmma_commit_group();
}

// P (the softmaxed scores, fp32) packed into the A fragments of P V.
template <class S, class Ops>
HSAP_DEV void wgmma_fwd_pack_p(unsigned (&p)[S::kBN / 16][4], const float (&s)[S::kBN / 2]) {
  HSAP_UNROLL
  for (int kc = 0; kc < S::kBN / 16; ++kc) {
    const float* x = s + 8 * kc;  // blocks 2kc (x[0..3]) and 2kc + 1 (x[4..7])
    p[kc][0] = Ops::pack(x[0], x[1]);
    p[kc][1] = Ops::pack(x[2], x[3]);
    p[kc][2] = Ops::pack(x[4], x[5]);
    p[kc][3] = Ops::pack(x[6], x[7]);
  }
}

// One consumer thread's state over a chunk: the running softmax of its two rows, the O
// accumulator, the scores of the tile in hand and P of the tile whose P V is next.
template <class S>
struct WgmmaFwdRows {
  FoldedOnlineSoftmax smx[2];
  bool saw_key[2];
  float o[S::kD / 2];
  float s[S::kBN / 2];
  unsigned p[S::kBN / 16][4];
  float rescale[2];

  HSAP_DEV void init() {
    smx[0].init();
    smx[1].init();
    saw_key[0] = saw_key[1] = false;
    HSAP_UNROLL
    for (int i = 0; i < S::kD / 2; ++i) o[i] = 0.0f;
  }
  // The masked online softmax of s (the tile `info` describes, at the chunk's q0, rows): s
  // becomes P (fp32), rescale the factor o needs before this tile's P V.
  // warp_rows_valid: all 16 rows of the calling warp are rows of the chunk. Warp-uniform: the
  // per-score test runs only where the band or the tile's edges cut the warp's 16 x kBN scores.
  HSAP_DEV void softmax(const KeyTileInfo& info, long long q0, int rows, int row0, int t,
                        float scale_log2, bool warp_rows_valid) {
    const TileMask mask = tile_mask(info, q0, rows);
    auto& s4 = reinterpret_cast<float(&)[S::kNTiles][4]>(s);
    if (!mask.masked && mask.cols == S::kBN && warp_rows_valid) {
      mma_fwd_softmax_scores<S, true>(s4, rescale, smx, saw_key, mask, row0, t, scale_log2);
    } else {
      mma_fwd_softmax_scores<S, false>(s4, rescale, smx, saw_key, mask, row0, t, scale_log2);
    }
  }
};

// FlashAttention-3's ping-pong of the two consumer warpgroups (S::kPingPong): they take
// turns at issuing their GEMMs, so that one's softmax runs while the other's GEMMs hold the
// tensor cores. Warpgroup wg waits for its turn at named barrier 1 + wg (its own 128 threads
// and the other warpgroup's 128 arrivals) and, once its GEMMs are issued, gives the turn to
// the other at the other's barrier; warpgroup 1 gives warpgroup 0 the first turn. Both take
// as many turns (the same chunks and tiles), so the turns alternate to the end, and the
// last arrival is left pending when the CTA exits. The mbarriers in between (full, fix,
// q_full) are waited for before a turn is taken, so no turn waits on a warpgroup that
// waits for it.
template <class S>
HSAP_DEV void wgmma_fwd_first_turn(int wg) {
  if constexpr (S::kPingPong) {
    if (wg == 1) named_barrier_arrive<1, S::kConsumerThreads>();
  }
}
template <class S>
HSAP_DEV void wgmma_fwd_take_turn(int wg) {
  if constexpr (S::kPingPong) {
    if (wg == 0) {
      named_barrier_sync<1, S::kConsumerThreads>();
    } else {
      named_barrier_sync<2, S::kConsumerThreads>();
    }
  }
}
template <class S>
HSAP_DEV void wgmma_fwd_pass_turn(int wg) {
  if constexpr (S::kPingPong) {
    if (wg == 0) {
      named_barrier_arrive<2, S::kConsumerThreads>();
    } else {
      named_barrier_arrive<1, S::kConsumerThreads>();
    }
  }
}

// Waits for tile n's K and V (stage n % kStages) and returns what the producer said of it;
// when the tile holds fewer than kBN valid keys, zeroes its V rows past them first.
template <class S>
HSAP_DEV KeyTileInfo wgmma_fwd_acquire(const WgmmaFwdSmem<S>& sm, unsigned n, int ct,
                                       unsigned* fixes) {
  const int stage = static_cast<int>(n % S::kStages);
  mbarrier_wait_parity(&sm.full[stage], (n / S::kStages) & 1u);
  const KeyTileInfo info = sm.info[stage];
  if (info.cols < S::kBN) {
    wgmma_fwd_zero_v_tail<S>(sm.v_stage(stage), info.cols, ct, sm.fix, (*fixes)++ & 1u);
  }
  return info;
}

// The consumers: warpgroup wg (0 or 1 after the producer) computes rows [64 wg, 64 wg + 64)
// of every chunk. FlashAttention-3's intra-warpgroup pipelining: with S of tile i in hand as
// P, the loop issues S = Q K^T of tile i + 1, then O += P V of tile i, waits for the first
// group only, and runs the softmax of tile i + 1 while P V of tile i is still on the tensor
// cores; it then waits for P V (before O is rescaled and P overwritten, which the ISA forbids
// while the wgmma that reads them is pending) and releases tile i's stage.
template <class Cfg, class S>
HSAP_DEV void wgmma_fwd_consume(const WgmmaFwdSmem<S>& sm, float* out, float* lse,
                                long long q_rows, int heads_q, int h, float scale,
                                const QueryBlock qb) {
  using T = typename Cfg::T;
  using Ops = MmaOps<T>;
  constexpr bool kBf16 = WgmmaIsBf16<T>::kValue;
  const int ct = static_cast<int>(threadIdx.x) - 128;  // consumer thread, 0..255
  const int wg = ct / 128, warp = (ct % 128) / 32, lane = ct % 32;
  const int g = lane / 4, t = lane % 4;
  const int row0 = wg * 64 + warp * 16 + g;  // this lane's row g in the chunk
  const float scale_log2 = scale * kLog2E;
  const unsigned char* q_wg = sm.q + wg * 64 * 128;
  unsigned n = 0, chunk = 0, fixes = 0;  // tiles and chunks consumed, V fixes
  WgmmaFwdRows<S> r;
  wgmma_fwd_first_turn<S>(wg);
  for (long long q0 = qb.q_begin; q0 < qb.q_end; q0 += S::kBM, ++chunk) {
    const int rows = static_cast<int>(min64(S::kBM, qb.q_end - q0));
    const bool warp_rows_valid = wg * 64 + warp * 16 + 16 <= rows;
    r.init();
    mbarrier_wait_parity(sm.q_full, chunk & 1u);
    const int tiles = *sm.chunk_tiles;
    if (tiles > 0) {  // prologue: S of the first tile, softmaxed, as P
      const KeyTileInfo info = wgmma_fwd_acquire<S>(sm, n, ct, &fixes);
      wgmma_fwd_take_turn<S>(wg);
      wgmma_fwd_issue_scores<S, kBf16>(r.s, q_wg, sm.k_stage(n % S::kStages));
      wgmma_fwd_pass_turn<S>(wg);
      wgmma_wait_group<0>();
      wgmma_fence_operand(r.s);
      r.softmax(info, q0, rows, row0, t, scale_log2, warp_rows_valid);
      mma_fwd_rescale<S>(reinterpret_cast<float(&)[S::kDTiles][4]>(r.o), r.rescale);
      wgmma_fwd_pack_p<S, Ops>(r.p, r.s);
    }
    // Tile n is in hand as P. The branch-free steady state (ptxas must see which group
    // wait_group<1> leaves pending, or it serializes every wgmma), then the last tile.
    for (int i = 0; i + 1 < tiles; ++i, ++n) {
      const int stage = static_cast<int>(n % S::kStages);
      const KeyTileInfo info = wgmma_fwd_acquire<S>(sm, n + 1, ct, &fixes);
      wgmma_fwd_take_turn<S>(wg);
      wgmma_fwd_issue_scores<S, kBf16>(r.s, q_wg, sm.k_stage((n + 1) % S::kStages));
      wgmma_fwd_issue_pv<S, kBf16>(r.o, r.p, sm.v_stage(stage));
      wgmma_fwd_pass_turn<S>(wg);
      wgmma_wait_group<1>();  // S of tile n + 1; P V of tile n may still run
      wgmma_fence_operand(r.s);
      r.softmax(info, q0, rows, row0, t, scale_log2, warp_rows_valid);
      wgmma_wait_group<0>();  // P V of tile n: o and p are free, the stage is read
      wgmma_fence_operand(r.o);
      HSAP_UNROLL
      for (int kc = 0; kc < S::kBN / 16; ++kc) wgmma_fwd_pin(r.p[kc]);
      mbarrier_arrive(&sm.empty[stage]);
      mma_fwd_rescale<S>(reinterpret_cast<float(&)[S::kDTiles][4]>(r.o), r.rescale);
      wgmma_fwd_pack_p<S, Ops>(r.p, r.s);
    }
    if (tiles > 0) {
      wgmma_fwd_take_turn<S>(wg);
      wgmma_fwd_issue_pv<S, kBf16>(r.o, r.p, sm.v_stage(n % S::kStages));
      wgmma_fwd_pass_turn<S>(wg);
      wgmma_wait_group<0>();
      wgmma_fence_operand(r.o);
      mbarrier_arrive(&sm.empty[n % S::kStages]);
      ++n;
    }
    mbarrier_arrive(sm.q_empty);  // every S of the chunk has completed
    mma_fwd_merge<S>(reinterpret_cast<const float(&)[S::kDTiles][4]>(r.o), r.smx, r.saw_key,
                     scale_log2, out, lse, q_rows, heads_q, h, q0, rows, row0, t);
  }
}

// CTA (block, blockIdx.y) of attn_fwd_wgmma_kernel<Cfg> (below): FwdParams' contract
// (hsap_params.cuh, attn_fwd_kernel), on 384 threads with Cfg::kWgmmaSmemBytes of dynamic
// shared memory, and the tensor maps of p.q, p.k, p.v described above. The checks that skip
// a CTA are uniform over it and come before any barrier is used.
template <class Cfg>
HSAP_DEV void wgmma_fwd_block(const FwdParams& p, int block, const TensorMap* tq,
                              const TensorMap* tk, const TensorMap* tv) {
  using S = WgmmaFwdShapeOf<Cfg>;
  static_assert(Cfg::kWgmmaFwd && Cfg::kWgmmaSmemBytes == S::kSmemBytes,
                "hsap: generator and device disagree on the sm_90a forward's shared memory");
  if (block >= p.num_blocks || static_cast<int>(blockIdx.y) >= p.heads_q) return;
  const int h = blockIdx.y;
  const int kvh = kv_head<Cfg>(p.kv_head_of_q, p.heads_q, p.heads_kv, h, p.error_flag);
  if (kvh < 0) return;
  const QueryBlock qb = p.blocks[block];
  if (!block_rows_in_range(qb, p.q_rows, p.error_flag)) return;
  if (!tensors_aligned16(p.error_flag, p.q, p.k, p.v)) return;
  const WgmmaFwdSmem<S> sm(dynamic_smem());
  if (threadIdx.x == 0) {
    for (int s = 0; s < S::kStages; ++s) {
      mbarrier_init(&sm.full[s], 1);  // the producer's arrive.expect_tx
      mbarrier_init(&sm.empty[s], S::kConsumerThreads);
    }
    mbarrier_init(sm.q_full, 1);
    mbarrier_init(sm.q_empty, S::kConsumerThreads);
    mbarrier_init(sm.fix, S::kConsumerThreads);
    fence_barrier_init();
  }
  __syncthreads();
  if (threadIdx.x < 128) {
    setmaxnreg_dec<S::kProducerRegs>();
    if (threadIdx.x == 0) {
      wgmma_fwd_produce<Cfg, S>(sm, tq, tk, tv, p.k_rows, h, kvh, qb, p.segments, p.error_flag);
    }
  } else {
    setmaxnreg_inc<S::kConsumerRegs>();
    wgmma_fwd_consume<Cfg, S>(sm, p.out, p.lse, p.q_rows, p.heads_q, h, p.scale, qb);
  }
}

// attn_fwd_wgmma_kernel<Cfg>: grid (num_blocks, heads_q), CTA (b, h) as wgmma_fwd_block.
template <class Cfg>
__global__ void __launch_bounds__(384, 1)
    attn_fwd_wgmma_kernel(const FwdParams p, const __grid_constant__ TensorMap tq,
                          const __grid_constant__ TensorMap tk,
                          const __grid_constant__ TensorMap tv) {
  wgmma_fwd_block<Cfg>(p, static_cast<int>(blockIdx.x), &tq, &tk, &tv);
}

// Part `part` of a FusedCopy (hsap_params.cuh) on the kThreads threads of a CTA; word: a
// shared word for thread 0's verdict.
template <int kThreads>
HSAP_DEV void fused_copy_part(const FusedCopy& c, int part, unsigned int* error_flag,
                              volatile unsigned int* word) {
  if (threadIdx.x == 0) {
    bool arrived = true;
    if (c.ready_flag != nullptr) {
      arrived = wait_geq_sys_until(c.ready_flag, c.ready_value, c.ready_timeout_ns);
      if (!arrived) report(error_flag, kErrorPeerTimeout);
    }
    *word = arrived ? 1u : 0u;
  }
  __syncthreads();
  if (*word != 0) {
    copy_slice<kThreads>(c.k_dst, c.k_src, c.bytes, part, c.parts);
    copy_slice<kThreads>(c.v_dst, c.v_src, c.bytes, part, c.parts);
  }
  if (c.consumed_flag != nullptr) cta_signal_add_sys(c.consumed_flag, 1);
}

// fused_fwd_wgmma_kernel<Cfg>: one launch of the sm_90a fused forward (FusedCopy,
// hsap_params.cuh): copy CTAs first in the grid, so that they start before the attention's.
template <class Cfg>
__global__ void __launch_bounds__(384, 1)
    fused_fwd_wgmma_kernel(const FwdParams p, const FusedCopy copy,
                           const __grid_constant__ TensorMap tq,
                           const __grid_constant__ TensorMap tk,
                           const __grid_constant__ TensorMap tv) {
  const int block = static_cast<int>(blockIdx.x) - copy.parts;
  if (block < 0) {
    if (blockIdx.y == 0) {
      fused_copy_part<384>(copy, static_cast<int>(blockIdx.x), p.error_flag,
                           reinterpret_cast<volatile unsigned int*>(dynamic_smem()));
    }
    return;
  }
  wgmma_fwd_block<Cfg>(p, block, &tq, &tk, &tv);
}

}  // namespace hsap_dev

#endif  // defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(HSAP_DEVICE_EMULATION)
#endif  // HSAP_JIT_DEVICE_HSAP_ATTENTION_WGMMA_FWD_CUH_
