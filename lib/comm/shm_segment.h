// The shared-memory transport's segment (lib/comm/shm_transport.h): its layout (a header,
// one slot per rank, one ring per ordered pair of ranks), one rank's mapping of it, the
// futex words ranks sleep on, and the bootstrap that creates, opens and joins it. Internal
// to the shared-memory transport.
#ifndef HSAP_LIB_COMM_SHM_SEGMENT_H_
#define HSAP_LIB_COMM_SHM_SEGMENT_H_

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace hsap::shm_internal {

using Clock = std::chrono::steady_clock;

inline constexpr uint64_t kSegmentMagic = 0x68736170'73686d31;  // "hsapshm1"
inline constexpr size_t kMaxStageNameBytes = 200;               // longer stage names are truncated
inline constexpr size_t kReasonBytes = 512;
// How often a waiting rank checks that its peers' processes still exist.
inline constexpr auto kLivenessPeriod = std::chrono::milliseconds(20);

struct alignas(64) SegmentHeader {
  std::atomic<uint64_t> magic;  // kSegmentMagic once rank 0 has written the fields below
  int32_t nranks;
  uint32_t unused;
  uint64_t ring_bytes;                // capacity of each (src, dst) ring, a power of two
  std::atomic<uint32_t> attached;     // ranks through the bootstrap; the barrier's futex word
  std::atomic<uint32_t> abort_claim;  // the first Abort() sets it, then writes abort_reason
  std::atomic<uint32_t> aborted;      // set after abort_reason is written
  std::atomic<uint32_t> broken_claim;
  std::atomic<uint32_t> broken;  // a rank timed out; set after broken_reason is written
  char abort_reason[kReasonBytes];
  char broken_reason[kReasonBytes];
};

// What a rank's slot says about it.
enum RankState : uint32_t {
  kAbsent = 0,     // not attached yet
  kActive = 1,     // attached
  kDeparted = 2,   // its transport was destroyed
  kWithdrawn = 3,  // it timed out and took back its operations
};

struct alignas(64) RankSlot {
  std::atomic<int32_t> pid;
  std::atomic<uint32_t> state;
  std::atomic<uint32_t> doorbell;  // bumped whenever something changed for this rank
  std::atomic<uint32_t> sleepers;  // threads of this rank sleeping on doorbell
};

// Indices of a ring: bytes ever written (by the producer) and consumed (by the consumer).
struct RingIndex {
  alignas(64) std::atomic<uint64_t> head;
  alignas(64) std::atomic<uint64_t> tail;
};

static_assert(std::atomic<uint32_t>::is_always_lock_free &&
                  std::atomic<uint64_t>::is_always_lock_free,
              "the shared segment needs address-free atomics");

// Rings shrink as the world grows so that the segment stays near 32 MiB (rings are touched
// only when used, so a large world costs address space more than memory).
uint64_t RingBytesFor(int nranks);

struct SegmentLayout {
  size_t slots = 0, rings = 0, data = 0, total = 0;

  SegmentLayout(int nranks, uint64_t ring_bytes) {
    const size_t channels = static_cast<size_t>(nranks) * nranks;
    slots = sizeof(SegmentHeader);
    rings = slots + sizeof(RankSlot) * nranks;
    data = rings + sizeof(RingIndex) * channels;
    total = data + ring_bytes * channels;
  }
};

// Sleeps while *word == expected, at most `duration` (spurious wake-ups are fine).
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, Clock::duration duration);
// Wakes every thread sleeping on `word`.
void FutexWakeAll(std::atomic<uint32_t>* word);

// False when `pid` no longer exists or is a zombie waiting to be reaped.
bool ProcessAlive(int32_t pid);

// One rank's mapping of the segment.
class Segment {
 public:
  Segment(void* base, size_t bytes, int nranks, uint64_t ring_bytes)
      : base_(static_cast<uint8_t*>(base)),
        bytes_(bytes),
        nranks_(nranks),
        ring_bytes_(ring_bytes),
        layout_(nranks, ring_bytes) {}
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  ~Segment() { munmap(base_, bytes_); }

  int nranks() const { return nranks_; }
  uint64_t ring_bytes() const { return ring_bytes_; }
  SegmentHeader& header() { return *reinterpret_cast<SegmentHeader*>(base_); }
  RankSlot& slot(int r) { return reinterpret_cast<RankSlot*>(base_ + layout_.slots)[r]; }
  RingIndex& ring(int src, int dst) {
    return reinterpret_cast<RingIndex*>(base_ + layout_.rings)[Channel(src, dst)];
  }
  uint8_t* ring_data(int src, int dst) {
    return base_ + layout_.data + ring_bytes_ * Channel(src, dst);
  }

  void Notify(int r) {
    RankSlot& s = slot(r);
    s.doorbell.fetch_add(1);
    if (s.sleepers.load() > 0) FutexWakeAll(&s.doorbell);
  }
  void NotifyAll() {
    for (int r = 0; r < nranks_; ++r) Notify(r);
    FutexWakeAll(&header().attached);  // ranks still in the bootstrap barrier
  }

  // The first reason wins; every rank's waits end.
  void Abort(absl::string_view reason) {
    SegmentHeader& h = header();
    uint32_t expected = 0;
    if (h.abort_claim.compare_exchange_strong(expected, 1)) {
      CopyReason(h.abort_reason, reason);
      h.aborted.store(1);
    }
    NotifyAll();
  }
  bool aborted() { return header().aborted.load() != 0; }
  std::string abort_reason() { return header().abort_reason; }

  void Break(absl::string_view reason) {
    SegmentHeader& h = header();
    uint32_t expected = 0;
    if (h.broken_claim.compare_exchange_strong(expected, 1)) {
      CopyReason(h.broken_reason, reason);
      h.broken.store(1);
    }
    NotifyAll();
  }
  bool broken() { return header().broken.load() != 0; }
  std::string broken_reason() { return header().broken_reason; }

 private:
  size_t Channel(int src, int dst) const { return static_cast<size_t>(src) * nranks_ + dst; }
  static void CopyReason(char* out, absl::string_view reason) {
    const size_t n = std::min(reason.size(), kReasonBytes - 1);
    std::memcpy(out, reason.data(), n);
    out[n] = '\0';
  }

  uint8_t* const base_;
  const size_t bytes_;
  const int nranks_;
  const uint64_t ring_bytes_;
  const SegmentLayout layout_;
};

// ---- Bootstrap -------------------------------------------------------------------------

// UnavailableError "what: strerror(err)".
absl::Status ErrnoError(absl::string_view what, int err);

// Rank 0: creates, sizes and initializes the segment `name` (FailedPrecondition when it
// exists already).
absl::StatusOr<std::unique_ptr<Segment>> CreateSegment(const std::string& name, int nranks);

// Other ranks: opens the segment rank 0 created, waiting for it until `deadline`
// (DeadlineExceeded then; InvalidArgument when rank 0 created it for another nranks).
absl::StatusOr<std::unique_ptr<Segment>> OpenSegment(const std::string& name, int nranks, int rank,
                                                     absl::Duration timeout,
                                                     Clock::time_point deadline);

// Marks `rank` attached and waits until every rank is (DeadlineExceeded naming the ranks
// missing; Aborted when the world is aborted or a rank's process dies meanwhile).
absl::Status JoinBarrier(Segment& seg, int rank, absl::Duration timeout,
                         Clock::time_point deadline);

// Aborts the world of the segment `name`, if it can be opened, with `reason`, releasing the
// ranks in the bootstrap barrier (a rank that found nranks disagreeing does so).
void AbortSegment(const std::string& name, absl::string_view reason);

}  // namespace hsap::shm_internal

#endif  // HSAP_LIB_COMM_SHM_SEGMENT_H_
