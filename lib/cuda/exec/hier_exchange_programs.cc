#include "lib/cuda/exec/hier_exchange_programs.h"

#include <functional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "lib/sched/schedule.h"

namespace hsap::cuda::hier_internal {
namespace {

using protocol::PlanPayload;
uint64_t Payload(PlanPayload kind, int step = 0) { return protocol::PlanMessage(kind, step); }

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

}  // namespace

// The all-to-all of one tensor: shard [n_me, full, width] -> group buffer [N, mine, width]
// (in), or back (`back`; `add`: fp32 partial sums added by the owner).
absl::StatusOr<ExchangeProgram> AllToAllProgram(const RankHierarchy& r, int full, int width,
                                                size_t es, bool q_like, PlanPayload kind, bool back,
                                                bool add) {
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

namespace {

// `chunks` again at `shift` bytes further (the V half after the K half).
std::vector<ByteChunk> KThenV(const std::vector<ByteChunk>& k, size_t shift) {
  std::vector<ByteChunk> out = k;
  for (const ByteChunk& c : k) out.push_back({c.offset + shift, c.bytes});
  return out;
}

std::vector<TokenRange> SendRows(const SubRingStep& s) { return LocalRows(s.send_runs); }

}  // namespace

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

namespace {

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

}  // namespace

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

}  // namespace hsap::cuda::hier_internal
