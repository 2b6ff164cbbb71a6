// The objects behind the partition and batch handles of hsap.h.
#ifndef HSAP_LIB_API_BATCH_H_
#define HSAP_LIB_API_BATCH_H_

#include <memory>

#include "absl/status/statusor.h"
#include "attention/kernel.h"
#include "attention/layout.h"
#include "lib/api_util.h"
#include "lib/batch.h"
#include "lib/partition.h"

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

namespace hsap {

// The host kernels a batch with these options runs over `layout`, compiled now (batch
// creation): the JIT set, or the hand-written one where the JIT cannot run
// (jit::HostKernelsForBatch).
absl::StatusOr<std::shared_ptr<const KernelSet>> HostKernelsForOptions(const BatchOptions& options,
                                                                       const Layout& layout);

// The kernels of a batch being created, compiled now (at creation, not in the first forward
// call) unless `local` already holds an error. A compile failure is stored in `local` and
// null is returned: the rank still takes part in the collective creation, so that its peers
// fail promptly too, with KernelsOrPlaceholder() standing in for the kernels.
std::shared_ptr<const KernelSet> KernelsForCreate(const BatchOptions& options, const Layout& layout,
                                                  absl::Status& local);
const KernelSet& KernelsOrPlaceholder(const std::shared_ptr<const KernelSet>& kernels);

// The same for a batch on a CUDA communicator: its CUDA kernels compiled and loaded now,
// wrapped in the BatchDevice that runs the batch on `gpu`; null (with `local` set) on
// failure.
std::unique_ptr<BatchDevice> GpuBatchDeviceForCreate(std::shared_ptr<cuda::GpuComm> gpu,
                                                     const BatchOptions& options,
                                                     const Layout& layout, absl::Status& local);

// The handle of a created batch; it owns the batch and keeps its kernels alive.
hsapBatch_st* NewBatchHandle(std::unique_ptr<Batch> batch,
                             std::shared_ptr<const KernelSet> kernels);

}  // namespace hsap

#endif  // HSAP_LIB_API_BATCH_H_
