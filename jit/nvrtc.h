// NVRTC, loaded at run time, and the CUDA compiler built on it.
//
// Loading. libhsap never links CUDA libraries: NVRTC is dlopen()ed on first use. The search
// is, in order: every directory of $HSAP_NVRTC_PATH (colon-separated) when that variable is
// set -- and then nothing else, so tests can simulate a machine without NVRTC by pointing it
// at an empty directory --; otherwise $CUDA_HOME/lib64, /usr/local/cuda/lib64, then the
// default loader path. In each place the names libnvrtc.so.13, libnvrtc.so.12, libnvrtc.so
// are tried. Missing NVRTC is absl::UnimplementedError (hsapUnsupported at the C ABI).
//
// Compiling. CompileCuda() compiles one translation unit with in-memory headers:
//   - to a cubin for the exact architecture ("sm_80" -> --gpu-architecture=sm_80) when this
//     NVRTC supports it (nvrtcGetSupportedArchs);
//   - to PTX for the closest lower virtual architecture ("compute_XX") when the
//     architecture is unknown to this NVRTC or when PTX is asked for; the driver JITs it.
// Name expressions (e.g. "hsap_dev::attn_fwd_kernel<Cfg>") are registered before the
// compile and their lowered (mangled) names returned with the binary. A failed compile is
// CompileError (jit/compile_error.h, hsapCompileError) whose message holds the full NVRTC log and
// the path where the generated source was kept. Every compile is timed.
//
// Caching. Binaries go through jit/cache.h (kind "cubin"/"ptx"), keyed by the source, the
// name and content of every header, all options, the target, the NVRTC version and (by the
// cache itself) the library version. The cached payload also holds the lowered names.
#ifndef HSAP_JIT_NVRTC_H_
#define HSAP_JIT_NVRTC_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace hsap::jit {

class CompileCache;

// The process' NVRTC. Function pointers of the C API we use (types declared here, so no
// CUDA header is needed to build libhsap).
struct NvrtcApi {
  using Program = struct _nvrtcProgram*;
  using Result = int;  // nvrtcResult; 0 is NVRTC_SUCCESS

  std::string path;  // the file that was loaded
  int major = 0, minor = 0;
  std::vector<int> supported_archs;  // e.g. {75, 80, 86, 89, 90, 100, ...}

  const char* (*GetErrorString)(Result) = nullptr;
  Result (*Version)(int*, int*) = nullptr;
  Result (*GetNumSupportedArchs)(int*) = nullptr;
  Result (*GetSupportedArchs)(int*) = nullptr;
  Result (*CreateProgram)(Program*, const char*, const char*, int, const char* const*,
                          const char* const*) = nullptr;
  Result (*DestroyProgram)(Program*) = nullptr;
  Result (*CompileProgram)(Program, int, const char* const*) = nullptr;
  Result (*GetPTXSize)(Program, size_t*) = nullptr;
  Result (*GetPTX)(Program, char*) = nullptr;
  Result (*GetCUBINSize)(Program, size_t*) = nullptr;
  Result (*GetCUBIN)(Program, char*) = nullptr;
  Result (*GetProgramLogSize)(Program, size_t*) = nullptr;
  Result (*GetProgramLog)(Program, char*) = nullptr;
  Result (*AddNameExpression)(Program, const char*) = nullptr;
  Result (*GetLoweredName)(Program, const char*, const char**) = nullptr;

  // "nvrtc 13.0 (<path>)": the compiler identity used in cache keys.
  std::string Identity() const;
  bool SupportsCubin(int arch) const;
};

// The NVRTC found by the search above (loaded once per distinct search path, never
// unloaded). UnimplementedError when none is found, naming the places searched.
absl::StatusOr<const NvrtcApi*> LoadNvrtc();

// "sm_90" -> 90, "sm_80" -> 80, "compute_75" -> 75, "sm_90a" -> 90; InvalidArgument otherwise.
// The "a" suffix names the architecture-specific target (sm_90a: wgmma, setmaxnreg, ...),
// whose code runs on that exact architecture only (IsArchSpecificTarget).
absl::StatusOr<int> ParseCudaArch(absl::string_view arch);
// True for "sm_90a" / "compute_90a" (ParseCudaArch must accept `arch`).
bool IsArchSpecificTarget(absl::string_view arch);

struct CudaCompileRequest {
  std::string program_name = "hsap_kernels.cu";  // shown in logs
  std::string source;
  // (include name, content) of every header the source includes; NVRTC sees only these
  // (no include directory is searched).
  std::vector<std::pair<std::string, std::string>> headers;
  std::string arch;        // "sm_80", "sm_90", "sm_90a" (arch-specific: never a lower fallback)
  bool force_ptx = false;  // PTX even when a cubin for `arch` could be built
  std::vector<std::string> name_expressions;
  std::vector<std::string> extra_options;  // appended to the default options
};

struct CudaBinary {
  enum class Kind { kCubin, kPtx };
  Kind kind = Kind::kCubin;
  std::string target;  // "sm_90" for a cubin, "compute_90" for PTX
  std::string image;   // ELF cubin or NUL-free PTX text
  std::vector<std::pair<std::string, std::string>> lowered_names;  // expression -> symbol
  std::string log;                 // NVRTC's log (warnings), possibly empty
  double compile_seconds = 0;      // wall time of the NVRTC compile; 0 when served by the cache
  double compile_cpu_seconds = 0;  // CPU time of the compiling thread (NVRTC runs in it)
  bool from_cache = false;

  absl::StatusOr<std::string> LoweredName(absl::string_view expression) const;
};

// The default options for `target` ("--gpu-architecture=sm_90", "-std=c++17", ...).
std::vector<std::string> DefaultNvrtcOptions(absl::string_view target);

// Compiles `request` (through `cache` unless it is null; CompileCache::Global() is the
// usual argument). Errors: Unimplemented (no NVRTC, or an architecture below every
// supported one, or an arch-specific "sm_XXa" this NVRTC does not know: its code cannot
// come from a lower architecture), InvalidArgument (bad arch string), CompileError (log +
// source path).
absl::StatusOr<CudaBinary> CompileCuda(const CudaCompileRequest& request, CompileCache* cache);

// ---- ELF64 symbol table (to check that a cubin defines the kernels we look up) ----

struct ElfSymbol {
  std::string name;
  int type = 0;     // STT_* (2 = function)
  int binding = 0;  // STB_* (1 = global)
  uint16_t section = 0;
  uint64_t size = 0;
};

// Symbols of the .symtab of a little-endian ELF64 image. Every offset is bounds-checked: a
// truncated or malformed image is InvalidArgument, never a crash.
absl::StatusOr<std::vector<ElfSymbol>> ReadElfSymbols(absl::string_view image);

}  // namespace hsap::jit

#endif  // HSAP_JIT_NVRTC_H_
