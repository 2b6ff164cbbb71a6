// Pieces the GPU executors share (gpu_executor.cc for the sequence-aware ring,
// gpu_hier_executor.cc for plans): per-call events, and the stand-ins the measurement
// modes (GpuExecMode) run with.
#ifndef HSAP_LIB_CUDA_EXEC_UTIL_H_
#define HSAP_LIB_CUDA_EXEC_UTIL_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lib/cuda/device.h"
#include "lib/transport.h"

namespace hsap::cuda {

// Events created for one call and destroyed at its end (destroying an event whose work is
// pending is allowed: CUDA releases it on completion).
class CallEvents {
 public:
  explicit CallEvents(Device& device) : device_(device) {}
  ~CallEvents() {
    for (cudaEvent e : events_) device_.DestroyEvent(e);
  }
  absl::StatusOr<cudaEvent> New() {
    absl::StatusOr<cudaEvent> e = device_.CreateEvent();
    if (e.ok()) events_.push_back(*e);
    return e;
  }

 private:
  Device& device_;
  std::vector<cudaEvent> events_;
};

// kTransfersOnly: the attention and accumulator kernels are not launched; the copy kernels
// that pack and unpack messages are (they are part of moving the data).
class SkippedKernels : public DeviceKernels {
 public:
  explicit SkippedKernels(const DeviceKernels* real) : real_(real) {}
  absl::Status Forward(const hsap_dev::FwdParams&, cudaStream) const override { return {}; }
  absl::Status Backward(const hsap_dev::BwdParams&, cudaStream) const override { return {}; }
  absl::Status Delta(const hsap_dev::DeltaParams&, cudaStream) const override { return {}; }
  absl::Status Init(const hsap_dev::InitParams&, cudaStream) const override { return {}; }
  absl::Status Convert(const hsap_dev::ConvertParams&, cudaStream) const override { return {}; }
  absl::Status Accumulate(const hsap_dev::AccumulateParams&, cudaStream) const override {
    return {};
  }
  absl::Status CopyChunks(const hsap_dev::ChunksParams& p, cudaStream s) const override {
    return real_->CopyChunks(p, s);
  }
  absl::Status AddChunks(const hsap_dev::ChunksParams& p, cudaStream s) const override {
    return real_->AddChunks(p, s);
  }

 private:
  const DeviceKernels* real_;
};

// kComputeOnly: stages that complete at once without moving anything.
class SkippedTransport : public Transport {
 public:
  explicit SkippedTransport(const Transport& inner) : rank_(inner.rank()), size_(inner.size()) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  absl::StatusOr<std::unique_ptr<Pending>> Start(absl::Span<const SendOp>, absl::Span<const RecvOp>,
                                                 std::string) override {
    return std::unique_ptr<Pending>(new Done());
  }
  void Abort(absl::string_view) override {}
  bool aborted() const override { return false; }
  TrafficCounters counters() const override { return {}; }
  void ResetCounters() override {}

 private:
  struct Done : Pending {
    absl::Status Wait() override { return absl::OkStatus(); }
  };
  int rank_, size_;
};

}  // namespace hsap::cuda

#endif  // HSAP_LIB_CUDA_EXEC_UTIL_H_
