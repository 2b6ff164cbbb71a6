// hsap_kernel_bench: the JIT host attention kernels against the hand-written kernels and
// against this machine's measured FMA peak, plus JIT compile times and cache hit rates.
//
//   hsap_kernel_bench [--tokens=N] [--heads_q=H] [--heads_kv=H] [--dtype=bf16|fp16|fp32]
//                     [--dims=64,128,256] [--threads=N] [--reps=N] [--nvrtc_arch=sm_90]
//                     [--nvrtc_limit=N (0: all shipped variants, -1: skip)]
//                     [--layouts=causal,packed,full] [--peer=<python> [--peer_script=PATH]]
//
// --peer: also times PyTorch's CPU attention (bench/torch_peer.py, run by that Python) on
// the same shape, dtype and thread count for the single-document layouts (causal, full)
// and prints its times beside the hand-written and JIT ones, with the ratios
// (torch_ms / hsap_ms: above 1 means hsap is faster). Without an importable torch the
// comparison is skipped with a line saying why.
//
// Throughput is GFLOP/s over visible (query, key) pairs: forward 4*D flops per pair per
// query head (Q.K^T and P.V), backward 10*D (2.5x forward, the FlashAttention convention;
// the JIT backward recomputes more than that, which the figure does not credit). Masked
// work inside diagonal tiles is not counted. The best of --reps runs is reported. Runs on
// one thread (and the 1-thread peak) are timed by process CPU time, runs on several threads
// by the wall clock: on a shared machine the multi-thread rows are only as good as the
// machine is idle.
//
// The FMA peak is a register-only microbenchmark: 16 independent accumulator chains with
// distinct initial values per thread (so the compiler cannot merge them), fp32 FMA on
// AVX-512 (or AVX2), and vdpbf16ps where the CPU has AVX512-BF16.
#include <immintrin.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "attention/kernel.h"
#include "attention/layout.h"
#include "attention/parallel.h"
#include "attention/worklist.h"
#include "jit/cache.h"
#include "jit/codegen_host.h"
#include "jit/cuda_kernels.h"
#include "jit/host_compiler.h"
#include "jit/host_jit_kernels.h"

namespace hsap {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// CPU time of the whole process. Runs on one thread are timed with it rather than the wall
// clock, so that other processes competing for the cores do not count against a kernel.
double ProcessCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// Seconds of `fn`: process CPU time with one thread, wall time with more.
template <typename Fn>
double TimeIt(int threads, Fn&& fn) {
  const double c0 = ProcessCpuSeconds();
  const auto t0 = Clock::now();
  fn();
  return threads == 1 ? ProcessCpuSeconds() - c0 : Seconds(t0, Clock::now());
}

volatile float g_sink;

// ---- FMA peak ----
// The chains are written out one by one: a loop over an accumulator array makes GCC keep
// the array in memory, and the benchmark then measures store forwarding, not FMAs.
#define HSAP_REPEAT16(X) \
  X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)
#define HSAP_REPEAT12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

__attribute__((target("avx512f"), noinline)) double FmaChainsAvx512(int64_t iters) {
#define HSAP_INIT(i) __m512 acc##i = _mm512_set1_ps(1.0f + 0.001f * (i));
  HSAP_REPEAT16(HSAP_INIT)
#undef HSAP_INIT
  const __m512 a = _mm512_set1_ps(0.9999999f), b = _mm512_set1_ps(1e-7f);
  for (int64_t it = 0; it < iters; ++it) {
#define HSAP_STEP(i) acc##i = _mm512_fmadd_ps(acc##i, a, b);
    HSAP_REPEAT16(HSAP_STEP)
#undef HSAP_STEP
  }
  __m512 s = _mm512_setzero_ps();
#define HSAP_SUM(i) s = _mm512_add_ps(s, acc##i);
  HSAP_REPEAT16(HSAP_SUM)
#undef HSAP_SUM
  g_sink = _mm512_reduce_add_ps(s);
  return static_cast<double>(iters) * 16 * 16 * 2;
}

__attribute__((target("avx2,fma"), noinline)) double FmaChainsAvx2(int64_t iters) {
#define HSAP_INIT(i) __m256 acc##i = _mm256_set1_ps(1.0f + 0.001f * (i));
  HSAP_REPEAT12(HSAP_INIT)
#undef HSAP_INIT
  const __m256 a = _mm256_set1_ps(0.9999999f), b = _mm256_set1_ps(1e-7f);
  for (int64_t it = 0; it < iters; ++it) {
#define HSAP_STEP(i) acc##i = _mm256_fmadd_ps(acc##i, a, b);
    HSAP_REPEAT12(HSAP_STEP)
#undef HSAP_STEP
  }
  __m256 s = _mm256_setzero_ps();
#define HSAP_SUM(i) s = _mm256_add_ps(s, acc##i);
  HSAP_REPEAT12(HSAP_SUM)
#undef HSAP_SUM
  float out[8];
  _mm256_storeu_ps(out, s);
  g_sink = out[0];
  return static_cast<double>(iters) * 12 * 8 * 2;
}

__attribute__((target("avx512f,avx512bf16"), noinline)) double DpBf16Chains(int64_t iters) {
#define HSAP_INIT(i) __m512 acc##i = _mm512_set1_ps(1.0f + 0.001f * (i));
  HSAP_REPEAT16(HSAP_INIT)
#undef HSAP_INIT
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80);  // bf16 1.0
  const __m512bh b = (__m512bh)_mm512_set1_epi16(0x3380);  // bf16 ~6e-8
  for (int64_t it = 0; it < iters; ++it) {
#define HSAP_STEP(i) acc##i = _mm512_dpbf16_ps(acc##i, a, b);
    HSAP_REPEAT16(HSAP_STEP)
#undef HSAP_STEP
  }
  __m512 s = _mm512_setzero_ps();
#define HSAP_SUM(i) s = _mm512_add_ps(s, acc##i);
  HSAP_REPEAT16(HSAP_SUM)
#undef HSAP_SUM
  g_sink = _mm512_reduce_add_ps(s);
  return static_cast<double>(iters) * 16 * 32 * 2;  // 32 products per instruction
}

// GFLOP/s of `fn` on `threads` threads at once.
double PeakGflops(double (*fn)(int64_t), int threads) {
  const int64_t iters = 20'000'000;
  fn(iters / 20);  // warm up (clocks, caches)
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    std::vector<double> flops(threads);
    const double s = TimeIt(threads, [&] {
      if (threads == 1) {
        flops[0] = fn(iters);
        return;
      }
      std::vector<std::thread> pool;
      for (int t = 0; t < threads; ++t) pool.emplace_back([&, t] { flops[t] = fn(iters); });
      for (auto& th : pool) th.join();
    });
    double total = 0;
    for (double f : flops) total += f;
    best = std::max(best, total / s / 1e9);
  }
  return best;
}

// ---- attention ----
struct Flags {
  int64_t tokens = 4096;
  int heads_q = 8, heads_kv = 2;
  DType dtype = DType::kBF16;
  std::vector<int> dims = {64, 128, 256};
  int threads = 0;
  int reps = 3;
  std::string nvrtc_arch = "sm_90";
  int nvrtc_limit = 0;
  std::vector<std::string> layouts = {"causal", "packed"};
  std::string peer;  // Python interpreter for bench/torch_peer.py; empty: no peer
  std::string peer_script;
};

std::vector<std::string> SplitCommas(const char* v) {
  std::vector<std::string> parts;
  for (const char* p = v; *p;) {
    const char* e = p;
    while (*e && *e != ',') ++e;
    if (e > p) parts.emplace_back(p, e);
    p = *e == ',' ? e + 1 : e;
  }
  return parts;
}

Flags ParseFlags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&](const char* name) -> const char* {
      const std::string prefix = std::string("--") + name + "=";
      return a.rfind(prefix, 0) == 0 ? argv[i] + prefix.size() : nullptr;
    };
    if (const char* v = value("tokens")) {
      f.tokens = std::atoll(v);
    } else if (const char* v = value("heads_q")) {
      f.heads_q = std::atoi(v);
    } else if (const char* v = value("heads_kv")) {
      f.heads_kv = std::atoi(v);
    } else if (const char* v = value("dtype")) {
      f.dtype = std::strcmp(v, "fp32") == 0   ? DType::kF32
                : std::strcmp(v, "fp16") == 0 ? DType::kF16
                                              : DType::kBF16;
    } else if (const char* v = value("dims")) {
      f.dims.clear();
      for (const char* p = v; *p;) {
        f.dims.push_back(std::atoi(p));
        while (*p && *p != ',') ++p;
        if (*p == ',') ++p;
      }
    } else if (const char* v = value("threads")) {
      f.threads = std::atoi(v);
    } else if (const char* v = value("reps")) {
      f.reps = std::max(1, std::atoi(v));
    } else if (const char* v = value("nvrtc_arch")) {
      f.nvrtc_arch = v;
    } else if (const char* v = value("nvrtc_limit")) {
      f.nvrtc_limit = std::atoi(v);
    } else if (const char* v = value("layouts")) {
      f.layouts = SplitCommas(v);
      for (const std::string& l : f.layouts) {
        if (l != "causal" && l != "packed" && l != "full") {
          std::fprintf(stderr, "--layouts: unknown layout '%s' (causal, packed, full)\n",
                       l.c_str());
          std::exit(2);
        }
      }
    } else if (const char* v = value("peer")) {
      f.peer = v;
    } else if (const char* v = value("peer_script")) {
      f.peer_script = v;
    } else {
      std::fprintf(stderr, "unknown flag %s (see the comment at the top of the source)\n", argv[i]);
      std::exit(2);
    }
  }
  if (f.threads <= 0) f.threads = HardwareThreads();
  if (!f.peer.empty() && f.peer_script.empty()) {
    // bench/torch_peer.py of the source tree this binary was built from (build/..).
    char exe[4096];
    const ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    std::string dir = n > 0 ? std::string(exe, n) : std::string(argv[0]);
    dir = dir.substr(0, dir.find_last_of('/') + 1);
    f.peer_script = dir + "../bench/torch_peer.py";
  }
  return f;
}

// PyTorch's forward and backward milliseconds for one shape, from bench/torch_peer.py; or
// why there are none.
struct PeerTimes {
  bool ok = false;
  double fwd_ms = 0, bwd_ms = 0;
  std::string why;
};

PeerTimes RunPeer(const Flags& f, const std::string& mask, int dim, int threads) {
  PeerTimes t;
  const std::string cmd = f.peer + " " + f.peer_script + " --tokens=" + std::to_string(f.tokens) +
                          " --heads_q=" + std::to_string(f.heads_q) +
                          " --heads_kv=" + std::to_string(f.heads_kv) +
                          " --dim=" + std::to_string(dim) + " --dtype=" +
                          std::string(f.dtype == DType::kF32   ? "fp32"
                                      : f.dtype == DType::kF16 ? "fp16"
                                                               : "bf16") +
                          " --mask=" + mask + " --threads=" + std::to_string(threads) +
                          " --reps=" + std::to_string(f.reps) + " 2>&1";
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) {
    t.why = "cannot run " + cmd;
    return t;
  }
  bool have_fwd = false, have_bwd = false;
  std::string last;
  char line[1024];
  while (std::fgets(line, sizeof(line), pipe) != nullptr) {
    double ms = 0;
    if (std::sscanf(line, "peer fwd %lf", &ms) == 1) {
      t.fwd_ms = ms;
      have_fwd = true;
    } else if (std::sscanf(line, "peer bwd %lf", &ms) == 1) {
      t.bwd_ms = ms;
      have_bwd = true;
    } else if (line[0] != '\0') {
      last = line;
    }
  }
  const int rc = pclose(pipe);
  t.ok = rc == 0 && have_fwd && have_bwd;
  if (!t.ok) {
    while (!last.empty() && (last.back() == '\n' || last.back() == '\r')) last.pop_back();
    t.why = last.empty() ? cmd + " exited with status " + std::to_string(rc) : last;
  }
  return t;
}

// Causal documents of varied lengths filling `tokens` (a packed training row).
Layout PackedLayout(int64_t tokens) {
  const int64_t lengths[] = {700, 130, 1500, 64, 333, 900, 257, 1200, 40, 512};
  std::vector<int64_t> cu = {0};
  for (int i = 0; cu.back() < tokens; ++i) {
    cu.push_back(std::min(tokens, cu.back() + lengths[i % 10]));
  }
  return *Layout::FromDocuments(cu);
}

struct Buffers {
  std::vector<uint8_t> q, k, v, dout;
  std::vector<float> out, lse, delta, dq, dk, dv;
};

std::vector<uint8_t> Random(std::mt19937_64& rng, size_t n, DType dt) {
  std::normal_distribution<float> normal;
  std::vector<uint8_t> b(n * DTypeSize(dt));
  for (size_t i = 0; i < n; ++i) StoreFromFloat(dt, b.data(), i, normal(rng));
  return b;
}

struct Timing {
  double fwd_s = 0, bwd_s = 0;
  std::vector<float> out, dq;
};

Timing Run(const KernelSet& kernels, const Flags& f, const AttentionDims& dims,
           const WorkList& work, Buffers& b, int threads) {
  const int64_t t = f.tokens;
  Timing r;
  r.fwd_s = r.bwd_s = 1e30;
  for (int rep = 0; rep < f.reps; ++rep) {
    InitPartial(b.out.data(), b.lse.data(), t, dims.heads_q, dims.head_dim);
    ForwardArgs fa;
    fa.dims = dims;
    fa.dtype = f.dtype;
    fa.q = b.q.data();
    fa.q_rows = t;
    fa.k = b.k.data();
    fa.v = b.v.data();
    fa.k_rows = t;
    fa.out = b.out.data();
    fa.lse = b.lse.data();
    absl::Status s;
    r.fwd_s = std::min(r.fwd_s, TimeIt(threads, [&] { s = kernels.Forward(fa, work, threads); }));
    if (!s.ok()) {
      std::fprintf(stderr, "%s forward: %s\n", std::string(kernels.name()).c_str(),
                   std::string(s.message()).c_str());
      std::exit(1);
    }
  }
  r.out = b.out;
  // delta from this forward's output, in fp32 (the kernels take it as an input).
  for (int h = 0; h < dims.heads_q; ++h) {
    for (int64_t i = 0; i < t; ++i) {
      double s = 0;
      for (int d = 0; d < dims.head_dim; ++d) {
        const size_t idx = (i * dims.heads_q + h) * dims.head_dim + d;
        s += LoadAsFloat(f.dtype, b.dout.data(), idx) * b.out[idx];
      }
      b.delta[h * t + i] = static_cast<float>(s);
    }
  }
  for (int rep = 0; rep < f.reps; ++rep) {
    std::fill(b.dq.begin(), b.dq.end(), 0.0f);
    std::fill(b.dk.begin(), b.dk.end(), 0.0f);
    std::fill(b.dv.begin(), b.dv.end(), 0.0f);
    BackwardArgs ba;
    ba.dims = dims;
    ba.dtype = f.dtype;
    ba.q = b.q.data();
    ba.dout = b.dout.data();
    ba.lse = b.lse.data();
    ba.delta = b.delta.data();
    ba.q_rows = t;
    ba.k = b.k.data();
    ba.v = b.v.data();
    ba.k_rows = t;
    ba.dq = b.dq.data();
    ba.dk = b.dk.data();
    ba.dv = b.dv.data();
    absl::Status s;
    r.bwd_s = std::min(r.bwd_s, TimeIt(threads, [&] { s = kernels.Backward(ba, work, threads); }));
    if (!s.ok()) {
      std::fprintf(stderr, "%s backward: %s\n", std::string(kernels.name()).c_str(),
                   std::string(s.message()).c_str());
      std::exit(1);
    }
  }
  r.dq = b.dq;
  return r;
}

// Elements where two results differ by more than a loose tolerance (both are fp32
// computations of the same thing; this catches a broken kernel, not rounding).
int64_t CountWrong(const std::vector<float>& a, const std::vector<float>& b) {
  int64_t wrong = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!(std::abs(a[i] - b[i]) <= 1e-3f * (1.0f + std::abs(b[i])))) ++wrong;
  }
  return wrong;
}

// The machine: CPU, host compiler and the measured FMA peaks (1 thread, f.threads).
struct Peaks {
  double one = 0, all = 0;
};

Peaks PrintMachine(const Flags& f, bool avx512) {
  __builtin_cpu_init();
  const bool bf16dp = avx512 && __builtin_cpu_supports("avx512bf16");

  std::printf(
      "# hsap_kernel_bench: JIT host kernels vs hand-written kernels vs measured FMA peak\n");
  std::printf("# cpu: %s, hardware threads: %d\n", jit::HostArchString().c_str(),
              HardwareThreads());
  auto compiler = jit::FindHostCompiler();
  std::printf("# host JIT compiler: %s\n",
              compiler.ok() ? (compiler->path + " (" + compiler->version + ")").c_str()
                            : std::string(compiler.status().message()).c_str());
  double (*fma)(int64_t) = avx512 ? &FmaChainsAvx512 : &FmaChainsAvx2;
  Peaks peaks;
  peaks.one = PeakGflops(fma, 1);
  peaks.all = PeakGflops(fma, f.threads);
  std::printf(
      "# measured fp32 FMA peak (%s, 16 independent chains): %.1f GFLOP/s on 1 thread, "
      "%.1f on %d threads\n",
      avx512 ? "AVX-512" : "AVX2", peaks.one, peaks.all, f.threads);
  if (bf16dp) {
    std::printf(
        "# measured vdpbf16ps peak: %.1f GFLOP/s on 1 thread, %.1f on %d threads "
        "(not used by these kernels: they compute in fp32)\n",
        PeakGflops(&DpBf16Chains, 1), PeakGflops(&DpBf16Chains, f.threads), f.threads);
  }
  return peaks;
}

// Random inputs (seeded by the head dim) and room for the outputs.
Buffers MakeBuffers(const Flags& f, int dim) {
  std::mt19937_64 rng(dim);
  Buffers b;
  const size_t qn = f.tokens * f.heads_q * dim, kn = f.tokens * f.heads_kv * dim;
  b.q = Random(rng, qn, f.dtype);
  b.k = Random(rng, kn, f.dtype);
  b.v = Random(rng, kn, f.dtype);
  b.dout = Random(rng, qn, f.dtype);
  b.out.resize(qn);
  b.lse.resize(f.heads_q * f.tokens);
  b.delta.resize(b.lse.size());
  b.dq.resize(qn);
  b.dk.resize(kn);
  b.dv.resize(kn);
  return b;
}

// The layout named by --layouts.
Layout LayoutNamed(const std::string& layout_name, int64_t tokens) {
  return layout_name == "causal" ? *Layout::FromDocuments(std::vector<int64_t>{0, tokens})
         : layout_name == "full" ? *Layout::FromDocuments(std::vector<int64_t>{0, tokens},
                                                          std::vector<MaskKind>{MaskKind::kFull})
                                 : PackedLayout(tokens);
}

// PyTorch's figures for one layout, head dim and thread count against ours.
void PrintPeerRows(const Flags& f, const std::string& layout_name, int dim, int threads,
                   const Timing& hand, const Timing& jit) {
  if (layout_name == "packed") {
    std::printf("  # peer: no PyTorch figure for the packed layout (no varlen CPU kernel)\n");
    return;
  }
  const PeerTimes peer = RunPeer(f, layout_name, dim, threads);
  if (!peer.ok) {
    std::printf("  # peer skipped: %s\n", peer.why.c_str());
    return;
  }
  for (int dir = 0; dir < 2; ++dir) {
    const double tm = dir == 0 ? peer.fwd_ms : peer.bwd_ms;
    const double hm = 1e3 * (dir == 0 ? hand.fwd_s : hand.bwd_s);
    const double jm = 1e3 * (dir == 0 ? jit.fwd_s : jit.bwd_s);
    std::printf(
        "  %-7s %5d %4s %7d torch_ms %9.2f  hand_ms %9.2f  torch/hand %5.2fx  jit_ms %9.2f  "
        "torch/jit %5.2fx\n",
        layout_name.c_str(), dim, dir == 0 ? "fwd" : "bwd", threads, tm, hm, tm / hm, jm, tm / jm);
  }
  std::fflush(stdout);
}

// The rows of one head dim: the JIT kernels compiled through `cache` (their compile time
// kept in `compile_times`), then per layout and thread count hand-written against JIT. False
// after saying why the JIT compile failed.
bool BenchHeadDim(const Flags& f, int dim, const Peaks& peaks, jit::CompileCache* cache,
                  std::vector<std::pair<std::string, double>>* compile_times) {
  AttentionDims dims;
  dims.heads_q = f.heads_q;
  dims.heads_kv = f.heads_kv;
  dims.head_dim = dim;
  dims.scale = 1.0f / std::sqrt(static_cast<float>(dim));
  jit::HostKernelSpec spec = jit::HostKernelSpecFor(dims, f.dtype, /*band_masks=*/true);
  const auto c0 = Clock::now();
  auto jit_kernels = jit::GetHostJitKernels(spec, cache);
  if (!jit_kernels.ok()) {
    std::fprintf(stderr, "JIT compile failed: %s\n",
                 std::string(jit_kernels.status().message()).c_str());
    return false;
  }
  compile_times->emplace_back(std::string((*jit_kernels)->name()), Seconds(c0, Clock::now()));
  Buffers b = MakeBuffers(f, dim);
  for (const std::string& layout_name : f.layouts) {
    const Layout layout = LayoutNamed(layout_name, f.tokens);
    const WorkList work = *BuildWorkList(layout, kKernelBlockQ);
    const double pairs = static_cast<double>(layout.VisiblePairs()) * f.heads_q;
    for (int threads : {1, f.threads}) {
      const Timing hand = Run(HandWrittenKernels(), f, dims, work, b, threads);
      const Timing jit = Run(**jit_kernels, f, dims, work, b, threads);
      const double peak = threads == 1 ? peaks.one : peaks.all;
      const int64_t wrong_fwd = CountWrong(jit.out, hand.out);
      const int64_t wrong_bwd = CountWrong(jit.dq, hand.dq);
      for (int dir = 0; dir < 2; ++dir) {
        const double flops = pairs * dim * (dir == 0 ? 4.0 : 10.0);
        const double hs = dir == 0 ? hand.fwd_s : hand.bwd_s;
        const double js = dir == 0 ? jit.fwd_s : jit.bwd_s;
        const double hg = flops / hs / 1e9, jg = flops / js / 1e9;
        std::printf("  %-7s %5d %4s %7d %13.0f %10.2f %10.1f %10.2f %10.1f %7.2fx %7.1f%% %7lld\n",
                    layout_name.c_str(), dim, dir == 0 ? "fwd" : "bwd", threads, pairs, hs * 1e3,
                    hg, js * 1e3, jg, jg / hg, 100.0 * jg / peak,
                    static_cast<long long>(dir == 0 ? wrong_fwd : wrong_bwd));
        std::fflush(stdout);
      }
      if (f.peer.empty()) continue;
      PrintPeerRows(f, layout_name, dim, threads, hand, jit);
    }
  }
  return true;
}

// Cache behaviour: the same specs again, from a second cache object on the directory (a
// new process) and then from this one (memory). False when a compile fails.
bool ReportHostCache(const Flags& f, const jit::CompileCache& cache,
                     const jit::CompileCache::Options& copts,
                     const std::vector<std::pair<std::string, double>>& compile_times) {
  const jit::CacheStats cold = cache.stats();
  jit::CompileCache second(copts);
  for (int pass = 0; pass < 2; ++pass) {
    for (int dim : f.dims) {
      AttentionDims dims;
      dims.heads_q = f.heads_q;
      dims.heads_kv = f.heads_kv;
      dims.head_dim = dim;
      dims.scale = 1.0f;
      auto k = jit::CompileHostJitKernelsUnchecked(
          jit::HostKernelSpecFor(dims, f.dtype, /*band_masks=*/true), second);
      if (!k.ok()) return false;
    }
  }
  const jit::CacheStats warm = second.stats();
  std::printf("#\n# host JIT compile (clang++ subprocess + dlopen), cold cache:\n");
  for (const auto& [name, s] : compile_times) {
    std::printf("#   %-40s %6.2f s\n", name.c_str(), s);
  }
  std::printf("# host cache, first process: %lld lookups, %lld compiles, hit rate %.0f%%\n",
              static_cast<long long>(cold.lookups()), static_cast<long long>(cold.compiles),
              100 * cold.hit_rate());
  std::printf(
      "# host cache, second process (2 passes): %lld lookups, %lld disk hits, %lld "
      "memory hits, %lld compiles, hit rate %.0f%%\n",
      static_cast<long long>(warm.lookups()), static_cast<long long>(warm.disk_hits),
      static_cast<long long>(warm.memory_hits), static_cast<long long>(warm.compiles),
      100 * warm.hit_rate());
  return true;
}

// NVRTC: each shipped CUDA variant, cold, then again from the cache (in `dir`).
void ReportNvrtc(const Flags& f, const std::string& dir) {
  if (f.nvrtc_limit < 0) {
    std::printf("#\n# NVRTC column skipped (--nvrtc_limit=-1)\n");
    return;
  }
  std::vector<jit::CudaKernelConfig> configs = jit::ShippedCudaConfigs(f.nvrtc_arch);
  if (f.nvrtc_limit > 0 && static_cast<int>(configs.size()) > f.nvrtc_limit) {
    configs.resize(f.nvrtc_limit);
  }
  jit::CompileCache::Options nopts;
  nopts.dir = dir + "/nvrtc-cache";
  jit::CompileCache ncache(nopts);
  std::printf("#\n# NVRTC compile per shipped variant (%s, cold cache):\n", f.nvrtc_arch.c_str());
  double total = 0, worst = 0;
  for (const jit::CudaKernelConfig& c : configs) {
    auto compiled = jit::CompileCudaKernels(c, &ncache);
    if (!compiled.ok()) {
      std::printf("#   NVRTC unavailable or failed: %s\n",
                  std::string(compiled.status().message()).substr(0, 300).c_str());
      break;
    }
    const double s = compiled->binary.compile_seconds;
    total += s;
    worst = std::max(worst, s);
    std::printf("#   %-40s %6.2f s  %s %zu bytes\n", c.Name().c_str(), s,
                compiled->binary.target.c_str(), compiled->binary.image.size());
  }
  ncache.ResetStats();
  for (const jit::CudaKernelConfig& c : configs) (void)jit::CompileCudaKernels(c, &ncache);
  const jit::CacheStats ns = ncache.stats();
  std::printf(
      "# NVRTC total %.2f s, worst %.2f s; second pass: %lld lookups, %lld compiles, "
      "hit rate %.0f%%\n",
      total, worst, static_cast<long long>(ns.lookups()), static_cast<long long>(ns.compiles),
      100 * ns.hit_rate());
}

}  // namespace
}  // namespace hsap

int main(int argc, char** argv) {
  using namespace hsap;
  const Flags f = ParseFlags(argc, argv);
  const bool avx512 = jit::HostHasAvx512();
  const Peaks peaks = PrintMachine(f, avx512);

  // JIT compiles through a private cache: cold pass, then a "second process" on the same
  // directory, then the same process again.
  char dir_template[] = "/tmp/hsap-kernel-bench.XXXXXX";
  const std::string cache_dir = std::string(mkdtemp(dir_template)) + "/cache";
  jit::CompileCache::Options copts;
  copts.dir = cache_dir;
  jit::CompileCache cache(copts);
  std::printf("# dtype %s, tokens %lld, heads_q %d, heads_kv %d, best of %d runs\n#\n",
              std::string(DTypeName(f.dtype)).c_str(), static_cast<long long>(f.tokens), f.heads_q,
              f.heads_kv, f.reps);
  std::printf("# %-7s %5s %4s %7s %13s %10s %10s %10s %10s %8s %8s %7s\n", "layout", "hdim", "dir",
              "threads", "visible_pairs", "hand_ms", "hand_GF/s", "jit_ms", "jit_GF/s", "jit/hand",
              "jit/peak", "#wrong");

  std::vector<std::pair<std::string, double>> compile_times;
  for (int dim : f.dims) {
    if (!BenchHeadDim(f, dim, peaks, &cache, &compile_times)) return 1;
  }
  if (!ReportHostCache(f, cache, copts, compile_times)) return 1;
  ReportNvrtc(f, std::string(dir_template));
  return 0;
}
