#include "lib/cuda/exec/gpu_executor.h"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "lib/cuda/exec/exec_util.h"
#include "lib/exec/executor.h"
#include "lib/exec/protocol.h"
#include "lib/exec/staged.h"

namespace hsap::cuda {

static_assert(sizeof(hsap_dev::QueryBlock) == sizeof(QueryBlock) &&
                  offsetof(hsap_dev::QueryBlock, seg_end) == offsetof(QueryBlock, seg_end),
              "device and host query blocks must share a layout");
static_assert(sizeof(hsap_dev::KeySegment) == sizeof(KeySegment) &&
                  offsetof(hsap_dev::KeySegment, diag_hi) == offsetof(KeySegment, diag_hi),
              "device and host key segments must share a layout");

namespace {

using protocol::Payload;
using protocol::RingTag;

// Common state of a forward or backward call.
class GpuCall {
 public:
  GpuCall(const GpuExecContext& ctx, const char* pass)
      : ctx_(ctx), events_(*ctx.device), pass_(pass), transfer_(TransferStream(*ctx.transport)) {
    const AttentionDims& dims = ctx.program->dims();
    kv_row32_ = static_cast<size_t>(dims.heads_kv) * dims.head_dim;
    kv_row_bytes_ = kv_row32_ * DTypeSize(ctx.program->dtype());
  }

  absl::Status Init() {
    const PoolLayout& layout = ctx_.program->pool_layout();
    if (ctx_.pool == nullptr || ctx_.pool_bytes < layout.total_bytes()) {
      return absl::InternalError(absl::StrCat("the communicator's pool holds ", ctx_.pool_bytes,
                                              " B; this batch needs ", layout.total_bytes(), " B (",
                                              layout.DebugString(), ")"));
    }
    for (cudaEvent* e : {&posted_[0], &posted_[1]}) {
      HSAP_ASSIGN_OR_RETURN(cudaEvent ev, events_.New());
      *e = ev;
    }
    PoolCursor cursor(ctx_.pool);
    const size_t recv = layout.kv_recv / 4, send = layout.kv_send / 4;
    for (int s = 0; s < 2; ++s) {
      recv_k_[s] = cursor.Take(recv);
      recv_v_[s] = cursor.Take(recv);
    }
    for (int s = 0; s < 2; ++s) {
      send_k_[s] = cursor.Take(send);
      send_v_[s] = cursor.Take(send);
    }
    store_k_ = cursor.Take(layout.relay_kv / 2);
    store_v_ = cursor.Take(layout.relay_kv / 2);
    pool_cursor_ = cursor.used();
    return absl::OkStatus();
  }

  // Adds a message of `bytes` between this rank and `peer` to `t`, by link class.
  void Tally(ExecTraffic& t, int peer, uint64_t bytes, bool sent) const {
    const Topology* topo = ctx_.topology;
    const int me = ctx_.program->schedule().rank;
    hsap::Tally(t, topo == nullptr || topo->SameNode(me, peer), bytes, sent);
  }

  // Makes the transfer stream wait for the work enqueued on the compute stream so far
  // (no-op for a host transport, or when both are one stream).
  absl::Status FenceTransfers(cudaEvent e) {
    if (transfer_ == nullptr || transfer_ == ctx_.stream) return absl::OkStatus();
    HSAP_RETURN_IF_ERROR(ctx_.device->RecordEvent(e, ctx_.stream));
    return ctx_.device->StreamWaitEvent(transfer_, e);
  }

  // Posts stage i's K/V transfers into slot i % 2 (see the header for the ordering).
  absl::StatusOr<std::unique_ptr<Transport::Pending>> PostKv(size_t i, const void* k,
                                                             const void* v) {
    const Stage& st = ctx_.program->schedule().stages[i];
    const int slot = static_cast<int>(i % 2);
    std::vector<SendOp> sends;
    std::vector<RecvOp> recvs;
    if (st.send_to >= 0) {
      const size_t bytes = static_cast<size_t>(st.send_rows) * kv_row_bytes_;
      // A fan-out sends rows of the relay store.
      HSAP_ASSIGN_OR_RETURN(const void* kp,
                            Rows(st.send_from_store ? store_k_ : k, st.send_runs, send_k_[slot]));
      HSAP_ASSIGN_OR_RETURN(const void* vp,
                            Rows(st.send_from_store ? store_v_ : v, st.send_runs, send_v_[slot]));
      Tally(moved_, st.send_to, 2 * bytes, /*sent=*/true);
      sends.push_back({st.send_to, kp, bytes, RingTag(ctx_.call_id, Payload::kKey, st.step)});
      sends.push_back({st.send_to, vp, bytes, RingTag(ctx_.call_id, Payload::kValue, st.step)});
    }
    if (st.recv_from >= 0) {
      const size_t bytes = static_cast<size_t>(st.recv_rows) * kv_row_bytes_;
      Tally(moved_, st.recv_from, 2 * bytes, /*sent=*/false);
      recvs.push_back(
          {st.recv_from, recv_k(i), bytes, RingTag(ctx_.call_id, Payload::kKey, st.step)});
      recvs.push_back(
          {st.recv_from, recv_v(i), bytes, RingTag(ctx_.call_id, Payload::kValue, st.step)});
    }
    HSAP_RETURN_IF_ERROR(FenceTransfers(posted_[slot]));
    return ctx_.transport->Start(sends, recvs, StageName(pass_, st, "kv"));
  }

  const GpuExecContext& ctx() const { return ctx_; }
  ExecTraffic& moved() { return moved_; }
  CallEvents& events() { return events_; }
  size_t pool_cursor() const { return pool_cursor_; }
  // Where stage i's K/V land: its slot, or the relay store for a kept buffer.
  void* recv_k(size_t i) const { return Received(i, store_k_, recv_k_); }
  void* recv_v(size_t i) const { return Received(i, store_v_, recv_v_); }
  // The receive slots themselves (the fused forward stages through them).
  void* slot_k(int s) const { return recv_k_[s]; }
  void* slot_v(int s) const { return recv_v_[s]; }
  size_t kv_row32() const { return kv_row32_; }

 private:
  // The rows of a [rows, heads_kv, D] tensor listed by runs: the tensor itself for one
  // contiguous run, else packed into `scratch` on the compute stream.
  absl::StatusOr<const void*> Rows(const void* base, const std::vector<TokenRun>& runs,
                                   char* scratch) {
    const char* b = static_cast<const char*>(base);
    if (runs.size() == 1) return b + runs[0].local_begin * kv_row_bytes_;
    char* dst = scratch;
    for (const TokenRun& r : runs) {
      const size_t bytes = static_cast<size_t>(r.length) * kv_row_bytes_;
      HSAP_RETURN_IF_ERROR(
          ctx_.device->CopyAsync(dst, b + r.local_begin * kv_row_bytes_, bytes, ctx_.stream));
      dst += bytes;
    }
    return static_cast<const void*>(scratch);
  }

  void* Received(size_t i, char* store, char* const (&slots)[2]) const {
    const int64_t at = ctx_.program->schedule().stages[i].store_begin;
    return at >= 0 ? store + static_cast<size_t>(at) * kv_row_bytes_ : slots[i % 2];
  }

  const GpuExecContext& ctx_;
  CallEvents events_;
  const char* pass_;
  cudaStream transfer_;
  size_t kv_row_bytes_ = 0, kv_row32_ = 0;
  cudaEvent posted_[2] = {nullptr, nullptr};
  char* recv_k_[2] = {nullptr, nullptr};
  char* recv_v_[2] = {nullptr, nullptr};
  char* send_k_[2] = {nullptr, nullptr};
  char* send_v_[2] = {nullptr, nullptr};
  char* store_k_ = nullptr;  // the relay store (schedule.h), empty without relays
  char* store_v_ = nullptr;
  size_t pool_cursor_ = 0;
  ExecTraffic moved_;
};

// The context a mode runs with (the stand-ins live in `kernels` / `transport`).
GpuExecContext ForMode(const GpuExecContext& ctx, SkippedKernels& kernels,
                       std::unique_ptr<SkippedTransport>& transport) {
  GpuExecContext out = ctx;
  if (ctx.mode == GpuExecMode::kTransfersOnly) {
    out.kernels = &kernels;
    out.cudnn = nullptr;
  }
  if (ctx.mode == GpuExecMode::kComputeOnly && ctx.transport != nullptr) {
    transport = std::make_unique<SkippedTransport>(*ctx.transport);
    out.transport = transport.get();
  }
  return out;
}

// Rounds `count` fp32 values to the storage dtype of the kernels.
absl::Status Store(const GpuExecContext& ctx, const float* from, void* to, size_t count) {
  if (count == 0) return absl::OkStatus();
  return ctx.kernels->Convert({from, to, static_cast<long long>(count)}, ctx.stream);
}

// The fused forward, first half (see the header): publish this rank's rows in its window
// for the call numbered NextCall(), returned. Enqueued before any kernel of the call, so that
// the flag the peers' fused kernels spin on never waits for SM slots those kernels may hold
// (loopback ranks share one GPU).
absl::StatusOr<uint32_t> FusedForwardPublish(const GpuExecContext& ctx, GpuCall& call,
                                             const void* k, const void* v) {
  PeerWindow& w = *ctx.window;
  const FusedRoutes& routes = *ctx.routes;
  const Schedule& sched = ctx.program->schedule();
  const int me = sched.rank;
  const size_t row_bytes = call.kv_row32() * DTypeSize(ctx.program->dtype());
  Device& device = *ctx.device;
  for (const Stage& st : sched.stages) {
    if (st.recv_from >= 0 && !w.reachable(st.recv_from)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", me, ": the peer window of rank ", st.recv_from,
          " could not be mapped at a later batch's creation; create this batch again"));
    }
  }
  const uint32_t call_number = w.NextCall();

  // Owner: the export is free once every reader copied the previous call's rows.
  for (const Stage& st : sched.stages) {
    if (st.send_to < 0) continue;
    HSAP_RETURN_IF_ERROR(
        device.WaitValueAsync(w.consumed(me, st.send_to), w.copies_by(st.send_to), ctx.stream));
  }
  for (size_t i = 0; i < sched.stages.size(); ++i) {
    const Stage& st = sched.stages[i];
    if (st.send_to < 0) continue;
    char* dst_k = w.export_area(me) + routes.write_offset[i];
    char* dst_v = dst_k + static_cast<size_t>(st.send_rows) * row_bytes;
    for (const TokenRun& r : st.send_runs) {
      const size_t at = static_cast<size_t>(r.local_begin) * row_bytes;
      const size_t bytes = static_cast<size_t>(r.length) * row_bytes;
      for (auto [dst, src] : {std::pair{dst_k, static_cast<const char*>(k)},
                              std::pair{dst_v, static_cast<const char*>(v)}}) {
        HSAP_RETURN_IF_ERROR(device.CopyAsync(dst, src + at, bytes, ctx.stream));
      }
      dst_k += bytes;
      dst_v += bytes;
    }
    call.Tally(call.moved(), st.send_to, 2 * static_cast<uint64_t>(st.send_rows) * row_bytes,
               /*sent=*/true);
    w.copies_by(st.send_to) += static_cast<uint32_t>(routes.copy_ctas);
  }
  HSAP_RETURN_IF_ERROR(device.WriteValueAsync(w.ready(me), call_number, ctx.stream));
  return call_number;
}

// The second half: the local keys, then one fused kernel per max_fused_steps() stages
// reads the senders' windows of call `call_number`.
absl::Status FusedForwardStages(const GpuExecContext& ctx, GpuCall& call, uint32_t call_number,
                                const void* k, const void* v, const hsap_dev::FwdParams& fwd) {
  PeerWindow& w = *ctx.window;
  const FusedRoutes& routes = *ctx.routes;
  const Schedule& sched = ctx.program->schedule();
  const int me = sched.rank;
  const size_t row_bytes = call.kv_row32() * DTypeSize(ctx.program->dtype());
  Device& device = *ctx.device;
  HSAP_RETURN_IF_ERROR(LaunchForward(*ctx.kernels, fwd, ctx.program->lists().local(), k, v,
                                     sched.local_rows, ctx.stream));
  FusedForwardLaunch launch;
  hsap_dev::FusedFwdHead& h = launch.head;
  h.q = fwd.q;
  h.out = fwd.out;
  h.lse = fwd.lse;
  h.kv_head_of_q = nullptr;
  h.error_flag = w.error_word();
  for (int b = 0; b < 2; ++b) {
    h.stage_k[b] = call.slot_k(b);
    h.stage_v[b] = call.slot_v(b);
  }
  h.counters = w.counters();
  h.q_rows = fwd.q_rows;
  h.ready_timeout_ns = static_cast<unsigned long long>(absl::ToInt64Nanoseconds(ctx.peer_timeout));
  h.heads_q = fwd.heads_q;
  h.heads_kv = fwd.heads_kv;
  h.scale = fwd.scale;
  launch.share = routes.share;
  auto flush = [&]() -> absl::Status {
    if (launch.steps.empty()) return absl::OkStatus();
    HSAP_RETURN_IF_ERROR(device.ZeroAsync(w.counters(), 4 * sizeof(uint32_t), ctx.stream));
    absl::Status s = ctx.kernels->FusedForward(launch, ctx.stream);
    launch.steps.clear();
    return s;
  };
  for (size_t i = 0; i < sched.stages.size(); ++i) {
    const Stage& st = sched.stages[i];
    if (st.recv_from < 0) continue;
    const DeviceWorkLists::List& list = ctx.program->lists().stage(i);
    hsap_dev::FusedStep step{};
    step.k_src = w.export_area(st.recv_from) + routes.read_offset[i];
    step.v_src =
        static_cast<const char*>(step.k_src) + static_cast<size_t>(st.recv_rows) * row_bytes;
    step.ready_flag = w.ready(st.recv_from);
    step.ready_value = call_number;
    step.consumed_flag = w.consumed(st.recv_from, me);
    step.blocks = list.blocks;
    step.segments = list.segments;
    step.k_rows = st.recv_rows;
    step.num_blocks = list.num_blocks;
    launch.steps.push_back(step);
    call.Tally(call.moved(), st.recv_from, 2 * static_cast<uint64_t>(st.recv_rows) * row_bytes,
               /*sent=*/false);
    if (static_cast<int>(launch.steps.size()) == ctx.kernels->max_fused_steps()) {
      HSAP_RETURN_IF_ERROR(flush());
    }
  }
  return flush();
}

}  // namespace

absl::Status GpuExecuteForward(const GpuExecContext& ctx_in, const void* q, const void* k,
                               const void* v, void* out, float* lse, ExecTraffic* traffic) {
  SkippedKernels skipped_kernels(ctx_in.kernels);
  std::unique_ptr<SkippedTransport> skipped_transport;
  const GpuExecContext ctx = ForMode(ctx_in, skipped_kernels, skipped_transport);
  GpuCall call(ctx, "forward");
  HSAP_RETURN_IF_ERROR(call.Init());
  const Schedule& sched = ctx.program->schedule();
  const int64_t rows = sched.local_rows;
  const AttentionDims& dims = ctx.program->dims();
  const size_t out_elems = static_cast<size_t>(rows) * dims.heads_q * dims.head_dim;
  const size_t lse_elems = static_cast<size_t>(rows) * dims.heads_q;
  PoolCursor cursor(static_cast<char*>(ctx.pool) + call.pool_cursor());
  float* out32 = reinterpret_cast<float*>(cursor.Take(out_elems * sizeof(float)));
  float* lse32 = reinterpret_cast<float*>(cursor.Take(lse_elems * sizeof(float)));
  const size_t fan = sched.first_fan_out();
  const bool relays = fan < sched.stages.size() || sched.store_rows > 0;
  if (ctx.window != nullptr && ctx.cudnn != nullptr) {
    return absl::InternalError("the fused forward cannot run the cuDNN engine's pieces");
  }
  if (ctx.window != nullptr && relays) {
    return absl::InternalError(
        "the fused forward cannot run a schedule with relays (batches on several nodes run "
        "stages)");
  }
  // Fused: this rank's rows are published before any kernel of the call.
  const bool fused = ctx.window != nullptr && ctx.mode == GpuExecMode::kFull;
  uint32_t call_number = 0;
  if (fused) {
    HSAP_ASSIGN_OR_RETURN(call_number, FusedForwardPublish(ctx, call, k, v));
  }
  if (rows > 0) {
    HSAP_RETURN_IF_ERROR(ctx.kernels->Init({out32, lse32, rows, dims.heads_q}, ctx.stream));
  }

  const QuerySide side{rows, dims.heads_q, dims.heads_kv, dims.scale};
  const hsap_dev::FwdParams p = ForwardParams(side, q, out32, lse32);
  // Step 0 is the local work, step i + 1 stage i's (the engine choice's order).
  auto attend = [&](size_t step, const DeviceWorkLists::List& list, const void* kk, const void* vv,
                    int64_t k_rows) {
    return AttendStepForward(ctx.cudnn, step, *ctx.kernels, p, list, kk, vv, k_rows, ctx.stream);
  };

  auto on_stage = [&](size_t i) {
    const Stage& st = sched.stages[i];
    if (st.recv_from < 0) return absl::OkStatus();
    return attend(i + 1, ctx.program->lists().stage(i), call.recv_k(i), call.recv_v(i),
                  st.recv_rows);
  };
  // The direct stages, then (relays only) the fan-outs, which send what the former kept.
  absl::Status staged =
      fused ? FusedForwardStages(ctx, call, call_number, k, v, p)
            : RunStaged(
                fan, [&](size_t i) { return call.PostKv(i, k, v); },
                [&] { return attend(0, ctx.program->lists().local(), k, v, rows); }, on_stage);
  if (staged.ok() && fan < sched.stages.size()) {
    staged = RunStaged(
        sched.stages.size() - fan, [&](size_t i) { return call.PostKv(fan + i, k, v); },
        [] { return absl::OkStatus(); }, [&](size_t i) { return on_stage(fan + i); });
  }
  if (!staged.ok()) return staged;
  HSAP_RETURN_IF_ERROR(Store(ctx, out32, out, out_elems));
  HSAP_RETURN_IF_ERROR(ctx.device->CopyAsync(lse, lse32, lse_elems * sizeof(float), ctx.stream));
  if (traffic != nullptr) *traffic = call.moved();
  return absl::OkStatus();
}

namespace {

// The backward of one rank's ring schedule on the device: the pool regions after the K/V
// slots (PoolLayout order), the stages (RunBackwardStagesThenFanOuts) with the fp32 dK/dV
// partials of received rows back to their owner, then the relays' return phase.
class GpuRingBackward {
 public:
  GpuRingBackward(const GpuExecContext& ctx, GpuCall& call, const void* k, const void* v)
      : ctx_(ctx),
        call_(call),
        sched_(ctx.program->schedule()),
        k_(k),
        v_(v),
        rows_(sched_.local_rows),
        q_elems_(static_cast<size_t>(rows_) * ctx.program->dims().heads_q *
                 ctx.program->dims().head_dim),
        kv_elems_(static_cast<size_t>(rows_) * call.kv_row32()) {}

  // Carves the regions, zeroes the accumulators and computes delta = rowsum(dout * out).
  absl::Status Prepare(const void* dout, const void* q, const void* out, const float* lse) {
    const PoolLayout& layout = ctx_.program->pool_layout();
    const AttentionDims& dims = ctx_.program->dims();
    const size_t stat_elems = static_cast<size_t>(rows_) * dims.heads_q;
    // Regions after the K/V slots, in PoolLayout order.
    PoolCursor cursor(static_cast<char*>(ctx_.pool) + call_.pool_cursor());
    dq32_ = reinterpret_cast<float*>(cursor.Take(q_elems_ * sizeof(float)));
    dk32_ = reinterpret_cast<float*>(cursor.Take(kv_elems_ * sizeof(float)));
    dv32_ = reinterpret_cast<float*>(cursor.Take(kv_elems_ * sizeof(float)));
    float* delta = reinterpret_cast<float*>(cursor.Take(stat_elems * sizeof(float)));
    const size_t partial = layout.grad_partial / 4, returned = layout.grad_returned / 4;
    for (int s = 0; s < 2; ++s) {
      part_k_[s] = reinterpret_cast<float*>(cursor.Take(partial));
      part_v_[s] = reinterpret_cast<float*>(cursor.Take(partial));
    }
    for (int s = 0; s < 2; ++s) {
      back_k_[s] = reinterpret_cast<float*>(cursor.Take(returned));
      back_v_[s] = reinterpret_cast<float*>(cursor.Take(returned));
    }
    // Relays: the store's summed partials, and the partials that come back in the return
    // phase (one region per deferred stage, in stage order).
    const size_t store_elems = static_cast<size_t>(sched_.store_rows) * call_.kv_row32();
    store_gk_ = reinterpret_cast<float*>(cursor.Take(layout.relay_grad / 2));
    store_gv_ = reinterpret_cast<float*>(cursor.Take(layout.relay_grad / 2));
    deferred_k_.assign(sched_.stages.size(), nullptr);
    deferred_v_.assign(sched_.stages.size(), nullptr);
    for (size_t i = 0; i < sched_.stages.size(); ++i) {
      const Stage& st = sched_.stages[i];
      if (st.send_to < 0 || !st.send_grads_deferred) continue;
      const size_t bytes = static_cast<size_t>(st.send_rows) * call_.kv_row32() * sizeof(float);
      deferred_k_[i] = reinterpret_cast<float*>(cursor.Take(bytes));
      deferred_v_[i] = reinterpret_cast<float*>(cursor.Take(bytes));
    }
    for (cudaEvent* e : {&grads_ready_[0], &grads_ready_[1], &store_ready_}) {
      HSAP_ASSIGN_OR_RETURN(cudaEvent ev, call_.events().New());
      *e = ev;
    }

    for (auto [ptr, count] : {std::pair{dq32_, q_elems_},
                              {dk32_, kv_elems_},
                              {dv32_, kv_elems_},
                              {store_gk_, store_elems},
                              {store_gv_, store_elems}}) {
      HSAP_RETURN_IF_ERROR(ctx_.device->ZeroAsync(ptr, count * sizeof(float), ctx_.stream));
    }
    if (rows_ > 0) {
      HSAP_RETURN_IF_ERROR(
          ctx_.kernels->Delta({dout, out, delta, rows_, dims.heads_q}, ctx_.stream));
    }
    const QuerySide side{rows_, dims.heads_q, dims.heads_kv, dims.scale};
    params_ = BackwardParams(side, q, dout, lse, delta, dq32_);
    out_ = out;
    return absl::OkStatus();
  }

  // The stages, then the return phase.
  absl::Status Run() {
    std::vector<int> steps;
    for (const Stage& st : sched_.stages) steps.push_back(st.step);
    BackwardStages hooks;
    hooks.post_kv = [&](size_t i) { return call_.PostKv(i, k_, v_); };
    hooks.local = [&] {
      return Backward(0, ctx_.program->lists().local(), k_, v_, rows_, dk32_, dv32_);
    };
    hooks.compute = [&](size_t i) { return Compute(i); };
    hooks.post_grad = [&](size_t i) { return PostGrad(i); };
    // The partials returned for stage j, added in step order.
    hooks.add_returned = [&](size_t j) -> absl::Status {
      const Stage& st = sched_.stages[j];
      if (st.send_to < 0 || st.send_grads_deferred) return absl::OkStatus();
      return AddRows(st, back_k_[j % 2], back_v_[j % 2]);
    };
    // The direct stages, then (relays only) the fan-outs, which send what the former kept.
    const size_t fan = sched_.first_fan_out();
    HSAP_RETURN_IF_ERROR(RunBackwardStagesThenFanOuts(steps, fan, hooks));
    return ReturnRelayGrads(fan);
  }

  // dQ, dK, dV in the storage dtype.
  absl::Status Store(void* dq, void* dk, void* dv) const {
    HSAP_RETURN_IF_ERROR(cuda::Store(ctx_, dq32_, dq, q_elems_));
    HSAP_RETURN_IF_ERROR(cuda::Store(ctx_, dk32_, dk, kv_elems_));
    return cuda::Store(ctx_, dv32_, dv, kv_elems_);
  }

  const ExecTraffic& grad_moved() const { return grad_moved_; }

 private:
  // Step 0 is the local work, step i + 1 stage i's (the engine choice's order).
  absl::Status Backward(size_t step, const DeviceWorkLists::List& list, const void* kk,
                        const void* vv, int64_t k_rows, float* gk, float* gv) const {
    return AttendStepBackward(ctx_.cudnn, step, *ctx_.kernels, params_, out_, list, kk, vv, k_rows,
                              gk, gv, ctx_.stream);
  }

  // Stage i's received rows: their partials into the slot (zeroed first), or into the
  // store for a kept buffer, whose partials are summed there.
  absl::Status Compute(size_t i) {
    const Stage& st = sched_.stages[i];
    const int slot = static_cast<int>(i % 2);
    if (st.recv_from < 0) return absl::OkStatus();
    if (st.store_begin >= 0) {  // a kept buffer: its partials are summed in the store
      const size_t at = static_cast<size_t>(st.store_begin) * call_.kv_row32();
      return Backward(i + 1, ctx_.program->lists().stage(i), call_.recv_k(i), call_.recv_v(i),
                      st.recv_rows, store_gk_ + at, store_gv_ + at);
    }
    const size_t bytes = static_cast<size_t>(st.recv_rows) * call_.kv_row32() * sizeof(float);
    for (float* g : {part_k_[slot], part_v_[slot]}) {
      HSAP_RETURN_IF_ERROR(ctx_.device->ZeroAsync(g, bytes, ctx_.stream));
    }
    return Backward(i + 1, ctx_.program->lists().stage(i), call_.recv_k(i), call_.recv_v(i),
                    st.recv_rows, part_k_[slot], part_v_[slot]);
  }

  // Stage i's partials to the owner of its received rows, and those of this rank's rows
  // from the stage's destination (unless they come in the return phase).
  absl::StatusOr<std::unique_ptr<Transport::Pending>> PostGrad(size_t i) {
    const Stage& st = sched_.stages[i];
    const int slot = static_cast<int>(i % 2);
    std::vector<SendOp> sends;
    std::vector<RecvOp> recvs;
    if (st.recv_from >= 0 && st.store_begin < 0) {
      const size_t bytes = static_cast<size_t>(st.recv_rows) * call_.kv_row32() * sizeof(float);
      call_.Tally(grad_moved_, st.recv_from, 2 * bytes, /*sent=*/true);
      sends.push_back(
          {st.recv_from, part_k_[slot], bytes, RingTag(ctx_.call_id, Payload::kKeyGrad, st.step)});
      sends.push_back({st.recv_from, part_v_[slot], bytes,
                       RingTag(ctx_.call_id, Payload::kValueGrad, st.step)});
    }
    if (st.send_to >= 0 && !st.send_grads_deferred) {
      const size_t bytes = static_cast<size_t>(st.send_rows) * call_.kv_row32() * sizeof(float);
      call_.Tally(grad_moved_, st.send_to, 2 * bytes, /*sent=*/false);
      recvs.push_back(
          {st.send_to, back_k_[slot], bytes, RingTag(ctx_.call_id, Payload::kKeyGrad, st.step)});
      recvs.push_back(
          {st.send_to, back_v_[slot], bytes, RingTag(ctx_.call_id, Payload::kValueGrad, st.step)});
    }
    HSAP_RETURN_IF_ERROR(call_.FenceTransfers(grads_ready_[slot]));
    return ctx_.transport->Start(sends, recvs, StageName("backward", st, "dk/dv"));
  }

  // Adds the partials `gk`, `gv` of stage j's sent rows into their rows: of dk/dv, or of the
  // relay store's sums for a fan-out.
  absl::Status AddRows(const Stage& st, const float* gk, const float* gv) const {
    float* to_k = st.send_from_store ? store_gk_ : dk32_;
    float* to_v = st.send_from_store ? store_gv_ : dv32_;
    size_t offset = 0;
    for (const TokenRun& run : st.send_runs) {
      const long long count = static_cast<long long>(run.length * call_.kv_row32());
      const size_t at = static_cast<size_t>(run.local_begin) * call_.kv_row32();
      for (auto [to, from] : {std::pair{to_k, gk}, {to_v, gv}}) {
        HSAP_RETURN_IF_ERROR(
            ctx_.kernels->Accumulate({to + at, from + offset, count}, ctx_.stream));
      }
      offset += static_cast<size_t>(count);
    }
    return absl::OkStatus();
  }

  // The return phase: each kept buffer's summed partials go back to its owner, which adds
  // them in stage order after all its other partials.
  absl::Status ReturnRelayGrads(size_t fan) {
    std::vector<SendOp> sends;
    std::vector<RecvOp> recvs;
    for (size_t i = 0; i < fan; ++i) {
      const Stage& st = sched_.stages[i];
      if (st.recv_from >= 0 && st.store_begin >= 0) {
        const size_t bytes = static_cast<size_t>(st.recv_rows) * call_.kv_row32() * sizeof(float);
        const size_t at = static_cast<size_t>(st.store_begin) * call_.kv_row32();
        call_.Tally(grad_moved_, st.recv_from, 2 * bytes, /*sent=*/true);
        sends.push_back({st.recv_from, store_gk_ + at, bytes,
                         RingTag(ctx_.call_id, Payload::kRelayKeyGrad, st.step)});
        sends.push_back({st.recv_from, store_gv_ + at, bytes,
                         RingTag(ctx_.call_id, Payload::kRelayValueGrad, st.step)});
      }
      if (st.send_to >= 0 && st.send_grads_deferred) {
        const size_t bytes = static_cast<size_t>(st.send_rows) * call_.kv_row32() * sizeof(float);
        call_.Tally(grad_moved_, st.send_to, 2 * bytes, /*sent=*/false);
        recvs.push_back({st.send_to, deferred_k_[i], bytes,
                         RingTag(ctx_.call_id, Payload::kRelayKeyGrad, st.step)});
        recvs.push_back({st.send_to, deferred_v_[i], bytes,
                         RingTag(ctx_.call_id, Payload::kRelayValueGrad, st.step)});
      }
    }
    if (sends.empty() && recvs.empty()) return absl::OkStatus();
    HSAP_RETURN_IF_ERROR(call_.FenceTransfers(store_ready_));
    HSAP_ASSIGN_OR_RETURN(std::unique_ptr<Transport::Pending> pending,
                          ctx_.transport->Start(sends, recvs, "backward relay dk/dv return"));
    HSAP_RETURN_IF_ERROR(pending->Wait());
    for (size_t i = 0; i < fan; ++i) {
      const Stage& st = sched_.stages[i];
      if (st.send_to >= 0 && st.send_grads_deferred) {
        HSAP_RETURN_IF_ERROR(AddRows(st, deferred_k_[i], deferred_v_[i]));
      }
    }
    return absl::OkStatus();
  }

  const GpuExecContext& ctx_;
  GpuCall& call_;
  const Schedule& sched_;
  const void* const k_;
  const void* const v_;
  const int64_t rows_;
  const size_t q_elems_, kv_elems_;
  hsap_dev::BwdParams params_{};
  const void* out_ = nullptr;  // the final output (the cuDNN engine's backward reads it)
  float *dq32_ = nullptr, *dk32_ = nullptr, *dv32_ = nullptr;
  float *part_k_[2] = {}, *part_v_[2] = {}, *back_k_[2] = {}, *back_v_[2] = {};
  float *store_gk_ = nullptr, *store_gv_ = nullptr;
  std::vector<float*> deferred_k_, deferred_v_;
  cudaEvent grads_ready_[2] = {}, store_ready_ = nullptr;
  ExecTraffic grad_moved_;
};

}  // namespace

absl::Status GpuExecuteBackward(const GpuExecContext& ctx_in, const void* dout, const void* q,
                                const void* k, const void* v, const void* out, const float* lse,
                                void* dq, void* dk, void* dv, ExecTraffic* traffic) {
  SkippedKernels skipped_kernels(ctx_in.kernels);
  std::unique_ptr<SkippedTransport> skipped_transport;
  const GpuExecContext ctx = ForMode(ctx_in, skipped_kernels, skipped_transport);
  GpuCall call(ctx, "backward");
  HSAP_RETURN_IF_ERROR(call.Init());
  GpuRingBackward backward(ctx, call, k, v);
  HSAP_RETURN_IF_ERROR(backward.Prepare(dout, q, out, lse));
  HSAP_RETURN_IF_ERROR(backward.Run());
  HSAP_RETURN_IF_ERROR(backward.Store(dq, dk, dv));
  if (traffic != nullptr) {
    const ExecTraffic& kv = call.moved();
    const ExecTraffic& grad_moved = backward.grad_moved();
    traffic->bytes_sent = kv.bytes_sent + grad_moved.bytes_sent;
    traffic->bytes_received = kv.bytes_received + grad_moved.bytes_received;
    traffic->intra_node_sent = kv.intra_node_sent + grad_moved.intra_node_sent;
    traffic->intra_node_received = kv.intra_node_received + grad_moved.intra_node_received;
    traffic->inter_node_sent = kv.inter_node_sent + grad_moved.inter_node_sent;
    traffic->inter_node_received = kv.inter_node_received + grad_moved.inter_node_received;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<DeviceRingProgram>> DeviceRingProgram::Build(
    Device& device, const Schedule& schedule, const AttentionDims& dims, DType dtype,
    cudaStream stream, DeviceBufferPool* pool) {
  if (!dims.kv_head_of_q.empty()) {
    return absl::InternalError(
        "the ring executor takes no kv-head map; batches under a plan run on "
        "GpuHierarchicalForward/Backward");
  }
  auto program = std::unique_ptr<DeviceRingProgram>(new DeviceRingProgram());
  program->schedule_ = &schedule;
  program->dims_ = dims;
  program->dtype_ = dtype;
  HSAP_ASSIGN_OR_RETURN(program->pool_layout_, ComputePoolLayout(schedule, dims, dtype));
  if (pool != nullptr) {
    HSAP_RETURN_IF_ERROR(
        pool->Reserve(program->pool_layout_.total_bytes(), program->pool_layout_.DebugString()));
  }
  HSAP_ASSIGN_OR_RETURN(program->lists_, DeviceWorkLists::Upload(device, schedule, stream));
  return program;
}

}  // namespace hsap::cuda
