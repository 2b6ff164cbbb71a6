#include "bench/roofline_issue.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "attention/kernel.h"
#include "attention/layout.h"
#include "base/status_macros.h"
#include "jit/cuda_kernels.h"

namespace hsap::bench {
namespace {

// ---- instruction costs counted in the SASS (CUDA 13.0 ptxas, sm_90, bf16, head dim 128,
// band variant, `cuobjdump -sass` of the NVRTC cubin; docs/gpu_backend.md shows how) ----
//
// A 16-byte cp.async of a K/V (forward) or Q/dO/K/V (backward) tile row chunk.
// Measured code: the generic cp_async_rows / cp_async_tile loop (4x unrolled, 117
// instructions per 4 chunks): 64-bit row address, zero-fill select and the LDGSTS.
constexpr double kCopyAlu = 12.75, kCopyImad = 12.5, kCopyOther = 3.75;
// Current code (cp_async_rows of hsap_mma.cuh, fixed chunk column per thread): per copy the
// LDGSTS, one IMAD.WIDE bumping the 64-bit source, the zero-fill ISETP against an
// immediate and a VIADD of the shared address; per tile (both tensors of a tile pair) the
// row's 64-bit address, the stage's shared base and the valid-row count: the copy block
// of the forward's tile loop holds 95 instructions for 16 copies (44 ALU, 25 IMAD, 26 other).
constexpr double kFixedCopyAlu = 2, kFixedCopyImad = 1, kFixedCopyOther = 1;
constexpr double kFixedCopyAluPerTile = 12, kFixedCopyImadPerTile = 9,
                 kFixedCopyOtherPerTile = 10;

// Forward, per score held by a thread (kBN / 2 of them per warp-tile): the per-element mask
// (7.25 ALU + 0.75 IMAD per score, evaluated predicated for every tile, full ones too), the
// scale, -inf select, NaN/+inf and saw-key flags, row max, exp2f's range check, sum and
// pack: 590 ALU, 44 IMAD, 252 FP32 in the 32-score loop body of hsap_attention_mma_fwd.cuh.
constexpr double kFwdAluPerScore = 18, kFwdMaskAluPerScore = 7.25;
constexpr double kFwdImadPerScore = 1.3, kFwdMaskImadPerScore = 0.75;
// Whole tiles (mma_fwd_softmax<S, true>: no row/column bounds, band test, -inf select or
// saw-key flag; the NaN/+inf FSETPs stay; the softmax block of the tile loop 821 -> 332
// instructions): per score what makes the whole-tile loop's 266 ALU and 55 IMAD with the
// per-tile and copy terms below (the loop: 919 instructions, against 1,408 on cut tiles).
constexpr double kFwdWholeAluPerScore = 5.8, kFwdWholeImadPerScore = 0.53;
constexpr double kFwdFp32PerScore = 5.5;  // FMUL scale, FADD, 2 FMUL (exp2f), FADD sum, F2FP/2
// The current code: the folded softmax (FoldedOnlineSoftmax: FFMA + ex2.approx per score,
// NaN/+inf from the row's l at the end, no per-score flag), the band test in 32-bit
// (TileMask), the key-tile walk by thread 0 from shared memory and the 2 CTAs per SM
// declared (206 registers). Its tile loop (same kernel, 64 x 64) holds 620 instructions on a
// whole tile (ALU 109, IMAD 67, FP32 154, other 56; the softmax block: FMNMX, FFMA, MUFU.EX2
// and FADD per score) and 1,014 on a cut one (ALU 475, IMAD 96). Per score, with the
// per-tile and copy terms below:
constexpr double kFoldedWholeAluPerScore = 0.91, kFoldedWholeImadPerScore = 0.91;
constexpr double kFoldedCutAluPerScore = 12.34, kFoldedCutImadPerScore = 1.81;
constexpr double kFoldedFp32PerScore = 2.44;  // FFMA, FADD sum, F2FP/2, the row terms
// Thread 0's step of the walk per tile (walk_to on the walk in shared memory, the path that
// stays in its segment: the fields it touches loaded and k0 stored back, the band test, the
// tile's descriptor stored): 70 instructions, which warp 0 executes while the others wait
// at the next barrier, so every warp-tile of the CTA pays them.
constexpr double kFwdWalkAlu = 32, kFwdWalkImad = 15, kFwdWalkOther = 23;
constexpr double kFwdAluPerTile = 36, kFwdImadPerTile = 13, kFwdFp32PerTile = 12;
constexpr double kFwdOtherPerTile = 41;  // 8 SHFL, 2 BAR, branches, walk, cp.async commit/wait
// Backward key pass, per element of S^T (kBM / 2 per thread): visibility, accurate expf
// (branched per element), dS = P (dP - delta), packs: 238 instructions for 8 elements.
constexpr double kKeyAluPerElem = 6.25, kKeyImadPerElem = 5.75, kKeyFp32PerElem = 10,
                 kKeyOtherPerElem = 5;
constexpr double kKeyAluPerKStep = 5, kKeyImadPerKStep = 4, kKeyOtherPerKStep = 2;  // rolled
// Per tile: tile read from shared memory, lse/delta loads and stores, barriers, and thread
// 0's walk (executed by warp 0 while the others wait at the barrier).
constexpr double kKeyAluPerTile = 85, kKeyImadPerTile = 65, kKeyOtherPerTile = 115;
// Backward dq pass, per element of S (kDqBN / 2 per thread), per k-step and per tile.
constexpr double kQueryAluPerElem = 4.75, kQueryImadPerElem = 3.8, kQueryFp32PerElem = 9.25,
                 kQueryOtherPerElem = 4.2;
constexpr double kQueryAluPerKStep = 7, kQueryImadPerKStep = 8, kQueryOtherPerKStep = 2;
constexpr double kQueryAluPerTile = 70, kQueryImadPerTile = 43, kQueryOtherPerTile = 70;

// Latencies a warp waits out per tile (assumed from published microbenchmarks' orders of
// magnitude; they do not bind the shipped kernels, whose W * busy exceeds busy + exposed).
constexpr double kBarrierCycles = 30, kShuffleCycles = 30, kL1Cycles = 35, kL2Cycles = 300;

double CeilDiv(double a, double b) { return std::ceil(a / b); }

// The copies of one warp-tile: `chunks` 16-byte copies per thread.
void AddCopies(WarpTileMix& m, double chunks, bool generic) {
  if (generic) {
    m.alu += kCopyAlu * chunks;
    m.imad += kCopyImad * chunks;
    m.other += kCopyOther * chunks;
  } else {
    m.alu += kFixedCopyAlu * chunks + kFixedCopyAluPerTile;
    m.imad += kFixedCopyImad * chunks + kFixedCopyImadPerTile;
    m.other += kFixedCopyOther * chunks + kFixedCopyOtherPerTile;
  }
}

// The backward's exponential as prob_from_log2 (FFMA + ex2.approx on the lse kept in log2
// units) instead of expf: the kernel's SASS (sm_90, bf16, D = 128, both passes) lost 312
// instructions over its 24 elements per warp-tile pair, per element 0.7 ALU, 3.5 IMAD, 5.3
// FP32 and 3.5 other.
void RemoveExpf(WarpTileMix& m, double elems) {
  m.alu -= 0.7 * elems;
  m.imad -= 3.5 * elems;
  m.fp32 -= 5.3 * elems;
  m.other -= 3.5 * elems;
}

}  // namespace

PipeCycles PipeCyclesOf(const GpuSpec& gpu) {
  PipeCycles p;
  // Tensor FLOPs per clock per SM of the dense peak, per scheduler at mma.sync's share.
  const double per_sm = gpu.dense_16bit_tflops * 1e12 / (gpu.sms * gpu.clock_ghz * 1e9);
  const double share = gpu.arch >= 90 ? kMmaSyncFractionSm90 : 1.0;
  p.hmma = 4096.0 / (per_sm / 4 * share);
  return p;
}

WarpTileTime TimeOf(const WarpTileMix& m, const PipeCycles& p) {
  WarpTileTime t;
  t.tensor = m.hmma * p.hmma;
  t.ldsm = m.ldsm * p.other;
  t.mufu = m.mufu * p.mufu;
  t.alu = m.alu * p.alu;
  t.imad = m.imad * p.imad;
  t.fp32 = m.fp32 * p.fp32;
  t.other = m.other * p.other;
  t.busy = t.tensor + t.ldsm + t.mufu + t.alu + t.imad + t.fp32 + t.other;
  const double issue = m.hmma + m.ldsm + m.mufu + m.alu + m.imad + m.fp32 + m.other;
  t.overlapped = std::max({t.tensor, t.mufu, t.alu, t.imad + t.fp32, issue});
  return t;
}

KernelCode MeasuredKernelCode() { return KernelCode{}; }

// Explicit tiles in the config: the generator sizes them (shared memory) as it would ship them.
jit::CudaTiles TilesOf(const jit::CudaKernelConfig& c, jit::CudaTiles t, const KernelCode& code) {
  if (code.bwd_block_m > 0 && t.bwd_tensor_core && code.bwd_block_m != t.bwd_block_m) {
    jit::CudaKernelConfig e = c;
    e.bwd_block_m = code.bwd_block_m;
    e.bwd_block_n = t.bwd_block_n;
    e.bwd_threads = t.bwd_threads;
    if (absl::StatusOr<jit::CudaTiles> r = jit::ChooseCudaTiles(e); r.ok()) {
      t.bwd_block_m = r->bwd_block_m;
      t.bwd_smem_bytes = r->bwd_smem_bytes;
    }
  }
  const int warps = t.threads / 32;
  if (code.row_blocks == 0 || t.block_m == 16 * code.row_blocks * warps) return t;
  jit::CudaKernelConfig e = c;
  e.block_m = 16 * code.row_blocks * warps;
  // One row block: the 64-row tiles' keys (64 up to head dim 128, 32 above).
  e.block_n = code.row_blocks == 1 ? (c.head_dim <= 128 ? 64 : 32) : t.block_n;
  e.threads = t.threads;
  if (absl::StatusOr<jit::CudaTiles> r = jit::ChooseCudaTiles(e); r.ok()) {
    t.block_m = r->block_m;
    t.block_n = r->block_n;
    t.fwd_smem_bytes = r->fwd_smem_bytes;
  }
  return t;
}

KernelCode CurrentKernelCode() {
  KernelCode k;
  k.generic_copy = false;     // cp_async_rows: addresses computed once per tile
  k.mask_every_tile = false;  // mma_fwd_softmax<S, kWhole>: the test only on cut tiles
  k.per_score_softmax = false;  // FoldedOnlineSoftmax, TileMask, thread 0's walk
  k.row_blocks = 0;           // the shipped tiles (128 x 64 at head dim 64)
  k.bwd_accurate_exp = false;  // prob_from_log2: FFMA + ex2.approx, both passes
  k.bwd_block_m = 0;           // the shipped backward tiles (32 x 64 at head dim 128)
  return k;
}

WarpTileMix ForwardWarpTileMix(const jit::CudaKernelConfig& c, const jit::CudaTiles& shipped,
                               const KernelCode& v, bool cut) {
  const jit::CudaTiles t = TilesOf(c, shipped, v);
  const double bn = t.block_n, d = c.head_dim, rb = t.block_m / (t.threads / 32) / 16;
  const double scores = rb * 16 * bn / 32;             // per thread
  const double chunks = 2 * bn * (d / 8) / t.threads;  // K and V copies per thread
  const bool general = v.mask_every_tile || cut;       // the per-score test runs
  const bool mask = c.has_band && general;
  double alu = kFwdAluPerScore - kFwdMaskAluPerScore, imad = kFwdImadPerScore - kFwdMaskImadPerScore;
  double fp32 = kFwdFp32PerScore;
  if (mask) alu += kFwdMaskAluPerScore, imad += kFwdMaskImadPerScore;
  if (!general) {
    alu = kFwdWholeAluPerScore;
    imad = kFwdWholeImadPerScore;
  }
  if (!v.per_score_softmax) {  // the current core, as counted
    alu = general ? kFoldedCutAluPerScore : kFoldedWholeAluPerScore;
    imad = general ? kFoldedCutImadPerScore : kFoldedWholeImadPerScore;
    fp32 = kFoldedFp32PerScore;
    if (general && !mask) alu -= kFwdMaskAluPerScore, imad -= kFwdMaskImadPerScore;
  }
  WarpTileMix m;
  m.name = "fwd";
  m.hmma = rb * bn * d / 64;  // S (bn/8 x d/16), PV (bn/16 x d/8) per row block
  m.ldsm = bn * d / 128 + (t.q_in_registers ? 0 : rb * d / 16);  // K, V shared; Q per block
  m.mufu = scores + 2 * rb;  // p, and each row's rescale
  m.alu = alu * scores + kFwdAluPerTile;
  m.imad = imad * scores + kFwdImadPerTile;
  m.fp32 = fp32 * scores + rb * d / 2 + kFwdFp32PerTile;  // + O rescale
  m.other = kFwdOtherPerTile + 8 * (rb - 1);
  if (!v.per_score_softmax) {  // the current core's walk by thread 0
    m.alu += kFwdWalkAlu;
    m.imad += kFwdWalkImad;
    m.other += kFwdWalkOther;
  }
  AddCopies(m, chunks, v.generic_copy);
  m.exposed = 2 * kBarrierCycles + 4 * kShuffleCycles;
  m.useful_flops = rb * 4 * 16 * bn * d;
  return m;
}

WarpTileMix BackwardKeyWarpTileMix(const jit::CudaKernelConfig& c, const jit::CudaTiles& shipped,
                                   const KernelCode& code) {
  const jit::CudaTiles t = TilesOf(c, shipped, code);
  const double bm = t.bwd_block_m, bn = t.bwd_block_n, d = c.head_dim;
  const double warps = t.bwd_threads / 32, key_groups = bn / 16, split = warps / key_groups;
  const double dw = d / split, qt = bm / 8, dt = dw / 8, ksteps = d / 16;
  const double elems = 16 * bm / 32;
  const double chunks = 2 * bm * (d / 8) / t.bwd_threads;  // Q and dO
  WarpTileMix m;
  m.name = "bwd key";
  m.hmma = 2 * qt * ksteps + 2 * dt * (bm / 16);  // S^T, dP^T; dV, dK
  m.ldsm = ksteps * (2 + 2 * std::ceil(qt / 2)) + (bm / 16) * 2 * std::ceil(dt / 2);
  m.mufu = elems;
  m.alu = kKeyAluPerElem * elems + kKeyAluPerKStep * ksteps + kKeyAluPerTile;
  m.imad = kKeyImadPerElem * elems + kKeyImadPerKStep * ksteps + kKeyImadPerTile;
  m.fp32 = kKeyFp32PerElem * elems;
  m.other = kKeyOtherPerElem * elems + kKeyOtherPerKStep * ksteps + kKeyOtherPerTile;
  AddCopies(m, chunks, code.generic_copy);
  if (!code.bwd_accurate_exp) RemoveExpf(m, elems);
  // Three barriers, thread 0's walk (shared-memory round trips) and the lse/delta loads that
  // warp 0 stores before the third barrier.
  m.exposed = 3 * kBarrierCycles + 2 * kBarrierCycles + kL2Cycles;
  if (!code.bwd_walk_in_loop) {  // tile list precomputed per key item: no thread-0 walk
    m.alu -= 25;
    m.imad -= 10;
    m.other -= 15;
    m.exposed -= 2 * kBarrierCycles;
  }
  m.useful_flops = 8 * 16 * bm * dw;  // S, dP, dV, dK of the warp's keys (its part of D)
  return m;
}

WarpTileMix BackwardQueryWarpTileMix(const jit::CudaKernelConfig& c, const jit::CudaTiles& t,
                                     const KernelCode& code) {
  const double bn = t.bwd_block_n, d = c.head_dim;
  const double dq_bn = jit::MmaDqBlockN(t.bwd_block_n);
  const double dq_split = d > 128 ? 2 : 1, dqw = d / dq_split;
  const double kt = dq_bn / 8, dt = dqw / 8, ksteps = d / 16;
  const double elems = 16 * dq_bn / 32;
  const double chunks = 2 * dq_bn * (d / 8) / t.bwd_threads;  // K and V
  WarpTileMix m;
  m.name = "bwd dq";
  m.hmma = 2 * kt * ksteps + dt * (dq_bn / 16);  // S, dP; dQ
  m.ldsm = ksteps * (2 + 2 * std::ceil(kt / 2)) + (dq_bn / 16) * std::ceil(dt / 2);
  m.mufu = elems;
  m.alu = kQueryAluPerElem * elems + kQueryAluPerKStep * ksteps + kQueryAluPerTile;
  m.imad = kQueryImadPerElem * elems + kQueryImadPerKStep * ksteps + kQueryImadPerTile;
  m.fp32 = kQueryFp32PerElem * elems;
  m.other = kQueryOtherPerElem * elems + kQueryOtherPerKStep * ksteps + kQueryOtherPerTile;
  AddCopies(m, chunks, code.generic_copy);
  if (!code.bwd_accurate_exp) RemoveExpf(m, elems);
  m.exposed = 3 * kBarrierCycles + 2 * kBarrierCycles;
  m.useful_flops = 2 * 16 * dq_bn * dqw;  // dQ only: S and dP are recomputed
  return m;
}

WarpTileMix BackwardKeyWalkStepMix() {
  // The slow path of next_key_tile per block or segment: ~25 instructions (loads of the
  // block / segment, bounds and band tests, branch) with two dependent loads that hit L1.
  WarpTileMix m;
  m.name = "bwd key walk step";
  m.alu = 12;
  m.imad = 5;
  m.other = 8;
  m.exposed = 2 * kL1Cycles;
  return m;
}

WarpTileCounts CountWarpTiles(const WorkList& work, const jit::CudaKernelConfig& c,
                              const jit::CudaTiles& t, int64_t k_rows) {
  WarpTileCounts n;
  n.pairs = static_cast<double>(work.visible_pairs);
  const int64_t bm = t.block_m, bn = t.block_n;
  const int64_t kbm = t.bwd_block_m, kbn = t.bwd_block_n;
  const int64_t bwd_warps = t.bwd_threads / 32;
  const int64_t qm = 16 * bwd_warps / (c.head_dim > 128 ? 2 : 1);
  const int64_t dq_bn = jit::MmaDqBlockN(t.bwd_block_n);
  // Keys of segment s seen by rows [q0, q0 + rows): [lo, hi).
  auto visible = [](const KeySegment& s, int64_t q0, int64_t rows, int64_t* lo, int64_t* hi) {
    *lo = s.k_begin;
    *hi = s.k_end;
    if (s.diag_lo > -kNoDiagLimit) *lo = std::max(*lo, q0 + s.diag_lo);
    if (s.diag_hi < kNoDiagLimit) *hi = std::min(*hi, q0 + rows - 1 + s.diag_hi + 1);
  };
  const double key_items = std::ceil(static_cast<double>(k_rows) / kbn);
  n.bwd_key_walk_steps = key_items * static_cast<double>(work.blocks.size() + work.segments.size());
  for (const QueryBlock& b : work.blocks) {
    for (int64_t si = b.seg_begin; si < b.seg_end; ++si) {
      const KeySegment& s = work.segments[si];
      for (int64_t q0 = b.q_begin; q0 < b.q_end; q0 += bm) {  // forward chunks
        int64_t lo, hi;
        visible(s, q0, std::min(bm, b.q_end - q0), &lo, &hi);
        if (lo >= hi) continue;
        const int64_t rows = std::min(bm, b.q_end - q0), warps = t.threads / 32;
        n.fwd += warps * CeilDiv(hi - lo, bn);
        // As the kernel decides (hsap_attention_mma_fwd.cuh): per CTA tile the band test, per
        // m16 row block its rows, per tile its keys; a warp-tile of rb row blocks counts as
        // cut by the share of its blocks that are.
        const int64_t rb = bm / (16 * warps), blocks = warps * rb;
        const int64_t full_blocks = std::min<int64_t>(blocks, rows / 16);
        for (int64_t k0 = lo; k0 < hi; k0 += bn) {
          const int64_t cols = std::min(bn, hi - k0);
          const bool inside = k0 - (q0 + rows - 1) >= s.diag_lo && (k0 + cols - 1) - q0 <= s.diag_hi;
          const bool whole = cols == bn && (!c.has_band || inside);
          n.fwd_cut += static_cast<double>(whole ? blocks - full_blocks : blocks) / rb;
        }
      }
      for (int64_t q0 = b.q_begin; q0 < b.q_end; q0 += qm) {  // dq chunks
        int64_t lo, hi;
        visible(s, q0, std::min(qm, b.q_end - q0), &lo, &hi);
        if (lo < hi) n.bwd_query += bwd_warps * CeilDiv(hi - lo, dq_bn);
      }
      // Key pass: per key tile meeting the segment, the query rows that see its keys.
      for (int64_t kt0 = s.k_begin / kbn * kbn; kt0 < std::min(s.k_end, k_rows); kt0 += kbn) {
        const int64_t ka = std::max(kt0, s.k_begin), kb = std::min(kt0 + kbn, s.k_end);
        if (ka >= kb) continue;
        int64_t qa = b.q_begin, qz = b.q_end;
        if (s.diag_hi < kNoDiagLimit) qa = std::max(qa, ka - s.diag_hi);
        if (s.diag_lo > -kNoDiagLimit) qz = std::min(qz, kb - s.diag_lo);
        if (qa < qz) n.bwd_key += bwd_warps * CeilDiv(qz - qa, kbm);
      }
    }
  }
  return n;
}

IssuePrediction PredictIssue(const std::vector<WarpTileMix>& mixes,
                             const std::vector<double>& warp_tiles, double flops, int threads,
                             int registers, int smem, const GpuSpec& gpu) {
  IssuePrediction r;
  const int ctas = jit::CudaCtasPerSm(gpu.arch, threads, registers, smem);
  const double w = ctas * (threads / 32) / 4.0;  // warps per scheduler
  r.warps_per_scheduler = static_cast<int>(std::lround(w));
  if (ctas == 0 || mixes.empty()) {
    r.bound = "does not fit an SM";
    return r;
  }
  const PipeCycles pipes = PipeCyclesOf(gpu);
  double cycles = 0, overlapped = 0;  // per scheduler, whole workload
  bool latency = false;
  for (size_t i = 0; i < mixes.size() && i < warp_tiles.size(); ++i) {
    const WarpTileTime t = TimeOf(mixes[i], pipes);
    const double round = std::max(w * t.busy, t.busy + mixes[i].exposed);
    const double round_o = std::max(w * t.overlapped, t.overlapped + mixes[i].exposed);
    latency = latency || round > w * t.busy;
    const double rounds = warp_tiles[i] / (4.0 * gpu.sms) / w;
    cycles += rounds * round;
    overlapped += rounds * round_o;
    if (i == 0) {
      r.per_tile = t;
      r.round_cycles = round;
    }
  }
  const double hz = gpu.clock_ghz * 1e9;
  r.tflops = cycles > 0 ? flops / (cycles / hz) / 1e12 : 0;
  r.overlapped_tflops = overlapped > 0 ? flops / (overlapped / hz) / 1e12 : 0;
  r.bound = latency ? "latency" : "scheduler (serial pipes)";
  return r;
}

double ForwardSchedulerTflops(const jit::CudaKernelConfig& c, const jit::CudaTiles& shipped,
                              int registers, const GpuSpec& gpu, const KernelCode& code) {
  const jit::CudaTiles t = TilesOf(c, shipped, code);
  const WarpTileMix m = ForwardWarpTileMix(c, t, code);
  return PredictIssue({m}, {1e6}, 1e6 * m.useful_flops, t.threads, registers, t.fwd_smem_bytes,
                      gpu)
      .tflops;
}

double BackwardSchedulerTflops(const jit::CudaKernelConfig& c, const jit::CudaTiles& shipped,
                               int registers, const GpuSpec& gpu, const KernelCode& code) {
  const jit::CudaTiles t = TilesOf(c, shipped, code);
  if (!t.bwd_tensor_core || !c.deterministic_dq) return 0;
  const double pairs = 1e9, dq_bn = jit::MmaDqBlockN(t.bwd_block_n);
  const double split = c.head_dim > 128 ? 2 : 1;  // warps sharing keys or query rows
  const double warps = t.bwd_threads / 32.0, key_groups = t.bwd_block_n / 16.0;
  const double key_split = warps / key_groups;
  return PredictIssue({BackwardKeyWarpTileMix(c, t, code), BackwardQueryWarpTileMix(c, t, code)},
                      {pairs / (16 * t.bwd_block_m) * key_split, pairs / (16 * dq_bn) * split},
                      10 * pairs * c.head_dim, t.bwd_threads, registers, t.bwd_smem_bytes, gpu)
      .tflops;
}

namespace {

struct DocumentWork {
  jit::CudaTiles tiles;
  WarpTileCounts counts;
};

// The work list the GPU runner builds for the code's forward: blocks of its tile's rows
// (DeviceKernels::forward_block_rows), the backward walking the same list.
absl::StatusOr<DocumentWork> WorkOnDocuments(const jit::CudaKernelConfig& c,
                                             const std::vector<int64_t>& cu_seqlens,
                                             const KernelCode& code) {
  HSAP_ASSIGN_OR_RETURN(jit::CudaTiles shipped, jit::ChooseCudaTiles(c));
  const jit::CudaTiles tiles = TilesOf(c, shipped, code);
  HSAP_ASSIGN_OR_RETURN(Layout layout, Layout::FromDocuments(cu_seqlens));
  HSAP_ASSIGN_OR_RETURN(WorkList work, BuildWorkList(layout, tiles.block_m));
  return DocumentWork{tiles, CountWarpTiles(work, c, tiles, layout.num_tokens())};
}

}  // namespace

absl::StatusOr<IssuePrediction> PredictForwardOnDocuments(const jit::CudaKernelConfig& c,
                                                          int registers,
                                                          const std::vector<int64_t>& cu_seqlens,
                                                          int heads, const GpuSpec& gpu,
                                                          const KernelCode& code) {
  HSAP_ASSIGN_OR_RETURN(DocumentWork w, WorkOnDocuments(c, cu_seqlens, code));
  const double flops = 4.0 * w.counts.pairs * c.head_dim * heads;
  if (code.mask_every_tile) {
    return PredictIssue({ForwardWarpTileMix(c, w.tiles, code)}, {w.counts.fwd * heads}, flops,
                        w.tiles.threads, registers, w.tiles.fwd_smem_bytes, gpu);
  }
  return PredictIssue(
      {ForwardWarpTileMix(c, w.tiles, code), ForwardWarpTileMix(c, w.tiles, code, /*cut=*/true)},
      {(w.counts.fwd - w.counts.fwd_cut) * heads, w.counts.fwd_cut * heads}, flops,
      w.tiles.threads, registers, w.tiles.fwd_smem_bytes, gpu);
}

absl::StatusOr<IssuePrediction> PredictBackwardOnDocuments(const jit::CudaKernelConfig& c,
                                                           int registers,
                                                           const std::vector<int64_t>& cu_seqlens,
                                                           int heads, const GpuSpec& gpu,
                                                           const KernelCode& code) {
  HSAP_ASSIGN_OR_RETURN(DocumentWork w, WorkOnDocuments(c, cu_seqlens, code));
  if (!w.tiles.bwd_tensor_core || !c.deterministic_dq) {
    return absl::UnimplementedError(
        "the issue model covers the tensor-core backward with deterministic dq");
  }
  const double flops = 10.0 * w.counts.pairs * c.head_dim * heads;
  const double warps = w.tiles.bwd_threads / 32;
  return PredictIssue({BackwardKeyWarpTileMix(c, w.tiles, code),
                       BackwardQueryWarpTileMix(c, w.tiles, code), BackwardKeyWalkStepMix()},
                      {w.counts.bwd_key * heads, w.counts.bwd_query * heads,
                       w.counts.bwd_key_walk_steps * heads * warps},
                      flops,
                      w.tiles.bwd_threads, registers, w.tiles.bwd_smem_bytes, gpu);
}

std::vector<ChangedMix> ForwardChanges(const jit::CudaKernelConfig& c, const jit::CudaTiles& t) {
  const KernelCode now = CurrentKernelCode();
  std::vector<ChangedMix> out;
  KernelCode all = now;
  auto add = [&](bool pending, const char* name, const char* what, auto&& change) {
    if (!pending) return;  // done in the current code
    KernelCode k = now;
    change(k);
    change(all);
    out.push_back({{name, what}, ForwardWarpTileMix(c, t, k)});
  };
  add(now.mask_every_tile, "mask only diagonal tiles",
      "classify each key tile once (inside the band or cut by it); the per-score band test "
      "only on the tiles the band cuts",
      [](KernelCode& k) { k.mask_every_tile = false; });
  add(now.generic_copy, "copy addresses precomputed",
      "cp.async from per-thread source/destination addresses computed once per tile (one "
      "64-bit add per 16-byte copy instead of the generic 64-bit row walk)",
      [](KernelCode& k) { k.generic_copy = false; });
  add(now.per_score_softmax, "folded softmax core",
      "p = ex2.approx(fma(s, scale*log2e, -m)), NaN/+inf from the row's l, the band test in "
      "32 bits, the key tiles walked by thread 0",
      [](KernelCode& k) { k.per_score_softmax = false; });
  if (out.size() > 1) out.push_back({{"all of the above", "the changes above together"},
                                     ForwardWarpTileMix(c, t, all)});
  if (TilesOf(c, t, now).block_m == 32 * (t.threads / 32)) return out;  // done
  all.row_blocks = 2;
  out.push_back({{"all + 32 rows per warp",
                  "and two m16 row blocks per warp (128x64 tiles on 4 warps, FlashAttention-2's "
                  "forward shape): each K/V fragment and copy serves twice the rows (registers: "
                  "O 128 + S 64 floats per thread; shipped at head dim 64, it spills under "
                  "ptxas at 128, docs/gpu_backend.md)"},
                 ForwardWarpTileMix(c, t, all)});
  return out;
}

std::vector<ChangedMix> BackwardKeyChanges(const jit::CudaKernelConfig& c,
                                           const jit::CudaTiles& t) {
  const KernelCode now = CurrentKernelCode();
  std::vector<ChangedMix> out;
  KernelCode all = now;
  auto add = [&](bool pending, const char* name, const char* what, auto&& change) {
    if (!pending) return;
    KernelCode k = now;
    change(k);
    change(all);
    out.push_back({{name, what}, BackwardKeyWarpTileMix(c, t, k)});
  };
  add(now.generic_copy, "copy addresses precomputed", "pointer bump per 16-byte copy",
      [](KernelCode& k) { k.generic_copy = false; });
  add(now.bwd_accurate_exp, "exp2 branch-free",
      "one FFMA + ex2.approx per element, no per-element branch around expf",
      [](KernelCode& k) { k.bwd_accurate_exp = false; });
  add(now.bwd_walk_in_loop, "walk off the critical path",
      "the key item's query tiles listed once (host or a prologue), not walked by thread 0 "
      "between barriers",
      [](KernelCode& k) { k.bwd_walk_in_loop = false; });
  if (out.size() > 1) out.push_back({{"all of the above", "the changes above together"},
                                     BackwardKeyWarpTileMix(c, t, all)});
  return out;
}

}  // namespace hsap::bench
