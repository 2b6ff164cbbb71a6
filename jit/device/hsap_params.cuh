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

// One step of the fused forward: the K/V this rank attends to in step s, and where it
// comes from. k_src/v_src ([k_rows, heads_kv, D], storage dtype) are usually a PEER
// pointer to the owner's K/V (NVLink); for a step fed by the network they point to the
// local receive buffer. The copy blocks wait until *ready_flag >= ready_value (system-scope
// acquire; nullptr: no wait) before reading the source, and after the whole step has been
// copied each copy block adds 1 to *consumed_flag (system-scope release; nullptr: none),
// so the owner knows its buffer may be reused once it counts num_copy_ctas per reader.
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

// fused_fwd_kernel<Cfg> (generated for roles with peers). 1-D grid: the first
// num_copy_ctas CTAs copy, the others compute. Step s uses staging buffer b = s % 2:
// the copiers wait until every compute CTA released the buffer from step s - 2, copy the
// step's K/V into stage_k[b]/stage_v[b] and release counters[b] (ready); the compute CTAs
// wait for that, run the forward over the step's work list (merging into out/lse) and add
// 1 to counters[2 + b] (consumed). Copies of step s + 1 thus overlap compute of step s.
// Compute CTAs also wait for all of step s - 1 before starting step s, because two steps may
// merge into the same output rows.
// A copy CTA gives up waiting for a step's ready_flag after ready_timeout_ns (0: never),
// reports kErrorPeerTimeout, skips that step's copy and carries on, so a peer that failed
// never hangs the device.
// Launch: Cfg::kThreads threads, Cfg::kFwdSmemBytes dynamic shared memory, and a grid whose
// CTAs are ALL resident at once (cooperative launch, or at most the occupancy-derived
// number of CTAs); otherwise waiting CTAs can starve the ones they wait for.
// counters: 4 words, zero at launch (memset them before each launch).
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
  int num_copy_ctas;  // >= 1, < gridDim.x
};
template <int kMaxSteps>
struct FusedFwdParamsT {
  FusedFwdHead head;
  FusedStep steps[kMaxSteps];
};

}  // namespace hsap_dev

#endif  // HSAP_JIT_DEVICE_HSAP_PARAMS_CUH_
