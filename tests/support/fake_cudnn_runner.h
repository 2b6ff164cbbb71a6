// A host fake of cuDNN's fused attention for the cuDNN engine's tests
// (lib/cuda/cudnn/piece_runner.h): each call is evaluated in fp64 from the definition there
// -- cuDNN's mask rule (CudnnMask::Admits, relative to each entry's own rectangle), natural-log
// Stats in cuDNN's padded [b, h, s_q] layout, O / dQ / dK / dV rounded to the storage dtype
// and written only at the entries' ragged rows -- on the emulated device's memory (host
// memory underneath), reading the call's int32 sequence lengths and ragged offsets from
// there. Its work runs in stream order through `enqueue` (the emulated device's or runtime's
// launch), like a kernel.
//
// It counts what it was asked: calls and the visible pairs per head it evaluated, forward and
// backward, so that a test can check that the pieces the engine tally gives cuDNN were
// handed to it, and it records the first contract violation (offsets that disagree with the
// lengths, rows out of order, a softmax_sum that is not delta in the Stats layout) in error().
#ifndef HSAP_TESTS_SUPPORT_FAKE_CUDNN_RUNNER_H_
#define HSAP_TESTS_SUPPORT_FAKE_CUDNN_RUNNER_H_

#include <atomic>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "attention/dtype.h"
#include "lib/cuda/cudnn/piece_runner.h"

namespace hsap::testing {

class FakeCudnnRunner : public cuda::CudnnPieceRunner {
 public:
  // Runs `op` on stream `s` (in order with the stream's kernels).
  using Enqueue = std::function<absl::Status(cuda::cudaStream s, std::function<void()> op)>;
  explicit FakeCudnnRunner(Enqueue enqueue) : enqueue_(std::move(enqueue)) {}

  std::string name() const override { return "host fake"; }

  // Answers a call before running it: OK runs it; any other status is returned instead and
  // the call counted as refused (Unimplemented: a cuDNN that builds no graph for the call,
  // piece_runner.h). Set before the batch runs.
  using Answer = std::function<absl::Status(const cuda::SdpaCall& call, bool backward)>;
  void set_answer(Answer answer) { answer_ = std::move(answer); }

  absl::Status Forward(const cuda::SdpaShape& shape, const cuda::SdpaCall& call,
                       const cuda::SdpaForwardArgs& args, cuda::cudaStream s) override {
    if (absl::Status a = Answered(call, false); !a.ok()) return a;
    ++forward_calls_;
    return enqueue_(s, [this, shape, call, args] { RunForward(shape, call, args); });
  }
  absl::Status Backward(const cuda::SdpaShape& shape, const cuda::SdpaCall& call,
                        const cuda::SdpaBackwardArgs& args, cuda::cudaStream s) override {
    if (absl::Status a = Answered(call, true); !a.ok()) return a;
    ++backward_calls_;
    return enqueue_(s, [this, shape, call, args] { RunBackward(shape, call, args); });
  }

  // Calls run (not refused).
  int64_t forward_calls() const { return forward_calls_.load(); }
  int64_t backward_calls() const { return backward_calls_.load(); }
  // Visible pairs per head evaluated (after the stream ran the calls).
  int64_t forward_pairs() const { return forward_pairs_.load(); }
  int64_t backward_pairs() const { return backward_pairs_.load(); }
  int64_t refused_calls() const { return refused_calls_.load(); }
  std::string error() const {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }

 private:
  absl::Status Answered(const cuda::SdpaCall& call, bool backward) {
    if (!answer_) return absl::OkStatus();
    absl::Status a = answer_(call, backward);
    if (!a.ok()) ++refused_calls_;
    return a;
  }

  static constexpr double kNegInf = -std::numeric_limits<double>::infinity();

  struct Entry {
    int64_t q0, lq, k0, lk;  // rows
  };
  // The call's entries from its device arrays; false (recorded) when they break the contract.
  bool Entries(const cuda::SdpaShape& shape, const cuda::SdpaCall& call, std::vector<Entry>* out) {
    const int64_t q_row = int64_t{shape.heads_q} * shape.head_dim;
    const int64_t kv_row = int64_t{shape.heads_kv} * shape.head_dim;
    for (int b = 0; b < call.num_entries; ++b) {
      const int64_t qo = call.q_offsets[b], ko = call.kv_offsets[b];
      Entry e{qo / q_row, call.seq_q[b], ko / kv_row, call.seq_kv[b]};
      const bool ok = qo % q_row == 0 && ko % kv_row == 0 && e.lq > 0 && e.lk > 0 &&
                      e.lq <= call.max_q_len && e.lk <= call.max_k_len &&
                      qo + e.lq * q_row <= call.q_offsets[b + 1] &&
                      ko + e.lk * kv_row <= call.kv_offsets[b + 1];
      if (!ok) {
        Record(absl::StrCat("entry ", b, " of a ", call.mask.ToString(),
                            " call breaks the ragged layout"));
        return false;
      }
      out->push_back(e);
    }
    return true;
  }

  // Scores of row i of entry e, head h against its admitted keys (j, s_ij).
  static void Scores(const cuda::SdpaShape& shape, const cuda::CudnnMask& mask, const Entry& e,
                     int64_t i, int h, const void* q, const void* k,
                     std::vector<std::pair<int64_t, double>>* s) {
    s->clear();
    const int d = shape.head_dim, kvh = h / (shape.heads_q / shape.heads_kv);
    const size_t qb = static_cast<size_t>(((e.q0 + i) * shape.heads_q + h) * d);
    for (int64_t j = 0; j < e.lk; ++j) {
      if (!mask.Admits(i, j, e.lq, e.lk)) continue;
      const size_t kb = static_cast<size_t>(((e.k0 + j) * shape.heads_kv + kvh) * d);
      double dot = 0;
      for (int x = 0; x < d; ++x) {
        dot += static_cast<double>(LoadAsFloat(shape.dtype, q, qb + x)) *
               LoadAsFloat(shape.dtype, k, kb + x);
      }
      s->push_back({j, shape.scale * dot});
    }
  }

  void RunForward(const cuda::SdpaShape& shape, const cuda::SdpaCall& call,
                  const cuda::SdpaForwardArgs& a) {
    std::vector<Entry> entries;
    if (!Entries(shape, call, &entries)) return;
    const int d = shape.head_dim, kvh_of = shape.heads_q / shape.heads_kv;
    std::vector<std::pair<int64_t, double>> s;
    std::vector<double> o(static_cast<size_t>(d));
    int64_t pairs = 0;
    for (size_t b = 0; b < entries.size(); ++b) {
      const Entry& e = entries[b];
      for (int h = 0; h < shape.heads_q; ++h) {
        for (int64_t i = 0; i < e.lq; ++i) {
          Scores(shape, call.mask, e, i, h, a.q, a.k, &s);
          pairs += static_cast<int64_t>(s.size()) * (h == 0 ? 1 : 0);
          double m = kNegInf, z = 0;
          for (const auto& [j, x] : s) m = std::max(m, x);
          for (const auto& [j, x] : s) z += std::exp(x - m);
          const double stats = s.empty() ? kNegInf : m + std::log(z);
          std::fill(o.begin(), o.end(), 0.0);
          for (const auto& [j, x] : s) {
            const double w = std::exp(x - stats);
            const size_t vb = static_cast<size_t>(((e.k0 + j) * shape.heads_kv + h / kvh_of) * d);
            for (int c = 0; c < d; ++c) o[c] += w * LoadAsFloat(shape.dtype, a.v, vb + c);
          }
          const size_t ob = static_cast<size_t>(((e.q0 + i) * shape.heads_q + h) * d);
          for (int c = 0; c < d; ++c) {
            StoreFromFloat(shape.dtype, a.o, ob + c, static_cast<float>(o[c]));
          }
          a.stats[(b * shape.heads_q + h) * call.max_q_len + i] = static_cast<float>(stats);
        }
      }
    }
    forward_pairs_ += pairs;
  }

  void RunBackward(const cuda::SdpaShape& shape, const cuda::SdpaCall& call,
                   const cuda::SdpaBackwardArgs& a) {
    std::vector<Entry> entries;
    if (!Entries(shape, call, &entries)) return;
    const int d = shape.head_dim, kvh_of = shape.heads_q / shape.heads_kv;
    const DType t = shape.dtype;
    std::vector<std::pair<int64_t, double>> s;
    int64_t pairs = 0;
    for (size_t b = 0; b < entries.size(); ++b) {
      const Entry& e = entries[b];
      // fp64 accumulators of the entry's rows.
      std::vector<double> dq(static_cast<size_t>(e.lq * shape.heads_q * d), 0.0);
      std::vector<double> dk(static_cast<size_t>(e.lk * shape.heads_kv * d), 0.0);
      std::vector<double> dv(dk.size(), 0.0);
      for (int h = 0; h < shape.heads_q; ++h) {
        const int kvh = h / kvh_of;
        for (int64_t i = 0; i < e.lq; ++i) {
          Scores(shape, call.mask, e, i, h, a.q, a.k, &s);
          pairs += static_cast<int64_t>(s.size()) * (h == 0 ? 1 : 0);
          const double stats = a.stats[(b * shape.heads_q + h) * call.max_q_len + i];
          const double delta = a.delta[h * a.delta_stride + e.q0 + i];
          // Where given, softmax_sum is delta in the Stats layout (what libcudnn's runner binds).
          if (a.softmax_sum != nullptr &&
              a.softmax_sum[(b * shape.heads_q + h) * call.max_q_len + i] !=
                  a.delta[h * a.delta_stride + e.q0 + i]) {
            Record(
                absl::StrCat("softmax_sum of entry ", b, " head ", h, " row ", i, " is not delta"));
          }
          const size_t qb = static_cast<size_t>(((e.q0 + i) * shape.heads_q + h) * d);
          for (const auto& [j, x] : s) {
            const double p = std::exp(x - stats);
            const size_t kb = static_cast<size_t>(((e.k0 + j) * shape.heads_kv + kvh) * d);
            double dp = 0;
            for (int c = 0; c < d; ++c) {
              dp +=
                  static_cast<double>(LoadAsFloat(t, a.dout, qb + c)) * LoadAsFloat(t, a.v, kb + c);
            }
            const double ds = p * (dp - delta);
            const size_t lq = static_cast<size_t>((i * shape.heads_q + h) * d);
            const size_t lk = static_cast<size_t>((j * shape.heads_kv + kvh) * d);
            for (int c = 0; c < d; ++c) {
              dq[lq + c] += shape.scale * ds * LoadAsFloat(t, a.k, kb + c);
              dk[lk + c] += shape.scale * ds * LoadAsFloat(t, a.q, qb + c);
              dv[lk + c] += p * LoadAsFloat(t, a.dout, qb + c);
            }
          }
        }
      }
      const size_t q_at = static_cast<size_t>(e.q0 * shape.heads_q * d);
      const size_t k_at = static_cast<size_t>(e.k0 * shape.heads_kv * d);
      for (size_t x = 0; x < dq.size(); ++x) {
        StoreFromFloat(t, a.dq, q_at + x, static_cast<float>(dq[x]));
      }
      for (size_t x = 0; x < dk.size(); ++x) {
        StoreFromFloat(t, a.dk, k_at + x, static_cast<float>(dk[x]));
        StoreFromFloat(t, a.dv, k_at + x, static_cast<float>(dv[x]));
      }
    }
    backward_pairs_ += pairs;
  }

  void Record(const std::string& what) {
    std::lock_guard<std::mutex> lock(mu_);
    if (error_.empty()) error_ = what;
  }

  Enqueue enqueue_;
  Answer answer_;
  std::atomic<int64_t> forward_calls_{0}, backward_calls_{0}, refused_calls_{0};
  std::atomic<int64_t> forward_pairs_{0}, backward_pairs_{0};
  mutable std::mutex mu_;
  std::string error_;
};

}  // namespace hsap::testing

#endif  // HSAP_TESTS_SUPPORT_FAKE_CUDNN_RUNNER_H_
