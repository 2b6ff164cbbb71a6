// C entry points of the "Planning at start-up" section of hsap.h.
#include <cstddef>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "hsap/hsap.h"
#include "lib/api/checks.h"
#include "lib/api/handles.h"
#include "lib/api/result.h"
#include "lib/comm/topology.h"
#include "lib/cuda/exec/gpu_batch.h"
#include "lib/planner/calibration.h"
#include "lib/planner/cluster.h"
#include "lib/planner/cost_model.h"
#include "lib/planner/planner.h"

namespace hsap {
namespace {

// The planner's workload for a caller's model, each field checked.
absl::StatusOr<Workload> WorkloadFromModel(const hsapPlanModel_t* model) {
  HSAP_RETURN_IF_ERROR(CheckNotNull(model, "model"));
  HSAP_RETURN_IF_ERROR(CheckConfigHeader(*model, "model", offsetof(hsapPlanModel_t, engine),
                                         "HSAP_PLAN_MODEL_INITIALIZER"));
  if (model->seqLen < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("model->seqLen = ", model->seqLen, " must be >= 1"));
  }
  HSAP_RETURN_IF_ERROR(CheckHeadCount(model->numHeadsQ, "model->numHeadsQ"));
  HSAP_RETURN_IF_ERROR(CheckHeadCount(model->numHeadsKV, "model->numHeadsKV"));
  if (model->numHeadsQ % model->numHeadsKV != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("model->numHeadsQ = ", model->numHeadsQ,
                     " must be a multiple of numHeadsKV = ", model->numHeadsKV));
  }
  constexpr int kMaxDim = 1 << 24;
  for (auto [value, name, least] :
       {std::tuple{model->numLayers, "numLayers", 1}, std::tuple{model->headDim, "headDim", 1},
        std::tuple{model->hidden, "hidden", 0}, std::tuple{model->ffnHidden, "ffnHidden", 0},
        std::tuple{model->vocab, "vocab", 0}}) {
    if (value < least || value > kMaxDim) {
      return absl::InvalidArgumentError(
          absl::StrCat("model->", name, " = ", value, " must be in [", least, ", 2^24]"));
    }
  }
  const auto dtype = RawEnum(model->dtype);
  if (dtype != hsapFloat32 && dtype != hsapBFloat16 && dtype != hsapFloat16) {
    return absl::InvalidArgumentError(absl::StrCat("model->dtype = ", dtype, " is not a dtype"));
  }
  if (model->causal != 0 && model->causal != 1) {
    return absl::InvalidArgumentError("model->causal must be 0 or 1");
  }
  if (model->activationCheckpointing != 0 && model->activationCheckpointing != 1) {
    return absl::InvalidArgumentError("model->activationCheckpointing must be 0 or 1");
  }
  if (!(model->memoryMargin >= 0 && model->memoryMargin < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("model->memoryMargin = ", model->memoryMargin, " must be in [0, 1)"));
  }
  Workload w;
  ModelSpec& m = w.model;
  m.name = "hsapPlanModel_t";
  m.layers = model->numLayers;
  m.heads_q = model->numHeadsQ;
  m.heads_kv = model->numHeadsKV;
  m.head_dim = model->headDim;
  m.hidden = model->hidden > 0 ? model->hidden : model->numHeadsQ * model->headDim;
  m.ffn_hidden = model->ffnHidden > 0 ? model->ffnHidden : 4 * m.hidden;
  m.vocab = model->vocab > 0 ? model->vocab : 32000;
  m.dtype_bytes = dtype == hsapFloat32 ? 4 : 2;
  w.seq_len = model->seqLen;
  w.causal = model->causal == 1;
  w.budget.margin_fraction = model->memoryMargin;
  w.budget.activation_checkpointing = model->activationCheckpointing == 1;
  return w;
}

// The fields of hsapPlanModel_t that came after activationCheckpointing: a caller built
// against an older hsap.h passes a smaller struct without them.
bool HasPricingFields(const hsapPlanModel_t* model) {
  return model->size >= offsetof(hsapPlanModel_t, calibrationJson) + sizeof(const char*);
}

// Prices `cluster` as model->engine and model->calibrationJson say (calibration.h).
absl::Status PriceCluster(const hsapPlanModel_t* model, Cluster* cluster) {
  const char* engine_name = HasPricingFields(model) ? model->engine : nullptr;
  const char* text = HasPricingFields(model) ? model->calibrationJson : nullptr;
  const std::string name = engine_name == nullptr ? "auto" : engine_name;
  if (name == "none") {
    if (text != nullptr) {
      return absl::InvalidArgumentError(
          "model->engine = \"none\" prices without calibration: model->calibrationJson must be "
          "NULL");
    }
    return absl::OkStatus();
  }
  absl::StatusOr<Engine> engine = ParseEngine(name);
  if (!engine.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("model->engine: ", engine.status().message(), ", or none"));
  }
  Calibration calibration = BuiltinCalibration();
  if (text != nullptr) {
    absl::StatusOr<Calibration> file = CalibrationFromJsonText(text);
    if (!file.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("model->calibrationJson: ", file.status().message()));
    }
    calibration = OverlayCalibration(calibration, *file);
  }
  return ApplyCalibration(calibration, *engine, cluster).status();
}

absl::Status PlanFor(Cluster cluster, const hsapPlanModel_t* model, hsapPlan_t* plan) {
  HSAP_ASSIGN_OR_RETURN(Workload workload, WorkloadFromModel(model));
  HSAP_RETURN_IF_ERROR(PriceCluster(model, &cluster));
  PlannerOptions options;
  options.with_baselines = false;  // the plan alone: the baselines are references
  HSAP_ASSIGN_OR_RETURN(PlannerResult result, PlanAttention(cluster, workload, options));
  *plan = new hsapPlan_st{std::move(result.plan)};
  return absl::OkStatus();
}

// What a rank sends to every other to describe its device (fixed size, no pointers).
struct DeviceWire {
  char kind[32];
  double peak_tflops, memory_gib, hbm_gbps, attention_efficiency, intra_node_gbps, nic_gbps;
  int32_t node, nics;
};

absl::StatusOr<DeviceWire> Describe(const hsapComm_st& comm, const hsapPlanDevice_t* self) {
  DeviceWire w{};
  if (self == nullptr) {
    const Topology& topology = comm.comm->topology();
    const int node = topology.node_of(comm.comm->rank());
    if (comm.gpu != nullptr) {
      // A GPU: its kind from the driver's name, its memory, and its node as discovered at
      // initialisation (cluster.h: DescribeNamedDevice).
      HSAP_ASSIGN_OR_RETURN(cuda::DeviceIdentity id, comm.gpu->device().Identity());
      HSAP_ASSIGN_OR_RETURN(DeviceDescription d,
                            DescribeNamedDevice(id.name, id.memory_bytes, node,
                                                static_cast<int>(topology.RanksOf(node).size())));
      std::strncpy(w.kind, d.kind.c_str(), sizeof(w.kind) - 1);
      w.memory_gib = d.memory_gib;
      w.node = d.node;
      w.nics = d.nics;
      w.nic_gbps = d.nic_gbps;
      return w;
    }
    // A host rank: nominal figures, every rank alike (only the shares matter), in its node
    // of the communicator's described topology (rankNodes), each node with one nominal NIC
    // slower than the intra-node links.
    std::strncpy(w.kind, "cpu", sizeof(w.kind));
    w.peak_tflops = 1;
    w.memory_gib = 16;
    w.hbm_gbps = 100;
    w.attention_efficiency = 1;
    w.intra_node_gbps = 10;
    w.node = node;
    w.nics = 1;
    w.nic_gbps = 1;
    return w;
  }
  HSAP_RETURN_IF_ERROR(
      CheckConfigHeader(*self, "self", sizeof(hsapPlanDevice_t), "HSAP_PLAN_DEVICE_INITIALIZER"));
  if (std::memchr(self->kind, 0, sizeof(self->kind)) == nullptr) {
    return absl::InvalidArgumentError("self->kind is not NUL-terminated within 32 bytes");
  }
  std::memcpy(w.kind, self->kind, sizeof(w.kind));
  w.peak_tflops = self->peakTflops;
  w.memory_gib = self->memoryGib;
  w.hbm_gbps = self->hbmGbps;
  w.attention_efficiency = self->attentionEfficiency;
  w.intra_node_gbps = self->intraNodeGbps;
  w.nic_gbps = self->nicGbps;
  w.node = self->node;
  w.nics = self->nics;
  return w;
}

}  // namespace
}  // namespace hsap

extern "C" {

hsapResult_t hsapPlanCreateForCluster(hsapPlan_t* plan, const char* clusterJson,
                                      const hsapPlanModel_t* model) {
  return hsap::RunApi("hsapPlanCreateForCluster", [&]() -> absl::Status {
    HSAP_RETURN_IF_ERROR(hsap::CheckNotNull(plan, "plan"));
    *plan = nullptr;
    HSAP_RETURN_IF_ERROR(hsap::CheckNotNull(clusterJson, "clusterJson"));
    HSAP_ASSIGN_OR_RETURN(hsap::Cluster cluster, hsap::ClusterFromJsonText(clusterJson));
    return hsap::PlanFor(cluster, model, plan);
  });
}

hsapResult_t hsapPlanCreateForComm(hsapPlan_t* plan, hsapComm_t comm, const hsapPlanDevice_t* self,
                                   const hsapPlanModel_t* model) {
  return hsap::RunApi("hsapPlanCreateForComm", [&]() -> absl::Status {
    HSAP_RETURN_IF_ERROR(hsap::CheckNotNull(plan, "plan"));
    *plan = nullptr;
    if (comm == nullptr || comm->comm == nullptr) {
      return absl::InvalidArgumentError("comm is null");
    }
    // Every rank takes part in the gather, even with a bad description, so that its peers
    // fail on the empty kind rather than wait.
    absl::StatusOr<hsap::DeviceWire> mine = hsap::Describe(*comm, self);
    hsap::DeviceWire wire = mine.ok() ? *mine : hsap::DeviceWire{};
    std::vector<hsap::DeviceWire> all(comm->comm->size());
    HSAP_RETURN_IF_ERROR(comm->comm->transport().AllGather(
        &wire, all.data(), sizeof(wire), "hsapPlanCreateForComm: device descriptions"));
    HSAP_RETURN_IF_ERROR(mine.status());
    std::vector<hsap::DeviceDescription> devices;
    for (const hsap::DeviceWire& w : all) {
      devices.push_back({std::string(w.kind, strnlen(w.kind, sizeof(w.kind))), w.peak_tflops,
                         w.memory_gib, w.hbm_gbps, w.attention_efficiency, w.intra_node_gbps,
                         w.node, w.nics, w.nic_gbps});
    }
    HSAP_ASSIGN_OR_RETURN(hsap::Cluster cluster, hsap::ClusterFromDevices(devices));
    return hsap::PlanFor(cluster, model, plan);
  });
}

hsapResult_t hsapPlanGetRankMemory(hsapPlan_t plan, int rank, double* bytes) {
  return hsap::RunApi("hsapPlanGetRankMemory", [&]() -> absl::Status {
    HSAP_RETURN_IF_ERROR(hsap::CheckNotNull(plan, "plan"));
    HSAP_RETURN_IF_ERROR(hsap::CheckNotNull(bytes, "bytes"));
    if (rank < 0 || rank >= plan->plan.num_ranks) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank = ", rank, " must be in [0, ", plan->plan.num_ranks, ")"));
    }
    *bytes = plan->plan.ranks.empty() ? 0.0 : plan->plan.ranks[rank].memory_bytes;
    return absl::OkStatus();
  });
}

}  // extern "C"
