// hsap_schedule_perf: how long the per-batch planning takes. Builds the layout, the
// sequence-aware partition and the schedules of a large packed row (default: 1M tokens,
// 10,000 documents with long-tailed lengths, 64 ranks) and prints the time of each step
// next to its target (a rank's schedule: under 10 ms).
//
//   hsap_schedule_perf --tokens 1048576 --docs 10000 --ranks 64 -n 5
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <random>
#include <string>
#include <vector>

#include "attention/kernel.h"
#include "attention/layout.h"
#include "lib/sched/partition.h"
#include "lib/sched/schedule.h"

namespace {

using Clock = std::chrono::steady_clock;
double Ms(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}
double ThreadCpuMs() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) * 1e3 + static_cast<double>(t.tv_nsec) * 1e-6;
}

[[noreturn]] void Usage(const char* error) {
  if (error != nullptr) std::fprintf(stderr, "error: %s\n\n", error);
  std::fprintf(stderr,
               "usage: hsap_schedule_perf [--tokens N] [--docs N] [--ranks N] [-n iters]\n"
               "                          [--mask causal|mixed] [--seed N]\n");
  std::exit(error == nullptr ? 0 : 2);
}

// Long-tailed (lognormal, sigma 1.5) document lengths summing to `tokens`, each >= 1.
std::vector<int64_t> Lengths(int64_t tokens, int64_t docs, uint64_t seed) {
  docs = std::min(docs, tokens);
  std::mt19937_64 rng(seed);
  std::lognormal_distribution<double> dist(0.0, 1.5);
  std::vector<double> w(docs);
  double sum = 0;
  for (double& x : w) sum += (x = dist(rng));
  std::vector<int64_t> len(docs);
  int64_t assigned = 0;
  for (int64_t i = 0; i < docs; ++i) {
    len[i] = 1 + static_cast<int64_t>(std::floor(w[i] / sum * static_cast<double>(tokens - docs)));
    assigned += len[i];
  }
  *std::max_element(len.begin(), len.end()) += tokens - assigned;
  return len;
}

struct Options {
  int64_t tokens = 1 << 20, docs = 10000;
  int ranks = 64, iters = 5;
  uint64_t seed = 1;
  std::string mask = "mixed";
};

Options Parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") Usage(nullptr);
    if (i + 1 >= argc) Usage(("missing value for " + a).c_str());
    const std::string v = argv[++i];
    char* end = nullptr;
    const long long n = std::strtoll(v.c_str(), &end, 10);
    const bool ok = end != v.c_str() && *end == '\0' && n >= 1;
    if (a == "--mask") {
      if (v != "causal" && v != "mixed") Usage("--mask must be causal or mixed");
      o.mask = v;
      continue;
    }
    if (!ok) Usage((a + " needs a positive integer").c_str());
    if (a == "--tokens") {
      o.tokens = n;
    } else if (a == "--docs") {
      o.docs = n;
    } else if (a == "--ranks") {
      o.ranks = static_cast<int>(n);
    } else if (a == "-n" || a == "--iters") {
      o.iters = static_cast<int>(n);
    } else if (a == "--seed") {
      o.seed = static_cast<uint64_t>(n);
    } else {
      Usage(("unknown option " + a).c_str());
    }
  }
  return o;
}

// The row's documents as Layout::FromDocuments takes them (with --mask mixed, the four
// kinds in turn).
struct Documents {
  std::vector<int64_t> cu{0};
  std::vector<hsap::MaskKind> kinds;
  std::vector<int64_t> params;
};

Documents DocumentsOf(const Options& o, const std::vector<int64_t>& lengths) {
  Documents d;
  for (size_t i = 0; i < lengths.size(); ++i) {
    d.cu.push_back(d.cu.back() + lengths[i]);
    hsap::MaskKind kind = hsap::MaskKind::kCausal;
    if (o.mask == "mixed") kind = static_cast<hsap::MaskKind>(i % 4);
    d.kinds.push_back(kind);
    d.params.push_back(kind == hsap::MaskKind::kPrefixLM        ? lengths[i] / 4
                       : kind == hsap::MaskKind::kSlidingWindow ? std::min<int64_t>(lengths[i], 512)
                                                                : 0);
  }
  return d;
}

// Per rank, the best of the runs (a shared machine preempts now and then); wall time and
// the thread's CPU time.
struct Timings {
  double layout_ms = 1e300, partition_ms = 1e300;
  std::vector<double> rank_wall, rank_cpu;
  int64_t split = 0, stages = 0, rows_moved = 0;
  double worst_balance = 0, balance_slack = 0;
};

// Builds the layout, the partition and every rank's schedule o.iters times. False after
// printing why a step failed.
bool Measure(const Options& o, const Documents& d, Timings* t) {
  const int ranks = o.ranks;
  t->rank_wall.assign(ranks, 1e300);
  t->rank_cpu.assign(ranks, 1e300);
  for (int it = 0; it < o.iters; ++it) {
    auto t0 = Clock::now();
    absl::StatusOr<hsap::Layout> layout = hsap::Layout::FromDocuments(d.cu, d.kinds, d.params);
    auto t1 = Clock::now();
    if (!layout.ok()) {
      std::fprintf(stderr, "layout: %s\n", std::string(layout.status().message()).c_str());
      return false;
    }
    absl::StatusOr<hsap::Partition> partition = hsap::Partition::Create(*layout, ranks);
    auto t2 = Clock::now();
    if (!partition.ok()) {
      std::fprintf(stderr, "partition: %s\n", std::string(partition.status().message()).c_str());
      return false;
    }
    int64_t stage_count = 0, moved = 0;
    for (int r = 0; r < ranks; ++r) {
      const double c0 = ThreadCpuMs();
      auto s0 = Clock::now();
      absl::StatusOr<hsap::Schedule> s =
          hsap::BuildSchedule(*layout, *partition, r, hsap::kKernelBlockQ);
      const double ms = Ms(s0, Clock::now());
      const double cpu = ThreadCpuMs() - c0;
      if (!s.ok()) {
        std::fprintf(stderr, "schedule: %s\n", std::string(s.status().message()).c_str());
        return false;
      }
      t->rank_wall[r] = std::min(t->rank_wall[r], ms);
      t->rank_cpu[r] = std::min(t->rank_cpu[r], cpu);
      stage_count += static_cast<int64_t>(s->stages.size());
      moved += s->rows_received();
    }
    t->layout_ms = std::min(t->layout_ms, Ms(t0, t1));
    t->partition_ms = std::min(t->partition_ms, Ms(t1, t2));
    t->split = partition->split_units();
    t->worst_balance = 0;
    double min_target = 1e300;
    for (int r = 0; r < ranks; ++r) min_target = std::min(min_target, partition->target(r));
    for (int r = 0; r < ranks; ++r) {
      const double dev = std::abs(static_cast<double>(partition->work(r)) - partition->target(r));
      t->worst_balance = std::max(t->worst_balance, dev / partition->target(r));
      t->balance_slack = std::max(
          t->balance_slack,
          dev / (0.02 * min_target + 2.0 * static_cast<double>(partition->max_position_work())));
    }
    t->stages = stage_count;
    t->rows_moved = moved;
  }
  return true;
}

// The steps' times against their targets, and what the schedules move. Whether the
// schedule target was met.
bool PrintResults(const Options& o, const Timings& t) {
  const int ranks = o.ranks;
  const int64_t tokens = o.tokens;
  double all_ms = 0, max_rank_ms = 0, max_rank_cpu = 0;
  for (int r = 0; r < ranks; ++r) {
    all_ms += t.rank_wall[r];
    max_rank_ms = std::max(max_rank_ms, t.rank_wall[r]);
    max_rank_cpu = std::max(max_rank_cpu, t.rank_cpu[r]);
  }
  const double mean_rank_ms = all_ms / ranks;
  std::printf("# %-34s %12s %12s\n", "step", "time(ms)", "target(ms)");
  std::printf("  %-34s %12.3f %12s\n", "layout (cu_seqlens -> slices)", t.layout_ms, "-");
  std::printf("  %-34s %12.3f %12s\n", "partition (all ranks)", t.partition_ms, "-");
  std::printf("  %-34s %12.3f %12.3f\n", "schedule of one rank (mean)", mean_rank_ms, 10.0);
  std::printf("  %-34s %12.3f %12.3f\n", "schedule of one rank (slowest)", max_rank_ms, 10.0);
  std::printf("  %-34s %12.3f %12.3f\n", "  the same in thread CPU time", max_rank_cpu, 10.0);
  std::printf("  %-34s %12.3f %12s\n", "schedules of all ranks", all_ms, "-");
  std::printf(
      "# documents split across ranks: %lld; remote stages over all ranks: %lld; K/V rows "
      "moved: %lld (%.2f%% of a naive ring's %lld)\n",
      (long long)t.split, (long long)t.stages, (long long)t.rows_moved,
      100.0 * static_cast<double>(t.rows_moved) / (static_cast<double>(tokens) * (ranks - 1)),
      (long long)(tokens * (ranks - 1)));
  std::printf(
      "# balance: max |work - target| / target = %.4f%%; max |work - target| / (the rule's "
      "bound 0.02 * min target + 2g) = %.3f\n",
      100.0 * t.worst_balance, t.balance_slack);
  return max_rank_ms < 10.0;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = Parse(argc, argv);
  const std::vector<int64_t> lengths = Lengths(o.tokens, o.docs, o.seed);
  const Documents d = DocumentsOf(o, lengths);

  std::printf("# hsap_schedule_perf: partition and per-rank schedules of one packed row\n");
  std::printf(
      "# tokens %lld, documents %zu (lognormal(0, 1.5) lengths, longest %lld), ranks %d, "
      "mask %s, seed %llu\n",
      (long long)o.tokens, lengths.size(),
      (long long)*std::max_element(lengths.begin(), lengths.end()), o.ranks, o.mask.c_str(),
      (unsigned long long)o.seed);
  std::printf("# times in ms, one thread; per step (and per rank) the best of %d runs\n#\n",
              o.iters);

  Timings t;
  if (!Measure(o, d, &t)) return 1;
  const bool met = PrintResults(o, t);
  std::printf("# Schedule target (< 10 ms per rank): %s\n", met ? "met" : "NOT met");
  return 0;
}
