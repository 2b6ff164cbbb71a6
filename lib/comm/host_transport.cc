#include "lib/comm/host_transport.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"

namespace hsap {
namespace {

enum class OpKind { kSend, kRecv };

// kPosted: waiting in a queue for its partner. kMatched: paired, the receive sits in its
// owner's ready list. kCopying: the receiver is copying outside the lock; neither buffer
// may be withdrawn. kDone / kFailed: terminal, referenced by no queue.
enum class OpState { kPosted, kMatched, kCopying, kDone, kFailed };

struct Op {
  OpKind kind = OpKind::kSend;
  int owner = -1;
  int peer = -1;
  uint64_t tag = 0;
  size_t bytes = 0;
  const void* send_data = nullptr;
  void* recv_data = nullptr;
  const std::string* stage = nullptr;  // the owner's stage name; alive while the op is
  OpState state = OpState::kPosted;
  Op* partner = nullptr;  // set in kMatched and kCopying
  absl::Status error;     // set in kFailed
};

bool IsTerminal(const Op& op) { return op.state == OpState::kDone || op.state == OpState::kFailed; }

const char* KindName(OpKind kind) { return kind == OpKind::kSend ? "send" : "recv"; }

using MatchKey = std::pair<int, uint64_t>;  // (the other rank, tag)
using OpQueue = absl::flat_hash_map<MatchKey, std::deque<Op*>>;

struct RankSlot {
  std::condition_variable cv;  // signalled whenever an op of this rank changes state or on abort
  OpQueue sends_to_me;         // unmatched sends posted to this rank, keyed by (sender, tag)
  OpQueue my_recvs;            // this rank's unmatched receives, keyed by (sender, tag)
  std::vector<Op*> ready;      // this rank's matched receives, waiting for its copy
  bool departed = false;
  std::atomic<uint64_t> bytes_sent{0};
  std::atomic<uint64_t> bytes_received{0};
  std::atomic<uint64_t> messages_sent{0};
  std::atomic<uint64_t> messages_received{0};
};

struct World {
  World(int nranks, absl::Duration timeout) : timeout(timeout) {
    slots.reserve(nranks);
    for (int r = 0; r < nranks; ++r) slots.push_back(std::make_unique<RankSlot>());
  }
  int size() const { return static_cast<int>(slots.size()); }

  const absl::Duration timeout;
  std::vector<std::unique_ptr<RankSlot>> slots;
  // std::mutex rather than absl::Mutex: ThreadSanitizer understands it without an
  // instrumented Abseil.
  mutable std::mutex mu;
  bool aborted = false;                   // guarded by mu
  std::string abort_reason;               // guarded by mu
  absl::Status broken;                    // guarded by mu; set after a timeout
  std::atomic<bool> aborted_flag{false};  // lock-free mirror of `aborted` for aborted()
};

// The functions below run with world.mu held.

void RemoveFromQueue(OpQueue& queue, const MatchKey& key, Op* op) {
  auto it = queue.find(key);
  if (it == queue.end()) return;
  std::deque<Op*>& ops = it->second;
  ops.erase(std::remove(ops.begin(), ops.end(), op), ops.end());
  if (ops.empty()) queue.erase(it);
}

void RemoveFromReady(RankSlot& slot, Op* op) {
  slot.ready.erase(std::remove(slot.ready.begin(), slot.ready.end(), op), slot.ready.end());
}

void CountCompletion(World& world, const Op& send, const Op& recv) {
  RankSlot& sender = *world.slots[send.owner];
  RankSlot& receiver = *world.slots[recv.owner];
  sender.bytes_sent.fetch_add(send.bytes, std::memory_order_relaxed);
  sender.messages_sent.fetch_add(1, std::memory_order_relaxed);
  receiver.bytes_received.fetch_add(recv.bytes, std::memory_order_relaxed);
  receiver.messages_received.fetch_add(1, std::memory_order_relaxed);
}

void Pair(World& world, Op* send, Op* recv) {
  if (send->bytes != recv->bytes) {
    send->state = recv->state = OpState::kFailed;
    send->error = absl::FailedPreconditionError(absl::StrCat(
        "rank ", send->owner, ": size mismatch in stage '", *send->stage, "': send to rank ",
        send->peer, " (", TagName(send->tag), ") has ", send->bytes, " bytes but rank ",
        recv->owner, " posted a receive of ", recv->bytes, " bytes (its stage '", *recv->stage,
        "'); the ranks disagree on the message size"));
    recv->error = absl::FailedPreconditionError(absl::StrCat(
        "rank ", recv->owner, ": size mismatch in stage '", *recv->stage, "': recv from rank ",
        recv->peer, " (", TagName(recv->tag), ") expects ", recv->bytes, " bytes but rank ",
        send->owner, " sends ", send->bytes, " bytes (its stage '", *send->stage,
        "'); the ranks disagree on the message size"));
    world.slots[send->owner]->cv.notify_all();
    world.slots[recv->owner]->cv.notify_all();
    return;
  }
  if (send->bytes == 0) {  // nothing to copy: complete at once
    send->state = recv->state = OpState::kDone;
    CountCompletion(world, *send, *recv);
    world.slots[send->owner]->cv.notify_all();
    world.slots[recv->owner]->cv.notify_all();
    return;
  }
  send->state = recv->state = OpState::kMatched;
  send->partner = recv;
  recv->partner = send;
  world.slots[recv->owner]->ready.push_back(recv);
  world.slots[recv->owner]->cv.notify_all();
}

void Post(World& world, Op* op) {
  if (op->kind == OpKind::kSend) {
    RankSlot& receiver = *world.slots[op->peer];
    const MatchKey key{op->owner, op->tag};
    auto it = receiver.my_recvs.find(key);
    if (it != receiver.my_recvs.end()) {
      Op* recv = it->second.front();
      it->second.pop_front();
      if (it->second.empty()) receiver.my_recvs.erase(it);
      Pair(world, op, recv);
    } else {
      receiver.sends_to_me[key].push_back(op);
    }
  } else {
    RankSlot& me = *world.slots[op->owner];
    const MatchKey key{op->peer, op->tag};
    auto it = me.sends_to_me.find(key);
    if (it != me.sends_to_me.end()) {
      Op* send = it->second.front();
      it->second.pop_front();
      if (it->second.empty()) me.sends_to_me.erase(it);
      Pair(world, send, op);
    } else {
      me.my_recvs[key].push_back(op);
    }
  }
}

// Removes a posted op from its queue and marks it failed with `error`.
void Unpost(World& world, Op* op, absl::Status error) {
  if (op->kind == OpKind::kSend) {
    RemoveFromQueue(world.slots[op->peer]->sends_to_me, {op->owner, op->tag}, op);
  } else {
    RemoveFromQueue(world.slots[op->owner]->my_recvs, {op->peer, op->tag}, op);
  }
  op->state = OpState::kFailed;
  op->error = std::move(error);
}

// Performs every pending copy into `rank`'s receive buffers. Releases world.mu during each
// memcpy; both ops are in kCopying meanwhile, so neither side withdraws its buffer.
void ProgressCopies(World& world, int rank, std::unique_lock<std::mutex>& lock) {
  RankSlot& me = *world.slots[rank];
  while (!me.ready.empty()) {
    Op* recv = me.ready.back();
    me.ready.pop_back();
    Op* send = recv->partner;
    recv->state = send->state = OpState::kCopying;
    void* dst = recv->recv_data;
    const void* src = send->send_data;
    const size_t bytes = recv->bytes;
    lock.unlock();
    std::memcpy(dst, src, bytes);
    lock.lock();
    recv->state = send->state = OpState::kDone;
    recv->partner = send->partner = nullptr;
    CountCompletion(world, *send, *recv);
    world.slots[send->owner]->cv.notify_all();
    if (recv->owner != send->owner) me.cv.notify_all();
  }
}

class HostPending final : public Transport::Pending {
 public:
  HostPending(std::shared_ptr<World> world, int rank, std::string stage)
      : world_(std::move(world)), rank_(rank), stage_(std::move(stage)) {}
  HostPending(const HostPending&) = delete;
  HostPending& operator=(const HostPending&) = delete;

  ~HostPending() override {
    if (posted_ && !finished_) Wait().IgnoreError();
  }

  // Called by Start() under world.mu. `ops_` must not be resized afterwards.
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
      op.owner = rank_;
      op.stage = &stage_;
      Post(*world_, &op);
    }
    posted_ = true;
  }

  absl::Status Wait() override {
    if (finished_) return result_;
    World& world = *world_;
    RankSlot& me = *world.slots[rank_];
    using Clock = std::chrono::steady_clock;
    // An (effectively) infinite timeout waits without a deadline.
    std::optional<Clock::time_point> deadline;
    if (world.timeout < absl::Hours(24 * 365 * 100)) {
      deadline = Clock::now() + absl::ToChronoNanoseconds(world.timeout);
    }
    std::unique_lock<std::mutex> lock(world.mu);
    while (true) {
      if (world.aborted) {
        result_ = absl::AbortedError(
            absl::StrCat("rank ", rank_, ": stage '", stage_, "' aborted: ", world.abort_reason));
        Withdraw(absl::StrCat("the world was aborted: ", world.abort_reason), lock);
        break;
      }
      ProgressCopies(world, rank_, lock);
      if (world.aborted) continue;
      FailOpsWithDepartedPeers();
      if (std::all_of(ops_.begin(), ops_.end(), IsTerminal)) {
        result_ = CollectErrors();
        break;
      }
      if (deadline && Clock::now() >= *deadline) {
        result_ = absl::DeadlineExceededError(TimeoutMessage());
        Withdraw("it timed out", lock);
        if (world.broken.ok()) {
          world.broken = absl::FailedPreconditionError(
              absl::StrCat("the world is unusable since a rank timed out (", result_.message(),
                           "); destroy every rank and create a new communicator"));
        }
        break;
      }
      if (deadline) {
        me.cv.wait_until(lock, *deadline);
      } else {
        me.cv.wait(lock);
      }
    }
    lock.unlock();
    finished_ = true;
    return result_;
  }

 private:
  // Takes every unfinished op of this stage out of the world. Ops a peer is copying
  // right now are waited for (the copy is bounded and takes no lock); afterwards no other
  // rank refers to this stage's buffers.
  void Withdraw(absl::string_view why, std::unique_lock<std::mutex>& lock) {
    World& world = *world_;
    RankSlot& me = *world.slots[rank_];
    const absl::Status withdrawn = absl::AbortedError(absl::StrCat("withdrawn: ", why));
    for (Op& op : ops_) {
      if (op.state == OpState::kPosted) {
        Unpost(world, &op, withdrawn);
      } else if (op.state == OpState::kMatched) {
        Op* partner = op.partner;
        if (op.kind == OpKind::kRecv) {
          RemoveFromReady(me, &op);
        } else {
          RemoveFromReady(*world.slots[partner->owner], partner);
        }
        partner->state = OpState::kFailed;
        partner->partner = nullptr;
        partner->error = absl::AbortedError(
            absl::StrCat("rank ", partner->owner, ": stage '", *partner->stage, "': rank ", rank_,
                         " withdrew the matching ", KindName(op.kind), " (", TagName(op.tag),
                         ", its stage '", stage_, "') because ", why));
        world.slots[partner->owner]->cv.notify_all();
        op.state = OpState::kFailed;
        op.partner = nullptr;
        op.error = withdrawn;
      }
    }
    auto copying = [this]() {
      return std::any_of(ops_.begin(), ops_.end(),
                         [](const Op& op) { return op.state == OpState::kCopying; });
    };
    while (copying()) me.cv.wait(lock);
  }

  void FailOpsWithDepartedPeers() {
    World& world = *world_;
    for (Op& op : ops_) {
      if (op.state != OpState::kPosted || !world.slots[op.peer]->departed) continue;
      Unpost(world, &op,
             absl::FailedPreconditionError(absl::StrCat(
                 "rank ", rank_, ": stage '", stage_, "': rank ", op.peer,
                 " was destroyed before posting the ", op.kind == OpKind::kSend ? "recv" : "send",
                 " matching this ", KindName(op.kind), " (", TagName(op.tag), ")")));
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
    return StageTimeoutMessage(rank_, world_->timeout, stage_, missing);
  }

  std::shared_ptr<World> world_;
  const int rank_;
  const std::string stage_;
  std::vector<Op> ops_;
  bool posted_ = false;
  bool finished_ = false;
  absl::Status result_;
};

class HostTransport final : public Transport {
 public:
  HostTransport(std::shared_ptr<World> world, int rank) : world_(std::move(world)), rank_(rank) {}

  ~HostTransport() override {
    std::lock_guard<std::mutex> lock(world_->mu);
    world_->slots[rank_]->departed = true;
    for (auto& slot : world_->slots) slot->cv.notify_all();
  }

  int rank() const override { return rank_; }
  int size() const override { return world_->size(); }

  absl::StatusOr<std::unique_ptr<Pending>> Start(absl::Span<const SendOp> sends,
                                                 absl::Span<const RecvOp> recvs,
                                                 std::string stage) override {
    HSAP_RETURN_IF_ERROR(CheckStageOps(rank_, world_->size(), stage, sends, recvs));

    auto pending = std::make_unique<HostPending>(world_, rank_, stage);
    std::lock_guard<std::mutex> lock(world_->mu);
    if (world_->aborted) {
      return absl::AbortedError(
          absl::StrCat("rank ", rank_, ": stage '", stage, "' aborted: ", world_->abort_reason));
    }
    if (!world_->broken.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("rank ", rank_, ": stage '", stage, "': ", world_->broken.message()));
    }
    auto departed = [&](int peer) { return world_->slots[peer]->departed; };
    for (const SendOp& s : sends) {
      if (departed(s.peer)) return DepartedError(stage, s.peer);
    }
    for (const RecvOp& r : recvs) {
      if (departed(r.peer)) return DepartedError(stage, r.peer);
    }
    pending->PostAll(sends, recvs);
    return std::unique_ptr<Pending>(std::move(pending));
  }

  void Abort(absl::string_view reason) override {
    std::lock_guard<std::mutex> lock(world_->mu);
    if (world_->aborted) return;
    world_->aborted = true;
    world_->abort_reason = std::string(reason);
    world_->aborted_flag.store(true, std::memory_order_release);
    for (auto& slot : world_->slots) slot->cv.notify_all();
  }

  bool aborted() const override { return world_->aborted_flag.load(std::memory_order_acquire); }

  TrafficCounters counters() const override {
    const RankSlot& me = *world_->slots[rank_];
    TrafficCounters c;
    c.bytes_sent = me.bytes_sent.load(std::memory_order_relaxed);
    c.bytes_received = me.bytes_received.load(std::memory_order_relaxed);
    c.messages_sent = me.messages_sent.load(std::memory_order_relaxed);
    c.messages_received = me.messages_received.load(std::memory_order_relaxed);
    return c;
  }

  void ResetCounters() override {
    RankSlot& me = *world_->slots[rank_];
    me.bytes_sent.store(0, std::memory_order_relaxed);
    me.bytes_received.store(0, std::memory_order_relaxed);
    me.messages_sent.store(0, std::memory_order_relaxed);
    me.messages_received.store(0, std::memory_order_relaxed);
  }

 private:
  absl::Status DepartedError(absl::string_view stage, int peer) const {
    return absl::FailedPreconditionError(absl::StrCat("rank ", rank_, ": stage '", stage,
                                                      "': rank ", peer,
                                                      " has been destroyed; it cannot take part"));
  }

  std::shared_ptr<World> world_;
  const int rank_;
};

}  // namespace

absl::StatusOr<std::vector<std::unique_ptr<Transport>>> CreateHostTransports(
    int nranks, absl::Duration timeout) {
  if (nranks < 1 || nranks > kMaxHostRanks) {
    return absl::InvalidArgumentError(
        absl::StrCat("nranks = ", nranks, " is outside [1, ", kMaxHostRanks, "]"));
  }
  if (timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout = ", absl::FormatDuration(timeout), " must be positive"));
  }
  auto world = std::make_shared<World>(nranks, timeout);
  std::vector<std::unique_ptr<Transport>> transports;
  transports.reserve(nranks);
  for (int r = 0; r < nranks; ++r) {
    transports.push_back(std::make_unique<HostTransport>(world, r));
  }
  return transports;
}

}  // namespace hsap
