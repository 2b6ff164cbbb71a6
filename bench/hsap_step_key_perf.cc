// hsap_step_key_perf: what a training step's key costs beside the step's attention. A
// trainer that packs a new row every step makes, per step, the row's layouts (one per mask
// its layers use), one partition for all of them (hsapPartitionCreateForLayouts) and a batch
// per mask over it -- collective, so the ranks wait for one another there. This bench times
// that on the host backend (ranks as threads of this process) with a new row each step, two
// ways, beside a forward + backward of every mask's batch (one layer per mask):
//
//   key, one call          hsapBatchCreateManyWithPartition: every batch in one agreement
//   key, batch by batch    hsapBatchCreateWithPartition per mask: one agreement per batch
//
// Steps alternate between the two ways. A phase's time runs from the moment the last rank
// began it to the moment the last rank ended it (Stats); the table gives the median and the
// 90th percentile over the steps of each way (after a warm-up step of each that compiles the
// kernels).
//
//   hsap_step_key_perf --ranks 4 --docs 64 --tokens 1024 --masks causal,sw:32 -n 50
#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_util.h"
#include "hsap/hsap.h"

namespace {

using hsap::bench::Clock;
using hsap::bench::Must;

[[noreturn]] void Usage(const char* error) {
  if (error != nullptr) std::fprintf(stderr, "error: %s\n\n", error);
  std::fprintf(stderr,
               "usage: hsap_step_key_perf [--ranks N] [--docs N] [--tokens N] [-n steps]\n"
               "                          [--masks causal,sw:W,full,prefix:P] [--heads Q/KV]\n"
               "                          [--dim D] [--dtype fp32|bf16|fp16] [--seed N]\n");
  std::exit(error == nullptr ? 0 : 2);
}

struct Mask {
  hsapMaskKind_t kind = hsapMaskCausal;
  int64_t param = 0;
  std::string name;
};

struct Options {
  int ranks = 4, docs = 64, steps = 30, heads_q = 4, heads_kv = 2, dim = 32;
  int64_t tokens = 1024;
  uint64_t seed = 1;
  std::string dtype = "fp32";
  std::vector<Mask> masks;
};

std::vector<Mask> ParseMasks(const std::string& list) {
  std::vector<Mask> masks;
  size_t at = 0;
  while (at <= list.size()) {
    const size_t comma = std::min(list.find(',', at), list.size());
    const std::string m = list.substr(at, comma - at);
    at = comma + 1;
    Mask mask;
    mask.name = m;
    const size_t colon = m.find(':');
    const std::string kind = m.substr(0, colon);
    if (colon != std::string::npos) mask.param = std::atoll(m.c_str() + colon + 1);
    if (kind == "causal" && colon == std::string::npos) {
      mask.kind = hsapMaskCausal;
    } else if (kind == "full" && colon == std::string::npos) {
      mask.kind = hsapMaskFull;
    } else if (kind == "sw" && mask.param >= 1) {
      mask.kind = hsapMaskSlidingWindow;
    } else if (kind == "prefix" && mask.param >= 0 && colon != std::string::npos) {
      mask.kind = hsapMaskPrefixLM;
    } else {
      Usage(("--masks: '" + m + "' is not causal, full, sw:W (W >= 1) or prefix:P").c_str());
    }
    masks.push_back(mask);
  }
  return masks;
}

Options Parse(int argc, char** argv) {
  Options o;
  o.masks = ParseMasks("causal,sw:32");
  hsap::bench::ArgReader reader(argc, argv, Usage);
  hsap::bench::Arg a;
  while (reader.Next(a)) {
    if (a.name == "--ranks") {
      o.ranks = static_cast<int>(a.Int(1));
    } else if (a.name == "--docs") {
      o.docs = static_cast<int>(a.Int(1));
    } else if (a.name == "--tokens") {
      o.tokens = a.Int(1);
    } else if (a.name == "-n" || a.name == "--steps") {
      o.steps = static_cast<int>(a.Int(1));
    } else if (a.name == "--dim") {
      o.dim = static_cast<int>(a.Int(1));
    } else if (a.name == "--seed") {
      o.seed = static_cast<uint64_t>(a.Int(0));
    } else if (a.name == "--masks") {
      o.masks = ParseMasks(a.value);
    } else if (a.name == "--heads") {
      if (std::sscanf(a.value.c_str(), "%d/%d", &o.heads_q, &o.heads_kv) != 2 || o.heads_q < 1 ||
          o.heads_kv < 1) {
        Usage("--heads takes Q/KV, e.g. 4/2");
      }
    } else if (a.name == "--dtype") {
      if (a.value != "fp32" && a.value != "bf16" && a.value != "fp16") {
        Usage("--dtype must be fp32, bf16 or fp16");
      }
      o.dtype = a.value;
    } else {
      Usage(("unknown option " + a.name).c_str());
    }
  }
  if (o.tokens < o.docs) Usage("--tokens must be at least --docs (documents of >= 1 token)");
  return o;
}

// A row of `docs` documents of long-tailed (lognormal) lengths, each >= 1, summing to
// `tokens`: cu_seqlens.
std::vector<int64_t> Row(const Options& o, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::lognormal_distribution<double> dist(0.0, 1.0);
  std::vector<double> w(o.docs);
  double sum = 0;
  for (double& x : w) sum += (x = dist(rng));
  std::vector<int64_t> cu{0};
  for (int i = 0; i < o.docs; ++i) {
    const int64_t rest = o.tokens - cu.back() - (o.docs - 1 - i);
    int64_t len = 1 + static_cast<int64_t>(w[i] / sum * static_cast<double>(o.tokens - o.docs));
    len = i + 1 == o.docs ? rest : std::min(len, rest);
    cu.push_back(cu.back() + len);
  }
  return cu;
}

// One rank's shard tensors of one batch (random values; the bench checks time, not math:
// the tests check the results).
struct Shard {
  std::vector<uint8_t> q, k, v, dout, out, dq, dk, dv;
  std::vector<float> lse;
  hsapTensor_t T(std::vector<uint8_t>& x, hsapDataType_t dtype, int64_t n, int heads, int dim) {
    return hsapTensor_t{x.data(), dtype, n, heads, dim};
  }
};

// A barrier of the rank threads that sleeps while it waits (std::barrier may spin, which on a
// machine with fewer cores than ranks takes the cores the other ranks need to get there).
class SleepingBarrier {
 public:
  explicit SleepingBarrier(int n) : n_(n) {}
  void arrive_and_wait() {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t round = round_;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++round_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return round_ != round; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  const int n_;
  int arrived_ = 0;
  uint64_t round_ = 0;
};

// When one rank began and ended each phase of one step (ms since the bench's start).
struct Span {
  double begin = 0, end = 0;
};
struct StepTimes {
  Span key_one_call, key_by_batch, attention;
};

const Clock::time_point kStart = Clock::now();
double Now() { return 1e3 * hsap::bench::Seconds(kStart, Clock::now()); }

// Layouts of the row under every mask, and the partition they share.
struct Key {
  std::vector<hsapLayout_t> layouts;
  hsapPartition_t partition = nullptr;
  std::vector<hsapBatch_t> batches;

  Key(const Options& o, const std::vector<int64_t>& cu) {
    const int docs = static_cast<int>(cu.size() - 1);
    for (const Mask& m : o.masks) {
      std::vector<hsapMaskKind_t> kinds(docs, m.kind);
      std::vector<int64_t> params(docs, m.param);
      hsapLayout_t l = nullptr;
      Must(hsapLayoutCreate(&l, cu.data(), docs, kinds.data(), params.data()), "hsapLayoutCreate");
      layouts.push_back(l);
    }
    Must(hsapPartitionCreateForLayouts(&partition, layouts.data(), static_cast<int>(layouts.size()),
                                       o.ranks, nullptr),
         "hsapPartitionCreateForLayouts");
  }
  ~Key() {
    for (hsapBatch_t b : batches) hsapBatchDestroy(b);
    hsapPartitionDestroy(partition);
    for (hsapLayout_t l : layouts) hsapLayoutDestroy(l);
  }
};

void RunRank(const Options& o, hsapComm_t comm, int rank, SleepingBarrier& sync,
             std::vector<std::vector<StepTimes>>& times) {
  const hsapDataType_t dtype = hsap::bench::ToC(hsap::bench::ParseDType(o.dtype));
  const size_t es = o.dtype == "fp32" ? 4 : 2;
  hsapBatchConfig_t config = HSAP_BATCH_CONFIG_INITIALIZER;
  config.dtype = dtype;
  config.numHeadsQ = o.heads_q;
  config.numHeadsKV = o.heads_kv;
  config.headDim = o.dim;
  std::vector<hsapBatchConfig_t> configs(o.masks.size(), config);
  std::mt19937 rng(rank);
  // Steps alternate between the two ways of making the key (even: one call), so that both
  // run in the same surroundings; steps 0 and 1 are the warm-up.
  for (int step = 0; step < 2 * o.steps + 2; ++step) {
    const bool one_call = step % 2 == 0;
    const std::vector<int64_t> cu = Row(o, o.seed + step / 2);
    StepTimes& t = times[rank][step];
    sync.arrive_and_wait();
    const double begin = Now();
    Key key(o, cu);
    key.batches.assign(o.masks.size(), nullptr);
    if (one_call) {
      Must(
          hsapBatchCreateManyWithPartition(key.batches.data(), static_cast<int>(o.masks.size()),
                                           comm, key.layouts.data(), key.partition, configs.data()),
          "hsapBatchCreateManyWithPartition");
    } else {
      for (size_t i = 0; i < o.masks.size(); ++i) {
        Must(hsapBatchCreateWithPartition(&key.batches[i], comm, key.layouts[i], key.partition,
                                          &configs[i]),
             "hsapBatchCreateWithPartition");
      }
    }
    (one_call ? t.key_one_call : t.key_by_batch) = Span{begin, Now()};
    // A forward and a backward of every mask's batch (one layer per mask).
    int64_t n = 0;
    Must(hsapBatchGetLocalTokens(key.batches[0], &n), "hsapBatchGetLocalTokens");
    Shard s;
    const size_t qb = n * o.heads_q * o.dim * es + 1, kb = n * o.heads_kv * o.dim * es + 1;
    for (auto* x : {&s.q, &s.dout, &s.out, &s.dq}) x->assign(qb, 0);
    for (auto* x : {&s.k, &s.v, &s.dk, &s.dv}) x->assign(kb, 0);
    for (auto* x : {&s.q, &s.k, &s.v, &s.dout}) {
      for (size_t i = 0; i + 1 < x->size(); i += es) (*x)[i + es - 1] = 0x3c + rng() % 2;
    }
    s.lse.assign(n * o.heads_q + 1, 0.0f);
    hsapTensor_t q = s.T(s.q, dtype, n, o.heads_q, o.dim),
                 k = s.T(s.k, dtype, n, o.heads_kv, o.dim),
                 v = s.T(s.v, dtype, n, o.heads_kv, o.dim),
                 dout = s.T(s.dout, dtype, n, o.heads_q, o.dim),
                 out = s.T(s.out, dtype, n, o.heads_q, o.dim),
                 dq = s.T(s.dq, dtype, n, o.heads_q, o.dim),
                 dk = s.T(s.dk, dtype, n, o.heads_kv, o.dim),
                 dv = s.T(s.dv, dtype, n, o.heads_kv, o.dim);
    sync.arrive_and_wait();
    t.attention.begin = Now();
    for (hsapBatch_t b : key.batches) {
      Must(hsapAttentionForward(b, &q, &k, &v, &out, s.lse.data()), "hsapAttentionForward");
      Must(hsapAttentionBackward(b, &dout, &q, &k, &v, &out, s.lse.data(), &dq, &dk, &dv),
           "hsapAttentionBackward");
    }
    t.attention.end = Now();
  }
}

// Median and 90th percentile over the steps (warm-up excluded) of a phase's time: from the
// moment the last rank began it (every rank is then in it: what went before, such as the
// ranks leaving a barrier at different times on a loaded machine, is not the phase's) to the
// moment the last rank ended it.
std::pair<double, double> Stats(const std::vector<std::vector<StepTimes>>& times,
                                Span StepTimes::*field) {
  std::vector<double> worst;
  for (size_t s = 2; s < times[0].size(); ++s) {
    if ((times[0][s].*field).end == 0) continue;  // a step of the other way
    double begin = 0, end = 0;
    for (const auto& rank : times) {
      begin = std::max(begin, (rank[s].*field).begin);
      end = std::max(end, (rank[s].*field).end);
    }
    worst.push_back(end - begin);
  }
  std::sort(worst.begin(), worst.end());
  auto at = [&](double p) {
    return worst[std::min(worst.size() - 1, static_cast<size_t>(p * (worst.size() - 1) + 0.5))];
  };
  return {at(0.5), at(0.9)};
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = Parse(argc, argv);
  std::vector<hsapComm_t> comms(o.ranks);
  hsapCommConfig_t cc = HSAP_COMM_CONFIG_INITIALIZER;
  cc.numThreads = 1;  // one compute thread per rank: the ranks are the parallelism here
  Must(hsapCommInitAll(comms.data(), o.ranks, &cc), "hsapCommInitAll");
  std::string masks;
  for (const Mask& m : o.masks) masks += (masks.empty() ? "" : ",") + m.name;
  std::printf(
      "# hsap_step_key_perf: a step's key (layouts, shared partition, a batch per mask) "
      "beside its attention\n");
  std::printf(
      "# host backend, %d ranks (threads, 1 compute thread each), %d documents, %lld "
      "tokens, masks %s, heads %d/%d, head dim %d, %s, %d steps (+1 warm-up), a new "
      "row each step\n",
      o.ranks, o.docs, static_cast<long long>(o.tokens), masks.c_str(), o.heads_q, o.heads_kv,
      o.dim, o.dtype.c_str(), o.steps);
  std::printf("# a phase's time: from the last rank's start to the last rank's end\n#\n");
  std::vector<std::vector<StepTimes>> times(o.ranks, std::vector<StepTimes>(2 * o.steps + 2));
  SleepingBarrier sync(o.ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < o.ranks; ++r) {
    threads.emplace_back([&, r] { RunRank(o, comms[r], r, sync, times); });
  }
  for (std::thread& t : threads) t.join();
  for (hsapComm_t c : comms) hsapCommDestroy(c);
  std::printf("# %-60s %12s %12s\n", "what", "median (ms)", "p90 (ms)");
  const struct {
    const char* name;
    Span StepTimes::*field;
  } rows[] = {
      {"key, one call (hsapBatchCreateManyWithPartition)", &StepTimes::key_one_call},
      {"key, batch by batch (hsapBatchCreateWithPartition)", &StepTimes::key_by_batch},
      {"attention: forward + backward of every mask's batch", &StepTimes::attention},
  };
  for (const auto& row : rows) {
    const auto [median, p90] = Stats(times, row.field);
    std::printf("  %-60s %12.3f %12.3f\n", row.name, median, p90);
  }
  const double key = Stats(times, &StepTimes::key_one_call).first;
  const double attention = Stats(times, &StepTimes::attention).first;
  std::printf(
      "# key (one call) / attention: %.1f %%; target (issue 27): key < 2 ms for 4 ranks "
      "and 64 documents\n",
      100.0 * key / std::max(attention, 1e-9));
  return 0;
}
