// hsap_plan: plans attention for a model on a (heterogeneous) cluster and compares the plan
// with the symmetric baselines, both priced by what runs (the run simulator: the runtime's
// own programs for one document of --seq tokens).
//
//   hsap_plan --cluster clusters/testbed_8h100_8a100.json [--model llama-7b | MODEL.json]
//             [--seq 131072] [--full] [--margin 0.1] [--no-checkpointing]
//             [--json PLAN.json] [--svg PICTURE.svg] [--brief]
//             [--run [--docs MEAN] [--seed N]]
//             [--engine auto|jit|cudnn|fa2|fa3] [--calibration FILE|builtin|none]
//   hsap_plan --brief clusters/mix32_*.json ...    one table row per cluster + summary
//   hsap_plan --help
//
// Pricing (docs/cost_model.md): the attention engine's calibrated TFLOP/s by block length
// and head dim, forward and backward apart (lib/planner/calibration.h): the built-in
// calibration (H200 measurements and published figures) by default, a calibration file
// over it (--calibration FILE, as hsap_attn_perf --calibration-out writes), or none (the
// flat datasheet peak x attention_efficiency of the cluster description). --engine: the
// engine priced, auto (default: cuDNN where calibrated, else the JIT kernels, as
// HSAP_ATTENTION_ENGINE=auto runs), jit, cudnn, or the what-ifs fa2 / fa3. The output says
// what priced the plan: "# priced: engine cudnn, calibration built-in H200 (measured 2026-12)".
//
// A --json or --svg file that cannot be written is an error (exit 1, the reason on stderr).
// The SVG draws the first 128 devices and says so in the picture when there are more.
//
// tokens/s counts the row's tokens through the attention of every layer, forward and
// backward: seq / (layers x (t_fwd + t_bwd)) with the run simulator's per-layer times. The
// SVG's timeline comes from the event simulator (lib/planner/simulator.h), which records
// events.
//
// --run: the plan and the baselines (the strongest first), each with and without node
// stores, as the runtime runs them (lib/planner/run_simulator.h) on a row of --seq tokens: one
// causal document, or causal documents of mean length --docs drawn from --seed. Per layer: forward
// and backward time, the busiest rank's compute, the imbalance (that minus the mean rank's), the
// transfer time no compute hid, the inter-node bytes, the NIC lower bound (busiest node's
// inter-node bytes over its NICs), and the time to build the programs and price them.
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "lib/planner/baselines.h"
#include "lib/planner/calibration.h"
#include "lib/planner/cluster.h"
#include "lib/planner/cost_model.h"
#include "lib/planner/group_programs.h"
#include "lib/planner/planner.h"
#include "lib/planner/run_simulator.h"
#include "lib/planner/simulator.h"
#include "lib/sched/plan.h"
#include "lib/sched/plan_json.h"

namespace {

using namespace hsap;

struct Args {
  std::vector<std::string> clusters;
  std::string model = "llama-7b";
  int64_t seq = 131072;
  bool full = false;
  double margin = 0.10;
  bool checkpointing = true;
  std::string json_path, svg_path;
  bool brief = false;
  bool run = false;   // also simulate what the runtime runs (run_simulator.h)
  double docs = 0;    // mean document length of the row it runs; 0: one document
  uint64_t seed = 1;  // of the document lengths
  Engine engine = Engine::kAuto;
  std::string calibration = "builtin";  // a file, "builtin" or "none"
};

constexpr char kUsage[] =
    "usage: hsap_plan --cluster FILE [--model NAME] [--seq N] [--full] [--margin F] "
    "[--no-checkpointing] [--json FILE] [--svg FILE] [--brief] [--run [--docs MEAN] "
    "[--seed N]] [--engine auto|jit|cudnn|fa2|fa3] [--calibration FILE|builtin|none] "
    "[FILE...]\n"
    "       hsap_plan --help\n";

[[noreturn]] void Usage(const char* msg) {
  std::fprintf(stderr, "hsap_plan: %s\n%s", msg, kUsage);
  std::exit(2);
}

Args Parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) Usage(("missing value after " + arg).c_str());
      return argv[++i];
    };
    if (arg == "--help" || arg == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (arg == "--cluster") {
      a.clusters.push_back(value());
    } else if (arg == "--model") {
      a.model = value();
    } else if (arg == "--seq") {
      if (!absl::SimpleAtoi(value(), &a.seq) || a.seq < 1) Usage("--seq needs a positive integer");
    } else if (arg == "--full") {
      a.full = true;
    } else if (arg == "--margin") {
      if (!absl::SimpleAtod(value(), &a.margin)) Usage("--margin needs a number in [0, 1)");
    } else if (arg == "--no-checkpointing") {
      a.checkpointing = false;
    } else if (arg == "--json") {
      a.json_path = value();
    } else if (arg == "--svg") {
      a.svg_path = value();
    } else if (arg == "--run") {
      a.run = true;
    } else if (arg == "--docs") {
      if (!absl::SimpleAtod(value(), &a.docs) || a.docs < 0) Usage("--docs needs a length >= 0");
    } else if (arg == "--seed") {
      if (!absl::SimpleAtoi(value(), &a.seed)) Usage("--seed needs a non-negative integer");
    } else if (arg == "--engine") {
      absl::StatusOr<Engine> engine = ParseEngine(value());
      if (!engine.ok()) Usage(std::string(engine.status().message()).c_str());
      a.engine = *engine;
    } else if (arg == "--calibration") {
      a.calibration = value();
    } else if (arg == "--brief") {
      a.brief = true;
    } else if (!arg.empty() && arg[0] != '-') {
      a.clusters.push_back(arg);
    } else {
      Usage(("unknown option " + arg).c_str());
    }
  }
  if (a.clusters.empty()) Usage("give a cluster file");
  return a;
}

const char* Color(SimEventKind kind, bool backward) {
  switch (kind) {
    case SimEventKind::kCompute:
      return backward ? "#1f4e9c" : "#4f8fe0";
    case SimEventKind::kAllToAll:
      return backward ? "#c0611a" : "#f29a4a";
    case SimEventKind::kRing:
      return backward ? "#2c8a3e" : "#66c17a";
  }
  return "#999";
}

// Writes `text` to `path`; the error names the path and the reason.
absl::Status WriteTextFile(const std::string& path, const std::string& text) {
  errno = 0;
  std::ofstream out(path, std::ios::binary);
  if (out) out << text;
  if (out) out.close();
  if (!out) {
    return absl::UnavailableError(absl::StrCat(
        "cannot write ", path, errno != 0 ? absl::StrCat(": ", std::strerror(errno)) : ""));
  }
  return absl::OkStatus();
}

// Devices drawn in the picture; a larger plan's picture says which ones are left out.
constexpr int kMaxSvgLanes = 128;

// The SVG picture of `plan`: a timeline of the simulated layer and the assignment per device.
std::string PlanSvg(const Cluster& cluster, const Workload& workload, const Plan& plan,
                    const SimResult& sim) {
  std::ostringstream out;
  const int n = plan.num_ranks;
  const int lanes = std::min(n, kMaxSvgLanes);
  const double width = 1000, left = 150, lane_h = 14, top = 40;
  const double timeline_h = top + lanes * lane_h + 30;
  const double height = timeline_h + 40 + lanes * lane_h + 40;
  const double total = sim.Seconds();
  out << absl::StrFormat(
      "<svg xmlns='http://www.w3.org/2000/svg' width='%.0f' height='%.0f' "
      "font-family='monospace' font-size='10'>\n<rect width='100%%' height='100%%' "
      "fill='white'/>\n",
      left + width + 20, height);
  out << absl::StrFormat(
      "<text x='10' y='16' font-size='13'>%s on %s: %s, %d tokens — event simulator's layer %.3f "
      "ms "
      "(fwd %.3f + bwd %.3f)</text>\n",
      workload.model.name, cluster.Summary(), plan.description, workload.seq_len, total * 1e3,
      sim.forward_seconds * 1e3, sim.backward_seconds * 1e3);
  out << "<text x='10' y='30'>timeline: compute (blue), all-to-all (orange), ring K/V "
         "(green); light = forward, dark = backward; transfers drawn on the receiver</text>\n";
  if (lanes < n) {
    out << absl::StrFormat(
        "<text x='10' y='%.1f' font-size='12' fill='#b00'>only devices 0-%d of %d are drawn; "
        "devices %d-%d are left out of this picture (hsap_plan --json has every device)</text>\n",
        timeline_h - 8, lanes - 1, n, lanes, n - 1);
  }
  for (int r = 0; r < lanes; ++r) {
    const double y = top + r * lane_h;
    out << absl::StrFormat("<text x='10' y='%.1f'>%4d %s</text>\n", y + 10, r,
                           cluster.kind_of(r).name);
  }
  for (const SimEvent& e : sim.events) {
    if (e.device >= lanes || e.end <= e.start) continue;
    const double y =
        top + e.device * lane_h + (e.kind == SimEventKind::kCompute ? 0 : lane_h * 0.55);
    const double h = e.kind == SimEventKind::kCompute ? lane_h * 0.5 : lane_h * 0.35;
    out << absl::StrFormat("<rect x='%.2f' y='%.1f' width='%.2f' height='%.1f' fill='%s'/>\n",
                           left + e.start / total * width, y,
                           std::max(0.3, (e.end - e.start) / total * width), h,
                           Color(e.kind, e.backward));
  }
  // Assignment: token share (bar) and heads (text) per device.
  const double y0 = timeline_h + 20;
  out << absl::StrFormat(
      "<text x='10' y='%.1f' font-size='12'>assignment: bar = share of the row's tokens held "
      "before the all-to-all (scaled to the largest); group and query heads after it</text>\n",
      y0);
  const std::vector<double> shares = plan.RankShares();
  const double max_share = *std::max_element(shares.begin(), shares.end());
  const std::vector<int> group_of = plan.GroupOfRank(), index = plan.IndexInGroup();
  for (int r = 0; r < lanes; ++r) {
    const double y = y0 + 10 + r * lane_h;
    const int g = group_of[r];
    out << absl::StrFormat("<text x='10' y='%.1f'>%4d %s</text>\n", y + 10, r,
                           cluster.kind_of(r).name);
    out << absl::StrFormat(
        "<rect x='%.1f' y='%.1f' width='%.2f' height='%.1f' fill='hsl(%d,60%%,60%%)'/>\n", left,
        y + 1, shares[r] / max_share * width * 0.5, lane_h - 3, (g * 47) % 360);
    out << absl::StrFormat("<text x='%.1f' y='%.1f'>%.3f%%  group %d  heads %s</text>\n",
                           left + width * 0.5 + 10, y + 10, 100 * shares[r], g,
                           FormatHeads(plan.groups[g].heads[index[r]]));
  }
  out << "</svg>\n";
  return out.str();
}

// The breakdown of a priced layer (fwd + bwd): the busiest device's compute, the imbalance
// (that minus the mean device's compute), and the rest: transfer no compute hid.
struct Breakdown {
  double compute = 0, imbalance = 0, exposed = 0;
};
Breakdown BreakdownOf(const RunSimulation& run) {
  return {run.MaxComputeSeconds(), run.ImbalanceSeconds(), run.ExposedTransferSeconds()};
}

double TokensPerSecond(const Workload& w, const RunSimulation& run) {
  return static_cast<double>(w.seq_len) / (w.model.layers * run.Seconds());
}

struct Row {
  std::string name, config;
  bool available;
  double fwd, bwd, tokens_per_s;
};

// --run: the plan and the baselines' plans (the strongest first) as the runtime runs them on
// a row (one causal document, or documents of mean length --docs), priced by the run
// simulator, each with and without node stores.
int ReportRun(const Args& args, const Cluster& cluster, const ModelSpec& model,
              const PlannerResult& result, const std::string& best_name) {
  absl::StatusOr<Layout> row = SampleRow(args.seq, args.docs, args.seed);
  if (!row.ok()) {
    std::fprintf(stderr, "hsap_plan: --run: %s\n", std::string(row.status().message()).c_str());
    return 1;
  }
  const LayerShape shape{model.heads_q, model.heads_kv, model.head_dim,
                         model.dtype_bytes == 4 ? DType::kF32 : DType::kBF16};
  // Every plan as chosen, and with node stores (lib/sched/hierarchy.h, 6.) the other way
  // (`stores`: yes / no), so both sides of the planner's choice show in one run.
  std::vector<std::pair<std::string, Plan>> plans;
  auto add = [&](const std::string& name, const Plan& plan) {
    plans.push_back({name, plan});
    plans.push_back({name, plan});
    plans.back().second.node_stores = !plan.node_stores;
  };
  add("hsap", result.plan);
  for (const Baseline& b : result.baselines) {
    if (b.available && b.name == best_name) add(b.name, b.plan);
  }
  for (const Baseline& b : result.baselines) {
    if (b.available && b.name != best_name) add(b.name, b.plan);
  }
  std::printf("# what runs: %s, priced by the run simulator (the runtime's own programs)\n",
              args.docs > 0 ? absl::StrFormat("documents of mean %.0f tokens, seed %lu", args.docs,
                                              static_cast<unsigned long>(args.seed))
                                  .c_str()
                            : "one causal document");
  std::printf("# %-12s %6s %10s %10s %10s %10s %10s %12s %10s %9s\n", "layout", "stores", "fwd_ms",
              "bwd_ms", "compute_ms", "imbal_ms", "exposed_ms", "internode_GB", "nic_lb_ms",
              "build_ms");
  for (const auto& [name, plan] : plans) {
    const auto start = std::chrono::steady_clock::now();
    absl::StatusOr<std::vector<RankProgram>> programs = PlanPrograms(*row, plan, cluster, shape);
    absl::StatusOr<RunSimulation> sim = programs.ok()
                                            ? SimulatePrograms(cluster, *programs, model.head_dim)
                                            : absl::StatusOr<RunSimulation>(programs.status());
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (!sim.ok()) {
      std::fprintf(stderr, "hsap_plan: --run %s: %s\n", name.c_str(),
                   std::string(sim.status().message()).c_str());
      return 1;
    }
    std::printf("  %-12s %6s %10.3f %10.3f %10.3f %10.3f %10.3f %12.3f %10.3f %9.0f\n",
                name.c_str(), plan.node_stores ? "yes" : "no", sim->forward_seconds * 1e3,
                sim->backward_seconds * 1e3, sim->MaxComputeSeconds() * 1e3,
                sim->ImbalanceSeconds() * 1e3, sim->ExposedTransferSeconds() * 1e3,
                sim->InterNodeBytes() / 1e9, NicBoundSeconds(cluster, *sim) * 1e3, ms);
  }
  return 0;
}

// The model of --model: a preset's name or a model JSON file.
absl::StatusOr<ModelSpec> LoadModel(const Args& args) {
  absl::StatusOr<ModelSpec> model = ModelPreset(args.model);
  if (args.model.size() > 5 && args.model.substr(args.model.size() - 5) == ".json") {
    std::ifstream in(args.model);
    std::stringstream text;
    text << in.rdbuf();
    model = in ? ModelFromJsonText(text.str())
               : absl::StatusOr<ModelSpec>(absl::NotFoundError("cannot open " + args.model));
  }
  return model;
}

// The plan against the baselines, by what runs: the table's rows (hsap first), the
// strongest baseline, and the yardsticks.
struct Comparison {
  std::vector<Row> rows;
  double best_baseline = 0;  // tokens/s
  std::string best_name = "none";
  double speedup = 0, e2e_hsap = 0, e2e_base = 0, e2e_speedup = 0;
  double ideal_tps = 0, hardware_tps = 0, of_ideal = 0;
  Breakdown parts;
};

Comparison Compare(const Cluster& cluster, const ModelSpec& model, const Workload& workload,
                   const PlannerResult& result) {
  Comparison c;
  c.ideal_tps =
      static_cast<double>(workload.seq_len) / (model.layers * IdealSeconds(cluster, workload));
  std::vector<Row>& rows = c.rows;
  rows.push_back({"hsap", result.family, true, result.run.forward_seconds,
                  result.run.backward_seconds, TokensPerSecond(workload, result.run)});
  for (const Baseline& b : result.baselines) {
    Row row{b.name, b.config, b.available, 0, 0, 0};
    if (b.available) {
      row.fwd = b.run.forward_seconds;
      row.bwd = b.run.backward_seconds;
      row.tokens_per_s = TokensPerSecond(workload, b.run);
      if (row.tokens_per_s > c.best_baseline) {
        c.best_baseline = row.tokens_per_s;
        c.best_name = b.name;
      }
    }
    rows.push_back(row);
  }
  c.speedup = c.best_baseline > 0 ? rows[0].tokens_per_s / c.best_baseline : 0;
  // End to end: attention (as it runs) plus the token-parallel projections and MLP.
  // With activation checkpointing the attention's forward runs again in the backward.
  const bool recompute = workload.budget.activation_checkpointing;
  auto e2e_tokens_per_s = [&](const Plan& plan, const RunSimulation& run) {
    const double attention = run.Seconds() + (recompute ? run.forward_seconds : 0.0);
    return static_cast<double>(workload.seq_len) /
           (model.layers * (attention + DenseLayerSeconds(cluster, workload, plan)));
  };
  c.e2e_hsap = e2e_tokens_per_s(result.plan, result.run);
  for (const Baseline& b : result.baselines) {
    if (b.available && b.name == c.best_name) c.e2e_base = e2e_tokens_per_s(b.plan, b.run);
  }
  c.e2e_speedup = c.e2e_base > 0 ? c.e2e_hsap / c.e2e_base : 0;
  c.hardware_tps = static_cast<double>(workload.seq_len) /
                   (model.layers * HardwareBoundSeconds(cluster, workload));
  c.parts = BreakdownOf(result.run);
  c.of_ideal = rows[0].tokens_per_s / c.ideal_tps;
  return c;
}

// The plan, the table of it against the baselines, and the yardsticks.
void PrintPlanReport(const Args& args, const Cluster& cluster, const ModelSpec& model,
                     const Workload& workload, const PlannerResult& result, const Comparison& c) {
  const std::vector<Row>& rows = c.rows;
  std::printf("# hsap_plan: %s (%s), %s, %ld tokens, %s mask\n", cluster.name.c_str(),
              cluster.Summary().c_str(), model.name.c_str(), static_cast<long>(args.seq),
              args.full ? "full" : "causal");
  std::printf("# priced: %s\n", cluster.pricing.empty()
                                    ? "flat datasheet peak x attention_efficiency (no calibration)"
                                    : cluster.pricing.c_str());
  std::printf(
      "# attention per layer: %.3g TFLOP forward, %.3g TFLOP backward; ideal bound "
      "%.3f ms/layer\n#\n",
      workload.ForwardFlops() / 1e12, workload.BackwardFlops() / 1e12,
      IdealSeconds(cluster, workload) * 1e3);
  std::string described = DescribePlan(result.plan);
  std::printf("%s#\n", described.c_str());
  std::printf("# %-12s %-36s %10s %10s %12s %8s %8s\n", "layout", "config", "fwd_ms", "bwd_ms",
              "tokens/s", "vs_best", "of_ideal");
  for (const Row& r : rows) {
    if (!r.available) {
      std::printf("  %-12s %-36s %10s %10s %12s %8s %8s\n", r.name.c_str(),
                  r.config.substr(0, 36).c_str(), "-", "-", "-", "-", "-");
      if (r.config.size() > 36) std::printf("  %12s   (%s)\n", "", r.config.c_str());
      continue;
    }
    std::printf("  %-12s %-36s %10.3f %10.3f %12.0f %7.3fx %7.1f%%\n", r.name.c_str(),
                r.config.substr(0, 36).c_str(), r.fwd * 1e3, r.bwd * 1e3, r.tokens_per_s,
                c.best_baseline > 0 ? r.tokens_per_s / c.best_baseline : 0.0,
                100 * r.tokens_per_s / c.ideal_tps);
  }
  std::printf(
      "# strongest baseline: %s; hsap speedup %.3fx; %.1f%% of the ideal bound; "
      "planning %.1f ms wall, %.1f ms CPU: search %.1f ms (%d cost-model evaluations), "
      "baselines %.1f ms\n",
      c.best_name.c_str(), c.speedup, 100 * c.of_ideal, result.planning_seconds * 1e3,
      result.planning_cpu_seconds * 1e3, result.search_cpu_seconds * 1e3, result.candidates,
      result.baselines_cpu_seconds * 1e3);
  std::printf(
      "# yardsticks per layer (fwd + bwd): hardware bound %.3f ms (datasheet peak, efficiency "
      "1), model bound %.3f ms (cost-model efficiency); hsap at %.1f%% / %.1f%% of them\n",
      HardwareBoundSeconds(cluster, workload) * 1e3, IdealSeconds(cluster, workload) * 1e3,
      100 * rows[0].tokens_per_s / c.hardware_tps, 100 * c.of_ideal);
  std::printf(
      "# hsap's layer as it runs: %.3f ms = compute %.3f (busiest device) + exposed transfer "
      "%.3f; imbalance %.3f (busiest minus mean device compute)\n",
      result.run.Seconds() * 1e3, c.parts.compute * 1e3, c.parts.exposed * 1e3,
      c.parts.imbalance * 1e3);
  std::printf(
      "# end to end (attention + token-parallel projections and MLP, token shares of the "
      "plan; GEMMs at the kind's GEMM efficiency; with checkpointing the forward recomputed): "
      "hsap %.0f tokens/s, %s %.0f tokens/s: %.3fx (attention only %.3fx)\n",
      c.e2e_hsap, c.best_name.c_str(), c.e2e_base, c.e2e_speedup, c.speedup);
}

// The cluster's line of the --brief table.
void PrintBriefLine(const Cluster& cluster, const PlannerResult& result, const Comparison& c) {
  const std::vector<Row>& rows = c.rows;
  const double step = result.run.Seconds();
  std::printf(
      "  %-28s %-30s %12.0f %12.0f %-10s %7.3fx %7.3fx %7.1f%% %7.1f%% %5.0f%% %5.0f%% %5.0f%% "
      "%9.1f %9.1f\n",
      cluster.name.c_str(), cluster.Summary().substr(0, 30).c_str(), rows[0].tokens_per_s,
      c.best_baseline, c.best_name.c_str(), c.speedup, c.e2e_speedup,
      100 * rows[0].tokens_per_s / c.hardware_tps, 100 * c.of_ideal, 100 * c.parts.compute / step,
      100 * c.parts.exposed / step, 100 * c.parts.imbalance / step, result.search_cpu_seconds * 1e3,
      result.baselines_cpu_seconds * 1e3);
}

// --json and --svg. 1 after saying why a file cannot be written, else 0.
int WriteOutputs(const Args& args, const Cluster& cluster, const Workload& workload,
                 const PlannerResult& result) {
  if (!args.json_path.empty()) {
    if (absl::Status written = WriteTextFile(args.json_path, PlanToJsonText(result.plan) + "\n");
        !written.ok()) {
      std::fprintf(stderr, "hsap_plan: --json: %s\n", std::string(written.message()).c_str());
      return 1;
    }
  }
  if (!args.svg_path.empty()) {
    SimOptions options;
    options.record_events = true;
    auto sim = Simulate(cluster, workload, result.plan, options);
    absl::Status written = sim.status();
    if (sim.ok()) {
      written = WriteTextFile(args.svg_path, PlanSvg(cluster, workload, result.plan, *sim));
    }
    if (!written.ok()) {
      std::fprintf(stderr, "hsap_plan: --svg: %s\n", std::string(written.message()).c_str());
      return 1;
    }
    if (cluster.size() > kMaxSvgLanes) {
      std::fprintf(stderr, "hsap_plan: the picture %s draws devices 0-%d of %d\n",
                   args.svg_path.c_str(), kMaxSvgLanes - 1, cluster.size());
    }
  }
  return 0;
}

// The calibration of --calibration: the built-in one, a file over it, or none (nullopt).
absl::StatusOr<std::optional<Calibration>> LoadPricing(const Args& args) {
  if (args.calibration == "none") return std::optional<Calibration>();
  if (args.calibration == "builtin") return std::optional<Calibration>(BuiltinCalibration());
  absl::StatusOr<Calibration> c = LoadCalibrationOverBuiltin(args.calibration);
  if (!c.ok()) return c.status();
  return std::optional<Calibration>(*std::move(c));
}

int RunOne(const Args& args, const std::optional<Calibration>& calibration, const std::string& path,
           bool print_plan, std::vector<double>* speedups, std::vector<double>* ideal_fractions) {
  auto cluster = LoadCluster(path);
  if (cluster.ok() && calibration.has_value()) {
    absl::StatusOr<std::string> priced = ApplyCalibration(*calibration, args.engine, &*cluster);
    if (!priced.ok()) cluster = priced.status();
  }
  if (!cluster.ok()) {
    std::fprintf(stderr, "hsap_plan: %s\n", std::string(cluster.status().message()).c_str());
    return 1;
  }
  const absl::StatusOr<ModelSpec> model = LoadModel(args);
  if (!model.ok()) {
    std::fprintf(stderr, "hsap_plan: %s\n", std::string(model.status().message()).c_str());
    return 2;
  }
  Workload workload;
  workload.model = *model;
  workload.seq_len = args.seq;
  workload.causal = !args.full;
  workload.budget.margin_fraction = args.margin;
  workload.budget.activation_checkpointing = args.checkpointing;
  auto result = PlanAttention(*cluster, workload);
  if (!result.ok()) {
    std::fprintf(stderr, "hsap_plan: %s: %s\n", path.c_str(),
                 std::string(result.status().message()).c_str());
    return 1;
  }
  const Comparison c = Compare(*cluster, *model, workload, *result);
  if (speedups && c.speedup > 0) speedups->push_back(c.speedup);
  if (ideal_fractions) ideal_fractions->push_back(c.of_ideal);
  if (print_plan) {
    PrintPlanReport(args, *cluster, *model, workload, *result, c);
  } else {
    PrintBriefLine(*cluster, *result, c);
  }
  if (args.run && print_plan) {
    if (int rc = ReportRun(args, *cluster, *model, *result, c.best_name); rc != 0) return rc;
  }
  return WriteOutputs(args, *cluster, workload, *result);
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = Parse(argc, argv);
  const absl::StatusOr<std::optional<Calibration>> calibration = LoadPricing(args);
  if (!calibration.ok()) {
    std::fprintf(stderr, "hsap_plan: --calibration: %s\n",
                 std::string(calibration.status().message()).c_str());
    return 1;
  }
  if (args.clusters.size() == 1 && !args.brief) {
    return RunOne(args, *calibration, args.clusters[0], /*print_plan=*/true, nullptr, nullptr);
  }
  std::printf(
      "# hsap_plan: model %s, %ld tokens, %s mask; tokens/s through all layers' "
      "attention (fwd + bwd), priced by what runs (the run simulator: the runtime's own "
      "programs)\n",
      args.model.c_str(), static_cast<long>(args.seq), args.full ? "full" : "causal");
  std::printf(
      "# priced: engine %s, calibration %s (hsap_plan --cluster FILE names the figures "
      "per device kind)\n",
      EngineName(args.engine),
      calibration->has_value() ? (*calibration)->name.c_str()
                               : "none (flat datasheet peak x attention_efficiency)");
  std::printf(
      "# speedup: attention only; e2e_x: whole layer (attention + token-parallel projections "
      "and MLP); of_hw / of_model: hsap against the hardware bound (datasheet peak) and the "
      "model bound (cost-model efficiency); compute / exposed / imbal: shares of hsap's "
      "layer as it runs (busiest device's compute, transfer not hidden, busiest minus mean)\n");
  std::printf("# %-28s %-30s %12s %12s %-10s %8s %8s %8s %8s %6s %6s %6s %9s %9s\n", "cluster",
              "devices", "hsap_tok/s", "base_tok/s", "baseline", "speedup", "e2e_x", "of_hw",
              "of_model", "comp", "expos", "imbal", "search_ms", "base_ms");
  std::vector<double> speedups, ideal;
  int rc = 0;
  for (const std::string& path : args.clusters) {
    rc |= RunOne(args, *calibration, path, /*print_plan=*/false, &speedups, &ideal);
  }
  if (!speedups.empty()) {
    double sum = 0, max = 0;
    for (double s : speedups) {
      sum += s;
      max = std::max(max, s);
    }
    std::printf(
        "# speedup over the strongest symmetric baseline: mean %.3fx, max %.3fx over %zu "
        "clusters\n",
        sum / speedups.size(), max, speedups.size());
  }
  return rc;
}
