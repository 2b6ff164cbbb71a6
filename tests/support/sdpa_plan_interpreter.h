// An fp64 host interpreter of cuDNN operation graphs written down as data
// (lib/cuda/cudnn/sdpa_graph.h), for the tests of the graphs cuDNN's fused attention runs:
// each backend operation with its documented meaning (matmul with per-entry M/N/K extents
// from the seq-len overrides and head broadcast, pointwise with broadcast, reductions (sum,
// max) over contiguous groups, reshape as a re-view of the same addresses) and ragged tensors
// (entry b starts at its ragged offset and has seq_len[b] rows; rows past it do not exist:
// they read as NaN and are never written). Bound tensors live in caller memory (doubles);
// the result is compared with an independent fp64 definition, so the graph's formula,
// masks, transposes, strides, offsets and extents are checked without a GPU. Assumed, from
// cudnn-frontend: ragged offsets scale by the ratio of token strides (GQA's full heads). Not
// modelled: precision (all fp64), and anything of cuDNN's engines themselves.
#ifndef HSAP_TESTS_SUPPORT_SDPA_PLAN_INTERPRETER_H_
#define HSAP_TESTS_SUPPORT_SDPA_PLAN_INTERPRETER_H_

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <vector>

#include "gtest/gtest.h"
#include "lib/cuda/cudnn/sdpa_graph.h"

namespace hsap::testing {

// The ragged batch a graph runs on, on the host: seq_q, seq_kv [B]; q_offsets, kv_offsets
// [B + 1] in elements (rows of heads_q * head_dim, heads_kv * head_dim).
struct RaggedEntries {
  std::vector<int32_t> seq_q, seq_kv, q_offsets, kv_offsets;
};

using cuda::Dims4;
using cuda::kUidOffsetQo;
using cuda::kUidSeqLenKv;
using cuda::kUidSeqLenQ;

// Bind every bound tensor (Bind for memory, Scalar for by-value scalars, int32 ones too),
// then Run.
class PlanInterpreter {
 public:
  PlanInterpreter(const cuda::CudnnGraphPlan& plan, const RaggedEntries& entries, int heads_q,
                  int heads_kv, int head_dim)
      : plan_(plan), e_(entries), heads_q_(heads_q), heads_kv_(heads_kv), head_dim_(head_dim) {}

  void Bind(int64_t uid, std::vector<double>* memory) { memory_[uid] = memory; }
  void Scalar(int64_t uid, double value) { scalars_[uid] = value; }

  void Run() {
    for (const cuda::CudnnOpNode& op : plan_.ops) {
      const cuda::CudnnTensorNode& out = *plan_.Find(op.output);
      Value y = Empty(out.dims);
      std::vector<Value> x;
      for (int64_t uid : op.inputs) x.push_back(Load(*plan_.Find(uid)));
      switch (op.kind) {
        case cuda::CudnnOpKind::kMatmul:
          Matmul(op, x[0], x[1], &y);
          break;
        case cuda::CudnnOpKind::kPointwise:
          Pointwise(op, x, &y);
          break;
        case cuda::CudnnOpKind::kReduction:
          Reduce(op.reduce, x[0], &y);
          break;
        case cuda::CudnnOpKind::kReshape:
          Reshape(*plan_.Find(op.inputs[0]), x[0], out, &y);
          break;
      }
      Store(out, y);
    }
  }

 private:
  struct Value {
    Dims4 dims;
    std::vector<double> v;
    std::vector<bool> written;
    size_t At(int64_t b, int64_t h, int64_t i, int64_t j) const {
      return static_cast<size_t>(((b * dims[1] + h) * dims[2] + i) * dims[3] + j);
    }
  };
  static Value Empty(const Dims4& dims) {
    const size_t n = static_cast<size_t>(dims[0] * dims[1] * dims[2] * dims[3]);
    return {dims, std::vector<double>(n, std::nan("")), std::vector<bool>(n, false)};
  }
  template <typename F>
  static void ForEach(const Dims4& d, F f) {
    for (int64_t b = 0; b < d[0]; ++b)
      for (int64_t h = 0; h < d[1]; ++h)
        for (int64_t i = 0; i < d[2]; ++i)
          for (int64_t j = 0; j < d[3]; ++j) f(std::array<int64_t, 4>{b, h, i, j});
  }
  int64_t SeqLen(int64_t uid, int64_t b) const {
    return (uid == kUidSeqLenQ ? e_.seq_q : e_.seq_kv)[static_cast<size_t>(b)];
  }

  // The element address of a bound tensor, or -1 where a ragged tensor has no such row.
  int64_t Address(const cuda::CudnnTensorNode& t, const std::array<int64_t, 4>& idx) const {
    if (t.ragged_offset_uid == 0) {
      int64_t a = 0;
      for (int i = 0; i < 4; ++i) a += idx[i] * t.strides[i];
      return a;
    }
    // The sequence axis is the one with the largest stride below the batch.
    const int seq_axis = t.strides[2] >= t.strides[3] && t.strides[2] >= t.strides[1] ? 2 : 3;
    const bool qo = t.ragged_offset_uid == kUidOffsetQo;
    if (idx[seq_axis] >= SeqLen(qo ? kUidSeqLenQ : kUidSeqLenKv, idx[0])) return -1;
    const std::vector<int32_t>& off = qo ? e_.q_offsets : e_.kv_offsets;
    // The offsets count tokens of Hq (qo) or Hkv (kv) heads; a tensor with a longer token
    // stride (GQA's full-head scratch on the kv offsets) scales them by the ratio: the
    // "implicit multiplier" cudnn-frontend relies on.
    const int64_t offset_token = (qo ? heads_q_ : heads_kv_) * head_dim_;
    const int64_t multiplier = t.strides[seq_axis] / offset_token;
    return off[static_cast<size_t>(idx[0])] * multiplier + idx[1] * t.strides[1] +
           idx[2] * t.strides[2] + idx[3] * t.strides[3];
  }

  Value Load(const cuda::CudnnTensorNode& t) {
    if (t.is_virtual) return virtuals_.at(t.uid);
    Value x = Empty(t.dims);
    if (t.by_value) {
      x.v[0] = scalars_.at(t.uid);
      return x;
    }
    if (t.dtype == cuda::CudnnDataKind::kInt32) {  // seq lens (offsets only address)
      for (int64_t b = 0; b < t.dims[0]; ++b) x.v[b] = static_cast<double>(SeqLen(t.uid, b));
      return x;
    }
    std::vector<double>& mem = Memory(t);
    ForEach(t.dims, [&](const std::array<int64_t, 4>& idx) {
      const int64_t a = Address(t, idx);
      if (a >= 0 && a < static_cast<int64_t>(mem.size())) {
        x.v[x.At(idx[0], idx[1], idx[2], idx[3])] = mem[static_cast<size_t>(a)];
      }
    });
    return x;
  }

  void Store(const cuda::CudnnTensorNode& t, const Value& y) {
    if (t.is_virtual) {
      virtuals_[t.uid] = y;
      return;
    }
    std::vector<double>& mem = Memory(t);
    ForEach(t.dims, [&](const std::array<int64_t, 4>& idx) {
      const size_t i = y.At(idx[0], idx[1], idx[2], idx[3]);
      const int64_t a = Address(t, idx);
      if (!y.written[i] || a < 0) return;
      if (a >= static_cast<int64_t>(mem.size())) {
        ADD_FAILURE() << t.name << " writes past its memory";
        return;
      }
      mem[static_cast<size_t>(a)] = y.v[i];
    });
  }

  // Caller memory, or scratch of the tensor's own (sized by its largest address).
  std::vector<double>& Memory(const cuda::CudnnTensorNode& t) {
    if (auto it = memory_.find(t.uid); it != memory_.end()) return *it->second;
    std::vector<double>& s = scratch_[t.uid];
    if (s.empty()) {
      int64_t top = 0;
      ForEach(t.dims,
              [&](const std::array<int64_t, 4>& idx) { top = std::max(top, Address(t, idx) + 1); });
      s.assign(static_cast<size_t>(top), std::nan(""));
    }
    return s;
  }

  int64_t Extent(int64_t override_uid, int64_t b, int64_t full) const {
    return override_uid == 0 ? full : std::min<int64_t>(full, SeqLen(override_uid, b));
  }

  void Matmul(const cuda::CudnnOpNode& op, const Value& a, const Value& bm, Value* c) {
    const Dims4& d = c->dims;
    const int64_t ga = d[1] / a.dims[1], gb = d[1] / bm.dims[1];
    for (int64_t b = 0; b < d[0]; ++b) {
      const int64_t m = Extent(op.m_override, b, d[2]), n = Extent(op.n_override, b, d[3]);
      const int64_t k = Extent(op.k_override, b, a.dims[3]);
      for (int64_t h = 0; h < d[1]; ++h)
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = 0; j < n; ++j) {
            double sum = 0;
            for (int64_t l = 0; l < k; ++l) {
              sum += a.v[a.At(b, h / ga, i, l)] * bm.v[bm.At(b, h / gb, l, j)];
            }
            c->v[c->At(b, h, i, j)] = sum;
            c->written[c->At(b, h, i, j)] = true;
          }
    }
  }

  void Pointwise(const cuda::CudnnOpNode& op, const std::vector<Value>& x, Value* y) {
    ForEach(y->dims, [&](const std::array<int64_t, 4>& idx) {
      auto in = [&](size_t k) {
        const Value& v = x[k];
        std::array<int64_t, 4> j = idx;
        for (int a = 0; a < 4; ++a) j[a] = v.dims[a] == 1 ? 0 : j[a];
        return v.v[v.At(j[0], j[1], j[2], j[3])];
      };
      double r = 0;
      switch (op.mode) {
        case cuda::CudnnPointwiseMode::kMul:
          r = in(0) * in(1);
          break;
        case cuda::CudnnPointwiseMode::kSub:
          r = in(0) - in(1);
          break;
        case cuda::CudnnPointwiseMode::kExp:
          r = std::exp(in(0));
          break;
        case cuda::CudnnPointwiseMode::kIdentity:
          r = in(0);
          break;
        case cuda::CudnnPointwiseMode::kGenIndex:
          r = static_cast<double>(idx[op.axis]);
          break;
        case cuda::CudnnPointwiseMode::kCmpLt:
          r = in(0) < in(1) ? 1 : 0;
          break;
        case cuda::CudnnPointwiseMode::kCmpGe:
          r = in(0) >= in(1) ? 1 : 0;
          break;
        case cuda::CudnnPointwiseMode::kLogicalAnd:
          r = (in(0) != 0 && in(1) != 0) ? 1 : 0;
          break;
        case cuda::CudnnPointwiseMode::kBinarySelect:
          r = in(2) != 0 ? in(0) : in(1);
          break;
        case cuda::CudnnPointwiseMode::kAdd:
          r = in(0) + in(1);
          break;
        case cuda::CudnnPointwiseMode::kDiv:
          r = in(0) / in(1);
          break;
        case cuda::CudnnPointwiseMode::kLog:
          r = std::log(in(0));
          break;
        case cuda::CudnnPointwiseMode::kCmpGt:
          r = in(0) > in(1) ? 1 : 0;
          break;
      }
      const size_t i = y->At(idx[0], idx[1], idx[2], idx[3]);
      y->v[i] = r;
      y->written[i] = true;
    });
  }

  // Sums (or takes the max of) contiguous groups of each dimension the output shrinks.
  static void Reduce(cuda::CudnnReduceMode mode, const Value& x, Value* y) {
    const bool max = mode == cuda::CudnnReduceMode::kMax;
    std::fill(y->v.begin(), y->v.end(), max ? -std::numeric_limits<double>::infinity() : 0.0);
    std::fill(y->written.begin(), y->written.end(), true);
    ForEach(x.dims, [&](const std::array<int64_t, 4>& idx) {
      std::array<int64_t, 4> o;
      for (int a = 0; a < 4; ++a) o[a] = idx[a] / (x.dims[a] / y->dims[a]);
      double& r = y->v[y->At(o[0], o[1], o[2], o[3])];
      const double v = x.v[x.At(idx[0], idx[1], idx[2], idx[3])];
      r = max ? std::max(r, v) : r + v;
    });
  }

  // y[i] = the x element at the address y's strides give i (batch stride included).
  static void Reshape(const cuda::CudnnTensorNode& xt, const Value& x,
                      const cuda::CudnnTensorNode& yt, Value* y) {
    std::map<int64_t, size_t> at_address;
    ForEach(xt.dims, [&](const std::array<int64_t, 4>& idx) {
      int64_t a = 0;
      for (int i = 0; i < 4; ++i) a += idx[i] * xt.strides[i];
      at_address[a] = x.At(idx[0], idx[1], idx[2], idx[3]);
    });
    ForEach(yt.dims, [&](const std::array<int64_t, 4>& idx) {
      int64_t a = 0;
      for (int i = 0; i < 4; ++i) a += idx[i] * yt.strides[i];
      const size_t i = y->At(idx[0], idx[1], idx[2], idx[3]);
      y->v[i] = x.v[at_address.at(a)];
      y->written[i] = true;
    });
  }

  const cuda::CudnnGraphPlan& plan_;
  const RaggedEntries e_;  // a copy: callers may pass a temporary
  const int64_t heads_q_, heads_kv_, head_dim_;
  std::map<int64_t, std::vector<double>*> memory_;
  std::map<int64_t, double> scalars_;
  std::map<int64_t, Value> virtuals_;
  std::map<int64_t, std::vector<double>> scratch_;
};

}  // namespace hsap::testing

#endif  // HSAP_TESTS_SUPPORT_SDPA_PLAN_INTERPRETER_H_
