// C entry points of the CUDA communicator section of hsap.h, and hsapGetUniqueId /
// hsapCommInitRank for both backends (host ranks as processes: lib/comm/shm_transport.h).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "base/status_macros.h"
#include "hsap/hsap.h"
#include "lib/api/checks.h"
#include "lib/api/result.h"
#include "lib/comm/communicator.h"
#include "lib/comm/shm_transport.h"
#include "lib/comm/topology.h"
#include "lib/cuda/exec/gpu_batch.h"
#include "lib/cuda/runtime/cuda_loader.h"
#include "lib/cuda/runtime/device.h"
#include "lib/cuda/transport/loopback_transport.h"
#include "lib/cuda/transport/nccl_transport.h"

namespace {

constexpr size_t kCommConfigV1Size = offsetof(hsapCommConfig_t, numThreads) + sizeof(int);
constexpr size_t kCommConfigStreamSize = offsetof(hsapCommConfig_t, cudaStream) + sizeof(void*);
constexpr size_t kCommConfigBackendSize =
    offsetof(hsapCommConfig_t, backend) + sizeof(hsapBackend_t);
constexpr size_t kCommConfigRankNodesSize =
    offsetof(hsapCommConfig_t, rankNodes) + sizeof(const int*);

// The layout of an hsapUniqueId_t made by hsapGetUniqueId. A token without kIdMagic is
// taken for a raw ncclUniqueId (as hsapGetUniqueId made them before the host backend
// could use them).
constexpr char kIdMagic[8] = {'h', 's', 'a', 'p', 'U', 'I', 'D', '\1'};
constexpr size_t kIdFlagsOffset = 8;
constexpr uint8_t kIdHasNccl = 1;
constexpr size_t kIdShmOffset = 16;
constexpr size_t kIdNcclOffset = 32;
// ncclUniqueId is 128 bytes, of which NCCL uses the first few dozen (a magic and a socket
// address); the token keeps the first kIdNcclBytes and requires the rest to be zero.
constexpr size_t kIdNcclBytes = sizeof(hsapUniqueId_t) - kIdNcclOffset;

static_assert(sizeof(hsapUniqueId_t) == sizeof(hsap::cuda::NcclUniqueId),
              "hsapUniqueId_t must carry an ncclUniqueId");
static_assert(kIdShmOffset + sizeof(hsap::ShmWorldId::bytes) <= kIdNcclOffset);

struct DecodedId {
  bool is_hsap = false;  // made by hsapGetUniqueId
  std::optional<hsap::cuda::NcclUniqueId> nccl;
  hsap::ShmWorldId shm;
};

DecodedId DecodeId(const hsapUniqueId_t& id) {
  DecodedId out;
  const auto* bytes = reinterpret_cast<const uint8_t*>(id.internal);
  if (std::memcmp(bytes, kIdMagic, sizeof(kIdMagic)) != 0) {
    hsap::cuda::NcclUniqueId raw;
    std::memcpy(raw.internal, id.internal, sizeof(raw.internal));
    out.nccl = raw;
    return out;
  }
  out.is_hsap = true;
  std::memcpy(out.shm.bytes.data(), bytes + kIdShmOffset, out.shm.bytes.size());
  if ((bytes[kIdFlagsOffset] & kIdHasNccl) != 0) {
    hsap::cuda::NcclUniqueId nccl;
    std::memset(nccl.internal, 0, sizeof(nccl.internal));
    std::memcpy(nccl.internal, bytes + kIdNcclOffset, kIdNcclBytes);
    out.nccl = nccl;
  }
  return out;
}

struct CommSettings {
  absl::Duration timeout;
  int num_threads = 0;
  hsap::cuda::cudaStream stream = nullptr;
  hsapBackend_t backend = hsapBackendDefault;
  const int* rank_nodes = nullptr;  // config->rankNodes (nranks entries) or null
};

// The described topology (config->rankNodes, nranks entries), or nullopt without one.
absl::StatusOr<std::optional<hsap::Topology>> RankTopology(const CommSettings& settings,
                                                           int nranks) {
  if (settings.rank_nodes == nullptr) return std::optional<hsap::Topology>();
  for (int r = 0; r < nranks; ++r) {
    if (settings.rank_nodes[r] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("config->rankNodes[", r, "] = ", settings.rank_nodes[r],
                       " is negative; give every rank the index (>= 0) of its node"));
    }
  }
  HSAP_ASSIGN_OR_RETURN(hsap::Topology topology,
                        hsap::Topology::FromRankNodes(
                            absl::MakeConstSpan(settings.rank_nodes, static_cast<size_t>(nranks))));
  return std::optional<hsap::Topology>(std::move(topology));
}

// Reads and checks a config of any size (older ones lack the stream and the backend).
absl::StatusOr<CommSettings> ReadCommConfig(const hsapCommConfig_t* config) {
  CommSettings out;
  absl::Duration requested = absl::ZeroDuration();
  if (config != nullptr) {
    HSAP_RETURN_IF_ERROR(hsap::CheckConfigHeader(*config, "config", kCommConfigV1Size,
                                                 "HSAP_COMM_CONFIG_INITIALIZER"));
    if (config->timeoutMs < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config->timeoutMs = ", config->timeoutMs,
          " is negative; pass a positive timeout in milliseconds, or 0 for the default"));
    }
    if (config->numThreads < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("config->numThreads = ", config->numThreads,
                       " is negative; pass 0 for hardware threads / ranks"));
    }
    requested = absl::Milliseconds(config->timeoutMs);
    out.num_threads = config->numThreads;
    if (config->size >= kCommConfigRankNodesSize) out.rank_nodes = config->rankNodes;
    if (config->size >= kCommConfigStreamSize) {
      out.stream = static_cast<hsap::cuda::cudaStream>(config->cudaStream);
    }
    if (config->size >= kCommConfigBackendSize) {
      const auto backend = hsap::RawEnum(config->backend);
      if (backend < hsapBackendDefault || backend > hsapBackendCuda) {
        return absl::InvalidArgumentError(absl::StrCat(
            "config->backend = ", backend,
            " is not an hsapBackend_t (hsapBackendDefault, hsapBackendHost, hsapBackendCuda)"));
      }
      out.backend = static_cast<hsapBackend_t>(backend);
    }
  }
  HSAP_ASSIGN_OR_RETURN(absl::Duration timeout, hsap::ResolveTimeout(requested));
  out.timeout = timeout;
  return out;
}

// Wraps a transport into a communicator handle with its GPU side (one compute thread:
// kernels run on the GPU). `stream`: the caller's compute stream or null; `topology`:
// nullopt for every rank on one node.
absl::StatusOr<std::unique_ptr<hsapComm_st>> NewCudaComm(
    std::unique_ptr<hsap::Transport> transport, hsap::cuda::cudaStream stream,
    absl::Duration timeout, std::optional<hsap::Topology> topology = std::nullopt) {
  HSAP_ASSIGN_OR_RETURN(std::unique_ptr<hsap::cuda::Device> device, hsap::cuda::CreateCudaDevice());
  HSAP_ASSIGN_OR_RETURN(std::shared_ptr<hsap::cuda::GpuComm> gpu,
                        hsap::cuda::GpuComm::Create(std::move(device), stream, timeout));
  auto handle = std::make_unique<hsapComm_st>();
  handle->comm =
      std::make_unique<hsap::Communicator>(std::move(transport), timeout, 1, std::move(topology));
  handle->gpu = std::move(gpu);
  return handle;
}

// Finds the nodes of an NCCL communicator's ranks (collective over it: hsap::DiscoverTopology
// all-gathers each rank's host hash over NCCL, through the transport's device staging
// buffer, with the communicator's deadline; config->rankNodes, when given on every rank,
// is taken instead) and publishes the communicator.
absl::Status Publish(std::unique_ptr<hsap::cuda::NcclTransport> transport,
                     const CommSettings& settings, hsapComm_t* comm) {
  const absl::Span<const int> described =
      settings.rank_nodes == nullptr
          ? absl::Span<const int>()
          : absl::MakeConstSpan(settings.rank_nodes, static_cast<size_t>(transport->size()));
  HSAP_ASSIGN_OR_RETURN(hsap::Topology topology,
                        hsap::DiscoverTopology(*transport, hsap::LocalHostHash(), described,
                                               "communicator initialisation (node discovery)"));
  // The communicator's device and stream on the NCCL communicator's GPU, whichever device the
  // calling thread has current.
  hsap::cuda::CudaDeviceScope on(transport->runtime(), transport->device());
  HSAP_RETURN_IF_ERROR(on.status());
  HSAP_ASSIGN_OR_RETURN(
      std::unique_ptr<hsapComm_st> handle,
      NewCudaComm(std::move(transport), settings.stream, settings.timeout, std::move(topology)));
  *comm = handle.release();
  return absl::OkStatus();
}

}  // namespace

extern "C" {

hsapResult_t hsapGetUniqueId(hsapUniqueId_t* uniqueId) {
  return hsap::RunApi("hsapGetUniqueId", [&]() -> absl::Status {
    HSAP_RETURN_IF_ERROR(hsap::CheckNotNull(uniqueId, "uniqueId"));
    HSAP_ASSIGN_OR_RETURN(const hsap::ShmWorldId shm, hsap::NewShmWorldId());
    hsapUniqueId_t id;
    std::memset(&id, 0, sizeof(id));
    auto* bytes = reinterpret_cast<uint8_t*>(id.internal);
    std::memcpy(bytes, kIdMagic, sizeof(kIdMagic));
    std::memcpy(bytes + kIdShmOffset, shm.bytes.data(), shm.bytes.size());
    // The CUDA backend's part, where it could be used; its absence only rules out CUDA.
    if (hsap::cuda::CheckNcclDevice().ok()) {
      const hsap::cuda::NcclApi& nccl = **hsap::cuda::LoadNccl();
      hsap::cuda::NcclUniqueId nid;
      HSAP_RETURN_IF_ERROR(nccl.Check(nccl.GetUniqueId(&nid), "ncclGetUniqueId"));
      const auto* tail = reinterpret_cast<const uint8_t*>(nid.internal) + kIdNcclBytes;
      if (std::all_of(tail, tail + (sizeof(nid.internal) - kIdNcclBytes),
                      [](uint8_t b) { return b == 0; })) {
        bytes[kIdFlagsOffset] |= kIdHasNccl;
        std::memcpy(bytes + kIdNcclOffset, nid.internal, kIdNcclBytes);
      }
    }
    *uniqueId = id;
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
    HSAP_ASSIGN_OR_RETURN(CommSettings settings, ReadCommConfig(config));
    const DecodedId id = DecodeId(uniqueId);
    hsapBackend_t backend = settings.backend;
    if (backend == hsapBackendDefault) {
      const bool cuda = !id.is_hsap || (id.nccl && hsap::cuda::CheckNcclDevice().ok());
      backend = cuda ? hsapBackendCuda : hsapBackendHost;
    }
    if (backend == hsapBackendHost) {
      if (!id.is_hsap) {
        return absl::InvalidArgumentError(
            "uniqueId was not made by hsapGetUniqueId (a raw ncclUniqueId?); the host backend "
            "needs a token from hsapGetUniqueId");
      }
      if (nranks > hsap::kMaxShmRanks) {
        return absl::InvalidArgumentError(absl::StrCat("nranks = ", nranks, " is outside [1, ",
                                                       hsap::kMaxShmRanks,
                                                       "] for the host backend across processes"));
      }
      HSAP_ASSIGN_OR_RETURN(std::optional<hsap::Topology> topology, RankTopology(settings, nranks));
      HSAP_ASSIGN_OR_RETURN(std::unique_ptr<hsap::Transport> transport,
                            hsap::CreateShmTransport(id.shm, nranks, rank, settings.timeout));
      int num_threads = settings.num_threads;
      if (num_threads == 0) {
        num_threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / nranks);
      }
      auto handle = std::make_unique<hsapComm_st>();
      handle->comm = std::make_unique<hsap::Communicator>(std::move(transport), settings.timeout,
                                                          num_threads, std::move(topology));
      *comm = handle.release();
      return absl::OkStatus();
    }
    HSAP_RETURN_IF_ERROR(RankTopology(settings, nranks).status());
    HSAP_RETURN_IF_ERROR(hsap::cuda::CheckNcclDevice());
    if (!id.nccl) {
      return absl::FailedPreconditionError(
          "uniqueId carries no ncclUniqueId (hsapGetUniqueId found no CUDA device or NCCL where "
          "it ran); make the token on a rank with a GPU and NCCL for the CUDA backend");
    }
    const hsap::cuda::NcclApi& nccl = **hsap::cuda::LoadNccl();
    hsap::cuda::ncclComm nc = nullptr;
    HSAP_RETURN_IF_ERROR(
        nccl.Check(nccl.CommInitRank(&nc, nranks, *id.nccl, rank),
                   absl::StrCat("ncclCommInitRank(rank ", rank, " of ", nranks, ")")));
    absl::StatusOr<std::unique_ptr<hsap::cuda::NcclTransport>> t =
        hsap::cuda::NcclTransport::Create(nc, /*owns_comm=*/true, /*stream=*/nullptr,
                                          settings.timeout);
    if (!t.ok()) {
      nccl.CommDestroy(nc);
      return t.status();
    }
    return Publish(*std::move(t), settings, comm);
  });
}

hsapResult_t hsapCommInitFromNccl(hsapComm_t* comm, void* ncclComm,
                                  const hsapCommConfig_t* config) {
  return hsap::RunApi("hsapCommInitFromNccl", [&]() -> absl::Status {
    HSAP_RETURN_IF_ERROR(hsap::CheckNotNull(comm, "comm"));
    *comm = nullptr;
    HSAP_RETURN_IF_ERROR(hsap::CheckNotNull(ncclComm, "ncclComm"));
    HSAP_ASSIGN_OR_RETURN(CommSettings settings, ReadCommConfig(config));
    HSAP_RETURN_IF_ERROR(hsap::cuda::CheckNcclDevice());
    HSAP_ASSIGN_OR_RETURN(std::unique_ptr<hsap::cuda::NcclTransport> t,
                          hsap::cuda::NcclTransport::Create(
                              static_cast<hsap::cuda::ncclComm>(ncclComm), /*owns_comm=*/false,
                              /*stream=*/nullptr, settings.timeout));
    return Publish(std::move(t), settings, comm);
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
    HSAP_ASSIGN_OR_RETURN(CommSettings settings, ReadCommConfig(config));
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
    return Publish(*std::move(t), settings, newcomm);
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
    HSAP_ASSIGN_OR_RETURN(CommSettings settings, ReadCommConfig(config));
    // One process, one host: one node, unless config->rankNodes describes others.
    HSAP_ASSIGN_OR_RETURN(std::optional<hsap::Topology> topology, RankTopology(settings, nranks));
    HSAP_RETURN_IF_ERROR(hsap::cuda::CheckCudaDevice());
    HSAP_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<hsap::Transport>> transports,
                          hsap::cuda::CreateLoopbackTransports(nranks, settings.timeout));
    std::vector<std::unique_ptr<hsapComm_st>> handles;
    for (std::unique_ptr<hsap::Transport>& t : transports) {
      absl::StatusOr<std::unique_ptr<hsapComm_st>> h =
          NewCudaComm(std::move(t), /*stream=*/nullptr, settings.timeout, topology);
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
