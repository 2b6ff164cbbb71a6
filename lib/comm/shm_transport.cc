#include "lib/comm/shm_transport.h"

#include <sys/mman.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <map>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "lib/comm/shm_engine.h"
#include "lib/comm/shm_segment.h"

namespace hsap {
namespace shm_internal {
namespace {

// Passes over the rings without progress before a waiting rank sleeps on its futex.
constexpr int kSpinPasses = 64;

// ---- Stages ----------------------------------------------------------------------------

// One stage of a rank: its operations, posted to the engine; Wait() drives the engine (and
// so the rank's other stages) until every operation of this one ends.
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

// One rank of a shared-memory world: the Transport over its engine.
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

}  // namespace
}  // namespace shm_internal

using shm_internal::Clock;
using shm_internal::CreateSegment;
using shm_internal::Engine;
using shm_internal::ErrnoError;
using shm_internal::JoinBarrier;
using shm_internal::OpenSegment;
using shm_internal::Segment;
using shm_internal::ShmTransport;

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
      shm_internal::AbortSegment(name, seg.status().message());
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
