#include "lib/exec/runner.h"

#include <utility>

#include "lib/exec/executor.h"
#include "lib/exec/hierarchical_executor.h"

namespace hsap {
namespace {

void CountLinks(const ExecTraffic& t, CallTraffic& c) {
  c.links_counted = true;
  c.links = {t.intra_node_sent, t.intra_node_received, t.inter_node_sent, t.inter_node_received};
}

CallTraffic ToCallTraffic(const ExecTraffic& t) {
  CallTraffic c;
  c.ring_sent = t.bytes_sent;
  c.ring_received = t.bytes_received;
  CountLinks(t, c);
  return c;
}

class HostRingRunner : public BatchRunner {
 public:
  explicit HostRingRunner(ExecContext ctx) : ctx_(std::move(ctx)) {}

  absl::Status Forward(uint64_t call_id, const void* q, const void* k, const void* v, void* out,
                       float* lse, CallTraffic& traffic) override {
    ctx_.call_id = call_id;
    ExecTraffic t;
    absl::Status s = ExecuteForward(ctx_, q, k, v, out, lse, &t);
    traffic = ToCallTraffic(t);
    return s;
  }
  absl::Status Backward(uint64_t call_id, const void* dout, const void* q, const void* k,
                        const void* v, const void* out, const float* lse, void* dq, void* dk,
                        void* dv, CallTraffic& traffic) override {
    ctx_.call_id = call_id;
    ExecTraffic t;
    absl::Status s = ExecuteBackward(ctx_, dout, q, k, v, out, lse, dq, dk, dv, &t);
    traffic = ToCallTraffic(t);
    return s;
  }

 private:
  ExecContext ctx_;
};

class HostPlanRunner : public BatchRunner {
 public:
  explicit HostPlanRunner(HierExecContext ctx) : ctx_(std::move(ctx)) {}

  absl::Status Forward(uint64_t call_id, const void* q, const void* k, const void* v, void* out,
                       float* lse, CallTraffic& traffic) override {
    ctx_.call_id = call_id;
    ExecTraffic links;
    absl::Status s = HierarchicalForward(ctx_, q, k, v, out, lse, &traffic, &links);
    CountLinks(links, traffic);
    return s;
  }
  absl::Status Backward(uint64_t call_id, const void* dout, const void* q, const void* k,
                        const void* v, const void* out, const float* lse, void* dq, void* dk,
                        void* dv, CallTraffic& traffic) override {
    ctx_.call_id = call_id;
    ExecTraffic links;
    absl::Status s =
        HierarchicalBackward(ctx_, dout, q, k, v, out, lse, dq, dk, dv, &traffic, &links);
    CountLinks(links, traffic);
    return s;
  }

 private:
  HierExecContext ctx_;
};

class HostRunnerFactory : public RunnerFactory {
 public:
  explicit HostRunnerFactory(const KernelSet& kernels) : kernels_(kernels) {}

  bool RunsRelays() const override { return true; }
  bool PreparesLocally() const override { return true; }

  absl::StatusOr<std::unique_ptr<BatchRunner>> ForSchedule(Communicator& comm,
                                                           const Schedule& schedule,
                                                           const AttentionDims& dims,
                                                           DType dtype) override {
    return std::make_unique<HostRingRunner>(
        ExecContext{&comm, &schedule, &kernels_, dims, dtype, /*call_id=*/0});
  }
  absl::StatusOr<std::unique_ptr<BatchRunner>> ForHierarchy(Communicator& comm,
                                                            const RankHierarchy& rank,
                                                            const AttentionDims& dims,
                                                            DType dtype) override {
    return std::make_unique<HostPlanRunner>(
        HierExecContext{&comm, &rank, &kernels_, dims, dtype, /*call_id=*/0});
  }

 private:
  const KernelSet& kernels_;
};

}  // namespace

std::unique_ptr<RunnerFactory> HostRunners(const KernelSet& kernels) {
  return std::make_unique<HostRunnerFactory>(kernels);
}

}  // namespace hsap
