#include "lib/comm/communicator.h"

#include <algorithm>
#include <cstdint>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/params.h"
#include "base/status_macros.h"
#include "lib/comm/host_transport.h"

namespace hsap {

absl::StatusOr<absl::Duration> ResolveTimeout(absl::Duration requested) {
  if (requested < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout = ", absl::FormatDuration(requested),
                     " is negative; pass a positive timeout, or 0 for the default"));
  }
  if (requested > absl::ZeroDuration()) return requested;
  HSAP_ASSIGN_OR_RETURN(const int64_t ms, GetInt64Param(Param::kTimeoutMs));
  if (ms <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("$HSAP_TIMEOUT_MS = ", ms,
                     " must be positive (milliseconds); unset it for the default of 5 minutes"));
  }
  return absl::Milliseconds(ms);
}

absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> Communicator::CreateHostWorld(
    int nranks, const CommOptions& options) {
  if (nranks < 1 || nranks > kMaxHostRanks) {
    return absl::InvalidArgumentError(absl::StrCat("nranks = ", nranks, " is outside [1, ",
                                                   kMaxHostRanks, "] for the host backend"));
  }
  if (options.num_threads < 0) {
    return absl::InvalidArgumentError(absl::StrCat("num_threads = ", options.num_threads,
                                                   " is negative; pass 0 for the default"));
  }
  HSAP_ASSIGN_OR_RETURN(absl::Duration timeout, ResolveTimeout(options.timeout));
  Topology topology = Topology::SingleNode(nranks);
  if (!options.rank_nodes.empty()) {
    if (static_cast<int>(options.rank_nodes.size()) != nranks) {
      return absl::InvalidArgumentError(absl::StrCat("rank_nodes has ", options.rank_nodes.size(),
                                                     " entries for ", nranks,
                                                     " ranks; give one node per rank"));
    }
    HSAP_ASSIGN_OR_RETURN(topology, Topology::FromRankNodes(options.rank_nodes));
  }
  int num_threads = options.num_threads;
  if (num_threads == 0) {
    const int hardware = static_cast<int>(std::thread::hardware_concurrency());
    num_threads = std::max(1, hardware / nranks);
  }
  HSAP_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Transport>> transports,
                        CreateHostTransports(nranks, timeout));
  std::vector<std::unique_ptr<Communicator>> comms;
  comms.reserve(nranks);
  for (auto& transport : transports) {
    comms.push_back(
        std::make_unique<Communicator>(std::move(transport), timeout, num_threads, topology));
  }
  return comms;
}

Communicator::Communicator(std::unique_ptr<Transport> transport, absl::Duration timeout,
                           int num_threads, std::optional<Topology> topology)
    : transport_(std::move(transport)),
      timeout_(timeout),
      num_threads_(num_threads),
      topology_(topology.has_value() ? *std::move(topology)
                                     : Topology::SingleNode(transport_->size())) {}

}  // namespace hsap
