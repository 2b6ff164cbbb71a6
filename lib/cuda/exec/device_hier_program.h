// The device side of one rank's hierarchical batch (gpu_hier_executor.h): its exchange
// programs (hier_exchange_programs.h) with their copy lists uploaded to the device, the
// work lists, the kv-head map, and the sizes of the pool regions a forward or a backward
// carves (ForwardRegions, BackwardRegions). Built once per batch.
#ifndef HSAP_LIB_CUDA_EXEC_DEVICE_HIER_PROGRAM_H_
#define HSAP_LIB_CUDA_EXEC_DEVICE_HIER_PROGRAM_H_

#include <cstddef>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "attention/dtype.h"
#include "attention/kernel.h"
#include "lib/cuda/exec/exchange_program.h"
#include "lib/cuda/exec/exec_util.h"
#include "lib/cuda/runtime/device.h"
#include "lib/sched/hierarchy.h"

namespace hsap::cuda {

// The device side of one rank's hierarchical batch: exchange programs (with their copy
// lists uploaded), work lists and the kv-head map.
class DeviceHierProgram {
 public:
  // `dims`: the whole layer's heads, head dim and scale. Blocks the host until the upload
  // is done.
  static absl::StatusOr<std::unique_ptr<DeviceHierProgram>> Build(Device& device,
                                                                  const RankHierarchy& rank,
                                                                  const AttentionDims& dims,
                                                                  DType dtype, cudaStream stream);

  // Pool bytes a forward or a backward needs (the larger).
  size_t pool_bytes() const { return pool_bytes_; }

  // One exchange with its device copy lists.
  struct Exchange {
    ExchangeProgram program;
    hsap_dev::ChunksParams pack{}, unpack{}, self{};  // src/dst filled at run time
  };
  struct Step {
    Exchange kv, grad;  // grad: the fp32 dK/dV partials back (backward)
    // The node fan-out of the step's K/V and, backward, the fan-in of its fp32 partials
    // (leg 0: this rank's partials to its gateways; leg 1 + x: those of fan-out receiver x,
    // added by the gateway in that order). Empty programs when the step has no fan-out.
    Exchange fan_kv;
    std::vector<Exchange> fan_grad;
    // Node stores (hierarchy.h 6.): the store segments sent to keepers and received into
    // this rank's store (posted with `kv`); a keeper's fills of its slot from the store
    // (self copies) and, backward, of the store partial from its step partial; its forwards
    // from the store (sends of the fan-out exchange) and, backward, one fan-in leg per
    // forward adding that receiver's partials into the store partial.
    Exchange store_kv, store_fill, store_fill_grad, store_fan_kv;
    std::vector<Exchange> store_fan_grad;
    // In the step's gradient group, after `grad`: leg 0 a keeper's store sums back to their
    // holders, leg 1 + x the holder's x-th returned sum added into its dK/dV.
    std::vector<Exchange> store_grad;
    DeviceWorkLists::List work;
  };

  const RankHierarchy& rank() const { return *rank_; }
  const AttentionDims& dims() const { return dims_; }
  DType dtype() const { return dtype_; }
  const int* kv_head_of_q() const { return kv_map_; }
  const DeviceWorkLists::List& local_work() const { return local_work_; }
  const std::vector<Step>& steps() const { return steps_; }
  // All-to-all in: q, k, v, dout, (lse, delta); back: out, lse, dq, dk, dv.
  const Exchange& in_q() const { return in_q_; }
  const Exchange& in_k() const { return in_k_; }
  const Exchange& in_v() const { return in_v_; }
  const Exchange& in_dout() const { return in_dout_; }
  const Exchange& in_stats() const { return in_stats_; }
  const Exchange& out_o() const { return out_o_; }
  const Exchange& out_lse() const { return out_lse_; }
  const Exchange& out_dq() const { return out_dq_; }
  const Exchange& out_dk() const { return out_dk_; }
  const Exchange& out_dv() const { return out_dv_; }

  // Sizes of the pool regions (bytes; see gpu_hier_executor.cc for their use).
  struct Sizes {
    size_t gq = 0, gkv = 0, out32 = 0, lse32 = 0, stats = 0, gstats = 0, dq32 = 0, dkv32 = 0,
           sum32 = 0, kv_slot = 0, partial_slot = 0;
    size_t a2a_in_send = 0, a2a_in_recv = 0, a2a_out_send = 0, a2a_out_recv = 0;
    size_t ring_send = 0, ring_recv = 0, grad_send = 0, grad_recv = 0;
    size_t fan_send = 0, fan_recv = 0, fan_grad_send = 0, fan_grad_recv = 0;
    size_t store_kv = 0, store_grad = 0;  // a keeper's node store and its fp32 partials
  };
  const Sizes& sizes() const { return sizes_; }

 private:
  DeviceHierProgram() = default;
  const RankHierarchy* rank_ = nullptr;
  AttentionDims dims_;
  DType dtype_ = DType::kBF16;
  DeviceBuffer memory_;
  const int* kv_map_ = nullptr;
  DeviceWorkLists::List local_work_;
  std::vector<Step> steps_;
  Exchange in_q_, in_k_, in_v_, in_dout_, in_stats_, out_o_, out_lse_, out_dq_, out_dk_, out_dv_;
  Sizes sizes_;
  size_t pool_bytes_ = 0;

  class Builder;  // Build's steps (device_hier_program.cc)
};

namespace hier_internal {

// The pool regions of a forward and of a backward, carved in order from `base` (null: only
// `used` counts); `used` is the bytes they take.
struct ForwardRegions {
  char *gq, *gkv, *out32, *lse32, *gout, *kv[2], *a2a_send, *a2a_recv, *ring_send[2], *ring_recv[2],
      *fan_send, *fan_recv, *store;
  size_t used;
};
ForwardRegions CarveForward(void* base, const DeviceHierProgram::Sizes& z);

struct BackwardRegions {
  char *gq, *gdout, *gkv, *stats, *gstats, *dq32, *dkv32, *gdq, *gdkv, *sum32, *kv[2], *partial[2],
      *a2a_send, *a2a_recv, *ring_send[2], *ring_recv[2], *grad_send[2], *grad_recv[2], *fan_send,
      *fan_recv, *fan_grad_send, *fan_grad_recv, *store, *store32;
  size_t used;
};
BackwardRegions CarveBackward(void* base, const DeviceHierProgram::Sizes& z);

}  // namespace hier_internal
}  // namespace hsap::cuda

#endif  // HSAP_LIB_CUDA_EXEC_DEVICE_HIER_PROGRAM_H_
