#include "bench/attn_perf_report.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "absl/status/statusor.h"
#include "bench/bench_util.h"
#include "bench/gpu_reference.h"
#include "lib/api/handles.h"
#include "lib/sched/plan_json.h"
#include "lib/sched/schedule.h"

namespace hsap::bench::attn_perf {

std::string HumanBytes(double b) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB"};
  int u = 0;
  while (b >= 1024.0 && u < 4) {
    b /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), u == 0 ? "%.0f%s" : "%.2f%s", b, units[u]);
  return buf;
}

TeBytes TransformerEngineBytes(const std::vector<int64_t>& lengths, int R, int G, int hq, int hkv,
                               int D, size_t es) {
  TeBytes te;
  te.a = R / std::max(1, G);
  while (te.a > 1 && R % te.a != 0) --te.a;
  te.a = std::max(1, te.a);
  te.p = R / te.a;
  double padded = 0;
  for (int64_t l : lengths) {
    if (l > 0) padded += static_cast<double>((l + 2 * R - 1) / (2 * R) * (2 * R));
  }
  const double A = te.a, P = te.p, shard = padded / R;
  const double kv_eff = std::max<double>(hkv, A);
  te.a2a = (A - 1) * shard * (2.0 * hq / A + 2.0 * kv_eff / A) * D * static_cast<double>(es);
  te.p2p = (P - 1) * (padded / P) * 2.0 * (kv_eff / A) * D * static_cast<double>(es);
  return te;
}

void PrintPreamble(const Setup& s, int version, int threads_per_rank, bool fused_forward) {
  const Options& o = *s.o;
  const int R = s.R;
  const bool on_gpu = s.on_gpu;
  const hsapPlan_t plan = s.plan;
  const int plan_groups = s.plan_groups;
  std::printf("# hsap_attn_perf (hsap %d): distributed attention over a packed row, %s backend\n",
              version, on_gpu ? "CUDA (loopback ranks on GPU 0, JIT CUDA kernels)" : "host");
  if (on_gpu) {
    std::printf("# ranks %d (threads of this process sharing GPU 0, a stream each), weights ", R);
  } else {
    std::printf("# ranks %d (threads of this process, %d compute threads each), weights ", R,
                threads_per_rank);
  }
  if (o.weights.empty()) {
    std::printf("equal");
  } else {
    for (size_t i = 0; i < o.weights.size(); ++i) std::printf("%s%g", i ? "," : "", o.weights[i]);
  }
  std::printf("\n# dtype %s, heads %d (kv %d), head dim %d, mask %s, documents %s", o.dtype.c_str(),
              o.heads, o.kv_heads, o.head_dim, o.mask.c_str(), o.docs_dist.c_str());
  if (o.docs_dist == "longtail" || o.docs_dist == "uniform") {
    std::printf(" (%lld tokens per document on average%s)", (long long)o.tokens_per_doc,
                o.docs_dist == "longtail" ? ", lognormal(0, 1.5) lengths" : ", uniform lengths");
  }
  std::printf(", seed %u\n", o.seed);
  if (plan != nullptr) {
    size_t size = 0;
    Must(hsapPlanToJson(plan, nullptr, &size), "hsapPlanToJson");
    std::string json(size, '\0');
    Must(hsapPlanToJson(plan, json.data(), &size), "hsapPlanToJson");
    absl::StatusOr<hsap::Plan> parsed = hsap::PlanFromJsonText(json.c_str());
    std::printf("# plan: %d groups (all-to-all inside, sequence-aware sub-rings across)\n",
                plan_groups);
    if (parsed.ok()) {
      std::istringstream lines(hsap::DescribePlan(*parsed));
      for (std::string line; std::getline(lines, line);) std::printf("#   %s\n", line.c_str());
    }
    std::printf(
        "# a2a, p2p: bytes received per rank in one forward (mean over ranks) by the all-to-all "
        "inside the group (Q, K, V in; out and fp32 lse back) and by the sub-rings across groups; "
        "TE a2a, TE p2p: what TransformerEngine's a2a+p2p would receive per rank for the same "
        "row (symmetric groups of A = R/G ranks, documents padded to 2*R, equal shards, KV heads "
        "replicated up to A; a2a: Q, K, V in and out back; p2p: every other group's K/V); with a "
        "plan, 'bytes max/mean' count both (a2a + p2p), so their ratio to the naive ring can "
        "exceed 1\n");
  }
  if (on_gpu) {
    std::printf(
        "# fwdHid%%, bwdHid%%: share of the transfer time hidden behind compute, (C + X - F) / X "
        "with F the time of the full call, C of the same call without transfers and X without "
        "attention kernels (each the slowest rank's mean), clamped to [0, 100]\n");
    std::printf("# forward K/V: %s\n",
                fused_forward
                    ? "read from the peers' windows inside the fused kernel (fused_fwd_kernel; "
                      "no transfer stage, so fwdHid% is '-')"
                    : "loopback transfer stages (device-to-device copies) overlapped with the "
                      "attention kernels");
  }
}

void PrintTableHeader(const Setup& s) {
  const Options& o = *s.o;
  const bool on_gpu = s.on_gpu;
  const hsapPlan_t plan = s.plan;
  std::printf("# time: per call, the slowest rank's mean over %d iterations after %d warmup (ms)\n",
              o.iters, o.warmup);
  std::printf(
      "# TFLOP/s: all ranks together, over visible (query, key) pairs only: forward 4*D FLOPs "
      "per pair per query head (QK^T and PV), backward 10*D (2.5x forward)\n");
  std::printf(
      "# bytes: K/V bytes received per rank in one forward (max, mean over ranks; backward moves "
      "the same again plus fp32 dK/dV partials); ring: bytes per rank of a naive ring that "
      "delivers every K/V row to every rank, (T - T/R) * 2 * Hkv * D * size; ratio = mean / "
      "ring\n");
  std::printf(
      "%s"
      "# #wrong: elements of out, dq, dk, dv (gathered from the ranks) with |x - ref| > 2 * (max "
      "error of the same-precision single-device NaiveForward/Backward) + 4 rounding units; '-' "
      "when not checked (-c 0, or a row beyond the reference's limit); %s\n",
      o.nodes > 0
          ? "# intra, inter: forward K/V bytes received per rank (mean) from ranks of the same / "
            "another node (hsapBatchGetLinkTraffic); direct: the inter-node bytes per rank (mean) "
            "of direct delivery (each row sent from its owner to every rank that needs it, what "
            "the runtime does without rankNodes), from the direct schedules\n"
          : "",
      DescribeReferencePolicy(o.reference_policy(), on_gpu).c_str());
  if (o.check != 0) {
    std::printf(
        "# reference: after each row, '# check T ref SITE TIME': the reference that checked it "
        "(host or gpu; '-' and why when none did, or why the host stood in for the GPU) and its "
        "time, then max|err| against fp64 of out, dq, dk, dv: ours, and the same-precision "
        "single-device baseline's (the scale of the tolerance)\n");
  }
  std::printf("#\n# %9s %6s %6s %10s %10s %9s %9s %10s %10s %10s %7s", "tokens", "docs", "split",
              "fwd(ms)", "bwd(ms)", "fwdTF/s", "bwdTF/s", "bytes max", "bytes mean", "ring",
              "ratio");
  if (plan != nullptr) {
    std::printf(" %10s %10s %10s %10s", "a2a", "p2p", "TE a2a", "TE p2p");
  }
  if (o.nodes > 0) std::printf(" %10s %10s %10s", "intra", "inter", "direct");
  if (on_gpu) std::printf(" %8s %8s", "fwdHid%", "bwdHid%");
  std::printf(" %7s\n", "#wrong");
}

RowFigures FiguresOf(const Setup& s, const Row& row, const RankRuns& runs) {
  const Options& o = *s.o;
  const int R = s.R;
  const int64_t T = row.T;
  const size_t kv_row = row.kv_row;
  RowFigures f;
  f.fwd_flop = 4.0 * o.head_dim * static_cast<double>(row.pairs) * o.heads;
  f.fwd = *std::max_element(runs.fwd_s.begin(), runs.fwd_s.end());
  f.bwd = *std::max_element(runs.bwd_s.begin(), runs.bwd_s.end());
  f.fwd_tflops = f.fwd_flop / f.fwd * 1e-12;
  f.bwd_tflops = 2.5 * f.fwd_flop / f.bwd * 1e-12;
  double bytes_sum = 0;
  for (const hsapTraffic_t& tr : runs.traffic) {
    f.bytes_max = std::max(f.bytes_max, static_cast<double>(tr.forwardBytesReceived));
    bytes_sum += static_cast<double>(tr.forwardBytesReceived);
  }
  f.bytes_mean = bytes_sum / R;
  f.ring = static_cast<double>(T) * (R - 1) / R * 2.0 * static_cast<double>(kv_row);
  f.ratio = f.ring > 0 ? f.bytes_mean / f.ring : 0.0;
  f.split = SplitDocuments(s, row);
  return f;
}

bool PrintRowLine(const Setup& s, const Row& row, const RankRuns& runs, const RowFigures& f,
                  bool fused_forward, const char* wrong_col) {
  const Options& o = *s.o;
  const int R = s.R;
  const bool on_gpu = s.on_gpu;
  const hsapPlan_t plan = s.plan;
  const int64_t T = row.T;
  const std::vector<int64_t>& lengths = row.lengths;
  const size_t kv_row = row.kv_row;
  const hsapLayout_t layout = row.layout;
  const hsapPartition_t part = row.part;
  const std::vector<int>& rank_nodes = s.rank_nodes;
  const double fwd = f.fwd, bwd = f.bwd;
  const std::vector<double>* part_fwd_s = runs.part_fwd_s;
  const std::vector<double>* part_bwd_s = runs.part_bwd_s;
  std::printf("  %9lld %6zu %6lld %10.3f %10.3f %9.4f %9.4f %10s %10s %10s %7.4f", (long long)T,
              lengths.size(), (long long)f.split, fwd * 1e3, bwd * 1e3, f.fwd_tflops, f.bwd_tflops,
              HumanBytes(f.bytes_max).c_str(), HumanBytes(f.bytes_mean).c_str(),
              HumanBytes(f.ring).c_str(), f.ratio);
  if (plan != nullptr) {
    double a2a = 0, p2p = 0;
    for (const hsapTrafficDetail_t& d : runs.detail) {
      a2a += static_cast<double>(d.forwardAllToAllBytesReceived) / R;
      p2p += static_cast<double>(d.forwardRingBytesReceived) / R;
    }
    const TeBytes te =
        TransformerEngineBytes(lengths, R, s.plan_groups, o.heads, o.kv_heads, o.head_dim, s.esize);
    std::printf(" %10s %10s %10s %10s", HumanBytes(a2a).c_str(), HumanBytes(p2p).c_str(),
                HumanBytes(te.a2a).c_str(), HumanBytes(te.p2p).c_str());
  }
  if (o.nodes > 0) {
    double intra = 0, inter = 0, direct = 0;
    for (const hsapLinkTraffic_t& l : runs.links) {
      intra += static_cast<double>(l.forwardIntraNodeBytesReceived) / R;
      inter += static_cast<double>(l.forwardInterNodeBytesReceived) / R;
    }
    for (int r = 0; r < R; ++r) {
      absl::StatusOr<hsap::Schedule> sched =
          hsap::BuildSchedule(layout->layout, *part->partition, r, hsap::kKernelBlockQ);
      if (!sched.ok()) {
        std::fprintf(stderr, "direct schedule: %s\n",
                     std::string(sched.status().message()).c_str());
        return false;
      }
      for (const hsap::Stage& st : sched->stages) {
        if (st.recv_from >= 0 && rank_nodes[st.recv_from] != rank_nodes[r]) {
          direct += static_cast<double>(st.recv_rows) * 2.0 * kv_row / R;
        }
      }
    }
    std::printf(" %10s %10s %10s", HumanBytes(intra).c_str(), HumanBytes(inter).c_str(),
                HumanBytes(direct).c_str());
  }
  if (on_gpu) {
    // Share of the transfer-only time that the full call hid: (compute + transfers - full)
    // / transfers, each the slowest rank's, clamped to [0, 100] %.
    auto hidden = [&](const std::vector<double>* parts, double full) {
      const double comp = *std::max_element(parts[0].begin(), parts[0].end());
      const double xfer = *std::max_element(parts[1].begin(), parts[1].end());
      if (xfer <= 0) return 100.0;
      return std::clamp((comp + xfer - full) / xfer, 0.0, 1.0) * 100.0;
    };
    if (fused_forward) {
      std::printf(" %8s %8.1f", "-", hidden(part_bwd_s, bwd));
    } else {
      std::printf(" %8.1f %8.1f", hidden(part_fwd_s, fwd), hidden(part_bwd_s, bwd));
    }
  }
  std::printf(" %7s\n", wrong_col);
  return true;
}

void PrintFooter(const Setup& s, const Totals& t) {
  const int64_t total_wrong = t.wrong;
  const int rows = t.rows;
  std::printf("# Out of bounds values : %lld %s\n", (long long)total_wrong,
              total_wrong == 0 ? "OK" : "FAILED");
  std::printf("# Avg fwd TFLOP/s : %.4f\n# Avg bwd TFLOP/s : %.4f\n",
              rows ? t.sum_fwd_tflops / rows : 0.0, rows ? t.sum_bwd_tflops / rows : 0.0);
  std::printf("# Avg bytes moved vs naive ring : %.4f (%.1f%% saved)\n",
              rows ? t.sum_ratio / rows : 0.0, rows ? 100.0 * (1.0 - t.sum_ratio / rows) : 0.0);
  if (s.on_gpu) std::printf("# Device pool per rank (max) : %s\n", HumanBytes(t.max_pool).c_str());
  PrintCudnnAverages(t.cudnn);
  std::printf("#\n");
}

}  // namespace hsap::bench::attn_perf
