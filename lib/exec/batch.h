// A batch: distributed attention over one packed row on one rank of a communicator.
//
// Creation is collective: every rank partitions the row (deterministically, so all get the
// same partition) and builds its own schedule, after an AllGather of a fingerprint of its
// inputs (layout, weights, dtype, heads, head dim, scale) has shown that all ranks agree; a
// rank whose inputs differ makes every rank fail with FailedPrecondition naming it ("rank
// 2's layout differs from rank 0's"). Runners that prepare locally (the host's,
// RunnerFactory::PreparesLocally) are made before that AllGather, whose record then says
// whether they were, so creation is one collective round; others (the GPU's) are made after
// it and agreed on in a second round. CreateManyWithPartition makes several batches over one
// partition with the rounds of one.
//
// Forward and Backward are collective too. Each call first exchanges (call number, kind,
// batch, argument check) with every rank, so that mismatched calls (one rank calling
// backward while another calls forward, a rank on another batch, a rank whose arguments
// were rejected) are reported on every rank instead of computed; a rank that never calls
// makes the others fail with DeadlineExceeded once the communicator's timeout passes.
#ifndef HSAP_LIB_EXEC_BATCH_H_
#define HSAP_LIB_EXEC_BATCH_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "attention/dtype.h"
#include "attention/kernel.h"
#include "attention/layout.h"
#include "lib/comm/communicator.h"
#include "lib/exec/runner.h"
#include "lib/sched/hierarchy.h"
#include "lib/sched/partition.h"
#include "lib/sched/plan.h"
#include "lib/sched/schedule.h"

namespace hsap {

struct BatchOptions {
  DType dtype = DType::kBF16;
  int heads_q = 0;
  int heads_kv = 0;
  int head_dim = 0;
  float scale = 0.0f;  // 0: 1/sqrt(head_dim)
};

// The head geometry of a batch (scale 0 resolved to 1/sqrt(head_dim)), or InvalidArgument
// naming the field at fault.
absl::StatusOr<AttentionDims> DimsFromOptions(const BatchOptions& options);

struct BatchTraffic {
  CallTraffic forward;   // of the last forward
  CallTraffic backward;  // of the last backward
};

class Batch {
 public:
  // `comm` must outlive the batch. weights: one per rank or empty (equal). `local_check`:
  // the caller's verdict on its other arguments; when it is not OK the rank still takes part
  // in the agreement (so that its peers fail at once rather than time out) and returns it.
  // `runners` makes what the batch runs (runner.h); a second agreement after it follows, so
  // a rank that could not prepare (e.g. its GPU cannot hold the batch) makes every rank fail.
  static absl::StatusOr<std::unique_ptr<Batch>> Create(Communicator& comm, const Layout& layout,
                                                       absl::Span<const double> weights,
                                                       const BatchOptions& options,
                                                       RunnerFactory& runners,
                                                       absl::Status local_check = absl::OkStatus());
  // On the host executors with `kernels` (which must outlive the batch).
  static absl::StatusOr<std::unique_ptr<Batch>> Create(
      Communicator& comm, const Layout& layout, absl::Span<const double> weights,
      const BatchOptions& options, const KernelSet& kernels = HandWrittenKernels(),
      absl::Status local_check = absl::OkStatus());

  // A batch over a given partition (e.g. another batch's, or one made for several masks by
  // Partition::Create(layouts, ...)), so that the layers of a model with different masks
  // over one row (full, sliding-window, ...) share one token placement. The partition must
  // be for comm.size() ranks and layout.num_tokens() tokens; ranks agree that they pass
  // equal partitions (Partition::Fingerprint) besides the layout and options.
  static absl::StatusOr<std::unique_ptr<Batch>> CreateWithPartition(
      Communicator& comm, const Layout& layout, std::shared_ptr<const Partition> partition,
      const BatchOptions& options, RunnerFactory& runners,
      absl::Status local_check = absl::OkStatus());
  static absl::StatusOr<std::unique_ptr<Batch>> CreateWithPartition(
      Communicator& comm, const Layout& layout, std::shared_ptr<const Partition> partition,
      const BatchOptions& options, const KernelSet& kernels = HandWrittenKernels(),
      absl::Status local_check = absl::OkStatus());

  // Several batches over one partition (a model's masks and dtypes over one row: a step's
  // key) in the collective rounds of one batch: the ranks agree once on the partition, the
  // number of batches and every batch's layout and options (in order), with the checks of
  // CreateWithPartition (a rank whose inputs differ makes every rank fail, naming the field);
  // layouts[i], options[i] and runners[i] make batch i (all three the same length, at least
  // 1). With one batch it is CreateWithPartition (ranks may mix the two).
  static absl::StatusOr<std::vector<std::unique_ptr<Batch>>> CreateManyWithPartition(
      Communicator& comm, absl::Span<const Layout* const> layouts,
      std::shared_ptr<const Partition> partition, absl::Span<const BatchOptions> options,
      absl::Span<RunnerFactory* const> runners, absl::Status local_check = absl::OkStatus());

  // A batch under a plan (hierarchy.h): head-parallel groups, uneven shards and heads. The
  // plan's num_ranks must be the communicator's size; heads_q and heads_kv must match the
  // options. Ranks agree on the layout, the plan and the options as above. Tensors are this
  // rank's shard: local_tokens() rows, all heads.
  static absl::StatusOr<std::unique_ptr<Batch>> CreateWithPlan(
      Communicator& comm, const Layout& layout, const Plan& plan, const BatchOptions& options,
      RunnerFactory& runners, absl::Status local_check = absl::OkStatus());
  static absl::StatusOr<std::unique_ptr<Batch>> CreateWithPlan(
      Communicator& comm, const Layout& layout, const Plan& plan, const BatchOptions& options,
      const KernelSet& kernels = HandWrittenKernels(), absl::Status local_check = absl::OkStatus());

  // Tensors as in executor.h, sized by local_tokens(). local_check as above. `stream`: the
  // caller's CUDA stream of this call for a GPU runner (BatchRunner::set_call_stream; the
  // caller checked that it belongs to the runner's device), null for the communicator's.
  absl::Status Forward(const void* q, const void* k, const void* v, void* out, float* lse,
                       absl::Status local_check = absl::OkStatus(), void* stream = nullptr);
  absl::Status Backward(const void* dout, const void* q, const void* k, const void* v,
                        const void* out, const float* lse, void* dq, void* dk, void* dv,
                        absl::Status local_check = absl::OkStatus(), void* stream = nullptr);

  const std::shared_ptr<const Partition>& partition() const { return partition_; }
  // This rank's schedule; null for a batch under a plan.
  const Schedule* schedule() const { return schedule_.get(); }
  // This rank's part of the hierarchy; null for a batch without a plan.
  const RankHierarchy* hierarchy() const { return hierarchy_.get(); }
  int64_t local_tokens() const {
    return hierarchy_ != nullptr ? hierarchy_->shard_tokens : schedule_->local_rows;
  }
  // What the batch runs (host or GPU executor, chosen at creation).
  BatchRunner* runner() const { return runner_.get(); }
  const AttentionDims& dims() const { return dims_; }
  DType dtype() const { return options_.dtype; }
  const BatchTraffic& traffic() const { return traffic_; }
  // A call's bytes (traffic().forward or .backward) by link class: as the runner counted
  // them, or, with every rank on one node, all intra-node. Unimplemented where the runner
  // does not classify its messages and the ranks span several nodes (GPU ring batches).
  absl::StatusOr<LinkTraffic> Links(const CallTraffic& call) const;
  int rank() const { return comm_->rank(); }

 private:
  Batch() = default;
  // The part both creators share: fields set, dims derived from the options unless `local`
  // already holds an error (a failure is stored in `local`).
  static std::unique_ptr<Batch> NewBatch(Communicator& comm, const BatchOptions& options,
                                         absl::Status& local);
  // After the factory made (or failed to make) this rank's runner: every rank learns whether
  // every rank has one; keeps it.
  absl::Status AgreeOnRunner(absl::StatusOr<std::unique_ptr<BatchRunner>> runner);
  // This rank's schedule over partition_ (kept) and the runner of it.
  absl::StatusOr<std::unique_ptr<BatchRunner>> Prepare(const Layout& layout,
                                                       RunnerFactory& runners);
  // The per-call agreement; kind: 1 forward, 2 backward.
  absl::Status AgreeOnCall(uint64_t kind, const absl::Status& local_check);
  // The creation agreement; `inputs` hashes what must be equal beyond layout and options
  // (the weights, the plan or the partition, as `mode` says: see batch.cc).
  absl::Status AgreeOnCreate(const Layout& layout, uint64_t inputs, const absl::Status& local,
                             uint64_t mode);
  // The part of Create and CreateWithPartition after the partition is known (null when
  // `local` holds an error): agreement, schedule, runner.
  static absl::StatusOr<std::unique_ptr<Batch>> CreateOverPartition(
      Communicator& comm, const Layout& layout, std::shared_ptr<const Partition> partition,
      uint64_t mode, uint64_t inputs, const BatchOptions& options, RunnerFactory& runners,
      absl::Status local);

  Communicator* comm_ = nullptr;
  BatchOptions options_;
  AttentionDims dims_;
  std::shared_ptr<const Partition> partition_;
  std::unique_ptr<const Schedule> schedule_;        // a batch without a plan
  std::unique_ptr<const RankHierarchy> hierarchy_;  // a batch under a plan
  std::unique_ptr<BatchRunner> runner_;
  uint64_t fingerprint_ = 0;
  uint64_t calls_ = 0;
  BatchTraffic traffic_;
};

}  // namespace hsap

#endif  // HSAP_LIB_EXEC_BATCH_H_
