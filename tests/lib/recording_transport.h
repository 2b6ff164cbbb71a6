// A test-only Transport decorator: forwards to another transport and records each Start()
// as the NCCL group it would be (nccl_lowering.h's LowerStage), so that tests can compare
// what an executor posts with the lowering.
#ifndef HSAP_TESTS_LIB_RECORDING_TRANSPORT_H_
#define HSAP_TESTS_LIB_RECORDING_TRANSPORT_H_

#include <memory>
#include <string>
#include <utility>

#include "lib/cuda/nccl_lowering.h"
#include "lib/transport.h"

namespace hsap::cuda {

class RecordingTransport : public Transport {
 public:
  explicit RecordingTransport(std::unique_ptr<Transport> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  absl::StatusOr<std::unique_ptr<Pending>> Start(absl::Span<const SendOp> sends,
                                                 absl::Span<const RecvOp> recvs,
                                                 std::string stage) override {
    recorded_.push_back(LowerStage(sends, recvs, stage));
    return inner_->Start(sends, recvs, std::move(stage));
  }
  void Abort(absl::string_view reason) override { inner_->Abort(reason); }
  bool aborted() const override { return inner_->aborted(); }
  TrafficCounters counters() const override { return inner_->counters(); }
  void ResetCounters() override { inner_->ResetCounters(); }
  void* transfer_stream() const override { return inner_->transfer_stream(); }
  bool offers_peer_windows() const override { return inner_->offers_peer_windows(); }
  NcclProgram TakeRecorded() { return std::exchange(recorded_, {}); }

 private:
  std::unique_ptr<Transport> inner_;
  NcclProgram recorded_;
};

}  // namespace hsap::cuda

#endif  // HSAP_TESTS_LIB_RECORDING_TRANSPORT_H_
