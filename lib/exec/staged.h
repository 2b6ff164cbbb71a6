// The pieces the executors share (lib/exec/executor.cc for the sequence-aware ring,
// lib/exec/hierarchical_executor.cc for the sub-rings of a plan): the double-buffered stage
// loop and the final rounding of fp32 accumulators to the storage dtype.
#ifndef HSAP_LIB_EXEC_STAGED_H_
#define HSAP_LIB_EXEC_STAGED_H_

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
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

// The name of a stage in error messages: "forward step 3 (kv from rank 1, to rank 5)".
std::string StageName(const char* pass, const Stage& st, const char* what);

// Rounds fp32 values to `dtype` into `to` (from.size() elements).
void StoreRows(DType dtype, const std::vector<float>& from, void* to);

}  // namespace hsap

#endif  // HSAP_LIB_EXEC_STAGED_H_
