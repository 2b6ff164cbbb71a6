#include "lib/exec/hierarchical_executor.h"

#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "lib/comm/alltoallv.h"
#include "lib/comm/transport.h"
#include "lib/exec/executor.h"
#include "lib/exec/hier_transfers.h"
#include "lib/exec/protocol.h"
#include "lib/exec/staged.h"
#include "lib/sched/schedule.h"

namespace hsap {
namespace {

using hier_internal::Bytes;
using hier_internal::ForEachStoreRow;
using hier_internal::GroupExchange;
using hier_internal::SendRows;
using hier_internal::StepName;
using hier_internal::SubRingKv;
using protocol::PlanPayload;

// The kernels' view of this rank's heads.
AttentionDims LocalDims(const HierExecContext& ctx) {
  const RankHierarchy& r = *ctx.rank;
  AttentionDims d;
  d.heads_q = static_cast<int>(r.q_heads.size());
  d.heads_kv = static_cast<int>(r.kv_heads.size());
  d.head_dim = ctx.dims.head_dim;
  d.scale = ctx.dims.scale;
  d.kv_head_of_q = r.kv_head_of_q;
  return d;
}

// [heads, rows] <-> [rows, heads, width] at component c (fp32).
void HeadMajorToRows(const float* hm, int heads, int64_t rows, int width, int c, float* out) {
  for (int h = 0; h < heads; ++h) {
    for (int64_t t = 0; t < rows; ++t) out[(t * heads + h) * width + c] = hm[h * rows + t];
  }
}
void RowsToHeadMajor(const float* in, int heads, int64_t rows, int width, int c, float* hm) {
  for (int h = 0; h < heads; ++h) {
    for (int64_t t = 0; t < rows; ++t) hm[h * rows + t] = in[(t * heads + h) * width + c];
  }
}

absl::Status CheckContext(const HierExecContext& ctx) {
  if (ctx.comm == nullptr || ctx.rank == nullptr || ctx.kernels == nullptr) {
    return absl::InvalidArgumentError("hierarchical executor: comm, rank and kernels are required");
  }
  if (ctx.comm->rank() != ctx.rank->rank) {
    return absl::InvalidArgumentError(absl::StrCat("the hierarchy was built for rank ",
                                                   ctx.rank->rank, " but runs on rank ",
                                                   ctx.comm->rank()));
  }
  return absl::OkStatus();
}

// The group buffers of one backward on this rank: its query heads over the group's rows
// (q, dout, head-major lse and delta) and its K/V heads; the fp32 gradients accumulate in
// dq32, dk32 and dv32.
struct GroupBackward {
  const char* gq;
  const char* gdout;
  const float* glse;
  const float* gdelta;
  const char* gk;
  const char* gv;
  float* dq32;
  float* dk32;
  float* dv32;
};

// The sub-rings of a backward: this rank's query heads against the local keys and every
// step's received rows; the fp32 dK/dV partials of received rows go back to their senders
// one step later (RunBackwardStages), and those of this rank's rows are added into
// dk32/dv32 in step order. Adds the gradient bytes to `grad_sent` / `grad_received`.
class SubRingBackward {
 public:
  SubRingBackward(const HierExecContext& ctx, const GroupBackward& g, SubRingKv& ring,
                  uint64_t& grad_sent, uint64_t& grad_received, ExecTraffic& links)
      : ctx_(ctx),
        g_(g),
        ring_(ring),
        r_(*ctx.rank),
        D_(ctx.dims.head_dim),
        hkv_(r_.kv_heads.size()),
        threads_(ctx.comm->num_threads()),
        grad_sent_(grad_sent),
        grad_received_(grad_received),
        links_(links),
        // The node store's fp32 partials (hierarchy.h, 6.), [store_rows, D] each.
        store_dk_(static_cast<size_t>(r_.store_rows) * D_, 0.0f),
        store_dv_(store_dk_.size()) {
    args_.dims = LocalDims(ctx);
    args_.dtype = ctx.dtype;
    args_.q = g.gq;
    args_.dout = g.gdout;
    args_.lse = g.glse;
    args_.delta = g.gdelta;
    args_.q_rows = r_.group_tokens;
    args_.dq = g.dq32;
  }

  absl::Status Run() {
    BackwardStages hooks;
    hooks.post_kv = [&](size_t i) { return ring_.Post(i); };
    hooks.local = [&]() { return Local(); };
    hooks.compute = [&](size_t i) { return Compute(i); };
    hooks.post_grad = [&](size_t i) { return PostGrad(i); };
    hooks.add_returned = [&](size_t i) { return AddReturned(i); };
    std::vector<int> steps;
    for (const SubRingStep& st : r_.steps) steps.push_back(st.step);
    return RunBackwardStages(steps, hooks);
  }

 private:
  // The local keys: the group buffer's own K/V.
  absl::Status Local() {
    if (r_.local_work.empty()) return absl::OkStatus();
    args_.k = g_.gk;
    args_.v = g_.gv;
    args_.k_rows = r_.group_tokens;
    args_.dk = g_.dk32;
    args_.dv = g_.dv32;
    return ctx_.kernels->Backward(args_, r_.local_work, threads_);
  }

  // Step i's received rows: their partials into part_k/part_v of the step's slot, then the
  // fan-in.
  absl::Status Compute(size_t i) {
    const SubRingStep& st = r_.steps[i];
    const size_t slot = i % 2;
    const size_t kv_row = hkv_ * D_;
    HSAP_RETURN_IF_ERROR(ring_.Assemble(i, &args_.k, &args_.v));
    part_k_[slot].assign(st.recv_rows * kv_row, 0.0f);
    part_v_[slot].assign(st.recv_rows * kv_row, 0.0f);
    if (st.recv_group >= 0 && !st.recv_work.empty()) {
      args_.k_rows = st.recv_rows;
      args_.dk = part_k_[slot].data();
      args_.dv = part_v_[slot].data();
      HSAP_RETURN_IF_ERROR(ctx_.kernels->Backward(args_, st.recv_work, threads_));
    }
    return FanIn(st, part_k_[slot].data(), part_v_[slot].data());
  }

  // Adds rows of `part` ([rows, heads, D] at head `head`) into the store partial at the
  // store rows of `runs` (packed in order).
  void AddToStore(const float* part, size_t heads, size_t head, const std::vector<TokenRun>& runs,
                  float* store) const {
    const int D = D_;
    ForEachStoreRow(runs, [&](int64_t store_row, int64_t row) {
      const float* from = part + (static_cast<size_t>(row) * heads + head) * D;
      float* to = store + static_cast<size_t>(store_row) * D;
      for (int d = 0; d < D; ++d) to[d] += from[d];
    });
  }

  // The fan-out's partials (hierarchy.h, 5.): a fan-out receiver sends those of the heads
  // it got from its gateway (dK then dV, fp32); a gateway adds its receivers' to its own,
  // in fan-out order, before they go back to the holder with its other partials. A keeper
  // then adds the partials of its store-filled heads and those of its forwards from the
  // store into the store partial (6.).
  absl::Status FanIn(const SubRingStep& st, float* pk, float* pv) {
    if (st.fan_out_send.empty() && st.fan_out_recv.empty() && st.store_fan_send.empty() &&
        st.store_fill.empty()) {
      return absl::OkStatus();
    }
    const int D = D_;
    const size_t hkv = hkv_;
    const ThdShape shape{st.recv_rows, static_cast<int>(hkv), D, sizeof(float)};
    const TokenRange all{0, st.recv_rows};
    const uint64_t tag =
        protocol::PlanTag(ctx_.call_id, protocol::PlanMessage(PlanPayload::kKvGradFanIn, st.step));
    std::vector<std::vector<char>> out(st.fan_out_recv.size()), in(st.fan_out_send.size());
    std::vector<SendOp> sends;
    std::vector<RecvOp> recvs;
    for (size_t x = 0; x < st.fan_out_recv.size(); ++x) {
      const KvTransfer& t = st.fan_out_recv[x];
      const size_t half = Bytes(st.recv_rows, t.heads.size(), D, sizeof(float));
      out[x].resize(2 * half);
      HSAP_RETURN_IF_ERROR(
          PackThd(pk, shape, absl::MakeConstSpan(&all, 1), t.local_heads, out[x].data(), half));
      HSAP_RETURN_IF_ERROR(PackThd(pv, shape, absl::MakeConstSpan(&all, 1), t.local_heads,
                                   out[x].data() + half, half));
      sends.push_back({t.peer, out[x].data(), 2 * half, tag});
      grad_sent_ += 2 * half;
      Tally(links_, *ctx_.comm, t.peer, 2 * half, true);
    }
    for (size_t x = 0; x < st.fan_out_send.size(); ++x) {
      in[x].resize(2 * Bytes(st.recv_rows, st.fan_out_send[x].heads.size(), D, sizeof(float)));
      recvs.push_back({st.fan_out_send[x].peer, in[x].data(), in[x].size(), tag});
      grad_received_ += in[x].size();
      Tally(links_, *ctx_.comm, st.fan_out_send[x].peer, in[x].size(), false);
    }
    std::vector<std::vector<char>> from_store(st.store_fan_send.size());
    for (size_t x = 0; x < st.store_fan_send.size(); ++x) {
      const StoreFanOut& f = st.store_fan_send[x];
      from_store[x].resize(2 * Bytes(f.rows, f.heads.size(), D, sizeof(float)));
      recvs.push_back({f.peer, from_store[x].data(), from_store[x].size(), tag});
      grad_received_ += from_store[x].size();
      Tally(links_, *ctx_.comm, f.peer, from_store[x].size(), false);
    }
    HSAP_RETURN_IF_ERROR(ctx_.comm->transport().Exchange(
        sends, recvs,
        StepName("hier backward", st.step, "dk/dv fan-in", st.fan_out_send, st.fan_out_recv)));
    // Fixed order (receiver, dK then dV, row, head): bitwise reproducible.
    for (size_t x = 0; x < st.fan_out_send.size(); ++x) {
      const float* part = reinterpret_cast<const float*>(in[x].data());
      for (float* acc : {pk, pv}) {
        for (int64_t row = 0; row < st.recv_rows; ++row) {
          for (int l : st.fan_out_send[x].local_heads) {
            float* to = acc + (row * hkv + l) * D;
            for (int d = 0; d < D; ++d) to[d] += part[d];
            part += D;
          }
        }
      }
    }
    // The store: this step's filled heads, then the forwards' partials (list order, head
    // order, dK then dV).
    for (const StoreTransfer& fill : st.store_fill) {
      AddToStore(pk, hkv, fill.local_head, fill.runs, store_dk_.data());
      AddToStore(pv, hkv, fill.local_head, fill.runs, store_dv_.data());
    }
    for (size_t x = 0; x < st.store_fan_send.size(); ++x) {
      const StoreFanOut& f = st.store_fan_send[x];
      const float* part = reinterpret_cast<const float*>(from_store[x].data());
      const size_t half = static_cast<size_t>(f.rows) * f.heads.size() * D;
      for (size_t j = 0; j < f.heads.size(); ++j) {
        AddToStore(part, f.heads.size(), j, f.runs[j], store_dk_.data());
        AddToStore(part + half, f.heads.size(), j, f.runs[j], store_dv_.data());
      }
    }
    return absl::OkStatus();
  }

  // Partials of the rows received at step i go back to their senders (dK then dV of the
  // sender's heads, fp32); those of our rows come back from the receivers of step i; a
  // node store's summed partials (hierarchy.h, 6.) go from its keeper to the holder.
  absl::StatusOr<std::unique_ptr<Transport::Pending>> PostGrad(size_t i) {
    const SubRingStep& st = r_.steps[i];
    const size_t slot = i % 2;
    const int D = D_;
    const uint64_t tag =
        protocol::PlanTag(ctx_.call_id, protocol::PlanMessage(PlanPayload::kKvGrad, st.step));
    std::vector<SendOp> sends;
    std::vector<RecvOp> recvs;
    if (st.recv_group >= 0) {
      const ThdShape shape{st.recv_rows, static_cast<int>(hkv_), D, sizeof(float)};
      const TokenRange all{0, st.recv_rows};
      out_msg_[slot].assign(st.recv.size(), {});
      for (size_t x = 0; x < st.recv.size(); ++x) {
        const KvTransfer& t = st.recv[x];
        const size_t half = Bytes(st.recv_rows, t.heads.size(), D, sizeof(float));
        out_msg_[slot][x].resize(2 * half);
        HSAP_RETURN_IF_ERROR(PackThd(part_k_[slot].data(), shape, absl::MakeConstSpan(&all, 1),
                                     t.local_heads, out_msg_[slot][x].data(), half));
        HSAP_RETURN_IF_ERROR(PackThd(part_v_[slot].data(), shape, absl::MakeConstSpan(&all, 1),
                                     t.local_heads, out_msg_[slot][x].data() + half, half));
        sends.push_back({t.peer, out_msg_[slot][x].data(), 2 * half, tag});
        grad_sent_ += 2 * half;
        Tally(links_, *ctx_.comm, t.peer, 2 * half, true);
      }
    }
    in_msg_[slot].assign(st.send.size(), {});
    for (size_t x = 0; x < st.send.size(); ++x) {
      const size_t bytes = 2 * Bytes(st.send_rows, st.send[x].heads.size(), D, sizeof(float));
      in_msg_[slot][x].resize(bytes);
      recvs.push_back({st.send[x].peer, in_msg_[slot][x].data(), bytes, tag});
      grad_received_ += bytes;
      Tally(links_, *ctx_.comm, st.send[x].peer, bytes, false);
    }
    // Node stores (hierarchy.h, 6.): a segment's summed partials, [rows, D] dK then dV.
    const uint64_t store_tag =
        protocol::PlanTag(ctx_.call_id, protocol::PlanMessage(PlanPayload::kKvStoreGrad, st.step));
    store_out_[slot].assign(st.store_return_send.size(), {});
    for (size_t x = 0; x < st.store_return_send.size(); ++x) {
      const StoreTransfer& t = st.store_return_send[x];
      const size_t half = static_cast<size_t>(t.rows) * D;
      const size_t at = static_cast<size_t>(t.runs.front().local_begin) * D;
      std::vector<char>& msg = store_out_[slot][x];
      msg.resize(2 * half * sizeof(float));
      std::memcpy(msg.data(), store_dk_.data() + at, half * sizeof(float));
      std::memcpy(msg.data() + half * sizeof(float), store_dv_.data() + at, half * sizeof(float));
      sends.push_back({t.peer, msg.data(), msg.size(), store_tag});
      grad_sent_ += msg.size();
      Tally(links_, *ctx_.comm, t.peer, msg.size(), true);
    }
    store_in_[slot].assign(st.store_return_recv.size(), {});
    for (size_t x = 0; x < st.store_return_recv.size(); ++x) {
      const StoreTransfer& t = st.store_return_recv[x];
      std::vector<char>& msg = store_in_[slot][x];
      msg.resize(2 * static_cast<size_t>(t.rows) * D * sizeof(float));
      recvs.push_back({t.peer, msg.data(), msg.size(), store_tag});
      grad_received_ += msg.size();
      Tally(links_, *ctx_.comm, t.peer, msg.size(), false);
    }
    return ctx_.comm->transport().Start(sends, recvs, StepName("hier backward", st, "dk/dv"));
  }

  // The partials of this rank's rows returned at step i, added into dk32/dv32 (sends in
  // list order, dK then dV, row, head; then the store returns).
  absl::Status AddReturned(size_t i) {
    const SubRingStep& st = r_.steps[i];
    const int D = D_;
    const size_t hkv = hkv_;
    const std::vector<TokenRange> rows = SendRows(st);
    for (size_t x = 0; x < st.send.size(); ++x) {
      const KvTransfer& t = st.send[x];
      const float* part = reinterpret_cast<const float*>(in_msg_[i % 2][x].data());
      for (int which = 0; which < 2; ++which) {
        float* acc = which == 0 ? g_.dk32 : g_.dv32;
        for (const TokenRange& range : rows) {
          for (int64_t row = range.begin; row < range.end; ++row) {
            for (int l : t.local_heads) {
              float* to = acc + (row * hkv + l) * D;
              for (int d = 0; d < D; ++d) to[d] += part[d];
              part += D;
            }
          }
        }
      }
    }
    for (size_t x = 0; x < st.store_return_recv.size(); ++x) {
      const StoreTransfer& t = st.store_return_recv[x];
      const float* part = reinterpret_cast<const float*>(store_in_[i % 2][x].data());
      for (float* acc : {g_.dk32, g_.dv32}) {
        for (const TokenRange& range : LocalRows(t.runs)) {
          for (int64_t row = range.begin; row < range.end; ++row) {
            float* to = acc + (row * hkv + t.local_head) * D;
            for (int d = 0; d < D; ++d) to[d] += part[d];
            part += D;
          }
        }
      }
    }
    return absl::OkStatus();
  }

  const HierExecContext& ctx_;
  const GroupBackward& g_;
  SubRingKv& ring_;
  const RankHierarchy& r_;
  const int D_;
  const size_t hkv_;
  const int threads_;
  uint64_t& grad_sent_;
  uint64_t& grad_received_;
  ExecTraffic& links_;
  BackwardArgs args_;
  std::vector<float> store_dk_, store_dv_;
  // Per slot (step parity): the step's partials, the messages of its gradient exchange.
  std::vector<float> part_k_[2], part_v_[2];
  std::vector<std::vector<char>> out_msg_[2], in_msg_[2], store_out_[2], store_in_[2];
};

}  // namespace

absl::Status HierarchicalForward(const HierExecContext& ctx, const void* q, const void* k,
                                 const void* v, void* out, float* lse, HierTraffic* traffic,
                                 ExecTraffic* links) {
  HSAP_RETURN_IF_ERROR(CheckContext(ctx));
  const RankHierarchy& r = *ctx.rank;
  const int D = ctx.dims.head_dim, HQ = ctx.dims.heads_q, HKV = ctx.dims.heads_kv;
  const size_t es = DTypeSize(ctx.dtype);
  const int64_t N = r.group_tokens;
  const size_t hq = r.q_heads.size(), hkv = r.kv_heads.size();
  const int threads = ctx.comm->num_threads();

  GroupExchange a2a(ctx, "hier forward");
  std::vector<char> gq(Bytes(N, hq, D, es)), gk(Bytes(N, hkv, D, es)), gv(Bytes(N, hkv, D, es));
  HSAP_RETURN_IF_ERROR(a2a.Scatter(q, HQ, D, es, true, gq.data(), PlanPayload::kInQ, "q"));
  HSAP_RETURN_IF_ERROR(a2a.Scatter(k, HKV, D, es, false, gk.data(), PlanPayload::kInK, "k"));
  HSAP_RETURN_IF_ERROR(a2a.Scatter(v, HKV, D, es, false, gv.data(), PlanPayload::kInV, "v"));

  std::vector<float> out32(static_cast<size_t>(N) * hq * D), lse32(static_cast<size_t>(N) * hq);
  InitPartial(out32.data(), lse32.data(), N, static_cast<int>(hq), D);
  SubRingKv ring(ctx, gk.data(), gv.data(), "hier forward", PlanPayload::kKv);
  if (hq > 0) {
    ForwardArgs args;
    args.dims = LocalDims(ctx);
    args.dtype = ctx.dtype;
    args.q = gq.data();
    args.q_rows = N;
    args.out = out32.data();
    args.lse = lse32.data();
    absl::Status run = RunStaged(
        r.steps.size(), [&](size_t i) { return ring.Post(i); },
        [&]() -> absl::Status {
          if (r.local_work.empty()) return absl::OkStatus();
          args.k = gk.data();
          args.v = gv.data();
          args.k_rows = N;
          return ctx.kernels->Forward(args, r.local_work, threads);
        },
        [&](size_t i) -> absl::Status {
          const SubRingStep& st = r.steps[i];
          HSAP_RETURN_IF_ERROR(ring.Assemble(i, &args.k, &args.v));
          if (st.recv_group < 0 || st.recv_work.empty()) return absl::OkStatus();
          args.k_rows = st.recv_rows;
          return ctx.kernels->Forward(args, st.recv_work, threads);
        });
    if (!run.ok()) return run;
  }

  // Back to the shards' owners: out in the storage dtype, lse as [rows, heads, 1] fp32.
  std::vector<char> gout(gq.size());
  StoreRows(ctx.dtype, out32, gout.data());
  HSAP_RETURN_IF_ERROR(a2a.Gather(gout.data(), HQ, D, es, true, out, PlanPayload::kOutO, "out"));
  std::vector<float> lse_rows(static_cast<size_t>(N) * hq);
  HeadMajorToRows(lse32.data(), static_cast<int>(hq), N, 1, 0, lse_rows.data());
  std::vector<float> my_lse(static_cast<size_t>(r.shard_tokens) * HQ);
  HSAP_RETURN_IF_ERROR(a2a.Gather(lse_rows.data(), HQ, 1, sizeof(float), true, my_lse.data(),
                                  PlanPayload::kOutLse, "lse"));
  RowsToHeadMajor(my_lse.data(), HQ, r.shard_tokens, 1, 0, lse);
  if (traffic != nullptr) {
    *traffic = HierTraffic{a2a.bytes_sent(), a2a.bytes_received(), ring.sent(), ring.received()};
  }
  if (links != nullptr) {
    *links = a2a.links();
    AddTraffic(*links, ring.links());
  }
  return absl::OkStatus();
}

absl::Status HierarchicalBackward(const HierExecContext& ctx, const void* dout, const void* q,
                                  const void* k, const void* v, const void* out, const float* lse,
                                  void* dq, void* dk, void* dv, HierTraffic* traffic,
                                  ExecTraffic* links) {
  HSAP_RETURN_IF_ERROR(CheckContext(ctx));
  const RankHierarchy& r = *ctx.rank;
  const int D = ctx.dims.head_dim, HQ = ctx.dims.heads_q, HKV = ctx.dims.heads_kv;
  const size_t es = DTypeSize(ctx.dtype);
  const int64_t N = r.group_tokens, n_me = r.shard_tokens;
  const size_t hq = r.q_heads.size(), hkv = r.kv_heads.size();

  // lse and delta of the shard, as [rows, heads, 2] fp32, travel to the heads' holders.
  std::vector<float> delta(static_cast<size_t>(n_me) * HQ);
  ComputeDelta(ctx.dtype, dout, out, n_me, HQ, D, delta.data());
  std::vector<float> stats(static_cast<size_t>(n_me) * HQ * 2);
  HeadMajorToRows(lse, HQ, n_me, 2, 0, stats.data());
  HeadMajorToRows(delta.data(), HQ, n_me, 2, 1, stats.data());

  GroupExchange a2a(ctx, "hier backward");
  std::vector<char> gq(Bytes(N, hq, D, es)), gdout(gq.size()), gk(Bytes(N, hkv, D, es)),
      gv(gk.size());
  std::vector<float> gstats(static_cast<size_t>(N) * hq * 2);
  for (auto [src, heads, q_like, dst, kind, what] :
       {std::tuple{q, HQ, true, gq.data(), PlanPayload::kInQ, "q"},
        std::tuple{dout, HQ, true, gdout.data(), PlanPayload::kInDout, "dout"},
        std::tuple{k, HKV, false, gk.data(), PlanPayload::kInK, "k"},
        std::tuple{v, HKV, false, gv.data(), PlanPayload::kInV, "v"}}) {
    HSAP_RETURN_IF_ERROR(a2a.Scatter(src, heads, D, es, q_like, dst, kind, what));
  }
  HSAP_RETURN_IF_ERROR(a2a.Scatter(stats.data(), HQ, 2, sizeof(float), true, gstats.data(),
                                   PlanPayload::kInStats, "lse and delta"));
  std::vector<float> glse(static_cast<size_t>(N) * hq), gdelta(glse.size());
  RowsToHeadMajor(gstats.data(), static_cast<int>(hq), N, 2, 0, glse.data());
  RowsToHeadMajor(gstats.data(), static_cast<int>(hq), N, 2, 1, gdelta.data());

  const size_t kv_row = hkv * D;
  std::vector<float> dq32(static_cast<size_t>(N) * hq * D, 0.0f), dk32(N * kv_row, 0.0f),
      dv32(N * kv_row, 0.0f);
  SubRingKv ring(ctx, gk.data(), gv.data(), "hier backward", PlanPayload::kKv);
  uint64_t grad_sent = 0, grad_received = 0;
  ExecTraffic grad_links;
  if (hq > 0) {
    const GroupBackward g{gq.data(), gdout.data(), glse.data(), gdelta.data(), gk.data(),
                          gv.data(), dq32.data(),  dk32.data(), dv32.data()};
    HSAP_RETURN_IF_ERROR(SubRingBackward(ctx, g, ring, grad_sent, grad_received, grad_links).Run());
  }

  // Back to the owners: dQ rounded here; dK/dV rounded here when this rank holds the only
  // copy of its KV heads in the group, else summed over the holders in fp32 by the owner.
  std::vector<char> gdq(gq.size());
  StoreRows(ctx.dtype, dq32, gdq.data());
  HSAP_RETURN_IF_ERROR(a2a.Gather(gdq.data(), HQ, D, es, true, dq, PlanPayload::kOutDq, "dq"));
  if (r.kv_grad_partial) {
    for (auto [part, into, kind, what] : {std::tuple{&dk32, dk, PlanPayload::kOutDk, "dk"},
                                          std::tuple{&dv32, dv, PlanPayload::kOutDv, "dv"}}) {
      std::vector<float> sum(static_cast<size_t>(n_me) * HKV * D, 0.0f);
      HSAP_RETURN_IF_ERROR(
          a2a.Gather(part->data(), HKV, D, sizeof(float), false, nullptr, kind, what, sum.data()));
      StoreRows(ctx.dtype, sum, into);
    }
  } else {
    for (auto [part, into, kind, what] : {std::tuple{&dk32, dk, PlanPayload::kOutDk, "dk"},
                                          std::tuple{&dv32, dv, PlanPayload::kOutDv, "dv"}}) {
      std::vector<char> rounded(Bytes(N, hkv, D, es));
      StoreRows(ctx.dtype, *part, rounded.data());
      HSAP_RETURN_IF_ERROR(a2a.Gather(rounded.data(), HKV, D, es, false, into, kind, what));
    }
  }
  if (traffic != nullptr) {
    *traffic = HierTraffic{a2a.bytes_sent(), a2a.bytes_received(), ring.sent() + grad_sent,
                           ring.received() + grad_received};
  }
  if (links != nullptr) {
    *links = a2a.links();
    AddTraffic(*links, ring.links());
    AddTraffic(*links, grad_links);
  }
  return absl::OkStatus();
}

}  // namespace hsap
