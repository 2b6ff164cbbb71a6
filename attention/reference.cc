#include "attention/reference.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace hsap {
namespace {

// Visible key ranges [first, last] of every query, enumerated from the layout's slices
// (no work lists, no tiles: the ground truth is read straight off the mask).
std::vector<std::vector<std::pair<int64_t, int64_t>>> VisibleKeyRanges(const Layout& layout) {
  std::vector<std::vector<std::pair<int64_t, int64_t>>> ranges(layout.num_tokens());
  for (const MaskSlice& s : layout.slices()) {
    for (int64_t q = s.q_begin; q < s.q_end; ++q) {
      for (int64_t k = s.k_begin; k < s.k_end; ++k) {
        if (!s.Visible(q, k)) continue;
        // Extend to the end of the visible run of this slice (bands are contiguous).
        int64_t last = k;
        while (last + 1 < s.k_end && s.Visible(q, last + 1)) ++last;
        ranges[q].emplace_back(k, last);
        break;
      }
    }
  }
  for (auto& r : ranges) std::sort(r.begin(), r.end());
  return ranges;
}

std::vector<double> ToDouble(DType dtype, const void* data, size_t count) {
  std::vector<double> out(count);
  for (size_t i = 0; i < count; ++i) out[i] = LoadAsFloat(dtype, data, i);
  return out;
}

struct Shapes {
  int64_t tokens;
  int hq, hkv, dim;
  size_t QIndex(int64_t t, int h) const { return (static_cast<size_t>(t) * hq + h) * dim; }
  size_t KIndex(int64_t t, int h) const { return (static_cast<size_t>(t) * hkv + h) * dim; }
};

Shapes ShapesOf(const Layout& layout, const ReferenceInputs& in) {
  return {layout.num_tokens(), in.dims.heads_q, in.dims.heads_kv, in.dims.head_dim};
}

// Storage-precision arithmetic for the naive computation: every result is rounded.
class Rounded {
 public:
  explicit Rounded(DType dtype) : dtype_(dtype) {}
  float operator()(float x) const { return RoundTo(dtype_, x); }
  float Mul(float a, float b) const { return (*this)(a * b); }
  float Add(float a, float b) const { return (*this)(a + b); }
  // Sequential dot product: each product and each partial sum rounded.
  float Dot(const float* a, const float* b, int n) const {
    float acc = 0.0f;
    for (int i = 0; i < n; ++i) acc = Add(acc, Mul(a[i], b[i]));
    return acc;
  }

 private:
  DType dtype_;
};

std::vector<float> ToFloat(DType dtype, const void* data, size_t count) {
  std::vector<float> out(count);
  for (size_t i = 0; i < count; ++i) out[i] = LoadAsFloat(dtype, data, i);
  return out;
}

// The naive forward of one (head, query): probabilities of its visible keys (in key order
// of `keys`), its output row and its lse, all in storage precision.
struct NaiveRow {
  std::vector<int64_t> keys;
  std::vector<float> p;
  std::vector<float> out;
  float lse = -std::numeric_limits<float>::infinity();
};

NaiveRow NaiveAttendRow(const Rounded& r, const Shapes& sh, float scale, const float* q_row,
                        const std::vector<float>& k, const std::vector<float>& v, int kv_head,
                        const std::vector<std::pair<int64_t, int64_t>>& ranges) {
  NaiveRow row;
  row.out.assign(sh.dim, 0.0f);
  for (const auto& [first, last] : ranges) {
    for (int64_t key = first; key <= last; ++key) row.keys.push_back(key);
  }
  if (row.keys.empty()) return row;
  std::vector<float> s(row.keys.size());
  float m = -std::numeric_limits<float>::infinity();
  for (size_t j = 0; j < row.keys.size(); ++j) {
    s[j] = r.Mul(r.Dot(q_row, &k[sh.KIndex(row.keys[j], kv_head)], sh.dim), scale);
    m = std::max(m, s[j]);
  }
  float sum = 0.0f;
  row.p.resize(row.keys.size());
  for (size_t j = 0; j < row.keys.size(); ++j) {
    row.p[j] = r(std::exp(r(s[j] - m)));
    sum = r.Add(sum, row.p[j]);
  }
  for (size_t j = 0; j < row.keys.size(); ++j) {
    row.p[j] = r(row.p[j] / sum);
    const float* v_row = &v[sh.KIndex(row.keys[j], kv_head)];
    for (int d = 0; d < sh.dim; ++d) row.out[d] = r.Add(row.out[d], r.Mul(row.p[j], v_row[d]));
  }
  row.lse = r.Add(m, r(std::log(sum)));
  return row;
}

}  // namespace

ReferenceForwardResult ReferenceForward(const Layout& layout, const ReferenceInputs& in) {
  const Shapes sh = ShapesOf(layout, in);
  const std::vector<double> q = ToDouble(in.dtype, in.q, sh.QIndex(sh.tokens, 0));
  const std::vector<double> k = ToDouble(in.dtype, in.k, sh.KIndex(sh.tokens, 0));
  const std::vector<double> v = ToDouble(in.dtype, in.v, sh.KIndex(sh.tokens, 0));
  const auto ranges = VisibleKeyRanges(layout);
  ReferenceForwardResult result;
  result.out.assign(sh.QIndex(sh.tokens, 0), 0.0);
  result.lse.assign(static_cast<size_t>(sh.hq) * sh.tokens,
                    -std::numeric_limits<double>::infinity());
  std::vector<double> scores;
  for (int h = 0; h < sh.hq; ++h) {
    const int kvh = in.dims.KvHead(h);
    for (int64_t t = 0; t < sh.tokens; ++t) {
      if (ranges[t].empty()) continue;
      const double* q_row = &q[sh.QIndex(t, h)];
      scores.clear();
      double m = -std::numeric_limits<double>::infinity();
      for (const auto& [first, last] : ranges[t]) {
        for (int64_t key = first; key <= last; ++key) {
          const double* k_row = &k[sh.KIndex(key, kvh)];
          double dot = 0.0;
          for (int d = 0; d < sh.dim; ++d) dot += q_row[d] * k_row[d];
          scores.push_back(dot * in.dims.scale);
          m = std::max(m, scores.back());
        }
      }
      double sum = 0.0;
      for (double s : scores) sum += std::exp(s - m);
      const double lse = m + std::log(sum);
      double* out = &result.out[sh.QIndex(t, h)];
      size_t j = 0;
      for (const auto& [first, last] : ranges[t]) {
        for (int64_t key = first; key <= last; ++key, ++j) {
          const double p = std::exp(scores[j] - lse);
          const double* v_row = &v[sh.KIndex(key, kvh)];
          for (int d = 0; d < sh.dim; ++d) out[d] += p * v_row[d];
        }
      }
      result.lse[static_cast<size_t>(h) * sh.tokens + t] = lse;
    }
  }
  return result;
}

ReferenceGradients ReferenceBackward(const Layout& layout, const ReferenceInputs& in,
                                     const void* dout_data) {
  const Shapes sh = ShapesOf(layout, in);
  const std::vector<double> q = ToDouble(in.dtype, in.q, sh.QIndex(sh.tokens, 0));
  const std::vector<double> k = ToDouble(in.dtype, in.k, sh.KIndex(sh.tokens, 0));
  const std::vector<double> v = ToDouble(in.dtype, in.v, sh.KIndex(sh.tokens, 0));
  const std::vector<double> dout = ToDouble(in.dtype, dout_data, sh.QIndex(sh.tokens, 0));
  const ReferenceForwardResult fwd = ReferenceForward(layout, in);
  const auto ranges = VisibleKeyRanges(layout);
  const double scale = in.dims.scale;
  ReferenceGradients g;
  g.dq.assign(q.size(), 0.0);
  g.dk.assign(k.size(), 0.0);
  g.dv.assign(v.size(), 0.0);
  std::vector<int64_t> keys;
  std::vector<double> p, dp;
  for (int h = 0; h < sh.hq; ++h) {
    const int kvh = in.dims.KvHead(h);
    for (int64_t t = 0; t < sh.tokens; ++t) {
      if (ranges[t].empty()) continue;
      const double lse = fwd.lse[static_cast<size_t>(h) * sh.tokens + t];
      const double* q_row = &q[sh.QIndex(t, h)];
      const double* do_row = &dout[sh.QIndex(t, h)];
      keys.clear();
      p.clear();
      dp.clear();
      double delta = 0.0;  // sum_k P_k dP_k = dout . out
      for (const auto& [first, last] : ranges[t]) {
        for (int64_t key = first; key <= last; ++key) {
          const double* k_row = &k[sh.KIndex(key, kvh)];
          const double* v_row = &v[sh.KIndex(key, kvh)];
          double dot = 0.0, dpv = 0.0;
          for (int d = 0; d < sh.dim; ++d) {
            dot += q_row[d] * k_row[d];
            dpv += do_row[d] * v_row[d];
          }
          keys.push_back(key);
          p.push_back(std::exp(dot * scale - lse));
          dp.push_back(dpv);
          delta += p.back() * dpv;
        }
      }
      double* dq_row = &g.dq[sh.QIndex(t, h)];
      for (size_t j = 0; j < keys.size(); ++j) {
        const double ds = p[j] * (dp[j] - delta);  // dL/dS, S the scaled score
        const size_t ki = sh.KIndex(keys[j], kvh);
        for (int d = 0; d < sh.dim; ++d) {
          dq_row[d] += scale * ds * k[ki + d];
          g.dk[ki + d] += scale * ds * q_row[d];
          g.dv[ki + d] += p[j] * do_row[d];
        }
      }
    }
  }
  return g;
}

ReferenceForwardResult NaiveForward(const Layout& layout, const ReferenceInputs& in) {
  const Shapes sh = ShapesOf(layout, in);
  const Rounded r(in.dtype);
  const std::vector<float> q = ToFloat(in.dtype, in.q, sh.QIndex(sh.tokens, 0));
  const std::vector<float> k = ToFloat(in.dtype, in.k, sh.KIndex(sh.tokens, 0));
  const std::vector<float> v = ToFloat(in.dtype, in.v, sh.KIndex(sh.tokens, 0));
  const auto ranges = VisibleKeyRanges(layout);
  const float scale = in.dims.scale;  // a hyperparameter, applied in fp32
  ReferenceForwardResult result;
  result.out.assign(sh.QIndex(sh.tokens, 0), 0.0);
  result.lse.assign(static_cast<size_t>(sh.hq) * sh.tokens,
                    -std::numeric_limits<double>::infinity());
  for (int h = 0; h < sh.hq; ++h) {
    const int kvh = in.dims.KvHead(h);
    for (int64_t t = 0; t < sh.tokens; ++t) {
      const NaiveRow row = NaiveAttendRow(r, sh, scale, &q[sh.QIndex(t, h)], k, v, kvh, ranges[t]);
      std::copy(row.out.begin(), row.out.end(), result.out.begin() + sh.QIndex(t, h));
      result.lse[static_cast<size_t>(h) * sh.tokens + t] = row.lse;
    }
  }
  return result;
}

ReferenceGradients NaiveBackward(const Layout& layout, const ReferenceInputs& in,
                                 const void* dout_data) {
  const Shapes sh = ShapesOf(layout, in);
  const Rounded r(in.dtype);
  const std::vector<float> q = ToFloat(in.dtype, in.q, sh.QIndex(sh.tokens, 0));
  const std::vector<float> k = ToFloat(in.dtype, in.k, sh.KIndex(sh.tokens, 0));
  const std::vector<float> v = ToFloat(in.dtype, in.v, sh.KIndex(sh.tokens, 0));
  const std::vector<float> dout = ToFloat(in.dtype, dout_data, sh.QIndex(sh.tokens, 0));
  const auto ranges = VisibleKeyRanges(layout);
  const float scale = in.dims.scale;  // a hyperparameter, applied in fp32
  std::vector<float> dq(q.size(), 0.0f), dk(k.size(), 0.0f), dv(v.size(), 0.0f);
  for (int h = 0; h < sh.hq; ++h) {
    const int kvh = in.dims.KvHead(h);
    for (int64_t t = 0; t < sh.tokens; ++t) {
      const float* q_row = &q[sh.QIndex(t, h)];
      const NaiveRow row = NaiveAttendRow(r, sh, scale, q_row, k, v, kvh, ranges[t]);
      if (row.keys.empty()) continue;
      const float* do_row = &dout[sh.QIndex(t, h)];
      const float delta = r.Dot(do_row, row.out.data(), sh.dim);
      float* dq_row = &dq[sh.QIndex(t, h)];
      for (size_t j = 0; j < row.keys.size(); ++j) {
        const size_t ki = sh.KIndex(row.keys[j], kvh);
        const float dp = r.Dot(do_row, &v[ki], sh.dim);
        const float ds = r.Mul(r.Mul(row.p[j], r(dp - delta)), scale);
        for (int d = 0; d < sh.dim; ++d) {
          dq_row[d] = r.Add(dq_row[d], r.Mul(ds, k[ki + d]));
          dk[ki + d] = r.Add(dk[ki + d], r.Mul(ds, q_row[d]));
          dv[ki + d] = r.Add(dv[ki + d], r.Mul(row.p[j], do_row[d]));
        }
      }
    }
  }
  ReferenceGradients g;
  g.dq.assign(dq.begin(), dq.end());
  g.dk.assign(dk.begin(), dk.end());
  g.dv.assign(dv.begin(), dv.end());
  return g;
}

}  // namespace hsap
