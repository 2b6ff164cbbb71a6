// Params of the generated CUDA kernels: the exact argument of every kernel, by value.
//
// Plain C++ (no CUDA keyword), included both by the generated device code (under NVRTC or
// nvcc) and by the host runtime that fills the structs and launches the kernels, so both
// sides agree on the layout. Only `long long`, `int`, `unsigned int`, `float` and pointers
// are used: their sizes are the same on the host (LP64) and on the device.
//
// Tensor layouts are those of attention/kernel.h:
//   q, dout, out, dq:   [q_rows, heads_q, D]   (row stride heads_q * D elements)
//   k, v, dk, dv:       [k_rows, heads_kv, D]
//   lse, delta:         [heads_q, q_rows]      (fp32)
// where D is the head dim the kernel was generated for. q, k, v, dout are in the storage
// dtype of the variant (fp32, bf16 or fp16 bits); out/lse/dq/dk/dv accumulators are fp32.
// All device pointers are global memory of the launching device, except FusedStep::k_src /
// v_src / consumed_flag which may be peer pointers (NVLink, cudaDeviceEnablePeerAccess or
// cuMemMap) or host-mapped memory for the flags.
#ifndef HSAP_JIT_DEVICE_HSAP_PARAMS_CUH_
#define HSAP_JIT_DEVICE_HSAP_PARAMS_CUH_

namespace hsap_dev {

// Same layout as hsap::QueryBlock / hsap::KeySegment (attention/worklist.h): four int64
// each, so a WorkList's vectors are copied to the device as they are.
struct QueryBlock {
  long long q_begin, q_end;      // query rows [q_begin, q_end) of the q buffer
  long long seg_begin, seg_end;  // its segments: segments[seg_begin, seg_end)
};
struct KeySegment {
  long long k_begin, k_end;  // key rows [k_begin, k_end) of the k/v buffer
  // Key row kr is visible to query row qr iff diag_lo <= kr - qr <= diag_hi; a full
  // segment has diag_lo <= -2^60 and diag_hi >= 2^60.
  long long diag_lo, diag_hi;
};

// Bits of *error_flag (atomicOr), set when the device detects a broken contract; the
// affected work is skipped, never read or written out of bounds.
enum ErrorBits : unsigned int {
  kErrorBandInFullOnlyVariant = 1u,  // a banded (causal) segment given to a full-only variant
  kErrorRowsOutOfRange = 2u,         // a block or segment outside [0, q_rows) / [0, k_rows)
  kErrorHeads = 4u,  // kv_head_of_q is null but heads_q != heads_kv * Cfg::kGqa, or a kv head
                     // out of [0, heads_kv)
  kErrorPeerTimeout = 8u,  // fused kernel: a peer's ready flag did not arrive in time (the
                           // step was not copied: its results are garbage)
  kErrorMisaligned = 16u,  // tensor-core variants: q, k or v (or a fused stage buffer) is not
                           // 16-byte aligned (cp.async moves 16-byte rows); nothing computed
  kErrorStalled = 32u,  // fused kernel: a task waited for tasks of other CTAs of its launch
                        // while nothing in the launch moved for 2 * ready_timeout_ns and at
                        // least a second (they never ran); it carried on regardless, so the
                        // results are garbage
};

// attn_fwd_kernel<Cfg>. Grid (num_blocks, heads_q), Cfg::kThreads threads, dynamic shared
// memory Cfg::kFwdSmemBytes (set cudaFuncAttributeMaxDynamicSharedMemorySize first).
// CTA (b, h) computes query block b of head h over its segments and merges the partial
// (out, lse) into out/lse (merge of attention/merge.h). Blocks are disjoint, so no two CTAs
// write the same output row: no atomics, deterministic.
struct FwdParams {
  const void* q;
  const void* k;
  const void* v;
  float* out;
  float* lse;
  const QueryBlock* blocks;
  const KeySegment* segments;
  // [heads_q] or nullptr: kv head = h / Cfg::kGqa (then heads_q must be heads_kv * kGqa)
  const int* kv_head_of_q;
  unsigned int* error_flag;  // nullptr or one zeroed word
  long long q_rows, k_rows;
  int num_blocks;
  int heads_q, heads_kv;
  float scale;  // softmax scale
};

// attn_bwd_kernel<Cfg> (FlashAttention-2 math, organised by query block). Grid
// (num_blocks, heads_q), Cfg::kBwdThreads threads, Cfg::kBwdSmemBytes dynamic shared memory.
// CTA (b, h) recomputes P = exp(scale * Q K^T - lse) for its block and adds
//   dq += scale * dS K          (plain adds: the CTA owns these dq rows; deterministic)
//   dk += scale * dS^T Q, dv += P^T dO   (fp32 atomicAdd: several query blocks and the
//                                         heads of a GQA group hit the same key rows, so
//                                         dk/dv are NOT bitwise deterministic)
// with dS = P * (dO V^T - delta). lse is the FINAL lse of the forward pass, delta comes
// from attn_delta_kernel. dq, dk, dv are fp32 and accumulated into (zero them first).
struct BwdParams {
  const void* q;
  const void* k;
  const void* v;
  const void* dout;
  const float* lse;
  const float* delta;
  float* dq;
  float* dk;
  float* dv;
  const QueryBlock* blocks;
  const KeySegment* segments;
  const int* kv_head_of_q;
  unsigned int* error_flag;
  long long q_rows, k_rows;
  int num_blocks;
  int heads_q, heads_kv;
  float scale;
};

// attn_delta_kernel<Cfg>: delta[h, r] = sum_d dout[r, h, d] * out[r, h, d] (fp32), dout and
// out in the storage dtype. One warp per (row, head) in a warp-stride loop: any grid (e.g.
// min(ceil(rows * heads / 8), 8 * SMs)), 256 threads, no dynamic shared memory.
struct DeltaParams {
  const void* dout;
  const void* out;
  float* delta;
  long long rows;
  int heads;
};

// lse_merge_kernel<Cfg>: merges (o2, lse2) into (o1, lse1) exactly as hsap::MergePartial.
// o: fp32 [rows, heads, D]; lse: fp32 [heads, lse_stride]. One warp per (row, head) in a
// warp-stride loop: any grid, 256 threads.
struct MergeParams {
  float* o1;
  float* lse1;
  const float* o2;
  const float* lse2;
  long long rows;
  int heads;
  long long lse_stride1, lse_stride2;
};

// init_partial_kernel<Cfg>: out = 0, lse = -inf over [rows, heads, D] / [heads, rows].
// convert_out_kernel<Cfg>: dst[i] = src[i] rounded to the storage dtype (nearest even).
// Both grid-stride: any grid, 256 threads.
struct InitParams {
  float* out;
  float* lse;
  long long rows;
  int heads;
};
struct ConvertParams {
  const float* src;
  void* dst;
  long long count;
};

// accumulate_kernel<Cfg>: dst[i] += src[i] over count fp32 elements (gradient partials that
// came back from a peer, added to the owner's rows). Grid-stride: any grid, 256 threads.
struct AccumulateParams {
  float* dst;
  const float* src;
  long long count;
};

// copy_chunks_kernel<Cfg> / add_chunks_kernel<Cfg>: for each chunk c, dst + c.dst receives
// (copy) or has added to it (add: fp32 elements, offsets and sizes multiples of 4) the
// c.bytes bytes at src + c.src. Chunks must not overlap in dst. One CTA per chunk in a
// grid-stride loop: any grid, 256 threads. These move the head/row selections of the
// hierarchical runtime (all-to-all packing, sub-ring messages, gradient sums); the lists
// are built once per batch.
struct CopyChunk {
  long long src, dst, bytes;
};
struct ChunksParams {
  const void* src;
  void* dst;
  const CopyChunk* chunks;
  long long num_chunks;
};

// The helpers of the cuDNN engine (lib/cuda/cudnn/, docs/gpu_backend.md "Attention
// engines"): cuDNN's fused attention runs a ragged batch of entries, entry b attending rows
// [begin, begin + len) of a query buffer (its THD ragged offsets point into hsap's buffers,
// so its O, dO and dQ rows are hsap's rows) and writing its softmax statistics to
// Stats[b, h, i] = stats[b * stats_entry_stride + h * stats_head_stride + i], fp32, i < len.
// cuDNN's Stats are M + log(Z) of the scaled scores in natural log: hsap's lse convention
// (attention/merge.h), so they are taken as they are. The entries of one call have disjoint
// rows. total_rows (the sum of the entries' len) sizes the grid.
struct EntryRows {
  long long begin, len;
};

// merge_entries_kernel<Cfg>: for every entry b, row i < len, head h, with r = begin + i,
// merges cuDNN's partial (o[r, h, :] in the storage dtype, Stats[b, h, i]) into hsap's fp32
// accumulators (out[r, h, :], lse[h * lse_stride + r]) exactly as lse_merge_kernel does (a
// Stats of -inf, a row that saw nothing, leaves them as they are). o: [rows, heads, D].
// One warp per (entry row, head) in a warp-stride loop per entry: any grid, 256 threads.
struct EntryMergeParams {
  float* out;
  float* lse;
  const void* o;
  const float* stats;
  const EntryRows* entries;
  long long lse_stride, stats_entry_stride, stats_head_stride, total_rows;
  int num_entries, heads;
};

// gather_stats_kernel<Cfg>: Stats[b, h, i] = lse[h * lse_stride + begin + i] for every entry
// b, head h, i < len: hsap's final lse as the Stats of cuDNN's backward. Grid-stride per
// entry: any grid, 256 threads.
struct StatsGatherParams {
  const float* lse;
  float* stats;
  const EntryRows* entries;
  long long lse_stride, stats_entry_stride, stats_head_stride, total_rows;
  int num_entries, heads;
};

// add_entries_kernel<Cfg>: dst[r, :] += src[r, :] for the rows r of every entry, src in the
// storage dtype (cuDNN's dQ, dK or dV), dst fp32 (hsap's accumulators); row_elems elements
// per row (heads * D). Grid-stride per entry: any grid, 256 threads.
struct EntryAddParams {
  float* dst;
  const void* src;
  const EntryRows* entries;
  long long row_elems, total_rows;
  int num_entries;
};

// One step of the fused forward: the K/V this rank attends to in step s, and where it
// comes from. k_src/v_src ([k_rows, heads_kv, D], storage dtype) are usually a PEER
// pointer to the owner's K/V (NVLink); for a step fed by the network they point to the
// local receive buffer. The copy tasks wait until *ready_flag >= ready_value (system-scope
// acquire; nullptr: no wait) before reading the source, and after copying its part each
// copy task adds 1 to *consumed_flag (system-scope release; nullptr: none), so the owner
// knows its buffer may be reused once it counts num_copy_ctas per reader.
struct FusedStep {
  const void* k_src;
  const void* v_src;
  const unsigned int* ready_flag;
  unsigned int* consumed_flag;
  const QueryBlock* blocks;
  const KeySegment* segments;
  long long k_rows;
  int num_blocks;
  unsigned int ready_value;
};

// fused_fwd_kernel<Cfg> (generated for roles with peers). The launch's work is a list of
// tasks handed out by ticket (an atomicAdd on counters[3]), never by blockIdx, so that it is
// correct whichever of its CTAs are resident, and when: a CTA takes the next ticket, does its
// task, and repeats; a CTA that starts after the last ticket finds nothing and leaves. For
// S = num_steps steps and C = num_copy_ctas copy parts per step, the tickets run through
//   copy(0), copy(1), compute(0), copy(2), compute(1), copy(3), ..., compute(S - 1)
// where copy(s) is C tasks, each copying 1/C of step s's K/V into staging buffer b = s % 2
// and adding 1 to counters[b] (ready), and compute(s) is num_blocks * heads_q work items
// (query block, query head), each running the forward over its block's segments against
// buffer b (merging into out/lse) and adding 1 to counters[2] (items done). Waits:
//   copy(s), s >= 2:  every item of step s - 2 is done (buffer b is free again);
//   compute(s):       counters[b] holds step s's C copies, and every item of step s - 1 is
//                     done (two steps may merge into the same output rows: steps merge in
//                     order, and the results are those of the staged path bit for bit).
// A task only ever waits for tasks of smaller tickets, all taken by CTAs that are running:
// any number of resident CTAs (one is enough) finishes the launch; there is no grid-wide
// barrier. Copies of step s + 1 still overlap the compute of step s.
// A copy task first waits until *ready_flag >= ready_value (the peer published); it gives up
// after ready_timeout_ns (0: never), reports kErrorPeerTimeout, skips that step's copy and
// carries on, so a peer that failed never hangs the device. Every other wait gives up when
// none of the launch's counters moved for 2 * ready_timeout_ns and at least a second (more
// than any peer wait lasts), reports kErrorStalled and carries on. Either way every counter and consumed flag
// is balanced when the kernel ends; its outputs are then invalid.
// Each copy task adds 1 to its step's *consumed_flag after copying: the owner counts
// num_copy_ctas per reader and call.
// Launch: Cfg::kThreads threads, Cfg::kFwdSmemBytes dynamic shared memory, any 1-D grid.
// The CTAs need not be co-resident, but the grid should stay within the launch's share of
// the CTAs the GPU keeps resident (lib/cuda/exec/launch_grid.h FusedForwardGrid): its CTAs
// spin on peers' flags while they hold their SM, and the peers' kernels that come before
// their flags need SMs too (the peer timeout bounds that case).
// counters: 4 words, zero at launch (memset them before each launch). Tasks per launch
// (S * C + the items of every step) must stay below 2^31.
// stage_k/stage_v: each at least max_s(k_rows) * heads_kv * D elements, 16-byte aligned.
// The parameters are a head and the step array, so the host can fill them for any
// kMaxSteps: the steps start at the same offset whatever their count.
struct FusedFwdHead {
  const void* q;
  float* out;
  float* lse;
  const int* kv_head_of_q;
  unsigned int* error_flag;
  void* stage_k[2];
  void* stage_v[2];
  unsigned int* counters;
  long long q_rows;
  unsigned long long ready_timeout_ns;
  int heads_q, heads_kv;
  float scale;
  int num_steps;      // <= kMaxSteps
  int num_copy_ctas;  // >= 1: copy tasks per step (parts of its K/V)
};
template <int kMaxSteps>
struct FusedFwdParamsT {
  FusedFwdHead head;
  FusedStep steps[kMaxSteps];
};

// fused_fwd_wgmma_kernel<Cfg> (configurations with the sm_90a forward and peers): the fused
// forward as one launch per step, in stream order. Launch s attends step s - 1 from its
// staging buffer (FwdParams, as attn_fwd_wgmma_kernel, whose CTAs it runs unchanged) while
// its `parts` copy CTAs stage step s into the other buffer (this FusedCopy); the first
// launch only copies, the last only attends. No CTA waits for another CTA of its launch,
// so any number of resident CTAs finishes it; the launch boundary orders each step's
// copies before its attention (and the generic-proxy stores before the TMA reads).
// Grid: x = parts + num_blocks, y = heads_q (1 without blocks); CTA (x < parts, 0) copies
// part x, CTAs (x < parts, y > 0) leave, CTA (parts + b, h) is the forward's CTA (b, h).
// A copy CTA waits until *ready_flag >= ready_value (system scope; nullptr: no wait) for at
// most ready_timeout_ns (0: no limit), past which it reports kErrorPeerTimeout to the
// FwdParams' error_flag and skips its copy; it copies its part of the k and v `bytes`
// (16-byte vectors where the pointers allow) and adds 1 to *consumed_flag (nullptr: none).
struct FusedCopy {
  const void* k_src;
  const void* v_src;
  void* k_dst;
  void* v_dst;
  long long bytes;  // of k, and of v
  const unsigned int* ready_flag;
  unsigned int* consumed_flag;
  unsigned long long ready_timeout_ns;
  unsigned int ready_value;
  int parts;  // copy CTAs; 0: the launch copies nothing
};

}  // namespace hsap_dev

#endif  // HSAP_JIT_DEVICE_HSAP_PARAMS_CUH_
