#include "lib/cuda/exec/gpu_hier_executor.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "lib/cuda/exec/exec_util.h"
#include "lib/cuda/exec/nccl_lowering.h"
#include "lib/cuda/runtime/buffer_pool.h"
#include "lib/exec/protocol.h"
#include "lib/exec/staged.h"
#include "lib/sched/schedule.h"

namespace hsap::cuda {
namespace {

using protocol::PlanPayload;
uint64_t Payload(PlanPayload kind, int step = 0) { return protocol::PlanMessage(kind, step); }

size_t Bytes(int64_t rows, size_t heads, int width, size_t es) {
  return static_cast<size_t>(rows) * heads * static_cast<size_t>(width) * es;
}

const std::vector<int>& HeadsOf(const GroupMember& m, bool q_like) {
  return q_like ? m.q_heads : m.kv_heads;
}

// Group buffer rows [row_begin, row_begin + tokens) of a [N, heads, width] tensor.
ByteChunk RowsChunk(const GroupMember& m, size_t heads, int width, size_t es) {
  return {Bytes(m.row_begin, heads, width, es), Bytes(m.tokens, heads, width, es)};
}

// One exchange inside the group: `chunks(m)` gives the source chunks of the message to member
// m and the destination chunks of the message from m; this rank's own share is copied
// locally. `add`: fp32 partial sums added into the destination.
using SrcDst = std::pair<std::vector<ByteChunk>, std::vector<ByteChunk>>;
absl::StatusOr<ExchangeProgram> GroupProgram(
    const RankHierarchy& r, PlanPayload kind, bool add,
    const std::function<absl::StatusOr<SrcDst>(const GroupMember&)>& chunks) {
  ExchangeBuilder b(add);
  for (const GroupMember& m : r.members) {
    HSAP_ASSIGN_OR_RETURN(SrcDst c, chunks(m));
    if (m.rank == r.rank) {
      HSAP_RETURN_IF_ERROR(b.Self(c.first, c.second));
    } else {
      b.Send(m.rank, Payload(kind), c.first);
      b.Receive(m.rank, Payload(kind), c.second);
    }
  }
  return std::move(b).Build();
}

// The all-to-all of one tensor: shard [n_me, full, width] -> group buffer [N, mine, width]
// (in), or back (`back`; `add`: fp32 partial sums added by the owner).
absl::StatusOr<ExchangeProgram> AllToAllProgram(const RankHierarchy& r, int full, int width,
                                                size_t es, bool q_like, PlanPayload kind, bool back,
                                                bool add = false) {
  const size_t mine = HeadsOf(r.members[r.index], q_like).size();
  const ThdShape shape{r.shard_tokens, full, width, es};
  const TokenRange all{0, r.shard_tokens};
  return GroupProgram(r, kind, add, [&](const GroupMember& m) -> absl::StatusOr<SrcDst> {
    HSAP_ASSIGN_OR_RETURN(std::vector<ByteChunk> shard,
                          ThdChunks(shape, absl::MakeConstSpan(&all, 1), HeadsOf(m, q_like)));
    std::vector<ByteChunk> rows = {RowsChunk(m, mine, width, es)};
    return back ? SrcDst{std::move(rows), std::move(shard)}
                : SrcDst{std::move(shard), std::move(rows)};
  });
}

// lse of the holder [hq, N] fp32 -> the owner's lse [HQ, n_me] (one piece per head).
absl::StatusOr<ExchangeProgram> LseBackProgram(const RankHierarchy& r) {
  const int64_t N = r.group_tokens, n_me = r.shard_tokens;
  const size_t hq = r.q_heads.size(), f = sizeof(float);
  return GroupProgram(r, PlanPayload::kOutLse, false,
                      [&](const GroupMember& m) -> absl::StatusOr<SrcDst> {
                        SrcDst c;
                        for (size_t l = 0; l < hq; ++l)
                          c.first.push_back({(l * N + m.row_begin) * f, m.tokens * f});
                        for (int h : m.q_heads) c.second.push_back({h * n_me * f, n_me * f});
                        return c;
                      });
}

// The owner's (lse, delta) [2, HQ, n_me] -> the holders' [2, hq, N] (one piece per head).
absl::StatusOr<ExchangeProgram> StatsInProgram(const RankHierarchy& r, int HQ) {
  const int64_t N = r.group_tokens, n_me = r.shard_tokens;
  const size_t hq = r.q_heads.size(), f = sizeof(float);
  return GroupProgram(
      r, PlanPayload::kInStats, false, [&](const GroupMember& m) -> absl::StatusOr<SrcDst> {
        SrcDst c;
        for (size_t k = 0; k < 2; ++k) {
          for (int h : m.q_heads) c.first.push_back({((k * HQ + h) * n_me) * f, n_me * f});
          for (size_t l = 0; l < hq; ++l) {
            c.second.push_back({((k * hq + l) * N + m.row_begin) * f, m.tokens * f});
          }
        }
        return c;
      });
}

// `chunks` again at `shift` bytes further (the V half after the K half).
std::vector<ByteChunk> KThenV(const std::vector<ByteChunk>& k, size_t shift) {
  std::vector<ByteChunk> out = k;
  for (const ByteChunk& c : k) out.push_back({c.offset + shift, c.bytes});
  return out;
}

std::vector<TokenRange> SendRows(const SubRingStep& s) { return LocalRows(s.send_runs); }

// Sub-ring step K/V: [gk | gv] of the group buffer -> the step's receive slot [k | v].
absl::StatusOr<ExchangeProgram> RingKvProgram(const RankHierarchy& r, const SubRingStep& s, int D,
                                              size_t es) {
  const size_t hkv = r.kv_heads.size();
  const ThdShape group{r.group_tokens, static_cast<int>(hkv), D, es};
  const ThdShape slot{s.recv_rows, static_cast<int>(hkv), D, es};
  const std::vector<TokenRange> rows = SendRows(s);
  const TokenRange all{0, s.recv_rows};
  ExchangeBuilder b;
  for (const KvTransfer& t : s.send) {
    HSAP_ASSIGN_OR_RETURN(std::vector<ByteChunk> k, ThdChunks(group, rows, t.local_heads));
    b.Send(t.peer, Payload(PlanPayload::kKv, s.step), KThenV(k, Bytes(r.group_tokens, hkv, D, es)));
  }
  for (const KvTransfer& t : s.recv) {
    HSAP_ASSIGN_OR_RETURN(std::vector<ByteChunk> k,
                          ThdChunks(slot, absl::MakeConstSpan(&all, 1), t.local_heads));
    b.Receive(t.peer, Payload(PlanPayload::kKv, s.step), KThenV(k, Bytes(s.recv_rows, hkv, D, es)));
  }
  return std::move(b).Build();
}

// Sub-ring step dK/dV partials (fp32): the slot's [pk | pv] back to the senders, added into
// the holders' [dk32 | dv32].
absl::StatusOr<ExchangeProgram> RingGradProgram(const RankHierarchy& r, const SubRingStep& s,
                                                int D) {
  const size_t hkv = r.kv_heads.size(), f = sizeof(float);
  const ThdShape group{r.group_tokens, static_cast<int>(hkv), D, f};
  const ThdShape slot{s.recv_rows, static_cast<int>(hkv), D, f};
  const std::vector<TokenRange> rows = SendRows(s);
  const TokenRange all{0, s.recv_rows};
  ExchangeBuilder b(/*add=*/true);
  for (const KvTransfer& t : s.recv) {
    HSAP_ASSIGN_OR_RETURN(std::vector<ByteChunk> k,
                          ThdChunks(slot, absl::MakeConstSpan(&all, 1), t.local_heads));
    b.Send(t.peer, Payload(PlanPayload::kKvGrad, s.step), KThenV(k, Bytes(s.recv_rows, hkv, D, f)));
  }
  for (const KvTransfer& t : s.send) {
    HSAP_ASSIGN_OR_RETURN(std::vector<ByteChunk> k, ThdChunks(group, rows, t.local_heads));
    b.Receive(t.peer, Payload(PlanPayload::kKvGrad, s.step),
              KThenV(k, Bytes(r.group_tokens, hkv, D, f)));
  }
  return std::move(b).Build();
}

// Node fan-out of a step's K/V (hierarchy.h, 5.): the gateway forwards heads of its receive
// slot [k | v] to the node's other receivers, which place them in theirs.
absl::StatusOr<ExchangeProgram> FanOutKvProgram(const RankHierarchy& r, const SubRingStep& s, int D,
                                                size_t es) {
  const size_t hkv = r.kv_heads.size();
  const ThdShape slot{s.recv_rows, static_cast<int>(hkv), D, es};
  const TokenRange all{0, s.recv_rows};
  const uint64_t tag = Payload(PlanPayload::kKvFanOut, s.step);
  ExchangeBuilder b;
  for (const KvTransfer& t : s.fan_out_send) {
    HSAP_ASSIGN_OR_RETURN(std::vector<ByteChunk> k,
                          ThdChunks(slot, absl::MakeConstSpan(&all, 1), t.local_heads));
    b.Send(t.peer, tag, KThenV(k, Bytes(s.recv_rows, hkv, D, es)));
  }
  for (const KvTransfer& t : s.fan_out_recv) {
    HSAP_ASSIGN_OR_RETURN(std::vector<ByteChunk> k,
                          ThdChunks(slot, absl::MakeConstSpan(&all, 1), t.local_heads));
    b.Receive(t.peer, tag, KThenV(k, Bytes(s.recv_rows, hkv, D, es)));
  }
  return std::move(b).Build();
}

// The fan-in of a step's fp32 dK/dV partials (the fan-out backwards), as legs of one stage:
// leg 0 sends this rank's partials [pk | pv] of the heads it got from gateways; leg 1 + x
// adds those of fan-out receiver x into the gateway's partials. One leg per receiver, so
// the gateway adds them one launch after another in fan-out order (bitwise reproducible).
absl::StatusOr<std::vector<ExchangeProgram>> FanInGradPrograms(const RankHierarchy& r,
                                                               const SubRingStep& s, int D) {
  const size_t hkv = r.kv_heads.size(), f = sizeof(float);
  const ThdShape slot{s.recv_rows, static_cast<int>(hkv), D, f};
  const TokenRange all{0, s.recv_rows};
  const uint64_t tag = Payload(PlanPayload::kKvGradFanIn, s.step);
  std::vector<ExchangeProgram> legs;
  ExchangeBuilder sends(/*add=*/true);
  for (const KvTransfer& t : s.fan_out_recv) {
    HSAP_ASSIGN_OR_RETURN(std::vector<ByteChunk> k,
                          ThdChunks(slot, absl::MakeConstSpan(&all, 1), t.local_heads));
    sends.Send(t.peer, tag, KThenV(k, Bytes(s.recv_rows, hkv, D, f)));
  }
  HSAP_ASSIGN_OR_RETURN(ExchangeProgram leg, std::move(sends).Build());
  legs.push_back(std::move(leg));
  for (const KvTransfer& t : s.fan_out_send) {
    HSAP_ASSIGN_OR_RETURN(std::vector<ByteChunk> k,
                          ThdChunks(slot, absl::MakeConstSpan(&all, 1), t.local_heads));
    ExchangeBuilder one(/*add=*/true);
    one.Receive(t.peer, tag, KThenV(k, Bytes(s.recv_rows, hkv, D, f)));
    HSAP_ASSIGN_OR_RETURN(ExchangeProgram in, std::move(one).Build());
    legs.push_back(std::move(in));
  }
  return legs;
}

// ---- Node stores (hierarchy.h, 6.) ----------------------------------------------------
// The keeper's store is [sk | sv], [store_rows, D] each (one KV head per row), in the
// storage dtype; backward adds its fp32 partials [spk | spv] of the same shape.

ThdShape StoreShape(const RankHierarchy& r, int D, size_t es) { return {r.store_rows, 1, D, es}; }

// Store rows of `runs` ([rows, D] of one head) as chunks of the store, K half; checks that
// they are the `rows` the tables promise.
absl::StatusOr<std::vector<ByteChunk>> StoreChunks(const RankHierarchy& r,
                                                   const std::vector<TokenRun>& runs, int64_t rows,
                                                   int D, size_t es) {
  int64_t total = 0;
  for (const TokenRun& run : runs) total += run.length;
  if (total != rows) {
    return absl::InternalError(
        absl::StrCat("a node store segment lists ", total, " rows in its runs, not ", rows));
  }
  const int head = 0;
  return ThdChunks(StoreShape(r, D, es), LocalRows(runs), absl::MakeConstSpan(&head, 1));
}

// A store forward's rows as chunks of the store, K half: [rows, heads, D] row-major, row r
// of head j at store row runs[j] (packed in order).
absl::StatusOr<std::vector<ByteChunk>> StoreFanChunks(const RankHierarchy& r, const StoreFanOut& f,
                                                      int D, size_t es) {
  if (f.runs.size() != f.heads.size()) {
    return absl::InternalError("a node store forward lists runs for other heads than it sends");
  }
  std::vector<std::vector<int64_t>> rows_of(f.heads.size());
  for (size_t j = 0; j < f.runs.size(); ++j) {
    for (const TokenRun& run : f.runs[j]) {
      for (int64_t x = 0; x < run.length; ++x) rows_of[j].push_back(run.local_begin + x);
    }
    if (static_cast<int64_t>(rows_of[j].size()) != f.rows) {
      return absl::InternalError(absl::StrCat("a node store forward lists ", rows_of[j].size(),
                                              " rows of a head, not ", f.rows));
    }
  }
  const size_t row_bytes = Bytes(1, 1, D, es);
  std::vector<ByteChunk> chunks;
  for (int64_t x = 0; x < f.rows; ++x) {
    for (const std::vector<int64_t>& rows : rows_of) {
      if (rows[x] < 0 || rows[x] >= r.store_rows) {
        return absl::InternalError("a node store forward reads outside the store");
      }
      chunks.push_back({static_cast<size_t>(rows[x]) * row_bytes, row_bytes});
    }
  }
  return chunks;
}

// A step's store K/V (with the step's K/V stage): this rank's group-buffer rows to keepers
// (from [gk | gv]) and the segments arriving into its store [sk | sv].
absl::StatusOr<ExchangeProgram> StoreKvProgram(const RankHierarchy& r, const SubRingStep& s, int D,
                                               size_t es) {
  const size_t hkv = r.kv_heads.size();
  const ThdShape group{r.group_tokens, static_cast<int>(hkv), D, es};
  const uint64_t tag = Payload(PlanPayload::kKvStore, s.step);
  ExchangeBuilder b;
  for (const StoreTransfer& x : s.store_send) {
    HSAP_ASSIGN_OR_RETURN(
        std::vector<ByteChunk> k,
        ThdChunks(group, LocalRows(x.runs), absl::MakeConstSpan(&x.local_head, 1)));
    b.Send(x.peer, tag, KThenV(k, Bytes(r.group_tokens, hkv, D, es)));
  }
  for (const StoreTransfer& x : s.store_recv) {
    HSAP_ASSIGN_OR_RETURN(std::vector<ByteChunk> k, StoreChunks(r, x.runs, x.rows, D, es));
    b.Receive(x.peer, tag, KThenV(k, Bytes(r.store_rows, 1, D, es)));
  }
  return std::move(b).Build();
}

// A keeper's fills of its step buffer from its store, as self copies: forward, store rows
// (packed) -> slot rows 0..recv_rows of the filled head; `grad`, the fp32 step partial of
// those rows added back into the store partial.
absl::StatusOr<ExchangeProgram> StoreFillProgram(const RankHierarchy& r, const SubRingStep& s,
                                                 int D, size_t es, bool grad) {
  const size_t hkv = r.kv_heads.size();
  const ThdShape slot{s.recv_rows, static_cast<int>(hkv), D, es};
  const TokenRange all{0, s.recv_rows};
  ExchangeBuilder b(/*add=*/grad);
  for (const StoreTransfer& x : s.store_fill) {
    HSAP_ASSIGN_OR_RETURN(std::vector<ByteChunk> store, StoreChunks(r, x.runs, s.recv_rows, D, es));
    HSAP_ASSIGN_OR_RETURN(
        std::vector<ByteChunk> rows,
        ThdChunks(slot, absl::MakeConstSpan(&all, 1), absl::MakeConstSpan(&x.local_head, 1)));
    store = KThenV(store, Bytes(r.store_rows, 1, D, es));
    rows = KThenV(rows, Bytes(s.recv_rows, hkv, D, es));
    HSAP_RETURN_IF_ERROR(grad ? b.Self(rows, store) : b.Self(store, rows));
  }
  return std::move(b).Build();
}

// A step's forwards from the store to receivers of other groups (sends of the step's
// fan-out exchange, tag kKvFanOut), from [sk | sv].
absl::StatusOr<ExchangeProgram> StoreFanOutProgram(const RankHierarchy& r, const SubRingStep& s,
                                                   int D, size_t es) {
  ExchangeBuilder b;
  for (const StoreFanOut& f : s.store_fan_send) {
    HSAP_ASSIGN_OR_RETURN(std::vector<ByteChunk> k, StoreFanChunks(r, f, D, es));
    b.Send(f.peer, Payload(PlanPayload::kKvFanOut, s.step),
           KThenV(k, Bytes(r.store_rows, 1, D, es)));
  }
  return std::move(b).Build();
}

// Backward, in the step's fan-in exchange: the fp32 partials of each store forward's
// receiver, added into the store partial [spk | spv] (one leg per receiver, in list order).
absl::StatusOr<std::vector<ExchangeProgram>> StoreFanInPrograms(const RankHierarchy& r,
                                                                const SubRingStep& s, int D) {
  const size_t f32 = sizeof(float);
  std::vector<ExchangeProgram> legs;
  for (const StoreFanOut& f : s.store_fan_send) {
    HSAP_ASSIGN_OR_RETURN(std::vector<ByteChunk> k, StoreFanChunks(r, f, D, f32));
    ExchangeBuilder one(/*add=*/true);
    one.Receive(f.peer, Payload(PlanPayload::kKvGradFanIn, s.step),
                KThenV(k, Bytes(r.store_rows, 1, D, f32)));
    HSAP_ASSIGN_OR_RETURN(ExchangeProgram in, std::move(one).Build());
    legs.push_back(std::move(in));
  }
  return legs;
}

// In the gradient group of a store's last participant step (hierarchy.h 6.): leg 0 sends
// the keeper's store partial sums of the step's store_return_send (tag kKvStoreGrad); leg
// 1 + x adds the sums of its x-th store_return_recv into the holder's [dk32 | dv32] (one
// add per message, in list order, after the step's other returned partials).
absl::StatusOr<std::vector<ExchangeProgram>> StoreReturnPrograms(const RankHierarchy& r,
                                                                 const SubRingStep& s, int D) {
  const size_t hkv = r.kv_heads.size(), f32 = sizeof(float);
  const ThdShape group{r.group_tokens, static_cast<int>(hkv), D, f32};
  const uint64_t tag = Payload(PlanPayload::kKvStoreGrad, s.step);
  std::vector<ExchangeProgram> legs;
  ExchangeBuilder sends(/*add=*/true);
  for (const StoreTransfer& x : s.store_return_send) {
    HSAP_ASSIGN_OR_RETURN(std::vector<ByteChunk> k, StoreChunks(r, x.runs, x.rows, D, f32));
    sends.Send(x.peer, tag, KThenV(k, Bytes(r.store_rows, 1, D, f32)));
  }
  HSAP_ASSIGN_OR_RETURN(ExchangeProgram leg, std::move(sends).Build());
  legs.push_back(std::move(leg));
  for (const StoreTransfer& x : s.store_return_recv) {
    HSAP_ASSIGN_OR_RETURN(
        std::vector<ByteChunk> k,
        ThdChunks(group, LocalRows(x.runs), absl::MakeConstSpan(&x.local_head, 1)));
    ExchangeBuilder one(/*add=*/true);
    one.Receive(x.peer, tag, KThenV(k, Bytes(r.group_tokens, hkv, D, f32)));
    HSAP_ASSIGN_OR_RETURN(ExchangeProgram in, std::move(one).Build());
    legs.push_back(std::move(in));
  }
  return legs;
}

struct ForwardRegions {
  char *gq, *gkv, *out32, *lse32, *gout, *kv[2], *a2a_send, *a2a_recv, *ring_send[2], *ring_recv[2],
      *fan_send, *fan_recv, *store;
  size_t used;
};
ForwardRegions CarveForward(void* base, const DeviceHierProgram::Sizes& z) {
  PoolCursor c(base);
  ForwardRegions f;
  f.gq = c.Take(z.gq);
  f.gkv = c.Take(z.gkv);
  f.out32 = c.Take(z.out32);
  f.lse32 = c.Take(z.lse32);
  f.gout = c.Take(z.gq);
  for (char*& p : f.kv) p = c.Take(z.kv_slot);
  f.a2a_send = c.Take(std::max(z.a2a_in_send, z.a2a_out_send));
  f.a2a_recv = c.Take(std::max(z.a2a_in_recv, z.a2a_out_recv));
  for (int s = 0; s < 2; ++s) {
    f.ring_send[s] = c.Take(z.ring_send);
    f.ring_recv[s] = c.Take(z.ring_recv);
  }
  f.fan_send = c.Take(z.fan_send);
  f.fan_recv = c.Take(z.fan_recv);
  f.store = c.Take(z.store_kv);
  f.used = c.used();
  return f;
}

struct BackwardRegions {
  char *gq, *gdout, *gkv, *stats, *gstats, *dq32, *dkv32, *gdq, *gdkv, *sum32, *kv[2], *partial[2],
      *a2a_send, *a2a_recv, *ring_send[2], *ring_recv[2], *grad_send[2], *grad_recv[2], *fan_send,
      *fan_recv, *fan_grad_send, *fan_grad_recv, *store, *store32;
  size_t used;
};
BackwardRegions CarveBackward(void* base, const DeviceHierProgram::Sizes& z) {
  PoolCursor c(base);
  BackwardRegions b;
  b.gq = c.Take(z.gq);
  b.gdout = c.Take(z.gq);
  b.gkv = c.Take(z.gkv);
  b.stats = c.Take(z.stats);
  b.gstats = c.Take(z.gstats);
  b.dq32 = c.Take(z.dq32);
  b.dkv32 = c.Take(z.dkv32);
  b.gdq = c.Take(z.gq);
  b.gdkv = c.Take(z.gkv);
  b.sum32 = c.Take(z.sum32);
  for (char*& p : b.kv) p = c.Take(z.kv_slot);
  for (char*& p : b.partial) p = c.Take(z.partial_slot);
  b.a2a_send = c.Take(std::max(z.a2a_in_send, z.a2a_out_send));
  b.a2a_recv = c.Take(std::max(z.a2a_in_recv, z.a2a_out_recv));
  for (int s = 0; s < 2; ++s) {
    b.ring_send[s] = c.Take(z.ring_send);
    b.ring_recv[s] = c.Take(z.ring_recv);
    b.grad_send[s] = c.Take(z.grad_send);
    b.grad_recv[s] = c.Take(z.grad_recv);
  }
  b.fan_send = c.Take(z.fan_send);
  b.fan_recv = c.Take(z.fan_recv);
  b.fan_grad_send = c.Take(z.fan_grad_send);
  b.fan_grad_recv = c.Take(z.fan_grad_recv);
  b.store = c.Take(z.store_kv);
  b.store32 = c.Take(z.store_grad);
  b.used = c.used();
  return b;
}

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceHierProgram>> DeviceHierProgram::Build(
    Device& device, const RankHierarchy& r, const AttentionDims& dims, DType dtype,
    cudaStream stream) {
  auto p = std::unique_ptr<DeviceHierProgram>(new DeviceHierProgram());
  p->rank_ = &r;
  p->dims_ = dims;
  p->dtype_ = dtype;
  const int D = dims.head_dim, HQ = dims.heads_q, HKV = dims.heads_kv;
  const size_t es = DTypeSize(dtype), f = sizeof(float);
  const bool partial = r.kv_grad_partial;
  struct Named {
    Exchange* ex;
    absl::StatusOr<ExchangeProgram> program;
  };
  std::vector<Named> programs;
  programs.push_back({&p->in_q_, AllToAllProgram(r, HQ, D, es, true, PlanPayload::kInQ, false)});
  programs.push_back({&p->in_k_, AllToAllProgram(r, HKV, D, es, false, PlanPayload::kInK, false)});
  programs.push_back({&p->in_v_, AllToAllProgram(r, HKV, D, es, false, PlanPayload::kInV, false)});
  programs.push_back(
      {&p->in_dout_, AllToAllProgram(r, HQ, D, es, true, PlanPayload::kInDout, false)});
  programs.push_back({&p->in_stats_, StatsInProgram(r, HQ)});
  programs.push_back({&p->out_o_, AllToAllProgram(r, HQ, D, es, true, PlanPayload::kOutO, true)});
  programs.push_back({&p->out_lse_, LseBackProgram(r)});
  programs.push_back({&p->out_dq_, AllToAllProgram(r, HQ, D, es, true, PlanPayload::kOutDq, true)});
  programs.push_back({&p->out_dk_, AllToAllProgram(r, HKV, D, partial ? f : es, false,
                                                   PlanPayload::kOutDk, true, partial)});
  programs.push_back({&p->out_dv_, AllToAllProgram(r, HKV, D, partial ? f : es, false,
                                                   PlanPayload::kOutDv, true, partial)});
  p->steps_.resize(r.steps.size());
  for (size_t i = 0; i < r.steps.size(); ++i) {
    programs.push_back({&p->steps_[i].kv, RingKvProgram(r, r.steps[i], D, es)});
    programs.push_back({&p->steps_[i].grad, RingGradProgram(r, r.steps[i], D)});
    programs.push_back({&p->steps_[i].fan_kv, FanOutKvProgram(r, r.steps[i], D, es)});
    programs.push_back({&p->steps_[i].store_kv, StoreKvProgram(r, r.steps[i], D, es)});
    programs.push_back({&p->steps_[i].store_fill, StoreFillProgram(r, r.steps[i], D, es, false)});
    programs.push_back(
        {&p->steps_[i].store_fill_grad, StoreFillProgram(r, r.steps[i], D, f, true)});
    programs.push_back({&p->steps_[i].store_fan_kv, StoreFanOutProgram(r, r.steps[i], D, es)});
    HSAP_ASSIGN_OR_RETURN(std::vector<ExchangeProgram> fan_in, FanInGradPrograms(r, r.steps[i], D));
    p->steps_[i].fan_grad.resize(fan_in.size());
    for (size_t x = 0; x < fan_in.size(); ++x) {
      programs.push_back({&p->steps_[i].fan_grad[x], std::move(fan_in[x])});
    }
    HSAP_ASSIGN_OR_RETURN(std::vector<ExchangeProgram> store_in,
                          StoreFanInPrograms(r, r.steps[i], D));
    p->steps_[i].store_fan_grad.resize(store_in.size());
    for (size_t x = 0; x < store_in.size(); ++x) {
      programs.push_back({&p->steps_[i].store_fan_grad[x], std::move(store_in[x])});
    }
    HSAP_ASSIGN_OR_RETURN(std::vector<ExchangeProgram> store_return,
                          StoreReturnPrograms(r, r.steps[i], D));
    p->steps_[i].store_grad.resize(store_return.size());
    for (size_t x = 0; x < store_return.size(); ++x) {
      programs.push_back({&p->steps_[i].store_grad[x], std::move(store_return[x])});
    }
  }
  for (Named& n : programs) {
    if (!n.program.ok()) return n.program.status();
    n.ex->program = *std::move(n.program);
  }

  // Upload: copy lists, the kv-head map, the work lists.
  HostImage image;
  struct Lists {
    size_t pack, unpack, self;
  };
  std::vector<Lists> at;
  for (Named& n : programs) {
    const ExchangeProgram& e = n.ex->program;
    at.push_back({image.Add(e.pack), image.Add(e.unpack), image.Add(e.self)});
  }
  const size_t kv_map_at = image.Add(r.kv_head_of_q);
  std::vector<HostImage::WorkListAt> work_at = {image.Add(r.local_work)};
  for (const SubRingStep& s : r.steps) work_at.push_back(image.Add(s.recv_work));
  HSAP_ASSIGN_OR_RETURN(DeviceBuffer memory, image.Upload(device, stream, "hierarchy upload"));
  p->memory_ = std::move(memory);
  const char* base = static_cast<const char*>(p->memory_.get());
  for (size_t i = 0; i < programs.size(); ++i) {
    Exchange& e = *programs[i].ex;
    auto list = [&](size_t offset, size_t n) {
      hsap_dev::ChunksParams c{};
      c.chunks = reinterpret_cast<const hsap_dev::CopyChunk*>(base + offset);
      c.num_chunks = static_cast<long long>(n);
      return c;
    };
    e.pack = list(at[i].pack, e.program.pack.size());
    e.unpack = list(at[i].unpack, e.program.unpack.size());
    e.self = list(at[i].self, e.program.self.size());
  }
  p->kv_map_ = reinterpret_cast<const int*>(base + kv_map_at);
  p->local_work_ = HostImage::At(base, work_at[0]);
  for (size_t i = 0; i < r.steps.size(); ++i)
    p->steps_[i].work = HostImage::At(base, work_at[i + 1]);

  // Region sizes.
  Sizes& z = p->sizes_;
  const int64_t N = r.group_tokens, n_me = r.shard_tokens;
  const size_t hq = r.q_heads.size(), hkv = r.kv_heads.size();
  z.gq = Bytes(N, hq, D, es);
  z.gkv = 2 * Bytes(N, hkv, D, es);
  z.out32 = Bytes(N, hq, D, f);
  z.lse32 = Bytes(N, hq, 1, f);
  z.stats = Bytes(n_me, HQ, 2, f);
  z.gstats = Bytes(N, hq, 2, f);
  z.dq32 = z.out32;
  z.dkv32 = 2 * Bytes(N, hkv, D, f);
  z.sum32 = partial ? 2 * Bytes(n_me, HKV, D, f) : 0;
  for (const SubRingStep& s : r.steps) {
    z.kv_slot = std::max(z.kv_slot, 2 * Bytes(s.recv_rows, hkv, D, es));
    z.partial_slot = std::max(z.partial_slot, 2 * Bytes(s.recv_rows, hkv, D, f));
  }
  z.store_kv = 2 * Bytes(r.store_rows, 1, D, es);
  z.store_grad = 2 * Bytes(r.store_rows, 1, D, f);
  // A stage's exchanges sit side by side in its staging.
  auto staging = [](std::vector<const Exchange*> xs, const std::vector<Exchange>& more,
                    size_t& send, size_t& recv) {
    for (const Exchange& x : more) xs.push_back(&x);
    size_t s = 0, r2 = 0;
    for (const Exchange* x : xs) {
      s += x->program.send_staging;
      r2 += x->program.recv_staging;
    }
    send = std::max(send, s);
    recv = std::max(recv, r2);
  };
  for (const Step& s : p->steps_) {
    staging({&s.kv, &s.store_kv}, {}, z.ring_send, z.ring_recv);
    staging({&s.grad}, s.store_grad, z.grad_send, z.grad_recv);
    staging({&s.fan_kv, &s.store_fan_kv}, {}, z.fan_send, z.fan_recv);
    std::vector<const Exchange*> fan_in;
    for (const Exchange& x : s.fan_grad) fan_in.push_back(&x);
    staging(fan_in, s.store_fan_grad, z.fan_grad_send, z.fan_grad_recv);
  }
  // The all-to-all stages: forward in (q, k, v), back (out, lse); backward in (stats, q,
  // dout, k, v), back (dq, dk, dv).
  staging({&p->in_q_, &p->in_k_, &p->in_v_}, {}, z.a2a_in_send, z.a2a_in_recv);
  staging({&p->in_stats_, &p->in_q_, &p->in_dout_, &p->in_k_, &p->in_v_}, {}, z.a2a_in_send,
          z.a2a_in_recv);
  staging({&p->out_o_, &p->out_lse_}, {}, z.a2a_out_send, z.a2a_out_recv);
  staging({&p->out_dq_, &p->out_dk_, &p->out_dv_}, {}, z.a2a_out_send, z.a2a_out_recv);
  p->pool_bytes_ = std::max(CarveForward(nullptr, z).used, CarveBackward(nullptr, z).used);
  return p;
}

namespace {

// One exchange of a stage with its run-time buffers.
struct Leg {
  const DeviceHierProgram::Exchange* ex;
  const void* src;
  void* dst;
};

// The stage machinery shared by forward and backward.
class HierCall {
 public:
  HierCall(const GpuHierContext& ctx, const char* pass)
      : ctx_(ctx), pass_(pass), events_(*ctx.device), transfer_(TransferStream(*ctx.transport)) {}

  // Packs every leg's messages into `send` (legs side by side), runs the self copies,
  // makes the transfer stream wait, and posts the messages (receiving into `recv`).
  absl::StatusOr<std::unique_ptr<Transport::Pending>> Post(const std::vector<Leg>& legs, char* send,
                                                           char* recv, const std::string& name,
                                                           bool ring) {
    std::vector<SendOp> sends;
    std::vector<RecvOp> recvs;
    size_t send_at = 0, recv_at = 0;
    for (const Leg& leg : legs) {
      const ExchangeProgram& e = leg.ex->program;
      HSAP_RETURN_IF_ERROR(Launch(leg.ex->pack, leg.src, send + send_at, false));
      HSAP_RETURN_IF_ERROR(Launch(leg.ex->self, leg.src, leg.dst, e.add));
      for (const ExchangeMessage& m : e.sends) {
        sends.push_back(
            {m.peer, send + send_at + m.offset, m.bytes, protocol::PlanTag(ctx_.call_id, m.tag)});
        (ring ? ring_sent_ : a2a_sent_) += m.bytes;
        Tally(m.peer, m.bytes, /*sent=*/true);
      }
      for (const ExchangeMessage& m : e.recvs) {
        recvs.push_back(
            {m.peer, recv + recv_at + m.offset, m.bytes, protocol::PlanTag(ctx_.call_id, m.tag)});
        (ring ? ring_received_ : a2a_received_) += m.bytes;
        Tally(m.peer, m.bytes, /*sent=*/false);
      }
      send_at += e.send_staging;
      recv_at += e.recv_staging;
    }
    if (transfer_ != nullptr && transfer_ != ctx_.stream) {
      HSAP_ASSIGN_OR_RETURN(cudaEvent ev, events_.New());
      HSAP_RETURN_IF_ERROR(ctx_.device->RecordEvent(ev, ctx_.stream));
      HSAP_RETURN_IF_ERROR(ctx_.device->StreamWaitEvent(transfer_, ev));
    }
    return ctx_.transport->Start(sends, recvs, absl::StrCat(pass_, " ", name));
  }

  // After the stage completed: unpacks every leg from `recv`.
  absl::Status Unpack(const std::vector<Leg>& legs, const char* recv) {
    size_t recv_at = 0;
    for (const Leg& leg : legs) {
      HSAP_RETURN_IF_ERROR(Launch(leg.ex->unpack, recv + recv_at, leg.dst, leg.ex->program.add));
      recv_at += leg.ex->program.recv_staging;
    }
    return absl::OkStatus();
  }

  // A leg without messages: its self copies (or sums), as Post runs them.
  absl::Status Local(const Leg& leg) {
    return Launch(leg.ex->self, leg.src, leg.dst, leg.ex->program.add);
  }

  // Receive staging bytes of `legs` (where the next leg's messages start).
  static size_t RecvStaging(const std::vector<Leg>& legs) {
    size_t n = 0;
    for (const Leg& leg : legs) n += leg.ex->program.recv_staging;
    return n;
  }

  // Post + Wait + Unpack.
  absl::Status Run(const std::vector<Leg>& legs, char* send, char* recv, const std::string& name,
                   bool ring = false) {
    HSAP_ASSIGN_OR_RETURN(std::unique_ptr<Transport::Pending> p,
                          Post(legs, send, recv, name, ring));
    HSAP_RETURN_IF_ERROR(p->Wait());
    return Unpack(legs, recv);
  }

  HierTraffic traffic() const {
    return HierTraffic{a2a_sent_, a2a_received_, ring_sent_, ring_received_};
  }
  const LinkTraffic& links() const { return links_; }

 private:
  absl::Status Launch(hsap_dev::ChunksParams c, const void* src, void* dst, bool add) {
    if (c.num_chunks == 0) return absl::OkStatus();
    c.src = src;
    c.dst = dst;
    return add ? ctx_.kernels->AddChunks(c, ctx_.stream) : ctx_.kernels->CopyChunks(c, ctx_.stream);
  }

  // A posted message by link class: inter-node when its peer is on another node.
  void Tally(int peer, uint64_t bytes, bool sent) {
    const std::vector<int>* nodes = ctx_.node_of_rank;
    const int me = ctx_.program->rank().rank;
    const bool inter = nodes != nullptr && !nodes->empty() && (*nodes)[peer] != (*nodes)[me];
    if (inter) {
      (sent ? links_.inter_node_sent : links_.inter_node_received) += bytes;
    } else {
      (sent ? links_.intra_node_sent : links_.intra_node_received) += bytes;
    }
  }

  const GpuHierContext& ctx_;
  const char* pass_;
  CallEvents events_;
  cudaStream transfer_;
  uint64_t a2a_sent_ = 0, a2a_received_ = 0, ring_sent_ = 0, ring_received_ = 0;
  LinkTraffic links_;
};

// The context a mode runs with (the stand-ins live in the caller's `kernels`/`transport`).
GpuHierContext ForMode(const GpuHierContext& ctx, SkippedKernels& kernels,
                       std::unique_ptr<SkippedTransport>& transport) {
  GpuHierContext out = ctx;
  if (ctx.mode == GpuExecMode::kTransfersOnly) out.kernels = &kernels;
  if (ctx.mode == GpuExecMode::kComputeOnly && ctx.transport != nullptr) {
    transport = std::make_unique<SkippedTransport>(*ctx.transport);
    out.transport = transport.get();
  }
  return out;
}

absl::Status CheckContext(const GpuHierContext& ctx) {
  if (ctx.device == nullptr || ctx.kernels == nullptr || ctx.transport == nullptr ||
      ctx.program == nullptr) {
    return absl::InternalError("GPU hierarchical executor context is incomplete");
  }
  if (ctx.pool == nullptr || ctx.pool_bytes < ctx.program->pool_bytes()) {
    return absl::InternalError(absl::StrCat("the communicator's pool holds ", ctx.pool_bytes,
                                            " B; this batch needs ", ctx.program->pool_bytes(),
                                            " B"));
  }
  return absl::OkStatus();
}

std::string StepName(const SubRingStep& s, const char* what) {
  return absl::StrCat("step ", s.step, " (", what, ")");
}

// The legs of step i's K/V stage: the sub-ring K/V into its slot and the node store
// segments (hierarchy.h 6.) into the store.
std::vector<Leg> KvLegs(const DeviceHierProgram::Step& device_step, const char* gkv, char* slot,
                        char* store) {
  return {{&device_step.kv, gkv, slot}, {&device_step.store_kv, gkv, store}};
}

bool HasFanOut(const SubRingStep& s) {
  return !s.fan_out_send.empty() || !s.fan_out_recv.empty() || !s.store_fan_send.empty();
}

// After step s's direct K/V are in `slot` [k | v]: a keeper's fills from its `store`, then
// the node fan-out (hierarchy.h 5., 6.), one exchange completed here, so the slot is whole
// before the step's kernels run. It runs even at a step that receives nothing when the rank
// forwards from its store.
absl::Status FanOut(HierCall& call, const DeviceHierProgram::Step& device_step,
                    const SubRingStep& s, char* slot, char* store, char* send, char* recv) {
  if (s.recv_group >= 0) HSAP_RETURN_IF_ERROR(call.Local({&device_step.store_fill, store, slot}));
  if (!HasFanOut(s)) return absl::OkStatus();
  return call.Run({{&device_step.fan_kv, slot, slot}, {&device_step.store_fan_kv, store, slot}},
                  send, recv, StepName(s, "kv fan-out"), /*ring=*/true);
}

// After step s's partials are in `partial` [pk | pv]: the fan-in. Added in this order (bitwise
// reproducible): the gateway's receivers' partials into `partial` in fan-out order; a
// keeper's filled heads of `partial` into its fp32 store partial `store32`; the partials of
// its store forwards' receivers into `store32`, in list order.
absl::Status FanIn(HierCall& call, const DeviceHierProgram::Step& device_step, const SubRingStep& s,
                   char* partial, char* store32, char* send, char* recv) {
  std::vector<Leg> gateway, store;
  for (const DeviceHierProgram::Exchange& x : device_step.fan_grad)
    gateway.push_back({&x, partial, partial});
  for (const DeviceHierProgram::Exchange& x : device_step.store_fan_grad)
    store.push_back({&x, store32, store32});
  std::unique_ptr<Transport::Pending> pending;
  if (HasFanOut(s)) {
    std::vector<Leg> legs = gateway;
    legs.insert(legs.end(), store.begin(), store.end());
    HSAP_ASSIGN_OR_RETURN(pending,
                          call.Post(legs, send, recv, StepName(s, "dk/dv fan-in"), /*ring=*/true));
    HSAP_RETURN_IF_ERROR(pending->Wait());
    HSAP_RETURN_IF_ERROR(call.Unpack(gateway, recv));
  }
  if (s.recv_group >= 0) {
    HSAP_RETURN_IF_ERROR(call.Local({&device_step.store_fill_grad, partial, store32}));
  }
  if (pending == nullptr) return absl::OkStatus();
  return call.Unpack(store, recv + HierCall::RecvStaging(gateway));
}

// The forward's stages, in the global order of labels of the backward
// (protocol::BackwardPostingOrder, without gradient groups): step t's K/V posted at 2t, its
// on_stage (fan-out exchange and kernels) at 2t + 3. RunStaged's look-ahead posts the next
// step's K/V before this step's fan-out, which is the same order only when the steps are
// consecutive; a node store's fan-out pairs ranks whose steps differ (a keeper and
// receivers of other groups), so under NCCL's posting-order matching it could deadlock. A
// step without a fan-out exchange posts nothing in on_stage, so it runs after the next
// step's K/V is posted (as RunStaged: that transfer overlaps its kernels).
absl::Status RunForwardStages(const std::vector<SubRingStep>& steps, const PostStage& post,
                              const std::function<absl::Status()>& local,
                              const std::function<absl::Status(size_t)>& on_stage) {
  std::vector<std::pair<int64_t, size_t>> order;  // (key, 2 * stage + is_on_stage)
  for (size_t i = 0; i < steps.size(); ++i) {
    const int64_t t = steps[i].step;
    int64_t at = 2 * t + 3;
    if (!HasFanOut(steps[i]) && i + 1 < steps.size()) {
      at = std::max<int64_t>(at, 2 * int64_t{steps[i + 1].step} + 1);
    }
    order.push_back({2 * t, 2 * i});
    order.push_back({at, 2 * i + 1});
  }
  std::sort(order.begin(), order.end());
  std::unique_ptr<Transport::Pending> kv[2];
  bool local_done = false;
  for (const auto& [key, what] : order) {
    const size_t i = what / 2, slot = i % 2;
    if (what % 2 == 0) {
      HSAP_ASSIGN_OR_RETURN(kv[slot], post(i));
    } else {
      HSAP_RETURN_IF_ERROR(kv[slot]->Wait());
      kv[slot].reset();
      HSAP_RETURN_IF_ERROR(on_stage(i));
    }
    if (!local_done) {
      local_done = true;
      HSAP_RETURN_IF_ERROR(local());
    }
  }
  if (!local_done) HSAP_RETURN_IF_ERROR(local());
  return absl::OkStatus();
}

}  // namespace

absl::Status GpuHierarchicalForward(const GpuHierContext& ctx_in, const void* q, const void* k,
                                    const void* v, void* out, float* lse, HierTraffic* traffic,
                                    LinkTraffic* links) {
  SkippedKernels skipped_kernels(ctx_in.kernels);
  std::unique_ptr<SkippedTransport> skipped_transport;
  const GpuHierContext ctx = ForMode(ctx_in, skipped_kernels, skipped_transport);
  HSAP_RETURN_IF_ERROR(CheckContext(ctx));
  const DeviceHierProgram& p = *ctx.program;
  const RankHierarchy& r = p.rank();
  const int D = p.dims().head_dim;
  const size_t es = DTypeSize(p.dtype());
  const int64_t N = r.group_tokens;
  const size_t hq = r.q_heads.size(), hkv = r.kv_heads.size();
  const ForwardRegions g = CarveForward(ctx.pool, p.sizes());
  char* gk = g.gkv;
  char* gv = g.gkv + Bytes(N, hkv, D, es);
  HierCall call(ctx, "hier forward");

  if (absl::Status s = call.Run({{&p.in_q(), q, g.gq}, {&p.in_k(), k, gk}, {&p.in_v(), v, gv}},
                                g.a2a_send, g.a2a_recv, "all-to-all q, k, v");
      !s.ok()) {
    return s;
  }
  float* out32 = reinterpret_cast<float*>(g.out32);
  float* lse32 = reinterpret_cast<float*>(g.lse32);
  if (hq > 0 && N > 0) {
    HSAP_RETURN_IF_ERROR(ctx.kernels->Init({out32, lse32, N, static_cast<int>(hq)}, ctx.stream));
  }
  const QuerySide side{N, static_cast<int>(hq), static_cast<int>(hkv), p.dims().scale,
                       p.kv_head_of_q()};
  const hsap_dev::FwdParams fp = ForwardParams(side, g.gq, out32, lse32);
  auto attend = [&](const DeviceWorkLists::List& list, const void* kk, const void* vv,
                    int64_t k_rows) {
    return LaunchForward(*ctx.kernels, fp, list, kk, vv, k_rows, ctx.stream);
  };
  auto kv_leg = [&](size_t i) { return KvLegs(p.steps()[i], g.gkv, g.kv[i % 2], g.store); };
  if (absl::Status s = RunForwardStages(
          r.steps,
          [&](size_t i) {
            return call.Post(kv_leg(i), g.ring_send[i % 2], g.ring_recv[i % 2],
                             StepName(r.steps[i], "kv"), /*ring=*/true);
          },
          [&] { return attend(p.local_work(), gk, gv, N); },
          [&](size_t i) -> absl::Status {
            HSAP_RETURN_IF_ERROR(call.Unpack(kv_leg(i), g.ring_recv[i % 2]));
            const SubRingStep& st = r.steps[i];
            HSAP_RETURN_IF_ERROR(
                FanOut(call, p.steps()[i], st, g.kv[i % 2], g.store, g.fan_send, g.fan_recv));
            if (st.recv_group < 0) return absl::OkStatus();
            return attend(p.steps()[i].work, g.kv[i % 2],
                          g.kv[i % 2] + Bytes(st.recv_rows, hkv, D, es), st.recv_rows);
          });
      !s.ok()) {
    return s;
  }
  if (hq > 0 && N > 0) {
    HSAP_RETURN_IF_ERROR(ctx.kernels->Convert(
        {out32, g.gout, static_cast<long long>(N) * static_cast<long long>(hq) * D}, ctx.stream));
  }
  if (absl::Status s = call.Run({{&p.out_o(), g.gout, out}, {&p.out_lse(), g.lse32, lse}},
                                g.a2a_send, g.a2a_recv, "all-to-all out, lse");
      !s.ok()) {
    return s;
  }
  if (traffic != nullptr) *traffic = call.traffic();
  if (links != nullptr) *links = call.links();
  return absl::OkStatus();
}

absl::Status GpuHierarchicalBackward(const GpuHierContext& ctx_in, const void* dout, const void* q,
                                     const void* k, const void* v, const void* out,
                                     const float* lse, void* dq, void* dk, void* dv,
                                     HierTraffic* traffic, LinkTraffic* links) {
  SkippedKernels skipped_kernels(ctx_in.kernels);
  std::unique_ptr<SkippedTransport> skipped_transport;
  const GpuHierContext ctx = ForMode(ctx_in, skipped_kernels, skipped_transport);
  HSAP_RETURN_IF_ERROR(CheckContext(ctx));
  const DeviceHierProgram& p = *ctx.program;
  const RankHierarchy& r = p.rank();
  const int D = p.dims().head_dim, HQ = p.dims().heads_q, HKV = p.dims().heads_kv;
  const size_t es = DTypeSize(p.dtype()), f = sizeof(float);
  const int64_t N = r.group_tokens, n_me = r.shard_tokens;
  const size_t hq = r.q_heads.size(), hkv = r.kv_heads.size();
  const BackwardRegions g = CarveBackward(ctx.pool, p.sizes());
  char* gk = g.gkv;
  char* gv = g.gkv + Bytes(N, hkv, D, es);
  HierCall call(ctx, "hier backward");

  // lse and delta of the shard, head-major, side by side.
  HSAP_RETURN_IF_ERROR(ctx.device->CopyAsync(g.stats, lse, Bytes(n_me, HQ, 1, f), ctx.stream));
  if (n_me > 0) {
    float* delta = reinterpret_cast<float*>(g.stats + Bytes(n_me, HQ, 1, f));
    HSAP_RETURN_IF_ERROR(ctx.kernels->Delta({dout, out, delta, n_me, HQ}, ctx.stream));
  }
  if (absl::Status s = call.Run({{&p.in_stats(), g.stats, g.gstats},
                                 {&p.in_q(), q, g.gq},
                                 {&p.in_dout(), dout, g.gdout},
                                 {&p.in_k(), k, gk},
                                 {&p.in_v(), v, gv}},
                                g.a2a_send, g.a2a_recv, "all-to-all q, dout, k, v, lse, delta");
      !s.ok()) {
    return s;
  }
  float* dq32 = reinterpret_cast<float*>(g.dq32);
  float* dk32 = reinterpret_cast<float*>(g.dkv32);
  float* dv32 = dk32 + static_cast<size_t>(N) * hkv * D;
  for (auto [ptr, bytes] : {std::pair{g.dq32, Bytes(N, hq, D, f)},
                            {g.dkv32, 2 * Bytes(N, hkv, D, f)},
                            {g.store32, p.sizes().store_grad}}) {
    HSAP_RETURN_IF_ERROR(ctx.device->ZeroAsync(ptr, bytes, ctx.stream));
  }
  const QuerySide side{N, static_cast<int>(hq), static_cast<int>(hkv), p.dims().scale,
                       p.kv_head_of_q()};
  const float* gstats = reinterpret_cast<const float*>(g.gstats);
  const hsap_dev::BwdParams bp =
      BackwardParams(side, g.gq, g.gdout, gstats, gstats + static_cast<size_t>(N) * hq, dq32);
  auto backward = [&](const DeviceWorkLists::List& list, const void* kk, const void* vv,
                      int64_t k_rows, float* gk32, float* gv32) {
    return LaunchBackward(*ctx.kernels, bp, list, kk, vv, k_rows, gk32, gv32, ctx.stream);
  };

  auto kv_leg = [&](size_t i) { return KvLegs(p.steps()[i], g.gkv, g.kv[i % 2], g.store); };
  // The step's partials back (and a node store's sums, hierarchy.h 6.), added into
  // [dk32 | dv32] in leg order.
  auto grad_leg = [&](size_t i) {
    std::vector<Leg> legs{{&p.steps()[i].grad, g.partial[i % 2], g.dkv32}};
    for (const DeviceHierProgram::Exchange& x : p.steps()[i].store_grad) {
      legs.push_back({&x, g.store32, g.dkv32});
    }
    return legs;
  };
  std::vector<int> steps;
  for (const auto& st : r.steps) steps.push_back(st.step);
  BackwardStages hooks;
  hooks.post_kv = [&](size_t i) {
    return call.Post(kv_leg(i), g.ring_send[i % 2], g.ring_recv[i % 2], StepName(r.steps[i], "kv"),
                     /*ring=*/true);
  };
  hooks.local = [&] { return backward(p.local_work(), gk, gv, N, dk32, dv32); };
  hooks.compute = [&](size_t i) -> absl::Status {
    const SubRingStep& st = r.steps[i];
    const int slot = static_cast<int>(i % 2);
    HSAP_RETURN_IF_ERROR(call.Unpack(kv_leg(i), g.ring_recv[slot]));
    HSAP_RETURN_IF_ERROR(
        FanOut(call, p.steps()[i], st, g.kv[slot], g.store, g.fan_send, g.fan_recv));
    if (st.recv_group >= 0) {
      const size_t half = Bytes(st.recv_rows, hkv, D, f);
      float* pk = reinterpret_cast<float*>(g.partial[slot]);
      float* pv = reinterpret_cast<float*>(g.partial[slot] + half);
      HSAP_RETURN_IF_ERROR(ctx.device->ZeroAsync(pk, 2 * half, ctx.stream));
      HSAP_RETURN_IF_ERROR(backward(p.steps()[i].work, g.kv[slot],
                                    g.kv[slot] + Bytes(st.recv_rows, hkv, D, es), st.recv_rows, pk,
                                    pv));
    }
    return FanIn(call, p.steps()[i], st, g.partial[slot], g.store32, g.fan_grad_send,
                 g.fan_grad_recv);
  };
  hooks.post_grad = [&](size_t i) {
    return call.Post(grad_leg(i), g.grad_send[i % 2], g.grad_recv[i % 2],
                     StepName(r.steps[i], "dk/dv"), /*ring=*/true);
  };
  // The partials returned for step j, added in step order.
  hooks.add_returned = [&](size_t j) { return call.Unpack(grad_leg(j), g.grad_recv[j % 2]); };
  HSAP_RETURN_IF_ERROR(RunBackwardStages(steps, hooks));

  // Back to the owners: dQ rounded here; dK/dV rounded here unless a KV head has several
  // holders in the group (then the owner sums the fp32 partials and rounds once).
  auto convert = [&](const float* from, void* to, size_t count) -> absl::Status {
    if (count == 0) return absl::OkStatus();
    return ctx.kernels->Convert({from, to, static_cast<long long>(count)}, ctx.stream);
  };
  HSAP_RETURN_IF_ERROR(convert(dq32, g.gdq, static_cast<size_t>(N) * hq * D));
  std::vector<Leg> legs = {{&p.out_dq(), g.gdq, dq}};
  const size_t shard_kv = static_cast<size_t>(n_me) * HKV * D;
  float* sum_k = reinterpret_cast<float*>(g.sum32);
  float* sum_v = sum_k + shard_kv;
  char* gdk = g.gdkv;
  char* gdv = g.gdkv + Bytes(N, hkv, D, es);
  if (r.kv_grad_partial) {
    HSAP_RETURN_IF_ERROR(ctx.device->ZeroAsync(g.sum32, 2 * shard_kv * f, ctx.stream));
    legs.push_back({&p.out_dk(), dk32, sum_k});
    legs.push_back({&p.out_dv(), dv32, sum_v});
  } else {
    const size_t count = static_cast<size_t>(N) * hkv * D;
    HSAP_RETURN_IF_ERROR(convert(dk32, gdk, count));
    HSAP_RETURN_IF_ERROR(convert(dv32, gdv, count));
    legs.push_back({&p.out_dk(), gdk, dk});
    legs.push_back({&p.out_dv(), gdv, dv});
  }
  HSAP_RETURN_IF_ERROR(call.Run(legs, g.a2a_send, g.a2a_recv, "all-to-all dq, dk, dv"));
  if (r.kv_grad_partial) {
    HSAP_RETURN_IF_ERROR(convert(sum_k, dk, shard_kv));
    HSAP_RETURN_IF_ERROR(convert(sum_v, dv, shard_kv));
  }
  if (traffic != nullptr) *traffic = call.traffic();
  if (links != nullptr) *links = call.links();
  return absl::OkStatus();
}

}  // namespace hsap::cuda
