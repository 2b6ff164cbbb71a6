// The host transport: the ranks of a world are threads of one process.
//
// All ranks of a world share one in-memory matching engine. A send from s to d with tag t
// waits in d's mailbox until d posts a receive from s with tag t (or the receive waits for
// the send); equal (s, d, t) messages match in posting order. The payload is copied once,
// straight from the sender's buffer into the receiver's, by the receiving rank inside its
// Wait(): there is no staging buffer, and a sender's stage completes when its receivers
// have copied. A Wait() also performs the copies of the rank's other posted stages, so
// ranks may wait on their stages in any order.
//
// Failure handling:
//  - Size mismatch between a matched send and receive: both fail with FailedPrecondition
//    naming both ranks, the tag, both sizes and both stages; nothing is copied.
//  - Timeout (the world's deadline, counted from the call to Wait()): DeadlineExceeded
//    naming this rank, the stage and every peer still missing with its tags. The rank's
//    unfinished operations are withdrawn (a copy already in progress from or into its
//    buffers is allowed to finish first, so no peer touches them after Wait() returns);
//    a peer whose matched operation loses its partner this way fails with Aborted. The
//    world is then broken: every later Start() on any rank fails with FailedPrecondition.
//  - Abort (any rank, any thread): every pending and future Wait()/Start() on every rank
//    returns Aborted with the first reason given.
//  - A destroyed rank: peers waiting for an operation it never posted fail with
//    FailedPrecondition instead of waiting for the deadline.
//
// Counters count completed messages only; a message from a rank to itself counts as both
// sent and received. Abort(), aborted() and the counters may be used from any thread;
// Start() and Wait() of one rank from one thread at a time.
#ifndef HSAP_LIB_COMM_HOST_TRANSPORT_H_
#define HSAP_LIB_COMM_HOST_TRANSPORT_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "lib/comm/transport.h"

namespace hsap {

// Upper bound on the ranks of one host world (each rank is a thread).
inline constexpr int kMaxHostRanks = 4096;

// Creates the transports of ranks 0..nranks-1 of a new world whose waits time out after
// `timeout` (absl::InfiniteDuration() for never). Errors: nranks outside [1, kMaxHostRanks],
// timeout not positive.
absl::StatusOr<std::vector<std::unique_ptr<Transport>>> CreateHostTransports(
    int nranks, absl::Duration timeout);

}  // namespace hsap

#endif  // HSAP_LIB_COMM_HOST_TRANSPORT_H_
