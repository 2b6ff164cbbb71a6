// A test-only Transport decorator: forwards to another transport and records each Start()
// as the NCCL group it would be (lib/comm/p2p_group.h), so that tests can compare
// what an executor posts with the lowering.
#ifndef HSAP_TESTS_SUPPORT_RECORDING_TRANSPORT_H_
#define HSAP_TESTS_SUPPORT_RECORDING_TRANSPORT_H_

#include <memory>
#include <string>
#include <utility>

#include "lib/comm/transport.h"
#include "lib/cuda/exec/nccl_lowering.h"
#include "lib/cuda/runtime/device.h"

namespace hsap::cuda {

class RecordingTransport : public DeviceTransport {
 public:
  explicit RecordingTransport(std::unique_ptr<Transport> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  absl::StatusOr<std::unique_ptr<Pending>> Start(absl::Span<const SendOp> sends,
                                                 absl::Span<const RecvOp> recvs,
                                                 std::string stage) override {
    recorded_.push_back(GroupOfStage(sends, recvs, stage));
    return inner_->Start(sends, recvs, std::move(stage));
  }
  void Abort(absl::string_view reason) override { inner_->Abort(reason); }
  bool aborted() const override { return inner_->aborted(); }
  TrafficCounters counters() const override { return inner_->counters(); }
  void ResetCounters() override { inner_->ResetCounters(); }
  cudaStream transfer_stream() const override { return TransferStream(*inner_); }
  bool offers_peer_windows() const override { return OffersPeerWindows(*inner_); }
  P2pProgram TakeRecorded() { return std::exchange(recorded_, {}); }

 private:
  std::unique_ptr<Transport> inner_;
  P2pProgram recorded_;
};

}  // namespace hsap::cuda

#endif  // HSAP_TESTS_SUPPORT_RECORDING_TRANSPORT_H_
