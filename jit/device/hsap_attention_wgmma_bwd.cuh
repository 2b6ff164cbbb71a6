// The sm_90a backward: the "bwd" kernel of configurations generated for arch "sm_90a" with
// deterministic dq (jit/codegen_cuda.h CudaWgmmaBackwardApplies: bf16/f16, head dim 64 or
// 128). Same contract as attn_bwd_mma_kernel (BwdParams of hsap_params.cuh; dq, dk, dv fp32
// and added into; any grid), whose work items, walks, masks and NaN/inf rules it keeps
// (hsap_attention_mma_bwd.cuh), all on wgmma, in the manner of FlashAttention-3's backward:
// CTAs of 384 threads, a producer warpgroup and two consumer warpgroups (setmaxnreg: 40 and
// 232 registers of the launch's 168 per thread), walking grid-stride over
//   1. key items (kItemKeys = 128 key rows kt0..kt1 of kv head kvh): consumer warpgroup wg
//      keeps dK and dV of keys kt0 + 64 wg .. + 63 in registers (wgmma accumulators: warp w
//      holds keys 16w..16w+15 of them); both read every query tile that sees the item's keys
//      (next_key_tile: every query head of the kv head, every block and segment, kBM rows at a
//      time: 64 at head dim 64, 48 at 128), so that a tile loaded once serves 128 keys; per
//      tile and warpgroup
//        S^T = K Q^T, dP^T = V dO^T            (wgmma m64nkBMk16, A and B from shared memory)
//        P^T = exp(scale S^T - lse), dS^T = P^T (dP^T - delta)   (mma_bwd_probs_t, per element)
//        dV += P^T dO, dK += dS^T Q            (wgmma m64nDk16, A = P^T / dS^T stored to
//                                               shared memory, B = dO / Q MN-major)
//      and adds dK * scale and dV to dk / dv once: one writer per (key row, kv head), so dk and
//      dv are bitwise deterministic;
//   2. dq items (query block, head; kDeterministicDq's organisation, mma_bwd_query_item's): the
//      block in chunks of kChunkRows = 128 rows, warpgroup wg holding dQ of rows 64 wg .. + 63,
//      each chunk walking the block's segments and their kBM-key tiles in order
//      (next_query_tile), per tile and warpgroup
//        S = Q K^T, dP = dO V^T                (wgmma m64nkBMk16 from shared memory)
//        dS = P (dP - delta)                   (per element, as mma_bwd_query_item)
//        dQ += dS K                            (wgmma m64nDk16, dS from registers, K MN-major)
//      then adds dQ * scale to its rows: a fixed reduction order, bitwise reproducible.
//      Atomic-dq configurations keep the mma.sync backward.
// A warpgroup whose part of a tile (its 64 keys, or rows) sees none of the tile's pairs skips
// the tile's GEMMs (exact: its P and dS would be 0).
// The producer (warp 0 of warpgroup 0; the other three exit) walks the items and their tiles
// (its walk in shared memory) and issues the TMA loads (hsap_tma.cuh): an item's fixed tiles
// once (key item: its K and V; dq chunk: its Q and dO; mbarriers fixed_full / fixed_empty),
// each walked tile into a ring of two stages (key item: Q and dO and the rows' lse and delta;
// dq chunk: K and V; mbarriers full / empty), with the tile's description in the stage's slot
// (WgmmaBwdSlot). An item's end is a slot without data that says what the consumers' epilogue
// writes, so the consumers hold no item state (FlashAttention-3's scheduler publishes its work
// the same way). Rows a box reads past the tile's valid ones (other rows of the tensor, e.g.
// the next document's) are zeroed in shared memory by the consumers where a product would
// multiply them by a zero (key items: Q and dO rows past the tile's query rows; dq chunks: K
// rows past its valid keys), so that a NaN or inf there cannot reach dK, dV or dQ as
// 0 * inf; elsewhere the per-element select masks them.
// Overlap: the producer loads the next tile while the consumers compute this one; within a
// tile the GEMMs are separate wgmma groups and the elementwise work runs while the next group
// is on the tensor cores (wgmma_bwd_tile, wgmma_bwd_dq_tile); the two consumer warpgroups
// interleave freely. Not done against FlashAttention-3: overlap of GEMMs across tiles, and a
// dS^T round trip through shared memory instead of the dq items' recomputing S and dP (7 tile
// products instead of 5, like the mma.sync backward's deterministic mode).
//
// Layouts (as the forward, hsap_attention_wgmma_fwd.cuh, whose header states them): every tile
// is kD / 64 panels of [rows][64 elements], 128-byte rows written by TMA with the 128-byte
// swizzle in boxes of kBoxRows rows (gcd(64, kBM)), each panel on a 1024-byte atom. The A
// operands (K, V; dq chunks: Q, dO) and the B operands of S^T / S and dP^T / dP (Q, dO; dq
// chunks: K, V) are read K-major (the forward's Q and K); the B operands of dV, dK (dO, Q)
// and dQ (K) MN-major (the forward's V: leading byte offset = the panel distance, stride byte
// offset 1024). P^T and dS^T are stored K-major in that layout (64 rows of 128 bytes). The
// accumulators (64 rows x N columns) are mma.sync's C fragments per warp, so
// mma_bwd_probs_t's and the dq pass's per-element rules apply unchanged, and packed in pairs
// they are the A fragments of the RS wgmma (the forward's P).
//
// Shared memory from the first 1024-aligned byte of the dynamic window: K, V of 128 keys (dq
// chunks: Q, dO of 128 rows), two stages of Q and dO [kBM rows] (dq chunks: K, V), P^T and
// dS^T of each consumer warpgroup, lse and delta [2][2][kBM], the walk's state and the
// stages' slots (256 bytes), the mbarriers fixed_full, fixed_empty, full[2], empty[2]
// (WgmmaBwdShape::kSmemBytes; jit/codegen_cuda.cc WgmmaBwdSmemBytes: same formula).
//
// Required members of Cfg, beyond those of hsap_attention.cuh: kDeterministicDq (true),
// kWgmmaBwd, kWgmmaBwdBlockM (kBM), kWgmmaBwdBoxRows (gcd(64, kBM), checked),
// kWgmmaBwdSmemBytes (WgmmaBwdShape<Cfg>::kSmemBytes, checked).
#ifndef HSAP_JIT_DEVICE_HSAP_ATTENTION_WGMMA_BWD_CUH_
#define HSAP_JIT_DEVICE_HSAP_ATTENTION_WGMMA_BWD_CUH_

#if defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(HSAP_DEVICE_EMULATION)

#include "hsap_attention_mma_bwd.cuh"
#include "hsap_attention_wgmma_bwd_tile.cuh"
#include "hsap_device.cuh"
#include "hsap_params.cuh"
#include "hsap_sync.cuh"
#include "hsap_tma.cuh"
#include "hsap_wgmma.cuh"

namespace hsap_dev {

// The key walk with the sm_90a backward's query tile (next_key_tile reads kBwdBlockM).
template <class Cfg>
struct WgmmaBwdWalkCfg : Cfg {
  static constexpr int kBwdBlockM = Cfg::kWgmmaBwdBlockM;
};

// The four tensor maps (q, k, v, dout), as the kernel receives them.
struct WgmmaBwdMaps {
  const TensorMap *q, *k, *v, *dout;
};

// Where a role is in the stage ring and in the fixed tiles' loads, in one register (the
// consumers hold it through their tile loops next to the accumulators): bits 0-1 count the
// stages used mod 2 * kStages (bit 0: the stage, bit 1: its mbarrier phase parity), bit 2 the
// fixed loads' parity. Both roles advance theirs alike, so that they meet.
struct WgmmaBwdPipe {
  unsigned bits = 0;
  HSAP_DEV int stage() const { return static_cast<int>(bits & 1u); }
  HSAP_DEV unsigned phase() const { return (bits >> 1) & 1u; }
  HSAP_DEV void next_stage() { bits = (bits & ~3u) | ((bits + 1u) & 3u); }
  HSAP_DEV unsigned fixed_phase() const { return (bits >> 2) & 1u; }
  HSAP_DEV void next_fixed() { bits ^= 4u; }
};

// Item `step` of the CTA's grid-stride share, which the producer walks: the key items
// (kItemKeys keys kt0..kt1 of kv head kvh) then the dq items (work-list block b of query head
// h); valid = false past the last.
struct WgmmaBwdItem {
  bool valid, key;
  int head;        // kv head (key item) or query head (dq item)
  long long a, b;  // key item: kt0, kt1; dq item: block, unused
};
template <class Cfg>
HSAP_DEV WgmmaBwdItem wgmma_bwd_item(const BwdParams& p, unsigned step) {
  using S = WgmmaBwdShape<Cfg>;
  long long k_rows = p.k_rows;
  wgmma_opaque(k_rows);  // the split below per item, not hoisted and held across items
  const long long key_tiles = (k_rows + S::kItemKeys - 1) / S::kItemKeys;
  const long long key_items = key_tiles * p.heads_kv;
  const long long query_items = static_cast<long long>(p.num_blocks) * p.heads_q;
  const long long item = static_cast<long long>(blockIdx.y) * gridDim.x + blockIdx.x +
                         static_cast<long long>(step) * gridDim.x * gridDim.y;
  WgmmaBwdItem it{};
  if (item >= key_items + query_items) return it;  // valid = false
  long long rest = item < key_items ? item : item - key_items;
  const long long per_head = item < key_items ? key_tiles : p.num_blocks;
  int head = 0;
  while (rest >= per_head) {  // split by subtraction, as attn_bwd_mma_kernel
    rest -= per_head;
    ++head;
  }
  it.valid = true;
  it.key = item < key_items;
  it.head = head;
  it.a = it.key ? rest * S::kItemKeys : rest;
  it.b = it.key ? min64((rest + 1) * S::kItemKeys, k_rows) : 0;
  return it;
}

// ---- The producer: warp 0 of warpgroup 0. Per stage, lane 0 waits for its `empty`, walks
// to the next tile into its slot (or writes an end marker) and issues its TMA loads; the warp
// writes a key item's stage stats; every lane arrives on `full` (count 32), lane 0 with the
// tile's bytes. An item or chunk that no tile sees publishes nothing.

// The fixed tiles of an item (64 rows per tensor and panel for each consumer warpgroup, in
// boxes of kBoxRows), once the consumers released the last ones. Lane 0.
template <class S>
HSAP_DEV void wgmma_bwd_load_fixed(const WgmmaBwdSmem<S>& sm, const TensorMap* a,
                                   const TensorMap* b, int head, long long row0,
                                   const WgmmaBwdPipe& pipe) {
  // A fresh barrier's phase 0 is incomplete, so waiting on parity 1 passes at once.
  mbarrier_wait_parity(sm.fixed_empty(), pipe.fixed_phase() ^ 1u);
  mbarrier_arrive_expect_tx(sm.fixed_full(), 2 * S::kKBytes);
  HSAP_UNROLL
  for (int w = 0; w < 2; ++w) {
    HSAP_UNROLL
    for (int pn = 0; pn < S::kPanels; ++pn) {
      HSAP_UNROLL
      for (int r = 0; r < S::kBN; r += S::kBoxRows) {
        const int row = static_cast<int>(row0) + S::kBN * w + r;
        const int at = pn * S::kBN * 128 + r * 128;
        tma_load_3d(sm.k_half(w) + at, a, pn * 64, head, row, sm.fixed_full());
        tma_load_3d(sm.v_half(w) + at, b, pn * 64, head, row, sm.fixed_full());
      }
    }
  }
}

// Stage st's two tensors (a: Q or K; b: dO or V), kBM rows from row0 of head `head`, in
// boxes of kBoxRows. Lane 0.
template <class S>
HSAP_DEV void wgmma_bwd_load_stage(const WgmmaBwdSmem<S>& sm, const TensorMap* a,
                                   const TensorMap* b, int head, long long row0, int st) {
  mbarrier_arrive_expect_tx(sm.full(st), 2 * S::kQBytes);
  HSAP_UNROLL
  for (int pn = 0; pn < S::kPanels; ++pn) {
    HSAP_UNROLL
    for (int r = 0; r < S::kBM; r += S::kBoxRows) {
      const int row = static_cast<int>(row0) + r;
      const int at = pn * S::kBM * 128 + r * 128;
      tma_load_3d(sm.q_stage(st) + at, a, pn * 64, head, row, sm.full(st));
      tma_load_3d(sm.do_stage(st) + at, b, pn * 64, head, row, sm.full(st));
    }
  }
}

// Lane 0 of the producer: waits for the pipe's stage to be free and returns its slot.
template <class S>
HSAP_DEV WgmmaBwdSlot* wgmma_bwd_claim(const WgmmaBwdSmem<S>& sm, const WgmmaBwdPipe& pipe) {
  // A fresh barrier's phase 0 is incomplete, so waiting on parity 1 passes at once. Waiting
  // again for a phase that completed passes too (an unpublished slot is claimed twice).
  mbarrier_wait_parity(sm.empty(pipe.stage()), pipe.phase() ^ 1u);
  return sm.slot(pipe.stage());
}

// Every lane: publishes a slot without data (an end marker) and moves to the next stage.
template <class S>
HSAP_DEV void wgmma_bwd_publish_marker(const WgmmaBwdSmem<S>& sm, WgmmaBwdPipe* pipe) {
  mbarrier_arrive(sm.full(pipe->stage()));
  pipe->next_stage();
}

// A key item's query tile, described in the pipe's slot (claimed): the warp stages its rows'
// lse and delta, lane 0 loads its Q and dO; every lane arrives on `full`.
template <class Cfg>
HSAP_DEV void wgmma_bwd_publish_query_tile(const BwdParams& p,
                                           const WgmmaBwdSmem<WgmmaBwdShape<Cfg>>& sm,
                                           const WgmmaBwdMaps& maps, WgmmaBwdPipe* pipe) {
  using S = WgmmaBwdShape<Cfg>;
  const int lane = static_cast<int>(threadIdx.x), st = pipe->stage();
  const MmaTile& t = sm.slot(st)->tile;
  float* stats = sm.lse_stage(st);
  for (int r = lane; r < S::kBM; r += 32) {  // rows past the tile: -inf and 0
    const long long stat = static_cast<long long>(t.h) * p.q_rows + (t.q0 + r);
    stats[r] = r < t.rows ? p.lse[stat] * kLog2E : neg_inf();  // log2 units
    stats[S::kBM + r] = r < t.rows ? p.delta[stat] : 0.0f;
  }
  if (lane == 0) {
    wgmma_bwd_load_stage<S>(sm, maps.q, maps.dout, t.h, t.q0, st);
  } else {
    mbarrier_arrive(sm.full(st));  // after this lane's stats (release)
  }
  pipe->next_stage();
}

// Lane 0: claims the pipe's stage and walks the key item to its next query tile, into the
// slot (an end marker past the last). Returns the slot.
template <class Cfg>
HSAP_DEV WgmmaBwdSlot* wgmma_bwd_next_query_tile(const BwdParams& p,
                                                 const WgmmaBwdSmem<WgmmaBwdShape<Cfg>>& sm,
                                                 int kvh, long long kt0, long long kt1,
                                                 const WgmmaBwdPipe& pipe) {
  WgmmaBwdSlot* slot = wgmma_bwd_claim<WgmmaBwdShape<Cfg>>(sm, pipe);
  next_key_tile<WgmmaBwdWalkCfg<Cfg>>(*sm.walk(), p, kvh, kt0, kt1, &slot->tile);
  slot->kind = slot->tile.valid ? kBwdKeyTile : kBwdKeyEnd;
  slot->head = kvh;
  slot->lo = kt0;
  slot->hi = kt1;
  return slot;
}

// One item's (or dq chunk's) stages: lane 0 walks to the first tile (walk_first; nothing is
// published when there is none), loads the fixed tiles (load_fixed), then every tile is
// published (publish: the whole warp) and the next walked (walk_next, lane 0) until the end
// marker, which is published. (The first tile is walked apart from the others, so that no
// flag is held across the loop: the producer has 40 registers.)
template <class S, class WalkFirst, class WalkNext, class LoadFixed, class Publish>
HSAP_DEV void wgmma_bwd_produce_tiles(const WgmmaBwdSmem<S>& sm, WgmmaBwdPipe* pipe,
                                      WalkFirst&& walk_first, WalkNext&& walk_next,
                                      LoadFixed&& load_fixed, Publish&& publish) {
  const bool lane0 = threadIdx.x == 0;
  if (lane0) walk_first();
  __syncwarp();
  if (!sm.slot(pipe->stage())->tile.valid) return;
  if (lane0) load_fixed();
  pipe->next_fixed();
  publish();
  for (;;) {
    if (lane0) walk_next();
    __syncwarp();
    if (!sm.slot(pipe->stage())->tile.valid) break;
    publish();
  }
  wgmma_bwd_publish_marker<S>(sm, pipe);
}

// Key item: keys [kt0, kt1) of kv head kvh; its K and V and query tiles, then its end
// marker; nothing when no query sees the keys.
template <class Cfg>
HSAP_DEV void wgmma_bwd_produce_key_item(const BwdParams& p,
                                         const WgmmaBwdSmem<WgmmaBwdShape<Cfg>>& sm,
                                         const WgmmaBwdMaps& maps, int kvh, long long kt0,
                                         long long kt1, WgmmaBwdPipe* pipe) {
  using S = WgmmaBwdShape<Cfg>;
  wgmma_bwd_produce_tiles<S>(
      sm, pipe,
      [&] {
        start_key_walk<WgmmaBwdWalkCfg<Cfg>>(*sm.walk(), p);
        wgmma_bwd_next_query_tile<Cfg>(p, sm, kvh, kt0, kt1, *pipe);
      },
      [&] { wgmma_bwd_next_query_tile<Cfg>(p, sm, kvh, kt0, kt1, *pipe); },
      [&] { wgmma_bwd_load_fixed<S>(sm, maps.k, maps.v, kvh, kt0, *pipe); },
      [&] { wgmma_bwd_publish_query_tile<Cfg>(p, sm, maps, pipe); });
}

// Lane 0: claims the pipe's stage and walks the dq chunk at q0 of block qb to its next key
// tile, into the slot (an end marker past the last).
template <class Cfg>
HSAP_DEV WgmmaBwdSlot* wgmma_bwd_next_key_tile(const BwdParams& p,
                                               const WgmmaBwdSmem<WgmmaBwdShape<Cfg>>& sm,
                                               const QueryBlock& qb, int h, long long q0,
                                               const WgmmaBwdPipe& pipe) {
  using S = WgmmaBwdShape<Cfg>;
  WgmmaBwdSlot* slot = wgmma_bwd_claim<S>(sm, pipe);
  const int rows = static_cast<int>(min64(S::kChunkRows, qb.q_end - q0));
  next_query_tile<Cfg, S::kBM>(*reinterpret_cast<MmaQueryWalk*>(sm.walk()), p, qb, q0, rows,
                               &slot->tile);
  slot->kind = slot->tile.valid ? kBwdQueryTile : kBwdQueryEnd;
  slot->head = h;
  slot->lo = q0;
  slot->hi = q0 + rows;
  return slot;
}

// A dq chunk's key tile, described in the pipe's slot (claimed): lane 0 loads its K and V;
// every lane arrives on `full`.
template <class S>
HSAP_DEV void wgmma_bwd_publish_key_tile(const WgmmaBwdSmem<S>& sm, const WgmmaBwdMaps& maps,
                                         int kvh, WgmmaBwdPipe* pipe) {
  const int st = pipe->stage();
  if (threadIdx.x == 0) {
    wgmma_bwd_load_stage<S>(sm, maps.k, maps.v, kvh, sm.slot(st)->tile.k0, st);
  } else {
    mbarrier_arrive(sm.full(st));
  }
  pipe->next_stage();
}

// dq item: block b of query head h, in chunks of kChunkRows rows; per chunk its Q and dO and
// key tiles, then its end marker; nothing for a chunk no key is visible to.
template <class Cfg>
HSAP_DEV void wgmma_bwd_produce_query_item(const BwdParams& p,
                                           const WgmmaBwdSmem<WgmmaBwdShape<Cfg>>& sm,
                                           const WgmmaBwdMaps& maps, int b, int h,
                                           WgmmaBwdPipe* pipe) {
  using S = WgmmaBwdShape<Cfg>;
  const int kvh = kv_head<Cfg>(p.kv_head_of_q, p.heads_q, p.heads_kv, h, p.error_flag);
  if (kvh < 0) return;
  // Read where it lies (not copied into registers, of which the producer has 40): the
  // mbarrier waits are memory clobbers, so each use reloads it (from L1).
  const QueryBlock& qb = p.blocks[b];
  if (!block_rows_in_range(qb, p.q_rows, p.error_flag)) return;
  for (long long q0 = qb.q_begin; q0 < qb.q_end; q0 += S::kChunkRows) {
    wgmma_bwd_produce_tiles<S>(
        sm, pipe,
        [&] {
          MmaQueryWalk* walk = reinterpret_cast<MmaQueryWalk*>(sm.walk());
          walk->si = qb.seg_begin - 1;
          walk->k0 = walk->k_hi = 0;
          wgmma_bwd_next_key_tile<Cfg>(p, sm, qb, h, q0, *pipe);
        },
        [&] { wgmma_bwd_next_key_tile<Cfg>(p, sm, qb, h, q0, *pipe); },
        [&] { wgmma_bwd_load_fixed<S>(sm, maps.q, maps.dout, h, q0, *pipe); },
        [&] { wgmma_bwd_publish_key_tile<S>(sm, maps, kvh, pipe); });
  }
}

// ---- The consumers: warpgroups 1 and 2 (wg 0 and 1 below). A key item's warpgroup wg owns
// keys kt0 + 64 wg .. + 63 (dK, dV in registers), a dq chunk's its rows q0 + 64 wg .. + 63
// (dQ); both read every stage's tile. Per stage: wait `full`, read the producer's slot (a
// tile, or the item's or chunk's end), fix the tile's tail, compute, arrive on `empty` (all
// 256 threads; every one of their wgmma has completed).

// Zeroes rows [rows, kBM) of stage st's tensors (both for a key item's Q and dO, the first,
// K, for a dq item's key tile; every panel: the swizzle permutes 16-byte chunks within a
// 128-byte row only) and hands them to the async proxy. The 256 consumer threads split the
// rows and meet at named barrier 1.
template <class S>
HSAP_DEV void wgmma_bwd_zero_tail(const WgmmaBwdSmem<S>& sm, int st, int rows, int tensors,
                                  int ct) {
  const int chunks = (S::kBM - rows) * 8;  // 16-byte chunks per panel
  for (int i = ct; i < tensors * S::kPanels * chunks; i += S::kConsumerThreads) {
    const int tensor = i / (S::kPanels * chunks), rest = i % (S::kPanels * chunks);
    const int pn = rest / chunks, c = rest % chunks;
    unsigned char* base = tensor == 0 ? sm.q_stage(st) : sm.do_stage(st);
    unsigned* dst = reinterpret_cast<unsigned*>(base + pn * S::kBM * 128 + rows * 128 + c * 16);
    dst[0] = dst[1] = dst[2] = dst[3] = 0u;
  }
  fence_proxy_async_shared();  // the generic-proxy stores, before wgmma (or TMA) sees them
  named_barrier_sync<1, S::kConsumerThreads>();
}

// Waits for the pipe's stage and returns its slot (read until the stage is released).
template <class S>
HSAP_DEV const WgmmaBwdSlot* wgmma_bwd_acquire(const WgmmaBwdSmem<S>& sm,
                                               const WgmmaBwdPipe& pipe) {
  mbarrier_wait_parity(sm.full(pipe.stage()), pipe.phase());
  return sm.slot(pipe.stage());
}

// Releases the pipe's stage (every consumer thread; its reads of the stage are done) and
// waits for the next one.
template <class S>
HSAP_DEV const WgmmaBwdSlot* wgmma_bwd_advance(const WgmmaBwdSmem<S>& sm, WgmmaBwdPipe* pipe) {
  mbarrier_arrive(sm.empty(pipe->stage()));
  pipe->next_stage();
  return wgmma_bwd_acquire<S>(sm, *pipe);
}

// A consumer thread's place: ct in [0, 256) of the consumers, its warpgroup wg (0 or 1), warp
// in the warpgroup, and g, t of its lane as the accumulator fragments use them.
struct WgmmaBwdThread {
  int ct = static_cast<int>(threadIdx.x) - 128;
  int wg = ct / 128, warp = (ct % 128) / 32, g = (ct % 32) / 4, t = ct % 4;
};

// Key item, from its first tile (acquired) to its end marker (released): warpgroup wg's keys
// kt0 + 64 wg .. + 63, dK and dV in registers, added to dk and dv once.
template <class Cfg>
HSAP_DEV void wgmma_bwd_consume_key_item(const BwdParams& p,
                                         const WgmmaBwdSmem<WgmmaBwdShape<Cfg>>& sm,
                                         WgmmaBwdPipe* pipe) {
  using S = WgmmaBwdShape<Cfg>;
  const WgmmaBwdThread th;
  const int ct = th.ct, wg = th.wg, warp = th.warp, g = th.g, t = th.t;
  float dk[S::kD / 2], dv[S::kD / 2];
  HSAP_UNROLL
  for (int i = 0; i < S::kD / 2; ++i) dk[i] = dv[i] = 0.0f;
  mbarrier_wait_parity(sm.fixed_full(), pipe->fixed_phase());
  pipe->next_fixed();
  const WgmmaBwdSlot* slot = sm.slot(pipe->stage());
  for (; slot->kind == kBwdKeyTile; slot = wgmma_bwd_advance<S>(sm, pipe)) {
    const int st = pipe->stage();
    if (slot->tile.rows < S::kBM) wgmma_bwd_zero_tail<S>(sm, st, slot->tile.rows, 2, ct);
    if (wgmma_bwd_part_sees(slot->tile, 64 * wg, 64 * wg + 64, 0, S::kBM)) {  // uniform in wg
      wgmma_bwd_tile<Cfg, S>(dk, dv, sm, st, 64 * wg, p, warp, g, t);
    }
  }
  const int kvh = slot->head;  // the end marker
  const long long kt0 = slot->lo, kt1 = slot->hi;
  mbarrier_arrive(sm.empty(pipe->stage()));
  pipe->next_stage();
  mbarrier_arrive(sm.fixed_empty());  // every GEMM that reads K and V has completed
  // One writer per (key row, kv head): plain adds, deterministic. Accumulator element 4j + e:
  // key 64 wg + 16 warp + g + 8 (e >> 1), column 8j + 2t + (e & 1).
  HSAP_UNROLL
  for (int j = 0; j < S::kD / 8; ++j) {
    HSAP_UNROLL
    for (int e = 0; e < 4; ++e) {
      const long long kr = kt0 + 64 * wg + 16 * warp + g + 8 * (e >> 1);
      if (kr < kt1) {
        const long long idx =
            (kr * p.heads_kv + kvh) * static_cast<long long>(S::kD) + 8 * j + 2 * t + (e & 1);
        p.dk[idx] += dk[4 * j + e] * p.scale;
        p.dv[idx] += dv[4 * j + e];
      }
    }
  }
}

// dq chunk (deterministic dq, mma_bwd_query_item's organisation on wgmma), from its first
// tile (acquired) to its end marker (released): warpgroup wg's rows q0 + 64 wg .. + 63 of
// query head h over the block's segments and their kBM-key tiles in order; dQ in registers,
// added once: a fixed reduction order, bitwise reproducible.
template <class Cfg>
HSAP_DEV void wgmma_bwd_consume_query_chunk(const BwdParams& p,
                                            const WgmmaBwdSmem<WgmmaBwdShape<Cfg>>& sm,
                                            WgmmaBwdPipe* pipe) {
  using S = WgmmaBwdShape<Cfg>;
  const WgmmaBwdThread th;
  const int ct = th.ct, wg = th.wg, warp = th.warp, g = th.g, t = th.t;
  const WgmmaBwdSlot* slot = sm.slot(pipe->stage());
  float row_lse[2], row_delta[2];
  {
    const long long q0 = slot->lo;
    const int wg_rows = static_cast<int>(max64(0, min64(64, slot->hi - q0 - 64 * wg)));
    load_row_stats(p, slot->head, q0 + 64 * wg, wg_rows, 16 * warp + g, row_lse, row_delta);
  }
  float dq[S::kD / 2];
  HSAP_UNROLL
  for (int i = 0; i < S::kD / 2; ++i) dq[i] = 0.0f;
  mbarrier_wait_parity(sm.fixed_full(), pipe->fixed_phase());
  pipe->next_fixed();
  for (; slot->kind == kBwdQueryTile; slot = wgmma_bwd_advance<S>(sm, pipe)) {
    const int st = pipe->stage();
    if (slot->tile.key_hi < S::kBM) wgmma_bwd_zero_tail<S>(sm, st, slot->tile.key_hi, 1, ct);
    if (wgmma_bwd_part_sees(slot->tile, 0, S::kBM, 64 * wg, 64 * wg + 64)) {  // uniform in wg
      wgmma_bwd_dq_tile<Cfg, S>(dq, sm, st, 64 * wg, row_lse, row_delta, p.scale, warp, g, t);
    }
  }
  const int h = slot->head;  // the end marker
  const long long q0 = slot->lo;
  const int wg_rows = static_cast<int>(max64(0, min64(64, slot->hi - q0 - 64 * wg)));
  mbarrier_arrive(sm.empty(pipe->stage()));
  pipe->next_stage();
  mbarrier_arrive(sm.fixed_empty());
  HSAP_UNROLL
  for (int j = 0; j < S::kD / 8; ++j) {
    HSAP_UNROLL
    for (int e = 0; e < 4; ++e) {
      const int r = 16 * warp + g + 8 * (e >> 1);
      if (r < wg_rows) {
        float* out = p.dq + ((q0 + 64 * wg + r) * p.heads_q + h) * static_cast<long long>(S::kD);
        out[8 * j + 2 * t + (e & 1)] += dq[4 * j + e] * p.scale;
      }
    }
  }
}

// The consumers' whole work: the items and chunks the producer publishes, until kBwdDone.
template <class Cfg>
HSAP_DEV void wgmma_bwd_consume(const BwdParams& p, const WgmmaBwdSmem<WgmmaBwdShape<Cfg>>& sm) {
  using S = WgmmaBwdShape<Cfg>;
  WgmmaBwdPipe pipe;
  for (;;) {
    const int kind = wgmma_bwd_acquire<S>(sm, pipe)->kind;
    if (kind == kBwdDone) return;
    if (kind == kBwdKeyTile) {
      wgmma_bwd_consume_key_item<Cfg>(p, sm, &pipe);
    } else {
      wgmma_bwd_consume_query_chunk<Cfg>(p, sm, &pipe);
    }
  }
}

// attn_bwd_wgmma_kernel<Cfg>: BwdParams' contract (attn_bwd_mma_kernel) on 384 threads with
// Cfg::kWgmmaBwdSmemBytes of dynamic shared memory and the tensor maps of p.q, p.k, p.v and
// p.dout (lib/cuda/exec/wgmma_tensor_maps.h EncodeWgmmaBackwardMaps: boxes of 64 elements x 1
// head x kWgmmaBwdBoxRows rows, 128-byte swizzle). Any grid: the CTAs take the items
// grid-stride.
template <class Cfg>
__global__ void __launch_bounds__(384, 1)
    attn_bwd_wgmma_kernel(const BwdParams p, const __grid_constant__ TensorMap tq,
                          const __grid_constant__ TensorMap tk,
                          const __grid_constant__ TensorMap tv,
                          const __grid_constant__ TensorMap tdo) {
  using S = WgmmaBwdShape<Cfg>;
  static_assert(Cfg::kWgmmaBwd && Cfg::kWgmmaBwdSmemBytes == S::kSmemBytes,
                "hsap: generator and device disagree on the sm_90a backward's shared memory");
  static_assert(sizeof(MmaKeyWalk) + S::kStages * sizeof(WgmmaBwdSlot) <= 252 &&
                    sizeof(MmaQueryWalk) <= sizeof(MmaKeyWalk) && sizeof(MmaKeyWalk) % 8 == 0,
                "hsap: the walk's state and the stages' tiles outgrew their shared memory");
  if (!tensors_aligned16(p.error_flag, p.q, p.k, p.v, p.dout)) return;  // uniform
  const WgmmaBwdSmem<S> sm(dynamic_smem());
  if (threadIdx.x == 0) {
    mbarrier_init(sm.fixed_full(), 1);  // the producer's arrive.expect_tx
    mbarrier_init(sm.fixed_empty(), S::kConsumerThreads);
    for (int s = 0; s < S::kStages; ++s) {
      mbarrier_init(sm.full(s), 32);  // the producer warp's lanes
      mbarrier_init(sm.empty(s), S::kConsumerThreads);
    }
    fence_barrier_init();
  }
  __syncthreads();
  if (threadIdx.x < 128) {
    setmaxnreg_dec<S::kProducerRegs>();
    if (threadIdx.x >= 32) return;
    if (threadIdx.x == 0) {
      prefetch_tensormap(&tq);
      prefetch_tensormap(&tk);
      prefetch_tensormap(&tv);
      prefetch_tensormap(&tdo);
    }
    const WgmmaBwdMaps maps{&tq, &tk, &tv, &tdo};
    WgmmaBwdPipe pipe;
    if (threadIdx.x == 0) *sm.producer_step() = 0;
    for (;;) {
      __syncwarp();  // lane 0's step is seen
      const unsigned step = *sm.producer_step();
      const WgmmaBwdItem it = wgmma_bwd_item<Cfg>(p, step);
      if (!it.valid) break;
      __syncwarp();  // every lane read the step
      if (threadIdx.x == 0) *sm.producer_step() = step + 1;
      if (it.key) {
        wgmma_bwd_produce_key_item<Cfg>(p, sm, maps, it.head, it.a, it.b, &pipe);
      } else {
        wgmma_bwd_produce_query_item<Cfg>(p, sm, maps, static_cast<int>(it.a), it.head, &pipe);
      }
    }
    if (threadIdx.x == 0) wgmma_bwd_claim<S>(sm, pipe)->kind = kBwdDone;
    __syncwarp();
    wgmma_bwd_publish_marker<S>(sm, &pipe);
  } else {
    setmaxnreg_inc<S::kConsumerRegs>();
    wgmma_bwd_consume<Cfg>(p, sm);
  }
}

}  // namespace hsap_dev

#endif  // defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(HSAP_DEVICE_EMULATION)
#endif  // HSAP_JIT_DEVICE_HSAP_ATTENTION_WGMMA_BWD_CUH_
