// hsap_attn_local_perf: single-device host attention over one packed row, in the style of
// nccl-tests. For each token count it times hsapAttentionForwardLocal and
// hsapAttentionBackwardLocal, reports the achieved GFLOP/s over visible pairs only, times the
// fp64 ReferenceForward on the same input (when small enough) and counts the elements of
// out/dq/dk/dv outside the tolerance rule.
//
//   hsap_attn_local_perf -b 1024 -e 16384 -f 2 --docs 8 --heads 8 --kv-heads 2
//       --head-dim 128 --dtype bf16 --mask causal --threads 0 -n 5 -w 1 -c 1
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attention/dtype.h"
#include "attention/layout.h"
#include "attention/parallel.h"
#include "attention/reference.h"
#include "attention/tolerance.h"
#include "bench/bench_util.h"
#include "hsap/hsap.h"
#include "lib/api/checks.h"

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
  int64_t docs = 8;
  int heads = 8;
  int kv_heads = 8;
  int head_dim = 128;
  std::string dtype = "bf16";
  std::string mask = "causal";  // causal | full | prefix | window | mixed
  int64_t window = 512;         // sliding window; prefix-LM uses a quarter of each document
  int threads = 0;
  int iters = 5;
  int warmup = 1;
  int check = 1;
  double ref_max_gflop = 2.0;  // skip the fp64 reference above this much forward work
  uint32_t seed = 1;
};

[[noreturn]] void Usage(const char* error) {
  if (error != nullptr) std::fprintf(stderr, "error: %s\n\n", error);
  std::fprintf(
      stderr,
      "usage: hsap_attn_local_perf [options]\n"
      "  -b, --tokens-begin N   first row length in tokens (default 4096)\n"
      "  -e, --tokens-end N     last row length (default: the first)\n"
      "  -f, --factor X         multiply the row length by X per step (default 2)\n"
      "  -t, --tokens N         one row length (sets -b and -e)\n"
      "      --docs N           documents per row; lengths drawn from a lognormal\n"
      "                         (sigma 1.2) with a fixed seed (default 8)\n"
      "      --heads N          query heads (default 8)\n"
      "      --kv-heads N       key/value heads (default: 8; must divide --heads)\n"
      "      --head-dim N       head dim, 32..256, multiple of 8 (default 128)\n"
      "      --dtype T          fp32 | bf16 | fp16 (default bf16)\n"
      "      --mask M           causal | full | prefix | window | mixed (default causal)\n"
      "      --window N         sliding window (default 512; clipped per document)\n"
      "  -T, --threads N        compute threads, 0 = all (default 0)\n"
      "  -n, --iters N          timed iterations (default 5)\n"
      "  -w, --warmup N         warmup iterations (default 1)\n"
      "  -c, --check 0|1|2      check against the fp64 reference (default 1); 2: a row too\n"
      "                         large for the reference is an error\n"
      "      --ref-max-gflop X  run the reference only up to X GFLOP of forward work\n"
      "                         (default 2)\n"
      "      --seed N           seed of document lengths and data (default 1)\n");
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
    if (arg == "-b" || arg == "--tokens-begin") {
      o.tokens_begin = need_int(1);
    } else if (arg == "-e" || arg == "--tokens-end") {
      o.tokens_end = need_int(1);
      end_set = true;
    } else if (arg == "-t" || arg == "--tokens") {
      o.tokens_begin = o.tokens_end = need_int(1);
      end_set = true;
    } else if (arg == "-f" || arg == "--factor") {
      if (!numeric || num <= 1.0) Usage("--factor needs a number > 1");
      o.factor = num;
    } else if (arg == "--docs") {
      o.docs = need_int(1);
    } else if (arg == "--heads") {
      o.heads = static_cast<int>(need_int(1));
    } else if (arg == "--kv-heads") {
      o.kv_heads = static_cast<int>(need_int(1));
    } else if (arg == "--head-dim") {
      o.head_dim = static_cast<int>(need_int(1));
    } else if (arg == "--dtype") {
      o.dtype = value;
    } else if (arg == "--mask") {
      o.mask = value;
    } else if (arg == "--window") {
      o.window = need_int(1);
    } else if (arg == "-T" || arg == "--threads") {
      o.threads = static_cast<int>(need_int(0));
    } else if (arg == "-n" || arg == "--iters") {
      o.iters = static_cast<int>(need_int(1));
    } else if (arg == "-w" || arg == "--warmup") {
      o.warmup = static_cast<int>(need_int(0));
    } else if (arg == "-c" || arg == "--check") {
      o.check = static_cast<int>(need_int(0));
    } else if (arg == "--ref-max-gflop") {
      if (!numeric || num < 0) Usage("--ref-max-gflop needs a number >= 0");
      o.ref_max_gflop = num;
    } else if (arg == "--seed") {
      o.seed = static_cast<uint32_t>(need_int(0));
    } else {
      Usage(("unknown option " + arg).c_str());
    }
  }
  if (!end_set) o.tokens_end = o.tokens_begin;
  if (o.tokens_end < o.tokens_begin) Usage("--tokens-end is below --tokens-begin");
  if (o.dtype != "fp32" && o.dtype != "bf16" && o.dtype != "fp16") {
    Usage("--dtype must be fp32, bf16 or fp16");
  }
  if (o.mask != "causal" && o.mask != "full" && o.mask != "prefix" && o.mask != "window" &&
      o.mask != "mixed") {
    Usage("--mask must be causal, full, prefix, window or mixed");
  }
  return o;
}

// Document lengths summing to `tokens`, each at least 1, drawn from a long-tailed
// (lognormal) distribution with a fixed seed: a few long documents and many short ones.
std::vector<int64_t> DocumentLengths(int64_t tokens, int64_t docs, uint32_t seed) {
  docs = std::min(docs, tokens);
  std::mt19937_64 rng(seed);
  std::lognormal_distribution<double> dist(0.0, 1.2);
  std::vector<double> w(static_cast<size_t>(docs));
  double sum = 0.0;
  for (double& x : w) sum += (x = dist(rng));
  std::vector<int64_t> lengths(w.size());
  int64_t assigned = 0;
  for (size_t i = 0; i < w.size(); ++i) {
    lengths[i] =
        1 + static_cast<int64_t>(std::floor(w[i] / sum * static_cast<double>(tokens - docs)));
    assigned += lengths[i];
  }
  // The rounding remainder goes to the longest document.
  *std::max_element(lengths.begin(), lengths.end()) += tokens - assigned;
  return lengths;
}

struct Row {
  std::vector<int64_t> cu;
  std::vector<hsapMaskKind_t> kinds;
  std::vector<int64_t> params;
};

Row MakeRow(const Options& o, int64_t tokens) {
  Row row;
  row.cu = {0};
  const std::vector<int64_t> lengths = DocumentLengths(tokens, o.docs, o.seed);
  const hsapMaskKind_t cycle[] = {hsapMaskCausal, hsapMaskFull, hsapMaskPrefixLM,
                                  hsapMaskSlidingWindow};
  for (size_t i = 0; i < lengths.size(); ++i) {
    const int64_t len = lengths[i];
    row.cu.push_back(row.cu.back() + len);
    hsapMaskKind_t kind = hsapMaskCausal;
    if (o.mask == "full") kind = hsapMaskFull;
    if (o.mask == "prefix") kind = hsapMaskPrefixLM;
    if (o.mask == "window") kind = hsapMaskSlidingWindow;
    if (o.mask == "mixed") kind = cycle[i % 4];
    row.kinds.push_back(kind);
    row.params.push_back(kind == hsapMaskPrefixLM        ? len / 4
                         : kind == hsapMaskSlidingWindow ? std::min(len, o.window)
                                                         : 0);
  }
  return row;
}

struct Buffer {
  std::vector<uint8_t> bytes;
  hsapTensor_t t;
  Buffer(hsap::DType dtype, int64_t tokens, int heads, int head_dim) {
    bytes.assign(static_cast<size_t>(tokens) * heads * head_dim * hsap::DTypeSize(dtype), 0);
    t = hsapTensor_t{bytes.data(), ToC(dtype), tokens, heads, head_dim};
  }
  size_t size() const { return static_cast<size_t>(t.numTokens) * t.numHeads * t.headDim; }
};

// Elements of `got` outside the tolerance rule of the tests (attention/tolerance.h) for
// results stored in `dtype`.
int64_t CountWrong(hsap::DType dtype, const Buffer& got, const std::vector<double>& ref,
                   const std::vector<double>& naive) {
  double naive_err = 0.0, magnitude = 1.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    naive_err = std::max(naive_err, std::abs(naive[i] - ref[i]));
    magnitude = std::max(magnitude, std::abs(ref[i]));
  }
  const double tol = hsap::ToleranceBound(naive_err, magnitude, hsap::StorageFloor(dtype));
  int64_t wrong = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double e = std::abs(hsap::LoadAsFloat(dtype, got.bytes.data(), i) - ref[i]);
    if (!(e <= tol)) ++wrong;
  }
  return wrong;
}

// The preamble: what runs and what every column means, and the column header.
void PrintPreamble(const Options& o, int version, int threads) {
  std::printf("# hsap_attn_local_perf (hsap %d): single-device host attention over a packed row\n",
              version);
  std::printf("# threads %d, dtype %s, heads %d (kv %d), head dim %d, mask %s", threads,
              o.dtype.c_str(), o.heads, o.kv_heads, o.head_dim, o.mask.c_str());
  if (o.mask == "window" || o.mask == "mixed") std::printf(", window %lld", (long long)o.window);
  std::printf(
      "\n# documents: %lld per row, lengths lognormal(0, 1.2) normalised to the row, seed %u\n",
      (long long)o.docs, o.seed);
  std::printf(
      "# time: wall time of one hsapAttentionForwardLocal / BackwardLocal call (mean of %d "
      "after %d warmup), in ms\n",
      o.iters, o.warmup);
  std::printf(
      "# GFLOP/s: counted over visible (query, key) pairs only: forward 4*D FLOPs per pair "
      "per query head (QK^T and PV), backward 2.5x forward (10*D)\n");
  std::printf(
      "# ref: fp64 ReferenceForward on the same input, in s; skipped above %.3g GFLOP of "
      "forward work or with -c 0\n",
      o.ref_max_gflop);
  std::printf(
      "# #wrong: elements of out, dq, dk, dv with |x - ref| > 2 * (max error of the "
      "same-precision NaiveForward/Backward) + 4 rounding units; '-' when not checked\n");
  std::printf("#\n# %10s %6s %14s %10s %10s %10s %10s %10s %7s\n", "tokens", "docs", "pairs",
              "fwd(ms)", "fwd GF/s", "bwd(ms)", "bwd GF/s", "ref(s)", "#wrong");
}

// The elements of out, dq, dk, dv outside the rule against the fp64 reference on the same
// input (`outs`: out, dq, dk, dv); *ref_s: the time of the reference forward.
int64_t CheckRow(const Options& o, hsap::DType dtype, const hsap::Layout& l, const Buffer& q,
                 const Buffer& k, const Buffer& v, const Buffer& dout,
                 std::array<const Buffer*, 4> outs, double* ref_s) {
  const Buffer &out = *outs[0], &dq = *outs[1], &dk = *outs[2], &dv = *outs[3];
  hsap::ReferenceInputs in;
  in.dims.heads_q = o.heads;
  in.dims.heads_kv = o.kv_heads;
  in.dims.head_dim = o.head_dim;
  in.dims.scale = 1.0f / std::sqrt(static_cast<float>(o.head_dim));
  in.dtype = dtype;
  in.q = q.bytes.data();
  in.k = k.bytes.data();
  in.v = v.bytes.data();
  const auto t0 = Clock::now();
  const hsap::ReferenceForwardResult ref = hsap::ReferenceForward(l, in);
  *ref_s = Seconds(t0, Clock::now());
  const hsap::ReferenceForwardResult naive = hsap::NaiveForward(l, in);
  const hsap::ReferenceGradients gref = hsap::ReferenceBackward(l, in, dout.bytes.data());
  const hsap::ReferenceGradients gnaive = hsap::NaiveBackward(l, in, dout.bytes.data());
  return CountWrong(dtype, out, ref.out, naive.out) + CountWrong(dtype, dq, gref.dq, gnaive.dq) +
         CountWrong(dtype, dk, gref.dk, gnaive.dk) + CountWrong(dtype, dv, gref.dv, gnaive.dv);
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = ParseOptions(argc, argv);
  const hsap::DType dtype = ParseDType(o.dtype);
  const int threads = o.threads > 0 ? o.threads : hsap::HardwareThreads();
  int version = 0;
  Must(hsapGetVersion(&version), "hsapGetVersion");

  PrintPreamble(o, version, threads);

  hsapAttentionConfig_t config = HSAP_ATTENTION_CONFIG_INITIALIZER;
  config.numThreads = o.threads;
  int64_t total_wrong = 0, unchecked = 0;
  double sum_fwd_gflops = 0.0, sum_bwd_gflops = 0.0;
  int rows = 0;
  for (double t = static_cast<double>(o.tokens_begin);
       t <= static_cast<double>(o.tokens_end) * 1.0000001; t *= o.factor) {
    const int64_t tokens = static_cast<int64_t>(std::llround(t));
    const Row row = MakeRow(o, tokens);
    hsapLayout_t layout = nullptr;
    Must(hsapLayoutCreate(&layout, row.cu.data(), static_cast<int64_t>(row.kinds.size()),
                          row.kinds.data(), row.params.data()),
         "hsapLayoutCreate");
    int64_t pairs = 0;
    Must(hsapLayoutGetVisiblePairs(layout, &pairs), "hsapLayoutGetVisiblePairs");

    Buffer q(dtype, tokens, o.heads, o.head_dim), k(dtype, tokens, o.kv_heads, o.head_dim);
    Buffer v(dtype, tokens, o.kv_heads, o.head_dim), out(dtype, tokens, o.heads, o.head_dim);
    Buffer dout(dtype, tokens, o.heads, o.head_dim), dq(dtype, tokens, o.heads, o.head_dim);
    Buffer dk(dtype, tokens, o.kv_heads, o.head_dim), dv(dtype, tokens, o.kv_heads, o.head_dim);
    std::vector<float> lse(static_cast<size_t>(tokens) * o.heads);
    std::mt19937 rng(o.seed + static_cast<uint32_t>(tokens));
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (Buffer* b : {&q, &k, &v, &dout}) {
      for (size_t i = 0; i < b->size(); ++i)
        hsap::StoreFromFloat(dtype, b->bytes.data(), i, u(rng));
    }

    auto forward = [&] {
      Must(hsapAttentionForwardLocal(&config, layout, &q.t, &k.t, &v.t, &out.t, lse.data()),
           "hsapAttentionForwardLocal");
    };
    auto backward = [&] {
      Must(hsapAttentionBackwardLocal(&config, layout, &dout.t, &q.t, &k.t, &v.t, &out.t,
                                      lse.data(), &dq.t, &dk.t, &dv.t),
           "hsapAttentionBackwardLocal");
    };
    for (int i = 0; i < o.warmup; ++i) forward();
    auto t0 = Clock::now();
    for (int i = 0; i < o.iters; ++i) forward();
    const double fwd_s = Seconds(t0, Clock::now()) / o.iters;
    for (int i = 0; i < o.warmup; ++i) backward();
    t0 = Clock::now();
    for (int i = 0; i < o.iters; ++i) backward();
    const double bwd_s = Seconds(t0, Clock::now()) / o.iters;

    const double fwd_flop = 4.0 * o.head_dim * static_cast<double>(pairs) * o.heads;
    const double fwd_gflops = fwd_flop / fwd_s * 1e-9, bwd_gflops = 2.5 * fwd_flop / bwd_s * 1e-9;
    sum_fwd_gflops += fwd_gflops;
    sum_bwd_gflops += bwd_gflops;
    ++rows;

    char ref_col[32] = "skipped", wrong_col[32] = "-";
    const bool checked = o.check != 0 && fwd_flop * 1e-9 <= o.ref_max_gflop;
    if (o.check == 2 && !checked) {
      std::fprintf(stderr, "error: -c 2, but %lld tokens exceed --ref-max-gflop %.3g\n",
                   (long long)tokens, o.ref_max_gflop);
      ++unchecked;
    }
    if (checked) {
      double ref_s = 0;
      const int64_t wrong =
          CheckRow(o, dtype, layout->layout, q, k, v, dout, {&out, &dq, &dk, &dv}, &ref_s);
      total_wrong += wrong;
      std::snprintf(ref_col, sizeof(ref_col), "%.3f", ref_s);
      std::snprintf(wrong_col, sizeof(wrong_col), "%lld", (long long)wrong);
    }
    std::printf("  %10lld %6zu %14lld %10.3f %10.2f %10.3f %10.2f %10s %7s\n", (long long)tokens,
                row.kinds.size(), (long long)pairs, fwd_s * 1e3, fwd_gflops, bwd_s * 1e3,
                bwd_gflops, ref_col, wrong_col);
    std::fflush(stdout);
    Must(hsapLayoutDestroy(layout), "hsapLayoutDestroy");
  }
  std::printf("# Out of bounds values : %lld %s\n", (long long)total_wrong,
              total_wrong == 0 ? "OK" : "FAILED");
  std::printf("# Avg fwd GFLOP/s : %.2f\n# Avg bwd GFLOP/s : %.2f\n#\n",
              rows > 0 ? sum_fwd_gflops / rows : 0.0, rows > 0 ? sum_bwd_gflops / rows : 0.0);
  return total_wrong == 0 && unchecked == 0 ? 0 : 1;
}
