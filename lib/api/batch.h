// Batch creation pieces shared by the batch entry points (with and without a plan).
#ifndef HSAP_LIB_API_BATCH_H_
#define HSAP_LIB_API_BATCH_H_

#include <memory>

#include "absl/status/statusor.h"
#include "attention/kernel.h"
#include "attention/layout.h"
#include "lib/api/checks.h"
#include "lib/api/handles.h"
#include "lib/exec/batch.h"
#include "lib/sched/partition.h"

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

// The handle of a created batch on `comm`; it owns the batch, keeps its kernels alive and
// counts in comm's live batches until it is destroyed.
hsapBatch_st* NewBatchHandle(std::unique_ptr<Batch> batch, std::shared_ptr<const KernelSet> kernels,
                             hsapComm_st& comm);

}  // namespace hsap

#endif  // HSAP_LIB_API_BATCH_H_
