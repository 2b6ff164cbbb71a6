// hsap_attn_perf: distributed attention over one packed row on N host ranks (threads of
// this process), in the style of nccl-tests. For each row length it partitions the row,
// runs hsapAttentionForward and hsapAttentionBackward on every rank, and reports time,
// achieved FLOP/s over visible pairs, the K/V bytes each rank moved against the bytes a
// naive ring would move, and (with -c 1) the elements outside the tolerance rule against
// the single-device fp64 reference.
//
//   hsap_attn_perf -b 4096 -e 65536 -f 2 --ranks 4 --docs-dist longtail --heads 8
//       --kv-heads 2 --head-dim 64 --dtype bf16 --weights 3,1,1,3 -n 5 -w 1 -c 1
//
// With a rank arrangement (--groups, or --plan FILE.json from hsap_plan) the batch runs
// under a plan (hsapBatchCreateWithPlan: all-to-all inside head-parallel groups,
// sequence-aware sub-rings across them), and the table also reports the all-to-all and the
// sub-ring bytes separately, next to what TransformerEngine's a2a+p2p would move:
//
//   hsap_attn_perf -b 8192 --groups 4,2 --heads 20,12:16,16 --kv-heads 4 --seq-weights 2,1
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "attention/dtype.h"
#include "attention/kernel.h"
#include "attention/layout.h"
#include "attention/reference.h"
#include "attention/tolerance.h"
#include "bench/bench_util.h"
#include "bench/cudnn_attention.h"
#include "hsap/hsap.h"
#include "lib/api/batch.h"
#include "lib/api/checks.h"
#include "lib/api/handles.h"
#include "lib/cuda/exec/gpu_batch.h"
#include "lib/cuda/runtime/cuda_loader.h"
#include "lib/sched/hierarchy.h"
#include "lib/sched/partition.h"
#include "lib/sched/plan_json.h"
#include "lib/sched/schedule.h"

namespace {

using ::hsap::bench::Clock;
using ::hsap::bench::Must;
using ::hsap::bench::ParseDType;
using ::hsap::bench::Seconds;
using ::hsap::bench::ToC;

struct Options {
  int64_t tokens_begin = 4096;
  int64_t tokens_end = 4096;
  double factor = 2.0;
  int ranks = 4;
  std::string docs_dist = "longtail";  // longtail | uniform | single | tiny
  int64_t tokens_per_doc = 1024;       // mean document length (longtail, uniform)
  std::string mask = "causal";         // causal | mixed
  int heads = 8;
  int kv_heads = 2;
  int head_dim = 64;
  std::string dtype = "bf16";
  std::vector<double> weights;  // empty: equal
  int threads = 0;              // compute threads per rank; 0: hardware threads / ranks
  int nodes = 0;                // >0: ranks in that many equal nodes (consecutive ranks)
  int iters = 5;
  int warmup = 1;
  int check = 1;
  double ref_max_gflop = 4.0;
  int timeout_ms = 600000;
  uint32_t seed = 1;
  // Rank arrangement (a plan): group sizes, per-rank query head counts per group (heads
  // assigned contiguously in rank order), sequence weights per group, token weights per
  // rank; or a plan file.
  std::vector<int> groups;
  std::vector<std::vector<int>> group_heads;
  std::vector<double> seq_weights, token_weights;
  std::string plan_file;
  std::string backend = "host";  // host | cuda-loopback
  int cudnn = -1;                // cuDNN comparison; -1: on with cuda-loopback
  int fused = 1;                 // cuda-loopback: forward through peer windows
  bool ranks_set = false;
  bool plan_mode() const { return !groups.empty() || !plan_file.empty(); }
};

// "a,b,c" -> numbers (all > 0 unless allow_zero).
std::vector<double> ParseList(const std::string& value, const char* what, bool allow_zero);

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
      "  -c, --check 0|1        check against the fp64 reference (default 1), on rows up to\n"
      "                         --ref-max-gflop of forward work\n"
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
      "      --ref-max-gflop X  check only rows up to X GFLOP of forward work (default 4)\n"
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
      "                         peers' K/V inside the fused kernel (1, default) or moves\n"
      "                         it with loopback transfer stages (0); sets\n"
      "                         $HSAP_FUSED_FORWARD\n");
  std::exit(error == nullptr ? 0 : 2);
}

Options ParseOptions(int argc, char** argv) {
  Options o;
  bool end_set = false;
  hsap::bench::ArgReader reader(argc, argv, Usage);
  hsap::bench::Arg a;
  while (reader.Next(a)) {
    const std::string& arg = a.name;
    const std::string& value = a.value;
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
    } else if (arg == "--ranks") {
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
    } else if (arg == "--nodes") {
      o.nodes = static_cast<int>(need_int(1));
    } else if (arg == "-T" || arg == "--threads") {
      o.threads = static_cast<int>(need_int(0));
    } else if (arg == "--ref-max-gflop") {
      if (!numeric || num < 0) Usage("--ref-max-gflop needs a number >= 0");
      o.ref_max_gflop = num;
    } else if (arg == "--timeout-ms") {
      o.timeout_ms = static_cast<int>(need_int(1));
    } else if (arg == "--seed") {
      o.seed = static_cast<uint32_t>(need_int(0));
    } else {
      Usage(("unknown option " + arg).c_str());
    }
  }
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
  if (o.fused != 0 && o.fused != 1) Usage("--fused must be 0 or 1");
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

// Document lengths summing to `tokens` with the chosen distribution and a fixed seed.
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

struct Bytes {
  std::vector<uint8_t> data;
  Bytes() = default;
  explicit Bytes(size_t n) : data(n + 1, 0) {}
  void* ptr() { return data.data(); }
};

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

// Elements of `got` outside the tolerance rule of the tests (attention/tolerance.h) for
// results stored in `dtype`.
int64_t CountWrong(hsap::DType dtype, const uint8_t* got, const std::vector<double>& ref,
                   const std::vector<double>& naive) {
  double naive_err = 0.0, magnitude = 1.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    naive_err = std::max(naive_err, std::abs(naive[i] - ref[i]));
    magnitude = std::max(magnitude, std::abs(ref[i]));
  }
  const double tol = hsap::ToleranceBound(naive_err, magnitude, hsap::StorageFloor(dtype));
  int64_t wrong = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double e = std::abs(hsap::LoadAsFloat(dtype, got, i) - ref[i]);
    if (!(e <= tol)) ++wrong;
  }
  return wrong;
}

// max |got - ref| over the elements of `got` (stored in `dtype`); NaN when one is NaN.
double MaxAbsError(hsap::DType dtype, const uint8_t* got, const std::vector<double>& ref) {
  double max_err = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double e = std::abs(hsap::LoadAsFloat(dtype, got, i) - ref[i]);
    if (std::isnan(e)) return e;
    max_err = std::max(max_err, e);
  }
  return max_err;
}

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

// The plan of --groups/--heads/--seq-weights/--token-weights, or of --plan.
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

// What TransformerEngine's a2a+p2p would receive per rank in one forward for this row:
// the symmetric arrangement with as many groups as the plan (A ranks per group, P = R/A
// groups; A = R/G, or the largest divisor of R below it), every document padded to a
// multiple of 2 * R, equal shards, KV heads replicated up to A when fewer. All-to-all: Q,
// K, V of the other A-1 ranks' shards for this rank's heads, and out back; p2p: the other
// P-1 groups' full K/V blocks for this rank's KV heads.
struct TeBytes {
  double a2a = 0, p2p = 0;
  int a = 1, p = 1;
};
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

}  // namespace

int main(int argc, char** argv) {
  Options o = ParseOptions(argc, argv);
  // Before any hsap call: hsap reads its environment once per process (base/params.h).
  if (o.backend == "cuda-loopback") {
    setenv("HSAP_FUSED_FORWARD", o.fused != 0 ? "1" : "0", /*overwrite=*/1);
  }
  hsapPlan_t plan = o.plan_mode() ? MakePlan(o) : nullptr;
  int plan_groups = 0;
  if (plan != nullptr)
    Must(hsapPlanGetShape(plan, nullptr, nullptr, nullptr, &plan_groups), "hsapPlanGetShape");
  const hsap::DType dtype = ParseDType(o.dtype);
  const size_t esize = hsap::DTypeSize(dtype);
  const int R = o.ranks;
  int version = 0;
  Must(hsapGetVersion(&version), "hsapGetVersion");

  std::vector<hsapComm_t> comms(R, nullptr);
  hsapCommConfig_t cc = HSAP_COMM_CONFIG_INITIALIZER;
  cc.timeoutMs = o.timeout_ms;
  cc.numThreads = o.threads;
  std::vector<int> rank_nodes;  // --nodes: consecutive ranks share a node
  for (int r = 0; o.nodes > 0 && r < R; ++r) rank_nodes.push_back(r / (R / o.nodes));
  cc.rankNodes = rank_nodes.empty() ? nullptr : rank_nodes.data();
  const bool on_gpu = o.backend == "cuda-loopback";
  if (on_gpu) {
    Must(hsapCommInitLoopback(comms.data(), R, &cc), "hsapCommInitLoopback");
  } else {
    Must(hsapCommInitAll(comms.data(), R, &cc), "hsapCommInitAll");
  }
  const hsap::cuda::CudaRuntimeApi* cuda_rt =
      on_gpu ? *hsap::cuda::LoadCudaRuntime() : nullptr;  // loaded: the communicators exist
  const int threads_per_rank =
      o.threads > 0 ? o.threads
                    : std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / R);

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
  // Forward through peer windows: every loopback batch without a plan.
  const bool fused_forward = on_gpu && o.fused != 0 && plan == nullptr;
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
  // cuDNN's fused attention on the whole row, after each row (cuda-loopback only).
  bool use_cudnn = on_gpu && o.cudnn != 0;
  if (use_cudnn && o.mask != "causal") {
    std::printf("# cuDNN: unavailable (--mask %s: the comparison builds causal documents only)\n",
                o.mask.c_str());
    use_cudnn = false;
  }
  if (use_cudnn && dtype == hsap::DType::kF32) {
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
      "when not checked (-c 0, or above %.3g GFLOP of forward work)\n",
      o.nodes > 0
          ? "# intra, inter: forward K/V bytes received per rank (mean) from ranks of the same / "
            "another node (hsapBatchGetLinkTraffic); direct: the inter-node bytes per rank (mean) "
            "of direct delivery (each row sent from its owner to every rank that needs it, what "
            "the runtime does without rankNodes), from the direct schedules\n"
          : "",
      o.ref_max_gflop);
  std::printf("#\n# %9s %6s %6s %10s %10s %9s %9s %10s %10s %10s %7s", "tokens", "docs", "split",
              "fwd(ms)", "bwd(ms)", "fwdTF/s", "bwdTF/s", "bytes max", "bytes mean", "ring",
              "ratio");
  if (plan != nullptr) {
    std::printf(" %10s %10s %10s %10s", "a2a", "p2p", "TE a2a", "TE p2p");
  }
  if (o.nodes > 0) std::printf(" %10s %10s %10s", "intra", "inter", "direct");
  if (on_gpu) std::printf(" %8s %8s", "fwdHid%", "bwdHid%");
  std::printf(" %7s\n", "#wrong");

  int64_t total_wrong = 0;
  size_t max_pool = 0;  // device pool of a rank (CUDA backend)
  double sum_fwd_tflops = 0, sum_bwd_tflops = 0, sum_ratio = 0;
  double sum_cudnn_tflops = 0, sum_ours_vs_cudnn = 0;
  double sum_cudnn_bwd_tflops = 0, sum_ours_vs_cudnn_bwd = 0;
  int rows = 0, cudnn_rows = 0, cudnn_bwd_rows = 0;
  bool use_cudnn_bwd = true;  // off after the backward graph fails once
  const double* weights = o.weights.empty() ? nullptr : o.weights.data();
  for (double t = static_cast<double>(o.tokens_begin);
       t <= static_cast<double>(o.tokens_end) * 1.0000001; t *= o.factor) {
    const int64_t T = static_cast<int64_t>(std::llround(t));
    const std::vector<int64_t> lengths = DocumentLengths(o, T);
    std::vector<int64_t> cu{0};
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
    hsapLayout_t layout = nullptr;
    Must(hsapLayoutCreate(&layout, cu.data(), static_cast<int64_t>(kinds.size()), kinds.data(),
                          params.data()),
         "hsapLayoutCreate");
    int64_t pairs = 0;
    Must(hsapLayoutGetVisiblePairs(layout, &pairs), "hsapLayoutGetVisiblePairs");

    // Full-row inputs, scattered to the ranks as a data loader would.
    const size_t q_row = static_cast<size_t>(o.heads) * o.head_dim * esize;
    const size_t kv_row = static_cast<size_t>(o.kv_heads) * o.head_dim * esize;
    Bytes q(T * q_row), k(T * kv_row), v(T * kv_row), dout(T * q_row);
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
    hsapPartition_t part = nullptr;
    if (plan != nullptr) {
      // The plan's shards, as every rank's batch computes them (hierarchy.h).
      absl::StatusOr<hsap::Hierarchy> h = hsap::Hierarchy::Create(layout->layout, plan->plan);
      absl::StatusOr<hsap::Partition> p =
          h.ok() ? hsap::Partition::FromRanges(layout->layout, h->shards())
                 : absl::StatusOr<hsap::Partition>(h.status());
      if (!p.ok()) {
        std::fprintf(stderr, "plan: %s\n", std::string(p.status().message()).c_str());
        return 1;
      }
      part = new hsapPartition_st{std::make_shared<const hsap::Partition>(*std::move(p)), false};
    } else {
      Must(hsapPartitionCreate(&part, layout, R, weights), "hsapPartitionCreate");
    }
    std::vector<int64_t> local(R);
    for (int r = 0; r < R; ++r) {
      int64_t nr = 0;
      Must(hsapPartitionGetRanges(part, r, nullptr, &nr, &local[r]), "hsapPartitionGetRanges");
    }
    struct Shards {
      std::vector<Bytes> b;
      std::vector<void*> p;
    };
    auto make = [&](size_t row) {
      Shards s;
      for (int r = 0; r < R; ++r) s.b.emplace_back(local[r] * row);
      for (int r = 0; r < R; ++r) s.p.push_back(s.b[r].ptr());
      return s;
    };
    Shards sq = make(q_row), sk = make(kv_row), sv = make(kv_row), sdout = make(q_row);
    Shards sout = make(q_row), sdq = make(q_row), sdk = make(kv_row), sdv = make(kv_row);
    Must(hsapPartitionScatter(part, q.ptr(), q_row, sq.p.data()), "hsapPartitionScatter");
    Must(hsapPartitionScatter(part, k.ptr(), kv_row, sk.p.data()), "hsapPartitionScatter");
    Must(hsapPartitionScatter(part, v.ptr(), kv_row, sv.p.data()), "hsapPartitionScatter");
    Must(hsapPartitionScatter(part, dout.ptr(), q_row, sdout.p.data()), "hsapPartitionScatter");
    std::vector<std::vector<float>> lse(R);

    std::vector<double> fwd_s(R), bwd_s(R);
    std::vector<hsapTraffic_t> traffic(R);
    std::vector<hsapTrafficDetail_t> detail(R);
    std::vector<hsapLinkTraffic_t> links(R);
    std::vector<hsapResult_t> result(R, hsapSuccess);
    std::vector<std::string> error(R);
    std::vector<size_t> pool_bytes(R, 0);
    // CUDA backend: [0] compute only, [1] transfers only (seconds per call, per rank).
    std::vector<double> part_fwd_s[2] = {std::vector<double>(R), std::vector<double>(R)};
    std::vector<double> part_bwd_s[2] = {std::vector<double>(R), std::vector<double>(R)};
    std::vector<std::thread> workers;
    for (int r = 0; r < R; ++r) {
      workers.emplace_back([&, r] {
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
        const int64_t n = local[r];
        lse[r].assign(static_cast<size_t>(n) * o.heads + 1, 0.0f);
        DeviceCopies gpu(cuda_rt);
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
        fwd_s[r] = Seconds(t0, Clock::now()) / o.iters;
        for (int i = 0; i < o.warmup && !e; ++i) e = backward();
        t0 = Clock::now();
        for (int i = 0; i < o.iters && !e; ++i) e = backward();
        bwd_s[r] = Seconds(t0, Clock::now()) / o.iters;
        if (e) fail(e);
        hsapCommGetPoolBytes(comms[r], &pool_bytes[r]);
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
            part_fwd_s[m][r] = Seconds(t1, Clock::now()) / o.iters;
            for (int i = 0; i < o.warmup && !e; ++i) e = backward();
            t1 = Clock::now();
            for (int i = 0; i < o.iters && !e; ++i) e = backward();
            part_bwd_s[m][r] = Seconds(t1, Clock::now()) / o.iters;
          }
          if (e) fail(e);
        }
        hsapBatchGetTraffic(batch, &traffic[r]);
        hsapBatchGetTrafficDetail(batch, &detail[r]);
        if (o.nodes > 0) hsapBatchGetLinkTraffic(batch, &links[r]);
        hsapBatchDestroy(batch);
      });
    }
    for (std::thread& w : workers) w.join();
    for (int r = 0; r < R; ++r) {
      if (result[r] != hsapSuccess) {
        std::fprintf(stderr, "rank %d failed: %s: %s\n", r, hsapGetErrorString(result[r]),
                     error[r].c_str());
        return 1;
      }
    }

    const double fwd_flop = 4.0 * o.head_dim * static_cast<double>(pairs) * o.heads;
    const bool check_row = o.check != 0 && fwd_flop * 1e-9 <= o.ref_max_gflop;

    // cuDNN on the whole row (same inputs, one GPU), after our row.
    Bytes cudnn_out;
    hsap::bench::CudnnForwardRun cudnn_run;
    bool cudnn_ran = false;
    Bytes cudnn_dq, cudnn_dk, cudnn_dv;
    hsap::bench::CudnnBackwardRun cudnn_bwd_run;
    bool cudnn_bwd_ran = false;
    if (use_cudnn) {
      hsap::bench::CudnnAttentionShape shape;
      shape.doc_lengths = lengths;
      shape.heads_q = o.heads;
      shape.heads_kv = o.kv_heads;
      shape.head_dim = o.head_dim;
      shape.dtype = dtype;
      shape.causal = true;
      cudnn_out = Bytes(T * q_row);
      absl::StatusOr<hsap::bench::CudnnForwardRun> run = hsap::bench::RunCudnnForward(
          shape, q.ptr(), k.ptr(), v.ptr(), o.warmup, o.iters, cudnn_out.ptr());
      if (run.ok()) {
        cudnn_run = *run;
        cudnn_ran = true;
      } else {
        std::printf("# cuDNN: unavailable (%s)\n", std::string(run.status().message()).c_str());
        use_cudnn = false;  // said once; the rows go on without it
      }
    }
    if (use_cudnn && use_cudnn_bwd) {
      hsap::bench::CudnnAttentionShape shape;
      shape.doc_lengths = lengths;
      shape.heads_q = o.heads;
      shape.heads_kv = o.kv_heads;
      shape.head_dim = o.head_dim;
      shape.dtype = dtype;
      shape.causal = true;
      // The gradients come back only when the row is checked.
      if (check_row) {
        cudnn_dq = Bytes(T * q_row);
        cudnn_dk = Bytes(T * kv_row);
        cudnn_dv = Bytes(T * kv_row);
      }
      absl::StatusOr<hsap::bench::CudnnBackwardRun> run = hsap::bench::RunCudnnBackward(
          shape, q.ptr(), k.ptr(), v.ptr(), dout.ptr(), o.warmup, o.iters,
          check_row ? cudnn_dq.ptr() : nullptr, check_row ? cudnn_dk.ptr() : nullptr,
          check_row ? cudnn_dv.ptr() : nullptr);
      if (run.ok()) {
        cudnn_bwd_run = *run;
        cudnn_bwd_ran = true;
      } else {
        std::printf("# cuDNN backward: unavailable (%s)\n",
                    std::string(run.status().message()).c_str());
        use_cudnn_bwd = false;
      }
    }

    max_pool = std::max(max_pool, *std::max_element(pool_bytes.begin(), pool_bytes.end()));
    const double fwd = *std::max_element(fwd_s.begin(), fwd_s.end());
    const double bwd = *std::max_element(bwd_s.begin(), bwd_s.end());
    const double fwd_tflops = fwd_flop / fwd * 1e-12, bwd_tflops = 2.5 * fwd_flop / bwd * 1e-12;
    double bytes_max = 0, bytes_sum = 0;
    for (const hsapTraffic_t& tr : traffic) {
      bytes_max = std::max(bytes_max, static_cast<double>(tr.forwardBytesReceived));
      bytes_sum += static_cast<double>(tr.forwardBytesReceived);
    }
    const double bytes_mean = bytes_sum / R;
    const double ring = static_cast<double>(T) * (R - 1) / R * 2.0 * static_cast<double>(kv_row);
    const double ratio = ring > 0 ? bytes_mean / ring : 0.0;

    // Documents cut across ranks: a document whose tokens are not all on one rank.
    int64_t split = 0;
    {
      std::vector<int> owner(T, -1);
      for (int r = 0; r < R; ++r) {
        int64_t nr = 0;
        Must(hsapPartitionGetRanges(part, r, nullptr, &nr, nullptr), "hsapPartitionGetRanges");
        std::vector<int64_t> ranges(2 * nr);
        Must(hsapPartitionGetRanges(part, r, ranges.data(), &nr, nullptr),
             "hsapPartitionGetRanges");
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
    }

    char wrong_col[32] = "-";
    char cudnn_wrong[32] = "-", cudnn_err[32] = "-";
    char cudnn_bwd_wrong[32] = "-", cudnn_bwd_err[32] = "-";
    if (check_row) {
      Bytes out(T * q_row), dq(T * q_row), dk(T * kv_row), dv(T * kv_row);
      std::vector<const void*> ptrs(R);
      auto gather = [&](Shards& s, size_t row, Bytes& into) {
        for (int r = 0; r < R; ++r) ptrs[r] = s.p[r];
        Must(hsapPartitionGather(part, ptrs.data(), row, into.ptr()), "hsapPartitionGather");
      };
      gather(sout, q_row, out);
      gather(sdq, q_row, dq);
      gather(sdk, kv_row, dk);
      gather(sdv, kv_row, dv);
      hsap::ReferenceInputs in;
      in.dims.heads_q = o.heads;
      in.dims.heads_kv = o.kv_heads;
      in.dims.head_dim = o.head_dim;
      in.dims.scale = 1.0f / std::sqrt(static_cast<float>(o.head_dim));
      in.dtype = dtype;
      in.q = q.ptr();
      in.k = k.ptr();
      in.v = v.ptr();
      const hsap::Layout& l = layout->layout;
      const hsap::ReferenceForwardResult ref = hsap::ReferenceForward(l, in);
      const hsap::ReferenceForwardResult naive = hsap::NaiveForward(l, in);
      const hsap::ReferenceGradients gref = hsap::ReferenceBackward(l, in, dout.ptr());
      const hsap::ReferenceGradients gnaive = hsap::NaiveBackward(l, in, dout.ptr());
      const int64_t wrong = CountWrong(dtype, out.data.data(), ref.out, naive.out) +
                            CountWrong(dtype, dq.data.data(), gref.dq, gnaive.dq) +
                            CountWrong(dtype, dk.data.data(), gref.dk, gnaive.dk) +
                            CountWrong(dtype, dv.data.data(), gref.dv, gnaive.dv);
      total_wrong += wrong;
      std::snprintf(wrong_col, sizeof(wrong_col), "%lld", (long long)wrong);
      if (cudnn_ran) {
        // cuDNN's out under the same rule (not added to the table's #wrong).
        const int64_t cw = CountWrong(dtype, cudnn_out.data.data(), ref.out, naive.out);
        std::snprintf(cudnn_wrong, sizeof(cudnn_wrong), "%lld", (long long)cw);
        std::snprintf(cudnn_err, sizeof(cudnn_err), "%.3g",
                      MaxAbsError(dtype, cudnn_out.data.data(), ref.out));
      }
      if (cudnn_bwd_ran) {
        // cuDNN's dq, dk, dv under the same rule (not added to the table's #wrong).
        const int64_t cw = CountWrong(dtype, cudnn_dq.data.data(), gref.dq, gnaive.dq) +
                           CountWrong(dtype, cudnn_dk.data.data(), gref.dk, gnaive.dk) +
                           CountWrong(dtype, cudnn_dv.data.data(), gref.dv, gnaive.dv);
        std::snprintf(cudnn_bwd_wrong, sizeof(cudnn_bwd_wrong), "%lld", (long long)cw);
        double max_err = 0;  // NaN stays NaN
        for (double e : {MaxAbsError(dtype, cudnn_dq.data.data(), gref.dq),
                         MaxAbsError(dtype, cudnn_dk.data.data(), gref.dk),
                         MaxAbsError(dtype, cudnn_dv.data.data(), gref.dv)}) {
          max_err = std::isnan(e) ? e : std::max(max_err, e);
        }
        std::snprintf(cudnn_bwd_err, sizeof(cudnn_bwd_err), "%.3g", max_err);
      }
    }
    std::printf("  %9lld %6zu %6lld %10.3f %10.3f %9.4f %9.4f %10s %10s %10s %7.4f", (long long)T,
                lengths.size(), (long long)split, fwd * 1e3, bwd * 1e3, fwd_tflops, bwd_tflops,
                HumanBytes(bytes_max).c_str(), HumanBytes(bytes_mean).c_str(),
                HumanBytes(ring).c_str(), ratio);
    if (plan != nullptr) {
      double a2a = 0, p2p = 0;
      for (const hsapTrafficDetail_t& d : detail) {
        a2a += static_cast<double>(d.forwardAllToAllBytesReceived) / R;
        p2p += static_cast<double>(d.forwardRingBytesReceived) / R;
      }
      const TeBytes te =
          TransformerEngineBytes(lengths, R, plan_groups, o.heads, o.kv_heads, o.head_dim, esize);
      std::printf(" %10s %10s %10s %10s", HumanBytes(a2a).c_str(), HumanBytes(p2p).c_str(),
                  HumanBytes(te.a2a).c_str(), HumanBytes(te.p2p).c_str());
    }
    if (o.nodes > 0) {
      double intra = 0, inter = 0, direct = 0;
      for (const hsapLinkTraffic_t& l : links) {
        intra += static_cast<double>(l.forwardIntraNodeBytesReceived) / R;
        inter += static_cast<double>(l.forwardInterNodeBytesReceived) / R;
      }
      for (int r = 0; r < R; ++r) {
        absl::StatusOr<hsap::Schedule> sched =
            hsap::BuildSchedule(layout->layout, *part->partition, r, hsap::kKernelBlockQ);
        if (!sched.ok()) {
          std::fprintf(stderr, "direct schedule: %s\n",
                       std::string(sched.status().message()).c_str());
          return 1;
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
    if (cudnn_ran) {
      const double cudnn_s = cudnn_run.forward_ms * 1e-3;
      const double cudnn_tflops = cudnn_s > 0 ? fwd_flop / cudnn_s * 1e-12 : 0.0;
      const double ours_vs = cudnn_tflops > 0 ? fwd_tflops / cudnn_tflops : 0.0;
      if (cudnn_rows == 0) {
        std::printf("# cuDNN %d.%d.%d, workspace %s\n", cudnn_run.version / 10000,
                    cudnn_run.version / 100 % 100, cudnn_run.version % 100,
                    HumanBytes(static_cast<double>(cudnn_run.workspace_bytes)).c_str());
      }
      std::printf(
          "# cuDNN %9lld fwd(ms) %10.3f fwdTF/s %9.4f ours/cuDNN %7.3f #wrong %s max|err| %s\n",
          (long long)T, cudnn_run.forward_ms, cudnn_tflops, ours_vs, cudnn_wrong, cudnn_err);
      sum_cudnn_tflops += cudnn_tflops;
      sum_ours_vs_cudnn += ours_vs;
      ++cudnn_rows;
    }
    if (cudnn_bwd_ran) {
      const double cudnn_s = cudnn_bwd_run.backward_ms * 1e-3;
      const double cudnn_tflops = cudnn_s > 0 ? 2.5 * fwd_flop / cudnn_s * 1e-12 : 0.0;
      const double ours_vs = cudnn_tflops > 0 ? bwd_tflops / cudnn_tflops : 0.0;
      if (cudnn_bwd_rows == 0) {
        std::printf("# cuDNN backward: workspace %s, scratch %s\n",
                    HumanBytes(static_cast<double>(cudnn_bwd_run.workspace_bytes)).c_str(),
                    HumanBytes(static_cast<double>(cudnn_bwd_run.scratch_bytes)).c_str());
      }
      std::printf(
          "# cuDNN %9lld bwd(ms) %10.3f bwdTF/s %9.4f ours/cuDNN %7.3f #wrong %s max|err| %s\n",
          (long long)T, cudnn_bwd_run.backward_ms, cudnn_tflops, ours_vs, cudnn_bwd_wrong,
          cudnn_bwd_err);
      sum_cudnn_bwd_tflops += cudnn_tflops;
      sum_ours_vs_cudnn_bwd += ours_vs;
      ++cudnn_bwd_rows;
    }
    std::fflush(stdout);
    sum_fwd_tflops += fwd_tflops;
    sum_bwd_tflops += bwd_tflops;
    sum_ratio += ratio;
    ++rows;
    Must(hsapPartitionDestroy(part), "hsapPartitionDestroy");
    Must(hsapLayoutDestroy(layout), "hsapLayoutDestroy");
  }
  for (hsapComm_t c : comms) Must(hsapCommDestroy(c), "hsapCommDestroy");
  if (plan != nullptr) Must(hsapPlanDestroy(plan), "hsapPlanDestroy");
  std::printf("# Out of bounds values : %lld %s\n", (long long)total_wrong,
              total_wrong == 0 ? "OK" : "FAILED");
  std::printf("# Avg fwd TFLOP/s : %.4f\n# Avg bwd TFLOP/s : %.4f\n",
              rows ? sum_fwd_tflops / rows : 0.0, rows ? sum_bwd_tflops / rows : 0.0);
  std::printf("# Avg bytes moved vs naive ring : %.4f (%.1f%% saved)\n",
              rows ? sum_ratio / rows : 0.0, rows ? 100.0 * (1.0 - sum_ratio / rows) : 0.0);
  if (on_gpu) std::printf("# Device pool per rank (max) : %s\n", HumanBytes(max_pool).c_str());
  if (cudnn_rows > 0) {
    std::printf("# Avg cuDNN fwd TFLOP/s : %.4f (ours/cuDNN %.3f over %d rows)\n",
                sum_cudnn_tflops / cudnn_rows, sum_ours_vs_cudnn / cudnn_rows, cudnn_rows);
  }
  if (cudnn_bwd_rows > 0) {
    std::printf("# Avg cuDNN bwd TFLOP/s : %.4f (ours/cuDNN %.3f over %d rows)\n",
                sum_cudnn_bwd_tflops / cudnn_bwd_rows, sum_ours_vs_cudnn_bwd / cudnn_bwd_rows,
                cudnn_bwd_rows);
  }
  std::printf("#\n");
  return total_wrong == 0 ? 0 : 1;
}
