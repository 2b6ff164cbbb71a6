#include "lib/exec/executor.h"

#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "lib/comm/transport.h"
#include "lib/exec/protocol.h"
#include "lib/exec/staged.h"

namespace hsap {
namespace {

using protocol::Payload;
using protocol::RingTag;

// Rows of a tensor [rows, row_bytes] listed by runs (local rows), packed or referenced.
class RowSource {
 public:
  // Points into `base` when the runs are one contiguous block; packs into `scratch` else.
  const void* Prepare(const void* base, size_t row_bytes, const std::vector<TokenRun>& runs,
                      std::vector<char>& scratch) {
    const char* b = static_cast<const char*>(base);
    if (runs.size() == 1) return b + runs[0].local_begin * row_bytes;
    int64_t rows = 0;
    for (const TokenRun& r : runs) rows += r.length;
    scratch.resize(static_cast<size_t>(rows) * row_bytes);
    char* dst = scratch.data();
    for (const TokenRun& r : runs) {
      const size_t bytes = static_cast<size_t>(r.length) * row_bytes;
      std::memcpy(dst, b + r.local_begin * row_bytes, bytes);
      dst += bytes;
    }
    return scratch.data();
  }
};

}  // namespace

void Tally(ExecTraffic& t, const Communicator& comm, int peer, uint64_t bytes, bool sent) {
  Tally(t, comm.topology().SameNode(comm.rank(), peer), bytes, sent);
}

void Tally(ExecTraffic& t, bool intra, uint64_t bytes, bool sent) {
  if (sent) {
    t.bytes_sent += bytes;
    (intra ? t.intra_node_sent : t.inter_node_sent) += bytes;
  } else {
    t.bytes_received += bytes;
    (intra ? t.intra_node_received : t.inter_node_received) += bytes;
  }
}

void AddTraffic(ExecTraffic& to, const ExecTraffic& from) {
  to.bytes_sent += from.bytes_sent;
  to.bytes_received += from.bytes_received;
  to.intra_node_sent += from.intra_node_sent;
  to.intra_node_received += from.intra_node_received;
  to.inter_node_sent += from.inter_node_sent;
  to.inter_node_received += from.inter_node_received;
}

namespace {

// Double-buffered K/V movement along the stages of a schedule. Kept buffers (relays) are
// received into the relay store, and fan-outs send from it.
class KvPipeline {
 public:
  KvPipeline(const ExecContext& ctx, const void* k, const void* v, const char* pass,
             Payload key_tag, Payload value_tag)
      : ctx_(ctx), k_(k), v_(v), pass_(pass), key_tag_(key_tag), value_tag_(value_tag) {
    row_bytes_ = static_cast<size_t>(ctx.dims.heads_kv) * ctx.dims.head_dim * DTypeSize(ctx.dtype);
    store_k_.resize(static_cast<size_t>(ctx.schedule->store_rows) * row_bytes_);
    store_v_.resize(store_k_.size());
  }

  // Posts stage i's transfers into buffer slot i % 2 (or the relay store).
  absl::StatusOr<std::unique_ptr<Transport::Pending>> Post(size_t i) {
    const Stage& st = ctx_.schedule->stages[i];
    Slot& slot = slots_[i % 2];
    std::vector<SendOp> sends;
    std::vector<RecvOp> recvs;
    Communicator& comm = *ctx_.comm;
    if (st.send_to >= 0) {
      const size_t bytes = static_cast<size_t>(st.send_rows) * row_bytes_;
      RowSource src;
      const void* kp = src.Prepare(st.send_from_store ? store_k_.data() : k_, row_bytes_,
                                   st.send_runs, slot.send_k);
      const void* vp = src.Prepare(st.send_from_store ? store_v_.data() : v_, row_bytes_,
                                   st.send_runs, slot.send_v);
      Tally(moved_, comm, st.send_to, 2 * bytes, /*sent=*/true);
      sends.push_back({st.send_to, kp, bytes, RingTag(ctx_.call_id, key_tag_, st.step)});
      sends.push_back({st.send_to, vp, bytes, RingTag(ctx_.call_id, value_tag_, st.step)});
    }
    if (st.recv_from >= 0) {
      const size_t bytes = static_cast<size_t>(st.recv_rows) * row_bytes_;
      Tally(moved_, comm, st.recv_from, 2 * bytes, /*sent=*/false);
      if (st.store_begin < 0) {
        slot.recv_k.resize(bytes);
        slot.recv_v.resize(bytes);
      }
      recvs.push_back({st.recv_from, const_cast<void*>(recv_k(i)), bytes,
                       RingTag(ctx_.call_id, key_tag_, st.step)});
      recvs.push_back({st.recv_from, const_cast<void*>(recv_v(i)), bytes,
                       RingTag(ctx_.call_id, value_tag_, st.step)});
    }
    return comm.transport().Start(sends, recvs, StageName(pass_, st, "kv"));
  }

  const void* recv_k(size_t i) const { return Received(i, store_k_, slots_[i % 2].recv_k); }
  const void* recv_v(size_t i) const { return Received(i, store_v_, slots_[i % 2].recv_v); }
  // Payload bytes of the stages posted so far.
  const ExecTraffic& moved() const { return moved_; }

 private:
  struct Slot {
    std::vector<char> send_k, send_v, recv_k, recv_v;
  };
  const void* Received(size_t i, const std::vector<char>& store,
                       const std::vector<char>& slot) const {
    const int64_t at = ctx_.schedule->stages[i].store_begin;
    return at >= 0 ? store.data() + at * row_bytes_ : slot.data();
  }
  const ExecContext& ctx_;
  const void* k_;
  const void* v_;
  const char* pass_;
  Payload key_tag_, value_tag_;
  size_t row_bytes_ = 0;
  Slot slots_[2];
  std::vector<char> store_k_, store_v_;
  ExecTraffic moved_;
};

// The backward of one rank's ring schedule: the local keys and every stage's received rows,
// the fp32 dK/dV partials of received rows back to their owner one stage later
// (RunBackwardStagesThenFanOuts), then the relays' kept partials in one return phase. The
// gradients accumulate in fp32 into dq32, dk32 and dv32 ([local_rows, heads, head_dim],
// zeroed by the caller).
class RingBackward {
 public:
  RingBackward(const ExecContext& ctx, const void* dout, const void* q, const void* k,
               const void* v, const float* lse, const float* delta, float* dq32, float* dk32,
               float* dv32)
      : ctx_(ctx),
        sched_(*ctx.schedule),
        k_(k),
        v_(v),
        rows_(sched_.local_rows),
        threads_(ctx.comm->num_threads()),
        kv_row_(static_cast<size_t>(ctx.dims.heads_kv) * ctx.dims.head_dim),
        dk32_(dk32),
        dv32_(dv32),
        kv_(ctx, k, v, "backward", Payload::kKey, Payload::kValue),
        store_gk_(sched_.store_rows * kv_row_, 0.0f),
        store_gv_(store_gk_.size(), 0.0f) {
    args_.dims = ctx.dims;
    args_.dtype = ctx.dtype;
    args_.q = q;
    args_.dout = dout;
    args_.lse = lse;
    args_.delta = delta;
    args_.q_rows = rows_;
    args_.dq = dq32;
  }

  absl::Status Run() {
    BackwardStages hooks;
    hooks.post_kv = [&](size_t i) { return kv_.Post(i); };
    hooks.local = [&]() { return Local(); };
    hooks.compute = [&](size_t i) { return Compute(i); };
    hooks.post_grad = [&](size_t i) { return PostGrad(i); };
    hooks.add_returned = [&](size_t i) {
      const Stage& st = sched_.stages[i];
      if (st.send_to >= 0 && !st.send_grads_deferred) {
        AddRows(st, back_k_[i % 2].data(), back_v_[i % 2].data());
      }
      return absl::OkStatus();
    };
    // The direct stages, then (relays only) the fan-outs, which send what the former kept.
    const size_t fan = sched_.first_fan_out();
    std::vector<int> steps;
    for (const Stage& st : sched_.stages) steps.push_back(st.step);
    HSAP_RETURN_IF_ERROR(RunBackwardStagesThenFanOuts(steps, fan, hooks));
    return ReturnRelayGrads(fan);
  }

  // K/V and gradient bytes moved, by link class.
  ExecTraffic moved() const {
    ExecTraffic t = kv_.moved();
    AddTraffic(t, grad_moved_);
    return t;
  }

 private:
  absl::Status Local() {
    if (sched_.local_work.empty()) return absl::OkStatus();
    args_.k = k_;
    args_.v = v_;
    args_.k_rows = rows_;
    args_.dk = dk32_;
    args_.dv = dv32_;
    return ctx_.kernels->Backward(args_, sched_.local_work, threads_);
  }

  // Adds the returned partials of a stage's sent rows (`gk`, `gv`, packed in run order) into
  // dk32/dv32, or into the relay store when the stage sent from it.
  void AddRows(const Stage& st, const float* gk, const float* gv) {
    const size_t kv_row = kv_row_;
    float* to_k = st.send_from_store ? store_gk_.data() : dk32_;
    float* to_v = st.send_from_store ? store_gv_.data() : dv32_;
    for (const TokenRun& run : st.send_runs) {
      float* tk = to_k + run.local_begin * kv_row;
      float* tv = to_v + run.local_begin * kv_row;
      const size_t count = static_cast<size_t>(run.length) * kv_row;
      for (size_t e = 0; e < count; ++e) {
        tk[e] += gk[e];
        tv[e] += gv[e];
      }
      gk += count;
      gv += count;
    }
  }

  // Gradient partials of the rows received at stage i: into the relay store when the
  // stage keeps its buffer (summed there), else into the slot's buffers, sent back to their
  // owner by PostGrad.
  absl::Status Compute(size_t i) {
    const Stage& st = sched_.stages[i];
    const size_t slot = i % 2;
    const size_t kv_row = kv_row_;
    if (st.recv_from < 0) return absl::OkStatus();
    if (st.store_begin >= 0) {
      args_.dk = store_gk_.data() + st.store_begin * kv_row;
      args_.dv = store_gv_.data() + st.store_begin * kv_row;
    } else {
      part_k_[slot].assign(st.recv_rows * kv_row, 0.0f);
      part_v_[slot].assign(st.recv_rows * kv_row, 0.0f);
      args_.dk = part_k_[slot].data();
      args_.dv = part_v_[slot].data();
    }
    if (st.recv_work.empty()) return absl::OkStatus();
    args_.k = kv_.recv_k(i);
    args_.v = kv_.recv_v(i);
    args_.k_rows = st.recv_rows;
    return ctx_.kernels->Backward(args_, st.recv_work, threads_);
  }

  // Stage i's partials to the owner of its received rows, and those of this rank's rows
  // from the stage's destination (unless they come in the return phase).
  absl::StatusOr<std::unique_ptr<Transport::Pending>> PostGrad(size_t i) {
    const Stage& st = sched_.stages[i];
    const size_t slot = i % 2;
    std::vector<SendOp> sends;
    std::vector<RecvOp> recvs;
    if (st.recv_from >= 0 && st.store_begin < 0) {
      const size_t bytes = part_k_[slot].size() * sizeof(float);
      Tally(grad_moved_, *ctx_.comm, st.recv_from, 2 * bytes, /*sent=*/true);
      sends.push_back({st.recv_from, part_k_[slot].data(), bytes,
                       RingTag(ctx_.call_id, Payload::kKeyGrad, st.step)});
      sends.push_back({st.recv_from, part_v_[slot].data(), bytes,
                       RingTag(ctx_.call_id, Payload::kValueGrad, st.step)});
    }
    if (st.send_to >= 0 && !st.send_grads_deferred) {
      back_k_[slot].resize(st.send_rows * kv_row_);
      back_v_[slot].resize(st.send_rows * kv_row_);
      const size_t bytes = back_k_[slot].size() * sizeof(float);
      Tally(grad_moved_, *ctx_.comm, st.send_to, 2 * bytes, /*sent=*/false);
      recvs.push_back({st.send_to, back_k_[slot].data(), bytes,
                       RingTag(ctx_.call_id, Payload::kKeyGrad, st.step)});
      recvs.push_back({st.send_to, back_v_[slot].data(), bytes,
                       RingTag(ctx_.call_id, Payload::kValueGrad, st.step)});
    }
    return ctx_.comm->transport().Start(sends, recvs, StageName("backward", st, "dk/dv"));
  }

  // The return phase: kept buffers' summed partials go back to their owners.
  absl::Status ReturnRelayGrads(size_t fan) {
    const size_t kv_row = kv_row_;
    std::vector<std::vector<float>> deferred_k(sched_.stages.size()),
        deferred_v(sched_.stages.size());
    std::vector<SendOp> sends;
    std::vector<RecvOp> recvs;
    for (size_t i = 0; i < fan; ++i) {
      const Stage& st = sched_.stages[i];
      if (st.recv_from >= 0 && st.store_begin >= 0) {
        const size_t bytes = st.recv_rows * kv_row * sizeof(float);
        Tally(grad_moved_, *ctx_.comm, st.recv_from, 2 * bytes, /*sent=*/true);
        sends.push_back({st.recv_from, store_gk_.data() + st.store_begin * kv_row, bytes,
                         RingTag(ctx_.call_id, Payload::kRelayKeyGrad, st.step)});
        sends.push_back({st.recv_from, store_gv_.data() + st.store_begin * kv_row, bytes,
                         RingTag(ctx_.call_id, Payload::kRelayValueGrad, st.step)});
      }
      if (st.send_to >= 0 && st.send_grads_deferred) {
        deferred_k[i].resize(st.send_rows * kv_row);
        deferred_v[i].resize(st.send_rows * kv_row);
        const size_t bytes = deferred_k[i].size() * sizeof(float);
        Tally(grad_moved_, *ctx_.comm, st.send_to, 2 * bytes, /*sent=*/false);
        recvs.push_back({st.send_to, deferred_k[i].data(), bytes,
                         RingTag(ctx_.call_id, Payload::kRelayKeyGrad, st.step)});
        recvs.push_back({st.send_to, deferred_v[i].data(), bytes,
                         RingTag(ctx_.call_id, Payload::kRelayValueGrad, st.step)});
      }
    }
    if (sends.empty() && recvs.empty()) return absl::OkStatus();
    HSAP_ASSIGN_OR_RETURN(
        std::unique_ptr<Transport::Pending> pending,
        ctx_.comm->transport().Start(sends, recvs, "backward relay dk/dv return"));
    HSAP_RETURN_IF_ERROR(pending->Wait());
    for (size_t i = 0; i < fan; ++i) {
      const Stage& st = sched_.stages[i];
      if (st.send_to >= 0 && st.send_grads_deferred) {
        AddRows(st, deferred_k[i].data(), deferred_v[i].data());
      }
    }
    return absl::OkStatus();
  }

  const ExecContext& ctx_;
  const Schedule& sched_;
  const void* const k_;
  const void* const v_;
  const int64_t rows_;
  const int threads_;
  const size_t kv_row_;
  float* const dk32_;
  float* const dv32_;
  KvPipeline kv_;
  BackwardArgs args_;
  // Gradient partials: computed for the rows received at stage i (sent back to their
  // owner), and received for this rank's rows that the stage's destination used. A kept
  // buffer's partials are computed into the relay store and summed there.
  std::vector<float> part_k_[2], part_v_[2], back_k_[2], back_v_[2];
  std::vector<float> store_gk_, store_gv_;
  ExecTraffic grad_moved_;
};

}  // namespace

ExecTraffic ForwardTraffic(const Schedule& schedule, const AttentionDims& dims, DType dtype) {
  const uint64_t kv_row = 2ull * dims.heads_kv * dims.head_dim * DTypeSize(dtype);
  return {static_cast<uint64_t>(schedule.rows_sent()) * kv_row,
          static_cast<uint64_t>(schedule.rows_received()) * kv_row};
}

ExecTraffic BackwardTraffic(const Schedule& schedule, const AttentionDims& dims, DType dtype) {
  const uint64_t kv_row = 2ull * dims.heads_kv * dims.head_dim * DTypeSize(dtype);
  const uint64_t grad_row = 2ull * dims.heads_kv * dims.head_dim * sizeof(float);
  const uint64_t sent = static_cast<uint64_t>(schedule.rows_sent());
  const uint64_t received = static_cast<uint64_t>(schedule.rows_received());
  // K/V go out again; the gradients of the received rows come back as fp32.
  return {sent * kv_row + received * grad_row, received * kv_row + sent * grad_row};
}

absl::Status ExecuteForward(const ExecContext& ctx, const void* q, const void* k, const void* v,
                            void* out, float* lse, ExecTraffic* traffic) {
  const Schedule& sched = *ctx.schedule;
  const int64_t rows = sched.local_rows;
  const AttentionDims& dims = ctx.dims;
  const int threads = ctx.comm->num_threads();
  // Accumulators of our own: the caller's out and lse are written only on success.
  std::vector<float> out32(static_cast<size_t>(rows) * dims.heads_q * dims.head_dim);
  std::vector<float> lse32(static_cast<size_t>(rows) * dims.heads_q);
  InitPartial(out32.data(), lse32.data(), rows, dims.heads_q, dims.head_dim);

  ForwardArgs args;
  args.dims = dims;
  args.dtype = ctx.dtype;
  args.q = q;
  args.q_rows = rows;
  args.out = out32.data();
  args.lse = lse32.data();

  KvPipeline kv(ctx, k, v, "forward", Payload::kKey, Payload::kValue);
  auto on_stage = [&](size_t i) -> absl::Status {
    const Stage& st = sched.stages[i];
    if (st.recv_from < 0 || st.recv_work.empty()) return absl::OkStatus();
    args.k = kv.recv_k(i);
    args.v = kv.recv_v(i);
    args.k_rows = st.recv_rows;
    return ctx.kernels->Forward(args, st.recv_work, threads);
  };
  // The direct stages, then (relays only) the fan-outs, which send what the former kept.
  const size_t fan = sched.first_fan_out();
  absl::Status run = RunStaged(
      fan, [&](size_t i) { return kv.Post(i); },
      [&]() -> absl::Status {
        if (sched.local_work.empty()) return absl::OkStatus();
        args.k = k;
        args.v = v;
        args.k_rows = rows;
        return ctx.kernels->Forward(args, sched.local_work, threads);
      },
      on_stage);
  if (run.ok() && fan < sched.stages.size()) {
    run = RunStaged(
        sched.stages.size() - fan, [&](size_t i) { return kv.Post(fan + i); },
        [] { return absl::OkStatus(); }, [&](size_t i) { return on_stage(fan + i); });
  }
  if (!run.ok()) return run;
  StoreRows(ctx.dtype, out32, out);
  if (!lse32.empty()) std::memcpy(lse, lse32.data(), lse32.size() * sizeof(float));
  if (traffic != nullptr) *traffic = kv.moved();
  return absl::OkStatus();
}

absl::Status ExecuteBackward(const ExecContext& ctx, const void* dout, const void* q, const void* k,
                             const void* v, const void* out, const float* lse, void* dq, void* dk,
                             void* dv, ExecTraffic* traffic) {
  const Schedule& sched = *ctx.schedule;
  const int64_t rows = sched.local_rows;
  const AttentionDims& dims = ctx.dims;
  const size_t q_row = static_cast<size_t>(dims.heads_q) * dims.head_dim;
  const size_t kv_row = static_cast<size_t>(dims.heads_kv) * dims.head_dim;

  std::vector<float> delta(static_cast<size_t>(rows) * dims.heads_q);
  ComputeDelta(ctx.dtype, dout, out, rows, dims.heads_q, dims.head_dim, delta.data());
  std::vector<float> dq32(rows * q_row, 0.0f), dk32(rows * kv_row, 0.0f), dv32(rows * kv_row, 0.0f);
  RingBackward ring(ctx, dout, q, k, v, lse, delta.data(), dq32.data(), dk32.data(), dv32.data());
  HSAP_RETURN_IF_ERROR(ring.Run());
  StoreRows(ctx.dtype, dq32, dq);
  StoreRows(ctx.dtype, dk32, dk);
  StoreRows(ctx.dtype, dv32, dv);
  if (traffic != nullptr) *traffic = ring.moved();
  return absl::OkStatus();
}

}  // namespace hsap
