#include "lib/cuda/transport/nccl_transport.h"

#include <chrono>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"
#include "lib/comm/p2p_group.h"

namespace hsap::cuda {
namespace {

bool IsHostCollective(uint64_t tag) {
  return (tag & kCollectiveTagBit) != 0 && ((tag >> kCollectiveKindShift) & 0x7f) ==
                                               static_cast<uint64_t>(CollectiveKind::kAllGather);
}

// Staging offsets keep 256-byte alignment.
size_t AlignUp(size_t bytes) { return (bytes + 255) / 256 * 256; }

// The buffer of each operation of `group` (GroupOfStage of sends and recvs): equal (peer,
// tag, bytes) operations are interchangeable, so each takes the first unused match.
std::vector<void*> BuffersInGroupOrder(const P2pGroup& group, absl::Span<const SendOp> sends,
                                       absl::Span<const RecvOp> recvs) {
  std::vector<void*> buffers;
  std::vector<bool> send_used(sends.size()), recv_used(recvs.size());
  auto matches = [](const auto& io, const P2pOp& op) {
    return io.peer == op.peer && io.tag == op.tag && io.bytes == op.bytes;
  };
  for (const P2pOp& op : group.ops) {
    void* buffer = nullptr;
    if (op.send) {
      for (size_t i = 0; i < sends.size() && buffer == nullptr; ++i) {
        if (!send_used[i] && matches(sends[i], op)) {
          send_used[i] = true;
          buffer = const_cast<void*>(sends[i].data);  // NCCL's send takes a const buffer
        }
      }
    } else {
      for (size_t i = 0; i < recvs.size() && buffer == nullptr; ++i) {
        if (!recv_used[i] && matches(recvs[i], op)) {
          recv_used[i] = true;
          buffer = recvs[i].data;
        }
      }
    }
    buffers.push_back(buffer);
  }
  return buffers;
}

// A peer outside [0, size) in a stage's operations.
absl::Status CheckPeers(absl::Span<const SendOp> sends, absl::Span<const RecvOp> recvs, int size,
                        const std::string& stage) {
  for (const SendOp& s : sends) {
    if (s.peer < 0 || s.peer >= size) {
      return absl::InvalidArgumentError(
          absl::StrCat("stage '", stage, "': send to peer ", s.peer, " outside [0, ", size, ")"));
    }
  }
  for (const RecvOp& r : recvs) {
    if (r.peer < 0 || r.peer >= size) {
      return absl::InvalidArgumentError(absl::StrCat("stage '", stage, "': receive from peer ",
                                                     r.peer, " outside [0, ", size, ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

// One posted group: its completion event and, for staged host receives, where to copy.
class NcclTransport::NcclPending : public Transport::Pending {
 public:
  NcclPending(NcclTransport* t, cudaEvent event, std::string stage, TrafficCounters delta)
      : t_(t), event_(event), stage_(std::move(stage)), delta_(delta) {}
  ~NcclPending() override {
    if (!waited_) (void)Wait();
    if (event_ != nullptr) t_->rt_->EventDestroy(event_);
  }
  absl::Status Wait() override {
    if (waited_) return result_;
    waited_ = true;
    result_ = t_->WaitEvent(event_, stage_);
    // cudaMemcpy runs on the current device's legacy stream: the staging buffer's device.
    CudaDeviceScope on(*t_->rt_, t_->device_);
    if (result_.ok()) result_ = on.status();
    if (result_.ok()) {
      for (const auto& [host, device, bytes] : unstage_) {
        result_ = t_->rt_->Check(t_->rt_->Memcpy(host, device, bytes, kCudaMemcpyDefault),
                                 absl::StrCat("copy of a staged receive (", stage_, ")"));
        if (!result_.ok()) break;
      }
    }
    if (!unstage_.empty()) t_->staging_busy_ = false;
    if (result_.ok()) t_->CountCompleted(delta_);
    return result_;
  }
  std::vector<std::tuple<void*, const void*, size_t>> unstage_;

 private:
  NcclTransport* t_;
  cudaEvent event_;
  std::string stage_;
  TrafficCounters delta_;
  bool waited_ = false;
  absl::Status result_;
};

absl::StatusOr<std::unique_ptr<NcclTransport>> NcclTransport::Create(ncclComm comm, bool owns_comm,
                                                                     cudaStream stream,
                                                                     absl::Duration timeout) {
  if (comm == nullptr) return absl::InvalidArgumentError("ncclComm is null");
  if (timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("the NCCL transport's timeout must be positive");
  }
  HSAP_RETURN_IF_ERROR(CheckNcclDevice());
  return Create(**LoadNccl(), **LoadCudaRuntime(), comm, owns_comm, stream, timeout);
}

absl::StatusOr<std::unique_ptr<NcclTransport>> NcclTransport::Create(const NcclApi& nccl,
                                                                     const CudaRuntimeApi& rt,
                                                                     ncclComm comm, bool owns_comm,
                                                                     cudaStream stream,
                                                                     absl::Duration timeout) {
  if (comm == nullptr) return absl::InvalidArgumentError("ncclComm is null");
  if (timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("the NCCL transport's timeout must be positive");
  }
  auto t = std::unique_ptr<NcclTransport>(new NcclTransport());
  t->nccl_ = &nccl;
  t->rt_ = &rt;
  t->timeout_ = timeout;
  // The communicator's GPU as NCCL knows it, not whichever device the calling thread has
  // current (hsapCommSplit and hsapCommInitFromNccl may be called from any thread): the
  // transport's stream, staging memory and events are made on it.
  HSAP_RETURN_IF_ERROR(
      t->nccl_->Check(t->nccl_->CommCuDevice(comm, &t->device_), "ncclCommCuDevice"));
  CudaDeviceScope on(rt, t->device_);
  HSAP_RETURN_IF_ERROR(on.status());
  HSAP_RETURN_IF_ERROR(
      t->nccl_->Check(t->nccl_->CommUserRank(comm, &t->rank_), "ncclCommUserRank"));
  HSAP_RETURN_IF_ERROR(t->nccl_->Check(t->nccl_->CommCount(comm, &t->size_), "ncclCommCount"));
  // Own the communicator only once nothing else can fail before the object exists.
  t->comm_ = comm;
  t->owns_comm_ = owns_comm;
  if (stream != nullptr) {
    t->stream_ = stream;
  } else {
    HSAP_RETURN_IF_ERROR(
        t->rt_->Check(t->rt_->StreamCreateWithFlags(&t->stream_, kCudaStreamNonBlocking),
                      "cudaStreamCreateWithFlags(communication stream)"));
    t->owns_stream_ = true;
  }
  return t;
}

NcclTransport::~NcclTransport() {
  CudaDeviceScope on(*rt_, device_);
  if (stream_ != nullptr && !aborted_.load()) rt_->StreamSynchronize(stream_);
  if (staging_ != nullptr) rt_->Free(staging_);
  if (owns_stream_ && stream_ != nullptr) rt_->StreamDestroy(stream_);
  if (owns_comm_ && comm_ != nullptr) {
    if (aborted_.load()) {
      nccl_->CommAbort(comm_);
    } else {
      nccl_->CommDestroy(comm_);
    }
  }
}

absl::StatusOr<std::unique_ptr<Transport::Pending>> NcclTransport::Start(
    absl::Span<const SendOp> sends, absl::Span<const RecvOp> recvs, std::string stage) {
  if (aborted_.load()) {
    std::lock_guard<std::mutex> lock(mu_);
    return absl::AbortedError(absl::StrCat("stage '", stage, "': ", abort_reason_));
  }
  HSAP_RETURN_IF_ERROR(CheckPeers(sends, recvs, size_, stage));
  // Staging memory and the stage's event are the communicator's GPU's, whatever device the
  // calling thread has current (NCCL takes buffers on its own device only).
  CudaDeviceScope on(*rt_, device_);
  HSAP_RETURN_IF_ERROR(on.status());
  // Host buffers of the AllGather go through device staging: sends first, then receives.
  size_t staged = 0;
  for (const SendOp& s : sends) staged += IsHostCollective(s.tag) ? AlignUp(s.bytes) : 0;
  for (const RecvOp& r : recvs) staged += IsHostCollective(r.tag) ? AlignUp(r.bytes) : 0;
  if (staged > 0) {
    if (staging_busy_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "stage '", stage, "': a second AllGather was started before the first was waited"));
    }
    if (staged > staging_bytes_) {
      if (staging_ != nullptr) rt_->Free(staging_);
      staging_ = nullptr;
      staging_bytes_ = 0;
      HSAP_RETURN_IF_ERROR(rt_->Check(rt_->Malloc(&staging_, staged), "cudaMalloc(staging)"));
      staging_bytes_ = staged;
    }
  }
  auto pending_unstage = std::vector<std::tuple<void*, const void*, size_t>>();
  std::vector<SendOp> dev_sends(sends.begin(), sends.end());
  std::vector<RecvOp> dev_recvs(recvs.begin(), recvs.end());
  size_t offset = 0;
  for (SendOp& s : dev_sends) {
    if (!IsHostCollective(s.tag)) continue;
    void* d = static_cast<char*>(staging_) + offset;
    offset += AlignUp(s.bytes);
    HSAP_RETURN_IF_ERROR(
        rt_->Check(rt_->MemcpyAsync(d, s.data, s.bytes, kCudaMemcpyDefault, stream_),
                   "staging an AllGather send"));
    s.data = d;
  }
  for (RecvOp& r : dev_recvs) {
    if (!IsHostCollective(r.tag)) continue;
    void* d = static_cast<char*>(staging_) + offset;
    offset += AlignUp(r.bytes);
    pending_unstage.emplace_back(r.data, d, r.bytes);
    r.data = d;
  }

  // The NCCL order of the operations: the same permutation GroupOfStage documents.
  P2pGroup group = GroupOfStage(dev_sends, dev_recvs, stage);
  const std::vector<void*> buffers = BuffersInGroupOrder(group, dev_sends, dev_recvs);
  TrafficCounters delta;
  HSAP_RETURN_IF_ERROR(nccl_->Check(nccl_->GroupStart(), "ncclGroupStart"));
  absl::Status issue;
  for (size_t i = 0; i < group.ops.size() && issue.ok(); ++i) {
    const P2pOp& op = group.ops[i];
    if (op.bytes == 0) continue;
    if (op.send) {
      issue = nccl_->Check(
          nccl_->Send(buffers[i], op.bytes, kNcclUint8, op.peer, comm_, stream_),
          absl::StrCat("ncclSend(", op.bytes, " B to rank ", op.peer, ") in stage '", stage, "'"));
      delta.bytes_sent += op.bytes;
      ++delta.messages_sent;
    } else {
      issue = nccl_->Check(nccl_->Recv(buffers[i], op.bytes, kNcclUint8, op.peer, comm_, stream_),
                           absl::StrCat("ncclRecv(", op.bytes, " B from rank ", op.peer,
                                        ") in stage '", stage, "'"));
      delta.bytes_received += op.bytes;
      ++delta.messages_received;
    }
  }
  // Always close the group, even after a failed call, so NCCL's group state stays sane.
  absl::Status end = nccl_->Check(nccl_->GroupEnd(), absl::StrCat("ncclGroupEnd (", stage, ")"));
  if (!issue.ok()) return issue;
  if (!end.ok()) return end;
  cudaEvent event = nullptr;
  HSAP_RETURN_IF_ERROR(rt_->Check(rt_->EventCreateWithFlags(&event, kCudaEventDisableTiming),
                                  "cudaEventCreateWithFlags"));
  if (absl::Status s = rt_->Check(rt_->EventRecord(event, stream_), "cudaEventRecord"); !s.ok()) {
    rt_->EventDestroy(event);
    return s;
  }
  auto pending = std::make_unique<NcclPending>(this, event, std::move(stage), delta);
  pending->unstage_ = std::move(pending_unstage);
  if (!pending->unstage_.empty()) staging_busy_ = true;
  return std::unique_ptr<Pending>(std::move(pending));
}

absl::Status NcclTransport::WaitEvent(cudaEvent event, const std::string& stage) {
  const absl::Time deadline = absl::Now() + timeout_;
  int polls = 0;
  for (;;) {
    if (aborted_.load()) {
      std::lock_guard<std::mutex> lock(mu_);
      return absl::AbortedError(absl::StrCat("stage '", stage, "': ", abort_reason_));
    }
    const cudaError e = rt_->EventQuery(event);
    if (e == kCudaSuccess) return absl::OkStatus();
    if (e != kCudaErrorNotReady) {
      return rt_->Check(e, absl::StrCat("cudaEventQuery (stage '", stage, "')"));
    }
    ncclResult async = kNcclSuccess;
    nccl_->CommGetAsyncError(comm_, &async);
    if (async != kNcclSuccess && async != kNcclInProgress) {
      absl::Status s =
          nccl_->Check(async, absl::StrCat("NCCL (stage '", stage, "', rank ", rank_, ")"));
      Abort(s.message());
      return s;
    }
    if (absl::Now() >= deadline) {
      const std::string msg =
          absl::StrCat("rank ", rank_, ": stage '", stage, "' did not complete within ",
                       absl::FormatDuration(timeout_),
                       " (a peer did not post its matching "
                       "operations); the NCCL communicator was aborted");
      Abort(msg);
      return absl::DeadlineExceededError(msg);
    }
    // Spin briefly (most stages finish in microseconds), then back off.
    if (++polls < 1000) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

void NcclTransport::Abort(absl::string_view reason) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_.load()) return;
    abort_reason_ = std::string(reason);
    aborted_.store(true);
  }
  // Releases NCCL kernels stuck on a peer; the communicator is unusable afterwards.
  nccl_->CommAbort(comm_);
  // An adopted communicator is aborted too: its owner must not use it any more.
  owns_comm_ = false;  // aborted: nothing left to destroy
}

bool IsCudaTransport(const Transport& t) {
  return dynamic_cast<const DeviceTransport*>(&t) != nullptr;
}

void NcclTransport::CountCompleted(const TrafficCounters& delta) {
  std::lock_guard<std::mutex> lock(mu_);
  counters_.bytes_sent += delta.bytes_sent;
  counters_.bytes_received += delta.bytes_received;
  counters_.messages_sent += delta.messages_sent;
  counters_.messages_received += delta.messages_received;
}

TrafficCounters NcclTransport::counters() const {
  std::lock_guard<std::mutex> lock(mu_);
  return counters_;
}

void NcclTransport::ResetCounters() {
  std::lock_guard<std::mutex> lock(mu_);
  counters_ = TrafficCounters();
}

}  // namespace hsap::cuda
