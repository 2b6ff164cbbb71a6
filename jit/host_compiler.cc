#include "jit/host_compiler.h"

#include <cpuid.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/params.h"
#include "base/status_macros.h"
#include "jit/compile_error.h"
#include "jit/subprocess.h"

#ifndef HSAP_CXX_COMPILER
#define HSAP_CXX_COMPILER "c++"
#endif

namespace hsap::jit {
namespace {

bool IsExecutable(const std::string& path) {
  return !path.empty() && access(path.c_str(), X_OK) == 0;
}

// Candidate clang++ executables on $PATH: clang++ first, then clang++-NN newest first.
std::vector<std::string> ClangCandidates() {
  std::vector<std::string> found;
  const std::string path_env = GetStringParam(Param::kPath);
  std::vector<std::pair<int, std::string>> versioned;
  for (absl::string_view dir : absl::StrSplit(path_env, ':', absl::SkipEmpty())) {
    const std::string plain = absl::StrCat(dir, "/clang++");
    if (IsExecutable(plain)) found.push_back(plain);
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(std::string(dir), ec)) {
      const std::string name = e.path().filename().string();
      if (name.rfind("clang++-", 0) != 0) continue;
      const int v = std::atoi(name.c_str() + 8);
      if (v > 0 && IsExecutable(e.path().string())) versioned.emplace_back(v, e.path().string());
    }
  }
  std::sort(versioned.begin(), versioned.end(),
            [](const auto& a, const auto& b) { return a.first > b.first; });
  for (auto& [v, p] : versioned) found.push_back(p);
  return found;
}

absl::StatusOr<HostCompilerInfo> Probe(const std::string& path) {
  auto run = RunProcess({path, "--version"}, absl::Seconds(30));
  if (!run.ok()) return run.status();
  if (run->exit_code != 0) {
    return absl::UnavailableError(absl::StrCat(path, " --version failed: ", run->output));
  }
  HostCompilerInfo info;
  info.path = path;
  info.version = std::string(absl::StripAsciiWhitespace(
      std::vector<std::string>(absl::StrSplit(run->output, '\n')).front()));
  info.is_clang = run->output.find("clang") != std::string::npos;
  return info;
}

absl::StatusOr<HostCompilerInfo> FindHostCompilerUncached() {
  std::vector<std::string> candidates;
  if (std::string chosen = GetStringParam(Param::kHostCxx); !chosen.empty()) {
    candidates.push_back(std::move(chosen));  // an explicit choice is the only candidate
  } else {
    candidates = ClangCandidates();
    candidates.push_back(HSAP_CXX_COMPILER);
  }
  std::string errors;
  for (const std::string& c : candidates) {
    auto info = Probe(c);
    if (info.ok()) return info;
    absl::StrAppend(&errors, "\n  ", c, ": ", info.status().message());
  }
  return absl::UnavailableError(absl::StrCat(
      "no working host C++ compiler for the JIT (install clang++ or set HSAP_HOST_CXX); tried:",
      errors));
}

std::string CpuString() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  char vendor[13] = {0};
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx)) {
    std::memcpy(vendor, &ebx, 4);
    std::memcpy(vendor + 4, &edx, 4);
    std::memcpy(vendor + 8, &ecx, 4);
  }
  unsigned family = 0, model = 0, stepping = 0;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx)) {
    const unsigned base_family = (eax >> 8) & 0xf;
    family = base_family == 0xf ? base_family + ((eax >> 20) & 0xff) : base_family;
    model = ((eax >> 4) & 0xf) |
            ((base_family == 0x6 || base_family == 0xf) ? ((eax >> 16) & 0xf) << 4 : 0);
    stepping = eax & 0xf;
  }
  std::string s = absl::StrCat(vendor, " ", family, "/", model, "/", stepping);
  __builtin_cpu_init();
#define HSAP_FEATURE(name) \
  if (__builtin_cpu_supports(name)) absl::StrAppend(&s, " ", name);
  HSAP_FEATURE("avx512f")
  HSAP_FEATURE("avx512bw")
  HSAP_FEATURE("avx512vl")
  HSAP_FEATURE("avx512dq")
  HSAP_FEATURE("avx512bf16")
  HSAP_FEATURE("avx512vnni")
  HSAP_FEATURE("avx512fp16")
  HSAP_FEATURE("avx2")
  HSAP_FEATURE("fma")
  HSAP_FEATURE("f16c")
#undef HSAP_FEATURE
  return s;
}

// Writes `data` to a new file at `path` (mode 0600).
absl::Status WriteNewFile(const std::string& path, absl::string_view data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(data.data(), static_cast<std::streamsize>(data.size()));
  out.close();
  if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadFileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::UnavailableError(absl::StrCat("cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string TempRoot() {
  const std::string tmp = GetStringParam(Param::kTmpDir);
  return (!tmp.empty() && tmp[0] == '/') ? tmp : "/tmp";
}

// Compiles in a private temporary directory, returns the .so bytes.
absl::StatusOr<std::string> RunCompile(const HostCompilerInfo& compiler, const HostSource& src,
                                       const std::vector<std::string>& options, const CacheKey& key,
                                       const CompileCache& cache) {
  std::string dir_template = TempRoot() + "/hsap-jit.XXXXXX";
  if (mkdtemp(dir_template.data()) == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot create a temporary directory under ",
                                               TempRoot(), ": ", std::strerror(errno)));
  }
  const std::string dir = dir_template;
  struct Cleanup {
    std::string dir;
    ~Cleanup() {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
  } cleanup{dir};

  const std::string source_path = dir + "/kernel.cc";
  const std::string so_path = dir + "/kernel.so";
  HSAP_RETURN_IF_ERROR(WriteNewFile(source_path, src.code));
  for (const auto& [name, content] : src.headers) {
    if (name.find('/') != std::string::npos || name.find("..") != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat("header name must be plain: ", name));
    }
    HSAP_RETURN_IF_ERROR(WriteNewFile(dir + "/" + name, content));
  }
  std::vector<std::string> argv = {compiler.path};
  argv.insert(argv.end(), options.begin(), options.end());
  argv.insert(argv.end(), {"-I", dir, "-o", so_path, source_path});
  absl::Duration timeout;
  if (src.timeout.has_value()) {
    timeout = *src.timeout;
  } else {
    HSAP_ASSIGN_OR_RETURN(const int64_t ms, GetInt64Param(Param::kJitCompileTimeoutMs));
    if (ms <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("HSAP_JIT_COMPILE_TIMEOUT_MS is ", ms, "; it must be a positive integer"));
    }
    timeout = absl::Milliseconds(ms);
  }
  HSAP_ASSIGN_OR_RETURN(const ProcessResult run, RunProcess(argv, timeout));
  if (run.timed_out || run.exit_code != 0 || run.signal != 0) {
    absl::StatusOr<std::string> kept = cache.KeepSource(key);
    const std::string where =
        kept.ok() ? *kept : absl::StrCat("(source not kept: ", kept.status().message(), ")");
    if (run.timed_out) {
      return absl::UnavailableError(
          absl::StrCat("host JIT compile timed out after ", absl::FormatDuration(timeout),
                       " (HSAP_JIT_COMPILE_TIMEOUT_MS) and was killed; source kept at ", where,
                       "\ncommand: ", absl::StrJoin(argv, " ")));
    }
    const std::string why = run.signal != 0 ? absl::StrCat("killed by signal ", run.signal)
                                            : absl::StrCat("exit code ", run.exit_code);
    return CompileError(absl::StrCat("host JIT compile failed (", why, "); source kept at ", where,
                                     "\ncommand: ", absl::StrJoin(argv, " "),
                                     "\ncompiler output:\n", run.output));
  }
  return ReadFileBytes(so_path);
}

}  // namespace

absl::StatusOr<HostCompilerInfo> FindHostCompiler() {
  static const absl::StatusOr<HostCompilerInfo>* const info =
      new absl::StatusOr<HostCompilerInfo>(FindHostCompilerUncached());
  return *info;
}

const std::string& HostArchString() {
  static const std::string* const s = new std::string(CpuString());
  return *s;
}

bool HostHasAvx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

bool HostHasAvx2Fma() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}

std::vector<std::string> StandardHostOptions(const HostCompilerInfo& compiler) {
  std::vector<std::string> o = {"-std=c++17",
                                "-O3",
                                "-march=native",
                                "-shared",
                                "-fPIC",
                                "-fvisibility=hidden",
                                "-ffp-contract=fast",
                                "-fno-math-errno",
                                "-fno-trapping-math",
                                "-fno-finite-math-only",
                                "-fno-exceptions",
                                "-fno-rtti",
                                "-w"};
  return o;
}

HostModule::~HostModule() {
  if (handle_ != nullptr) dlclose(handle_);
  if (fd_ >= 0) close(fd_);
}

absl::StatusOr<void*> HostModule::Symbol(const char* name) const {
  dlerror();
  void* p = dlsym(handle_, name);
  if (p == nullptr) {
    const char* err = dlerror();
    return absl::NotFoundError(absl::StrCat("symbol ", name, " not found in JIT module ",
                                            entry_name_, err != nullptr ? ": " : "",
                                            err != nullptr ? err : ""));
  }
  return p;
}

absl::StatusOr<std::shared_ptr<HostModule>> LoadHostModule(absl::string_view so_bytes,
                                                           std::string entry_name) {
  auto write_all = [&](int fd) -> bool {
    const char* p = so_bytes.data();
    size_t left = so_bytes.size();
    while (left > 0) {
      const ssize_t n = write(fd, p, left);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      p += n;
      left -= static_cast<size_t>(n);
    }
    return true;
  };
  // dlopen() returns an already-loaded object whose name matches, so a path must never be
  // reused while an earlier module loaded from it is still mapped: RTLD_NOLOAD tells.
  auto name_in_use = [](const std::string& path) {
    void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
    if (h == nullptr) return false;
    dlclose(h);
    return true;
  };
  void* handle = nullptr;
  int kept_fd = -1;
  std::string error;
  const int memfd = memfd_create("hsap-jit", MFD_CLOEXEC);
  if (memfd >= 0) {
    const std::string path = absl::StrCat("/proc/self/fd/", memfd);
    if (write_all(memfd) && !name_in_use(path)) {
      handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (handle == nullptr) error = dlerror();
    }
    // The module keeps the descriptor until dlclose, so that its number (and with it the
    // name dlopen knows the module by) is not handed to another module meanwhile.
    if (handle != nullptr) {
      kept_fd = memfd;
    } else {
      close(memfd);
    }
  }
  if (handle == nullptr) {
    // No memfd (old kernel, seccomp), no /proc, or a name clash: a uniquely named
    // temporary file, unlinked once loaded.
    std::string path = TempRoot() + "/hsap-jit-XXXXXX.so";
    const int fd = mkstemps(path.data(), 3);
    if (fd < 0) {
      return absl::UnavailableError(
          absl::StrCat("cannot create a file to load the JIT module: ", std::strerror(errno),
                       error.empty() ? "" : "; dlopen of memfd: ", error));
    }
    const bool written = write_all(fd);
    close(fd);
    if (written) {
      handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (handle == nullptr) error = dlerror();
    }
    unlink(path.c_str());
  }
  if (handle == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot load the JIT module ", entry_name, ": ", error));
  }
  return std::shared_ptr<HostModule>(new HostModule(handle, kept_fd, std::move(entry_name)));
}

absl::StatusOr<std::shared_ptr<HostModule>> CompileHostModule(const HostSource& source,
                                                              CompileCache& cache) {
  HSAP_ASSIGN_OR_RETURN(HostCompilerInfo compiler, FindHostCompiler());
  std::vector<std::string> options = StandardHostOptions(compiler);
  options.insert(options.end(), source.extra_options.begin(), source.extra_options.end());

  CacheKey key;
  key.kind = "host-so";
  key.source = source.code;
  key.source_suffix = "cc";
  key.headers = source.headers;
  key.options = options;
  key.arch = HostArchString();
  key.compiler = absl::StrCat(compiler.path, " | ", compiler.version);

  absl::StatusOr<std::string> so =
      cache.GetOrCompile(key, [&] { return RunCompile(compiler, source, options, key, cache); });
  if (!so.ok()) return so.status();
  return LoadHostModule(*so, key.EntryName());
}

}  // namespace hsap::jit
