// C entry points of the communicator section of hsap.h.
#include <cstddef>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "hsap/hsap.h"
#include "lib/api/checks.h"
#include "lib/api/result.h"
#include "lib/comm/communicator.h"
#include "lib/comm/host_transport.h"

namespace {

// Size of version 1 of hsapCommConfig_t (through numThreads).
constexpr size_t kCommConfigV1Size = offsetof(hsapCommConfig_t, numThreads) + sizeof(int);
// Size of the version with backend.
constexpr size_t kCommConfigBackendSize =
    offsetof(hsapCommConfig_t, backend) + sizeof(hsapBackend_t);
// Size of the version with rankNodes.
constexpr size_t kCommConfigRankNodesSize =
    offsetof(hsapCommConfig_t, rankNodes) + sizeof(const int*);

absl::StatusOr<hsap::Communicator*> GetComm(hsapComm_t comm) {
  if (comm == nullptr || comm->comm == nullptr) {
    return absl::InvalidArgumentError(
        "comm is null; pass a communicator created by hsapCommInitAll");
  }
  return comm->comm.get();
}

}  // namespace

extern "C" {

hsapResult_t hsapCommInitAll(hsapComm_t* comms, int nranks, const hsapCommConfig_t* config) {
  return hsap::RunApi("hsapCommInitAll", [&]() -> absl::Status {
    HSAP_RETURN_IF_ERROR(hsap::CheckNotNull(comms, "comms"));
    if (nranks < 1 || nranks > hsap::kMaxHostRanks) {
      return absl::InvalidArgumentError(absl::StrCat("nranks = ", nranks, " is outside [1, ",
                                                     hsap::kMaxHostRanks,
                                                     "]; comms must have room for nranks handles"));
    }
    hsap::CommOptions options;
    if (config != nullptr) {
      HSAP_RETURN_IF_ERROR(hsap::CheckConfigHeader(*config, "config", kCommConfigV1Size,
                                                   "HSAP_COMM_CONFIG_INITIALIZER"));
      if (config->timeoutMs < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("config->timeoutMs = ", config->timeoutMs,
                         " is negative; pass a positive timeout in milliseconds, or 0 for "
                         "$HSAP_TIMEOUT_MS / 5 minutes"));
      }
      if (config->numThreads < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("config->numThreads = ", config->numThreads,
                         " is negative; pass 0 for hardware threads / ranks"));
      }
      options.timeout = absl::Milliseconds(config->timeoutMs);
      options.num_threads = config->numThreads;
      if (config->size >= kCommConfigBackendSize) {
        const auto backend = hsap::RawEnum(config->backend);
        if (backend != hsapBackendDefault && backend != hsapBackendHost) {
          return absl::InvalidArgumentError(absl::StrCat(
              "config->backend = ", backend,
              ": hsapCommInitAll creates host ranks only (hsapBackendDefault or hsapBackendHost); "
              "for CUDA ranks use hsapCommInitRank or hsapCommInitLoopback"));
        }
      }
      if (config->size >= kCommConfigRankNodesSize && config->rankNodes != nullptr) {
        options.rank_nodes.assign(config->rankNodes, config->rankNodes + nranks);
        for (int r = 0; r < nranks; ++r) {
          if (options.rank_nodes[r] < 0) {
            return absl::InvalidArgumentError(
                absl::StrCat("config->rankNodes[", r, "] = ", options.rank_nodes[r],
                             " is negative; give every rank the index (>= 0) of its node"));
          }
        }
      }
    }
    HSAP_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<hsap::Communicator>> world,
                          hsap::Communicator::CreateHostWorld(nranks, options));
    // Allocate every handle before publishing any, so a failure leaves nothing behind.
    std::vector<std::unique_ptr<hsapComm_st>> handles;
    handles.reserve(nranks);
    for (auto& comm : world) {
      auto handle = std::make_unique<hsapComm_st>();
      handle->comm = std::move(comm);
      handles.push_back(std::move(handle));
    }
    for (int r = 0; r < nranks; ++r) comms[r] = handles[r].release();
    return absl::OkStatus();
  });
}

hsapResult_t hsapCommDestroy(hsapComm_t comm) {
  // Like free(): destroying NULL does nothing.
  return hsap::RunApi("hsapCommDestroy", [&]() -> absl::Status {
    if (comm != nullptr) {
      if (const int batches = comm->live_batches.load(); batches > 0) {
        return absl::FailedPreconditionError(
            absl::StrCat("comm still has ", batches,
                         " batch(es) created on it; destroy them with hsapBatchDestroy first (the "
                         "communicator stays valid)"));
      }
    }
    delete comm;
    return absl::OkStatus();
  });
}

hsapResult_t hsapCommAbort(hsapComm_t comm) {
  return hsap::RunApi("hsapCommAbort", [&]() -> absl::Status {
    HSAP_ASSIGN_OR_RETURN(hsap::Communicator * c, GetComm(comm));
    c->Abort(absl::StrCat("hsapCommAbort called on rank ", c->rank()));
    return absl::OkStatus();
  });
}

hsapResult_t hsapCommCount(hsapComm_t comm, int* count) {
  return hsap::RunApi("hsapCommCount", [&]() -> absl::Status {
    HSAP_ASSIGN_OR_RETURN(hsap::Communicator * c, GetComm(comm));
    HSAP_RETURN_IF_ERROR(hsap::CheckNotNull(count, "count"));
    *count = c->size();
    return absl::OkStatus();
  });
}

hsapResult_t hsapCommUserRank(hsapComm_t comm, int* rank) {
  return hsap::RunApi("hsapCommUserRank", [&]() -> absl::Status {
    HSAP_ASSIGN_OR_RETURN(hsap::Communicator * c, GetComm(comm));
    HSAP_RETURN_IF_ERROR(hsap::CheckNotNull(rank, "rank"));
    *rank = c->rank();
    return absl::OkStatus();
  });
}

}  // extern "C"
