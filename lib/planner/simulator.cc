#include "lib/planner/simulator.h"

#include <algorithm>
#include <numeric>

namespace hsap {
namespace {

struct PendingTransfer {
  double ready;
  int order;  // tie-break: deterministic issue order
  int src, dst;
  double bytes;
};

class PassSimulator {
 public:
  PassSimulator(const Cluster& cluster, const Workload& workload, const Plan& plan,
                const PlanCost& cost, const std::vector<RingFlow>& flows, PortClock* ports,
                SimResult* result, bool record)
      : cluster_(cluster),
        workload_(workload),
        plan_(plan),
        cost_(cost),
        flows_(flows),
        ports_(ports),
        result_(result),
        record_(record) {
    const int n = plan.num_ranks;
    heads_.resize(n);
    kv_.resize(n);
    group_of_ = plan.GroupOfRank();
    for (size_t g = 0; g < plan.groups.size(); ++g) {
      for (size_t i = 0; i < plan.groups[g].ranks.size(); ++i) {
        const int r = plan.groups[g].ranks[i];
        heads_[r] = static_cast<int>(plan.groups[g].heads[i].size());
        kv_[r] = static_cast<int>(plan.KvHeadsOf(static_cast<int>(g), static_cast<int>(i)).size());
      }
    }
    double total = 0;
    for (const PlanGroup& g : plan.groups) total += g.sequence_weight;
    for (const PlanGroup& g : plan.groups) share_.push_back(g.sequence_weight / total);
    order_ = plan.RingOrder();
    position_.resize(order_.size());
    for (size_t p = 0; p < order_.size(); ++p) position_[order_[p]] = static_cast<int>(p);
  }

  // Runs one pass from time t0; returns its end.
  double Run(bool backward, double t0) {
    const int n = plan_.num_ranks;
    const int num_groups = static_cast<int>(plan_.groups.size());
    const double d = workload_.model.head_dim, b = workload_.model.dtype_bytes;
    const double seq = static_cast<double>(workload_.seq_len);
    const double ring_factor = backward ? 2.0 : 1.0;
    auto tokens = [&](int r) { return cost_.ranks[r].tokens; };
    // Into the head layout: forward q, k, v; backward dout.
    auto in_bytes = [&](int src, int dst) {
      return backward ? tokens(src) * heads_[dst] * d * b
                      : tokens(src) * (heads_[dst] + 2.0 * kv_[dst]) * d * b;
    };
    // Back to the token layout: forward out; backward dq, dk, dv. src owns heads, dst tokens.
    auto out_bytes = [&](int src, int dst) {
      return backward ? tokens(dst) * (heads_[src] + 2.0 * kv_[src]) * d * b
                      : tokens(dst) * heads_[src] * d * b;
    };

    std::vector<double> ready(n, t0);
    std::vector<PendingTransfer> pending;
    AllToAll(in_bytes, std::vector<double>(n, t0), &pending);
    RunTransfers(&pending, SimEventKind::kAllToAll, backward, &ready);

    // Ring steps. done[r]: end of the rank's last compute; block_at[r]: when the rank had
    // the block of the previous step (to forward it); done_prev2[r]: end of compute two
    // steps back (frees a receive buffer).
    std::vector<double> done = ready, done_prev(n, t0), have_prev = ready;
    std::vector<double> arrive(n, t0);
    for (int s = 0; s < num_groups; ++s) {
      if (s > 0) {
        pending.clear();
        for (size_t f = 0; f < flows_.size(); ++f) {
          const RingFlow& flow = flows_[f];
          const int src_group = SourceGroup(group_of_[flow.dst], s);
          const double bytes = ring_factor * seq * share_[src_group] * 2.0 * flow.kv_heads * d * b;
          const double buffer_free = s >= 2 ? done_prev[flow.dst] : t0;
          pending.push_back({std::max(have_prev[flow.src], buffer_free), static_cast<int>(f),
                             flow.src, flow.dst, bytes});
        }
        std::fill(arrive.begin(), arrive.end(), t0);
        RunTransfers(&pending, SimEventKind::kRing, backward, &arrive);
        have_prev = arrive;
      }
      done_prev = done;  // becomes "two steps back" at the next step's buffer check
      for (int r = 0; r < n; ++r) {
        const int src_group = SourceGroup(group_of_[r], s);
        const double start = std::max(done[r], s > 0 ? arrive[r] : ready[r]);
        const RankCost& rc = cost_.ranks[r];
        const double length =
            (backward ? rc.compute_backward : rc.compute_forward) * share_[src_group];
        done[r] = start + length;
        result_->devices[r].busy_seconds += length;
        if (record_ && length > 0) {
          result_->events.push_back({r, SimEventKind::kCompute, backward, start, done[r]});
        }
      }
    }
    // Note: done_prev now holds the compute ends of step G-2 (unused after the loop).

    pending.clear();
    AllToAll(out_bytes, done, &pending);
    std::vector<double> finish = done;
    RunTransfers(&pending, SimEventKind::kAllToAll, backward, &finish);
    return *std::max_element(finish.begin(), finish.end());
  }

 private:
  int SourceGroup(int g, int step) const {
    const int num_groups = static_cast<int>(order_.size());
    return order_[(position_[g] + num_groups - step % num_groups) % num_groups];
  }

  // Pairs of each group in conflict-free rounds: round j sends from member i to i + j.
  template <typename BytesOf>
  void AllToAll(BytesOf bytes_of, const std::vector<double>& ready,
                std::vector<PendingTransfer>* pending) {
    size_t max_size = 0;
    for (const PlanGroup& g : plan_.groups) max_size = std::max(max_size, g.ranks.size());
    int order = 0;
    for (size_t j = 1; j < max_size; ++j) {
      for (const PlanGroup& g : plan_.groups) {
        const size_t k = g.ranks.size();
        if (j >= k) continue;
        for (size_t i = 0; i < k; ++i) {
          const int src = g.ranks[i], dst = g.ranks[(i + j) % k];
          const double bytes = bytes_of(src, dst);
          if (bytes <= 0) continue;
          pending->push_back({ready[src], order++, src, dst, bytes});
        }
      }
    }
  }

  // Issues transfers in order of readiness; (*arrival)[dst] becomes the latest arrival.
  void RunTransfers(std::vector<PendingTransfer>* pending, SimEventKind kind, bool backward,
                    std::vector<double>* arrival) {
    std::sort(pending->begin(), pending->end(), [](const auto& x, const auto& y) {
      return x.ready != y.ready ? x.ready < y.ready : x.order < y.order;
    });
    for (const PendingTransfer& t : *pending) {
      double start = 0;
      const double end = ports_->Transfer(t.src, t.dst, t.bytes, t.ready, &start);
      (*arrival)[t.dst] = std::max((*arrival)[t.dst], end);
      if (record_) result_->events.push_back({t.dst, kind, backward, start, end});
    }
  }

  const Cluster& cluster_;
  const Workload& workload_;
  const Plan& plan_;
  const PlanCost& cost_;
  const std::vector<RingFlow>& flows_;
  PortClock* ports_;
  SimResult* result_;
  bool record_;
  std::vector<int> heads_, kv_, group_of_, order_, position_;
  std::vector<double> share_;
};

}  // namespace

absl::StatusOr<SimResult> Simulate(const Cluster& cluster, const Workload& workload,
                                   const Plan& plan, const SimOptions& options) {
  // The cost model checks the plan against the cluster and the model and supplies the
  // per-rank token counts, compute times and memory.
  auto cost = EvaluatePlan(cluster, workload, plan, RingPricing::kPipelined);
  if (!cost.ok()) return cost.status();
  SimResult result;
  result.devices.resize(plan.num_ranks);
  const std::vector<RingFlow> flows = RingFlows(plan);
  PortClock ports(cluster);
  PassSimulator pass(cluster, workload, plan, *cost, flows, &ports, &result, options.record_events);
  const double forward_end = pass.Run(/*backward=*/false, 0.0);
  const double backward_end = pass.Run(/*backward=*/true, forward_end);
  result.forward_seconds = forward_end;
  result.backward_seconds = backward_end - forward_end;
  for (int r = 0; r < plan.num_ranks; ++r) {
    result.devices[r].idle_seconds = backward_end - result.devices[r].busy_seconds;
    result.devices[r].peak_memory_bytes = cost->ranks[r].memory_bytes;
  }
  return result;
}

}  // namespace hsap
