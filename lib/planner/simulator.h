// A discrete-event simulator of one attention layer (forward, then backward) under a plan.
//
// Resources: each device's compute engine, each device's intra-node egress and ingress
// ports, and each NIC's egress and ingress. A transfer uses its source's egress port and
// its destination's ingress port; it lasts bytes / min(bandwidths) and holds each port for
// bytes / that port's bandwidth (a fast port is free again while a slow peer still
// drains), then arrives one latency later; transfers on a busy port wait (first come,
// first served, in order of readiness), which is how flows sharing a NIC contend. A compute task
// holds its device's engine.
//
// Each pass runs: the all-to-all into the head layout (per group, in conflict-free rounds),
// ring steps (rank r in a group computes its queries against the K/V block of the group
// `step` places before it in the ring order; the next block is received from the holders
// of r's KV heads in the predecessor group while the current one is computed; a rank has
// two receive buffers, so block s can only land once block s-2 is consumed), and the
// all-to-all back. Backward computes 2.5x the work and moves K/V plus dK/dV (2x bytes).
// Memory per device is the cost model's account (lib/planner/cost_model.h).
#ifndef HSAP_LIB_PLANNER_SIMULATOR_H_
#define HSAP_LIB_PLANNER_SIMULATOR_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lib/planner/cluster.h"
#include "lib/planner/cost_model.h"
#include "lib/sched/plan.h"

namespace hsap {

enum class SimEventKind { kCompute, kAllToAll, kRing };

struct SimEvent {
  int device;  // the compute device, or the receiver of a transfer
  SimEventKind kind;
  bool backward;
  double start, end;  // seconds from the start of the layer's forward
};

struct SimDevice {
  double busy_seconds = 0;  // compute, forward + backward
  double idle_seconds = 0;  // wall time of both passes minus busy
  double peak_memory_bytes = 0;
};

struct SimResult {
  double forward_seconds = 0;
  double backward_seconds = 0;
  std::vector<SimDevice> devices;
  std::vector<SimEvent> events;  // only when requested
  double Seconds() const { return forward_seconds + backward_seconds; }
  double TokensPerSecond(const Workload& w) const {
    return static_cast<double>(w.seq_len) / (w.model.layers * Seconds());
  }
};

struct SimOptions {
  bool record_events = false;
};

absl::StatusOr<SimResult> Simulate(const Cluster& cluster, const Workload& workload,
                                   const Plan& plan, const SimOptions& options = {});

}  // namespace hsap

#endif  // HSAP_LIB_PLANNER_SIMULATOR_H_
