// Tagless, ordered point-to-point groups: the model of NCCL's send/receive semantics.
//
// NCCL point-to-point has no tags: inside a communicator the n-th send from a to b meets
// the n-th receive on b from a, and the operations between ncclGroupStart and ncclGroupEnd
// progress together. A transport stage (tagged sends and receives, transport.h) becomes
// such a group by putting its operations in one canonical order that both sides of every
// pair derive alike: by peer, sends before receives, then by tag.
#ifndef HSAP_LIB_COMM_P2P_GROUP_H_
#define HSAP_LIB_COMM_P2P_GROUP_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "lib/comm/transport.h"

namespace hsap {

// One send (send == true) or receive of `bytes` bytes with `peer`. `tag` is the transport
// tag of the same message (not given to NCCL; it is what orders and checks the group).
struct P2pOp {
  bool send = false;
  int peer = -1;
  size_t bytes = 0;
  uint64_t tag = 0;
  friend bool operator==(const P2pOp&, const P2pOp&) = default;
};

// ncclGroupStart(); ops...; ncclGroupEnd().
struct P2pGroup {
  std::string label;  // "fwd kv 3", "bwd kv 2", "bwd grad 1", or the transport stage name
  std::vector<P2pOp> ops;
};

using P2pProgram = std::vector<P2pGroup>;

// The group of one transport stage: its sends and receives in the canonical order (by
// peer, then send before receive, then tag). NcclTransport::Start issues exactly this.
P2pGroup GroupOfStage(absl::Span<const SendOp> sends, absl::Span<const RecvOp> recvs,
                      std::string label);

}  // namespace hsap

#endif  // HSAP_LIB_COMM_P2P_GROUP_H_
