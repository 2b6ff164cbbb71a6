#include "bench/attn_perf_cudnn.h"

#include <cstdio>
#include <string>

#include "absl/status/statusor.h"
#include "bench/attn_perf_report.h"

namespace hsap::bench::attn_perf {
namespace {

// The row's shape as cuDNN takes it: causal documents.
CudnnAttentionShape ShapeOf(const Setup& s, const Row& row) {
  const Options& o = *s.o;
  CudnnAttentionShape shape;
  shape.doc_lengths = row.lengths;
  shape.heads_q = o.heads;
  shape.heads_kv = o.kv_heads;
  shape.head_dim = o.head_dim;
  shape.dtype = s.dtype;
  shape.causal = true;
  return shape;
}

}  // namespace

bool CudnnComparisonOn(const Setup& s) {
  const Options& o = *s.o;
  // cuDNN's fused attention on the whole row, after each row (cuda-loopback only).
  bool use_cudnn = s.on_gpu && o.cudnn != 0;
  if (use_cudnn && o.mask != "causal") {
    std::printf("# cuDNN: unavailable (--mask %s: the comparison builds causal documents only)\n",
                o.mask.c_str());
    use_cudnn = false;
  }
  if (use_cudnn && s.dtype == DType::kF32) {
    std::printf("# cuDNN: unavailable (fp32: cuDNN's fused attention takes bf16 or fp16)\n");
    use_cudnn = false;
  }
  if (use_cudnn) {
    std::printf(
        "# cuDNN lines after each row: cuDNN's fused flash-attention forward and backward "
        "(backend graph API, documents as ragged batch entries, causal inside each) in one call "
        "over the whole row on GPU 0, same Q/K/V/dO; fwd(ms), bwd(ms) per call over the same "
        "iterations (CUDA events; the backward reads O and the Stats of cuDNN's own forward), "
        "fwdTF/s, bwdTF/s with the same FLOP counts, ours/cuDNN = our TF/s / cuDNN's (> 1: ours "
        "faster), #wrong and max|err| of its out (fwd) and of dq, dk, dv together (bwd) under "
        "the rule below ('-' when not checked)\n");
  }
  return use_cudnn;
}

void RunCudnnOnRow(const Setup& s, Row& row, bool check_row, bool* use_cudnn, bool* use_cudnn_bwd,
                   CudnnRow* out) {
  const Options& o = *s.o;
  const int64_t T = row.T;
  if (*use_cudnn) {
    const CudnnAttentionShape shape = ShapeOf(s, row);
    out->out = Bytes(T * row.q_row);
    absl::StatusOr<CudnnForwardRun> run = RunCudnnForward(
        shape, row.q.ptr(), row.k.ptr(), row.v.ptr(), o.warmup, o.iters, out->out.ptr());
    if (run.ok()) {
      out->fwd = *run;
      out->fwd_ran = true;
    } else {
      std::printf("# cuDNN: unavailable (%s)\n", std::string(run.status().message()).c_str());
      *use_cudnn = false;  // said once; the rows go on without it
    }
  }
  if (*use_cudnn && *use_cudnn_bwd) {
    const CudnnAttentionShape shape = ShapeOf(s, row);
    // The gradients come back only when the row is checked.
    if (check_row) {
      out->dq = Bytes(T * row.q_row);
      out->dk = Bytes(T * row.kv_row);
      out->dv = Bytes(T * row.kv_row);
    }
    absl::StatusOr<CudnnBackwardRun> run =
        RunCudnnBackward(shape, row.q.ptr(), row.k.ptr(), row.v.ptr(), row.dout.ptr(), o.warmup,
                         o.iters, check_row ? out->dq.ptr() : nullptr,
                         check_row ? out->dk.ptr() : nullptr, check_row ? out->dv.ptr() : nullptr);
    if (run.ok()) {
      out->bwd = *run;
      out->bwd_ran = true;
    } else {
      std::printf("# cuDNN backward: unavailable (%s)\n",
                  std::string(run.status().message()).c_str());
      *use_cudnn_bwd = false;
    }
  }
}

void PrintCudnnLines(const CudnnRow& c, int64_t T, double fwd_flop, double fwd_tflops,
                     double bwd_tflops, CudnnTotals* totals) {
  if (c.fwd_ran) {
    const double cudnn_s = c.fwd.forward_ms * 1e-3;
    const double cudnn_tflops = cudnn_s > 0 ? fwd_flop / cudnn_s * 1e-12 : 0.0;
    const double ours_vs = cudnn_tflops > 0 ? fwd_tflops / cudnn_tflops : 0.0;
    if (totals->rows == 0) {
      std::printf("# cuDNN %d.%d.%d, workspace %s\n", c.fwd.version / 10000,
                  c.fwd.version / 100 % 100, c.fwd.version % 100,
                  HumanBytes(static_cast<double>(c.fwd.workspace_bytes)).c_str());
    }
    std::printf(
        "# cuDNN %9lld fwd(ms) %10.3f fwdTF/s %9.4f ours/cuDNN %7.3f #wrong %s max|err| %s\n",
        (long long)T, c.fwd.forward_ms, cudnn_tflops, ours_vs, c.wrong, c.err);
    totals->sum_tflops += cudnn_tflops;
    totals->sum_ours_vs += ours_vs;
    ++totals->rows;
  }
  if (c.bwd_ran) {
    const double cudnn_s = c.bwd.backward_ms * 1e-3;
    const double cudnn_tflops = cudnn_s > 0 ? 2.5 * fwd_flop / cudnn_s * 1e-12 : 0.0;
    const double ours_vs = cudnn_tflops > 0 ? bwd_tflops / cudnn_tflops : 0.0;
    if (totals->bwd_rows == 0) {
      std::printf("# cuDNN backward: workspace %s, scratch %s\n",
                  HumanBytes(static_cast<double>(c.bwd.workspace_bytes)).c_str(),
                  HumanBytes(static_cast<double>(c.bwd.scratch_bytes)).c_str());
    }
    std::printf(
        "# cuDNN %9lld bwd(ms) %10.3f bwdTF/s %9.4f ours/cuDNN %7.3f #wrong %s max|err| %s\n",
        (long long)T, c.bwd.backward_ms, cudnn_tflops, ours_vs, c.bwd_wrong, c.bwd_err);
    totals->sum_bwd_tflops += cudnn_tflops;
    totals->sum_ours_vs_bwd += ours_vs;
    ++totals->bwd_rows;
  }
}

void PrintCudnnAverages(const CudnnTotals& totals) {
  if (totals.rows > 0) {
    std::printf("# Avg cuDNN fwd TFLOP/s : %.4f (ours/cuDNN %.3f over %d rows)\n",
                totals.sum_tflops / totals.rows, totals.sum_ours_vs / totals.rows, totals.rows);
  }
  if (totals.bwd_rows > 0) {
    std::printf("# Avg cuDNN bwd TFLOP/s : %.4f (ours/cuDNN %.3f over %d rows)\n",
                totals.sum_bwd_tflops / totals.bwd_rows, totals.sum_ours_vs_bwd / totals.bwd_rows,
                totals.bwd_rows);
  }
}

}  // namespace hsap::bench::attn_perf
