// A Transport over NCCL: one rank per GPU, grouped ncclSend/ncclRecv on a communication
// stream.
//
// Start() lowers the stage with GroupOfStage (lib/comm/p2p_group.h: operations sorted by peer,
// sends first, then tag, so both sides of a pair list their messages in the same order),
// issues ncclGroupStart, the sends and receives (ncclUint8, byte counts; zero-byte
// operations are skipped on both sides), ncclGroupEnd, and records an event on the stream.
// Pending::Wait() polls that event and ncclCommGetAsyncError until the communicator's
// deadline; on timeout or an asynchronous NCCL error it aborts the NCCL communicator
// (ncclCommAbort) and returns DeadlineExceeded / Internal naming the stage.
//
// NCCL has no tags, so the transport contract's "matching per (peer, tag)" holds only when
// every rank enqueues its stages in an order in which each group meets the same group on
// its peers (the lowering's global label order, see nccl_lowering.h); size mismatches
// cannot be detected by NCCL and are prevented by construction (the schedules agree).
//
// Data pointers are device memory, except for the AllGather collective (the agreement
// fingerprints of batches, CollectiveTag(kAllGather, n)), whose host buffers are staged
// through a small device buffer owned by the transport.
//
// Abort() aborts this rank's NCCL communicator; peers are released by their own deadline
// or by NCCL's error propagation, not at once as with the host transport.
#ifndef HSAP_LIB_CUDA_TRANSPORT_NCCL_TRANSPORT_H_
#define HSAP_LIB_CUDA_TRANSPORT_NCCL_TRANSPORT_H_

#include <atomic>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "lib/comm/transport.h"
#include "lib/cuda/runtime/cuda_loader.h"
#include "lib/cuda/runtime/device.h"

namespace hsap::cuda {

class NcclTransport : public DeviceTransport {
 public:
  // Adopts `comm` (destroyed with the transport when owns_comm). `stream`: the caller's
  // CUDA stream for communication, a stream of the communicator's GPU; null creates a
  // non-blocking stream of our own. The transport works on the communicator's GPU
  // (ncclCommCuDevice), which it makes current for its own CUDA calls (its stream, staging
  // memory, events) and then restores the caller's: it may be created and used from a thread
  // whose current device is another GPU.
  static absl::StatusOr<std::unique_ptr<NcclTransport>> Create(ncclComm comm, bool owns_comm,
                                                               cudaStream stream,
                                                               absl::Duration timeout);
  // The same through `nccl` and the CUDA runtime `rt` (the ones Create loads, or a test's
  // stand-ins), which must outlive the transport.
  static absl::StatusOr<std::unique_ptr<NcclTransport>> Create(const NcclApi& nccl,
                                                               const CudaRuntimeApi& rt,
                                                               ncclComm comm, bool owns_comm,
                                                               cudaStream stream,
                                                               absl::Duration timeout);
  ~NcclTransport() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  absl::StatusOr<std::unique_ptr<Pending>> Start(absl::Span<const SendOp> sends,
                                                 absl::Span<const RecvOp> recvs,
                                                 std::string stage) override;
  void Abort(absl::string_view reason) override;
  bool aborted() const override { return aborted_.load(); }
  TrafficCounters counters() const override;
  void ResetCounters() override;

  ncclComm comm() const { return comm_; }
  cudaStream stream() const { return stream_; }
  int device() const { return device_; }  // the communicator's GPU
  cudaStream transfer_stream() const override { return stream_; }
  bool offers_peer_windows() const override { return true; }
  const NcclApi& nccl() const { return *nccl_; }
  const CudaRuntimeApi& runtime() const { return *rt_; }
  absl::Duration timeout() const { return timeout_; }

 private:
  class NcclPending;
  NcclTransport() = default;
  // Waits for `event` with the deadline; aborts the communicator on failure.
  absl::Status WaitEvent(cudaEvent event, const std::string& stage);
  void CountCompleted(const TrafficCounters& delta);

  const NcclApi* nccl_ = nullptr;
  const CudaRuntimeApi* rt_ = nullptr;
  int device_ = 0;  // the communicator's GPU: its stream, staging and events are this GPU's
  ncclComm comm_ = nullptr;
  bool owns_comm_ = false;
  cudaStream stream_ = nullptr;
  bool owns_stream_ = false;
  absl::Duration timeout_;
  int rank_ = 0, size_ = 1;
  std::atomic<bool> aborted_{false};
  std::string abort_reason_;
  // Device staging for host AllGather buffers.
  void* staging_ = nullptr;
  size_t staging_bytes_ = 0;
  bool staging_busy_ = false;
  mutable std::mutex mu_;  // counters_, abort_reason_
  TrafficCounters counters_;
};

// True when `t` moves device memory (it has a transfer_stream: NCCL or loopback): the host
// executor must not run on it (batches on such communicators run on the GPU executor).
bool IsCudaTransport(const Transport& t);

}  // namespace hsap::cuda

#endif  // HSAP_LIB_CUDA_TRANSPORT_NCCL_TRANSPORT_H_
