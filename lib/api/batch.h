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

// What a batch being created runs on, chosen once here and prepared now (at creation, not
// in the first forward call) unless `local` already holds an error: on a host communicator
// the host runners with the batch's host kernels (`kernels`, JIT-compiled now), on a CUDA
// one the GPU runners with its CUDA kernels compiled and loaded (the fused forward only for
// batches without a plan). A failure is stored in `local`, and runners over the hand-written
// kernels stand in: the rank still takes part in the collective creation, so that its peers
// fail promptly too.
struct BatchBackend {
  std::shared_ptr<const KernelSet> kernels;  // host communicators
  std::unique_ptr<RunnerFactory> runners;
};
BatchBackend BackendForCreate(const hsapComm_st& comm, const BatchOptions& options,
                              const Layout& layout, bool planned, absl::Status& local);

// The options of an hsapBatchConfig_t (header, dtype and head counts checked), or
// InvalidArgument naming the field; shared by hsapBatchCreate and hsapBatchCreateWithPlan.
absl::StatusOr<BatchOptions> OptionsFromConfig(const hsapBatchConfig_t* config);

// The partition behind a handle, or InvalidArgument for a null one (partition.cc).
absl::StatusOr<const Partition*> PartitionFromHandle(hsapPartition_t partition);

// The handle of a created batch on `comm`; it owns the batch, keeps its kernels alive and
// counts in comm's live batches until it is destroyed.
hsapBatch_st* NewBatchHandle(std::unique_ptr<Batch> batch, std::shared_ptr<const KernelSet> kernels,
                             hsapComm_st& comm);

}  // namespace hsap

#endif  // HSAP_LIB_API_BATCH_H_
