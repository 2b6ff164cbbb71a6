#include "lib/sched/transfers.h"

#include <utility>

namespace hsap {
namespace {

constexpr uint64_t kF32 = sizeof(float);

Transfer Send(int peer, TransferKind kind, uint64_t bytes) { return {peer, true, kind, bytes}; }
Transfer Recv(int peer, TransferKind kind, uint64_t bytes) { return {peer, false, kind, bytes}; }

// Sets each message's link class from the topology (empty: one node).
void SetLinkClass(std::vector<Transfer>& transfers, int rank, absl::Span<const int> node_of_rank) {
  if (node_of_rank.empty()) return;
  for (Transfer& t : transfers) t.inter_node = node_of_rank[t.peer] != node_of_rank[rank];
}

// Elements of `rows` rows of `heads` heads of `width` elements.
uint64_t Elements(int64_t rows, size_t heads, int width) {
  return static_cast<uint64_t>(rows) * heads * static_cast<uint64_t>(width);
}

// A group all-to-all of one tensor (hierarchical_executor.cc's GroupExchange). Scatter:
// this rank's shard, all heads -> each member's heads over the group buffer; gather is the
// inverse. q_like: the tensor has query heads (else KV heads).
Exchange GroupExchange(const RankHierarchy& r, const char* what, bool scatter, bool q_like,
                       int width, uint64_t element_bytes) {
  auto heads = [&](const GroupMember& m) { return q_like ? m.q_heads.size() : m.kv_heads.size(); };
  const GroupMember& me = r.members[r.index];
  Exchange x{what, {}};
  for (const GroupMember& m : r.members) {
    if (m.rank == r.rank) continue;
    // My shard rows for m's heads, and m's shard rows for my heads.
    const uint64_t mine_for_m = Elements(me.tokens, heads(m), width) * element_bytes;
    const uint64_t theirs_for_me = Elements(m.tokens, heads(me), width) * element_bytes;
    x.transfers.push_back(
        Send(m.rank, TransferKind::kAllToAll, scatter ? mine_for_m : theirs_for_me));
    x.transfers.push_back(
        Recv(m.rank, TransferKind::kAllToAll, scatter ? theirs_for_me : mine_for_m));
  }
  return x;
}

}  // namespace

HierTraffic PassProgram::Traffic() const {
  HierTraffic t;
  auto add_a2a = [&](const std::vector<Exchange>& xs) {
    for (const Exchange& x : xs) {
      for (const Transfer& m : x.transfers) (m.send ? t.a2a_sent : t.a2a_received) += m.bytes;
    }
  };
  add_a2a(before);
  add_a2a(after);
  for (const ProgramStage& s : stages) {
    for (const std::vector<Transfer>* list : {&s.kv, &s.fan_out_kv, &s.fan_in_grad, &s.grad}) {
      for (const Transfer& m : *list) (m.send ? t.ring_sent : t.ring_received) += m.bytes;
    }
  }
  for (const Transfer& m : returns) (m.send ? t.ring_sent : t.ring_received) += m.bytes;
  return t;
}

LinkBytes PassProgram::Links() const {
  LinkBytes b;
  auto add = [&](const Transfer& m) {
    if (m.inter_node) {
      (m.send ? b.inter_sent : b.inter_received) += m.bytes;
    } else {
      (m.send ? b.intra_sent : b.intra_received) += m.bytes;
    }
  };
  for (const std::vector<Exchange>* xs : {&before, &after}) {
    for (const Exchange& x : *xs) {
      for (const Transfer& m : x.transfers) add(m);
    }
  }
  for (const ProgramStage& s : stages) {
    for (const std::vector<Transfer>* list : {&s.kv, &s.fan_out_kv, &s.fan_in_grad, &s.grad}) {
      for (const Transfer& m : *list) add(m);
    }
  }
  for (const Transfer& m : returns) add(m);
  return b;
}

int64_t PassProgram::pairs() const {
  int64_t n = local_pairs;
  for (const ProgramStage& s : stages) n += s.pairs;
  return n;
}

RankProgram ProgramOf(const Schedule& schedule, int heads_q, int heads_kv, int head_dim,
                      DType dtype, absl::Span<const int> node_of_rank) {
  RankProgram p;
  p.rank = schedule.rank;
  p.query_heads = heads_q;
  p.query_rows = schedule.local_rows;
  const uint64_t row = Elements(1, heads_kv, head_dim);  // elements of one K (or V) row
  const uint64_t es = DTypeSize(dtype);
  const size_t fan = schedule.first_fan_out();
  // K then V (dK then dV): two messages of `rows` rows each way, as executor.cc posts them.
  auto two = [&](std::vector<Transfer>& to, int peer, bool send, TransferKind kind, int64_t rows,
                 uint64_t element_bytes) {
    const bool inter = !node_of_rank.empty() && node_of_rank[peer] != node_of_rank[p.rank];
    for (int m = 0; m < 2; ++m) {
      to.push_back({peer, send, kind, static_cast<uint64_t>(rows) * row * element_bytes, inter});
    }
  };
  for (PassProgram* pass : {&p.forward, &p.backward}) {
    const bool backward = pass == &p.backward;
    pass->local_pairs = schedule.local_work.visible_pairs;
    for (size_t i = 0; i < schedule.stages.size(); ++i) {
      const Stage& st = schedule.stages[i];
      ProgramStage s;
      s.step = st.step;
      s.fan_out = i >= fan;
      s.pairs = st.recv_from >= 0 ? st.recv_work.visible_pairs : 0;
      if (st.send_to >= 0) two(s.kv, st.send_to, true, TransferKind::kKv, st.send_rows, es);
      if (st.recv_from >= 0) two(s.kv, st.recv_from, false, TransferKind::kKv, st.recv_rows, es);
      if (backward) {
        // fp32 partials of the received rows back to their sender, of this rank's (or its
        // relay store's) rows from the stage's destination; a kept buffer's sums and the
        // partials of rows its receiver relays travel in the return group instead.
        if (st.recv_from >= 0) {
          two(st.store_begin < 0 ? s.grad : pass->returns, st.recv_from, true,
              st.store_begin < 0 ? TransferKind::kKvGrad : TransferKind::kKvGradReturn,
              st.recv_rows, kF32);
        }
        if (st.send_to >= 0) {
          two(st.send_grads_deferred ? pass->returns : s.grad, st.send_to, false,
              st.send_grads_deferred ? TransferKind::kKvGradReturn : TransferKind::kKvGrad,
              st.send_rows, kF32);
        }
      }
      pass->stages.push_back(std::move(s));
    }
  }
  return p;
}

RankProgram ProgramOf(const RankHierarchy& r, int head_dim, DType dtype,
                      absl::Span<const int> node_of_rank) {
  RankProgram p;
  p.rank = r.rank;
  p.query_heads = static_cast<int>(r.q_heads.size());
  p.query_rows = r.group_tokens;
  const uint64_t es = DTypeSize(dtype);
  const int D = head_dim;
  const bool q = true, kv = false, in = true, out = false;
  p.forward.before = {GroupExchange(r, "q", in, q, D, es), GroupExchange(r, "k", in, kv, D, es),
                      GroupExchange(r, "v", in, kv, D, es)};
  p.forward.after = {GroupExchange(r, "out", out, q, D, es),
                     GroupExchange(r, "lse", out, q, 1, kF32)};
  p.backward.before = {GroupExchange(r, "q", in, q, D, es), GroupExchange(r, "dout", in, q, D, es),
                       GroupExchange(r, "k", in, kv, D, es), GroupExchange(r, "v", in, kv, D, es),
                       GroupExchange(r, "lse and delta", in, q, 2, kF32)};
  const uint64_t kv_grad_es = r.kv_grad_partial ? kF32 : es;
  p.backward.after = {GroupExchange(r, "dq", out, q, D, es),
                      GroupExchange(r, "dk", out, kv, D, kv_grad_es),
                      GroupExchange(r, "dv", out, kv, D, kv_grad_es)};
  for (PassProgram* pass : {&p.forward, &p.backward}) {
    const bool backward = pass == &p.backward;
    pass->local_pairs = r.local_work.visible_pairs;
    for (const SubRingStep& st : r.steps) {
      ProgramStage s;
      s.step = st.step;
      s.pairs = st.recv_group >= 0 ? st.recv_work.visible_pairs : 0;
      // One message per peer carrying K then V of its heads (SubRingKv): sends, then
      // receives, in the hierarchy's order.
      for (const KvTransfer& x : st.send) {
        s.kv.push_back(
            Send(x.peer, TransferKind::kKv, 2 * Elements(st.send_rows, x.heads.size(), D) * es));
      }
      for (const StoreTransfer& x : st.store_send) {
        s.kv.push_back(Send(x.peer, TransferKind::kKvStore, 2 * Elements(x.rows, 1, D) * es));
      }
      for (const KvTransfer& x : st.recv) {
        s.kv.push_back(
            Recv(x.peer, TransferKind::kKv, 2 * Elements(st.recv_rows, x.heads.size(), D) * es));
      }
      for (const StoreTransfer& x : st.store_recv) {
        s.kv.push_back(Recv(x.peer, TransferKind::kKvStore, 2 * Elements(x.rows, 1, D) * es));
      }
      // The step's fan-out inside the node, completed before its kernels: forwarded K/V,
      // and in the backward the fp32 partials back to the gateway (hierarchy.h, 5.).
      for (const KvTransfer& x : st.fan_out_send) {
        s.fan_out_kv.push_back(Send(x.peer, TransferKind::kKvFanOut,
                                    2 * Elements(st.recv_rows, x.heads.size(), D) * es));
      }
      for (const StoreFanOut& f : st.store_fan_send) {
        s.fan_out_kv.push_back(
            Send(f.peer, TransferKind::kKvFanOut, 2 * Elements(f.rows, f.heads.size(), D) * es));
      }
      for (const KvTransfer& x : st.fan_out_recv) {
        s.fan_out_kv.push_back(Recv(x.peer, TransferKind::kKvFanOut,
                                    2 * Elements(st.recv_rows, x.heads.size(), D) * es));
      }
      if (backward) {
        for (const KvTransfer& x : st.fan_out_recv) {
          s.fan_in_grad.push_back(Send(x.peer, TransferKind::kKvGradFanIn,
                                       2 * Elements(st.recv_rows, x.heads.size(), D) * kF32));
        }
        for (const KvTransfer& x : st.fan_out_send) {
          s.fan_in_grad.push_back(Recv(x.peer, TransferKind::kKvGradFanIn,
                                       2 * Elements(st.recv_rows, x.heads.size(), D) * kF32));
        }
        for (const StoreFanOut& f : st.store_fan_send) {
          s.fan_in_grad.push_back(Recv(f.peer, TransferKind::kKvGradFanIn,
                                       2 * Elements(f.rows, f.heads.size(), D) * kF32));
        }

        for (const KvTransfer& x : st.recv) {
          s.grad.push_back(Send(x.peer, TransferKind::kKvGrad,
                                2 * Elements(st.recv_rows, x.heads.size(), D) * kF32));
        }
        for (const KvTransfer& x : st.send) {
          s.grad.push_back(Recv(x.peer, TransferKind::kKvGrad,
                                2 * Elements(st.send_rows, x.heads.size(), D) * kF32));
        }
        // A node store's summed partials, in its last participant's gradient group.
        for (const StoreTransfer& x : st.store_return_send) {
          s.grad.push_back(
              Send(x.peer, TransferKind::kKvGradReturn, 2 * Elements(x.rows, 1, D) * kF32));
        }
        for (const StoreTransfer& x : st.store_return_recv) {
          s.grad.push_back(
              Recv(x.peer, TransferKind::kKvGradReturn, 2 * Elements(x.rows, 1, D) * kF32));
        }
      }
      for (std::vector<Transfer>* list : {&s.kv, &s.fan_out_kv, &s.fan_in_grad, &s.grad}) {
        SetLinkClass(*list, r.rank, node_of_rank);
      }
      pass->stages.push_back(std::move(s));
    }
    for (std::vector<Exchange>* xs : {&pass->before, &pass->after}) {
      for (Exchange& x : *xs) SetLinkClass(x.transfers, r.rank, node_of_rank);
    }
  }
  return p;
}

}  // namespace hsap
