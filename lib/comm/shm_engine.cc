#include "lib/comm/shm_engine.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "lib/comm/transport.h"

namespace hsap::shm_internal {
namespace {

std::vector<uint8_t> Encode(const Record& head, absl::string_view stage) {
  Record r = head;
  r.stage_len = static_cast<uint32_t>(std::min(stage.size(), kMaxStageNameBytes));
  std::vector<uint8_t> out(sizeof(Record) + r.stage_len);
  std::memcpy(out.data(), &r, sizeof(Record));
  std::memcpy(out.data() + sizeof(Record), stage.data(), r.stage_len);
  return out;
}

}  // namespace

void Engine::Post(Op* op) {
  if (op->kind == OpKind::kSend) {
    Outbox& o = out_[op->peer];
    op->seq = o.next_seq++;
    o.sends.push_back(op);
  } else {
    PostRecv(op);
  }
}

bool Engine::Progress() {
  bool progressed = false;
  for (int p = 0; p < size(); ++p) {
    progressed |= ReadInbox(p);
    progressed |= WriteOutbox(p);
  }
  return progressed;
}

void Engine::Flush() {
  for (int p = 0; p < size(); ++p) WriteOutbox(p);
}

bool Engine::InboxIdle(int peer) {
  RingIndex& ri = seg_->ring(peer, rank_);
  return !in_[peer].in_message && ri.head.load() == ri.tail.load(std::memory_order_relaxed);
}

void Engine::Unlink(Op* op) {
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

uint64_t Engine::Free(int dst) {
  RingIndex& ri = seg_->ring(rank_, dst);
  return seg_->ring_bytes() -
         (ri.head.load(std::memory_order_relaxed) - ri.tail.load(std::memory_order_acquire));
}

void Engine::Put(int dst, const void* src, uint64_t n) {
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

uint64_t Engine::Avail(int src) {
  RingIndex& ri = seg_->ring(src, rank_);
  return ri.head.load(std::memory_order_acquire) - ri.tail.load(std::memory_order_relaxed);
}

void Engine::Peek(int src, uint64_t offset, void* dst, uint64_t n) {
  if (dst == nullptr || n == 0) return;
  RingIndex& ri = seg_->ring(src, rank_);
  const uint64_t cap = seg_->ring_bytes();
  const uint64_t at = (ri.tail.load(std::memory_order_relaxed) + offset) & (cap - 1);
  const uint64_t first = std::min(n, cap - at);
  const uint8_t* data = seg_->ring_data(src, rank_);
  std::memcpy(dst, data + at, first);
  if (first < n) std::memcpy(static_cast<uint8_t*>(dst) + first, data, n - first);
}

void Engine::Consume(int src, uint64_t n) {
  RingIndex& ri = seg_->ring(src, rank_);
  ri.tail.store(ri.tail.load(std::memory_order_relaxed) + n, std::memory_order_release);
  seg_->Notify(src);
}

void Engine::CompleteSend(Op* op) {
  op->state = OpState::kDone;
  bytes_sent.fetch_add(op->bytes, std::memory_order_relaxed);
  messages_sent.fetch_add(1, std::memory_order_relaxed);
}

void Engine::CompleteRecv(Op* op, uint64_t seq) {
  op->state = OpState::kDone;
  bytes_received.fetch_add(op->bytes, std::memory_order_relaxed);
  messages_received.fetch_add(1, std::memory_order_relaxed);
  Record ack;
  ack.type = kAck;
  ack.tag = op->tag;
  ack.seq = seq;
  out_[op->peer].control.push_back(Encode(ack, ""));
}

void Engine::FailMismatchedRecv(Op* op, uint64_t sent_bytes, uint64_t seq,
                                absl::string_view sender) {
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

void Engine::PostRecv(Op* op) {
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

bool Engine::WriteOutbox(int peer) {
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

bool Engine::ReadInbox(int peer) {
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

void Engine::StartMessage(int peer, const Record& rec, const std::string& stage) {
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

void Engine::FinishMessage(int peer) {
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

void Engine::OnReply(int peer, const Record& rec, absl::string_view receiver_stage) {
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

}  // namespace hsap::shm_internal
