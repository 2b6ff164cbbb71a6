// What a batch runs, chosen once when the batch is created.
//
// A batch (batch.h) owns one BatchRunner: the host ring executor (executor.h), the host
// plan executor (hierarchical_executor.h), or their GPU counterparts
// (lib/cuda/exec/gpu_batch.h). The runner holds everything a call needs that does not
// change between calls (the schedule or hierarchy it runs, prepared device programs, the
// pool layout), so a call only runs it. A RunnerFactory makes the runner of a batch without
// a plan (from its schedule) or under a plan (from this rank's part of the hierarchy).
#ifndef HSAP_LIB_EXEC_RUNNER_H_
#define HSAP_LIB_EXEC_RUNNER_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attention/dtype.h"
#include "attention/kernel.h"
#include "lib/comm/communicator.h"
#include "lib/sched/hierarchy.h"
#include "lib/sched/schedule.h"

namespace hsap {

// Payload bytes of one call by link class (the communicator's topology): messages between
// ranks of one node and of different nodes.
struct LinkTraffic {
  uint64_t intra_node_sent = 0, intra_node_received = 0;
  uint64_t inter_node_sent = 0, inter_node_received = 0;
  friend bool operator==(const LinkTraffic&, const LinkTraffic&) = default;
};

// Payload bytes of one call: inside the head-parallel group (all-to-all) and along the
// rings. A batch without a plan moves everything along its ring. `links` holds the same
// bytes by link class when the runner counted them (links_counted: the host runners and
// the GPU plan runner).
struct CallTraffic : HierTraffic {
  bool links_counted = false;
  LinkTraffic links;
};

class BatchRunner {
 public:
  virtual ~BatchRunner() = default;
  // Tensors as in executor.h (ring) and hierarchical_executor.h (plan): this rank's shard,
  // in host memory for host runners and device memory for GPU runners. `call_id` is the
  // batch's call number (lib/exec/protocol.h tags); `traffic` receives the call's bytes.
  virtual absl::Status Forward(uint64_t call_id, const void* q, const void* k, const void* v,
                               void* out, float* lse, CallTraffic& traffic) = 0;
  virtual absl::Status Backward(uint64_t call_id, const void* dout, const void* q, const void* k,
                                const void* v, const void* out, const float* lse, void* dq,
                                void* dk, void* dv, CallTraffic& traffic) = 0;

  // The CUDA stream (a cudaStream_t) the next Forward / Backward runs on: a caller's, or
  // null for the communicator's own (lib/cuda/exec/gpu_batch.h). Batch sets it before every
  // call; host runners ignore it.
  void set_call_stream(void* stream) { call_stream_ = stream; }
  void* call_stream() const { return call_stream_; }

 private:
  void* call_stream_ = nullptr;
};

class RunnerFactory {
 public:
  virtual ~RunnerFactory() = default;
  // Whether the runners made run relayed K/V delivery (schedule.h, and the fan-outs of
  // hierarchy.h for plans) on a communicator whose ranks span several nodes; when false,
  // batches get the direct schedule / hierarchy.
  virtual bool RunsRelays() const { return false; }
  // The same for plan batches alone (the fan-outs of hierarchy.h); by default RunsRelays().
  virtual bool RunsPlanFanOuts() const { return RunsRelays(); }
  // Whether ForSchedule / ForHierarchy run no collective and may run before the ranks agree
  // on the batch (the host runners): batch creation then agrees once, on the inputs and the
  // runners together (batch.h).
  virtual bool PreparesLocally() const { return false; }
  // Query rows per work-list block (BuildWorkList's block_q) of the schedules and hierarchies
  // built for these runners: the kernels' preferred query tile. Any value is correct (every
  // kernel walks a block in chunks of its own tile); this one only sets how full they are.
  virtual int64_t WorkBlockRows() const { return kKernelBlockQ; }
  // Called once on every rank of `comm` after the ranks agreed on the batch (before, when
  // PreparesLocally); `schedule` /
  // `rank` outlive the runner. May run collectives on the communicator (every rank's
  // factory takes part, in the same order, whether or not its own preparation failed).
  virtual absl::StatusOr<std::unique_ptr<BatchRunner>> ForSchedule(Communicator& comm,
                                                                   const Schedule& schedule,
                                                                   const AttentionDims& dims,
                                                                   DType dtype) = 0;
  virtual absl::StatusOr<std::unique_ptr<BatchRunner>> ForHierarchy(Communicator& comm,
                                                                    const RankHierarchy& rank,
                                                                    const AttentionDims& dims,
                                                                    DType dtype) = 0;
};

// The host executors with `kernels` (which must outlive the runners made).
std::unique_ptr<RunnerFactory> HostRunners(const KernelSet& kernels);

}  // namespace hsap

#endif  // HSAP_LIB_EXEC_RUNNER_H_
