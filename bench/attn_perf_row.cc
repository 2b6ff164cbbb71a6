#include "bench/attn_perf_row.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "bench/bench_util.h"
#include "lib/api/handles.h"
#include "lib/cuda/exec/gpu_batch.h"
#include "lib/sched/hierarchy.h"
#include "lib/sched/partition.h"

namespace hsap::bench::attn_perf {
namespace {

// A rank's tensors: the host buffers themselves (host backend), or device copies of them
// (--backend cuda-loopback) that Fetch copies back.
class DeviceCopies {
 public:
  explicit DeviceCopies(const hsap::cuda::CudaRuntimeApi* rt) : rt_(rt) {}
  ~DeviceCopies() {
    for (const auto& [host, device] : placed_) rt_->Free(device);
  }
  void* Place(std::vector<uint8_t>& host) {
    if (rt_ == nullptr) return host.data();
    void* device = nullptr;
    Check(rt_->Malloc(&device, host.size()), "cudaMalloc");
    placed_.push_back({&host, device});
    Check(rt_->Memcpy(device, host.data(), host.size(), hsap::cuda::kCudaMemcpyDefault),
          "cudaMemcpy (upload)");
    // From pageable memory cudaMemcpy may return before its DMA lands, and the ranks'
    // non-blocking streams do not wait for it: the upload is complete when Place returns.
    Check(rt_->DeviceSynchronize(), "cudaDeviceSynchronize (upload)");
    return device;
  }
  void Fetch(std::vector<uint8_t>& host) {
    for (const auto& [h, device] : placed_) {
      if (h == &host) {
        Check(rt_->Memcpy(host.data(), device, host.size(), hsap::cuda::kCudaMemcpyDefault),
              "cudaMemcpy (download)");
      }
    }
  }

 private:
  void Check(hsap::cuda::cudaError e, const char* what) {
    if (absl::Status s = rt_->Check(e, what); !s.ok()) {
      std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
      std::exit(1);
    }
  }
  const hsap::cuda::CudaRuntimeApi* rt_;
  std::vector<std::pair<std::vector<uint8_t>*, void*>> placed_;
};

// The row's documents (mask kinds in turn with --mask mixed) and their layout.
void MakeLayout(const Options& o, int64_t T, Row* row) {
  row->T = T;
  row->lengths = DocumentLengths(o, T);
  const std::vector<int64_t>& lengths = row->lengths;
  std::vector<int64_t>& cu = row->cu;
  cu = {0};
  std::vector<hsapMaskKind_t> kinds;
  std::vector<int64_t> params;
  for (size_t i = 0; i < lengths.size(); ++i) {
    cu.push_back(cu.back() + lengths[i]);
    const hsapMaskKind_t kind =
        o.mask == "causal" ? hsapMaskCausal : static_cast<hsapMaskKind_t>(i % 4);
    kinds.push_back(kind);
    params.push_back(kind == hsapMaskPrefixLM        ? lengths[i] / 4
                     : kind == hsapMaskSlidingWindow ? std::min<int64_t>(lengths[i], 256)
                                                     : 0);
  }
  hsapLayout_t& layout = row->layout;
  Must(hsapLayoutCreate(&layout, cu.data(), static_cast<int64_t>(kinds.size()), kinds.data(),
                        params.data()),
       "hsapLayoutCreate");
  Must(hsapLayoutGetVisiblePairs(layout, &row->pairs), "hsapLayoutGetVisiblePairs");
}

// Full-row inputs drawn from the seed.
void DrawInputs(const Setup& s, Row* row) {
  const Options& o = *s.o;
  const DType dtype = s.dtype;
  const int64_t T = row->T;
  row->q_row = static_cast<size_t>(o.heads) * o.head_dim * s.esize;
  row->kv_row = static_cast<size_t>(o.kv_heads) * o.head_dim * s.esize;
  const size_t q_row = row->q_row, kv_row = row->kv_row;
  row->q = Bytes(T * q_row);
  row->k = Bytes(T * kv_row);
  row->v = Bytes(T * kv_row);
  row->dout = Bytes(T * q_row);
  Bytes &q = row->q, &k = row->k, &v = row->v, &dout = row->dout;
  {
    std::mt19937 rng(o.seed + static_cast<uint32_t>(T));
    std::normal_distribution<float> n(0.0f, 1.0f);
    for (Bytes* b : {&q, &dout}) {
      for (int64_t i = 0; i < T * o.heads * o.head_dim; ++i)
        hsap::StoreFromFloat(dtype, b->ptr(), i, n(rng));
    }
    for (Bytes* b : {&k, &v}) {
      for (int64_t i = 0; i < T * o.kv_heads * o.head_dim; ++i)
        hsap::StoreFromFloat(dtype, b->ptr(), i, n(rng));
    }
  }
}

// The partition: the plan's shards, or by the weights. False after printing why.
bool MakePartition(const Setup& s, Row* row) {
  const hsapLayout_t layout = row->layout;
  const hsapPlan_t plan = s.plan;
  hsapPartition_t& part = row->part;
  if (plan != nullptr) {
    // The plan's shards, as every rank's batch computes them (hierarchy.h).
    absl::StatusOr<hsap::Hierarchy> h = hsap::Hierarchy::Create(layout->layout, plan->plan);
    absl::StatusOr<hsap::Partition> p =
        h.ok() ? hsap::Partition::FromRanges(layout->layout, h->shards())
               : absl::StatusOr<hsap::Partition>(h.status());
    if (!p.ok()) {
      std::fprintf(stderr, "plan: %s\n", std::string(p.status().message()).c_str());
      return false;
    }
    part = new hsapPartition_st{std::make_shared<const hsap::Partition>(*std::move(p)), false};
  } else {
    Must(hsapPartitionCreate(&part, layout, s.R, s.weights), "hsapPartitionCreate");
  }
  return true;
}

// The inputs scattered to the ranks as a data loader would, the outputs' shards allocated.
void ScatterShards(const Setup& s, Row* row) {
  const int R = s.R;
  const hsapPartition_t part = row->part;
  const size_t q_row = row->q_row, kv_row = row->kv_row;
  std::vector<int64_t>& local = row->local;
  local.assign(R, 0);
  for (int r = 0; r < R; ++r) {
    int64_t nr = 0;
    Must(hsapPartitionGetRanges(part, r, nullptr, &nr, &local[r]), "hsapPartitionGetRanges");
  }
  auto make = [&](size_t row_bytes) {
    Shards shards;
    for (int r = 0; r < R; ++r) shards.b.emplace_back(local[r] * row_bytes);
    for (int r = 0; r < R; ++r) shards.p.push_back(shards.b[r].ptr());
    return shards;
  };
  row->sq = make(q_row);
  row->sk = make(kv_row);
  row->sv = make(kv_row);
  row->sdout = make(q_row);
  row->sout = make(q_row);
  row->sdq = make(q_row);
  row->sdk = make(kv_row);
  row->sdv = make(kv_row);
  Must(hsapPartitionScatter(part, row->q.ptr(), q_row, row->sq.p.data()), "hsapPartitionScatter");
  Must(hsapPartitionScatter(part, row->k.ptr(), kv_row, row->sk.p.data()), "hsapPartitionScatter");
  Must(hsapPartitionScatter(part, row->v.ptr(), kv_row, row->sv.p.data()), "hsapPartitionScatter");
  Must(hsapPartitionScatter(part, row->dout.ptr(), q_row, row->sdout.p.data()),
       "hsapPartitionScatter");
  row->lse.assign(R, {});
}

// Rank r's forward and backward on the row, as RunRanks says.
void RunRank(const Setup& setup, Row& row, int r, RankRuns* runs) {
  const Options& o = *setup.o;
  const DType dtype = setup.dtype;
  const bool on_gpu = setup.on_gpu;
  const hsapLayout_t layout = row.layout;
  const hsapPlan_t plan = setup.plan;
  const std::vector<hsapComm_t>& comms = setup.comms;
  const double* weights = setup.weights;
  Shards &sq = row.sq, &sk = row.sk, &sv = row.sv, &sdout = row.sdout, &sout = row.sout,
         &sdq = row.sdq, &sdk = row.sdk, &sdv = row.sdv;
  std::vector<std::vector<float>>& lse = row.lse;
  std::vector<hsapResult_t>& result = runs->result;
  std::vector<std::string>& error = runs->error;
  auto fail = [&](hsapResult_t e) {
    result[r] = e;
    error[r] = hsapGetLastError();
  };
  hsapBatchConfig_t bc = HSAP_BATCH_CONFIG_INITIALIZER;
  bc.dtype = ToC(dtype);
  bc.numHeadsQ = o.heads;
  bc.numHeadsKV = o.kv_heads;
  bc.headDim = o.head_dim;
  hsapBatch_t batch = nullptr;
  if (hsapResult_t e = plan != nullptr
                           ? hsapBatchCreateWithPlan(&batch, comms[r], layout, plan, &bc)
                           : hsapBatchCreate(&batch, comms[r], layout, weights, &bc);
      e) {
    return fail(e);
  }
  if (on_gpu) {
    size_t size = 0;
    if (hsapBatchGetEngineReport(batch, nullptr, &size) == hsapSuccess && size > 0) {
      std::string report(size, '\0');
      if (hsapBatchGetEngineReport(batch, report.data(), &size) == hsapSuccess) {
        report.resize(size - 1);
        runs->engines[r] = report;
      }
    }
  }
  const int64_t n = row.local[r];
  lse[r].assign(static_cast<size_t>(n) * o.heads + 1, 0.0f);
  DeviceCopies gpu(setup.cuda_rt);
  auto at = [&](Shards& s) { return gpu.Place(s.b[r].data); };
  hsapTensor_t tq{at(sq), ToC(dtype), n, o.heads, o.head_dim};
  hsapTensor_t tk{at(sk), ToC(dtype), n, o.kv_heads, o.head_dim};
  hsapTensor_t tv{at(sv), ToC(dtype), n, o.kv_heads, o.head_dim};
  hsapTensor_t tout{at(sout), ToC(dtype), n, o.heads, o.head_dim};
  hsapTensor_t tdout{at(sdout), ToC(dtype), n, o.heads, o.head_dim};
  hsapTensor_t tdq{at(sdq), ToC(dtype), n, o.heads, o.head_dim};
  hsapTensor_t tdk{at(sdk), ToC(dtype), n, o.kv_heads, o.head_dim};
  hsapTensor_t tdv{at(sdv), ToC(dtype), n, o.kv_heads, o.head_dim};
  std::vector<uint8_t> lse_bytes(lse[r].size() * sizeof(float));
  float* tlse = static_cast<float*>(gpu.Place(lse_bytes));
  auto forward = [&] { return hsapAttentionForward(batch, &tq, &tk, &tv, &tout, tlse); };
  auto backward = [&] {
    return hsapAttentionBackward(batch, &tdout, &tq, &tk, &tv, &tout, tlse, &tdq, &tdk, &tdv);
  };
  hsapResult_t e = hsapSuccess;
  for (int i = 0; i < o.warmup && !e; ++i) e = forward();
  auto t0 = Clock::now();
  for (int i = 0; i < o.iters && !e; ++i) e = forward();
  runs->fwd_s[r] = Seconds(t0, Clock::now()) / o.iters;
  for (int i = 0; i < o.warmup && !e; ++i) e = backward();
  t0 = Clock::now();
  for (int i = 0; i < o.iters && !e; ++i) e = backward();
  runs->bwd_s[r] = Seconds(t0, Clock::now()) / o.iters;
  if (e) fail(e);
  hsapCommGetPoolBytes(comms[r], &runs->pool_bytes[r]);
  for (Shards* s : {&sout, &sdq, &sdk, &sdv}) gpu.Fetch(s->b[r].data);
  gpu.Fetch(lse_bytes);
  std::memcpy(lse[r].data(), lse_bytes.data(), lse_bytes.size());
  // The same calls without transfers, then without kernels (outputs are garbage from
  // here on): how much of the transfer time the full calls hid behind compute.
  if (on_gpu && !e) {
    using hsap::cuda::GpuExecMode;
    for (GpuExecMode mode : {GpuExecMode::kComputeOnly, GpuExecMode::kTransfersOnly}) {
      hsap::cuda::SetGpuExecMode(batch->batch->runner(), mode);
      const int m = mode == GpuExecMode::kComputeOnly ? 0 : 1;
      for (int i = 0; i < o.warmup && !e; ++i) e = forward();
      auto t1 = Clock::now();
      for (int i = 0; i < o.iters && !e; ++i) e = forward();
      runs->part_fwd_s[m][r] = Seconds(t1, Clock::now()) / o.iters;
      for (int i = 0; i < o.warmup && !e; ++i) e = backward();
      t1 = Clock::now();
      for (int i = 0; i < o.iters && !e; ++i) e = backward();
      runs->part_bwd_s[m][r] = Seconds(t1, Clock::now()) / o.iters;
    }
    if (e) fail(e);
  }
  hsapBatchGetTraffic(batch, &runs->traffic[r]);
  hsapBatchGetTrafficDetail(batch, &runs->detail[r]);
  if (o.nodes > 0) hsapBatchGetLinkTraffic(batch, &runs->links[r]);
  hsapBatchDestroy(batch);
}

}  // namespace

bool MakeRow(const Setup& s, int64_t T, Row* row) {
  MakeLayout(*s.o, T, row);
  DrawInputs(s, row);
  if (!MakePartition(s, row)) return false;
  ScatterShards(s, row);
  return true;
}

bool RunRanks(const Setup& s, Row& row, RankRuns* runs) {
  const int R = s.R;
  runs->fwd_s.assign(R, 0.0);
  runs->bwd_s.assign(R, 0.0);
  runs->traffic.assign(R, {});
  runs->detail.assign(R, {});
  runs->links.assign(R, {});
  runs->result.assign(R, hsapSuccess);
  runs->error.assign(R, {});
  runs->engines.assign(R, {});
  runs->pool_bytes.assign(R, 0);
  for (int m = 0; m < 2; ++m) {
    runs->part_fwd_s[m].assign(R, 0.0);
    runs->part_bwd_s[m].assign(R, 0.0);
  }
  std::vector<std::thread> workers;
  for (int r = 0; r < R; ++r) workers.emplace_back([&, r] { RunRank(s, row, r, runs); });
  for (std::thread& w : workers) w.join();
  for (int r = 0; r < R; ++r) {
    if (runs->result[r] != hsapSuccess) {
      std::fprintf(stderr, "rank %d failed: %s: %s\n", r, hsapGetErrorString(runs->result[r]),
                   runs->error[r].c_str());
      return false;
    }
  }
  return true;
}

int64_t SplitDocuments(const Setup& s, const Row& row) {
  const int R = s.R;
  const int64_t T = row.T;
  const hsapPartition_t part = row.part;
  const std::vector<int64_t>& cu = row.cu;
  int64_t split = 0;
  std::vector<int> owner(T, -1);
  for (int r = 0; r < R; ++r) {
    int64_t nr = 0;
    Must(hsapPartitionGetRanges(part, r, nullptr, &nr, nullptr), "hsapPartitionGetRanges");
    std::vector<int64_t> ranges(2 * nr);
    Must(hsapPartitionGetRanges(part, r, ranges.data(), &nr, nullptr), "hsapPartitionGetRanges");
    for (int64_t i = 0; i < nr; ++i) {
      for (int64_t p = ranges[2 * i]; p < ranges[2 * i + 1]; ++p) owner[p] = r;
    }
  }
  for (size_t d = 0; d + 1 < cu.size(); ++d) {
    for (int64_t p = cu[d] + 1; p < cu[d + 1]; ++p) {
      if (owner[p] != owner[cu[d]]) {
        ++split;
        break;
      }
    }
  }
  return split;
}

}  // namespace hsap::bench::attn_perf
