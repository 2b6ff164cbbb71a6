// Batch entry points of the C ABI: distributed attention over one packed row.
//
// The collective calls keep a rank in step with its peers even when its own arguments are
// wrong: the argument checks run first, and their verdict travels with the rank's part of
// the agreement, so that every rank fails at once instead of waiting for a timeout. Only a
// null communicator or batch handle (nothing to take part with) returns without it.
#include "lib/api/batch.h"

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/params.h"
#include "base/status_macros.h"
#include "hsap/hsap.h"
#include "jit/host_jit_kernels.h"
#include "lib/api/checks.h"
#include "lib/api/result.h"
#include "lib/cuda/exec/gpu_batch.h"
#include "lib/exec/batch.h"

namespace hsap {
namespace {

// Size of version 1 of hsapBatchConfig_t.
constexpr size_t kBatchConfigV1Size = sizeof(hsapBatchConfig_t);

// The most batches hsapBatchCreateManyWithPartition makes in one call (hsap.h).
constexpr int kMaxBatchesTogether = 256;

absl::StatusOr<Batch*> BatchFromHandle(hsapBatch_t batch) {
  if (batch == nullptr || batch->batch == nullptr) {
    return absl::InvalidArgumentError("batch is null; create one with hsapBatchCreate");
  }
  return batch->batch.get();
}

// First failing check of a list, or OK.
template <typename... Checks>
absl::Status FirstError(Checks&&... checks) {
  absl::Status result;
  ((result.ok() ? (void)(result = checks()) : (void)0), ...);
  return result;
}

// The engine choice of a CUDA batch; Unimplemented for a host batch.
absl::StatusOr<const cuda::BatchEngines*> EnginesOfBatch(const Batch& batch) {
  const cuda::BatchEngines* engines = cuda::EnginesOf(batch.runner());
  if (engines == nullptr) {
    return absl::UnimplementedError(
        "this batch runs on the host backend, which has no attention engines (only CUDA "
        "batches do: communicators of hsapBackendCuda or hsapCommInitLoopback)");
  }
  return engines;
}

}  // namespace

absl::StatusOr<std::shared_ptr<const KernelSet>> HostKernelsForOptions(const BatchOptions& options,
                                                                       const Layout& layout) {
  HSAP_ASSIGN_OR_RETURN(AttentionDims dims, DimsFromOptions(options));
  return jit::HostKernelsForBatch(dims, options.dtype, layout);
}

namespace {

absl::StatusOr<BatchBackend> PrepareBackend(const hsapComm_st& comm, const BatchOptions& options,
                                            const Layout& layout, bool planned) {
  BatchBackend backend;
  if (comm.gpu == nullptr) {
    HSAP_ASSIGN_OR_RETURN(backend.kernels, HostKernelsForOptions(options, layout));
    backend.runners = HostRunners(*backend.kernels);
    return backend;
  }
  cuda::ScopedDevice on(comm.gpu->device());  // the kernels load into the communicator's GPU
  HSAP_RETURN_IF_ERROR(on.status());
  // Batches without a plan on transports that offer peer windows (loopback, NCCL) run
  // forward through them unless $HSAP_FUSED_FORWARD is 0 (a rank that says 0 makes every
  // rank fall back to stages).
  HSAP_ASSIGN_OR_RETURN(const bool fused_env, GetBoolParam(Param::kFusedForward));
  const bool fused = !planned && cuda::OffersPeerWindows(comm.comm->transport()) && fused_env;
  // The engine of the attention pieces ($HSAP_ATTENTION_ENGINE): under `cudnn`, a batch
  // cuDNN cannot run fails here, on every rank through the creation's agreement.
  HSAP_ASSIGN_OR_RETURN(AttentionDims dims, DimsFromOptions(options));
  const cuda::EngineShape engine_shape = cuda::EngineShapeOf(dims, options.dtype);
  HSAP_ASSIGN_OR_RETURN(cuda::EngineSetup engines, cuda::EngineSetupFromEnvironment(&engine_shape));
  HSAP_RETURN_IF_ERROR(
      cuda::CheckEngineMode(engines.mode, cuda::BatchCudnnStatus(engines, engine_shape)));
  HSAP_ASSIGN_OR_RETURN(std::shared_ptr<const cuda::DeviceKernels> kernels,
                        cuda::JitKernelsForBatch(options, layout, fused));
  backend.runners = cuda::NewGpuRunners(comm.gpu, std::move(kernels), std::move(engines));
  return backend;
}

}  // namespace

BatchBackend BackendForCreate(const hsapComm_st& comm, const BatchOptions& options,
                              const Layout& layout, bool planned, absl::Status& local) {
  if (local.ok()) {
    absl::StatusOr<BatchBackend> backend = PrepareBackend(comm, options, layout, planned);
    if (backend.ok()) return *std::move(backend);
    local = backend.status();
  }
  return BatchBackend{nullptr, HostRunners(HandWrittenKernels())};
}

absl::StatusOr<BatchOptions> OptionsFromConfig(const hsapBatchConfig_t* config) {
  if (config == nullptr) {
    return absl::InvalidArgumentError(
        "config is null; fill an hsapBatchConfig_t with HSAP_BATCH_CONFIG_INITIALIZER and set "
        "dtype, numHeadsQ, numHeadsKV and headDim");
  }
  HSAP_RETURN_IF_ERROR(
      CheckConfigHeader(*config, "config", kBatchConfigV1Size, "HSAP_BATCH_CONFIG_INITIALIZER"));
  BatchOptions options;
  HSAP_ASSIGN_OR_RETURN(options.dtype, DTypeFromC(config->dtype, "config->dtype"));
  HSAP_RETURN_IF_ERROR(CheckHeadCount(config->numHeadsQ, "config->numHeadsQ"));
  HSAP_RETURN_IF_ERROR(CheckHeadCount(config->numHeadsKV, "config->numHeadsKV"));
  options.heads_q = config->numHeadsQ;
  options.heads_kv = config->numHeadsKV;
  options.head_dim = config->headDim;
  options.scale = config->softmaxScale;
  return options;
}

hsapBatch_st* NewBatchHandle(std::unique_ptr<Batch> batch, std::shared_ptr<const KernelSet> kernels,
                             hsapComm_st& comm) {
  auto handle = std::make_unique<hsapBatch_st>();
  handle->partition.partition = batch->partition();
  handle->partition.owned_by_batch = true;
  handle->batch = std::move(batch);
  handle->kernels = std::move(kernels);
  handle->comm = &comm;
  comm.live_batches.fetch_add(1);
  return handle.release();
}

namespace {

// The stream of an OnStream call as the runners take it (Batch::Forward's `stream`): null
// for the plain calls and for host batches (which take only NULL); on a CUDA batch, the
// caller's stream, NULL meaning CUDA's default stream as for NCCL: cudaStreamLegacy
// ((cudaStream_t)0x1, driver_types.h).
void* RunnerStream(const hsapBatch_st& batch, bool on_stream, void* stream) {
  if (!on_stream || batch.comm == nullptr || batch.comm->gpu == nullptr) return nullptr;
  return stream != nullptr ? stream : reinterpret_cast<void*>(uintptr_t{1});
}

// The caller's stream of an OnStream call: a stream of a CUDA communicator's device, or NULL
// for a host communicator.
absl::Status CheckCallStream(const hsapBatch_st& batch, bool on_stream, void* stream) {
  if (!on_stream) return absl::OkStatus();
  if (batch.comm == nullptr || batch.comm->gpu == nullptr) {
    if (stream == nullptr) return absl::OkStatus();
    return absl::InvalidArgumentError(
        "cudaStream is not NULL but the batch is on a host communicator; pass NULL (host "
        "batches compute on the calling thread)");
  }
  return batch.comm->gpu->CheckStream(
      static_cast<cuda::cudaStream>(RunnerStream(batch, on_stream, stream)), "cudaStream");
}

// The forward's and backward's log-sum-exp: needed whenever the rank holds tokens.
absl::Status CheckLse(const float* lse, int64_t local_tokens) {
  if (lse == nullptr && local_tokens > 0) return absl::InvalidArgumentError("lse is null");
  return absl::OkStatus();
}

// on_stream: an OnStream call, on `stream`.
absl::Status Forward(hsapBatch_t batch, const hsapTensor_t* q, const hsapTensor_t* k,
                     const hsapTensor_t* v, hsapTensor_t* out, float* lse, bool on_stream,
                     void* stream) {
  HSAP_ASSIGN_OR_RETURN(Batch * bs, BatchFromHandle(batch));
  Batch& b = *bs;
  const int64_t n = b.local_tokens();
  const AttentionDims& d = b.dims();
  const DType t = b.dtype();
  absl::Status local =
      FirstError([&] { return CheckTensor(q, "q", t, n, d.heads_q, d.head_dim); },
                 [&] { return CheckTensor(k, "k", t, n, d.heads_kv, d.head_dim); },
                 [&] { return CheckTensor(v, "v", t, n, d.heads_kv, d.head_dim); },
                 [&] { return CheckTensor(out, "out", t, n, d.heads_q, d.head_dim); },
                 [&] { return CheckLse(lse, n); },
                 [&] { return CheckCallStream(*batch, on_stream, stream); });
  if (!local.ok()) return b.Forward(nullptr, nullptr, nullptr, nullptr, nullptr, local);
  return b.Forward(q->data, k->data, v->data, out->data, lse, absl::OkStatus(),
                   RunnerStream(*batch, on_stream, stream));
}

absl::Status Backward(hsapBatch_t batch, const hsapTensor_t* dout, const hsapTensor_t* q,
                      const hsapTensor_t* k, const hsapTensor_t* v, const hsapTensor_t* out,
                      const float* lse, hsapTensor_t* dq, hsapTensor_t* dk, hsapTensor_t* dv,
                      bool on_stream, void* stream) {
  HSAP_ASSIGN_OR_RETURN(Batch * bs, BatchFromHandle(batch));
  Batch& b = *bs;
  const int64_t n = b.local_tokens();
  const AttentionDims& d = b.dims();
  const DType t = b.dtype();
  absl::Status local =
      FirstError([&] { return CheckTensor(dout, "dout", t, n, d.heads_q, d.head_dim); },
                 [&] { return CheckTensor(q, "q", t, n, d.heads_q, d.head_dim); },
                 [&] { return CheckTensor(k, "k", t, n, d.heads_kv, d.head_dim); },
                 [&] { return CheckTensor(v, "v", t, n, d.heads_kv, d.head_dim); },
                 [&] { return CheckTensor(out, "out", t, n, d.heads_q, d.head_dim); },
                 [&] { return CheckLse(lse, n); },
                 [&] { return CheckTensor(dq, "dq", t, n, d.heads_q, d.head_dim); },
                 [&] { return CheckTensor(dk, "dk", t, n, d.heads_kv, d.head_dim); },
                 [&] { return CheckTensor(dv, "dv", t, n, d.heads_kv, d.head_dim); },
                 [&] { return CheckCallStream(*batch, on_stream, stream); });
  if (!local.ok()) {
    return b.Backward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                      nullptr, local);
  }
  return b.Backward(dout->data, q->data, k->data, v->data, out->data, lse, dq->data, dk->data,
                    dv->data, absl::OkStatus(), RunnerStream(*batch, on_stream, stream));
}

}  // namespace

}  // namespace hsap

extern "C" {

hsapResult_t hsapBatchCreate(hsapBatch_t* batch, hsapComm_t comm, hsapLayout_t layout,
                             const double* weights, const hsapBatchConfig_t* config) {
  return hsap::RunApi("hsapBatchCreate", [&]() -> absl::Status {
    if (comm == nullptr || comm->comm == nullptr) {
      return absl::InvalidArgumentError("comm is null; create communicators with hsapCommInitAll");
    }
    hsap::Communicator& c = *comm->comm;
    hsap::BatchOptions options;
    absl::Status local = hsap::FirstError(
        [&] { return hsap::CheckNotNull(batch, "batch"); },
        [&]() -> absl::Status {
          if (layout == nullptr) {
            return absl::InvalidArgumentError("layout is null; create one with hsapLayoutCreate");
          }
          return absl::OkStatus();
        },
        [&]() -> absl::Status {
          HSAP_ASSIGN_OR_RETURN(options, hsap::OptionsFromConfig(config));
          return absl::OkStatus();
        });
    static const hsap::Layout* const kNoLayout = new hsap::Layout();
    const hsap::Layout& l = layout != nullptr ? layout->layout : *kNoLayout;
    absl::Span<const double> w;
    if (weights != nullptr) w = absl::MakeConstSpan(weights, static_cast<size_t>(c.size()));
    hsap::BatchBackend backend =
        hsap::BackendForCreate(*comm, options, l, /*planned=*/false, local);
    HSAP_ASSIGN_OR_RETURN(std::unique_ptr<hsap::Batch> b,
                          hsap::Batch::Create(c, l, w, options, *backend.runners, local));
    *batch = hsap::NewBatchHandle(std::move(b), std::move(backend.kernels), *comm);
    return absl::OkStatus();
  });
}

hsapResult_t hsapBatchCreateWithPartition(hsapBatch_t* batch, hsapComm_t comm, hsapLayout_t layout,
                                          hsapPartition_t partition,
                                          const hsapBatchConfig_t* config) {
  return hsap::RunApi("hsapBatchCreateWithPartition", [&]() -> absl::Status {
    if (comm == nullptr || comm->comm == nullptr) {
      return absl::InvalidArgumentError("comm is null; create communicators with hsapCommInitAll");
    }
    hsap::Communicator& c = *comm->comm;
    hsap::BatchOptions options;
    std::shared_ptr<const hsap::Partition> shared;
    absl::Status local = hsap::FirstError(
        [&] { return hsap::CheckNotNull(batch, "batch"); },
        [&]() -> absl::Status {
          if (layout == nullptr) {
            return absl::InvalidArgumentError("layout is null; create one with hsapLayoutCreate");
          }
          return absl::OkStatus();
        },
        [&]() -> absl::Status {
          HSAP_RETURN_IF_ERROR(hsap::PartitionFromHandle(partition).status());
          shared = partition->partition;
          return absl::OkStatus();
        },
        [&]() -> absl::Status {
          HSAP_ASSIGN_OR_RETURN(options, hsap::OptionsFromConfig(config));
          return absl::OkStatus();
        });
    static const hsap::Layout* const kNoLayout = new hsap::Layout();
    const hsap::Layout& l = layout != nullptr ? layout->layout : *kNoLayout;
    hsap::BatchBackend backend =
        hsap::BackendForCreate(*comm, options, l, /*planned=*/false, local);
    HSAP_ASSIGN_OR_RETURN(std::unique_ptr<hsap::Batch> b,
                          hsap::Batch::CreateWithPartition(c, l, std::move(shared), options,
                                                           *backend.runners, local));
    *batch = hsap::NewBatchHandle(std::move(b), std::move(backend.kernels), *comm);
    return absl::OkStatus();
  });
}

hsapResult_t hsapBatchCreateManyWithPartition(hsapBatch_t* batches, int numBatches, hsapComm_t comm,
                                              const hsapLayout_t* layouts,
                                              hsapPartition_t partition,
                                              const hsapBatchConfig_t* configs) {
  return hsap::RunApi("hsapBatchCreateManyWithPartition", [&]() -> absl::Status {
    if (comm == nullptr || comm->comm == nullptr) {
      return absl::InvalidArgumentError("comm is null; create communicators with hsapCommInitAll");
    }
    hsap::Communicator& c = *comm->comm;
    std::shared_ptr<const hsap::Partition> shared;
    absl::Status local =
        hsap::FirstError([&] { return hsap::CheckNotNull(batches, "batches"); },
                         [&]() -> absl::Status {
                           if (numBatches < 1 || numBatches > hsap::kMaxBatchesTogether) {
                             return absl::InvalidArgumentError(
                                 absl::StrCat("numBatches = ", numBatches, "; it must be in [1, ",
                                              hsap::kMaxBatchesTogether, "]"));
                           }
                           return absl::OkStatus();
                         },
                         [&] { return hsap::CheckNotNull(layouts, "layouts"); },
                         [&] { return hsap::CheckNotNull(configs, "configs"); },
                         [&]() -> absl::Status {
                           for (int i = 0; i < numBatches; ++i) {
                             if (layouts[i] == nullptr) {
                               return absl::InvalidArgumentError(absl::StrCat(
                                   "layouts[", i, "] is null; create it with hsapLayoutCreate"));
                             }
                           }
                           return absl::OkStatus();
                         },
                         [&]() -> absl::Status {
                           HSAP_RETURN_IF_ERROR(hsap::PartitionFromHandle(partition).status());
                           shared = partition->partition;
                           return absl::OkStatus();
                         });
    // Each batch's options and backend (kernels, runners), in order; the first failure ends
    // the list (the rank then still takes part in the agreement).
    std::vector<const hsap::Layout*> ls;
    std::vector<hsap::BatchOptions> options;
    std::vector<hsap::BatchBackend> backends;
    for (int i = 0; local.ok() && i < numBatches; ++i) {
      absl::StatusOr<hsap::BatchOptions> o = hsap::OptionsFromConfig(&configs[i]);
      if (!o.ok()) {
        local = absl::Status(o.status().code(),
                             absl::StrCat("configs[", i, "]: ", o.status().message()));
        break;
      }
      hsap::BatchBackend backend =
          hsap::BackendForCreate(*comm, *o, layouts[i]->layout, /*planned=*/false, local);
      if (!local.ok()) break;
      ls.push_back(&layouts[i]->layout);
      options.push_back(*o);
      backends.push_back(std::move(backend));
    }
    std::vector<hsap::RunnerFactory*> runners;
    for (hsap::BatchBackend& b : backends) runners.push_back(b.runners.get());
    if (!local.ok()) ls.clear(), options.clear(), runners.clear();
    HSAP_ASSIGN_OR_RETURN(
        std::vector<std::unique_ptr<hsap::Batch>> made,
        hsap::Batch::CreateManyWithPartition(c, ls, std::move(shared), options, runners, local));
    for (size_t i = 0; i < made.size(); ++i) {
      batches[i] = hsap::NewBatchHandle(std::move(made[i]), std::move(backends[i].kernels), *comm);
    }
    return absl::OkStatus();
  });
}

hsapResult_t hsapBatchDestroy(hsapBatch_t batch) {
  return hsap::RunApi("hsapBatchDestroy", [&]() -> absl::Status {
    delete batch;
    return absl::OkStatus();
  });
}

hsapResult_t hsapBatchGetPartition(hsapBatch_t batch, hsapPartition_t* partition) {
  return hsap::RunApi("hsapBatchGetPartition", [&]() -> absl::Status {
    if (absl::StatusOr<hsap::Batch*> b = hsap::BatchFromHandle(batch); !b.ok()) return b.status();
    HSAP_RETURN_IF_ERROR(hsap::CheckNotNull(partition, "partition"));
    *partition = &batch->partition;
    return absl::OkStatus();
  });
}

hsapResult_t hsapBatchGetLocalTokens(hsapBatch_t batch, int64_t* numTokens) {
  return hsap::RunApi("hsapBatchGetLocalTokens", [&]() -> absl::Status {
    HSAP_ASSIGN_OR_RETURN(hsap::Batch * b, hsap::BatchFromHandle(batch));
    HSAP_RETURN_IF_ERROR(hsap::CheckNotNull(numTokens, "numTokens"));
    *numTokens = b->local_tokens();
    return absl::OkStatus();
  });
}

hsapResult_t hsapAttentionForward(hsapBatch_t batch, const hsapTensor_t* q, const hsapTensor_t* k,
                                  const hsapTensor_t* v, hsapTensor_t* out, float* lse) {
  return hsap::RunApi("hsapAttentionForward",
                      [&] { return hsap::Forward(batch, q, k, v, out, lse, false, nullptr); });
}

hsapResult_t hsapAttentionForwardOnStream(hsapBatch_t batch, const hsapTensor_t* q,
                                          const hsapTensor_t* k, const hsapTensor_t* v,
                                          hsapTensor_t* out, float* lse, void* cudaStream) {
  return hsap::RunApi("hsapAttentionForwardOnStream",
                      [&] { return hsap::Forward(batch, q, k, v, out, lse, true, cudaStream); });
}

hsapResult_t hsapAttentionBackward(hsapBatch_t batch, const hsapTensor_t* dout,
                                   const hsapTensor_t* q, const hsapTensor_t* k,
                                   const hsapTensor_t* v, const hsapTensor_t* out, const float* lse,
                                   hsapTensor_t* dq, hsapTensor_t* dk, hsapTensor_t* dv) {
  return hsap::RunApi("hsapAttentionBackward", [&] {
    return hsap::Backward(batch, dout, q, k, v, out, lse, dq, dk, dv, false, nullptr);
  });
}

hsapResult_t hsapAttentionBackwardOnStream(hsapBatch_t batch, const hsapTensor_t* dout,
                                           const hsapTensor_t* q, const hsapTensor_t* k,
                                           const hsapTensor_t* v, const hsapTensor_t* out,
                                           const float* lse, hsapTensor_t* dq, hsapTensor_t* dk,
                                           hsapTensor_t* dv, void* cudaStream) {
  return hsap::RunApi("hsapAttentionBackwardOnStream", [&] {
    return hsap::Backward(batch, dout, q, k, v, out, lse, dq, dk, dv, true, cudaStream);
  });
}

hsapResult_t hsapBatchGetTraffic(hsapBatch_t batch, hsapTraffic_t* traffic) {
  return hsap::RunApi("hsapBatchGetTraffic", [&]() -> absl::Status {
    HSAP_ASSIGN_OR_RETURN(hsap::Batch * b, hsap::BatchFromHandle(batch));
    HSAP_RETURN_IF_ERROR(hsap::CheckNotNull(traffic, "traffic"));
    const hsap::BatchTraffic& t = b->traffic();
    traffic->forwardBytesSent = t.forward.sent();
    traffic->forwardBytesReceived = t.forward.received();
    traffic->backwardBytesSent = t.backward.sent();
    traffic->backwardBytesReceived = t.backward.received();
    return absl::OkStatus();
  });
}

hsapResult_t hsapBatchGetEngines(hsapBatch_t batch, hsapEngines_t* engines) {
  return hsap::RunApi("hsapBatchGetEngines", [&]() -> absl::Status {
    HSAP_ASSIGN_OR_RETURN(hsap::Batch * b, hsap::BatchFromHandle(batch));
    HSAP_RETURN_IF_ERROR(hsap::CheckNotNull(engines, "engines"));
    HSAP_ASSIGN_OR_RETURN(const hsap::cuda::BatchEngines* e, hsap::EnginesOfBatch(*b));
    const hsap::cuda::EngineTally& t = e->tally();
    constexpr int kJit = static_cast<int>(hsap::cuda::AttentionEngine::kJit);
    constexpr int kCudnn = static_cast<int>(hsap::cuda::AttentionEngine::kCudnn);
    engines->mode = e->mode() == hsap::cuda::EngineMode::kCudnn ? hsapEngineCudnn
                    : e->mode() == hsap::cuda::EngineMode::kJit ? hsapEngineJit
                                                                : hsapEngineAuto;
    engines->cudnnPieces = t.pieces[kCudnn];
    engines->jitPieces = t.pieces[kJit];
    engines->cudnnPairs = t.pairs[kCudnn];
    engines->jitPairs = t.pairs[kJit];
    engines->cudnnCalls = t.cudnn_calls;
    return absl::OkStatus();
  });
}

hsapResult_t hsapBatchGetEngineReport(hsapBatch_t batch, char* buffer, size_t* size) {
  return hsap::RunApi("hsapBatchGetEngineReport", [&]() -> absl::Status {
    HSAP_ASSIGN_OR_RETURN(hsap::Batch * b, hsap::BatchFromHandle(batch));
    HSAP_RETURN_IF_ERROR(hsap::CheckNotNull(size, "size"));
    HSAP_RETURN_IF_ERROR(hsap::EnginesOfBatch(*b).status());
    const std::string text = hsap::cuda::EngineReportOf(b->runner());
    const size_t needed = text.size() + 1;
    if (buffer != nullptr && *size < needed) {
      const size_t capacity = *size;
      *size = needed;
      return absl::InvalidArgumentError(
          absl::StrCat("buffer holds ", capacity, " bytes but the engine report needs ", needed,
                       "; call with buffer = NULL to query the size"));
    }
    if (buffer != nullptr) std::memcpy(buffer, text.c_str(), needed);
    *size = needed;
    return absl::OkStatus();
  });
}

hsapResult_t hsapBatchGetLinkTraffic(hsapBatch_t batch, hsapLinkTraffic_t* traffic) {
  return hsap::RunApi("hsapBatchGetLinkTraffic", [&]() -> absl::Status {
    HSAP_ASSIGN_OR_RETURN(hsap::Batch * b, hsap::BatchFromHandle(batch));
    HSAP_RETURN_IF_ERROR(hsap::CheckNotNull(traffic, "traffic"));
    HSAP_ASSIGN_OR_RETURN(const hsap::LinkTraffic fwd, b->Links(b->traffic().forward));
    HSAP_ASSIGN_OR_RETURN(const hsap::LinkTraffic bwd, b->Links(b->traffic().backward));
    *traffic = hsapLinkTraffic_t{
        fwd.intra_node_sent, fwd.intra_node_received, fwd.inter_node_sent, fwd.inter_node_received,
        bwd.intra_node_sent, bwd.intra_node_received, bwd.inter_node_sent, bwd.inter_node_received};
    return absl::OkStatus();
  });
}

}  // extern "C"
