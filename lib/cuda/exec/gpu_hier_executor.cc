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
#include "lib/cuda/exec/hier_exchange_programs.h"
#include "lib/cuda/exec/nccl_lowering.h"
#include "lib/cuda/runtime/buffer_pool.h"
#include "lib/exec/protocol.h"
#include "lib/exec/staged.h"
#include "lib/sched/schedule.h"

namespace hsap::cuda {
namespace {

using hier_internal::BackwardRegions;
using hier_internal::Bytes;
using hier_internal::CarveBackward;
using hier_internal::CarveForward;
using hier_internal::ForwardRegions;

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
      const ExchangeProgram& e = leg.ex->program;
      for (const hsap_dev::ChunksParams& c : UnpackLaunches(e, leg.ex->unpack)) {
        HSAP_RETURN_IF_ERROR(Launch(c, recv + recv_at, leg.dst, e.add));
      }
      recv_at += e.recv_staging;
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

// Back to the owners: dQ rounded here; dK/dV rounded here unless a KV head has several
// holders in the group (then the owner sums the fp32 partials and rounds once).
absl::Status ReturnGradients(const GpuHierContext& ctx, HierCall& call, const BackwardRegions& g,
                             float* dq32, float* dk32, float* dv32, void* dq, void* dk, void* dv) {
  const DeviceHierProgram& p = *ctx.program;
  const RankHierarchy& r = p.rank();
  const int D = p.dims().head_dim, HKV = p.dims().heads_kv;
  const size_t es = DTypeSize(p.dtype()), f = sizeof(float);
  const int64_t N = r.group_tokens, n_me = r.shard_tokens;
  const size_t hq = r.q_heads.size(), hkv = r.kv_heads.size();
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
  // Step 0 is the local work, step i + 1 sub-ring step i's (the engine choice's order).
  auto attend = [&](size_t step, const DeviceWorkLists::List& list, const void* kk, const void* vv,
                    int64_t k_rows) {
    return AttendStepForward(ctx.cudnn, step, *ctx.kernels, fp, list, kk, vv, k_rows, ctx.stream);
  };
  auto kv_leg = [&](size_t i) { return KvLegs(p.steps()[i], g.gkv, g.kv[i % 2], g.store); };
  if (absl::Status s = RunForwardStages(
          r.steps,
          [&](size_t i) {
            return call.Post(kv_leg(i), g.ring_send[i % 2], g.ring_recv[i % 2],
                             StepName(r.steps[i], "kv"), /*ring=*/true);
          },
          [&] { return attend(0, p.local_work(), gk, gv, N); },
          [&](size_t i) -> absl::Status {
            HSAP_RETURN_IF_ERROR(call.Unpack(kv_leg(i), g.ring_recv[i % 2]));
            const SubRingStep& st = r.steps[i];
            HSAP_RETURN_IF_ERROR(
                FanOut(call, p.steps()[i], st, g.kv[i % 2], g.store, g.fan_send, g.fan_recv));
            if (st.recv_group < 0) return absl::OkStatus();
            return attend(i + 1, p.steps()[i].work, g.kv[i % 2],
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
  const int D = p.dims().head_dim, HQ = p.dims().heads_q;
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
  // Step 0 is the local work, step i + 1 sub-ring step i's. The group's output is not
  // gathered (the plan moves delta instead): the cuDNN engine gets delta.
  auto backward = [&](size_t step, const DeviceWorkLists::List& list, const void* kk,
                      const void* vv, int64_t k_rows, float* gk32, float* gv32) {
    return AttendStepBackward(ctx.cudnn, step, *ctx.kernels, bp, /*out=*/nullptr, list, kk, vv,
                              k_rows, gk32, gv32, ctx.stream);
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
  hooks.local = [&] { return backward(0, p.local_work(), gk, gv, N, dk32, dv32); };
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
      HSAP_RETURN_IF_ERROR(backward(i + 1, p.steps()[i].work, g.kv[slot],
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

  HSAP_RETURN_IF_ERROR(ReturnGradients(ctx, call, g, dq32, dk32, dv32, dq, dk, dv));
  if (traffic != nullptr) *traffic = call.traffic();
  if (links != nullptr) *links = call.links();
  return absl::OkStatus();
}

}  // namespace hsap::cuda
