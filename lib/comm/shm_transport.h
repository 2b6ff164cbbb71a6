// The shared-memory transport: the ranks of a world are processes of one host (threads of
// one process work too), each holding one Transport, joined by a world id.
//
// Segment. One POSIX shared-memory segment per world, named "/hsap-<32 hex digits>" from
// the id (/dev/shm/hsap-... on Linux). Rank 0 creates it (O_EXCL); the other ranks open it,
// retrying until the timeout. Each rank records its pid there and counts itself in; once
// every rank has attached (the bootstrap barrier) every rank unlinks the name (the first
// one wins), so nothing is left in /dev/shm from then on, whatever happens to the
// processes: the memory lives on only while some rank still maps it. A bootstrap that
// fails (timeout, nranks disagreeing, a rank claimed twice) aborts the segment and unlinks
// the name too; only a rank-0 process killed during the bootstrap itself can leave the name
// behind.
//
// Data path. Every ordered pair (src, dst), src == dst included, has a ring buffer in the
// segment that only src writes and only dst reads. A send streams a header (tag, size,
// sequence number, the sender's stage name) and then its payload through the ring, in
// chunks of whatever space is free, so messages of any size pass through a ring of fixed
// size. The receiver matches headers per (peer, tag) in posting order: into the posted
// receive's buffer when one is waiting, otherwise into a heap buffer kept until the
// receive is posted (later matching receives take it in order). The receiver answers
// every message with an acknowledgement (or a size-mismatch notice) through the reverse
// ring; a send completes when it is acknowledged. All copying is done by the owning
// process inside Start() and Wait(): no process touches another's buffers, so a Wait()
// that returns (successfully or not) leaves nothing referring to the stage's buffers.
//
// Semantics: as the Transport contract and the host transport (host_transport.h) state:
// grouped Start()/Wait(), a Wait() progressing the rank's other posted stages too,
// per (peer, tag) matching in posting order, size mismatches failing both sides with
// FailedPrecondition, DeadlineExceeded naming the rank, stage and every missing peer and
// tag, Abort() from any thread of any process releasing every rank with Aborted. After a
// timeout the rank withdraws and the world is broken: its peers' operations with it fail
// with Aborted, every later Start() on any rank fails with FailedPrecondition. A destroyed
// rank: its peers' operations that it never served fail with FailedPrecondition.
//
// Process death. While waiting, a rank checks every ~20 ms whether the processes of its
// peers still exist (kill(pid, 0), and /proc/<pid>/stat for a zombie not yet reaped); a
// peer that died without destroying its transport aborts the world ("rank r (pid p)
// died"), so every rank waiting or calling later gets Aborted within a fraction of a
// second, and never waits past its deadline. (Processes of other pid namespaces are not
// supported.)
//
// Waiting. A rank first spins briefly over its rings, then sleeps on a futex word of its
// own in the segment that peers bump (and wake) whenever they write to it, free ring
// space for it, abort or leave; the sleep is also bounded by 20 ms for the liveness check.
//
// Counters count completed messages (a send once acknowledged, a receive once copied); a
// message to itself counts as both. Abort(), aborted() and the counters may be used from
// any thread; Start() and Wait() of one rank from one thread at a time.
#ifndef HSAP_LIB_COMM_SHM_TRANSPORT_H_
#define HSAP_LIB_COMM_SHM_TRANSPORT_H_

#include <array>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "lib/comm/transport.h"

namespace hsap {

// Upper bound on the ranks of one shared-memory world (the segment holds nranks^2 rings).
inline constexpr int kMaxShmRanks = 256;

// Names a world: 128 random bits.
struct ShmWorldId {
  std::array<uint8_t, 16> bytes{};
};

// A fresh id from the kernel's random source (getrandom).
absl::StatusOr<ShmWorldId> NewShmWorldId();

// The segment's name for shm_open: "/hsap-" and the id in hex.
std::string ShmSegmentName(const ShmWorldId& id);

// Joins world `id` as `rank` of `nranks`, blocking until every rank has joined (the
// bootstrap barrier) or `timeout` passed (DeadlineExceeded naming the ranks missing).
// Every rank must pass the same nranks (a mismatch is InvalidArgument on the rank that
// noticed it and Aborted on the others). Waits on peers time out after `timeout` too.
absl::StatusOr<std::unique_ptr<Transport>> CreateShmTransport(const ShmWorldId& id, int nranks,
                                                              int rank, absl::Duration timeout);

}  // namespace hsap

#endif  // HSAP_LIB_COMM_SHM_TRANSPORT_H_
