// A rank of a communicator: its transport and the settings every collective call uses.
#ifndef HSAP_LIB_COMM_COMMUNICATOR_H_
#define HSAP_LIB_COMM_COMMUNICATOR_H_

#include <memory>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "lib/comm/topology.h"
#include "lib/comm/transport.h"

namespace hsap {

struct CommOptions {
  // Deadline of every wait on a peer. Zero: $HSAP_TIMEOUT_MS when set, else 5 minutes.
  absl::Duration timeout = absl::ZeroDuration();
  // Compute threads of each rank. Zero: hardware threads / ranks, at least 1.
  int num_threads = 0;
  // rank_nodes[r]: the node of rank r (see Topology::FromRankNodes). Empty: one node.
  std::vector<int> rank_nodes;
};

class Communicator {
 public:
  // Creates `nranks` ranks of the host backend sharing one in-process world.
  static absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateHostWorld(
      int nranks, const CommOptions& options);

  // `topology` must have the transport's size; nullopt: every rank on one node.
  Communicator(std::unique_ptr<Transport> transport, absl::Duration timeout, int num_threads,
               std::optional<Topology> topology = std::nullopt);

  int rank() const { return transport_->rank(); }
  int size() const { return transport_->size(); }
  Transport& transport() { return *transport_; }
  absl::Duration timeout() const { return timeout_; }
  int num_threads() const { return num_threads_; }
  // Which ranks share a node.
  const Topology& topology() const { return topology_; }
  // Releases every rank of the world from its waits (see Transport::Abort).
  void Abort(absl::string_view reason) { transport_->Abort(reason); }

 private:
  std::unique_ptr<Transport> transport_;
  absl::Duration timeout_;
  int num_threads_;
  Topology topology_;
};

// The timeout to use: `requested` if non-zero, else $HSAP_TIMEOUT_MS, else 5 minutes.
// Errors on a malformed or non-positive $HSAP_TIMEOUT_MS.
absl::StatusOr<absl::Duration> ResolveTimeout(absl::Duration requested);

}  // namespace hsap

#endif  // HSAP_LIB_COMM_COMMUNICATOR_H_
