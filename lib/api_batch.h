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

// What a batch being created runs on, prepared now (at creation, not in the first forward
// call) unless `local` already holds an error: on a host communicator its host kernels
// (`kernels`), on a CUDA one its CUDA kernels compiled and loaded, wrapped in the
// BatchDevice that runs the batch on the communicator's GPU (`device`). A failure is stored
// in `local` and both stay null: the rank still takes part in the collective creation, so
// that its peers fail promptly too, with kernels() standing in.
struct BatchBackend {
  std::shared_ptr<const KernelSet> kernels;
  std::unique_ptr<BatchDevice> device;
  // The kernels to hand to Batch::Create (a placeholder when there are none).
  const KernelSet& kernel_set() const;
};
BatchBackend BackendForCreate(const hsapComm_st& comm, const BatchOptions& options,
                              const Layout& layout, absl::Status& local);

// The handle of a created batch; it owns the batch and keeps its kernels alive.
hsapBatch_st* NewBatchHandle(std::unique_ptr<Batch> batch,
                             std::shared_ptr<const KernelSet> kernels);

}  // namespace hsap

#endif  // HSAP_LIB_API_BATCH_H_
