#include "lib/planner/run_simulator.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "attention/kernel.h"
#include "base/status_macros.h"
#include "lib/planner/cost_model.h"
#include "lib/planner/kernel_rates.h"
#include "lib/sched/partition.h"
#include "lib/sched/schedule.h"

namespace hsap {
namespace {

// A message to price: sent by `src` (its ready time is when both ends posted it).
struct Message {
  double ready = 0;
  int src = 0, dst = 0;
  uint64_t bytes = 0;
};

class RunPricer {
 public:
  RunPricer(const Cluster& cluster, absl::Span<const RankProgram> programs, int head_dim)
      : cluster_(cluster), programs_(programs), head_dim_(head_dim), ports_(cluster) {
    const int n = static_cast<int>(programs.size());
    result_.ranks.resize(n);
    clock_.assign(n, 0.0);
  }

  RunSimulation Run() {
    const int n = static_cast<int>(programs_.size());
    for (int r = 0; r < n; ++r) {
      result_.ranks[r].forward = programs_[r].forward.Traffic();
      result_.ranks[r].backward = programs_[r].backward.Traffic();
      result_.ranks[r].stages = static_cast<int>(programs_[r].forward.stages.size());
      result_.ranks[r].head_pairs = programs_[r].forward.pairs() * programs_[r].query_heads;
    }
    Pass(/*backward=*/false);
    const double forward_end = *std::max_element(clock_.begin(), clock_.end());
    std::fill(clock_.begin(), clock_.end(), forward_end);
    Pass(/*backward=*/true);
    const double backward_end = *std::max_element(clock_.begin(), clock_.end());
    result_.forward_seconds = forward_end;
    result_.backward_seconds = backward_end - forward_end;
    for (int r = 0; r < n; ++r) result_.ranks[r].finish_seconds = clock_[r];
    return std::move(result_);
  }

 private:
  const PassProgram& PassOf(int r, bool backward) const {
    return backward ? programs_[r].backward : programs_[r].forward;
  }

  // The attention of `pairs` visible pairs per head on rank r: the local work (stage < 0)
  // or ring stage `stage` of the pass. At the engine's rate for the piece's block length
  // (kernel_rates.h), slowed by NCCL's share of the device while a transfer is in flight
  // beside it (every piece but the pass's last stage, when the rank has stages); a stage
  // also pays its kernels' launch and, forward, the merge of its partial output into the
  // running one (Cluster::merge_bytes_per_element of HBM traffic per output element).
  double ComputeSeconds(int r, int64_t pairs, bool backward, int stage = -1) {
    const RankProgram& program = programs_[r];
    const DeviceKind& kind = cluster_.kind_of(r);
    const double flops = 4.0 * head_dim_ * static_cast<double>(pairs) * program.query_heads *
                         (backward ? kBackwardFactor : 1.0);
    const int stages = static_cast<int>(PassOf(r, backward).stages.size());
    const double block =
        BlockTokensOf(static_cast<double>(pairs), static_cast<double>(program.query_rows));
    double rate = kind.AttentionRate(backward, block, head_dim_);
    if (stages > 0 && stage < stages - 1) rate *= 1.0 - kind.nccl_compute_fraction;
    double seconds = pairs > 0 ? flops / rate : 0.0;
    if (stage >= 0) {
      seconds += cluster_.step_overhead_s;
      if (!backward && kind.hbm_bytes_per_s > 0) {
        seconds += cluster_.merge_bytes_per_element * static_cast<double>(program.query_rows) *
                   program.query_heads * head_dim_ / kind.hbm_bytes_per_s;
      }
    }
    result_.ranks[r].compute_seconds += seconds;
    return seconds;
  }

  // Prices `messages` in order of readiness; calls done(src, dst, arrival) for each.
  template <typename Done>
  void Price(std::vector<Message>& messages, Done&& done) {
    std::stable_sort(messages.begin(), messages.end(),
                     [](const Message& a, const Message& b) { return a.ready < b.ready; });
    for (const Message& m : messages) {
      double start = 0;
      const double arrival =
          m.src == m.dst
              ? m.ready
              : ports_.Transfer(m.src, m.dst, static_cast<double>(m.bytes), m.ready, &start);
      RunRank& rank = result_.ranks[m.src];
      (cluster_.SameNode(m.src, m.dst) ? rank.intra_node_bytes_sent : rank.inter_node_bytes_sent) +=
          m.bytes;
      done(m.src, m.dst, arrival);
    }
  }

  // All-to-alls one after the other: each starts when the rank finished the previous one,
  // a message when both ends started, and the rank is done when its messages are.
  void Exchanges(bool backward, bool after) {
    const int n = static_cast<int>(programs_.size());
    size_t count = 0;
    for (int r = 0; r < n; ++r) {
      const PassProgram& p = PassOf(r, backward);
      count = std::max(count, (after ? p.after : p.before).size());
    }
    for (size_t e = 0; e < count; ++e) {
      const std::vector<double> posted = clock_;
      std::vector<Message> messages;
      for (int r = 0; r < n; ++r) {
        const PassProgram& p = PassOf(r, backward);
        const std::vector<Exchange>& xs = after ? p.after : p.before;
        if (e >= xs.size()) continue;
        for (const Transfer& t : xs[e].transfers) {
          if (t.send) messages.push_back({std::max(posted[r], posted[t.peer]), r, t.peer, t.bytes});
        }
      }
      Price(messages, [&](int src, int dst, double arrival) {
        clock_[src] = std::max(clock_[src], arrival);
        clock_[dst] = std::max(clock_[dst], arrival);
      });
    }
  }

  // Index of every rank's stage at each step (-1: none); steps R.. are relay fan-outs. The
  // passes visit steps 1 .. num_steps_ - 1 only (the last step any rank has a stage at).
  void IndexSteps(bool backward) {
    const int n = static_cast<int>(programs_.size());
    num_steps_ = 1;
    for (int r = 0; r < n; ++r) {
      for (const ProgramStage& s : PassOf(r, backward).stages) {
        num_steps_ = std::max(num_steps_, s.step + 1);
      }
    }
    stage_at_.assign(n, std::vector<int>(num_steps_, -1));
    for (int r = 0; r < n; ++r) {
      const std::vector<ProgramStage>& stages = PassOf(r, backward).stages;
      for (size_t i = 0; i < stages.size(); ++i) stage_at_[r][stages[i].step] = static_cast<int>(i);
    }
  }

  // The messages of every rank's stage at `step` (kv or gradient group), ready when both
  // ends posted them (post[r][stage index]); done[r][stage index] becomes the latest
  // arrival of the rank's messages of that group.
  void PriceStep(int step, bool backward, bool grad, const std::vector<std::vector<double>>& post,
                 std::vector<std::vector<double>>& done) {
    const int n = static_cast<int>(programs_.size());
    std::vector<Message> messages;
    for (int r = 0; r < n; ++r) {
      const int i = stage_at_[r][step];
      if (i < 0) continue;
      const ProgramStage& s = PassOf(r, backward).stages[i];
      for (const Transfer& t : grad ? s.grad : s.kv) {
        if (!t.send) continue;
        const int j = stage_at_[t.peer][step];
        messages.push_back({std::max(post[r][i], post[t.peer][j]), r, t.peer, t.bytes});
      }
    }
    Price(messages, [&](int src, int dst, double arrival) {
      double& a = done[src][stage_at_[src][step]];
      double& b = done[dst][stage_at_[dst][step]];
      a = std::max(a, arrival);
      b = std::max(b, arrival);
    });
  }

  // A plan step's fan-out inside nodes (`grad` false: forwarded K/V) or fan-in (`grad`:
  // partials back to the gateway): one exchange per rank at `step`, completed before the
  // rank goes on. ready[r]: when rank r reaches it; becomes when r's messages arrived.
  void PriceFan(int step, bool backward, bool grad, std::vector<double>& ready) {
    const int n = static_cast<int>(programs_.size());
    std::vector<Message> messages;
    for (int r = 0; r < n; ++r) {
      const int i = stage_at_[r][step];
      if (i < 0) continue;
      const ProgramStage& s = PassOf(r, backward).stages[i];
      for (const Transfer& t : grad ? s.fan_in_grad : s.fan_out_kv) {
        if (t.send) messages.push_back({std::max(ready[r], ready[t.peer]), r, t.peer, t.bytes});
      }
    }
    if (messages.empty()) return;
    std::vector<double> arrived = ready;
    Price(messages, [&](int src, int dst, double arrival) {
      arrived[src] = std::max(arrived[src], arrival);
      arrived[dst] = std::max(arrived[dst], arrival);
    });
    ready = std::move(arrived);
  }

  void Pass(bool backward) {
    const int n = static_cast<int>(programs_.size());
    Exchanges(backward, /*after=*/false);
    IndexSteps(backward);
    std::vector<std::vector<double>> kv_post(n), kv_done(n), grad_post(n), grad_done(n);
    for (int r = 0; r < n; ++r) {
      const size_t k = PassOf(r, backward).stages.size();
      kv_post[r].assign(k, 0.0);
      kv_done[r].assign(k, 0.0);
      grad_post[r].assign(k, 0.0);
      grad_done[r].assign(k, 0.0);
    }
    if (!backward) {
      Forward(kv_post, kv_done);
    } else {
      Backward(kv_post, kv_done, grad_post, grad_done);
    }
    Exchanges(backward, /*after=*/true);
  }

  // Index of rank r's first fan-out stage (the stage count when there is none).
  int FirstFanOut(int r, bool backward) const {
    const std::vector<ProgramStage>& stages = PassOf(r, backward).stages;
    int i = 0;
    while (i < static_cast<int>(stages.size()) && !stages[i].fan_out) ++i;
    return i;
  }

  // RunStaged: post 0, local, then post i + 1, wait i, compute i; then (relays) the
  // fan-outs as a second RunStaged with no local work, once the direct stages are done.
  void Forward(std::vector<std::vector<double>>& post, std::vector<std::vector<double>>& done) {
    const int n = static_cast<int>(programs_.size());
    std::vector<double> start = clock_, local_end(n);
    std::vector<int> fan(n);
    std::vector<std::vector<double>> compute_end(n);
    for (int r = 0; r < n; ++r) {
      local_end[r] = start[r] + ComputeSeconds(r, programs_[r].forward.local_pairs, false);
      compute_end[r].assign(programs_[r].forward.stages.size(), 0.0);
      fan[r] = FirstFanOut(r, false);
      clock_[r] = local_end[r];
    }
    // When stage i may be posted and computed: in its phase, after the phase's start and
    // the stages before it as RunStaged orders them.
    auto phase_start = [&](int r, int i) {
      if (i < fan[r]) return start[r];
      return fan[r] == 0 ? local_end[r] : compute_end[r][fan[r] - 1];
    };
    auto phase_local_end = [&](int r, int i) {
      return i < fan[r] ? local_end[r] : phase_start(r, i);
    };
    for (int step = 1; step < num_steps_; ++step) {
      bool any = false;
      for (int r = 0; r < n; ++r) {
        const int i = stage_at_[r][step];
        if (i < 0) continue;
        any = true;
        const int k = i < fan[r] ? i : i - fan[r];  // index within the phase
        post[r][i] = k == 0   ? phase_start(r, i)
                     : k == 1 ? phase_local_end(r, i)
                              : compute_end[r][i - 2];
      }
      if (!any) continue;
      PriceStep(step, false, false, post, done);
      std::vector<double> begin(n, 0.0);
      for (int r = 0; r < n; ++r) {
        const int i = stage_at_[r][step];
        if (i < 0) continue;
        const int k = i < fan[r] ? i : i - fan[r];
        const double previous = k == 0 ? phase_local_end(r, i) : compute_end[r][i - 1];
        begin[r] = std::max(previous, done[r][i]);
      }
      PriceFan(step, false, false, begin);
      for (int r = 0; r < n; ++r) {
        const int i = stage_at_[r][step];
        if (i < 0) continue;
        compute_end[r][i] =
            begin[r] + ComputeSeconds(r, programs_[r].forward.stages[i].pairs, false, i);
        clock_[r] = compute_end[r][i];
      }
    }
  }

  // RunBackwardStages over protocol::BackwardPostingOrder: kv(t) sorts as 2t, grad(t) as
  // 2t + 3; every rank's groups of one key are posted before that key's messages are priced.
  // Fan-out steps (>= R) sort after every direct one: their run starts once the direct
  // run completed its last gradient group. Then the relays' return group.
  void Backward(std::vector<std::vector<double>>& kv_post,
                std::vector<std::vector<double>>& kv_done,
                std::vector<std::vector<double>>& grad_post,
                std::vector<std::vector<double>>& grad_done) {
    const int n = static_cast<int>(programs_.size());
    std::vector<bool> local_done(n, false);
    std::vector<int> fan(n);
    for (int r = 0; r < n; ++r) fan[r] = FirstFanOut(r, true);
    auto run_local = [&](int r) {
      if (local_done[r]) return;
      local_done[r] = true;
      clock_[r] += ComputeSeconds(r, programs_[r].backward.local_pairs, true);
    };
    for (int key = 2; key <= 2 * (num_steps_ - 1) + 3; ++key) {
      const bool grad = key % 2 == 1;
      const int step = grad ? (key - 3) / 2 : key / 2;
      if (step < 1 || step >= num_steps_) continue;
      bool any = false;
      // Gradient groups: the step's K/V arrived, its fan-out, kernels and fan-in (plans on
      // several nodes) run before the group is posted.
      std::vector<double> at = clock_;
      if (grad) {
        for (int r = 0; r < n; ++r) {
          const int i = stage_at_[r][step];
          if (i >= 0) at[r] = std::max(clock_[r], kv_done[r][i]);
        }
        PriceFan(step, true, false, at);
        for (int r = 0; r < n; ++r) {
          const int i = stage_at_[r][step];
          if (i >= 0) at[r] += ComputeSeconds(r, programs_[r].backward.stages[i].pairs, true, i);
        }
        PriceFan(step, true, true, at);
      }
      for (int r = 0; r < n; ++r) {
        const int i = stage_at_[r][step];
        if (i < 0) continue;
        any = true;
        if (!grad) {
          if (i == fan[r]) {  // the direct run is over: its local work, its last group
            run_local(r);
            if (i > 0) clock_[r] = std::max(clock_[r], grad_done[r][i - 1]);
          }
          kv_post[r][i] = clock_[r];
        } else {
          clock_[r] = at[r];
          grad_post[r][i] = clock_[r];
          if (i > 0) clock_[r] = std::max(clock_[r], grad_done[r][i - 1]);
        }
        run_local(r);
      }
      if (any) PriceStep(step, true, grad, grad ? grad_post : kv_post, grad ? grad_done : kv_done);
    }
    for (int r = 0; r < n; ++r) {
      run_local(r);
      if (!grad_done[r].empty()) clock_[r] = std::max(clock_[r], grad_done[r].back());
    }
    // The return group: posted by every rank once its stages are done.
    const std::vector<double> posted = clock_;
    std::vector<Message> messages;
    for (int r = 0; r < n; ++r) {
      for (const Transfer& t : programs_[r].backward.returns) {
        if (t.send) messages.push_back({std::max(posted[r], posted[t.peer]), r, t.peer, t.bytes});
      }
    }
    Price(messages, [&](int src, int dst, double arrival) {
      clock_[src] = std::max(clock_[src], arrival);
      clock_[dst] = std::max(clock_[dst], arrival);
    });
  }

  const Cluster& cluster_;
  absl::Span<const RankProgram> programs_;
  int head_dim_;
  PortClock ports_;
  RunSimulation result_;
  std::vector<double> clock_;
  std::vector<std::vector<int>> stage_at_;  // [rank][step]
  int num_steps_ = 1;                       // 1 + the last step of any rank's stages
};

}  // namespace

double RunSimulation::MaxComputeSeconds() const {
  double m = 0;
  for (const RunRank& r : ranks) m = std::max(m, r.compute_seconds);
  return m;
}

double RunSimulation::MeanComputeSeconds() const {
  if (ranks.empty()) return 0;
  double sum = 0;
  for (const RunRank& r : ranks) sum += r.compute_seconds;
  return sum / static_cast<double>(ranks.size());
}

uint64_t RunSimulation::InterNodeBytes() const {
  uint64_t sum = 0;
  for (const RunRank& r : ranks) sum += r.inter_node_bytes_sent;
  return sum;
}

double NicBoundSeconds(const Cluster& cluster, const RunSimulation& sim) {
  double bound = 0;
  for (const Node& node : cluster.nodes) {
    double bytes = 0;
    for (int d : node.devices) {
      if (d < static_cast<int>(sim.ranks.size())) bytes += sim.ranks[d].inter_node_bytes_sent;
    }
    bound = std::max(bound, bytes / (node.nics * node.nic_bytes_per_s));
  }
  return bound;
}

absl::StatusOr<RunSimulation> SimulatePrograms(const Cluster& cluster,
                                               absl::Span<const RankProgram> programs,
                                               int head_dim) {
  if (static_cast<int>(programs.size()) != cluster.size()) {
    return absl::InvalidArgumentError(absl::StrCat("there are ", programs.size(),
                                                   " rank programs but the cluster has ",
                                                   cluster.size(), " devices"));
  }
  for (size_t r = 0; r < programs.size(); ++r) {
    if (programs[r].rank != static_cast<int>(r)) {
      return absl::InvalidArgumentError(
          absl::StrCat("program ", r, " is rank ", programs[r].rank, "'s"));
    }
  }
  if (head_dim < 1) return absl::InvalidArgumentError("head_dim must be >= 1");
  return RunPricer(cluster, programs, head_dim).Run();
}

absl::StatusOr<std::vector<RankProgram>> PlanPrograms(const Layout& layout, const Plan& plan,
                                                      const LayerShape& shape) {
  return PlanPrograms(layout, plan, absl::Span<const int>(), shape);
}

absl::StatusOr<std::vector<RankProgram>> PlanPrograms(const Layout& layout, const Plan& plan,
                                                      const Cluster& cluster,
                                                      const LayerShape& shape) {
  std::vector<int> node_of_rank;
  for (const Device& d : cluster.devices) node_of_rank.push_back(d.node);
  if (static_cast<int>(node_of_rank.size()) != plan.num_ranks) {
    return absl::InvalidArgumentError(absl::StrCat("the plan is for ", plan.num_ranks,
                                                   " ranks but the cluster has ",
                                                   node_of_rank.size(), " devices"));
  }
  return PlanPrograms(layout, plan, node_of_rank, shape);
}

absl::StatusOr<std::vector<RankProgram>> PlanPrograms(const Layout& layout, const Plan& plan,
                                                      absl::Span<const int> node_of_rank,
                                                      const LayerShape& shape) {
  if (plan.heads_q != shape.heads_q || plan.heads_kv != shape.heads_kv) {
    return absl::InvalidArgumentError(
        absl::StrCat("the plan is for ", plan.heads_q, "/", plan.heads_kv,
                     " query/KV heads but the layer has ", shape.heads_q, "/", shape.heads_kv));
  }
  HSAP_ASSIGN_OR_RETURN(Hierarchy h, Hierarchy::Create(layout, plan, node_of_rank));
  std::vector<RankProgram> programs;
  programs.reserve(plan.num_ranks);
  for (int r = 0; r < plan.num_ranks; ++r) {
    HSAP_ASSIGN_OR_RETURN(RankHierarchy rank, h.BuildRank(layout, r, kKernelBlockQ));
    programs.push_back(ProgramOf(rank, shape.head_dim, shape.dtype, node_of_rank));
  }
  return programs;
}

namespace {

absl::StatusOr<std::vector<RankProgram>> FlatProgramsOn(const Layout& layout, int num_ranks,
                                                        absl::Span<const int> node_of_rank,
                                                        absl::Span<const double> weights,
                                                        const LayerShape& shape) {
  HSAP_ASSIGN_OR_RETURN(Partition partition, Partition::Create(layout, num_ranks, weights));
  std::vector<RankProgram> programs;
  programs.reserve(num_ranks);
  for (int r = 0; r < num_ranks; ++r) {
    HSAP_ASSIGN_OR_RETURN(Schedule sched,
                          BuildSchedule(layout, partition, r, kKernelBlockQ, node_of_rank));
    programs.push_back(
        ProgramOf(sched, shape.heads_q, shape.heads_kv, shape.head_dim, shape.dtype, node_of_rank));
  }
  return programs;
}

}  // namespace

absl::StatusOr<std::vector<RankProgram>> FlatPrograms(const Layout& layout, int num_ranks,
                                                      absl::Span<const double> weights,
                                                      const LayerShape& shape) {
  return FlatProgramsOn(layout, num_ranks, {}, weights, shape);
}

absl::StatusOr<std::vector<RankProgram>> FlatPrograms(const Layout& layout, const Cluster& cluster,
                                                      absl::Span<const double> weights,
                                                      const LayerShape& shape) {
  std::vector<int> node_of_rank;
  for (const Device& d : cluster.devices) node_of_rank.push_back(d.node);
  return FlatProgramsOn(layout, cluster.size(), node_of_rank, weights, shape);
}

absl::StatusOr<Layout> SampleRow(int64_t num_tokens, double mean_doc_tokens, uint64_t seed) {
  if (num_tokens < 1) return absl::InvalidArgumentError("a row needs at least one token");
  std::vector<int64_t> cu = {0};
  if (mean_doc_tokens <= 0 || mean_doc_tokens >= static_cast<double>(num_tokens)) {
    cu.push_back(num_tokens);
  } else {
    std::mt19937_64 rng(seed);
    while (cu.back() < num_tokens) {
      // Exponential lengths from a uniform in (0, 1], written out (the standard
      // distributions differ between library implementations).
      const double u = (static_cast<double>(rng() >> 11) + 1.0) * 0x1.0p-53;
      const int64_t length = std::max<int64_t>(1, std::llround(-mean_doc_tokens * std::log(u)));
      cu.push_back(std::min(num_tokens, cu.back() + length));
    }
  }
  return Layout::FromDocuments(cu);
}

}  // namespace hsap
