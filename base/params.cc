#include "base/params.h"

#include <array>
#include <cstdlib>
#include <utility>

#include "absl/base/const_init.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace hsap {
namespace {

constexpr ParamInfo kParams[] = {
    {Param::kTimeoutMs, "HSAP_TIMEOUT_MS", "300000",
     "default deadline of every wait on a peer, in milliseconds (a positive integer)"},
    {Param::kCacheDir, "HSAP_CACHE_DIR", "",
     "JIT cache directory, absolute (else $XDG_CACHE_HOME/hsap, else ~/.cache/hsap)"},
    {Param::kJitDisableCache, "HSAP_JIT_DISABLE_CACHE", "0",
     "a boolean: 1 compiles every JIT kernel, bypassing the cache"},
    {Param::kJitDump, "HSAP_JIT_DUMP", "", "directory that keeps every generated kernel source"},
    {Param::kJitCompileTimeoutMs, "HSAP_JIT_COMPILE_TIMEOUT_MS", "60000",
     "time limit of one JIT host kernel compile, in milliseconds (a positive integer); past it "
     "the hand-written kernels run"},
    {Param::kHostKernels, "HSAP_HOST_KERNELS", "jit",
     "host kernels of a batch: jit (default) or handwritten"},
    {Param::kHostCxx, "HSAP_HOST_CXX", "",
     "compiler of the JIT host kernels (default: newest clang++, else the build's compiler)"},
    {Param::kNvrtcPath, "HSAP_NVRTC_PATH", "",
     "colon-separated directories searched for libnvrtc, instead of the defaults"},
    {Param::kCudaLibPath, "HSAP_CUDA_LIB_PATH", "",
     "colon-separated directories searched for the CUDA and NCCL libraries, instead of the "
     "defaults"},
    {Param::kFusedForward, "HSAP_FUSED_FORWARD", "1",
     "a boolean: 0 makes CUDA batches move forward's K/V in transfer stages, not peer windows; "
     "loopback ranks (several on one GPU) use stages unless it is set to 1"},
    {Param::kPlanDebug, "HSAP_PLAN_DEBUG", "0",
     "a boolean: 1 prints every simulated planner candidate to stderr"},
    {Param::kAttentionEngine, "HSAP_ATTENTION_ENGINE", "auto",
     "engine of CUDA batches' attention pieces: auto (per piece the faster of cuDNN and the JIT "
     "kernels by the calibration of the device's kind, $HSAP_CALIBRATION; cuDNN wherever it can "
     "run a piece when the kind has no figures for both; else the JIT kernels), cudnn (cuDNN "
     "wherever it can run a piece, an error where it cannot run the batch) or jit"},
    {Param::kJitSm90a, "HSAP_JIT_SM90A", "0",
     "a boolean: 1 compiles the JIT kernels of compute capability 9.0 GPUs for sm_90a, whose "
     "forward is the wgmma/TMA one (opt-in until it has run on a GPU); 0 keeps the sm_90 "
     "kernels (mma.sync forward)"},
    {Param::kCalibration, "HSAP_CALIBRATION", "",
     "a calibration file (hsap_attn_perf --calibration-out) laid over the built-in figures, "
     "which the auto attention engine chooses by; empty: the built-in figures"},
    {Param::kCudaHome, "CUDA_HOME", "", "CUDA toolkit root, searched for NVRTC and CUDA libraries"},
    {Param::kPath, "PATH", "", "searched for clang++ (the JIT host compiler)"},
    {Param::kHome, "HOME", "", "the JIT cache defaults to ~/.cache/hsap"},
    {Param::kXdgCacheHome, "XDG_CACHE_HOME", "", "the JIT cache defaults to $XDG_CACHE_HOME/hsap"},
    {Param::kTmpDir, "TMPDIR", "", "temporary files of JIT compiles (else /tmp)"},
    {Param::kNcclHostId, "NCCL_HOSTID", "",
     "replaces hostname + boot id as the host identity CUDA communicators find nodes by, as "
     "it does for NCCL"},
};
constexpr size_t kNumParams = sizeof(kParams) / sizeof(kParams[0]);

constexpr bool TableFollowsEnum() {
  for (size_t i = 0; i < kNumParams; ++i) {
    if (static_cast<size_t>(kParams[i].param) != i) return false;
  }
  return true;
}
static_assert(TableFollowsEnum(), "kParams must list the Params in enum order");

using Values = std::array<std::optional<std::string>, kNumParams>;

ABSL_CONST_INIT absl::Mutex g_mu(absl::kConstInit);
Values* g_values ABSL_GUARDED_BY(g_mu) = nullptr;  // read on first use, never freed

Values ReadEnvironment() {
  Values values;
  for (size_t i = 0; i < kNumParams; ++i) {
    if (const char* v = std::getenv(kParams[i].name); v != nullptr) values[i] = v;
  }
  return values;
}

absl::Status ParseError(const ParamInfo& info, const std::string& value, const char* accepted) {
  return absl::InvalidArgumentError(absl::StrCat(
      "$", info.name, " = '", value, "' is not ", accepted, "; unset it for the default (",
      info.default_value, "). ", info.name, ": ", info.meaning));
}

}  // namespace

absl::Span<const ParamInfo> AllParams() { return kParams; }

const ParamInfo& DescribeParam(Param param) { return kParams[static_cast<size_t>(param)]; }

std::optional<std::string> GetParam(Param param) {
  {
    absl::ReaderMutexLock lock(&g_mu);
    if (g_values != nullptr) return (*g_values)[static_cast<size_t>(param)];
  }
  absl::MutexLock lock(&g_mu);
  if (g_values == nullptr) g_values = new Values(ReadEnvironment());
  return (*g_values)[static_cast<size_t>(param)];
}

std::string GetStringParam(Param param) {
  std::optional<std::string> value = GetParam(param);
  if (!value.has_value() || value->empty()) return DescribeParam(param).default_value;
  return *std::move(value);
}

absl::StatusOr<bool> GetBoolParam(Param param) {
  const ParamInfo& info = DescribeParam(param);
  const std::string value = GetParam(param).value_or(info.default_value);
  const std::string lower = absl::AsciiStrToLower(value);
  if (lower == "1" || lower == "true" || lower == "yes" || lower == "on") return true;
  if (lower == "0" || lower == "false" || lower == "no" || lower == "off") return false;
  return ParseError(info, value, "a boolean (1/true/yes/on or 0/false/no/off)");
}

absl::StatusOr<int64_t> GetInt64Param(Param param) {
  const ParamInfo& info = DescribeParam(param);
  const std::string value = GetParam(param).value_or(info.default_value);
  int64_t parsed = 0;
  if (!absl::SimpleAtoi(value, &parsed)) {
    return ParseError(info, value, "an integer (decimal, 64-bit)");
  }
  return parsed;
}

void ReloadParamsForTesting() {
  Values fresh = ReadEnvironment();
  absl::MutexLock lock(&g_mu);
  if (g_values == nullptr) {
    g_values = new Values(std::move(fresh));
  } else {
    *g_values = std::move(fresh);
  }
}

}  // namespace hsap
