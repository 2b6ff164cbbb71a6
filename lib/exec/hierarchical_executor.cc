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
#include "lib/exec/protocol.h"
#include "lib/exec/staged.h"
#include "lib/sched/schedule.h"

namespace hsap {
namespace {

using protocol::PlanPayload;

size_t Bytes(int64_t rows, size_t heads, int width, size_t element_bytes) {
  return static_cast<size_t>(rows) * heads * static_cast<size_t>(width) * element_bytes;
}

// The group's all-to-all for one tensor. "Scatter": a tensor over this rank's shard with
// the layer's full head count (`full_heads`, `width` elements of `element_bytes` per head)
// becomes the group buffer [group_tokens, my heads, width]. "Gather" is the inverse.
class GroupExchange {
 public:
  GroupExchange(const HierExecContext& ctx, const char* pass) : ctx_(ctx), pass_(pass) {}

  static const std::vector<int>& HeadsOf(const GroupMember& m, bool q_like) {
    return q_like ? m.q_heads : m.kv_heads;
  }

  absl::Status Scatter(const void* src, int full_heads, int width, size_t es, bool q_like,
                       void* dst, PlanPayload kind, const char* what) {
    const RankHierarchy& r = *ctx_.rank;
    const size_t mine = HeadsOf(r.members[r.index], q_like).size();
    const ThdShape shape{r.shard_tokens, full_heads, width, es};
    const TokenRange all{0, r.shard_tokens};
    AllToAllVPlan plan;
    for (const GroupMember& m : r.members) {
      plan.group.push_back(m.rank);
      HSAP_ASSIGN_OR_RETURN(std::vector<ByteChunk> send,
                            ThdChunks(shape, absl::MakeConstSpan(&all, 1), HeadsOf(m, q_like)));
      plan.send_chunks.push_back(std::move(send));
      plan.recv_chunks.push_back(
          {ByteChunk{Bytes(m.row_begin, mine, width, es), Bytes(m.tokens, mine, width, es)}});
    }
    return Run(src, Bytes(r.shard_tokens, full_heads, width, es), dst,
               Bytes(r.group_tokens, mine, width, es), plan, kind, what);
  }

  // Inverse of Scatter. With `sum_into` (fp32 only), the members' contributions are not
  // placed but added, in member order, into sum_into [shard_tokens, full_heads, width],
  // which the caller zeroes; `dst` is then unused.
  absl::Status Gather(const void* src, int full_heads, int width, size_t es, bool q_like, void* dst,
                      PlanPayload kind, const char* what, float* sum_into = nullptr) {
    const RankHierarchy& r = *ctx_.rank;
    const size_t mine = HeadsOf(r.members[r.index], q_like).size();
    const ThdShape shape{r.shard_tokens, full_heads, width, es};
    const TokenRange all{0, r.shard_tokens};
    AllToAllVPlan plan;
    std::vector<size_t> staged_at;
    size_t staged = 0;
    for (const GroupMember& m : r.members) {
      plan.group.push_back(m.rank);
      plan.send_chunks.push_back(
          {ByteChunk{Bytes(m.row_begin, mine, width, es), Bytes(m.tokens, mine, width, es)}});
      const std::vector<int>& heads = HeadsOf(m, q_like);
      if (sum_into != nullptr) {
        const size_t bytes = Bytes(r.shard_tokens, heads.size(), width, es);
        plan.recv_chunks.push_back({ByteChunk{staged, bytes}});
        staged_at.push_back(staged);
        staged += bytes;
      } else {
        HSAP_ASSIGN_OR_RETURN(std::vector<ByteChunk> recv,
                              ThdChunks(shape, absl::MakeConstSpan(&all, 1), heads));
        plan.recv_chunks.push_back(std::move(recv));
      }
    }
    const size_t src_bytes = Bytes(r.group_tokens, mine, width, es);
    if (sum_into == nullptr) {
      return Run(src, src_bytes, dst, Bytes(r.shard_tokens, full_heads, width, es), plan, kind,
                 what);
    }
    std::vector<char> staging(staged);
    HSAP_RETURN_IF_ERROR(Run(src, src_bytes, staging.data(), staged, plan, kind, what));
    // Fixed order (member, token, head): bitwise reproducible.
    for (size_t j = 0; j < r.members.size(); ++j) {
      const std::vector<int>& heads = HeadsOf(r.members[j], q_like);
      const float* part = reinterpret_cast<const float*>(staging.data() + staged_at[j]);
      for (int64_t t = 0; t < r.shard_tokens; ++t) {
        for (size_t l = 0; l < heads.size(); ++l) {
          float* to = sum_into + (static_cast<size_t>(t) * full_heads + heads[l]) * width;
          const float* from = part + (static_cast<size_t>(t) * heads.size() + l) * width;
          for (int d = 0; d < width; ++d) to[d] += from[d];
        }
      }
    }
    return absl::OkStatus();
  }

  uint64_t bytes_sent() const { return sent_; }
  uint64_t bytes_received() const { return received_; }
  // The same bytes by link class.
  const ExecTraffic& links() const { return links_; }

 private:
  absl::Status Run(const void* send, size_t send_bytes, void* recv, size_t recv_bytes,
                   const AllToAllVPlan& plan, PlanPayload kind, const char* what) {
    HSAP_ASSIGN_OR_RETURN(AllToAllVStats stats,
                          AllToAllV(ctx_.comm->transport(), send, send_bytes, recv, recv_bytes,
                                    plan, protocol::GroupExchangeTag(ctx_.call_id, kind),
                                    absl::StrCat(pass_, " all-to-all ", what)));
    sent_ += stats.bytes_sent;
    received_ += stats.bytes_received;
    // One message each way per other member, of its chunks' bytes.
    auto total = [](const std::vector<ByteChunk>& chunks) {
      uint64_t n = 0;
      for (const ByteChunk& c : chunks) n += c.bytes;
      return n;
    };
    for (size_t m = 0; m < plan.group.size(); ++m) {
      if (plan.group[m] == ctx_.rank->rank) continue;
      Tally(links_, *ctx_.comm, plan.group[m], total(plan.send_chunks[m]), true);
      Tally(links_, *ctx_.comm, plan.group[m], total(plan.recv_chunks[m]), false);
    }
    return absl::OkStatus();
  }

  const HierExecContext& ctx_;
  const char* pass_;
  uint64_t sent_ = 0, received_ = 0;
  ExecTraffic links_;
};

std::string StepName(const char* pass, int step, const char* what,
                     const std::vector<KvTransfer>& from, const std::vector<KvTransfer>& to) {
  std::string name = absl::StrCat(pass, " step ", step, " (", what);
  const char* sep = " from rank";
  for (const KvTransfer& x : from) {
    absl::StrAppend(&name, sep, " ", x.peer);
    sep = ",";
  }
  sep = from.empty() ? " to rank" : "; to rank";
  for (const KvTransfer& x : to) {
    absl::StrAppend(&name, sep, " ", x.peer);
    sep = ",";
  }
  absl::StrAppend(&name, ")");
  return name;
}
std::string StepName(const char* pass, const SubRingStep& s, const char* what) {
  return StepName(pass, s.step, what, s.recv, s.send);
}

// The rows of a sub-ring send, as token ranges of the group buffer.
std::vector<TokenRange> SendRows(const SubRingStep& s) { return LocalRows(s.send_runs); }

// Calls fn(store_row, row) for the store rows of `runs`, packed in order into rows 0, 1, ...
template <typename Fn>
void ForEachStoreRow(const std::vector<TokenRun>& runs, Fn&& fn) {
  int64_t row = 0;
  for (const TokenRun& run : runs) {
    for (int64_t i = 0; i < run.length; ++i) fn(run.local_begin + i, row++);
  }
}

// Double-buffered K/V along the sub-ring steps of one rank. A message carries the K rows
// of its heads followed by the V rows, [rows, heads, D] each.
class SubRingKv {
 public:
  SubRingKv(const HierExecContext& ctx, const void* k, const void* v, const char* pass,
            PlanPayload tag)
      : ctx_(ctx), k_(k), v_(v), pass_(pass), tag_(tag) {}

  absl::StatusOr<std::unique_ptr<Transport::Pending>> Post(size_t i) {
    const RankHierarchy& r = *ctx_.rank;
    const SubRingStep& s = r.steps[i];
    Slot& slot = slots_[i % 2];
    const int D = ctx_.dims.head_dim;
    const size_t es = DTypeSize(ctx_.dtype);
    const int hkv = static_cast<int>(r.kv_heads.size());
    const ThdShape shape{r.group_tokens, hkv, D, es};
    std::vector<SendOp> sends;
    std::vector<RecvOp> recvs;
    slot.send.resize(s.send.size());
    const std::vector<TokenRange> rows = SendRows(s);
    for (size_t x = 0; x < s.send.size(); ++x) {
      const KvTransfer& t = s.send[x];
      const size_t half = Bytes(s.send_rows, t.heads.size(), D, es);
      slot.send[x].resize(2 * half);
      HSAP_RETURN_IF_ERROR(PackThd(k_, shape, rows, t.local_heads, slot.send[x].data(), half));
      HSAP_RETURN_IF_ERROR(
          PackThd(v_, shape, rows, t.local_heads, slot.send[x].data() + half, half));
      sends.push_back({t.peer, slot.send[x].data(), 2 * half,
                       protocol::PlanTag(ctx_.call_id, protocol::PlanMessage(tag_, s.step))});
      sent_ += 2 * half;
      Tally(links_, *ctx_.comm, t.peer, 2 * half, true);
    }
    // Node stores (hierarchy.h, 6.): one head's rows, K then V [rows, D], holder to keeper.
    const uint64_t store_tag =
        protocol::PlanTag(ctx_.call_id, protocol::PlanMessage(PlanPayload::kKvStore, s.step));
    slot.store_send.resize(s.store_send.size());
    for (size_t x = 0; x < s.store_send.size(); ++x) {
      const StoreTransfer& t = s.store_send[x];
      const size_t half = Bytes(t.rows, 1, D, es);
      std::vector<char>& msg = slot.store_send[x];
      msg.resize(2 * half);
      const std::vector<TokenRange> rows = LocalRows(t.runs);
      const int head[] = {t.local_head};
      HSAP_RETURN_IF_ERROR(PackThd(k_, shape, rows, head, msg.data(), half));
      HSAP_RETURN_IF_ERROR(PackThd(v_, shape, rows, head, msg.data() + half, half));
      sends.push_back({t.peer, msg.data(), 2 * half, store_tag});
      sent_ += 2 * half;
      Tally(links_, *ctx_.comm, t.peer, 2 * half, true);
    }
    const size_t half_all = Bytes(s.recv_rows, hkv, D, es);
    slot.kv.resize(2 * half_all);
    // One sender of every head, in our order: its message is the K/V buffer itself.
    slot.direct = s.recv.size() == 1 && s.fan_out_recv.empty() && s.store_fill.empty();
    slot.recv.resize(slot.direct ? 0 : s.recv.size());
    for (size_t x = 0; x < s.recv.size(); ++x) {
      const KvTransfer& t = s.recv[x];
      const size_t bytes = 2 * Bytes(s.recv_rows, t.heads.size(), D, es);
      char* into = slot.kv.data();
      if (!slot.direct) {
        slot.recv[x].resize(bytes);
        into = slot.recv[x].data();
      }
      recvs.push_back({t.peer, into, bytes,
                       protocol::PlanTag(ctx_.call_id, protocol::PlanMessage(tag_, s.step))});
      received_ += bytes;
      Tally(links_, *ctx_.comm, t.peer, bytes, false);
    }
    slot.store_recv.resize(s.store_recv.size());
    for (size_t x = 0; x < s.store_recv.size(); ++x) {
      const StoreTransfer& t = s.store_recv[x];
      std::vector<char>& msg = slot.store_recv[x];
      msg.resize(2 * Bytes(t.rows, 1, D, es));
      recvs.push_back({t.peer, msg.data(), msg.size(), store_tag});
      received_ += msg.size();
      Tally(links_, *ctx_.comm, t.peer, msg.size(), false);
    }
    return ctx_.comm->transport().Start(sends, recvs, StepName(pass_, s, "kv"));
  }

  // After step i's direct receives completed (every rank calls this at every step): keeps
  // the store segments that arrived, fills the buffer's heads that come from the store, runs
  // the step's fan-out inside the node (hierarchy.h, 5. and 6.), then sets the K and V
  // buffers [recv_rows, kv_heads, D] of its rows (unset when the step receives nothing).
  absl::Status Assemble(size_t i, const void** k, const void** v) {
    const RankHierarchy& r = *ctx_.rank;
    const SubRingStep& s = r.steps[i];
    Slot& slot = slots_[i % 2];
    const int D = ctx_.dims.head_dim;
    const size_t es = DTypeSize(ctx_.dtype);
    const int hkv = static_cast<int>(r.kv_heads.size());
    const size_t half_all = Bytes(s.recv_rows, hkv, D, es);
    const size_t row_bytes = static_cast<size_t>(D) * es;
    if (store_k_.empty() && r.store_rows > 0) {
      store_k_.resize(static_cast<size_t>(r.store_rows) * row_bytes);
      store_v_.resize(store_k_.size());
    }
    for (size_t x = 0; x < s.store_recv.size(); ++x) {
      const StoreTransfer& t = s.store_recv[x];
      const size_t half = static_cast<size_t>(t.rows) * row_bytes;
      const size_t at = static_cast<size_t>(t.runs.front().local_begin) * row_bytes;
      std::memcpy(store_k_.data() + at, slot.store_recv[x].data(), half);
      std::memcpy(store_v_.data() + at, slot.store_recv[x].data() + half, half);
    }
    if (s.recv_group < 0) return FanOut(s, nullptr, 0);
    if (!slot.direct) {
      const ThdShape shape{s.recv_rows, hkv, D, es};
      const TokenRange all{0, s.recv_rows};
      for (size_t x = 0; x < s.recv.size(); ++x) {
        const KvTransfer& t = s.recv[x];
        const size_t half = Bytes(s.recv_rows, t.heads.size(), D, es);
        HSAP_RETURN_IF_ERROR(UnpackThd(slot.recv[x].data(), half, shape,
                                       absl::MakeConstSpan(&all, 1), t.local_heads,
                                       slot.kv.data()));
        HSAP_RETURN_IF_ERROR(UnpackThd(slot.recv[x].data() + half, half, shape,
                                       absl::MakeConstSpan(&all, 1), t.local_heads,
                                       slot.kv.data() + half_all));
      }
    }
    for (const StoreTransfer& fill : s.store_fill) {
      ForEachStoreRow(fill.runs, [&](int64_t store_row, int64_t row) {
        const size_t to = (static_cast<size_t>(row) * hkv + fill.local_head) * row_bytes;
        std::memcpy(slot.kv.data() + to, store_k_.data() + store_row * row_bytes, row_bytes);
        std::memcpy(slot.kv.data() + half_all + to, store_v_.data() + store_row * row_bytes,
                    row_bytes);
      });
    }
    HSAP_RETURN_IF_ERROR(FanOut(s, slot.kv.data(), half_all));
    *k = slot.kv.data();
    *v = slot.kv.data() + half_all;
    return absl::OkStatus();
  }

  uint64_t sent() const { return sent_; }
  uint64_t received() const { return received_; }
  const ExecTraffic& links() const { return links_; }

 private:
  struct Slot {
    std::vector<std::vector<char>> send, recv, store_send, store_recv;
    std::vector<char> kv;
    bool direct = false;
  };
  // The gateway forwards heads of its receive buffer `kv` (K then V, half_all bytes each)
  // to the node's other receivers of step s; they unpack theirs into `kv`. One exchange,
  // completed here (its data arrived with the step's direct receives).
  absl::Status FanOut(const SubRingStep& s, char* kv, size_t half_all) {
    if (s.fan_out_send.empty() && s.fan_out_recv.empty() && s.store_fan_send.empty()) {
      return absl::OkStatus();
    }
    const int D = ctx_.dims.head_dim;
    const size_t es = DTypeSize(ctx_.dtype);
    const ThdShape shape{s.recv_rows, static_cast<int>(ctx_.rank->kv_heads.size()), D, es};
    const TokenRange all{0, s.recv_rows};
    const uint64_t tag =
        protocol::PlanTag(ctx_.call_id, protocol::PlanMessage(PlanPayload::kKvFanOut, s.step));
    std::vector<std::vector<char>> out(s.fan_out_send.size()), in(s.fan_out_recv.size()),
        from_store(s.store_fan_send.size());
    std::vector<SendOp> sends;
    std::vector<RecvOp> recvs;
    for (size_t x = 0; x < s.fan_out_send.size(); ++x) {
      const KvTransfer& t = s.fan_out_send[x];
      const size_t half = Bytes(s.recv_rows, t.heads.size(), D, es);
      out[x].resize(2 * half);
      HSAP_RETURN_IF_ERROR(
          PackThd(kv, shape, absl::MakeConstSpan(&all, 1), t.local_heads, out[x].data(), half));
      HSAP_RETURN_IF_ERROR(PackThd(kv + half_all, shape, absl::MakeConstSpan(&all, 1),
                                   t.local_heads, out[x].data() + half, half));
      sends.push_back({t.peer, out[x].data(), 2 * half, tag});
      sent_ += 2 * half;
      Tally(links_, *ctx_.comm, t.peer, 2 * half, true);
    }
    // Forwards from the store: [rows, heads, D] K then V, as a gateway's.
    const size_t row_bytes = static_cast<size_t>(D) * es;
    for (size_t x = 0; x < s.store_fan_send.size(); ++x) {
      const StoreFanOut& f = s.store_fan_send[x];
      const size_t heads = f.heads.size();
      const size_t half = Bytes(f.rows, heads, D, es);
      from_store[x].resize(2 * half);
      for (size_t j = 0; j < heads; ++j) {
        ForEachStoreRow(f.runs[j], [&](int64_t store_row, int64_t row) {
          const size_t to = (static_cast<size_t>(row) * heads + j) * row_bytes;
          std::memcpy(from_store[x].data() + to, store_k_.data() + store_row * row_bytes,
                      row_bytes);
          std::memcpy(from_store[x].data() + half + to, store_v_.data() + store_row * row_bytes,
                      row_bytes);
        });
      }
      sends.push_back({f.peer, from_store[x].data(), 2 * half, tag});
      sent_ += 2 * half;
      Tally(links_, *ctx_.comm, f.peer, 2 * half, true);
    }
    for (size_t x = 0; x < s.fan_out_recv.size(); ++x) {
      const KvTransfer& t = s.fan_out_recv[x];
      in[x].resize(2 * Bytes(s.recv_rows, t.heads.size(), D, es));
      recvs.push_back({t.peer, in[x].data(), in[x].size(), tag});
      received_ += in[x].size();
      Tally(links_, *ctx_.comm, t.peer, in[x].size(), false);
    }
    HSAP_RETURN_IF_ERROR(ctx_.comm->transport().Exchange(
        sends, recvs, StepName(pass_, s.step, "kv fan-out", s.fan_out_recv, s.fan_out_send)));
    for (size_t x = 0; x < s.fan_out_recv.size(); ++x) {
      const KvTransfer& t = s.fan_out_recv[x];
      const size_t half = in[x].size() / 2;
      HSAP_RETURN_IF_ERROR(
          UnpackThd(in[x].data(), half, shape, absl::MakeConstSpan(&all, 1), t.local_heads, kv));
      HSAP_RETURN_IF_ERROR(UnpackThd(in[x].data() + half, half, shape, absl::MakeConstSpan(&all, 1),
                                     t.local_heads, kv + half_all));
    }
    return absl::OkStatus();
  }

  const HierExecContext& ctx_;
  const void* k_;
  const void* v_;
  const char* pass_;
  PlanPayload tag_;
  Slot slots_[2];
  std::vector<char> store_k_, store_v_;  // the node store: [store_rows, D] each
  uint64_t sent_ = 0, received_ = 0;
  ExecTraffic links_;
};

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
absl::Status SubRingBackward(const HierExecContext& ctx, const GroupBackward& g, SubRingKv& ring,
                             uint64_t& grad_sent, uint64_t& grad_received, ExecTraffic& links) {
  const RankHierarchy& r = *ctx.rank;
  const int D = ctx.dims.head_dim;
  const int64_t N = r.group_tokens;
  const size_t hkv = r.kv_heads.size();
  const size_t kv_row = hkv * D;
  const int threads = ctx.comm->num_threads();
  BackwardArgs args;
  args.dims = LocalDims(ctx);
  args.dtype = ctx.dtype;
  args.q = g.gq;
  args.dout = g.gdout;
  args.lse = g.glse;
  args.delta = g.gdelta;
  args.q_rows = N;
  args.dq = g.dq32;
  auto local = [&]() -> absl::Status {
    if (r.local_work.empty()) return absl::OkStatus();
    args.k = g.gk;
    args.v = g.gv;
    args.k_rows = N;
    args.dk = g.dk32;
    args.dv = g.dv32;
    return ctx.kernels->Backward(args, r.local_work, threads);
  };
  // The node store's fp32 partials (hierarchy.h, 6.), [store_rows, D] each.
  std::vector<float> store_dk(static_cast<size_t>(r.store_rows) * D, 0.0f),
      store_dv(store_dk.size());
  // Adds rows of `part` ([rows, heads, D] at head `head`) into the store partial at the
  // store rows of `runs` (packed in order).
  auto add_to_store = [&](const float* part, size_t heads, size_t head,
                          const std::vector<TokenRun>& runs, float* store) {
    ForEachStoreRow(runs, [&](int64_t store_row, int64_t row) {
      const float* from = part + (static_cast<size_t>(row) * heads + head) * D;
      float* to = store + static_cast<size_t>(store_row) * D;
      for (int d = 0; d < D; ++d) to[d] += from[d];
    });
  };
  // The fan-out's partials (hierarchy.h, 5.): a fan-out receiver sends those of the heads
  // it got from its gateway (dK then dV, fp32); a gateway adds its receivers' to its own,
  // in fan-out order, before they go back to the holder with its other partials. A keeper
  // then adds the partials of its store-filled heads and those of its forwards from the
  // store into the store partial (6.).
  auto fan_in = [&](const SubRingStep& st, float* pk, float* pv) -> absl::Status {
    if (st.fan_out_send.empty() && st.fan_out_recv.empty() && st.store_fan_send.empty() &&
        st.store_fill.empty()) {
      return absl::OkStatus();
    }
    const ThdShape shape{st.recv_rows, static_cast<int>(hkv), D, sizeof(float)};
    const TokenRange all{0, st.recv_rows};
    const uint64_t tag =
        protocol::PlanTag(ctx.call_id, protocol::PlanMessage(PlanPayload::kKvGradFanIn, st.step));
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
      grad_sent += 2 * half;
      Tally(links, *ctx.comm, t.peer, 2 * half, true);
    }
    for (size_t x = 0; x < st.fan_out_send.size(); ++x) {
      in[x].resize(2 * Bytes(st.recv_rows, st.fan_out_send[x].heads.size(), D, sizeof(float)));
      recvs.push_back({st.fan_out_send[x].peer, in[x].data(), in[x].size(), tag});
      grad_received += in[x].size();
      Tally(links, *ctx.comm, st.fan_out_send[x].peer, in[x].size(), false);
    }
    std::vector<std::vector<char>> from_store(st.store_fan_send.size());
    for (size_t x = 0; x < st.store_fan_send.size(); ++x) {
      const StoreFanOut& f = st.store_fan_send[x];
      from_store[x].resize(2 * Bytes(f.rows, f.heads.size(), D, sizeof(float)));
      recvs.push_back({f.peer, from_store[x].data(), from_store[x].size(), tag});
      grad_received += from_store[x].size();
      Tally(links, *ctx.comm, f.peer, from_store[x].size(), false);
    }
    HSAP_RETURN_IF_ERROR(ctx.comm->transport().Exchange(
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
      add_to_store(pk, hkv, fill.local_head, fill.runs, store_dk.data());
      add_to_store(pv, hkv, fill.local_head, fill.runs, store_dv.data());
    }
    for (size_t x = 0; x < st.store_fan_send.size(); ++x) {
      const StoreFanOut& f = st.store_fan_send[x];
      const float* part = reinterpret_cast<const float*>(from_store[x].data());
      const size_t half = static_cast<size_t>(f.rows) * f.heads.size() * D;
      for (size_t j = 0; j < f.heads.size(); ++j) {
        add_to_store(part, f.heads.size(), j, f.runs[j], store_dk.data());
        add_to_store(part + half, f.heads.size(), j, f.runs[j], store_dv.data());
      }
    }
    return absl::OkStatus();
  };
  // Partials of the rows received at step i go back to their senders (dK then dV of the
  // sender's heads, fp32); those of our rows come back from the receivers of step i.
  std::vector<float> part_k[2], part_v[2];
  std::vector<std::vector<char>> out_msg[2], in_msg[2], store_out[2], store_in[2];
  auto add_returned = [&](size_t i) -> absl::Status {
    const SubRingStep& st = r.steps[i];
    const std::vector<TokenRange> rows = SendRows(st);
    for (size_t x = 0; x < st.send.size(); ++x) {
      const KvTransfer& t = st.send[x];
      const float* part = reinterpret_cast<const float*>(in_msg[i % 2][x].data());
      for (int which = 0; which < 2; ++which) {
        float* acc = which == 0 ? g.dk32 : g.dv32;
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
      const float* part = reinterpret_cast<const float*>(store_in[i % 2][x].data());
      for (float* acc : {g.dk32, g.dv32}) {
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
  };
  BackwardStages hooks;
  hooks.post_kv = [&](size_t i) { return ring.Post(i); };
  hooks.local = local;
  hooks.compute = [&](size_t i) -> absl::Status {
    const SubRingStep& st = r.steps[i];
    const size_t slot = i % 2;
    HSAP_RETURN_IF_ERROR(ring.Assemble(i, &args.k, &args.v));
    part_k[slot].assign(st.recv_rows * kv_row, 0.0f);
    part_v[slot].assign(st.recv_rows * kv_row, 0.0f);
    if (st.recv_group >= 0 && !st.recv_work.empty()) {
      args.k_rows = st.recv_rows;
      args.dk = part_k[slot].data();
      args.dv = part_v[slot].data();
      HSAP_RETURN_IF_ERROR(ctx.kernels->Backward(args, st.recv_work, threads));
    }
    return fan_in(st, part_k[slot].data(), part_v[slot].data());
  };
  hooks.post_grad = [&](size_t i) -> absl::StatusOr<std::unique_ptr<Transport::Pending>> {
    const SubRingStep& st = r.steps[i];
    const size_t slot = i % 2;
    const uint64_t tag =
        protocol::PlanTag(ctx.call_id, protocol::PlanMessage(PlanPayload::kKvGrad, st.step));
    std::vector<SendOp> sends;
    std::vector<RecvOp> recvs;
    if (st.recv_group >= 0) {
      const ThdShape shape{st.recv_rows, static_cast<int>(hkv), D, sizeof(float)};
      const TokenRange all{0, st.recv_rows};
      out_msg[slot].assign(st.recv.size(), {});
      for (size_t x = 0; x < st.recv.size(); ++x) {
        const KvTransfer& t = st.recv[x];
        const size_t half = Bytes(st.recv_rows, t.heads.size(), D, sizeof(float));
        out_msg[slot][x].resize(2 * half);
        HSAP_RETURN_IF_ERROR(PackThd(part_k[slot].data(), shape, absl::MakeConstSpan(&all, 1),
                                     t.local_heads, out_msg[slot][x].data(), half));
        HSAP_RETURN_IF_ERROR(PackThd(part_v[slot].data(), shape, absl::MakeConstSpan(&all, 1),
                                     t.local_heads, out_msg[slot][x].data() + half, half));
        sends.push_back({t.peer, out_msg[slot][x].data(), 2 * half, tag});
        grad_sent += 2 * half;
        Tally(links, *ctx.comm, t.peer, 2 * half, true);
      }
    }
    in_msg[slot].assign(st.send.size(), {});
    for (size_t x = 0; x < st.send.size(); ++x) {
      const size_t bytes = 2 * Bytes(st.send_rows, st.send[x].heads.size(), D, sizeof(float));
      in_msg[slot][x].resize(bytes);
      recvs.push_back({st.send[x].peer, in_msg[slot][x].data(), bytes, tag});
      grad_received += bytes;
      Tally(links, *ctx.comm, st.send[x].peer, bytes, false);
    }
    // Node stores (hierarchy.h, 6.): a segment's summed partials, [rows, D] dK then dV.
    const uint64_t store_tag =
        protocol::PlanTag(ctx.call_id, protocol::PlanMessage(PlanPayload::kKvStoreGrad, st.step));
    store_out[slot].assign(st.store_return_send.size(), {});
    for (size_t x = 0; x < st.store_return_send.size(); ++x) {
      const StoreTransfer& t = st.store_return_send[x];
      const size_t half = static_cast<size_t>(t.rows) * D;
      const size_t at = static_cast<size_t>(t.runs.front().local_begin) * D;
      std::vector<char>& msg = store_out[slot][x];
      msg.resize(2 * half * sizeof(float));
      std::memcpy(msg.data(), store_dk.data() + at, half * sizeof(float));
      std::memcpy(msg.data() + half * sizeof(float), store_dv.data() + at, half * sizeof(float));
      sends.push_back({t.peer, msg.data(), msg.size(), store_tag});
      grad_sent += msg.size();
      Tally(links, *ctx.comm, t.peer, msg.size(), true);
    }
    store_in[slot].assign(st.store_return_recv.size(), {});
    for (size_t x = 0; x < st.store_return_recv.size(); ++x) {
      const StoreTransfer& t = st.store_return_recv[x];
      std::vector<char>& msg = store_in[slot][x];
      msg.resize(2 * static_cast<size_t>(t.rows) * D * sizeof(float));
      recvs.push_back({t.peer, msg.data(), msg.size(), store_tag});
      grad_received += msg.size();
      Tally(links, *ctx.comm, t.peer, msg.size(), false);
    }
    return ctx.comm->transport().Start(sends, recvs, StepName("hier backward", st, "dk/dv"));
  };
  hooks.add_returned = add_returned;
  std::vector<int> steps;
  for (const SubRingStep& st : r.steps) steps.push_back(st.step);
  return RunBackwardStages(steps, hooks);
}

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
    HSAP_RETURN_IF_ERROR(SubRingBackward(ctx, g, ring, grad_sent, grad_received, grad_links));
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
