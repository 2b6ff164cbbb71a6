// The shared-memory transport's data path (lib/comm/shm_transport.h): the records a rank
// writes on a ring, and one rank's matching engine. The engine owns the rank's mapping of
// the segment; it streams each posted send through the ring to its peer (a header record,
// then the payload in chunks of the free space), matches arriving messages to posted
// receives per (peer, tag) in posting order (keeping early ones on the heap), and answers
// every message with an acknowledgement or a size-mismatch notice. It only copies when
// Progress() or Flush() is called; one thread at a time. Internal to the transport.
#ifndef HSAP_LIB_COMM_SHM_ENGINE_H_
#define HSAP_LIB_COMM_SHM_ENGINE_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "lib/comm/shm_segment.h"

namespace hsap::shm_internal {

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

inline bool IsTerminal(const Op& op) {
  return op.state == OpState::kDone || op.state == OpState::kFailed;
}
inline const char* KindName(OpKind kind) { return kind == OpKind::kSend ? "send" : "recv"; }

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

  void Post(Op* op);

  // One pass over every ring; true when anything moved. Reading first lets the replies to
  // what was read go out in the same pass.
  bool Progress();

  // Writes what fits of the pending replies (and sends) without reading: a rank leaving
  // Wait() or being destroyed should not keep its peers waiting for acknowledgements.
  void Flush();

  // True when nothing from `peer` is waiting in its ring or arriving.
  bool InboxIdle(int peer);

  // Takes `op` out of every queue: no later progress touches its buffer.
  void Unlink(Op* op);

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

  // The ring to `dst`: its free bytes; writes n bytes and rings dst's doorbell.
  uint64_t Free(int dst);
  void Put(int dst, const void* src, uint64_t n);
  // The ring from `src`: the bytes waiting in it.
  uint64_t Avail(int src);
  // Copies n bytes at `offset` past the read position (dst null: skips them).
  void Peek(int src, uint64_t offset, void* dst, uint64_t n);
  // Frees n bytes of the ring from `src` and rings src's doorbell.
  void Consume(int src, uint64_t n);

  void CompleteSend(Op* op);
  // Marks a matched receive done and acknowledges message `seq` to its sender.
  void CompleteRecv(Op* op, uint64_t seq);
  // A receive met a message of another size: it fails, and the sender is told.
  void FailMismatchedRecv(Op* op, uint64_t sent_bytes, uint64_t seq, absl::string_view sender);

  // A receive takes the first early message of its (peer, tag), or waits in posted_.
  void PostRecv(Op* op);
  // Writes what fits to `peer`: replies between messages, then the sends in order.
  bool WriteOutbox(int peer);
  // Reads what arrived from `peer`: records, and the payload of the message under way.
  bool ReadInbox(int peer);
  // A message's header arrived: binds it to a posted receive or to a heap buffer.
  void StartMessage(int peer, const Record& rec, const std::string& stage);
  // A message's payload arrived whole: completes its receive, if it has one.
  void FinishMessage(int peer);
  // An acknowledgement or a size-mismatch notice of one of this rank's sends.
  void OnReply(int peer, const Record& rec, absl::string_view receiver_stage);

  std::unique_ptr<Segment> seg_;
  const int rank_;
  const absl::Duration timeout_;
  std::vector<Outbox> out_;
  std::vector<Inbox> in_;
  absl::flat_hash_map<MatchKey, std::deque<Op*>> posted_;  // unmatched receives
  absl::flat_hash_map<MatchKey, std::deque<std::shared_ptr<Early>>> early_;
};

}  // namespace hsap::shm_internal

#endif  // HSAP_LIB_COMM_SHM_ENGINE_H_
