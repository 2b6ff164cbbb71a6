#include "bench/cudnn_timed_run.h"

#include <algorithm>
#include <memory>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "base/status_macros.h"
#include "bench/cudnn_attention.h"
#include "lib/cuda/runtime/cuda_loader.h"

namespace hsap::bench {
namespace {

// Device memory, streams and events of a timed run, released on every path.
struct RunResources {
  const cuda::CudaRuntimeApi* rt = nullptr;
  std::vector<void*> buffers;
  cuda::cudaStream stream = nullptr;
  cuda::cudaEvent start = nullptr, stop = nullptr;
  ~RunResources() {
    if (stream != nullptr) rt->StreamSynchronize(stream);
    if (start != nullptr) rt->EventDestroy(start);
    if (stop != nullptr) rt->EventDestroy(stop);
    if (stream != nullptr) rt->StreamDestroy(stream);
    for (void* p : buffers) rt->Free(p);
  }
  absl::StatusOr<void*> Alloc(size_t bytes, absl::string_view what) {
    void* p = nullptr;
    HSAP_RETURN_IF_ERROR(rt->Check(rt->Malloc(&p, std::max<size_t>(bytes, 16)),
                                   absl::StrCat("cudaMalloc(", bytes, " bytes) for ", what)));
    buffers.push_back(p);
    return p;
  }
  // A stream of its own and the two timing events.
  absl::Status StartTiming() {
    HSAP_RETURN_IF_ERROR(rt->Check(rt->StreamCreateWithFlags(&stream, cuda::kCudaStreamNonBlocking),
                                   "cudaStreamCreateWithFlags"));
    HSAP_RETURN_IF_ERROR(rt->Check(rt->EventCreateWithFlags(&start, 0), "cudaEventCreate"));
    return rt->Check(rt->EventCreateWithFlags(&stop, 0), "cudaEventCreate");
  }
  // Runs `call` warmup + iters times; the mean ms of the timed ones.
  template <typename Call>
  absl::StatusOr<double> Time(int warmup, int iters, Call call, absl::string_view what) {
    for (int i = 0; i < warmup; ++i) HSAP_RETURN_IF_ERROR(call());
    HSAP_RETURN_IF_ERROR(rt->Check(rt->EventRecord(start, stream), "cudaEventRecord"));
    for (int i = 0; i < iters; ++i) HSAP_RETURN_IF_ERROR(call());
    HSAP_RETURN_IF_ERROR(rt->Check(rt->EventRecord(stop, stream), "cudaEventRecord"));
    HSAP_RETURN_IF_ERROR(
        rt->Check(rt->EventSynchronize(stop), absl::StrCat("cudaEventSynchronize (", what, ")")));
    float ms = 0;
    HSAP_RETURN_IF_ERROR(rt->Check(rt->EventElapsedTime(&ms, start, stop), "cudaEventElapsedTime"));
    return static_cast<double>(ms) / iters;
  }
};

}  // namespace

absl::StatusOr<CudnnForwardRun> RunCudnnForward(const CudnnAttentionShape& shape,
                                                const void* q_host, const void* k_host,
                                                const void* v_host, int warmup, int iters,
                                                void* out_host) {
  if (iters < 1) return absl::InvalidArgumentError("cuDNN attention: iters must be at least 1");
  absl::StatusOr<std::unique_ptr<CudnnAttention>> runner = CudnnAttention::Create(shape);
  if (!runner.ok()) return runner.status();
  absl::StatusOr<const cuda::CudaRuntimeApi*> rt_or = cuda::LoadCudaRuntime();
  if (!rt_or.ok()) return rt_or.status();
  const cuda::CudaRuntimeApi* rt = *rt_or;
  CudnnAttention& attn = **runner;
  const int64_t T = attn.geometry().total_tokens;
  const size_t es = DTypeSize(shape.dtype);
  const size_t q_bytes = static_cast<size_t>(T) * shape.heads_q * shape.head_dim * es;
  const size_t kv_bytes = static_cast<size_t>(T) * shape.heads_kv * shape.head_dim * es;

  RunResources res;
  res.rt = rt;
  void *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr, *stats = nullptr;
  {
    absl::StatusOr<void*> p = res.Alloc(q_bytes, "Q");
    if (!p.ok()) return p.status();
    q = *p;
    if (p = res.Alloc(kv_bytes, "K"); !p.ok()) return p.status();
    k = *p;
    if (p = res.Alloc(kv_bytes, "V"); !p.ok()) return p.status();
    v = *p;
    if (p = res.Alloc(q_bytes, "O"); !p.ok()) return p.status();
    o = *p;
    if (p = res.Alloc(attn.StatsBytes(), "the softmax stats"); !p.ok()) return p.status();
    stats = *p;
  }
  auto check = [&](cuda::cudaError e, absl::string_view what) { return rt->Check(e, what); };
  for (auto [dst, src, bytes] : {std::tuple<void*, const void*, size_t>{q, q_host, q_bytes},
                                 {k, k_host, kv_bytes},
                                 {v, v_host, kv_bytes}}) {
    HSAP_RETURN_IF_ERROR(
        check(rt->Memcpy(dst, src, bytes, cuda::kCudaMemcpyDefault), "cudaMemcpy (cuDNN inputs)"));
  }
  // Copies from pageable memory may return before their DMA lands; the stream below is
  // non-blocking.
  HSAP_RETURN_IF_ERROR(check(rt->DeviceSynchronize(), "cudaDeviceSynchronize (cuDNN inputs)"));
  HSAP_RETURN_IF_ERROR(check(rt->StreamCreateWithFlags(&res.stream, cuda::kCudaStreamNonBlocking),
                             "cudaStreamCreateWithFlags"));
  HSAP_RETURN_IF_ERROR(check(rt->EventCreateWithFlags(&res.start, 0), "cudaEventCreate"));
  HSAP_RETURN_IF_ERROR(check(rt->EventCreateWithFlags(&res.stop, 0), "cudaEventCreate"));
  for (int i = 0; i < warmup; ++i) {
    HSAP_RETURN_IF_ERROR(attn.Forward(q, k, v, o, static_cast<float*>(stats), res.stream));
  }
  HSAP_RETURN_IF_ERROR(check(rt->EventRecord(res.start, res.stream), "cudaEventRecord"));
  for (int i = 0; i < iters; ++i) {
    HSAP_RETURN_IF_ERROR(attn.Forward(q, k, v, o, static_cast<float*>(stats), res.stream));
  }
  HSAP_RETURN_IF_ERROR(check(rt->EventRecord(res.stop, res.stream), "cudaEventRecord"));
  HSAP_RETURN_IF_ERROR(
      check(rt->EventSynchronize(res.stop), "cudaEventSynchronize (cuDNN attention forward)"));
  float ms = 0;
  HSAP_RETURN_IF_ERROR(
      check(rt->EventElapsedTime(&ms, res.start, res.stop), "cudaEventElapsedTime"));
  if (out_host != nullptr) {
    HSAP_RETURN_IF_ERROR(check(rt->Memcpy(out_host, o, q_bytes, cuda::kCudaMemcpyDefault),
                               "cudaMemcpy (cuDNN output)"));
  }
  CudnnForwardRun run;
  run.forward_ms = static_cast<double>(ms) / iters;
  run.version = attn.version();
  run.workspace_bytes = attn.WorkspaceBytes();
  return run;
}

absl::StatusOr<CudnnBackwardRun> RunCudnnBackward(const CudnnAttentionShape& shape,
                                                  const void* q_host, const void* k_host,
                                                  const void* v_host, const void* dout_host,
                                                  int warmup, int iters, void* dq_host,
                                                  void* dk_host, void* dv_host) {
  if (iters < 1) return absl::InvalidArgumentError("cuDNN attention: iters must be at least 1");
  // The forward leaves O and the Stats the backward reads.
  HSAP_ASSIGN_OR_RETURN(std::unique_ptr<CudnnAttention> forward,
                        CudnnAttention::Create(shape, CudnnPass::kForward));
  HSAP_ASSIGN_OR_RETURN(std::unique_ptr<CudnnAttention> backward,
                        CudnnAttention::Create(shape, CudnnPass::kBackward));
  HSAP_ASSIGN_OR_RETURN(const cuda::CudaRuntimeApi* rt, cuda::LoadCudaRuntime());
  const int64_t T = backward->geometry().total_tokens;
  const size_t es = DTypeSize(shape.dtype);
  const size_t q_bytes = static_cast<size_t>(T) * shape.heads_q * shape.head_dim * es;
  const size_t kv_bytes = static_cast<size_t>(T) * shape.heads_kv * shape.head_dim * es;

  RunResources res;
  res.rt = rt;
  HSAP_ASSIGN_OR_RETURN(void* q, res.Alloc(q_bytes, "Q"));
  HSAP_ASSIGN_OR_RETURN(void* k, res.Alloc(kv_bytes, "K"));
  HSAP_ASSIGN_OR_RETURN(void* v, res.Alloc(kv_bytes, "V"));
  HSAP_ASSIGN_OR_RETURN(void* o, res.Alloc(q_bytes, "O"));
  HSAP_ASSIGN_OR_RETURN(void* dout, res.Alloc(q_bytes, "dO"));
  HSAP_ASSIGN_OR_RETURN(void* stats, res.Alloc(forward->StatsBytes(), "the softmax stats"));
  HSAP_ASSIGN_OR_RETURN(void* dq, res.Alloc(q_bytes, "dQ"));
  HSAP_ASSIGN_OR_RETURN(void* dk, res.Alloc(kv_bytes, "dK"));
  HSAP_ASSIGN_OR_RETURN(void* dv, res.Alloc(kv_bytes, "dV"));
  for (auto [dst, src, bytes] : {std::tuple<void*, const void*, size_t>{q, q_host, q_bytes},
                                 {k, k_host, kv_bytes},
                                 {v, v_host, kv_bytes},
                                 {dout, dout_host, q_bytes}}) {
    HSAP_RETURN_IF_ERROR(rt->Check(rt->Memcpy(dst, src, bytes, cuda::kCudaMemcpyDefault),
                                   "cudaMemcpy (cuDNN backward inputs)"));
  }
  HSAP_RETURN_IF_ERROR(
      rt->Check(rt->DeviceSynchronize(), "cudaDeviceSynchronize (cuDNN backward inputs)"));
  HSAP_RETURN_IF_ERROR(res.StartTiming());
  float* stats_f = static_cast<float*>(stats);
  HSAP_RETURN_IF_ERROR(forward->Forward(q, k, v, o, stats_f, res.stream));
  HSAP_ASSIGN_OR_RETURN(
      const double ms,
      res.Time(
          warmup, iters,
          [&] { return backward->Backward(q, k, v, o, dout, stats_f, dq, dk, dv, res.stream); },
          "cuDNN attention backward"));
  for (auto [dst, src, bytes] : {std::tuple<void*, const void*, size_t>{dq_host, dq, q_bytes},
                                 {dk_host, dk, kv_bytes},
                                 {dv_host, dv, kv_bytes}}) {
    if (dst == nullptr) continue;
    HSAP_RETURN_IF_ERROR(rt->Check(rt->Memcpy(dst, src, bytes, cuda::kCudaMemcpyDefault),
                                   "cudaMemcpy (cuDNN gradients)"));
  }
  CudnnBackwardRun run;
  run.backward_ms = ms;
  run.version = backward->version();
  run.workspace_bytes = backward->WorkspaceBytes();
  run.scratch_bytes = backward->ScratchBytes();
  return run;
}

}  // namespace hsap::bench
