#include "lib/cuda/transport/loopback_transport.h"

#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/params.h"
#include "base/status_macros.h"

namespace hsap::cuda {
namespace {

struct Op {
  int owner = -1;  // the rank that posted it
  int peer = -1;
  void* data = nullptr;  // const for sends
  size_t bytes = 0;
  uint64_t tag = 0;
  std::string stage;
  bool is_send = false;
  std::shared_ptr<CUevent_st> ready;  // sends: recorded on the sender's stream at Start
  // Set once matched: the copy's completion event (shared by both sides) or an error.
  bool matched = false;
  std::shared_ptr<CUevent_st> copied;
  absl::Status error;
};

struct World {
  const CudaRuntimeApi* rt = nullptr;
  int device = 0;  // the ranks' GPU: their streams, events and copies are its
  absl::Duration timeout;
  std::vector<cudaStream> streams;
  std::mutex mu;
  std::condition_variable cv;
  bool aborted = false;
  std::string abort_reason;
  // Unmatched sends and receives by (src, dst, tag), in posting order.
  std::map<std::tuple<int, int, uint64_t>, std::deque<std::shared_ptr<Op>>> sends, recvs;

  // An event destroyed when its last user lets go (both sides of a copy may poll it).
  absl::StatusOr<std::shared_ptr<CUevent_st>> NewEvent() {
    cudaEvent e = nullptr;
    HSAP_RETURN_IF_ERROR(
        rt->Check(rt->EventCreateWithFlags(&e, kCudaEventDisableTiming), "cudaEventCreate"));
    const CudaRuntimeApi* api = rt;
    return std::shared_ptr<CUevent_st>(e, [api](cudaEvent ev) { api->EventDestroy(ev); });
  }
};

// Enqueues the copy of a matched pair on the receiver's stream (world mutex held).
void Connect(World& w, const std::shared_ptr<Op>& send, const std::shared_ptr<Op>& recv) {
  send->matched = recv->matched = true;
  if (send->bytes != recv->bytes) {
    const absl::Status s = absl::FailedPreconditionError(
        absl::StrCat("rank ", send->owner, " sends ", send->bytes, " bytes (tag ", send->tag,
                     ", stage '", send->stage, "') but rank ", recv->owner, " receives ",
                     recv->bytes, " bytes (stage '", recv->stage, "')"));
    send->error = recv->error = s;
    return;
  }
  const cudaStream stream = w.streams[recv->owner];
  absl::Status s =
      w.rt->Check(w.rt->StreamWaitEvent(stream, send->ready.get(), 0), "cudaStreamWaitEvent");
  // Either side may be device, pinned or pageable host memory (the AllGather of batch
  // creation sends host records): the direction comes from the pointers.
  if (s.ok() && send->bytes > 0) {
    s = w.rt->Check(
        w.rt->MemcpyAsync(recv->data, send->data, send->bytes, kCudaMemcpyDefault, stream),
        "cudaMemcpyAsync (loopback)");
  }
  std::shared_ptr<CUevent_st> done;
  if (s.ok()) {
    absl::StatusOr<std::shared_ptr<CUevent_st>> e = w.NewEvent();
    s = e.status();
    if (e.ok()) done = *std::move(e);
  }
  if (s.ok()) s = w.rt->Check(w.rt->EventRecord(done.get(), stream), "cudaEventRecord");
  send->error = recv->error = s;
  send->copied = recv->copied = done;
}

class LoopbackTransport : public DeviceTransport {
 public:
  LoopbackTransport(std::shared_ptr<World> w, int rank, bool owns_stream)
      : w_(std::move(w)), rank_(rank), owns_stream_(owns_stream) {}
  ~LoopbackTransport() override {
    if (owns_stream_) {
      CudaDeviceScope on(*w_->rt, w_->device);
      w_->rt->StreamSynchronize(w_->streams[rank_]);
      w_->rt->StreamDestroy(w_->streams[rank_]);
    }
  }
  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(w_->streams.size()); }
  cudaStream stream() const { return w_->streams[rank_]; }
  cudaStream transfer_stream() const override { return stream(); }
  // Several ranks on one GPU: windows only when $HSAP_FUSED_FORWARD asks for them (header).
  bool offers_peer_windows() const override {
    if (size() == 1) return true;
    const absl::StatusOr<bool> fused = GetBoolParam(Param::kFusedForward);
    return GetParam(Param::kFusedForward).has_value() && fused.ok() && *fused;
  }

  class LoopbackPending : public Pending {
   public:
    LoopbackPending(LoopbackTransport* t, std::vector<std::shared_ptr<Op>> ops)
        : t_(t), ops_(std::move(ops)) {}
    ~LoopbackPending() override {
      if (!waited_) (void)Wait();
    }
    absl::Status Wait() override {
      if (waited_) return result_;
      waited_ = true;
      result_ = t_->WaitOps(ops_);
      return result_;
    }

   private:
    LoopbackTransport* t_;
    std::vector<std::shared_ptr<Op>> ops_;
    bool waited_ = false;
    absl::Status result_;
  };

  absl::StatusOr<std::unique_ptr<Pending>> Start(absl::Span<const SendOp> sends,
                                                 absl::Span<const RecvOp> recvs,
                                                 std::string stage) override {
    World& w = *w_;
    // The events made here and in Connect are recorded on the ranks' streams: they must be
    // of the ranks' device, whichever device the calling thread has current.
    CudaDeviceScope on(*w.rt, w.device);
    HSAP_RETURN_IF_ERROR(on.status());
    std::shared_ptr<CUevent_st> ready;
    if (!sends.empty()) {
      HSAP_ASSIGN_OR_RETURN(std::shared_ptr<CUevent_st> e, w.NewEvent());
      ready = std::move(e);
      HSAP_RETURN_IF_ERROR(
          w.rt->Check(w.rt->EventRecord(ready.get(), stream()), "cudaEventRecord"));
    }
    std::vector<std::shared_ptr<Op>> ops;
    std::lock_guard<std::mutex> lock(w.mu);
    if (w.aborted) return absl::AbortedError(w.abort_reason);
    for (const SendOp& s : sends) {
      if (s.peer < 0 || s.peer >= size()) {
        return absl::InvalidArgumentError(absl::StrCat("stage '", stage, "': peer ", s.peer));
      }
    }
    for (const RecvOp& r : recvs) {
      if (r.peer < 0 || r.peer >= size()) {
        return absl::InvalidArgumentError(absl::StrCat("stage '", stage, "': peer ", r.peer));
      }
    }
    for (const SendOp& s : sends) {
      auto op = std::make_shared<Op>();
      *op = Op{rank_, s.peer,  const_cast<void*>(s.data), s.bytes, s.tag, stage, true, ready,
               false, nullptr, absl::OkStatus()};
      auto& waiting = w.recvs[{rank_, s.peer, s.tag}];
      if (!waiting.empty()) {
        Connect(w, op, waiting.front());
        waiting.pop_front();
      } else {
        w.sends[{rank_, s.peer, s.tag}].push_back(op);
      }
      ops.push_back(op);
    }
    for (const RecvOp& r : recvs) {
      auto op = std::make_shared<Op>();
      *op = Op{rank_, r.peer,  r.data, r.bytes, r.tag,           stage,
               false, nullptr, false,  nullptr, absl::OkStatus()};
      auto& waiting = w.sends[{r.peer, rank_, r.tag}];
      if (!waiting.empty()) {
        Connect(w, waiting.front(), op);
        waiting.pop_front();
      } else {
        w.recvs[{r.peer, rank_, r.tag}].push_back(op);
      }
      ops.push_back(op);
    }
    w.cv.notify_all();
    return std::unique_ptr<Pending>(std::make_unique<LoopbackPending>(this, std::move(ops)));
  }

  absl::Status WaitOps(const std::vector<std::shared_ptr<Op>>& ops) {
    World& w = *w_;
    const absl::Time deadline = absl::Now() + w.timeout;
    {
      std::unique_lock<std::mutex> lock(w.mu);
      for (;;) {
        if (w.aborted) return absl::AbortedError(w.abort_reason);
        const Op* missing = nullptr;
        for (const auto& op : ops) {
          if (!op->matched) missing = op.get();
        }
        if (missing == nullptr) break;
        if (absl::Now() >= deadline) {
          return absl::DeadlineExceededError(absl::StrCat(
              "rank ", rank_, ": stage '", missing->stage, "' still waits for rank ", missing->peer,
              " (tag ", missing->tag, ") after ", absl::FormatDuration(w.timeout)));
        }
        w.cv.wait_for(lock, std::chrono::milliseconds(1));
      }
    }
    for (const auto& op : ops) {
      if (!op->error.ok()) return op->error;
    }
    // The copies into and out of this stage's buffers.
    for (const auto& op : ops) {
      if (op->copied == nullptr) continue;
      for (;;) {
        const cudaError e = w.rt->EventQuery(op->copied.get());
        if (e == kCudaSuccess) break;
        if (e != kCudaErrorNotReady) return w.rt->Check(e, "loopback copy");
        if (absl::Now() >= deadline) {
          return absl::DeadlineExceededError(
              absl::StrCat("rank ", rank_, ": a loopback copy of stage '", op->stage,
                           "' did not finish within ", absl::FormatDuration(w.timeout)));
        }
        std::this_thread::yield();
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& op : ops) {
      if (op->is_send) {
        counters_.bytes_sent += op->bytes;
        ++counters_.messages_sent;
      } else {
        counters_.bytes_received += op->bytes;
        ++counters_.messages_received;
      }
    }
    return absl::OkStatus();
  }

  void Abort(absl::string_view reason) override {
    std::lock_guard<std::mutex> lock(w_->mu);
    if (!w_->aborted) {
      w_->aborted = true;
      w_->abort_reason = std::string(reason);
    }
    w_->cv.notify_all();
  }
  bool aborted() const override {
    std::lock_guard<std::mutex> lock(w_->mu);
    return w_->aborted;
  }
  TrafficCounters counters() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return counters_;
  }
  void ResetCounters() override {
    std::lock_guard<std::mutex> lock(mu_);
    counters_ = TrafficCounters();
  }

 private:
  std::shared_ptr<World> w_;
  int rank_;
  bool owns_stream_;
  mutable std::mutex mu_;
  TrafficCounters counters_;
};

absl::Status CheckArguments(int nranks, absl::Duration timeout,
                            const std::vector<cudaStream>& streams) {
  if (nranks < 1) {
    return absl::InvalidArgumentError(absl::StrCat("nranks = ", nranks, " must be at least 1"));
  }
  if (!streams.empty() && static_cast<int>(streams.size()) != nranks) {
    return absl::InvalidArgumentError(
        absl::StrCat("streams has ", streams.size(), " entries; pass one per rank or none"));
  }
  if (timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("the loopback timeout must be positive");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<std::unique_ptr<Transport>>> CreateLoopbackTransports(
    int nranks, absl::Duration timeout, const std::vector<cudaStream>& streams) {
  HSAP_RETURN_IF_ERROR(CheckArguments(nranks, timeout, streams));
  HSAP_RETURN_IF_ERROR(CheckCudaDevice());
  return CreateLoopbackTransports(**LoadCudaRuntime(), nranks, timeout, streams);
}

absl::StatusOr<std::vector<std::unique_ptr<Transport>>> CreateLoopbackTransports(
    const CudaRuntimeApi& rt, int nranks, absl::Duration timeout,
    const std::vector<cudaStream>& streams) {
  HSAP_RETURN_IF_ERROR(CheckArguments(nranks, timeout, streams));
  auto w = std::make_shared<World>();
  w->rt = &rt;
  HSAP_RETURN_IF_ERROR(rt.Check(rt.GetDevice(&w->device), "cudaGetDevice"));
  w->timeout = timeout;
  w->streams = streams;
  const bool own = streams.empty();
  // The caller's streams must be of this device: the ranks' events are, and an event records
  // only on a stream of its own device. One record each tells here rather than at each stage.
  for (size_t r = 0; r < streams.size(); ++r) {
    HSAP_ASSIGN_OR_RETURN(std::shared_ptr<CUevent_st> probe, w->NewEvent());
    if (absl::Status s = rt.Check(rt.EventRecord(probe.get(), streams[r]), "cudaEventRecord");
        !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("streams[", r, "] is not a stream of GPU ",
                                                     w->device,
                                                     " (the current device): ", s.message()));
    }
  }
  if (own) {
    w->streams.assign(nranks, nullptr);
    for (int r = 0; r < nranks; ++r) {
      if (absl::Status s =
              w->rt->Check(w->rt->StreamCreateWithFlags(&w->streams[r], kCudaStreamNonBlocking),
                           "cudaStreamCreateWithFlags");
          !s.ok()) {
        for (int q = 0; q < r; ++q) w->rt->StreamDestroy(w->streams[q]);
        return s;
      }
    }
  }
  std::vector<std::unique_ptr<Transport>> out;
  for (int r = 0; r < nranks; ++r) out.push_back(std::make_unique<LoopbackTransport>(w, r, own));
  return out;
}

}  // namespace hsap::cuda
