// The simulator of what runs: it prices the transfer programs (lib/sched/transfers.h) the
// runtime executes for a batch, built from the real partition and schedules (flat batches)
// or the real hierarchy (plans), so its bytes per rank, its step counts and the work of each
// step are those of hsapAttentionForward / hsapAttentionBackward by construction (a test
// compares them with hsapBatchGetTrafficDetail on the host backend).
//
// Timing follows the executors (lib/exec/staged.h): the all-to-alls one after the other,
// each done when all of the rank's messages are; forward stage i's K/V is posted when the
// rank finished computing stage i - 2 (stage 0 at once, stage 1 after the local work) and
// computed once it arrived and stage i - 1 is done; backward posts in
// protocol::BackwardPostingOrder, computes stage i once its K/V arrived, posts its gradient
// group, then waits for stage i - 1's. A message starts when both ends have posted it and
// goes through the cluster's ports (PortClock: each device's intra-node ports, each node's
// NICs; with NCCL's protocol cost, Cluster::link_efficiency and half_bandwidth_bytes). Compute
// of a stage lasts pairs x heads x 4 x head_dim FLOPs (backward 2.5x) over the device's engine
// rate for the stage's block length (2 pairs / query rows, kernel_rates.h), less NCCL's share
// of the device while a transfer runs beside it, plus the stage's launch and merge
// (Cluster::step_overhead_s, merge_bytes_per_element), so causal imbalance and short ring
// blocks come out of the real work lists.
// The backward starts when the forward ended on every rank.
#ifndef HSAP_LIB_PLANNER_RUN_SIMULATOR_H_
#define HSAP_LIB_PLANNER_RUN_SIMULATOR_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "attention/dtype.h"
#include "attention/layout.h"
#include "lib/planner/cluster.h"
#include "lib/sched/hierarchy.h"
#include "lib/sched/plan.h"
#include "lib/sched/transfers.h"

namespace hsap {

// The attention geometry of the layer a batch runs.
struct LayerShape {
  int heads_q = 0;
  int heads_kv = 0;
  int head_dim = 0;
  DType dtype = DType::kBF16;
};

struct RunRank {
  HierTraffic forward, backward;  // bytes as hsapBatchGetTrafficDetail reports them
  // Bytes this rank sent over both passes, by link class (same node / another node).
  uint64_t intra_node_bytes_sent = 0;
  uint64_t inter_node_bytes_sent = 0;
  int stages = 0;              // K/V stages of a pass
  int64_t head_pairs = 0;      // visible pairs x query heads of a pass
  double compute_seconds = 0;  // busy, both passes
  double finish_seconds = 0;   // end of the rank's backward
};

struct RunSimulation {
  double forward_seconds = 0;
  double backward_seconds = 0;
  std::vector<RunRank> ranks;
  double Seconds() const { return forward_seconds + backward_seconds; }
  // The breakdown of Seconds(): the busiest rank's compute, the imbalance (that compute
  // minus the mean rank's), and what is left: transfer time no compute hid.
  double MaxComputeSeconds() const;
  double MeanComputeSeconds() const;
  double ExposedTransferSeconds() const { return Seconds() - MaxComputeSeconds(); }
  double ImbalanceSeconds() const { return MaxComputeSeconds() - MeanComputeSeconds(); }
  uint64_t InterNodeBytes() const;  // sent by all ranks, both passes
};

// A communication lower bound of a simulated run: the busiest node's inter-node bytes (sent,
// both passes) over the node's NIC bandwidth (all its NICs, one direction).
double NicBoundSeconds(const Cluster& cluster, const RunSimulation& sim);

// Prices the programs of every rank (programs[r].rank == r, one per device of `cluster`).
absl::StatusOr<RunSimulation> SimulatePrograms(const Cluster& cluster,
                                               absl::Span<const RankProgram> programs,
                                               int head_dim);

// The programs of a plan's batch on `layout` (what hsapBatchCreateWithPlan builds), all
// ranks on one node.
absl::StatusOr<std::vector<RankProgram>> PlanPrograms(const Layout& layout, const Plan& plan,
                                                      const LayerShape& shape);
// The same on `cluster`, one rank per device (plan.num_ranks devices): the hierarchy knows
// each rank's node, as on a host communicator whose rankNodes are the cluster's nodes, so
// a step's rows needed by several members of another node cross once and are fanned out
// inside it (lib/sched/hierarchy.h, 5.), and are priced as such.
absl::StatusOr<std::vector<RankProgram>> PlanPrograms(const Layout& layout, const Plan& plan,
                                                      const Cluster& cluster,
                                                      const LayerShape& shape);
// The same with the node of every rank given (empty: one node).
absl::StatusOr<std::vector<RankProgram>> PlanPrograms(const Layout& layout, const Plan& plan,
                                                      absl::Span<const int> node_of_rank,
                                                      const LayerShape& shape);
// The programs of a flat batch (what hsapBatchCreate builds): `num_ranks` ranks on one
// node, the sequence-aware partition with `weights` (empty: equal).
absl::StatusOr<std::vector<RankProgram>> FlatPrograms(const Layout& layout, int num_ranks,
                                                      absl::Span<const double> weights,
                                                      const LayerShape& shape);
// The same on `cluster`, one rank per device: the schedules know each rank's node, as on a
// host communicator whose rankNodes are the cluster's nodes, so rows needed by several ranks
// of another node are relayed (lib/sched/schedule.h) and priced as such.
absl::StatusOr<std::vector<RankProgram>> FlatPrograms(const Layout& layout, const Cluster& cluster,
                                                      absl::Span<const double> weights,
                                                      const LayerShape& shape);

// A packed row of `num_tokens` tokens: one causal document (mean_doc_tokens <= 0 or >=
// num_tokens), or causal documents with exponentially distributed lengths of the given mean
// (at least one token), drawn from `seed` (deterministic on every platform).
absl::StatusOr<Layout> SampleRow(int64_t num_tokens, double mean_doc_tokens, uint64_t seed);

}  // namespace hsap

#endif  // HSAP_LIB_PLANNER_RUN_SIMULATOR_H_
