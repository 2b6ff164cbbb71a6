// Every environment variable hsap reads, in one table (in the manner of NCCL's parameters).
//
// The environment is read once per process, on the first call of any accessor below (thread
// safe); later changes to it are not seen. A program that sets an hsap variable itself must
// do so before its first hsap call. base/params.cc is the only file of the library and the
// benches that calls getenv (tests/base/params_test.cc checks it, and that README.md's
// "### Environment" table lists exactly the HSAP_* variables of the table).
//
// Typed accessors report a value that does not parse as InvalidArgument naming the variable,
// its value, what it accepts and its meaning; they never fall back silently. A variable
// set to the empty string is set: the string accessors return "", the typed ones an error.
#ifndef HSAP_BASE_PARAMS_H_
#define HSAP_BASE_PARAMS_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace hsap {

enum class Param {
  // hsap's own variables.
  kTimeoutMs,            // HSAP_TIMEOUT_MS
  kCacheDir,             // HSAP_CACHE_DIR
  kJitDisableCache,      // HSAP_JIT_DISABLE_CACHE
  kJitDump,              // HSAP_JIT_DUMP
  kJitCompileTimeoutMs,  // HSAP_JIT_COMPILE_TIMEOUT_MS
  kHostKernels,          // HSAP_HOST_KERNELS
  kHostCxx,              // HSAP_HOST_CXX
  kNvrtcPath,            // HSAP_NVRTC_PATH
  kCudaLibPath,          // HSAP_CUDA_LIB_PATH
  kFusedForward,         // HSAP_FUSED_FORWARD
  kPlanDebug,            // HSAP_PLAN_DEBUG
  kAttentionEngine,      // HSAP_ATTENTION_ENGINE
  kJitSm90a,             // HSAP_JIT_SM90A
  kCalibration,          // HSAP_CALIBRATION
  // Standard variables hsap consults.
  kCudaHome,      // CUDA_HOME
  kPath,          // PATH
  kHome,          // HOME
  kXdgCacheHome,  // XDG_CACHE_HOME
  kTmpDir,        // TMPDIR
  kNcclHostId,    // NCCL_HOSTID
};

struct ParamInfo {
  Param param;
  const char* name;           // the environment variable
  const char* default_value;  // what the typed accessors return when it is unset
  const char* meaning;        // one line, for error messages and documentation
};

// The whole table, in the order of `Param`.
absl::Span<const ParamInfo> AllParams();
const ParamInfo& DescribeParam(Param param);

// The raw value, or nullopt when the variable is unset. For variables where "set but empty"
// means something (HSAP_NVRTC_PATH="" searches nowhere).
std::optional<std::string> GetParam(Param param);

// The value when set and non-empty, else the default.
std::string GetStringParam(Param param);

// 1/true/yes/on or 0/false/no/off (any case); the default when unset.
absl::StatusOr<bool> GetBoolParam(Param param);

// A decimal integer that fits int64; the default when unset.
absl::StatusOr<int64_t> GetInt64Param(Param param);

// Reads the environment again. Tests only (tests/support/scoped_env.h calls it on every
// change); not safe while another thread calls setenv.
void ReloadParamsForTesting();

}  // namespace hsap

#endif  // HSAP_BASE_PARAMS_H_
