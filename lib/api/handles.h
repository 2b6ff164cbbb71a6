// The objects behind the opaque handles of hsap.h, in one place.
//
// Layouts, plans and partitions are immutable after creation (no entry point changes them),
// so the threads of several ranks may share one. A partition handle either owns its
// partition or views a batch's (owned_by_batch). A batch copies what it needs of its layout
// and plan, and keeps its kernels alive; a communicator counts its live batches, so that
// destroying it before them fails instead of leaving them dangling (hsap.h).
#ifndef HSAP_LIB_API_HANDLES_H_
#define HSAP_LIB_API_HANDLES_H_

#include <atomic>
#include <memory>

#include "attention/kernel.h"
#include "attention/layout.h"
#include "hsap/hsap.h"
#include "lib/comm/communicator.h"
#include "lib/exec/batch.h"
#include "lib/sched/partition.h"
#include "lib/sched/plan.h"

namespace hsap::cuda {
class GpuComm;
}  // namespace hsap::cuda

struct hsapLayout_st {
  const hsap::Layout layout;  // immutable after creation: threads may share the handle
};

struct hsapComm_st {
  std::unique_ptr<hsap::Communicator> comm;
  // The GPU side of a CUDA communicator (device, compute stream, pool); null for the host
  // backend.
  std::shared_ptr<hsap::cuda::GpuComm> gpu;
  // Batches created on this communicator and not destroyed yet (they refer to it).
  std::atomic<int> live_batches{0};
};

struct hsapPlan_st {
  const hsap::Plan plan;  // validated on creation, immutable afterwards
};

struct hsapPartition_st {
  std::shared_ptr<const hsap::Partition> partition;
  // A batch's own partition (hsapBatchGetPartition): hsapPartitionDestroy refuses it.
  bool owned_by_batch = false;
};

struct hsapBatch_st {
  ~hsapBatch_st() {
    batch.reset();  // before the kernels and the communicator's count: it refers to both
    if (comm != nullptr) comm->live_batches.fetch_sub(1);
  }

  // The kernels the batch runs (declared first: the batch refers to them, so they must be
  // destroyed after it).
  std::shared_ptr<const hsap::KernelSet> kernels;
  std::unique_ptr<hsap::Batch> batch;
  hsapPartition_st partition;
  // The communicator the batch runs on; its live_batches counts this batch.
  hsapComm_st* comm = nullptr;
};

#endif  // HSAP_LIB_API_HANDLES_H_
