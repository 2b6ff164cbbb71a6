#include "lib/comm/shm_transport.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"

namespace hsap {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kSegmentMagic = 0x68736170'73686d31;  // "hsapshm1"
constexpr size_t kMaxStageNameBytes = 200;               // longer stage names are truncated
constexpr size_t kReasonBytes = 512;
// How often a waiting rank checks that its peers' processes still exist.
constexpr auto kLivenessPeriod = std::chrono::milliseconds(20);
// Passes over the rings without progress before a waiting rank sleeps on its futex.
constexpr int kSpinPasses = 64;

// ---- The shared segment -----------------------------------------------------------------

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
uint64_t RingBytesFor(int nranks) {
  const uint64_t channels = static_cast<uint64_t>(nranks) * nranks;
  uint64_t bytes = uint64_t{1} << 20;
  while (bytes > (uint64_t{16} << 10) && bytes * channels > (uint64_t{32} << 20)) bytes >>= 1;
  return bytes;
}

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

long Futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

// Sleeps while *word == expected, at most `duration` (spurious wake-ups are fine).
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, Clock::duration duration) {
  const auto ns =
      std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::nanoseconds>(duration).count());
  timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  Futex(word, FUTEX_WAIT, expected, &ts);
}

void FutexWakeAll(std::atomic<uint32_t>* word) { Futex(word, FUTEX_WAKE, INT_MAX, nullptr); }

// False when `pid` no longer exists or is a zombie waiting to be reaped.
bool ProcessAlive(int32_t pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return true;  // no procfs: trust kill()
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* paren = std::strrchr(buf, ')');  // the command name may contain anything
  if (paren == nullptr || paren[1] == '\0' || paren[2] == '\0') return true;
  return paren[2] != 'Z' && paren[2] != 'X';
}

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

// ---- Records on a ring ------------------------------------------------------------------

enum RecordType : uint32_t {
  kData = 1,      // a message: `bytes` of payload follow the stage name
  kAck = 2,       // message `seq` was received
  kMismatch = 3,  // message `seq` met a receive of `bytes` bytes (stage name: the receiver's)
};

// Written whole (with its stage name) or not at all, so a reader sees all of it or nothing.
struct Record {
  uint32_t type = 0;
  uint32_t stage_len = 0;
  uint64_t tag = 0;
  uint64_t bytes = 0;
  uint64_t seq = 0;
};

std::vector<uint8_t> Encode(const Record& head, absl::string_view stage) {
  Record r = head;
  r.stage_len = static_cast<uint32_t>(std::min(stage.size(), kMaxStageNameBytes));
  std::vector<uint8_t> out(sizeof(Record) + r.stage_len);
  std::memcpy(out.data(), &r, sizeof(Record));
  std::memcpy(out.data() + sizeof(Record), stage.data(), r.stage_len);
  return out;
}

// ---- One rank's matching engine ---------------------------------------------------------

enum class OpKind { kSend, kRecv };
// kPosted: queued (a send not fully written, a receive not matched). kStreaming: a receive
// bound to a message still arriving. kAwaitingAck: a send fully written. Terminal: kDone,
// kFailed.
enum class OpState { kPosted, kStreaming, kAwaitingAck, kDone, kFailed };

struct Op {
  OpKind kind = OpKind::kSend;
  int peer = -1;
  uint64_t tag = 0;
  size_t bytes = 0;
  const void* send_data = nullptr;
  void* recv_data = nullptr;
  const std::string* stage = nullptr;  // the owning stage's name
  uint64_t seq = 0;                    // a send's sequence number on its ring
  OpState state = OpState::kPosted;
  absl::Status error;  // set in kFailed
};

bool IsTerminal(const Op& op) { return op.state == OpState::kDone || op.state == OpState::kFailed; }
const char* KindName(OpKind kind) { return kind == OpKind::kSend ? "send" : "recv"; }

// A message that arrived before its receive was posted, kept on the heap.
struct Early {
  uint64_t tag = 0, seq = 0, bytes = 0, received = 0;
  std::string stage;  // the sender's
  std::vector<uint8_t> data;
  Op* bound = nullptr;   // the receive that took it while it was still arriving
  bool dropped = false;  // taken by a receive of another size
};

using MatchKey = std::pair<int, uint64_t>;  // (peer, tag)

class Engine {
 public:
  Engine(std::unique_ptr<Segment> segment, int rank, absl::Duration timeout)
      : seg_(std::move(segment)),
        rank_(rank),
        timeout_(timeout),
        out_(seg_->nranks()),
        in_(seg_->nranks()) {}

  Segment& seg() { return *seg_; }
  int rank() const { return rank_; }
  int size() const { return seg_->nranks(); }
  absl::Duration timeout() const { return timeout_; }

  void Post(Op* op) {
    if (op->kind == OpKind::kSend) {
      Outbox& o = out_[op->peer];
      op->seq = o.next_seq++;
      o.sends.push_back(op);
    } else {
      PostRecv(op);
    }
  }

  // One pass over every ring; true when anything moved. Reading first lets the replies to
  // what was read go out in the same pass.
  bool Progress() {
    bool progressed = false;
    for (int p = 0; p < size(); ++p) {
      progressed |= ReadInbox(p);
      progressed |= WriteOutbox(p);
    }
    return progressed;
  }

  // Writes what fits of the pending replies (and sends) without reading: a rank leaving
  // Wait() or being destroyed should not keep its peers waiting for acknowledgements.
  void Flush() {
    for (int p = 0; p < size(); ++p) WriteOutbox(p);
  }

  // True when nothing from `peer` is waiting in its ring or arriving.
  bool InboxIdle(int peer) {
    RingIndex& ri = seg_->ring(peer, rank_);
    return !in_[peer].in_message && ri.head.load() == ri.tail.load(std::memory_order_relaxed);
  }

  // Takes `op` out of every queue: no later progress touches its buffer.
  void Unlink(Op* op) {
    if (op->kind == OpKind::kSend) {
      Outbox& o = out_[op->peer];
      auto it = std::find(o.sends.begin(), o.sends.end(), op);
      if (it != o.sends.end()) {
        // Half a message on the ring would be misread: stop using it (the world is
        // aborted, broken or the peer is gone whenever this happens).
        if (it == o.sends.begin() && o.header_written) o.poisoned = true;
        o.sends.erase(it);
      }
      o.unacked.erase(op->seq);
    } else {
      const MatchKey key{op->peer, op->tag};
      auto it = posted_.find(key);
      if (it != posted_.end()) {
        std::deque<Op*>& q = it->second;
        q.erase(std::remove(q.begin(), q.end(), op), q.end());
        if (q.empty()) posted_.erase(it);
      }
      Inbox& in = in_[op->peer];
      if (in.recv == op) in.recv = nullptr;  // the rest of the message is discarded
      if (in.early != nullptr && in.early->bound == op) {
        in.early->bound = nullptr;
        in.early->dropped = true;
      }
    }
  }

  std::atomic<uint64_t> bytes_sent{0}, bytes_received{0}, messages_sent{0}, messages_received{0};

 private:
  struct Outbox {           // this rank -> peer
    std::deque<Op*> sends;  // not fully written yet, in posting order
    bool header_written = false;
    uint64_t payload_written = 0;              // of sends.front()
    std::deque<std::vector<uint8_t>> control;  // encoded acks and mismatch notices
    absl::flat_hash_map<uint64_t, Op*> unacked;
    uint64_t next_seq = 0;
    bool poisoned = false;
  };
  struct Inbox {  // peer -> this rank
    bool in_message = false;
    Record rec;
    uint64_t received = 0;
    Op* recv = nullptr;            // the payload goes straight into this receive, or
    std::shared_ptr<Early> early;  // into this heap buffer; neither: discarded
  };

  uint64_t Free(int dst) {
    RingIndex& ri = seg_->ring(rank_, dst);
    return seg_->ring_bytes() -
           (ri.head.load(std::memory_order_relaxed) - ri.tail.load(std::memory_order_acquire));
  }
  void Put(int dst, const void* src, uint64_t n) {
    RingIndex& ri = seg_->ring(rank_, dst);
    const uint64_t head = ri.head.load(std::memory_order_relaxed);
    const uint64_t cap = seg_->ring_bytes();
    const uint64_t at = head & (cap - 1);
    const uint64_t first = std::min(n, cap - at);
    uint8_t* data = seg_->ring_data(rank_, dst);
    std::memcpy(data + at, src, first);
    if (first < n) std::memcpy(data, static_cast<const uint8_t*>(src) + first, n - first);
    ri.head.store(head + n, std::memory_order_release);
    seg_->Notify(dst);
  }
  uint64_t Avail(int src) {
    RingIndex& ri = seg_->ring(src, rank_);
    return ri.head.load(std::memory_order_acquire) - ri.tail.load(std::memory_order_relaxed);
  }
  // Copies n bytes at `offset` past the read position (dst null: skips them).
  void Peek(int src, uint64_t offset, void* dst, uint64_t n) {
    if (dst == nullptr || n == 0) return;
    RingIndex& ri = seg_->ring(src, rank_);
    const uint64_t cap = seg_->ring_bytes();
    const uint64_t at = (ri.tail.load(std::memory_order_relaxed) + offset) & (cap - 1);
    const uint64_t first = std::min(n, cap - at);
    const uint8_t* data = seg_->ring_data(src, rank_);
    std::memcpy(dst, data + at, first);
    if (first < n) std::memcpy(static_cast<uint8_t*>(dst) + first, data, n - first);
  }
  void Consume(int src, uint64_t n) {
    RingIndex& ri = seg_->ring(src, rank_);
    ri.tail.store(ri.tail.load(std::memory_order_relaxed) + n, std::memory_order_release);
    seg_->Notify(src);
  }

  void CompleteSend(Op* op) {
    op->state = OpState::kDone;
    bytes_sent.fetch_add(op->bytes, std::memory_order_relaxed);
    messages_sent.fetch_add(1, std::memory_order_relaxed);
  }
  // Marks a matched receive done and acknowledges message `seq` to its sender.
  void CompleteRecv(Op* op, uint64_t seq) {
    op->state = OpState::kDone;
    bytes_received.fetch_add(op->bytes, std::memory_order_relaxed);
    messages_received.fetch_add(1, std::memory_order_relaxed);
    Record ack;
    ack.type = kAck;
    ack.tag = op->tag;
    ack.seq = seq;
    out_[op->peer].control.push_back(Encode(ack, ""));
  }
  // A receive met a message of another size: it fails, and the sender is told.
  void FailMismatchedRecv(Op* op, uint64_t sent_bytes, uint64_t seq, absl::string_view sender) {
    op->state = OpState::kFailed;
    op->error = absl::FailedPreconditionError(absl::StrCat(
        "rank ", rank_, ": size mismatch in stage '", *op->stage, "': recv from rank ", op->peer,
        " (", TagName(op->tag), ") expects ", op->bytes, " bytes but rank ", op->peer, " sends ",
        sent_bytes, " bytes (its stage '", sender, "'); the ranks disagree on the message size"));
    Record notice;
    notice.type = kMismatch;
    notice.tag = op->tag;
    notice.bytes = op->bytes;
    notice.seq = seq;
    out_[op->peer].control.push_back(Encode(notice, *op->stage));
  }

  void PostRecv(Op* op) {
    const MatchKey key{op->peer, op->tag};
    auto it = early_.find(key);
    if (it == early_.end()) {
      posted_[key].push_back(op);
      return;
    }
    std::shared_ptr<Early> e = std::move(it->second.front());
    it->second.pop_front();
    if (it->second.empty()) early_.erase(it);
    if (e->bytes != op->bytes) {
      e->dropped = true;
      FailMismatchedRecv(op, e->bytes, e->seq, e->stage);
    } else if (e->received == e->bytes) {
      if (op->bytes > 0) std::memcpy(op->recv_data, e->data.data(), op->bytes);
      CompleteRecv(op, e->seq);
    } else {
      e->bound = op;
      op->state = OpState::kStreaming;
    }
  }

  bool WriteOutbox(int peer) {
    Outbox& o = out_[peer];
    if (o.poisoned) return false;
    bool progressed = false;
    while (true) {
      const bool mid_message = !o.sends.empty() && o.header_written;
      if (!mid_message && !o.control.empty()) {
        const std::vector<uint8_t>& record = o.control.front();
        if (Free(peer) < record.size()) break;
        Put(peer, record.data(), record.size());
        o.control.pop_front();
        progressed = true;
        continue;
      }
      if (o.sends.empty()) break;
      Op* op = o.sends.front();
      if (!o.header_written) {
        Record head;
        head.type = kData;
        head.tag = op->tag;
        head.bytes = op->bytes;
        head.seq = op->seq;
        const std::vector<uint8_t> record = Encode(head, *op->stage);
        if (Free(peer) < record.size()) break;
        Put(peer, record.data(), record.size());
        o.header_written = true;
        o.payload_written = 0;
        progressed = true;
      }
      const uint64_t remaining = op->bytes - o.payload_written;
      if (remaining > 0) {
        const uint64_t n = std::min(Free(peer), remaining);
        if (n == 0) break;
        Put(peer, static_cast<const uint8_t*>(op->send_data) + o.payload_written, n);
        o.payload_written += n;
        progressed = true;
        if (n < remaining) break;  // the ring is full
      }
      o.sends.pop_front();
      o.header_written = false;
      op->state = OpState::kAwaitingAck;
      o.unacked[op->seq] = op;
    }
    return progressed;
  }

  bool ReadInbox(int peer) {
    Inbox& in = in_[peer];
    bool progressed = false;
    while (true) {
      if (!in.in_message) {
        if (Avail(peer) < sizeof(Record)) break;
        Record rec;
        Peek(peer, 0, &rec, sizeof(Record));
        std::string stage(std::min<size_t>(rec.stage_len, kMaxStageNameBytes), '\0');
        Peek(peer, sizeof(Record), stage.data(), stage.size());
        Consume(peer, sizeof(Record) + rec.stage_len);
        progressed = true;
        if (rec.type == kAck || rec.type == kMismatch) {
          OnReply(peer, rec, stage);
        } else {
          StartMessage(peer, rec, stage);
        }
        continue;
      }
      const uint64_t remaining = in.rec.bytes - in.received;
      const uint64_t n = std::min(Avail(peer), remaining);
      if (n == 0) break;
      void* dst = nullptr;
      if (in.recv != nullptr) {
        dst = static_cast<uint8_t*>(in.recv->recv_data) + in.received;
      } else if (in.early != nullptr && !in.early->dropped) {
        dst = in.early->data.data() + in.received;
      }
      Peek(peer, 0, dst, n);
      Consume(peer, n);
      in.received += n;
      if (in.early != nullptr) in.early->received = in.received;
      progressed = true;
      if (in.received == in.rec.bytes) FinishMessage(peer);
    }
    return progressed;
  }

  void StartMessage(int peer, const Record& rec, const std::string& stage) {
    Inbox& in = in_[peer];
    in.in_message = true;
    in.rec = rec;
    in.received = 0;
    in.recv = nullptr;
    in.early = nullptr;
    const MatchKey key{peer, rec.tag};
    auto posted = posted_.find(key);
    if (!early_.contains(key) && posted != posted_.end()) {
      Op* op = posted->second.front();
      posted->second.pop_front();
      if (posted->second.empty()) posted_.erase(posted);
      if (op->bytes != rec.bytes) {
        FailMismatchedRecv(op, rec.bytes, rec.seq, stage);  // the payload is discarded
      } else {
        op->state = OpState::kStreaming;
        in.recv = op;
      }
    } else {
      auto e = std::make_shared<Early>();
      e->tag = rec.tag;
      e->seq = rec.seq;
      e->bytes = rec.bytes;
      e->stage = stage;
      e->data.resize(rec.bytes);
      early_[key].push_back(e);
      in.early = std::move(e);
    }
    if (rec.bytes == 0) FinishMessage(peer);
  }

  void FinishMessage(int peer) {
    Inbox& in = in_[peer];
    if (in.recv != nullptr) {
      CompleteRecv(in.recv, in.rec.seq);
    } else if (in.early != nullptr && in.early->bound != nullptr) {
      Op* op = in.early->bound;
      if (op->bytes > 0) std::memcpy(op->recv_data, in.early->data.data(), op->bytes);
      CompleteRecv(op, in.rec.seq);
    }
    in.in_message = false;
    in.recv = nullptr;
    in.early = nullptr;
  }

  void OnReply(int peer, const Record& rec, absl::string_view receiver_stage) {
    Outbox& o = out_[peer];
    auto it = o.unacked.find(rec.seq);
    if (it == o.unacked.end()) return;  // withdrawn meanwhile
    Op* op = it->second;
    o.unacked.erase(it);
    if (rec.type == kAck) {
      CompleteSend(op);
      return;
    }
    op->state = OpState::kFailed;
    op->error = absl::FailedPreconditionError(
        absl::StrCat("rank ", rank_, ": size mismatch in stage '", *op->stage, "': send to rank ",
                     peer, " (", TagName(op->tag), ") has ", op->bytes, " bytes but rank ", peer,
                     " posted a receive of ", rec.bytes, " bytes (its stage '", receiver_stage,
                     "'); the ranks disagree on the message size"));
  }

  std::unique_ptr<Segment> seg_;
  const int rank_;
  const absl::Duration timeout_;
  std::vector<Outbox> out_;
  std::vector<Inbox> in_;
  absl::flat_hash_map<MatchKey, std::deque<Op*>> posted_;  // unmatched receives
  absl::flat_hash_map<MatchKey, std::deque<std::shared_ptr<Early>>> early_;
};

// ---- Stages ----------------------------------------------------------------------------

class ShmPending final : public Transport::Pending {
 public:
  ShmPending(std::shared_ptr<Engine> engine, std::string stage)
      : engine_(std::move(engine)), stage_(std::move(stage)) {}
  ShmPending(const ShmPending&) = delete;
  ShmPending& operator=(const ShmPending&) = delete;
  ~ShmPending() override {
    if (!finished_) Wait().IgnoreError();
  }

  void PostAll(absl::Span<const SendOp> sends, absl::Span<const RecvOp> recvs) {
    ops_.resize(sends.size() + recvs.size());
    size_t i = 0;
    for (const SendOp& s : sends) {
      Op& op = ops_[i++];
      op.kind = OpKind::kSend;
      op.peer = s.peer;
      op.tag = s.tag;
      op.bytes = s.bytes;
      op.send_data = s.data;
    }
    for (const RecvOp& r : recvs) {
      Op& op = ops_[i++];
      op.kind = OpKind::kRecv;
      op.peer = r.peer;
      op.tag = r.tag;
      op.bytes = r.bytes;
      op.recv_data = r.data;
    }
    for (Op& op : ops_) {
      op.stage = &stage_;
      engine_->Post(&op);
    }
    engine_->Progress();
  }

  absl::Status Wait() override {
    if (finished_) return result_;
    Engine& engine = *engine_;
    Segment& seg = engine.seg();
    RankSlot& me = seg.slot(engine.rank());
    std::optional<Clock::time_point> deadline;
    if (engine.timeout() < absl::Hours(24 * 365 * 100)) {
      deadline = Clock::now() + absl::ToChronoNanoseconds(engine.timeout());
    }
    auto next_liveness_check = Clock::now() + kLivenessPeriod;
    int idle_passes = 0;
    std::vector<uint32_t> peer_state(engine.size());
    while (true) {
      const uint32_t bell = me.doorbell.load();
      if (seg.aborted()) {
        result_ = absl::AbortedError(absl::StrCat("rank ", engine.rank(), ": stage '", stage_,
                                                  "' aborted: ", seg.abort_reason()));
        Withdraw(absl::StrCat("the world was aborted: ", seg.abort_reason()));
        break;
      }
      // Read before the pass, so that whatever a departed peer wrote before leaving has
      // been consumed when its absence is judged below.
      for (int p = 0; p < engine.size(); ++p) peer_state[p] = seg.slot(p).state.load();
      const bool progressed = engine.Progress();
      FailOpsOfGonePeers(peer_state);
      if (std::all_of(ops_.begin(), ops_.end(), IsTerminal)) {
        result_ = CollectErrors();
        engine.Flush();
        break;
      }
      const auto now = Clock::now();
      if (deadline && now >= *deadline) {
        result_ = absl::DeadlineExceededError(TimeoutMessage());
        Withdraw("it timed out");
        me.state.store(kWithdrawn);
        seg.Break(absl::StrCat("the world is unusable since a rank timed out (", result_.message(),
                               "); destroy every rank and create a new communicator"));
        break;
      }
      if (now >= next_liveness_check) {
        CheckPeersAlive();
        next_liveness_check = now + kLivenessPeriod;
        continue;
      }
      if (progressed) {
        idle_passes = 0;
        continue;
      }
      if (++idle_passes < kSpinPasses) {
        std::this_thread::yield();
        continue;
      }
      Clock::duration sleep = next_liveness_check - now;
      if (deadline) sleep = std::min(sleep, *deadline - now);
      me.sleepers.fetch_add(1);
      FutexWait(&me.doorbell, bell, sleep);
      me.sleepers.fetch_sub(1);
    }
    finished_ = true;
    return result_;
  }

 private:
  void Fail(Op& op, absl::Status error) {
    engine_->Unlink(&op);
    op.state = OpState::kFailed;
    op.error = std::move(error);
  }

  void Withdraw(absl::string_view why) {
    const absl::Status withdrawn = absl::AbortedError(absl::StrCat("withdrawn: ", why));
    for (Op& op : ops_) {
      if (!IsTerminal(op)) Fail(op, withdrawn);
    }
  }

  // Operations whose peer left (destroyed or timed out) and sent nothing more fail.
  void FailOpsOfGonePeers(const std::vector<uint32_t>& peer_state) {
    const int me = engine_->rank();
    for (Op& op : ops_) {
      if (IsTerminal(op)) continue;
      const uint32_t state = peer_state[op.peer];
      if (state != kDeparted && state != kWithdrawn) continue;
      if (!engine_->InboxIdle(op.peer)) continue;
      const char* partner = op.kind == OpKind::kSend ? "recv" : "send";
      if (state == kDeparted) {
        Fail(op, absl::FailedPreconditionError(absl::StrCat(
                     "rank ", me, ": stage '", stage_, "': rank ", op.peer,
                     " was destroyed before completing the ", partner, " matching this ",
                     KindName(op.kind), " (", TagName(op.tag), ")")));
      } else {
        Fail(op, absl::AbortedError(absl::StrCat("rank ", me, ": stage '", stage_, "': rank ",
                                                 op.peer, " withdrew the ", partner,
                                                 " matching this ", KindName(op.kind), " (",
                                                 TagName(op.tag), ") because it timed out")));
      }
    }
  }

  // Aborts the world when the process of an attached, not destroyed peer is gone.
  void CheckPeersAlive() {
    Segment& seg = engine_->seg();
    const int32_t self = getpid();
    for (int p = 0; p < engine_->size(); ++p) {
      RankSlot& slot = seg.slot(p);
      const int32_t pid = slot.pid.load();
      if (pid <= 0 || pid == self || slot.state.load() != kActive) continue;
      if (!ProcessAlive(pid)) {
        seg.Abort(absl::StrCat("rank ", p, " (pid ", pid,
                               ") died without destroying its communicator (noticed by rank ",
                               engine_->rank(), " in stage '", stage_, "')"));
        return;
      }
    }
  }

  absl::Status CollectErrors() const {
    std::vector<const absl::Status*> errors;
    for (const Op& op : ops_) {
      if (op.state == OpState::kFailed) errors.push_back(&op.error);
    }
    if (errors.empty()) return absl::OkStatus();
    return CombineStageFailures(errors);
  }

  std::string TimeoutMessage() const {
    std::map<int, std::vector<std::string>> missing;  // peer -> "recv tag 17", ...
    for (const Op& op : ops_) {
      if (IsTerminal(op)) continue;
      missing[op.peer].push_back(absl::StrCat(KindName(op.kind), " ", TagName(op.tag)));
    }
    return StageTimeoutMessage(engine_->rank(), engine_->timeout(), stage_, missing);
  }

  std::shared_ptr<Engine> engine_;
  const std::string stage_;
  std::vector<Op> ops_;  // not resized after PostAll: the engine points into it
  bool finished_ = false;
  absl::Status result_;
};

class ShmTransport final : public Transport {
 public:
  explicit ShmTransport(std::shared_ptr<Engine> engine) : engine_(std::move(engine)) {}
  ~ShmTransport() override {
    engine_->Flush();
    Segment& seg = engine_->seg();
    seg.slot(engine_->rank()).state.store(kDeparted);
    seg.NotifyAll();
  }

  int rank() const override { return engine_->rank(); }
  int size() const override { return engine_->size(); }

  absl::StatusOr<std::unique_ptr<Pending>> Start(absl::Span<const SendOp> sends,
                                                 absl::Span<const RecvOp> recvs,
                                                 std::string stage) override {
    const int me = rank();
    HSAP_RETURN_IF_ERROR(CheckStageOps(me, size(), stage, sends, recvs));
    Segment& seg = engine_->seg();
    if (seg.aborted()) {
      return absl::AbortedError(
          absl::StrCat("rank ", me, ": stage '", stage, "' aborted: ", seg.abort_reason()));
    }
    if (seg.broken()) {
      return absl::FailedPreconditionError(
          absl::StrCat("rank ", me, ": stage '", stage, "': ", seg.broken_reason()));
    }
    auto departed = [&](int peer) { return seg.slot(peer).state.load() == kDeparted; };
    for (const SendOp& s : sends) {
      if (departed(s.peer)) return DepartedError(stage, s.peer);
    }
    for (const RecvOp& r : recvs) {
      if (departed(r.peer)) return DepartedError(stage, r.peer);
    }
    auto pending = std::make_unique<ShmPending>(engine_, std::move(stage));
    pending->PostAll(sends, recvs);
    return std::unique_ptr<Pending>(std::move(pending));
  }

  void Abort(absl::string_view reason) override { engine_->seg().Abort(reason); }
  bool aborted() const override { return engine_->seg().aborted(); }

  TrafficCounters counters() const override {
    TrafficCounters c;
    c.bytes_sent = engine_->bytes_sent.load(std::memory_order_relaxed);
    c.bytes_received = engine_->bytes_received.load(std::memory_order_relaxed);
    c.messages_sent = engine_->messages_sent.load(std::memory_order_relaxed);
    c.messages_received = engine_->messages_received.load(std::memory_order_relaxed);
    return c;
  }
  void ResetCounters() override {
    engine_->bytes_sent.store(0, std::memory_order_relaxed);
    engine_->bytes_received.store(0, std::memory_order_relaxed);
    engine_->messages_sent.store(0, std::memory_order_relaxed);
    engine_->messages_received.store(0, std::memory_order_relaxed);
  }

 private:
  absl::Status DepartedError(absl::string_view stage, int peer) const {
    return absl::FailedPreconditionError(absl::StrCat("rank ", rank(), ": stage '", stage,
                                                      "': rank ", peer,
                                                      " has been destroyed; it cannot take part"));
  }

  std::shared_ptr<Engine> engine_;
};

// ---- Bootstrap -------------------------------------------------------------------------

absl::Status ErrnoError(absl::string_view what, int err) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(err)));
}

// Closes a descriptor on scope exit.
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) close(fd);
  }
};

absl::StatusOr<void*> Map(int fd, size_t bytes, const std::string& name) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return ErrnoError(absl::StrCat("mmap of ", name), errno);
  return p;
}

std::string MissingRanks(Segment& seg) {
  std::vector<int> missing;
  for (int r = 0; r < seg.nranks(); ++r) {
    if (seg.slot(r).pid.load() == 0) missing.push_back(r);
  }
  return absl::StrJoin(missing, ", ");
}

// Rank 0: creates, sizes and initializes the segment.
absl::StatusOr<std::unique_ptr<Segment>> CreateSegment(const std::string& name, int nranks) {
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) {
    const int err = errno;
    if (err == EEXIST) {
      return absl::FailedPreconditionError(absl::StrCat(
          "shared-memory segment ", name,
          " already exists: this unique id is already in use by another communicator; create a "
          "fresh one with hsapGetUniqueId for every communicator"));
    }
    return ErrnoError(absl::StrCat("shm_open(", name, ", O_CREAT)"), err);
  }
  FdCloser closer{fd};
  const uint64_t ring_bytes = RingBytesFor(nranks);
  const SegmentLayout layout(nranks, ring_bytes);
  if (ftruncate(fd, static_cast<off_t>(layout.total)) != 0) {
    const int err = errno;
    shm_unlink(name.c_str());
    return ErrnoError(absl::StrCat("ftruncate of ", name, " to ", layout.total, " bytes"), err);
  }
  absl::StatusOr<void*> base = Map(fd, layout.total, name);
  if (!base.ok()) {
    shm_unlink(name.c_str());
    return base.status();
  }
  auto seg = std::make_unique<Segment>(*base, layout.total, nranks, ring_bytes);
  SegmentHeader& h = seg->header();
  h.nranks = nranks;
  h.ring_bytes = ring_bytes;
  h.magic.store(kSegmentMagic);  // the fresh file is zero: every other field starts at zero
  return seg;
}

// Other ranks: opens the segment rank 0 created, waiting for it until `deadline`.
absl::StatusOr<std::unique_ptr<Segment>> OpenSegment(const std::string& name, int nranks, int rank,
                                                     absl::Duration timeout,
                                                     Clock::time_point deadline) {
  auto backoff = std::chrono::microseconds(200);
  auto sleep = [&] {
    std::this_thread::sleep_for(backoff);
    backoff = std::min<std::chrono::microseconds>(backoff * 2, std::chrono::milliseconds(10));
  };
  auto timed_out = [&](absl::string_view what) {
    return absl::DeadlineExceededError(
        absl::StrCat("rank ", rank, ": timed out after ", absl::ToInt64Milliseconds(timeout),
                     " ms waiting for rank 0 to ", what, " the shared-memory segment ", name,
                     " (did rank 0 call hsapCommInitRank with the same unique id?)"));
  };
  int fd = -1;
  while ((fd = shm_open(name.c_str(), O_RDWR, 0)) < 0) {
    if (errno != ENOENT) return ErrnoError(absl::StrCat("shm_open(", name, ")"), errno);
    if (Clock::now() >= deadline) return timed_out("create");
    sleep();
  }
  FdCloser closer{fd};
  // Rank 0 sizes the file before it sets the magic; wait for both.
  while (true) {
    struct stat st;
    if (fstat(fd, &st) != 0) return ErrnoError(absl::StrCat("fstat of ", name), errno);
    if (static_cast<size_t>(st.st_size) >= sizeof(SegmentHeader)) {
      HSAP_ASSIGN_OR_RETURN(void* p, Map(fd, sizeof(SegmentHeader), name));
      auto* h = static_cast<SegmentHeader*>(p);
      const bool ready = h->magic.load() == kSegmentMagic;
      const int32_t their_nranks = h->nranks;
      const uint64_t ring_bytes = h->ring_bytes;
      munmap(p, sizeof(SegmentHeader));
      if (ready) {
        if (their_nranks != nranks) {
          return absl::InvalidArgumentError(
              absl::StrCat("rank ", rank, " was given nranks = ", nranks,
                           " but rank 0 created the world with nranks = ", their_nranks,
                           "; every rank must pass the same nranks"));
        }
        const SegmentLayout layout(nranks, ring_bytes);
        HSAP_ASSIGN_OR_RETURN(void* base, Map(fd, layout.total, name));
        return std::make_unique<Segment>(base, layout.total, nranks, ring_bytes);
      }
    }
    if (Clock::now() >= deadline) return timed_out("initialize");
    sleep();
  }
}

// Marks `rank` attached and waits until every rank is.
absl::Status JoinBarrier(Segment& seg, int rank, absl::Duration timeout,
                         Clock::time_point deadline) {
  RankSlot& slot = seg.slot(rank);
  int32_t expected = 0;
  const int32_t self = getpid();
  if (!slot.pid.compare_exchange_strong(expected, self)) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " is already attached to this world (by pid ", expected,
                     "); every rank number must be used exactly once per unique id"));
  }
  slot.state.store(kActive);
  SegmentHeader& h = seg.header();
  h.attached.fetch_add(1);
  seg.NotifyAll();
  auto next_liveness_check = Clock::now() + kLivenessPeriod;
  while (true) {
    const uint32_t attached = h.attached.load();
    if (seg.aborted()) {
      return absl::AbortedError(absl::StrCat("rank ", rank, ": the communicator was aborted while ",
                                             "its ranks were joining: ", seg.abort_reason()));
    }
    if (attached >= static_cast<uint32_t>(seg.nranks())) return absl::OkStatus();
    const auto now = Clock::now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "rank ", rank, ": timed out after ", absl::ToInt64Milliseconds(timeout),
          " ms waiting for rank(s) ", MissingRanks(seg),
          " to join the shared-memory communicator (hsapCommInitRank with the same unique id "
          "and nranks = ",
          seg.nranks(), ")"));
    }
    if (now >= next_liveness_check) {
      for (int p = 0; p < seg.nranks(); ++p) {
        const int32_t pid = seg.slot(p).pid.load();
        if (pid > 0 && pid != self && !ProcessAlive(pid)) {
          return absl::AbortedError(absl::StrCat("rank ", rank, ": rank ", p, " (pid ", pid,
                                                 ") died while the ranks were joining"));
        }
      }
      next_liveness_check = now + kLivenessPeriod;
    }
    FutexWait(&h.attached, attached, std::min<Clock::duration>(deadline - now, kLivenessPeriod));
  }
}

}  // namespace

absl::StatusOr<ShmWorldId> NewShmWorldId() {
  ShmWorldId id;
  size_t filled = 0;
  while (filled < id.bytes.size()) {
    const ssize_t n = getrandom(id.bytes.data() + filled, id.bytes.size() - filled, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("getrandom", errno);
    }
    filled += static_cast<size_t>(n);
  }
  return id;
}

std::string ShmSegmentName(const ShmWorldId& id) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string name = "/hsap-";
  for (uint8_t b : id.bytes) {
    name.push_back(kHex[b >> 4]);
    name.push_back(kHex[b & 15]);
  }
  return name;
}

absl::StatusOr<std::unique_ptr<Transport>> CreateShmTransport(const ShmWorldId& id, int nranks,
                                                              int rank, absl::Duration timeout) {
  if (nranks < 1 || nranks > kMaxShmRanks) {
    return absl::InvalidArgumentError(absl::StrCat("nranks = ", nranks, " is outside [1, ",
                                                   kMaxShmRanks, "] for shared-memory ranks"));
  }
  if (rank < 0 || rank >= nranks) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank = ", rank, " is outside [0, nranks = ", nranks, ")"));
  }
  if (timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout = ", absl::FormatDuration(timeout), " must be positive"));
  }
  const std::string name = ShmSegmentName(id);
  const Clock::time_point deadline = timeout < absl::Hours(24 * 365 * 100)
                                         ? Clock::now() + absl::ToChronoNanoseconds(timeout)
                                         : Clock::time_point::max();
  absl::StatusOr<std::unique_ptr<Segment>> seg =
      rank == 0 ? CreateSegment(name, nranks) : OpenSegment(name, nranks, rank, timeout, deadline);
  if (!seg.ok()) {
    if (rank != 0 && seg.status().code() == absl::StatusCode::kInvalidArgument) {
      // nranks disagrees: release the others rather than let them wait for the deadline.
      const int fd = shm_open(name.c_str(), O_RDWR, 0);
      if (fd >= 0) {
        FdCloser closer{fd};
        if (absl::StatusOr<void*> p = Map(fd, sizeof(SegmentHeader), name); p.ok()) {
          Segment header_only(*p, sizeof(SegmentHeader), 0, 0);
          header_only.Abort(seg.status().message());
          FutexWakeAll(&header_only.header().attached);
        }
      }
      shm_unlink(name.c_str());
    }
    return seg.status();
  }
  absl::Status joined = JoinBarrier(**seg, rank, timeout, deadline);
  // Every rank has attached, or the world failed to form: either way no one needs the name.
  shm_unlink(name.c_str());
  if (!joined.ok()) {
    (*seg)->Abort(joined.message());
    return joined;
  }
  auto engine = std::make_shared<Engine>(*std::move(seg), rank, timeout);
  return std::unique_ptr<Transport>(std::make_unique<ShmTransport>(std::move(engine)));
}

}  // namespace hsap
