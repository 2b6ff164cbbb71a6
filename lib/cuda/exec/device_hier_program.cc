#include "lib/cuda/exec/device_hier_program.h"

#include <algorithm>
#include <utility>

#include "base/status_macros.h"
#include "lib/cuda/exec/hier_exchange_programs.h"

namespace hsap::cuda {

using hier_internal::AllToAllProgram;
using hier_internal::Bytes;
using hier_internal::CarveBackward;
using hier_internal::CarveForward;
using hier_internal::FanInGradPrograms;
using hier_internal::FanOutKvProgram;
using hier_internal::LseBackProgram;
using hier_internal::RingGradProgram;
using hier_internal::RingKvProgram;
using hier_internal::StatsInProgram;
using hier_internal::StoreFanInPrograms;
using hier_internal::StoreFanOutProgram;
using hier_internal::StoreFillProgram;
using hier_internal::StoreKvProgram;
using hier_internal::StoreReturnPrograms;
using protocol::PlanPayload;

// Build's steps, on the program `p` (its rank, dims and dtype set).
class DeviceHierProgram::Builder {
 public:
  explicit Builder(DeviceHierProgram* p) : p_(p) {}

  // Every exchange's program, in upload order: the all-to-alls, then per step its K/V,
  // gradient, fan-out, store and fan-in exchanges.
  absl::Status BuildPrograms() {
    DeviceHierProgram* const p = p_;
    const RankHierarchy& r = *p->rank_;
    const int D = p->dims_.head_dim, HQ = p->dims_.heads_q, HKV = p->dims_.heads_kv;
    const size_t es = DTypeSize(p->dtype_), f = sizeof(float);
    const bool partial = r.kv_grad_partial;
    std::vector<Named>& programs = programs_;
    programs.push_back({&p->in_q_, AllToAllProgram(r, HQ, D, es, true, PlanPayload::kInQ, false)});
    programs.push_back(
        {&p->in_k_, AllToAllProgram(r, HKV, D, es, false, PlanPayload::kInK, false)});
    programs.push_back(
        {&p->in_v_, AllToAllProgram(r, HKV, D, es, false, PlanPayload::kInV, false)});
    programs.push_back(
        {&p->in_dout_, AllToAllProgram(r, HQ, D, es, true, PlanPayload::kInDout, false)});
    programs.push_back({&p->in_stats_, StatsInProgram(r, HQ)});
    programs.push_back({&p->out_o_, AllToAllProgram(r, HQ, D, es, true, PlanPayload::kOutO, true)});
    programs.push_back({&p->out_lse_, LseBackProgram(r)});
    programs.push_back(
        {&p->out_dq_, AllToAllProgram(r, HQ, D, es, true, PlanPayload::kOutDq, true)});
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
      HSAP_ASSIGN_OR_RETURN(std::vector<ExchangeProgram> fan_in,
                            FanInGradPrograms(r, r.steps[i], D));
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
    return absl::OkStatus();
  }

  // Upload: copy lists, the kv-head map, the work lists. Blocks until the upload is done.
  absl::Status Upload(Device& device, cudaStream stream) {
    DeviceHierProgram* const p = p_;
    const RankHierarchy& r = *p->rank_;
    std::vector<Named>& programs = programs_;
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
    return absl::OkStatus();
  }

  // The sizes of the pool regions, and the pool bytes a forward or a backward needs.
  void SizeRegions() {
    DeviceHierProgram* const p = p_;
    const RankHierarchy& r = *p->rank_;
    const int D = p->dims_.head_dim, HQ = p->dims_.heads_q, HKV = p->dims_.heads_kv;
    const size_t es = DTypeSize(p->dtype_), f = sizeof(float);
    const bool partial = r.kv_grad_partial;
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
  }

 private:
  struct Named {
    Exchange* ex;
    absl::StatusOr<ExchangeProgram> program;
  };

  DeviceHierProgram* const p_;
  std::vector<Named> programs_;
};

absl::StatusOr<std::unique_ptr<DeviceHierProgram>> DeviceHierProgram::Build(
    Device& device, const RankHierarchy& r, const AttentionDims& dims, DType dtype,
    cudaStream stream) {
  auto p = std::unique_ptr<DeviceHierProgram>(new DeviceHierProgram());
  p->rank_ = &r;
  p->dims_ = dims;
  p->dtype_ = dtype;
  Builder builder(p.get());
  HSAP_RETURN_IF_ERROR(builder.BuildPrograms());
  HSAP_RETURN_IF_ERROR(builder.Upload(device, stream));
  builder.SizeRegions();
  return p;
}

namespace hier_internal {

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

}  // namespace hier_internal
}  // namespace hsap::cuda
