// Pieces the GPU executors share (gpu_executor.cc for the sequence-aware ring,
// gpu_hier_executor.cc for plans): per-call events, and the stand-ins the measurement
// modes (GpuExecMode) run with.
#ifndef HSAP_LIB_CUDA_EXEC_EXEC_UTIL_H_
#define HSAP_LIB_CUDA_EXEC_EXEC_UTIL_H_

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "attention/worklist.h"
#include "lib/comm/transport.h"
#include "lib/cuda/runtime/buffer_pool.h"
#include "lib/cuda/runtime/device.h"

namespace hsap::cuda {

// The work lists of a schedule (local work, then each stage's) in device memory.
class DeviceWorkLists {
 public:
  struct List {
    const hsap_dev::QueryBlock* blocks = nullptr;
    const hsap_dev::KeySegment* segments = nullptr;
    int num_blocks = 0;
  };

  // Copies the lists with one allocation; blocks the host until the copy is done.
  static absl::StatusOr<std::unique_ptr<DeviceWorkLists>> Upload(Device& device,
                                                                 const Schedule& schedule,
                                                                 cudaStream stream);
  const List& local() const { return lists_[0]; }
  const List& stage(size_t i) const { return lists_[i + 1]; }

 private:
  DeviceBuffer memory_;
  std::vector<List> lists_;
};

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
  absl::Status MergeEntries(const hsap_dev::EntryMergeParams&, cudaStream) const override {
    return {};
  }
  absl::Status GatherStats(const hsap_dev::StatsGatherParams&, cudaStream) const override {
    return {};
  }
  absl::Status AddEntries(const hsap_dev::EntryAddParams&, cudaStream) const override { return {}; }

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

// Consecutive regions of the pool, each aligned to kPoolAlignment; with a null base only
// the sizes add up (for sizing the pool).
class PoolCursor {
 public:
  explicit PoolCursor(void* base) : base_(static_cast<char*>(base)) {}
  char* Take(size_t bytes) {
    char* p = base_ == nullptr ? nullptr : base_ + used_;
    used_ += AlignPool(bytes);
    return p;
  }
  size_t used() const { return used_; }

 private:
  char* base_;
  size_t used_ = 0;
};

// Arrays gathered into one host image and uploaded with one allocation and one copy (the
// per-batch data: work lists, kv-head maps, copy lists).
class HostImage {
 public:
  // Appends `v` (aligned to kPoolAlignment); returns its byte offset in the image.
  template <typename T>
  size_t Add(const std::vector<T>& v) {
    const size_t at = AlignPool(bytes_.size());
    bytes_.resize(at + v.size() * sizeof(T));
    if (!v.empty()) std::memcpy(bytes_.data() + at, v.data(), v.size() * sizeof(T));
    return at;
  }
  // A work list's blocks and segments.
  struct WorkListAt {
    size_t blocks = 0, segments = 0;
    int num_blocks = 0;
  };
  WorkListAt Add(const WorkList& w) {
    WorkListAt at;
    at.blocks = Add(w.blocks);
    at.segments = Add(w.segments);
    at.num_blocks = static_cast<int>(w.blocks.size());
    return at;
  }
  static DeviceWorkLists::List At(const char* base, const WorkListAt& at);

  // The image in device memory; blocks the host until the copy is done.
  absl::StatusOr<DeviceBuffer> Upload(Device& device, cudaStream stream,
                                      absl::string_view what) const;

 private:
  std::vector<char> bytes_;
};

// The attention kernels over one work list against k/v of k_rows rows; `p` carries the rest
// (queries, accumulators, heads, scale, kv-head map). Nothing to do for an empty list or a
// rank without query heads.
// The query side of an attention launch over `q_rows` query rows with `heads_q` query and
// `heads_kv` K/V heads (kv_head_of_q: null for the GQA ratio, else the rank's map); the key
// side is set per launch by LaunchForward / LaunchBackward.
struct QuerySide {
  int64_t q_rows = 0;
  int heads_q = 0, heads_kv = 0;
  float scale = 0.0f;
  const int* kv_head_of_q = nullptr;
};
hsap_dev::FwdParams ForwardParams(const QuerySide& side, const void* q, float* out, float* lse);
hsap_dev::BwdParams BackwardParams(const QuerySide& side, const void* q, const void* dout,
                                   const float* lse, const float* delta, float* dq);

absl::Status LaunchForward(const DeviceKernels& kernels, hsap_dev::FwdParams p,
                           const DeviceWorkLists::List& list, const void* k, const void* v,
                           int64_t k_rows, cudaStream stream);
// dk/dv: fp32 [k_rows, heads_kv, D], added into.
absl::Status LaunchBackward(const DeviceKernels& kernels, hsap_dev::BwdParams p,
                            const DeviceWorkLists::List& list, const void* k, const void* v,
                            int64_t k_rows, float* dk, float* dv, cudaStream stream);

}  // namespace hsap::cuda

#endif  // HSAP_LIB_CUDA_EXEC_EXEC_UTIL_H_
