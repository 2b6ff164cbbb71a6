#include "bench/attn_perf_options.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <sstream>

#include "absl/status/statusor.h"
#include "bench/bench_util.h"
#include "lib/cuda/cudnn/engine_choice.h"

namespace hsap::bench::attn_perf {

[[noreturn]] void Usage(const char* error) {
  if (error != nullptr) std::fprintf(stderr, "error: %s\n\n", error);
  std::fprintf(
      stderr,
      "usage: hsap_attn_perf [options]\n"
      "  -b, --minbytes N       first row length in tokens (default 4096)\n"
      "  -e, --maxbytes N       last row length in tokens (default: the first)\n"
      "  -f, --stepfactor X     multiply the row length by X per step (default 2)\n"
      "  -n, --iters N          timed iterations (default 5)\n"
      "  -w, --warmup_iters N   warmup iterations (default 1)\n"
      "  -c, --check 0|1        check against the fp64 reference (default 1), on rows within\n"
      "                         the reference's limit (--ref-max-gflop, --gpu-ref-max-gflop)\n"
      "      --ranks N          host ranks, one thread each (default 4)\n"
      "      --docs-dist D      longtail | uniform | single | tiny (default longtail)\n"
      "      --tokens-per-doc N mean document length for longtail/uniform (default 1024)\n"
      "      --mask M           causal | mixed (all four kinds in turn) (default causal)\n"
      "      --heads N          query heads (default 8)\n"
      "      --kv-heads N       key/value heads (default 2)\n"
      "      --head-dim N       head dim, 32..256, multiple of 8 (default 64)\n"
      "      --dtype T          fp32 | bf16 | fp16 (default bf16)\n"
      "      --weights a,b,...  per-rank weights (default equal)\n"
      "  -T, --threads N        compute threads per rank (default: hardware threads / ranks)\n"
      "      --nodes N          describe the ranks as N nodes of R/N consecutive ranks (host\n"
      "                         backend, ring batches): K/V rows needed by several ranks of a\n"
      "                         node cross into it once; prints intra/inter-node bytes beside\n"
      "                         the inter-node bytes of direct delivery\n"
      "      --reference R      where rows are checked: auto (default: the GPU on\n"
      "                         cuda-loopback for rows above 0.5 GFLOP of forward work, else\n"
      "                         the host) | host | gpu (the fp64 reference on GPU 0; a row\n"
      "                         falls back to the host if it fails and the row is within\n"
      "                         --ref-max-gflop)\n"
      "      --ref-max-gflop X  the host checks rows up to X GFLOP of forward work (default 4)\n"
      "      --gpu-ref-max-gflop X  the GPU checks rows up to X GFLOP of forward work\n"
      "                         (default 20000; 32K tokens x 16 heads x d 128 causal: 4400)\n"
      "      --timeout-ms N     communicator timeout (default 600000)\n"
      "      --seed N           seed of lengths and data (default 1)\n"
      "  Rank arrangement (runs hsapBatchCreateWithPlan):\n"
      "      --groups a,b,...   head-parallel group sizes (ranks in order; sets --ranks)\n"
      "      --heads a,b:c,d    per-rank query head counts, groups separated by ':' (each\n"
      "                         group's counts sum to the query heads; default: even split)\n"
      "      --seq-weights ...  per-group sequence weights (default equal)\n"
      "      --token-weights .. per-rank token weights inside the groups (default equal)\n"
      "      --plan FILE.json   a plan written by hsap_plan --json (instead of --groups)\n"
      "      --backend B        host (default) | cuda-loopback (all ranks on GPU 0, one\n"
      "                         stream each, JIT CUDA kernels)\n"
      "      --cudnn 0|1        cuda-loopback: also time cuDNN's fused attention forward and\n"
      "                         backward on the whole row (default 1)\n"
      "      --fused 0|1        cuda-loopback batches without a plan: forward reads the\n"
      "                         peers' K/V inside the fused kernel (1) or moves it with\n"
      "                         loopback transfer stages (0); sets $HSAP_FUSED_FORWARD.\n"
      "                         Default: hsap's choice (stages for several ranks on one\n"
      "                         GPU, docs/gpu_backend.md)\n"
      "      --engine E         cuda-loopback: the engine of hsap's attention pieces, auto |\n"
      "                         cudnn | jit (sets $HSAP_ATTENTION_ENGINE; each row prints the\n"
      "                         engine tally as '# engines'). cuDNN's whole-row call is\n"
      "                         timed beside it either way (--cudnn)\n"
      "      --calibration-out FILE  cuda-loopback, --ranks 1, no plan: write each row's\n"
      "                         forward and backward TFLOP/s (ours as engine jit, cuDNN's\n"
      "                         as cudnn) as a calibration file for hsap_plan --calibration\n");
  std::exit(error == nullptr ? 0 : 2);
}

namespace {

// The options of the run: row lengths, iterations, checking, threads, nodes, timeout, seed.
// False when `a` is none of them.
bool ApplyRunOption(const Arg& a, Options& o, bool& end_set) {
  const std::string& arg = a.name;
  const bool numeric = a.numeric;
  const double num = a.num;
  auto need_int = [&](int64_t lo) { return a.Int(lo); };
  if (arg == "-b" || arg == "--minbytes" || arg == "--min-tokens") {
    o.tokens_begin = need_int(1);
  } else if (arg == "-e" || arg == "--maxbytes" || arg == "--max-tokens") {
    o.tokens_end = need_int(1);
    end_set = true;
  } else if (arg == "-f" || arg == "--stepfactor") {
    if (!numeric || num <= 1.0) Usage("-f needs a number > 1");
    o.factor = num;
  } else if (arg == "-n" || arg == "--iters") {
    o.iters = static_cast<int>(need_int(1));
  } else if (arg == "-w" || arg == "--warmup_iters") {
    o.warmup = static_cast<int>(need_int(0));
  } else if (arg == "-c" || arg == "--check") {
    o.check = static_cast<int>(need_int(0));
  } else if (arg == "--nodes") {
    o.nodes = static_cast<int>(need_int(1));
  } else if (arg == "-T" || arg == "--threads") {
    o.threads = static_cast<int>(need_int(0));
  } else if (arg == "--ref-max-gflop") {
    if (!numeric || num < 0) Usage("--ref-max-gflop needs a number >= 0");
    o.ref_max_gflop = num;
  } else if (arg == "--gpu-ref-max-gflop") {
    if (!numeric || num < 0) Usage("--gpu-ref-max-gflop needs a number >= 0");
    o.gpu_ref_max_gflop = num;
  } else if (arg == "--reference") {
    absl::StatusOr<ReferenceChoice> choice = ParseReferenceChoice(a.value);
    if (!choice.ok()) Usage(std::string(choice.status().message()).c_str());
    o.reference = *choice;
  } else if (arg == "--timeout-ms") {
    o.timeout_ms = static_cast<int>(need_int(1));
  } else if (arg == "--seed") {
    o.seed = static_cast<uint32_t>(need_int(0));
  } else {
    return false;
  }
  return true;
}

// The options of the problem and of the ranks: documents, mask, heads, dtype, weights, the
// rank arrangement, the backend. False when `a` is none of them.
bool ApplyShapeOption(const Arg& a, Options& o) {
  const std::string& arg = a.name;
  const std::string& value = a.value;
  auto need_int = [&](int64_t lo) { return a.Int(lo); };
  if (arg == "--ranks") {
    o.ranks = static_cast<int>(need_int(1));
    o.ranks_set = true;
  } else if (arg == "--docs-dist") {
    o.docs_dist = value;
  } else if (arg == "--tokens-per-doc") {
    o.tokens_per_doc = need_int(1);
  } else if (arg == "--mask") {
    o.mask = value;
  } else if (arg == "--heads" &&
             (value.find(',') != std::string::npos || value.find(':') != std::string::npos)) {
    o.group_heads.clear();
    std::stringstream groups(value);
    std::string group;
    while (std::getline(groups, group, ':')) {
      std::vector<int> counts;
      for (double c : ParseList(group, "--heads", /*allow_zero=*/true)) {
        counts.push_back(static_cast<int>(c));
      }
      o.group_heads.push_back(counts);
    }
  } else if (arg == "--heads") {
    o.heads = static_cast<int>(need_int(1));
  } else if (arg == "--groups") {
    o.groups.clear();
    for (double g : ParseList(value, "--groups", false)) o.groups.push_back(static_cast<int>(g));
  } else if (arg == "--seq-weights") {
    o.seq_weights = ParseList(value, "--seq-weights", false);
  } else if (arg == "--token-weights") {
    o.token_weights = ParseList(value, "--token-weights", true);
  } else if (arg == "--plan") {
    o.plan_file = value;
  } else if (arg == "--backend") {
    o.backend = value;
  } else if (arg == "--cudnn") {
    o.cudnn = static_cast<int>(need_int(0));
  } else if (arg == "--calibration-out") {
    o.calibration_out = value;
  } else if (arg == "--engine") {
    o.engine = value;
  } else if (arg == "--fused") {
    o.fused = static_cast<int>(need_int(0));
  } else if (arg == "--kv-heads") {
    o.kv_heads = static_cast<int>(need_int(1));
  } else if (arg == "--head-dim") {
    o.head_dim = static_cast<int>(need_int(1));
  } else if (arg == "--dtype") {
    o.dtype = value;
  } else if (arg == "--weights") {
    std::stringstream ss(value);
    std::string item;
    o.weights.clear();
    while (std::getline(ss, item, ',')) {
      char* e = nullptr;
      const double w = std::strtod(item.c_str(), &e);
      if (e == item.c_str() || *e != '\0' || !(w > 0) || !std::isfinite(w)) {
        Usage("--weights needs positive numbers separated by commas, e.g. 3,1,1,3");
      }
      o.weights.push_back(w);
    }
  } else {
    return false;
  }
  return true;
}

// The checks across options, and the defaults that follow from others.
void CheckOptions(Options& o, bool end_set) {
  if (!end_set) o.tokens_end = o.tokens_begin;
  if (o.tokens_end < o.tokens_begin) Usage("-e is below -b");
  if (o.dtype != "fp32" && o.dtype != "bf16" && o.dtype != "fp16") {
    Usage("--dtype must be fp32, bf16 or fp16");
  }
  if (o.docs_dist != "longtail" && o.docs_dist != "uniform" && o.docs_dist != "single" &&
      o.docs_dist != "tiny") {
    Usage("--docs-dist must be longtail, uniform, single or tiny");
  }
  if (o.mask != "causal" && o.mask != "mixed") Usage("--mask must be causal or mixed");
  if (!o.groups.empty()) {
    int sum = 0;
    for (int g : o.groups) sum += g;
    if (o.ranks_set && sum != o.ranks) Usage("--groups must add up to --ranks");
    o.ranks = sum;
    if (!o.group_heads.empty()) {
      if (o.group_heads.size() != o.groups.size()) Usage("--heads needs one list per group");
      for (size_t g = 0; g < o.groups.size(); ++g) {
        if (static_cast<int>(o.group_heads[g].size()) != o.groups[g]) {
          Usage("--heads needs one count per rank of each group");
        }
        int h = 0;
        for (int c : o.group_heads[g]) h += c;
        if (g == 0) o.heads = h;
        if (h != o.heads) Usage("every group's --heads counts must add up to the same total");
      }
    }
    if (!o.seq_weights.empty() && o.seq_weights.size() != o.groups.size()) {
      Usage("--seq-weights needs one value per group");
    }
    if (!o.token_weights.empty() && static_cast<int>(o.token_weights.size()) != o.ranks) {
      Usage("--token-weights needs one value per rank");
    }
  } else if (!o.group_heads.empty()) {
    Usage("--heads with per-rank counts needs --groups");
  }
  if (!o.plan_file.empty() && !o.groups.empty()) Usage("give --plan or --groups, not both");
  if (o.backend != "host" && o.backend != "cuda-loopback") {
    Usage("--backend must be host or cuda-loopback");
  }
  if (o.cudnn < 0) o.cudnn = o.backend == "cuda-loopback" ? 1 : 0;
  if (o.cudnn != 0 && o.backend != "cuda-loopback")
    Usage("--cudnn 1 needs --backend cuda-loopback");
  if (o.fused != -1 && o.fused != 0 && o.fused != 1) Usage("--fused must be 0 or 1");
  if (!o.engine.empty()) {
    if (!hsap::cuda::ParseEngineMode(o.engine, "--engine").ok()) {
      Usage("--engine must be auto, cudnn or jit");
    }
    if (o.backend != "cuda-loopback") Usage("--engine needs --backend cuda-loopback");
  }
  if (!o.calibration_out.empty() &&
      (o.backend != "cuda-loopback" || o.ranks != 1 || o.plan_mode())) {
    Usage(
        "--calibration-out needs --backend cuda-loopback, --ranks 1 and no plan (it records "
        "one GPU's kernels)");
  }
  if (o.plan_mode() && !o.weights.empty()) {
    Usage("--weights is for plain batches; use --seq-weights/--token-weights with --groups");
  }
  if (!o.weights.empty() && static_cast<int>(o.weights.size()) != o.ranks) {
    Usage("--weights needs one value per rank (--ranks)");
  }
  if (o.nodes > 0) {
    if (o.ranks % o.nodes != 0) Usage("--nodes must divide --ranks");
    if (o.plan_mode() || o.backend != "host") {
      Usage("--nodes is for ring batches on the host backend (no --groups/--plan)");
    }
  }
}

}  // namespace

Options ParseOptions(int argc, char** argv) {
  Options o;
  bool end_set = false;
  ArgReader reader(argc, argv, Usage);
  Arg a;
  while (reader.Next(a)) {
    if (!ApplyRunOption(a, o, end_set) && !ApplyShapeOption(a, o)) {
      Usage(("unknown option " + a.name).c_str());
    }
  }
  CheckOptions(o, end_set);
  return o;
}

std::vector<double> ParseList(const std::string& value, const char* what, bool allow_zero) {
  std::stringstream ss(value);
  std::string item;
  std::vector<double> out;
  while (std::getline(ss, item, ',')) {
    char* e = nullptr;
    const double w = std::strtod(item.c_str(), &e);
    if (e == item.c_str() || *e != '\0' || !std::isfinite(w) || w < 0 || (!allow_zero && w == 0)) {
      Usage((std::string(what) + " needs " + (allow_zero ? "non-negative" : "positive") +
             " numbers separated by commas")
                .c_str());
    }
    out.push_back(w);
  }
  if (out.empty()) Usage((std::string(what) + " needs at least one number").c_str());
  return out;
}

std::vector<int64_t> DocumentLengths(const Options& o, int64_t tokens) {
  std::mt19937_64 rng(o.seed * 1000003u + static_cast<uint64_t>(tokens));
  std::vector<int64_t> lengths;
  if (o.docs_dist == "single") return {tokens};
  if (o.docs_dist == "tiny") {
    std::uniform_int_distribution<int64_t> len(1, 16);
    for (int64_t left = tokens; left > 0;) {
      const int64_t l = std::min(left, len(rng));
      lengths.push_back(l);
      left -= l;
    }
    return lengths;
  }
  const int64_t docs = std::max<int64_t>(1, std::min(tokens, tokens / o.tokens_per_doc));
  std::vector<double> w(docs);
  double sum = 0;
  if (o.docs_dist == "longtail") {
    std::lognormal_distribution<double> dist(0.0, 1.5);
    for (double& x : w) sum += (x = dist(rng));
  } else {
    std::uniform_real_distribution<double> dist(0.5, 1.5);
    for (double& x : w) sum += (x = dist(rng));
  }
  int64_t assigned = 0;
  for (double x : w) {
    lengths.push_back(
        1 + static_cast<int64_t>(std::floor(x / sum * static_cast<double>(tokens - docs))));
    assigned += lengths.back();
  }
  *std::max_element(lengths.begin(), lengths.end()) += tokens - assigned;
  return lengths;
}

hsapPlan_t MakePlan(Options& o) {
  hsapPlan_t plan = nullptr;
  if (!o.plan_file.empty()) {
    std::FILE* f = std::fopen(o.plan_file.c_str(), "rb");
    if (f == nullptr) {
      std::fprintf(stderr, "cannot read --plan %s\n", o.plan_file.c_str());
      std::exit(2);
    }
    std::string text;
    char buf[4096];
    for (size_t n; (n = std::fread(buf, 1, sizeof(buf), f)) > 0;) text.append(buf, n);
    std::fclose(f);
    Must(hsapPlanCreateFromJson(&plan, text.c_str()), "hsapPlanCreateFromJson");
    int groups = 0;
    Must(hsapPlanGetShape(plan, &o.ranks, &o.heads, &o.kv_heads, &groups), "hsapPlanGetShape");
    return plan;
  }
  std::vector<int> ranks, counts, heads;
  for (size_t g = 0, rank = 0; g < o.groups.size(); ++g) {
    std::vector<int> c = o.group_heads.empty() ? std::vector<int>() : o.group_heads[g];
    if (c.empty()) {  // even split, the first ranks one more
      for (int i = 0; i < o.groups[g]; ++i) {
        c.push_back(o.heads / o.groups[g] + (i < o.heads % o.groups[g] ? 1 : 0));
      }
    }
    int next = 0;
    for (int i = 0; i < o.groups[g]; ++i, ++rank) {
      ranks.push_back(static_cast<int>(rank));
      counts.push_back(c[i]);
      for (int h = 0; h < c[i]; ++h) heads.push_back(next++);
    }
  }
  Must(hsapPlanCreate(&plan, o.ranks, o.heads, o.kv_heads, static_cast<int>(o.groups.size()),
                      o.groups.data(), ranks.data(),
                      o.seq_weights.empty() ? nullptr : o.seq_weights.data(),
                      o.token_weights.empty() ? nullptr : o.token_weights.data(), counts.data(),
                      heads.data(), nullptr),
       "hsapPlanCreate");
  return plan;
}

}  // namespace hsap::bench::attn_perf
