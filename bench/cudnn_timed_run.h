// A timed run of the cuDNN attention baseline (bench/cudnn_attention.h) on one row, as
// hsap_attn_perf reports it: the row's tensors uploaded, warmup and timed calls on a stream
// of its own (CUDA events), the results copied back. Unimplemented where CudnnAttention::Create
// is (no library, header or GPU).
#ifndef HSAP_BENCH_CUDNN_TIMED_RUN_H_
#define HSAP_BENCH_CUDNN_TIMED_RUN_H_

#include <cstddef>

#include "absl/status/statusor.h"
#include "bench/cudnn_graph_plan.h"

namespace hsap::bench {

// One timed run of cuDNN's forward on the whole row, as hsap_attn_perf reports it.
struct CudnnForwardRun {
  double forward_ms = 0;  // per call, mean over iters after warmup (CUDA events)
  int version = 0;
  size_t workspace_bytes = 0;
};

// Uploads the row's host tensors (our layout, shape.dtype), runs `warmup` untimed and `iters`
// timed forwards on a stream of its own, and copies the output back into `out_host` (T * Hq *
// D elements) when it is not null. All device memory is freed on every path.
absl::StatusOr<CudnnForwardRun> RunCudnnForward(const CudnnAttentionShape& shape,
                                                const void* q_host, const void* k_host,
                                                const void* v_host, int warmup, int iters,
                                                void* out_host);

// One timed run of cuDNN's backward on the whole row.
struct CudnnBackwardRun {
  double backward_ms = 0;  // per call, mean over iters after warmup (CUDA events)
  int version = 0;
  size_t workspace_bytes = 0;  // the backward plan's workspace
  size_t scratch_bytes = 0;    // softmax_sum, the fp32 dQ accumulator (and GQA full heads)
};

// Uploads the row's host tensors (our layout, shape.dtype: q and dout T * Hq * D elements, k
// and v T * Hkv * D), runs cuDNN's forward once for O and the Stats, then `warmup` untimed and
// `iters` timed backwards on a stream of its own, and copies dQ, dK, dV back into the host
// buffers that are not null. All device memory is freed on every path.
absl::StatusOr<CudnnBackwardRun> RunCudnnBackward(const CudnnAttentionShape& shape,
                                                  const void* q_host, const void* k_host,
                                                  const void* v_host, const void* dout_host,
                                                  int warmup, int iters, void* dq_host,
                                                  void* dk_host, void* dv_host);

}  // namespace hsap::bench

#endif  // HSAP_BENCH_CUDNN_TIMED_RUN_H_
