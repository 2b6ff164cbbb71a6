// The host JIT compiler: generated C++ -> shared object (in a subprocess) -> dlopen.
//
// The compiler is, in order: $HSAP_HOST_CXX, the first clang++ (or clang++-NN, newest
// first) on $PATH, then the C++ compiler the library was built with (HSAP_CXX_COMPILER).
// It runs as a child process (no shell; arguments passed as a vector), so LLVM is never
// loaded into the calling process. Options: -O3 -march=native -shared -fPIC and
// floating-point flags that keep infinities (masked scores are -inf): -ffp-contract=fast
// -fno-math-errno -fno-trapping-math, never -ffinite-math-only.
//
// Shared objects go through the compile cache (jit/cache.h) as bytes and are loaded from an
// anonymous memory file (memfd_create + dlopen of /proc/self/fd/N, RTLD_NOW|RTLD_LOCAL;
// the descriptor stays open while the module is loaded, because dlopen identifies modules
// by path), falling back to a uniquely named temporary file that is unlinked right after
// dlopen. Nothing is left on disk except the cache entry.
//
// A failed compile returns CompileError (jit/compile_error.h -> hsapCompileError) whose message
// holds the compiler's command, its full output and the path of the kept source. A compile
// past its time limit is killed (with its children) and returns Unavailable, the code of a
// missing compiler: the environment's fault, not the source's, so callers fall back.
#ifndef HSAP_JIT_HOST_COMPILER_H_
#define HSAP_JIT_HOST_COMPILER_H_

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "jit/cache.h"

namespace hsap::jit {

struct HostCompilerInfo {
  std::string path;     // what is executed
  std::string version;  // first line of `path --version`
  bool is_clang = false;
};

// The compiler described above (found once per process; errors if none runs).
absl::StatusOr<HostCompilerInfo> FindHostCompiler();

// The host CPU, exactly enough for -march=native code: vendor, family/model/stepping and
// the ISA extensions the kernels care about, e.g. "AuthenticAMD 26/68/0 avx512f avx512bw
// avx512vl avx512bf16 avx2 fma f16c". Part of every host cache key.
const std::string& HostArchString();
// Whether this CPU runs the AVX-512 kernel variant (F, BW, VL, DQ), else AVX2+FMA+F16C.
bool HostHasAvx512();
bool HostHasAvx2Fma();

// A dlopen()ed shared object; dlclose() on destruction.
class HostModule {
 public:
  ~HostModule();
  HostModule(const HostModule&) = delete;
  HostModule& operator=(const HostModule&) = delete;

  // The address of exported symbol `name`, or NotFound.
  absl::StatusOr<void*> Symbol(const char* name) const;
  const std::string& cache_entry_name() const { return entry_name_; }

 private:
  friend absl::StatusOr<std::shared_ptr<HostModule>> LoadHostModule(absl::string_view, std::string);
  HostModule(void* handle, int fd, std::string entry_name)
      : handle_(handle), fd_(fd), entry_name_(std::move(entry_name)) {}
  void* handle_;
  int fd_;  // the memfd the module was loaded from, or -1
  std::string entry_name_;
};

// Loads shared-object bytes (RTLD_NOW | RTLD_LOCAL).
absl::StatusOr<std::shared_ptr<HostModule>> LoadHostModule(absl::string_view so_bytes,
                                                           std::string entry_name);

struct HostSource {
  std::string code;  // the translation unit
  // Headers it includes by name (#include "name"); written next to it for the compile.
  std::vector<std::pair<std::string, std::string>> headers;
  std::vector<std::string> extra_options;  // appended to the standard options
  // Time limit of the compile; unset: HSAP_JIT_COMPILE_TIMEOUT_MS (base/params.h).
  std::optional<absl::Duration> timeout;
};

// Compiles (or finds in `cache`) and loads `source`.
absl::StatusOr<std::shared_ptr<HostModule>> CompileHostModule(const HostSource& source,
                                                              CompileCache& cache);

// The options CompileHostModule passes before extra_options (for tests and the bench).
std::vector<std::string> StandardHostOptions(const HostCompilerInfo& compiler);

}  // namespace hsap::jit

#endif  // HSAP_JIT_HOST_COMPILER_H_
