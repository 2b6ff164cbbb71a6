#include "lib/cuda/exec/cudnn_steps.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "lib/cuda/runtime/buffer_pool.h"

namespace hsap::cuda {
namespace {

// Where a call's arrays are in the host image.
struct CallAt {
  size_t q_rows = 0, k_rows = 0, seq_q = 0, seq_kv = 0, q_off = 0, kv_off = 0;
  HostImage::WorkListAt pieces;  // the entries as JIT work
};

// A call's arrays added to `image`; InvalidArgument when an offset does not fit int32.
absl::StatusOr<CallAt> AddCall(HostImage& image, const WorkList& work, const StepEngines& step,
                               const CudnnCall& call, const SdpaShape& shape) {
  std::vector<hsap_dev::EntryRows> q_rows, k_rows;
  std::vector<int32_t> seq_q, seq_kv, q_off, kv_off;
  const int64_t q_row = int64_t{shape.heads_q} * shape.head_dim;
  const int64_t kv_row = int64_t{shape.heads_kv} * shape.head_dim;
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  for (size_t e : call.entries) {
    const AttentionPiece& p = step.pieces[e];
    if (p.q_end() * q_row > kMax || p.k_end() * kv_row > kMax) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cuDNN's ragged offsets are int32 here: query row ", p.q_end(), " x ", q_row,
          " or key row ", p.k_end(), " x ", kv_row,
          " elements do not fit; use HSAP_ATTENTION_ENGINE=jit for buffers this large"));
    }
    q_rows.push_back({p.q_begin, p.q_len});
    k_rows.push_back({p.k_begin, p.k_len});
    seq_q.push_back(static_cast<int32_t>(p.q_len));
    seq_kv.push_back(static_cast<int32_t>(p.k_len));
    q_off.push_back(static_cast<int32_t>(p.q_begin * q_row));
    kv_off.push_back(static_cast<int32_t>(p.k_begin * kv_row));
  }
  // The end offsets: those of the last entry's end (non-decreasing, as THD wants).
  const AttentionPiece& last = step.pieces[call.entries.back()];
  q_off.push_back(static_cast<int32_t>(last.q_end() * q_row));
  kv_off.push_back(static_cast<int32_t>(last.k_end() * kv_row));
  CallAt at;
  at.q_rows = image.Add(q_rows);
  at.k_rows = image.Add(k_rows);
  at.seq_q = image.Add(seq_q);
  at.seq_kv = image.Add(seq_kv);
  at.q_off = image.Add(q_off);
  at.kv_off = image.Add(kv_off);
  std::vector<size_t> entries = call.entries;
  std::sort(entries.begin(), entries.end());
  at.pieces = image.Add(PiecesAsWorkList(work, step.pieces, entries));
  return at;
}

template <typename T>
const T* At(const char* base, size_t offset) {
  return reinterpret_cast<const T*>(base + offset);
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudnnSteps>> CudnnSteps::Build(
    Device& device, const BatchEngines& engines, absl::Span<const WorkList* const> steps,
    const SdpaShape& shape, std::shared_ptr<CudnnPieceRunner> runner, cudaStream stream) {
  if (runner == nullptr) return absl::InvalidArgumentError("CudnnSteps::Build: no piece runner");
  if (steps.size() != engines.num_steps()) {
    return absl::InternalError(absl::StrCat("CudnnSteps::Build: ", steps.size(), " work lists for ",
                                            engines.num_steps(), " steps"));
  }
  auto out = std::unique_ptr<CudnnSteps>(new CudnnSteps());
  out->shape_ = shape;
  out->runner_ = std::move(runner);
  out->steps_.resize(steps.size());
  HostImage image;
  std::vector<std::vector<CallAt>> calls_at(steps.size());
  std::vector<HostImage::WorkListAt> jit_at(steps.size());
  int64_t q_end = 0, k_end = 0, stats = 0;
  for (size_t s = 0; s < steps.size(); ++s) {
    const StepEngines& step = engines.step(s);
    if (step.cudnn_calls.empty()) continue;
    for (const CudnnCall& call : step.cudnn_calls) {
      HSAP_ASSIGN_OR_RETURN(CallAt at, AddCall(image, *steps[s], step, call, shape));
      calls_at[s].push_back(at);
      for (size_t e : call.entries) {
        q_end = std::max(q_end, step.pieces[e].q_end());
        k_end = std::max(k_end, step.pieces[e].k_end());
      }
      stats = std::max<int64_t>(
          stats, static_cast<int64_t>(call.entries.size()) * shape.heads_q * call.max_q_len);
    }
    jit_at[s] = image.Add(PiecesAsWorkList(*steps[s], step.pieces, step.jit_pieces));
  }
  HSAP_ASSIGN_OR_RETURN(out->memory_, image.Upload(device, stream, "cuDNN call arrays upload"));
  const char* base = static_cast<const char*>(out->memory_.get());
  for (size_t s = 0; s < steps.size(); ++s) {
    const StepEngines& step = engines.step(s);
    Step& dst = out->steps_[s];
    for (size_t c = 0; c < calls_at[s].size(); ++c) {
      const CudnnCall& call = step.cudnn_calls[c];
      const CallAt& at = calls_at[s][c];
      Call x;
      x.sdpa.mask = call.mask;
      x.sdpa.num_entries = static_cast<int>(call.entries.size());
      x.sdpa.max_q_len = call.max_q_len;
      x.sdpa.max_k_len = call.max_k_len;
      x.sdpa.seq_q = At<int32_t>(base, at.seq_q);
      x.sdpa.seq_kv = At<int32_t>(base, at.seq_kv);
      x.sdpa.q_offsets = At<int32_t>(base, at.q_off);
      x.sdpa.kv_offsets = At<int32_t>(base, at.kv_off);
      x.q_rows = At<hsap_dev::EntryRows>(base, at.q_rows);
      x.k_rows = At<hsap_dev::EntryRows>(base, at.k_rows);
      x.pieces = HostImage::At(base, at.pieces);
      for (size_t e : call.entries) {
        x.total_q += step.pieces[e].q_len;
        x.total_k += step.pieces[e].k_len;
        x.sdpa.q_rows = std::max(x.sdpa.q_rows, step.pieces[e].q_end());
        x.sdpa.k_rows = std::max(x.sdpa.k_rows, step.pieces[e].k_end());
      }
      dst.calls.push_back(x);
    }
    if (!dst.calls.empty()) dst.jit = HostImage::At(base, jit_at[s]);
  }
  // Scratch: O / dQ | dK | dV | Stats.
  const size_t es = DTypeSize(shape.dtype);
  const size_t o_bytes =
      AlignPool(static_cast<size_t>(q_end) * shape.heads_q * shape.head_dim * es);
  const size_t kv_bytes =
      AlignPool(static_cast<size_t>(k_end) * shape.heads_kv * shape.head_dim * es);
  // Stats, and delta in the Stats layout (cuDNN's softmax_sum where the executor has no O).
  const size_t stats_bytes = AlignPool(static_cast<size_t>(stats) * sizeof(float));
  const size_t total = o_bytes + 2 * kv_bytes + 2 * stats_bytes;
  if (total > 0) {
    HSAP_ASSIGN_OR_RETURN(void* scratch, device.Allocate(total));
    out->scratch_ = DeviceBuffer(&device, scratch);
    char* p = static_cast<char*>(scratch);
    out->o_ = p;
    out->dk_ = p + o_bytes;
    out->dv_ = p + o_bytes + kv_bytes;
    out->stats_ = reinterpret_cast<float*>(p + o_bytes + 2 * kv_bytes);
    out->softmax_sum_ = reinterpret_cast<float*>(p + o_bytes + 2 * kv_bytes + stats_bytes);
  }
  return out;
}

bool CudnnSteps::HasCalls(size_t step) const {
  return step < steps_.size() && !steps_[step].calls.empty();
}

const DeviceWorkLists::List& CudnnSteps::JitWork(size_t step,
                                                 const DeviceWorkLists::List& all) const {
  return HasCalls(step) ? steps_[step].jit : all;
}

template <typename Params>
Params CudnnSteps::StatsRows(const Call& c, int64_t lse_stride) const {
  Params p{};
  p.entries = c.q_rows;
  p.lse_stride = lse_stride;
  p.stats_head_stride = c.sdpa.max_q_len;
  p.stats_entry_stride = c.sdpa.max_q_len * shape_.heads_q;
  p.total_rows = c.total_q;
  p.num_entries = c.sdpa.num_entries;
  p.heads = shape_.heads_q;
  return p;
}

absl::Status CudnnSteps::Refused(const absl::Status& runner, const Call& c,
                                 const JitFallback& jit) const {
  if (!absl::IsUnimplemented(runner)) return runner;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (refused_++ == 0) first_refusal_ = std::string(runner.message());
  }
  return jit(c.pieces);
}

int64_t CudnnSteps::refused_calls() const {
  std::lock_guard<std::mutex> lock(mu_);
  return refused_;
}

std::string CudnnSteps::RuntimeNote() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (refused_ == 0) return "";
  return absl::StrCat("; at run time ", refused_, " cuDNN call", refused_ == 1 ? "" : "s",
                      " ran on the JIT kernels instead (first: ", first_refusal_, ")");
}

absl::Status CudnnSteps::RunForward(size_t step, const Forward& f, const DeviceKernels& kernels,
                                    cudaStream stream, const JitFallback& jit) const {
  if (!HasCalls(step)) return absl::OkStatus();
  for (const Call& c : steps_[step].calls) {
    const SdpaForwardArgs args{f.q, f.k, f.v, o_, stats_};
    if (absl::Status run = runner_->Forward(shape_, c.sdpa, args, stream); !run.ok()) {
      HSAP_RETURN_IF_ERROR(Refused(run, c, jit));
      continue;
    }
    hsap_dev::EntryMergeParams m = StatsRows<hsap_dev::EntryMergeParams>(c, f.lse_stride);
    m.out = f.out32;
    m.lse = f.lse32;
    m.o = o_;
    m.stats = stats_;
    HSAP_RETURN_IF_ERROR(kernels.MergeEntries(m, stream));
  }
  return absl::OkStatus();
}

absl::Status CudnnSteps::RunBackward(size_t step, const Backward& b, const DeviceKernels& kernels,
                                     cudaStream stream, const JitFallback& jit) const {
  if (!HasCalls(step)) return absl::OkStatus();
  const long long q_row = static_cast<long long>(shape_.heads_q) * shape_.head_dim;
  const long long kv_row = static_cast<long long>(shape_.heads_kv) * shape_.head_dim;
  for (const Call& c : steps_[step].calls) {
    hsap_dev::StatsGatherParams g = StatsRows<hsap_dev::StatsGatherParams>(c, b.stride);
    g.lse = b.lse;
    g.stats = stats_;
    HSAP_RETURN_IF_ERROR(kernels.GatherStats(g, stream));
    SdpaBackwardArgs args{b.q,     b.k,      b.v,     b.out, b.dout, stats_,
                          b.delta, b.stride, nullptr, o_,    dk_,    dv_};
    if (b.out == nullptr) {  // delta in the Stats layout stands in for cuDNN's sum_row(dO * O)
      hsap_dev::StatsGatherParams d = g;
      d.lse = b.delta;
      d.stats = softmax_sum_;
      HSAP_RETURN_IF_ERROR(kernels.GatherStats(d, stream));
      args.softmax_sum = softmax_sum_;
    }
    // The gathers above wrote only the scratch: a refused call leaves the accumulators alone.
    if (absl::Status run = runner_->Backward(shape_, c.sdpa, args, stream); !run.ok()) {
      HSAP_RETURN_IF_ERROR(Refused(run, c, jit));
      continue;
    }
    const struct {
      float* dst;
      const void* src;
      const hsap_dev::EntryRows* rows;
      long long row_elems, total;
    } adds[] = {{b.dq32, o_, c.q_rows, q_row, c.total_q},
                {b.dk32, dk_, c.k_rows, kv_row, c.total_k},
                {b.dv32, dv_, c.k_rows, kv_row, c.total_k}};
    for (const auto& a : adds) {
      hsap_dev::EntryAddParams p{};
      p.dst = a.dst;
      p.src = a.src;
      p.entries = a.rows;
      p.row_elems = a.row_elems;
      p.total_rows = a.total;
      p.num_entries = c.sdpa.num_entries;
      HSAP_RETURN_IF_ERROR(kernels.AddEntries(p, stream));
    }
  }
  return absl::OkStatus();
}

absl::Status AttendStepForward(const CudnnSteps* cudnn, size_t step, const DeviceKernels& kernels,
                               const hsap_dev::FwdParams& p, const DeviceWorkLists::List& list,
                               const void* k, const void* v, int64_t k_rows, cudaStream stream) {
  if (p.heads_q == 0) return absl::OkStatus();
  const DeviceWorkLists::List& jit = cudnn == nullptr ? list : cudnn->JitWork(step, list);
  HSAP_RETURN_IF_ERROR(LaunchForward(kernels, p, jit, k, v, k_rows, stream));
  if (cudnn == nullptr) return absl::OkStatus();
  return cudnn->RunForward(step, {p.q, k, v, p.out, p.lse, p.q_rows}, kernels, stream,
                           [&](const DeviceWorkLists::List& pieces) {
                             return LaunchForward(kernels, p, pieces, k, v, k_rows, stream);
                           });
}

absl::Status AttendStepBackward(const CudnnSteps* cudnn, size_t step, const DeviceKernels& kernels,
                                const hsap_dev::BwdParams& p, const void* out,
                                const DeviceWorkLists::List& list, const void* k, const void* v,
                                int64_t k_rows, float* dk, float* dv, cudaStream stream) {
  if (p.heads_q == 0) return absl::OkStatus();
  const DeviceWorkLists::List& jit = cudnn == nullptr ? list : cudnn->JitWork(step, list);
  HSAP_RETURN_IF_ERROR(LaunchBackward(kernels, p, jit, k, v, k_rows, dk, dv, stream));
  if (cudnn == nullptr) return absl::OkStatus();
  CudnnSteps::Backward b;
  b.q = p.q;
  b.k = k;
  b.v = v;
  b.out = out;
  b.dout = p.dout;
  b.lse = p.lse;
  b.delta = p.delta;
  b.stride = p.q_rows;
  b.dq32 = p.dq;
  b.dk32 = dk;
  b.dv32 = dv;
  return cudnn->RunBackward(step, b, kernels, stream, [&](const DeviceWorkLists::List& pieces) {
    return LaunchBackward(kernels, p, pieces, k, v, k_rows, dk, dv, stream);
  });
}

}  // namespace hsap::cuda
