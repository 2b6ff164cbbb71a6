// The stage loops every executor runs (host and GPU, ring and plan batches): the forward's
// double-buffered K/V stages and the backward's stages with the one-step-lagged return of
// gradient partials, in the order of lib/exec/protocol.h; and the final rounding of fp32
// accumulators to the storage dtype.
#ifndef HSAP_LIB_EXEC_STAGED_H_
#define HSAP_LIB_EXEC_STAGED_H_

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "attention/dtype.h"
#include "lib/comm/transport.h"
#include "lib/sched/schedule.h"

namespace hsap {

// Posts the transfers of stage i (into buffer slot i % 2) and returns the pending stage.
using PostStage = std::function<absl::StatusOr<std::unique_ptr<Transport::Pending>>(size_t)>;

// Runs `num_stages` stages with one stage of look-ahead: posts stage 0, runs `local` (the
// work that needs no transfer) while it is in flight, then for each stage i posts stage
// i + 1, waits for stage i and runs on_stage(i). So the transfers of stage i + 1 overlap
// the compute of stage i, and at most two stages' buffers are live. Stops at the first
// error (a pending stage is waited for by its destructor).
absl::Status RunStaged(size_t num_stages, const PostStage& post,
                       const std::function<absl::Status()>& local,
                       const std::function<absl::Status(size_t)>& on_stage);

// The hooks of one backward (RunBackwardStages). Stage i uses buffer slot i % 2.
struct BackwardStages {
  // Posts stage i's K/V.
  PostStage post_kv;
  // The work that needs no transfer; runs once the first group is posted.
  std::function<absl::Status()> local;
  // Stage i's K/V arrived: computes the partial gradients of the rows received.
  std::function<absl::Status(size_t)> compute;
  // Posts stage i's gradient group: those partials back to their owner, and the partials
  // of this rank's rows from the rank that used them.
  PostStage post_grad;
  // Stage i's gradient group completed: adds the returned partials (called in stage order).
  std::function<absl::Status(size_t)> add_returned;
};

// Runs a backward over stages with steps `steps` (increasing), posting in
// protocol::BackwardPostingOrder: at stage i's gradient group it waits for stage i's K/V,
// computes, posts the gradients, then completes stage i - 1's gradient group and adds its
// partials, so the gradients of each stage return one step later while the next stage's
// K/V is in flight, and partials are added in stage order (bitwise reproducible with
// deterministic kernels). Stops at the first error (pending groups are waited for by their
// destructors).
absl::Status RunBackwardStages(absl::Span<const int> steps, const BackwardStages& hooks);
// A relayed schedule's backward (lib/sched/schedule.h): the direct stages [0, fan), then the
// fan-out stages [fan, steps.size()) as a second run of their own (no local step), with the
// hooks called by stage index throughout.
absl::Status RunBackwardStagesThenFanOuts(absl::Span<const int> steps, size_t fan,
                                          const BackwardStages& hooks);

// The name of a stage in error messages: "forward step 3 (kv from rank 1, to rank 5)".
std::string StageName(const char* pass, const Stage& st, const char* what);

// Rounds fp32 values to `dtype` into `to` (from.size() elements).
void StoreRows(DType dtype, const std::vector<float>& from, void* to);

}  // namespace hsap

#endif  // HSAP_LIB_EXEC_STAGED_H_
