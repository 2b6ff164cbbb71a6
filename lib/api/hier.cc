// Entry points of the C ABI for batches under a plan (hierarchical head x context
// parallelism). The batch object is hsap-core's (lib/exec/batch.h), created through
// Batch::CreateWithPlan; forward and backward go through hsapAttentionForward/Backward.
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "hsap/hsap.h"
#include "lib/api/batch.h"
#include "lib/api/checks.h"
#include "lib/api/handles.h"
#include "lib/api/result.h"
#include "lib/exec/batch.h"

namespace hsap {
namespace {

// The arguments other than the communicator, checked in order; the verdict travels with
// this rank's part of the creation agreement so that its peers fail at once.
absl::Status CheckCreateArgs(hsapBatch_t* batch, hsapLayout_t layout, hsapPlan_t plan,
                             const hsapBatchConfig_t* config, BatchOptions& options) {
  HSAP_RETURN_IF_ERROR(CheckNotNull(batch, "batch"));
  if (layout == nullptr) {
    return absl::InvalidArgumentError("layout is null; create one with hsapLayoutCreate");
  }
  if (plan == nullptr) {
    return absl::InvalidArgumentError(
        "plan is null; create one with hsapPlanCreate or hsapPlanCreateFromJson");
  }
  HSAP_ASSIGN_OR_RETURN(options, OptionsFromConfig(config));
  return absl::OkStatus();
}

}  // namespace
}  // namespace hsap

extern "C" {

hsapResult_t hsapBatchCreateWithPlan(hsapBatch_t* batch, hsapComm_t comm, hsapLayout_t layout,
                                     hsapPlan_t plan, const hsapBatchConfig_t* config) {
  return hsap::RunApi("hsapBatchCreateWithPlan", [&]() -> absl::Status {
    if (comm == nullptr || comm->comm == nullptr) {
      return absl::InvalidArgumentError("comm is null; create communicators with hsapCommInitAll");
    }
    hsap::BatchOptions options;
    absl::Status local = hsap::CheckCreateArgs(batch, layout, plan, config, options);
    static const hsap::Layout* const kNoLayout = new hsap::Layout();
    static const hsap::Plan* const kNoPlan = new hsap::Plan();
    const hsap::Layout& l = layout != nullptr ? layout->layout : *kNoLayout;
    const hsap::Plan& p = plan != nullptr ? plan->plan : *kNoPlan;
    hsap::BatchBackend backend = hsap::BackendForCreate(*comm, options, l, /*planned=*/true, local);
    HSAP_ASSIGN_OR_RETURN(
        std::unique_ptr<hsap::Batch> b,
        hsap::Batch::CreateWithPlan(*comm->comm, l, p, options, *backend.runners, local));
    *batch = hsap::NewBatchHandle(std::move(b), std::move(backend.kernels), *comm);
    return absl::OkStatus();
  });
}

hsapResult_t hsapBatchGetTrafficDetail(hsapBatch_t batch, hsapTrafficDetail_t* traffic) {
  return hsap::RunApi("hsapBatchGetTrafficDetail", [&]() -> absl::Status {
    if (batch == nullptr || batch->batch == nullptr) {
      return absl::InvalidArgumentError("batch is null; create one with hsapBatchCreateWithPlan");
    }
    HSAP_RETURN_IF_ERROR(hsap::CheckNotNull(traffic, "traffic"));
    const hsap::BatchTraffic& t = batch->batch->traffic();
    traffic->forwardAllToAllBytesSent = t.forward.a2a_sent;
    traffic->forwardAllToAllBytesReceived = t.forward.a2a_received;
    traffic->forwardRingBytesSent = t.forward.ring_sent;
    traffic->forwardRingBytesReceived = t.forward.ring_received;
    traffic->backwardAllToAllBytesSent = t.backward.a2a_sent;
    traffic->backwardAllToAllBytesReceived = t.backward.a2a_received;
    traffic->backwardRingBytesSent = t.backward.ring_sent;
    traffic->backwardRingBytesReceived = t.backward.ring_received;
    return absl::OkStatus();
  });
}

}  // extern "C"
