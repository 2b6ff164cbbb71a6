// Which ranks of a communicator share a node: the topology K/V delivery is planned on
// (lib/sched/schedule.h relays a row needed by several ranks of another node through one of
// them) and traffic is classified by (intra-node, inter-node).
//
// Discovery (CUDA communicators), the way NCCL finds the ranks of a host: each rank hashes
// its host identity (hostname + the kernel's boot id, so that hosts cloned with one name
// still differ, and a restarted host is a new one), the hashes are all-gathered, and ranks
// with equal hashes share a node; nodes are numbered in order of first appearance (rank 0's
// node is 0). $NCCL_HOSTID, when set, replaces the identity (hostname + boot id) as it does
// for NCCL, so that hsap and NCCL agree on who shares a host.
#ifndef HSAP_LIB_COMM_TOPOLOGY_H_
#define HSAP_LIB_COMM_TOPOLOGY_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "lib/comm/transport.h"

namespace hsap {

class Topology {
 public:
  // All `num_ranks` ranks on node 0.
  static Topology SingleNode(int num_ranks);
  // rank_nodes[r]: the node of rank r (num_ranks entries, each >= 0; node numbers need not
  // be contiguous). InvalidArgument names the first bad entry.
  static absl::StatusOr<Topology> FromRankNodes(absl::Span<const int> rank_nodes);
  // host_hashes[r]: rank r's HostHash. Ranks with equal hashes share a node; nodes are
  // numbered 0, 1, ... in order of their first rank.
  static Topology FromHostHashes(absl::Span<const uint64_t> host_hashes);

  int num_ranks() const { return static_cast<int>(node_of_rank_.size()); }
  int node_of(int rank) const { return node_of_rank_[rank]; }
  bool SameNode(int a, int b) const { return node_of_rank_[a] == node_of_rank_[b]; }
  // True when every rank is on one node (delivery is then exactly the direct one).
  bool single_node() const { return num_nodes_ <= 1; }
  // node of every rank, indexed by rank.
  const std::vector<int>& node_of_rank() const { return node_of_rank_; }
  // The ranks of `node` (increasing); empty for a node number no rank has.
  std::vector<int> RanksOf(int node) const;

  friend bool operator==(const Topology&, const Topology&) = default;

 private:
  std::vector<int> node_of_rank_;
  int num_nodes_ = 0;  // distinct node numbers in use
};

// The identity of a host, hashed (64-bit FNV-1a of the string): `host_id` when given (the
// value of $NCCL_HOSTID), else hostname followed by boot_id.
uint64_t HostHash(absl::string_view hostname, absl::string_view boot_id,
                  std::optional<absl::string_view> host_id = std::nullopt);

// HostHash of the calling process's host: gethostname(), the first word of
// /proc/sys/kernel/random/boot_id (empty where it cannot be read) and $NCCL_HOSTID.
uint64_t LocalHostHash();

// Collective over `transport` (every rank calls it once, in the same order as its other
// collectives): all-gathers each rank's `host_hash` and a fingerprint of `described` (two
// uint64 per rank, AllGather with the transport's deadline) and returns FromHostHashes of
// the hashes, or, when `described` (the node of every rank, as FromRankNodes takes) is not
// empty, that described topology instead. Every rank must describe the same topology or
// none: otherwise InvalidArgument naming the first rank that differs from rank 0 (on every
// rank alike). `stage` names the collective in a timeout.
absl::StatusOr<Topology> DiscoverTopology(Transport& transport, uint64_t host_hash,
                                          absl::Span<const int> described = {},
                                          std::string stage = "node discovery");

}  // namespace hsap

#endif  // HSAP_LIB_COMM_TOPOLOGY_H_
