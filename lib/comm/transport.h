// Point-to-point transport between the ranks of a communicator, with grouped semantics.
//
// A stage posts all its sends and receives together (as ncclGroupStart ... ncclGroupEnd)
// and completes when every one of them has completed. A send to peer p with tag t matches
// the receive posted by p from this rank with the same tag; sizes must agree (a mismatch is
// an error on both sides, never a silent truncation). Matching is per (peer, tag), so the
// order in which ranks post within a stage does not matter, and stages never deadlock as
// long as every rank posts the matching operations eventually.
//
// Every wait has a deadline (the communicator's timeout): a peer that never posts yields
// DeadlineExceeded naming the peer, the tag and the stage. Abort() on any rank of the
// world makes every pending and future wait on every rank return Aborted.
//
// Tag layout (64 bits):
//   bit 63 == 0   point-to-point tags chosen by the caller (the executor's stages): any
//                 value below kCollectiveTagBit.
//   bit 63 == 1   reserved for collectives built on Start(): bits 56..62 hold the
//                 CollectiveKind, bits 0..55 a per-kind sequence or caller tag. Callers of
//                 Start() must not use these tags directly; use CollectiveTag().
// Because matching is per (src, dst, tag) and first-posted-first-matched, a collective
// never consumes a point-to-point message and vice versa.
#ifndef HSAP_LIB_COMM_TRANSPORT_H_
#define HSAP_LIB_COMM_TRANSPORT_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace hsap {

inline constexpr uint64_t kCollectiveTagBit = uint64_t{1} << 63;
inline constexpr int kCollectiveKindShift = 56;
inline constexpr uint64_t kCollectiveSequenceMask = (uint64_t{1} << kCollectiveKindShift) - 1;

enum class CollectiveKind : uint8_t { kAllGather = 1, kAllToAllV = 2 };

// The reserved tag of collective `kind` with sequence number (or caller tag) `sequence`;
// bits of `sequence` above 55 are dropped.
constexpr uint64_t CollectiveTag(CollectiveKind kind, uint64_t sequence) {
  return kCollectiveTagBit | (uint64_t{static_cast<uint8_t>(kind)} << kCollectiveKindShift) |
         (sequence & kCollectiveSequenceMask);
}

// A tag as error messages name it: "tag 17", "tag allgather#3", "tag alltoallv#0".
std::string TagName(uint64_t tag);

struct SendOp {
  int peer = -1;
  const void* data = nullptr;  // must stay valid and unchanged until the stage completes
  size_t bytes = 0;
  uint64_t tag = 0;
};

struct RecvOp {
  int peer = -1;
  void* data = nullptr;  // must stay valid until the stage completes
  size_t bytes = 0;
  uint64_t tag = 0;
};

// Bytes moved by this rank since creation (or the last ResetCounters()).
struct TrafficCounters {
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  uint64_t messages_sent = 0;
  uint64_t messages_received = 0;
};

// The error of a stage whose operations `failed` (non-empty, in posting order): the first
// one's code and the messages of the first four. Shared by the transports so that a failed
// stage reads the same whichever transport ran it.
absl::Status CombineStageFailures(const std::vector<const absl::Status*>& failed);

// "rank R: timed out after T ms in stage 'S' waiting for rank P (recv tag 17, ...), ..." for
// the operations still `missing` per peer (at most eight peers named).
std::string StageTimeoutMessage(int rank, absl::Duration timeout, absl::string_view stage,
                                const std::map<int, std::vector<std::string>>& missing);

// Checks the operations of one stage of rank `rank` in a world of `size` ranks before a
// transport posts them: every peer in [0, size), no null buffer with bytes > 0, and no
// receive buffer overlapping any other buffer of the stage (a peer would write into memory
// that is being read or written concurrently). InvalidArgument naming the operation.
absl::Status CheckStageOps(int rank, int size, absl::string_view stage,
                           absl::Span<const SendOp> sends, absl::Span<const RecvOp> recvs);

class Transport {
 public:
  // A posted stage; Wait() completes it. Destroying an unwaited handle waits for it.
  class Pending {
   public:
    virtual ~Pending() = default;
    virtual absl::Status Wait() = 0;
  };

  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Posts the operations of one stage and returns at once. `stage` names the stage in
  // error messages. Zero-byte operations are allowed and still match.
  virtual absl::StatusOr<std::unique_ptr<Pending>> Start(absl::Span<const SendOp> sends,
                                                         absl::Span<const RecvOp> recvs,
                                                         std::string stage) = 0;
  // Start + Wait.
  absl::Status Exchange(absl::Span<const SendOp> sends, absl::Span<const RecvOp> recvs,
                        std::string stage);

  // Every rank contributes `bytes` bytes; out receives size() * bytes, rank r's at r*bytes.
  // Used to check that ranks agree (fingerprints) before a collective computation.
  // `in` may be out + rank() * bytes (in place); otherwise in and out must not overlap.
  // Uses the reserved tags CollectiveTag(kAllGather, n) for the n-th call on this rank.
  absl::Status AllGather(const void* in, void* out, size_t bytes, std::string stage);

  // Releases every rank's pending and future waits with Aborted(reason).
  virtual void Abort(absl::string_view reason) = 0;
  virtual bool aborted() const = 0;

  virtual TrafficCounters counters() const = 0;
  virtual void ResetCounters() = 0;

 private:
  // Sequence number of the next AllGather (all ranks call collectives in the same order,
  // so equal sequence numbers meet; a rank one call ahead shows up as a timeout naming
  // the sequence number in its tag).
  uint64_t all_gather_calls_ = 0;
};

}  // namespace hsap

#endif  // HSAP_LIB_COMM_TRANSPORT_H_
