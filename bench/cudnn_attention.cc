#include "bench/cudnn_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "base/status_macros.h"
#include "bench/cudnn_descriptors.h"

namespace hsap::bench {

#if defined(HSAP_HAVE_CUDNN_HEADERS)

using cudnn_internal::Aligned16;
using cudnn_internal::Desc;
using cudnn_internal::DescriptorBuilder;
using cudnn_internal::DeviceBuffer;
using cudnn_internal::LoadCudnn;
using cudnn_internal::LowerPlan;
using cudnn_internal::ScratchLayout;

namespace {

// Impl::Build's steps: the forward's graph, each step's operations appended in order.
class ForwardGraph {
 public:
  ForwardGraph(const CudnnApi* api, std::vector<Desc>* descs, const CudnnAttentionShape& shape,
               const CudnnRaggedGeometry& g)
      : b_(api, descs),
        g_(g),
        io_(shape.dtype == DType::kBF16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF) {}

  const std::vector<cudnnBackendDescriptor_t>& ops() const { return ops_; }

  // Index tensors, and the inputs and outputs in our packed layout.
  absl::Status Tensors() {
    DescriptorBuilder& b = b_;
    const CudnnRaggedGeometry& g = g_;
    const cudnnDataType_t io = io_;
    const int64_t batch = g.batch;
    // Index tensors (device int32): seq lens [B,1,1,1], ragged offsets [B+1,1,1,1].
    const Dims4 seq_dims = {batch, 1, 1, 1}, off_dims = {batch + 1, 1, 1, 1};
    HSAP_CUDNN_ASSIGN_OR_RETURN(
        seq_q_, b.Tensor({"seq_len_q", kUidSeqLenQ, CUDNN_DATA_INT32, seq_dims, kOne}));
    HSAP_CUDNN_ASSIGN_OR_RETURN(
        seq_kv_, b.Tensor({"seq_len_kv", kUidSeqLenKv, CUDNN_DATA_INT32, seq_dims, kOne}));
    HSAP_CUDNN_ASSIGN_OR_RETURN(auto off_qo, b.Tensor({"ragged_offset_qo", kUidOffsetQo,
                                                       CUDNN_DATA_INT32, off_dims, kOne}));
    HSAP_CUDNN_ASSIGN_OR_RETURN(auto off_kv, b.Tensor({"ragged_offset_kv", kUidOffsetKv,
                                                       CUDNN_DATA_INT32, off_dims, kOne}));

    // Inputs and outputs in our packed layout.
    HSAP_CUDNN_ASSIGN_OR_RETURN(
        q_, b.Tensor({"Q", kUidQ, io, g.q_dims, g.q_strides, false, false, off_qo}));
    HSAP_CUDNN_ASSIGN_OR_RETURN(
        kt_, b.Tensor({"K^T", kUidK, io, g.kt_dims, g.kt_strides, false, false, off_kv}));
    HSAP_CUDNN_ASSIGN_OR_RETURN(
        v_, b.Tensor({"V", kUidV, io, g.v_dims, g.v_strides, false, false, off_kv}));
    HSAP_CUDNN_ASSIGN_OR_RETURN(
        o_, b.Tensor({"O", kUidO, io, g.q_dims, g.q_strides, false, false, off_qo}));
    HSAP_CUDNN_ASSIGN_OR_RETURN(
        stats_, b.Tensor({"Stats", kUidStats, CUDNN_DATA_FLOAT, g.stats_dims, g.stats_strides}));
    HSAP_CUDNN_ASSIGN_OR_RETURN(scale_, b.Tensor({"attn_scale", kUidScale, CUDNN_DATA_FLOAT, kOne,
                                                  kOne, false, /*by_value=*/true}));
    return absl::OkStatus();
  }

  // S = Q K^T over each document's seq_len x seq_len block; S *= 1/sqrt(D).
  absl::Status Scores() {
    DescriptorBuilder& b = b_;
    const Dims4& sd = g_.score_dims;
    const Dims4& ss = g_.score_strides;
    HSAP_CUDNN_ASSIGN_OR_RETURN(auto s_raw, Virt("S", CUDNN_DATA_FLOAT, sd, ss));
    HSAP_CUDNN_ASSIGN_OR_RETURN(auto bmm1,
                                b.Matmul("bmm1 (Q K^T)", q_, kt_, s_raw, seq_q_, seq_kv_, nullptr));
    ops_.push_back(bmm1);
    HSAP_CUDNN_ASSIGN_OR_RETURN(s_scaled_, Virt("S_scaled", CUDNN_DATA_FLOAT, sd, ss));
    HSAP_CUDNN_ASSIGN_OR_RETURN(
        auto mul, b.Pointwise("attn_scale", CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, s_raw, scale_,
                              nullptr, s_scaled_));
    ops_.push_back(mul);
    return absl::OkStatus();
  }

  // Padding mask: keep (row < seq_len_q) && (col < seq_len_kv), else the lowest float.
  absl::Status PaddingMask() {
    DescriptorBuilder& b = b_;
    const Dims4& sd = g_.score_dims;
    const Dims4& ss = g_.score_strides;
    HSAP_CUDNN_ASSIGN_OR_RETURN(auto row_p, Virt("pad_row_index", CUDNN_DATA_INT32, sd, ss));
    HSAP_CUDNN_ASSIGN_OR_RETURN(auto col_p, Virt("pad_col_index", CUDNN_DATA_INT32, sd, ss));
    HSAP_CUDNN_ASSIGN_OR_RETURN(auto row_ok, Virt("row_lt_seq_q", CUDNN_DATA_INT32, sd, ss));
    HSAP_CUDNN_ASSIGN_OR_RETURN(auto col_ok, Virt("col_lt_seq_kv", CUDNN_DATA_INT32, sd, ss));
    HSAP_CUDNN_ASSIGN_OR_RETURN(auto keep_p, Virt("pad_keep", CUDNN_DATA_BOOLEAN, sd, ss));
    HSAP_CUDNN_ASSIGN_OR_RETURN(
        auto lowest_p, b.Tensor({"lowest (padding)", kUidLowestPadding, CUDNN_DATA_FLOAT, kOne,
                                 kOne, false, /*by_value=*/true}));
    HSAP_CUDNN_ASSIGN_OR_RETURN(auto s_padded, Virt("S_padded", CUDNN_DATA_FLOAT, sd, ss));
    HSAP_CUDNN_ASSIGN_OR_RETURN(
        auto op, b.Pointwise("pad_row_index", CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32,
                             s_scaled_, nullptr, nullptr, row_p, /*axis=*/2));
    ops_.push_back(op);
    HSAP_CUDNN_ASSIGN_OR_RETURN(
        op, b.Pointwise("pad_col_index", CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, s_scaled_,
                        nullptr, nullptr, col_p, /*axis=*/3));
    ops_.push_back(op);
    HSAP_CUDNN_ASSIGN_OR_RETURN(op, b.Pointwise("row_lt_seq_q", CUDNN_POINTWISE_CMP_LT,
                                                CUDNN_DATA_INT32, row_p, seq_q_, nullptr, row_ok));
    ops_.push_back(op);
    HSAP_CUDNN_ASSIGN_OR_RETURN(op, b.Pointwise("col_lt_seq_kv", CUDNN_POINTWISE_CMP_LT,
                                                CUDNN_DATA_INT32, col_p, seq_kv_, nullptr, col_ok));
    ops_.push_back(op);
    HSAP_CUDNN_ASSIGN_OR_RETURN(
        op, b.Pointwise("pad_and", CUDNN_POINTWISE_LOGICAL_AND, CUDNN_DATA_BOOLEAN, row_ok, col_ok,
                        nullptr, keep_p));
    ops_.push_back(op);
    // BINARY_SELECT: y = t ? x : b.
    HSAP_CUDNN_ASSIGN_OR_RETURN(
        op, b.Pointwise("pad_select", CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, s_scaled_,
                        lowest_p, keep_p, s_padded));
    ops_.push_back(op);
    s_padded_ = s_padded;
    s_masked_ = s_padded;
    return absl::OkStatus();
  }

  // Causal mask inside each document: keep row >= col (q and kv lengths are equal, so top-left
  // and bottom-right alignments coincide).
  absl::Status CausalMask() {
    DescriptorBuilder& b = b_;
    const Dims4& sd = g_.score_dims;
    const Dims4& ss = g_.score_strides;
    HSAP_CUDNN_ASSIGN_OR_RETURN(auto row_c, Virt("causal_row_index", CUDNN_DATA_INT32, sd, ss));
    HSAP_CUDNN_ASSIGN_OR_RETURN(auto col_c, Virt("causal_col_index", CUDNN_DATA_INT32, sd, ss));
    HSAP_CUDNN_ASSIGN_OR_RETURN(auto keep_c, Virt("causal_keep", CUDNN_DATA_BOOLEAN, sd, ss));
    HSAP_CUDNN_ASSIGN_OR_RETURN(
        auto lowest_c, b.Tensor({"lowest (causal)", kUidLowestCausal, CUDNN_DATA_FLOAT, kOne, kOne,
                                 false, /*by_value=*/true}));
    HSAP_CUDNN_ASSIGN_OR_RETURN(auto s_causal, Virt("S_causal", CUDNN_DATA_FLOAT, sd, ss));
    HSAP_CUDNN_ASSIGN_OR_RETURN(
        auto op, b.Pointwise("causal_row_index", CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32,
                             s_padded_, nullptr, nullptr, row_c, /*axis=*/2));
    ops_.push_back(op);
    HSAP_CUDNN_ASSIGN_OR_RETURN(
        op, b.Pointwise("causal_col_index", CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, s_padded_,
                        nullptr, nullptr, col_c, /*axis=*/3));
    ops_.push_back(op);
    HSAP_CUDNN_ASSIGN_OR_RETURN(op, b.Pointwise("row_ge_col", CUDNN_POINTWISE_CMP_GE,
                                                CUDNN_DATA_BOOLEAN, row_c, col_c, nullptr, keep_c));
    ops_.push_back(op);
    HSAP_CUDNN_ASSIGN_OR_RETURN(
        op, b.Pointwise("causal_select", CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, s_padded_,
                        lowest_c, keep_c, s_causal));
    ops_.push_back(op);
    s_masked_ = s_causal;
    return absl::OkStatus();
  }

  // Softmax with its log-sum-exp: M = max, E = exp(S - M), Z = sum E, Stats = M + log Z,
  // P = E / Z (in the I/O type: what the second matmul takes); then O = P V over each
  // document.
  absl::Status SoftmaxAndOutput() {
    DescriptorBuilder& b = b_;
    const Dims4& sd = g_.score_dims;
    const Dims4& ss = g_.score_strides;
    const Dims4& rd = g_.stats_dims;
    const Dims4& rs = g_.stats_strides;
    HSAP_CUDNN_ASSIGN_OR_RETURN(auto row_max, Virt("row_max", CUDNN_DATA_FLOAT, rd, rs));
    HSAP_CUDNN_ASSIGN_OR_RETURN(auto s_sub, Virt("S_minus_max", CUDNN_DATA_FLOAT, sd, ss));
    HSAP_CUDNN_ASSIGN_OR_RETURN(auto s_exp, Virt("exp", CUDNN_DATA_FLOAT, sd, ss));
    HSAP_CUDNN_ASSIGN_OR_RETURN(auto row_sum, Virt("row_sum", CUDNN_DATA_FLOAT, rd, rs));
    HSAP_CUDNN_ASSIGN_OR_RETURN(auto row_log, Virt("log_row_sum", CUDNN_DATA_FLOAT, rd, rs));
    HSAP_CUDNN_ASSIGN_OR_RETURN(auto p, Virt("P", io_, sd, ss));
    HSAP_CUDNN_ASSIGN_OR_RETURN(
        auto op, b.Reduction("row_max", CUDNN_REDUCE_TENSOR_MAX, s_masked_, row_max));
    ops_.push_back(op);
    HSAP_CUDNN_ASSIGN_OR_RETURN(op, b.Pointwise("sub_max", CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT,
                                                s_masked_, row_max, nullptr, s_sub));
    ops_.push_back(op);
    HSAP_CUDNN_ASSIGN_OR_RETURN(op, b.Pointwise("exp", CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, s_sub,
                                                nullptr, nullptr, s_exp));
    ops_.push_back(op);
    HSAP_CUDNN_ASSIGN_OR_RETURN(op,
                                b.Reduction("row_sum", CUDNN_REDUCE_TENSOR_ADD, s_exp, row_sum));
    ops_.push_back(op);
    HSAP_CUDNN_ASSIGN_OR_RETURN(op, b.Pointwise("log", CUDNN_POINTWISE_LOG, CUDNN_DATA_FLOAT,
                                                row_sum, nullptr, nullptr, row_log));
    ops_.push_back(op);
    HSAP_CUDNN_ASSIGN_OR_RETURN(op, b.Pointwise("stats", CUDNN_POINTWISE_ADD, CUDNN_DATA_FLOAT,
                                                row_max, row_log, nullptr, stats_));
    ops_.push_back(op);
    HSAP_CUDNN_ASSIGN_OR_RETURN(op, b.Pointwise("div_sum", CUDNN_POINTWISE_DIV, CUDNN_DATA_FLOAT,
                                                s_exp, row_sum, nullptr, p));
    ops_.push_back(op);

    // O = P V over each document.
    HSAP_CUDNN_ASSIGN_OR_RETURN(op, b.Matmul("bmm2 (P V)", p, v_, o_, seq_q_, nullptr, seq_kv_));
    ops_.push_back(op);
    return absl::OkStatus();
  }

 private:
  static constexpr Dims4 kOne = {1, 1, 1, 1};

  // A virtual tensor, uids counting from kUidFirstVirtual.
  absl::StatusOr<cudnnBackendDescriptor_t> Virt(const char* name, cudnnDataType_t dtype,
                                                const Dims4& dims, const Dims4& strides) {
    return b_.Tensor({name, next_virtual_++, dtype, dims, strides, /*is_virtual=*/true});
  }

  DescriptorBuilder b_;
  const CudnnRaggedGeometry& g_;
  const cudnnDataType_t io_;
  int64_t next_virtual_ = kUidFirstVirtual;
  cudnnBackendDescriptor_t seq_q_ = nullptr, seq_kv_ = nullptr, q_ = nullptr, kt_ = nullptr,
                           v_ = nullptr, o_ = nullptr, stats_ = nullptr, scale_ = nullptr;
  cudnnBackendDescriptor_t s_scaled_ = nullptr, s_padded_ = nullptr, s_masked_ = nullptr;
  std::vector<cudnnBackendDescriptor_t> ops_;
};

}  // namespace

struct CudnnAttention::Impl {
  const CudnnApi* api = nullptr;
  const cuda::CudaRuntimeApi* rt = nullptr;
  cudnnHandle_t handle = nullptr;
  std::vector<Desc> descs;  // tensors, operations, graph, engine configs
  std::vector<Desc> plan;   // the execution plan (at most one), destroyed first
  DeviceBuffer index;       // seq_lens, qo offsets, kv offsets
  DeviceBuffer workspace;
  void* seq_lens_dev = nullptr;
  void* qo_offsets_dev = nullptr;
  void* kv_offsets_dev = nullptr;
  // Host values of the by-value scalars (their addresses go into every variant pack).
  float scale = 1.0f;
  float lowest = std::numeric_limits<float>::lowest();
  float one = 1.0f;
  // The backward: its plan, its scratch tensors (uid -> device address) in one allocation.
  CudnnGraphPlan backward_plan;
  DeviceBuffer scratch;
  std::map<int64_t, void*> scratch_dev;
  bool zero_dq_accum = false;  // cuDNN < 9.6 expects the caller to zero the dQ accumulator

  ~Impl() {
    plan.clear();
    // Engine configs and operations reference each other; destroy newest first.
    while (!descs.empty()) descs.pop_back();
    if (handle != nullptr) api->Destroy(handle);
  }

  absl::Status Build(const CudnnAttentionShape& shape, const CudnnRaggedGeometry& g);
  absl::Status BuildBackward(const CudnnAttentionShape& shape, const CudnnRaggedGeometry& g,
                             int version);
  // Finalizes the graph of `ops`, picks the plan, allocates the workspace, uploads the index
  // tensors and sets the scale.
  absl::Status FinishBuild(const CudnnAttentionShape& shape, const CudnnRaggedGeometry& g,
                           const std::vector<cudnnBackendDescriptor_t>& ops);
  absl::Status PickPlan(cudnnBackendDescriptor_t graph, size_t* workspace_bytes);
  // Binds `uids` to `ptrs` in a variant pack and executes the plan on `stream`.
  absl::Status Execute(absl::Span<const int64_t> uids, absl::Span<void* const> ptrs,
                       cuda::cudaStream stream, absl::string_view what);
};

absl::Status CudnnAttention::Impl::Build(const CudnnAttentionShape& shape,
                                         const CudnnRaggedGeometry& g) {
  ForwardGraph graph(api, &descs, shape, g);
  HSAP_CUDNN_RETURN_IF_ERROR(graph.Tensors());
  HSAP_CUDNN_RETURN_IF_ERROR(graph.Scores());
  HSAP_CUDNN_RETURN_IF_ERROR(graph.PaddingMask());
  if (shape.causal) HSAP_CUDNN_RETURN_IF_ERROR(graph.CausalMask());
  HSAP_CUDNN_RETURN_IF_ERROR(graph.SoftmaxAndOutput());
  return FinishBuild(shape, g, graph.ops());
}

absl::Status CudnnAttention::Impl::BuildBackward(const CudnnAttentionShape& shape,
                                                 const CudnnRaggedGeometry& g, int version) {
  HSAP_CUDNN_ASSIGN_OR_RETURN(backward_plan, BackwardGraphPlan(shape, version));
  HSAP_CUDNN_RETURN_IF_ERROR(ValidateGraphPlan(backward_plan));
  HSAP_CUDNN_ASSIGN_OR_RETURN(const std::vector<cudnnBackendDescriptor_t> ops,
                              LowerPlan(api, backward_plan, shape.dtype, &descs));
  HSAP_CUDNN_RETURN_IF_ERROR(FinishBuild(shape, g, ops));

  // Scratch tensors (softmax_sum, the dQ accumulator, GQA full heads): one allocation.
  size_t scratch_bytes = 0;
  const std::map<int64_t, size_t> offsets = ScratchLayout(backward_plan, &scratch_bytes);
  HSAP_CUDNN_ASSIGN_OR_RETURN(
      scratch, DeviceBuffer::Allocate(rt, scratch_bytes, "the cuDNN backward's scratch tensors"));
  for (const auto& [uid, offset] : offsets) {
    scratch_dev[uid] = static_cast<uint8_t*>(scratch.get()) + offset;
  }
  zero_dq_accum = version < 90600;
  return absl::OkStatus();
}

absl::Status CudnnAttention::Impl::FinishBuild(const CudnnAttentionShape& shape,
                                               const CudnnRaggedGeometry& g,
                                               const std::vector<cudnnBackendDescriptor_t>& ops) {
  DescriptorBuilder b(api, &descs);
  // The operation graph.
  HSAP_CUDNN_ASSIGN_OR_RETURN(auto graph,
                              b.Make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "operation graph"));
  HSAP_CUDNN_RETURN_IF_ERROR(b.Set(graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1,
                                   &handle, "operation graph"));
  HSAP_CUDNN_RETURN_IF_ERROR(b.Set(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS,
                                   CUDNN_TYPE_BACKEND_DESCRIPTOR, static_cast<int64_t>(ops.size()),
                                   ops.data(), "operation graph"));
  HSAP_CUDNN_RETURN_IF_ERROR(b.Finalize(graph, "operation graph"));
  size_t workspace_bytes = 0;
  HSAP_CUDNN_RETURN_IF_ERROR(PickPlan(graph, &workspace_bytes));
  HSAP_CUDNN_ASSIGN_OR_RETURN(workspace,
                              DeviceBuffer::Allocate(rt, workspace_bytes, "the cuDNN workspace"));

  // Seq lens and ragged offsets on the device.
  const size_t seq_bytes = Aligned16(g.seq_lens.size());
  const size_t off_bytes = Aligned16(g.qo_offsets.size());
  HSAP_CUDNN_ASSIGN_OR_RETURN(
      index, DeviceBuffer::Allocate(rt, seq_bytes + 2 * off_bytes, "seq lens and ragged offsets"));
  std::vector<uint8_t> host(index.bytes(), 0);
  std::memcpy(host.data(), g.seq_lens.data(), g.seq_lens.size() * sizeof(int32_t));
  std::memcpy(host.data() + seq_bytes, g.qo_offsets.data(), g.qo_offsets.size() * sizeof(int32_t));
  std::memcpy(host.data() + seq_bytes + off_bytes, g.kv_offsets.data(),
              g.kv_offsets.size() * sizeof(int32_t));
  HSAP_CUDNN_RETURN_IF_ERROR(
      rt->Check(rt->Memcpy(index.get(), host.data(), host.size(), cuda::kCudaMemcpyDefault),
                "cudaMemcpy (seq lens and ragged offsets)"));
  // A copy from pageable memory may return before its DMA lands; the graph's stream is
  // non-blocking.
  HSAP_CUDNN_RETURN_IF_ERROR(
      rt->Check(rt->DeviceSynchronize(), "cudaDeviceSynchronize (seq lens and ragged offsets)"));
  uint8_t* base = static_cast<uint8_t*>(index.get());
  seq_lens_dev = base;
  qo_offsets_dev = base + seq_bytes;
  kv_offsets_dev = base + seq_bytes + off_bytes;
  scale = 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
  return absl::OkStatus();
}

absl::Status CudnnAttention::Impl::PickPlan(cudnnBackendDescriptor_t graph,
                                            size_t* workspace_bytes) {
  DescriptorBuilder b(api, &descs);
  std::vector<std::string> rejected;
  for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
    const char* mode_name = mode == CUDNN_HEUR_MODE_A ? "A" : "fallback";
    const std::string what = absl::StrCat("engine heuristics (mode ", mode_name, ")");
    HSAP_CUDNN_ASSIGN_OR_RETURN(auto heur, b.Make(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, what));
    HSAP_CUDNN_RETURN_IF_ERROR(b.SetDesc(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph, what));
    HSAP_CUDNN_RETURN_IF_ERROR(
        b.Set(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, what));
    if (absl::Status s = b.Finalize(heur, what); !s.ok()) {
      rejected.push_back(std::string(s.message()));
      continue;
    }
    int64_t count = 0;
    HSAP_CUDNN_RETURN_IF_ERROR(
        api->Check(api->BackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                            CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr),
                   absl::StrCat("cudnnBackendGetAttribute(", what, ", result count)")));
    if (count <= 0) {
      rejected.push_back(absl::StrCat(what, ": no engine configuration"));
      continue;
    }
    std::vector<cudnnBackendDescriptor_t> cfgs;
    for (int64_t i = 0; i < count; ++i) {
      HSAP_CUDNN_ASSIGN_OR_RETURN(auto cfg,
                                  b.Make(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "engine config"));
      cfgs.push_back(cfg);
    }
    int64_t returned = 0;
    HSAP_CUDNN_RETURN_IF_ERROR(api->Check(
        api->BackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                 count, &returned, cfgs.data()),
        absl::StrCat("cudnnBackendGetAttribute(", what, ", results)")));
    for (int64_t i = 0; i < std::min(returned, count); ++i) {
      cudnnBackendDescriptor_t d = nullptr;
      HSAP_CUDNN_RETURN_IF_ERROR(
          api->Check(api->BackendCreateDescriptor(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, &d),
                     "cudnnBackendCreateDescriptor(execution plan)"));
      Desc candidate(api, d);
      absl::Status s = b.Set(d, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle,
                             "execution plan");
      if (s.ok())
        s = b.SetDesc(d, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, cfgs[i], "execution plan");
      if (s.ok()) s = b.Finalize(d, absl::StrCat("execution plan of engine config ", i));
      if (!s.ok()) {
        rejected.push_back(std::string(s.message()));
        continue;  // `candidate` destroys the descriptor
      }
      int64_t ws = 0;
      HSAP_CUDNN_RETURN_IF_ERROR(
          api->Check(api->BackendGetAttribute(d, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                              CUDNN_TYPE_INT64, 1, nullptr, &ws),
                     "cudnnBackendGetAttribute(execution plan, workspace size)"));
      *workspace_bytes = static_cast<size_t>(std::max<int64_t>(ws, 0));
      plan.push_back(std::move(candidate));
      return absl::OkStatus();
    }
  }
  // Keep the message readable: the first few reasons.
  if (rejected.size() > 4) rejected.resize(4);
  return absl::NotFoundError(absl::StrCat("no cuDNN engine supports the fused attention graph: ",
                                          absl::StrJoin(rejected, "; ")));
}

absl::Status CudnnAttention::Impl::Execute(absl::Span<const int64_t> uids,
                                           absl::Span<void* const> ptrs, cuda::cudaStream stream,
                                           absl::string_view what) {
  HSAP_CUDNN_RETURN_IF_ERROR(
      api->Check(api->SetStream(handle, reinterpret_cast<cudaStream_t>(stream)), "cudnnSetStream"));
  cudnnBackendDescriptor_t d = nullptr;
  HSAP_CUDNN_RETURN_IF_ERROR(
      api->Check(api->BackendCreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &d),
                 "cudnnBackendCreateDescriptor(variant pack)"));
  Desc pack(api, d);
  void* workspace_ptr = workspace.get();
  const int64_t n = static_cast<int64_t>(uids.size());
  HSAP_CUDNN_RETURN_IF_ERROR(
      api->Check(api->BackendSetAttribute(d, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64,
                                          n, uids.data()),
                 "cudnnBackendSetAttribute(variant pack, unique ids)"));
  HSAP_CUDNN_RETURN_IF_ERROR(
      api->Check(api->BackendSetAttribute(d, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS,
                                          CUDNN_TYPE_VOID_PTR, n, ptrs.data()),
                 "cudnnBackendSetAttribute(variant pack, data pointers)"));
  HSAP_CUDNN_RETURN_IF_ERROR(
      api->Check(api->BackendSetAttribute(d, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR,
                                          1, &workspace_ptr),
                 "cudnnBackendSetAttribute(variant pack, workspace)"));
  HSAP_CUDNN_RETURN_IF_ERROR(
      api->Check(api->BackendFinalize(d), "cudnnBackendFinalize(variant pack)"));
  return api->Check(api->BackendExecute(handle, plan.front().get(), d),
                    absl::StrCat("cudnnBackendExecute(", what, ")"));
}

absl::StatusOr<std::unique_ptr<CudnnAttention>> CudnnAttention::Create(
    const CudnnAttentionShape& shape, CudnnPass pass) {
  HSAP_CUDNN_ASSIGN_OR_RETURN(CudnnRaggedGeometry geometry, MakeRaggedGeometry(shape));
  HSAP_CUDNN_ASSIGN_OR_RETURN(const CudnnApi* api, LoadCudnn());
  if (absl::Status s = cuda::CheckCudaDevice(); !s.ok()) {
    return absl::UnimplementedError(absl::StrCat("cuDNN attention: ", s.message()));
  }
  HSAP_CUDNN_ASSIGN_OR_RETURN(const cuda::CudaRuntimeApi* rt, cuda::LoadCudaRuntime());
  int device = 0, major = 0, minor = 0;
  HSAP_CUDNN_RETURN_IF_ERROR(rt->Check(rt->GetDevice(&device), "cudaGetDevice"));
  HSAP_CUDNN_RETURN_IF_ERROR(
      rt->Check(rt->DeviceGetAttribute(&major, cuda::kCudaDevAttrComputeCapabilityMajor, device),
                "cudaDeviceGetAttribute(compute capability)"));
  HSAP_CUDNN_RETURN_IF_ERROR(
      rt->Check(rt->DeviceGetAttribute(&minor, cuda::kCudaDevAttrComputeCapabilityMinor, device),
                "cudaDeviceGetAttribute(compute capability)"));
  if (major < 8) {
    return absl::UnimplementedError(absl::StrCat("cuDNN fused attention needs sm80 or newer; GPU ",
                                                 device, " is sm", major, minor));
  }

  std::unique_ptr<CudnnAttention> self(new CudnnAttention());
  self->geometry_ = std::move(geometry);
  self->version_ = static_cast<int>(api->GetVersion());
  self->library_path_ = api->path;
  self->causal_ = shape.causal;
  self->pass_ = pass;
  self->impl_ = std::make_unique<Impl>();
  Impl& impl = *self->impl_;
  impl.api = api;
  impl.rt = rt;
  HSAP_CUDNN_RETURN_IF_ERROR(api->Check(api->Create(&impl.handle), "cudnnCreate"));
  if (pass == CudnnPass::kForward) {
    HSAP_CUDNN_RETURN_IF_ERROR(impl.Build(shape, self->geometry_));
  } else {
    HSAP_CUDNN_RETURN_IF_ERROR(impl.BuildBackward(shape, self->geometry_, self->version_));
  }
  self->workspace_bytes_ = impl.workspace.bytes();
  self->scratch_bytes_ = impl.scratch.bytes();
  return self;
}

CudnnAttention::~CudnnAttention() = default;

absl::Status CudnnAttention::Forward(const void* q, const void* k, const void* v, void* o,
                                     float* stats, cuda::cudaStream stream) {
  if (q == nullptr || k == nullptr || v == nullptr || o == nullptr || stats == nullptr) {
    return absl::InvalidArgumentError("cuDNN attention forward: a null tensor");
  }
  if (pass_ != CudnnPass::kForward) {
    return absl::FailedPreconditionError("cuDNN attention: Forward on a backward instance");
  }
  Impl& impl = *impl_;
  const int64_t uids[] = {
      kUidQ,        kUidK,        kUidV,        kUidO,     kUidStats,         kUidSeqLenQ,
      kUidSeqLenKv, kUidOffsetQo, kUidOffsetKv, kUidScale, kUidLowestPadding, kUidLowestCausal};
  void* ptrs[] = {const_cast<void*>(q),
                  const_cast<void*>(k),
                  const_cast<void*>(v),
                  o,
                  stats,
                  impl.seq_lens_dev,
                  impl.seq_lens_dev,
                  impl.qo_offsets_dev,
                  impl.kv_offsets_dev,
                  &impl.scale,
                  &impl.lowest,
                  &impl.lowest};
  // The causal select's scalar is not in a non-causal graph.
  const size_t n = causal_ ? 12 : 11;
  return impl.Execute(absl::MakeConstSpan(uids, n), absl::MakeConstSpan(ptrs, n), stream,
                      "fused attention forward");
}

absl::Status CudnnAttention::Backward(const void* q, const void* k, const void* v, const void* o,
                                      const void* dout, const float* stats, void* dq, void* dk,
                                      void* dv, cuda::cudaStream stream) {
  if (q == nullptr || k == nullptr || v == nullptr || o == nullptr || dout == nullptr ||
      stats == nullptr || dq == nullptr || dk == nullptr || dv == nullptr) {
    return absl::InvalidArgumentError("cuDNN attention backward: a null tensor");
  }
  if (pass_ != CudnnPass::kBackward) {
    return absl::FailedPreconditionError("cuDNN attention: Backward on a forward instance");
  }
  Impl& impl = *impl_;
  const std::vector<int64_t> uids = impl.backward_plan.BoundUids();
  std::vector<void*> ptrs;
  for (int64_t uid : uids) {
    void* p = nullptr;
    switch (uid) {
      case kUidQ:
        p = const_cast<void*>(q);
        break;
      case kUidK:
        p = const_cast<void*>(k);
        break;
      case kUidV:
        p = const_cast<void*>(v);
        break;
      case kUidO:
        p = const_cast<void*>(o);
        break;
      case kUidDO:
        p = const_cast<void*>(dout);
        break;
      case kUidStats:
        p = const_cast<float*>(stats);
        break;
      case kUidDQ:
        p = dq;
        break;
      case kUidDK:
        p = dk;
        break;
      case kUidDV:
        p = dv;
        break;
      case kUidSeqLenQ:
      case kUidSeqLenKv:
        p = impl.seq_lens_dev;
        break;
      case kUidOffsetQo:
        p = impl.qo_offsets_dev;
        break;
      case kUidOffsetKv:
        p = impl.kv_offsets_dev;
        break;
      case kUidScale:
        p = &impl.scale;
        break;
      case kUidOne:
        p = &impl.one;
        break;
      case kUidLowestPadding:
      case kUidLowestCausal:
      case kUidLowestPadding2:
        p = &impl.lowest;
        break;
      default:
        if (auto it = impl.scratch_dev.find(uid); it != impl.scratch_dev.end()) p = it->second;
    }
    if (p == nullptr) {
      return absl::InternalError(
          absl::StrCat("cuDNN attention backward: tensor uid ", uid, " has no address"));
    }
    ptrs.push_back(p);
  }
  if (impl.zero_dq_accum) {
    const CudnnTensorNode* accum = impl.backward_plan.Find(kUidDQAccum);
    HSAP_CUDNN_RETURN_IF_ERROR(impl.rt->Check(
        impl.rt->MemsetAsync(impl.scratch_dev.at(kUidDQAccum), 0, accum->scratch_bytes, stream),
        "cudaMemsetAsync (cuDNN dQ accumulator)"));
  }
  return impl.Execute(uids, ptrs, stream, "fused attention backward");
}

#else  // !HSAP_HAVE_CUDNN_HEADERS

class CudnnApi {};
struct CudnnAttention::Impl {};

absl::StatusOr<std::unique_ptr<CudnnAttention>> CudnnAttention::Create(
    const CudnnAttentionShape& shape, CudnnPass) {
  absl::StatusOr<CudnnRaggedGeometry> geometry = MakeRaggedGeometry(shape);
  if (!geometry.ok()) return geometry.status();
  return absl::UnimplementedError(
      "cuDNN attention: built without cudnn_graph.h (configure with the cuDNN 9 headers in the "
      "CUDA include directory or $CUDNN_HOME/include)");
}

CudnnAttention::~CudnnAttention() = default;

absl::Status CudnnAttention::Forward(const void*, const void*, const void*, void*, float*,
                                     cuda::cudaStream) {
  return absl::UnimplementedError("cuDNN attention: built without cudnn_graph.h");
}

absl::Status CudnnAttention::Backward(const void*, const void*, const void*, const void*,
                                      const void*, const float*, void*, void*, void*,
                                      cuda::cudaStream) {
  return absl::UnimplementedError("cuDNN attention: built without cudnn_graph.h");
}

#endif  // HSAP_HAVE_CUDNN_HEADERS

}  // namespace hsap::bench
