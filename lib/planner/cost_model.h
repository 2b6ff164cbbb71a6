// The cost model of one attention layer under a plan (formulas and reasoning in
// docs/cost_model.md), and the workload it prices: model, sequence, memory budget.
#ifndef HSAP_LIB_PLANNER_COST_MODEL_H_
#define HSAP_LIB_PLANNER_COST_MODEL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "lib/planner/cluster.h"
#include "lib/sched/plan.h"

namespace hsap {

struct ModelSpec {
  std::string name;
  int layers = 0;
  int heads_q = 0;
  int heads_kv = 0;
  int head_dim = 0;
  int hidden = 0;
  int ffn_hidden = 0;
  int vocab = 0;
  int dtype_bytes = 2;  // bf16
  // Parameters of the dense transformer (attention, SwiGLU MLP, embeddings + head).
  double Parameters() const;
};

// Llama-family presets: "llama-3b" (Llama 3.2 3B, GQA 24:8), "llama-7b" (Llama 2 7B),
// "llama-13b" (Llama 2 13B), "llama-70b" (Llama 2/3 70B, GQA 64:8).
absl::StatusOr<ModelSpec> ModelPreset(absl::string_view name);
std::vector<std::string> ModelPresetNames();
// A model from JSON: {"name": "...", "layers": 32, "heads_q": 32, "heads_kv": 8,
// "head_dim": 128, "hidden": 4096, "ffn_hidden": 14336, "vocab": 128256, "dtype_bytes": 2};
// name, ffn_hidden (default 4 x hidden), vocab (default 32000) and dtype_bytes (default 2)
// are optional.
absl::StatusOr<ModelSpec> ModelFromJsonText(absl::string_view text);

// Memory a device may use. Each term is per device.
struct MemoryBudget {
  // Weights, gradients and optimizer state. < 0: 16 bytes per parameter (bf16 weights and
  // gradients, fp32 master weights and Adam moments) sharded over all devices (ZeRO-3).
  double model_state_bytes = -1;
  // Activations of the rest of the layer stack are kept per token and layer. With
  // activation checkpointing (default) a layer keeps its input (hidden x dtype bytes) and
  // one layer at a time holds its working set (34 x hidden bytes per token, Megatron's
  // count with flash attention); without it every layer keeps 34 x hidden bytes per token.
  bool activation_checkpointing = true;
  double margin_fraction = 0.10;  // kept free for fragmentation, the framework, NCCL
};

struct Workload {
  ModelSpec model;
  int64_t seq_len = 0;       // tokens of the packed row
  bool causal = true;        // one causal document (else bidirectional)
  double visible_pairs = 0;  // per head; 0: computed from seq_len and causal
  MemoryBudget budget;

  double VisiblePairs() const;
  // Attention FLOPs of one layer, all heads: forward 4 d P Hq; backward kBackwardFactor x.
  double ForwardFlops() const;
  double BackwardFlops() const;
};

// Backward attention does 2.5x the forward's matrix work (5 matmuls against 2).
inline constexpr double kBackwardFactor = 2.5;

// Predicted figures of one rank under a plan.
struct RankCost {
  double tokens = 0;           // shard before the all-to-all
  double compute_forward = 0;  // attention compute, seconds
  double compute_backward = 0;
  double a2a_forward = 0;  // all-to-all in + out, seconds (the rank's group)
  double a2a_backward = 0;
  double ring_transfer_forward = 0;  // K/V transfer time if nothing overlapped
  double memory_bytes = 0;
  double memory_capacity = 0;  // usable: memory x (1 - margin)
};

struct PlanCost {
  double forward_seconds = 0;  // one layer, wall time
  double backward_seconds = 0;
  std::vector<RankCost> ranks;
  bool fits_memory = true;
  int worst_memory_rank = -1;  // the rank with the least headroom
  double Seconds() const { return forward_seconds + backward_seconds; }
  // Tokens of the row processed per second through all layers' attention (fwd + bwd).
  double TokensPerSecond(const Workload& w) const {
    return static_cast<double>(w.seq_len) / (w.model.layers * Seconds());
  }
};

// How precisely ring steps are priced.
enum class RingPricing {
  // Pipelined ring (default): block s reaches group g once its predecessor had it and g's
  // previous block has landed (one link, blocks back to back); g computes block s once it
  // has arrived and block s-1 is done. O(groups^2).
  kPipelined,
  // Lower bound: each group's compute and its K/V transfer fully overlapped. O(groups).
  kOverlapBound,
};

// One K/V flow of a ring step: rank `dst` receives `kv_heads` KV heads of each block from
// rank `src`, the holder of those heads in dst's ring predecessor group (the first rank of
// that group, in group order, whose query heads use the KV head).
struct RingFlow {
  int dst, src, kv_heads;
};
// Flows of one ring step (the same at every step); empty for a one-group plan. The plan
// must be valid.
std::vector<RingFlow> RingFlows(const Plan& plan);

// Prices `plan` for `workload` on `cluster`. Errors when the plan does not match the
// cluster (rank count) or the model (head counts).
absl::StatusOr<PlanCost> EvaluatePlan(const Cluster& cluster, const Workload& workload,
                                      const Plan& plan,
                                      RingPricing pricing = RingPricing::kPipelined);

// Memory of one rank: model state, activations of `tokens` pre-all-to-all tokens, attention
// tensors of `group_tokens` tokens for `heads` query / `kv_heads` KV heads, ring buffers
// for blocks of `block_tokens`, all-to-all staging.
double RankMemoryBytes(const Cluster& cluster, const Workload& workload, double tokens,
                       double group_tokens, int heads, int kv_heads, double block_tokens,
                       bool has_ring);
double ModelStateBytesPerDevice(const Cluster& cluster, const Workload& workload);
double UsableMemoryBytes(const Cluster& cluster, const Workload& workload, int device);

// The ideal bound: all attention FLOPs (fwd + bwd) over the sum of sustained FLOP/s (each
// device's engine rate for the whole row as one block, forward and backward apart) —
// perfect balance, communication fully hidden.
double IdealSeconds(const Cluster& cluster, const Workload& workload);

// Yardsticks.
// Hardware bound: all attention FLOPs (fwd + bwd) over the sum of the datasheet peaks
// (efficiency 1): no plan on any software reaches it. IdealSeconds is the model bound.
double HardwareBoundSeconds(const Cluster& cluster, const Workload& workload);
// The token-parallel rest of a transformer layer: the Q/K/V and output projections and the
// SwiGLU MLP, forward FLOPs per token (2 per multiply-add); backward does twice as many.
double DenseForwardFlopsPerToken(const ModelSpec& model);
// Forward + backward time of that part of one layer when every rank runs its token share of
// the row (plan.RankShares()) at its device's GEMM rate (DeviceKind::GemmFlops: peak x
// gemm_efficiency, the calibration's), plus the forward again when the workload checkpoints
// activations (the recompute the memory model assumes): the slowest rank's time.
double DenseLayerSeconds(const Cluster& cluster, const Workload& workload, const Plan& plan);

}  // namespace hsap

#endif  // HSAP_LIB_PLANNER_COST_MODEL_H_
