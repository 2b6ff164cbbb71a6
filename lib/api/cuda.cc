// C entry points of the CUDA communicator section of hsap.h.
#include <cstddef>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "hsap/hsap.h"
#include "lib/api/checks.h"
#include "lib/api/result.h"
#include "lib/comm/communicator.h"
#include "lib/cuda/exec/gpu_batch.h"
#include "lib/cuda/runtime/cuda_loader.h"
#include "lib/cuda/runtime/device.h"
#include "lib/cuda/transport/loopback_transport.h"
#include "lib/cuda/transport/nccl_transport.h"

namespace {

static_assert(sizeof(hsapUniqueId_t) == sizeof(hsap::cuda::NcclUniqueId),
              "hsapUniqueId_t must carry an ncclUniqueId");

constexpr size_t kCommConfigV1Size = offsetof(hsapCommConfig_t, numThreads) + sizeof(int);
constexpr size_t kCommConfigStreamSize = offsetof(hsapCommConfig_t, cudaStream) + sizeof(void*);

struct CudaCommSettings {
  absl::Duration timeout;
  hsap::cuda::cudaStream stream = nullptr;
};

// Reads the fields the CUDA backend uses; a config of the older size has no stream.
absl::StatusOr<CudaCommSettings> ReadConfig(const hsapCommConfig_t* config) {
  CudaCommSettings out;
  absl::Duration requested = absl::ZeroDuration();
  if (config != nullptr) {
    HSAP_RETURN_IF_ERROR(hsap::CheckConfigHeader(*config, "config", kCommConfigV1Size,
                                                 "HSAP_COMM_CONFIG_INITIALIZER"));
    if (config->timeoutMs < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config->timeoutMs = ", config->timeoutMs,
          " is negative; pass a positive timeout in milliseconds, or 0 for the default"));
    }
    requested = absl::Milliseconds(config->timeoutMs);
    if (config->size >= offsetof(hsapCommConfig_t, rankNodes) + sizeof(const int*) &&
        config->rankNodes != nullptr) {
      return absl::UnimplementedError(
          "config->rankNodes is not supported by the CUDA backend yet (its batches deliver K/V "
          "directly, rank to rank); pass NULL");
    }
    if (config->size >= kCommConfigStreamSize) {
      out.stream = static_cast<hsap::cuda::cudaStream>(config->cudaStream);
    }
  }
  HSAP_ASSIGN_OR_RETURN(absl::Duration timeout, hsap::ResolveTimeout(requested));
  out.timeout = timeout;
  return out;
}

// Wraps a transport into a communicator handle with its GPU side (one compute thread:
// kernels run on the GPU). `stream`: the caller's compute stream or null.
absl::StatusOr<std::unique_ptr<hsapComm_st>> NewCudaComm(std::unique_ptr<hsap::Transport> transport,
                                                         hsap::cuda::cudaStream stream,
                                                         absl::Duration timeout) {
  HSAP_ASSIGN_OR_RETURN(std::unique_ptr<hsap::cuda::Device> device, hsap::cuda::CreateCudaDevice());
  HSAP_ASSIGN_OR_RETURN(std::shared_ptr<hsap::cuda::GpuComm> gpu,
                        hsap::cuda::GpuComm::Create(std::move(device), stream, timeout));
  auto handle = std::make_unique<hsapComm_st>();
  handle->comm = std::make_unique<hsap::Communicator>(std::move(transport), timeout, 1);
  handle->gpu = std::move(gpu);
  return handle;
}

absl::Status Publish(std::unique_ptr<hsap::cuda::NcclTransport> transport,
                     hsap::cuda::cudaStream stream, absl::Duration timeout, hsapComm_t* comm) {
  HSAP_ASSIGN_OR_RETURN(std::unique_ptr<hsapComm_st> handle,
                        NewCudaComm(std::move(transport), stream, timeout));
  *comm = handle.release();
  return absl::OkStatus();
}

}  // namespace

extern "C" {

hsapResult_t hsapGetUniqueId(hsapUniqueId_t* uniqueId) {
  return hsap::RunApi("hsapGetUniqueId", [&]() -> absl::Status {
    HSAP_RETURN_IF_ERROR(hsap::CheckNotNull(uniqueId, "uniqueId"));
    HSAP_ASSIGN_OR_RETURN(const hsap::cuda::NcclApi* nccl, hsap::cuda::LoadNccl());
    hsap::cuda::NcclUniqueId id;
    HSAP_RETURN_IF_ERROR(nccl->Check(nccl->GetUniqueId(&id), "ncclGetUniqueId"));
    std::memcpy(uniqueId->internal, id.internal, sizeof(id.internal));
    return absl::OkStatus();
  });
}

hsapResult_t hsapCommInitRank(hsapComm_t* comm, int nranks, hsapUniqueId_t uniqueId, int rank,
                              const hsapCommConfig_t* config) {
  return hsap::RunApi("hsapCommInitRank", [&]() -> absl::Status {
    HSAP_RETURN_IF_ERROR(hsap::CheckNotNull(comm, "comm"));
    *comm = nullptr;
    if (nranks < 1) {
      return absl::InvalidArgumentError(absl::StrCat("nranks = ", nranks, " must be at least 1"));
    }
    if (rank < 0 || rank >= nranks) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank = ", rank, " is outside [0, nranks = ", nranks, ")"));
    }
    HSAP_ASSIGN_OR_RETURN(CudaCommSettings settings, ReadConfig(config));
    HSAP_RETURN_IF_ERROR(hsap::cuda::CheckNcclDevice());
    const hsap::cuda::NcclApi& nccl = **hsap::cuda::LoadNccl();
    hsap::cuda::NcclUniqueId id;
    std::memcpy(id.internal, uniqueId.internal, sizeof(id.internal));
    hsap::cuda::ncclComm nc = nullptr;
    HSAP_RETURN_IF_ERROR(
        nccl.Check(nccl.CommInitRank(&nc, nranks, id, rank),
                   absl::StrCat("ncclCommInitRank(rank ", rank, " of ", nranks, ")")));
    absl::StatusOr<std::unique_ptr<hsap::cuda::NcclTransport>> t =
        hsap::cuda::NcclTransport::Create(nc, /*owns_comm=*/true, /*stream=*/nullptr,
                                          settings.timeout);
    if (!t.ok()) {
      nccl.CommDestroy(nc);
      return t.status();
    }
    return Publish(*std::move(t), settings.stream, settings.timeout, comm);
  });
}

hsapResult_t hsapCommInitFromNccl(hsapComm_t* comm, void* ncclComm,
                                  const hsapCommConfig_t* config) {
  return hsap::RunApi("hsapCommInitFromNccl", [&]() -> absl::Status {
    HSAP_RETURN_IF_ERROR(hsap::CheckNotNull(comm, "comm"));
    *comm = nullptr;
    HSAP_RETURN_IF_ERROR(hsap::CheckNotNull(ncclComm, "ncclComm"));
    HSAP_ASSIGN_OR_RETURN(CudaCommSettings settings, ReadConfig(config));
    HSAP_RETURN_IF_ERROR(hsap::cuda::CheckNcclDevice());
    HSAP_ASSIGN_OR_RETURN(std::unique_ptr<hsap::cuda::NcclTransport> t,
                          hsap::cuda::NcclTransport::Create(
                              static_cast<hsap::cuda::ncclComm>(ncclComm), /*owns_comm=*/false,
                              /*stream=*/nullptr, settings.timeout));
    return Publish(std::move(t), settings.stream, settings.timeout, comm);
  });
}

hsapResult_t hsapCommSplit(hsapComm_t comm, int color, int key, hsapComm_t* newcomm,
                           const hsapCommConfig_t* config) {
  return hsap::RunApi("hsapCommSplit", [&]() -> absl::Status {
    HSAP_RETURN_IF_ERROR(hsap::CheckNotNull(newcomm, "newcomm"));
    *newcomm = nullptr;
    if (comm == nullptr || comm->comm == nullptr) {
      return absl::InvalidArgumentError("comm is null; pass a communicator from hsapCommInitRank");
    }
    auto* parent = dynamic_cast<hsap::cuda::NcclTransport*>(&comm->comm->transport());
    if (parent == nullptr) {
      return absl::UnimplementedError(
          "hsapCommSplit needs a CUDA communicator (hsapCommInitRank / hsapCommInitFromNccl); "
          "host communicators cannot be split");
    }
    HSAP_ASSIGN_OR_RETURN(CudaCommSettings settings, ReadConfig(config));
    if (config == nullptr || config->size < kCommConfigStreamSize) {
      settings.stream = nullptr;  // a stream of its own, not the parent's
    }
    const hsap::cuda::NcclApi& nccl = parent->nccl();
    hsap::cuda::ncclComm child = nullptr;
    HSAP_RETURN_IF_ERROR(
        nccl.Check(nccl.CommSplit(parent->comm(), color < 0 ? hsap::cuda::kNcclSplitNoColor : color,
                                  key, &child, nullptr),
                   absl::StrCat("ncclCommSplit(color ", color, ", key ", key, ")")));
    if (child == nullptr) return absl::OkStatus();  // this rank joined no group
    absl::StatusOr<std::unique_ptr<hsap::cuda::NcclTransport>> t =
        hsap::cuda::NcclTransport::Create(child, /*owns_comm=*/true, /*stream=*/nullptr,
                                          settings.timeout);
    if (!t.ok()) {
      nccl.CommDestroy(child);
      return t.status();
    }
    return Publish(*std::move(t), settings.stream, settings.timeout, newcomm);
  });
}

hsapResult_t hsapCommIsCuda(hsapComm_t comm, int* isCuda) {
  return hsap::RunApi("hsapCommIsCuda", [&]() -> absl::Status {
    HSAP_RETURN_IF_ERROR(hsap::CheckNotNull(isCuda, "isCuda"));
    if (comm == nullptr || comm->comm == nullptr) {
      return absl::InvalidArgumentError("comm is null");
    }
    *isCuda = hsap::cuda::IsCudaTransport(comm->comm->transport()) ? 1 : 0;
    return absl::OkStatus();
  });
}

hsapResult_t hsapCommInitLoopback(hsapComm_t* comms, int nranks, const hsapCommConfig_t* config) {
  return hsap::RunApi("hsapCommInitLoopback", [&]() -> absl::Status {
    HSAP_RETURN_IF_ERROR(hsap::CheckNotNull(comms, "comms"));
    if (nranks < 1) {
      return absl::InvalidArgumentError(absl::StrCat("nranks = ", nranks, " must be at least 1"));
    }
    for (int r = 0; r < nranks; ++r) comms[r] = nullptr;
    HSAP_ASSIGN_OR_RETURN(CudaCommSettings settings, ReadConfig(config));
    HSAP_RETURN_IF_ERROR(hsap::cuda::CheckCudaDevice());
    HSAP_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<hsap::Transport>> transports,
                          hsap::cuda::CreateLoopbackTransports(nranks, settings.timeout));
    std::vector<std::unique_ptr<hsapComm_st>> handles;
    for (std::unique_ptr<hsap::Transport>& t : transports) {
      absl::StatusOr<std::unique_ptr<hsapComm_st>> h =
          NewCudaComm(std::move(t), /*stream=*/nullptr, settings.timeout);
      if (!h.ok()) return h.status();  // nothing published yet
      handles.push_back(*std::move(h));
    }
    for (int r = 0; r < nranks; ++r) comms[r] = handles[r].release();
    return absl::OkStatus();
  });
}

hsapResult_t hsapCommGetPoolBytes(hsapComm_t comm, size_t* bytes) {
  return hsap::RunApi("hsapCommGetPoolBytes", [&]() -> absl::Status {
    HSAP_RETURN_IF_ERROR(hsap::CheckNotNull(bytes, "bytes"));
    if (comm == nullptr || comm->comm == nullptr) {
      return absl::InvalidArgumentError("comm is null");
    }
    *bytes = comm->gpu != nullptr ? comm->gpu->pool_bytes() : 0;
    return absl::OkStatus();
  });
}

}  // extern "C"
