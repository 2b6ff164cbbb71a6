#include "lib/exec/hier_transfers.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "lib/sched/schedule.h"

namespace hsap::hier_internal {

using protocol::PlanPayload;

absl::Status GroupExchange::Scatter(const void* src, int full_heads, int width, size_t es,
                                    bool q_like, void* dst, PlanPayload kind, const char* what) {
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

absl::Status GroupExchange::Gather(const void* src, int full_heads, int width, size_t es,
                                   bool q_like, void* dst, PlanPayload kind, const char* what,
                                   float* sum_into) {
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
    return Run(src, src_bytes, dst, Bytes(r.shard_tokens, full_heads, width, es), plan, kind, what);
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

absl::Status GroupExchange::Run(const void* send, size_t send_bytes, void* recv, size_t recv_bytes,
                                const AllToAllVPlan& plan, PlanPayload kind, const char* what) {
  HSAP_ASSIGN_OR_RETURN(AllToAllVStats stats,
                        AllToAllV(ctx_.comm->transport(), send, send_bytes, recv, recv_bytes, plan,
                                  protocol::GroupExchangeTag(ctx_.call_id, kind),
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

std::vector<TokenRange> SendRows(const SubRingStep& s) { return LocalRows(s.send_runs); }

absl::StatusOr<std::unique_ptr<Transport::Pending>> SubRingKv::Post(size_t i) {
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
    HSAP_RETURN_IF_ERROR(PackThd(v_, shape, rows, t.local_heads, slot.send[x].data() + half, half));
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

absl::Status SubRingKv::Assemble(size_t i, const void** k, const void** v) {
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
      HSAP_RETURN_IF_ERROR(UnpackThd(slot.recv[x].data(), half, shape, absl::MakeConstSpan(&all, 1),
                                     t.local_heads, slot.kv.data()));
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

absl::Status SubRingKv::FanOut(const SubRingStep& s, char* kv, size_t half_all) {
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
    HSAP_RETURN_IF_ERROR(PackThd(kv + half_all, shape, absl::MakeConstSpan(&all, 1), t.local_heads,
                                 out[x].data() + half, half));
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
        std::memcpy(from_store[x].data() + to, store_k_.data() + store_row * row_bytes, row_bytes);
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

}  // namespace hsap::hier_internal
