// The objects behind the opaque handles of hsap.h, in one place.
//
// Layouts and plans are immutable after creation, so the threads of several ranks may share
// one. A partition handle either owns its partition or views a batch's (owned_by_batch).
// A batch keeps its kernels alive; communicators outlive their batches (hsap.h).
#ifndef HSAP_LIB_API_HANDLES_H_
#define HSAP_LIB_API_HANDLES_H_

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
  hsap::Layout layout;  // immutable after creation
};

struct hsapComm_st {
  std::unique_ptr<hsap::Communicator> comm;
  // The GPU side of a CUDA communicator (device, compute stream, pool); null for the host
  // backend.
  std::shared_ptr<hsap::cuda::GpuComm> gpu;
};

struct hsapPlan_st {
  hsap::Plan plan;  // validated on creation, immutable afterwards
};

struct hsapPartition_st {
  std::shared_ptr<const hsap::Partition> partition;
  // A batch's own partition (hsapBatchGetPartition): hsapPartitionDestroy refuses it.
  bool owned_by_batch = false;
};

struct hsapBatch_st {
  // The kernels the batch runs (declared first: the batch refers to them, so they must be
  // destroyed after it).
  std::shared_ptr<const hsap::KernelSet> kernels;
  std::unique_ptr<hsap::Batch> batch;
  hsapPartition_st partition;
};

#endif  // HSAP_LIB_API_HANDLES_H_
