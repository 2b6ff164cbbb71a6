#include "jit/nvrtc.h"

#include <dlfcn.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/params.h"
#include "base/status_macros.h"
#include "jit/cache.h"
#include "jit/compile_error.h"

namespace hsap::jit {
namespace {

constexpr const char* kLibraryNames[] = {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"};

// The places to try, in order; an empty directory stands for the default loader path.
std::vector<std::string> SearchDirectories() {
  const std::optional<std::string> override_path = GetParam(Param::kNvrtcPath);
  std::vector<std::string> dirs;
  if (override_path.has_value()) {
    for (absl::string_view d : absl::StrSplit(*override_path, ':', absl::SkipEmpty())) {
      dirs.emplace_back(d);
    }
    return dirs;  // possibly empty: "no NVRTC anywhere"
  }
  if (const std::string home = GetStringParam(Param::kCudaHome); !home.empty()) {
    dirs.push_back(home + "/lib64");
  }
  dirs.push_back("/usr/local/cuda/lib64");
  dirs.push_back("");
  return dirs;
}

template <typename Fn>
bool Resolve(void* handle, const char* symbol, Fn*& fn) {
  fn = reinterpret_cast<Fn*>(dlsym(handle, symbol));
  return fn != nullptr;
}

absl::StatusOr<std::unique_ptr<NvrtcApi>> LoadFrom(void* handle, std::string path) {
  auto api = std::make_unique<NvrtcApi>();
  api->path = std::move(path);
  bool ok = Resolve(handle, "nvrtcGetErrorString", api->GetErrorString) &&
            Resolve(handle, "nvrtcVersion", api->Version) &&
            Resolve(handle, "nvrtcGetNumSupportedArchs", api->GetNumSupportedArchs) &&
            Resolve(handle, "nvrtcGetSupportedArchs", api->GetSupportedArchs) &&
            Resolve(handle, "nvrtcCreateProgram", api->CreateProgram) &&
            Resolve(handle, "nvrtcDestroyProgram", api->DestroyProgram) &&
            Resolve(handle, "nvrtcCompileProgram", api->CompileProgram) &&
            Resolve(handle, "nvrtcGetPTXSize", api->GetPTXSize) &&
            Resolve(handle, "nvrtcGetPTX", api->GetPTX) &&
            Resolve(handle, "nvrtcGetCUBINSize", api->GetCUBINSize) &&
            Resolve(handle, "nvrtcGetCUBIN", api->GetCUBIN) &&
            Resolve(handle, "nvrtcGetProgramLogSize", api->GetProgramLogSize) &&
            Resolve(handle, "nvrtcGetProgramLog", api->GetProgramLog) &&
            Resolve(handle, "nvrtcAddNameExpression", api->AddNameExpression) &&
            Resolve(handle, "nvrtcGetLoweredName", api->GetLoweredName);
  if (!ok) {
    return absl::UnimplementedError(absl::StrCat(
        "NVRTC at ", api->path, " lacks a required function (CUDA 11.1 or newer is needed)"));
  }
  if (api->Version(&api->major, &api->minor) != 0) {
    return absl::UnimplementedError(absl::StrCat("nvrtcVersion failed for ", api->path));
  }
  int count = 0;
  if (api->GetNumSupportedArchs(&count) != 0 || count < 0 || count > 1000) {
    return absl::UnimplementedError(
        absl::StrCat("nvrtcGetNumSupportedArchs failed for ", api->path));
  }
  api->supported_archs.resize(count);
  if (count > 0 && api->GetSupportedArchs(api->supported_archs.data()) != 0) {
    return absl::UnimplementedError(absl::StrCat("nvrtcGetSupportedArchs failed for ", api->path));
  }
  std::sort(api->supported_archs.begin(), api->supported_archs.end());
  return api;
}

absl::StatusOr<const NvrtcApi*> Search(const std::vector<std::string>& dirs) {
  std::vector<std::string> tried;
  absl::Status first_failure = absl::OkStatus();
  for (const std::string& dir : dirs) {
    for (const char* name : kLibraryNames) {
      const std::string path = dir.empty() ? std::string(name) : absl::StrCat(dir, "/", name);
      tried.push_back(path);
      // RTLD_LOCAL: NVRTC's symbols must not interpose on anything of the host process.
      void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (handle == nullptr) continue;
      Dl_info info{};
      std::string loaded = path;
      void* sym = dlsym(handle, "nvrtcVersion");
      if (sym != nullptr && dladdr(sym, &info) != 0 && info.dli_fname != nullptr) {
        loaded = info.dli_fname;
      }
      absl::StatusOr<std::unique_ptr<NvrtcApi>> api = LoadFrom(handle, loaded);
      if (api.ok()) return api->release();  // lives for the process, like the dlopen handle
      if (first_failure.ok()) first_failure = api.status();
      dlclose(handle);
    }
  }
  if (!first_failure.ok()) return first_failure;
  return absl::UnimplementedError(absl::StrCat(
      "NVRTC not found: install the CUDA toolkit or set CUDA_HOME (tried ",
      tried.empty() ? std::string("nothing: HSAP_NVRTC_PATH is empty") : absl::StrJoin(tried, ", "),
      ")"));
}

// ---- cached payload: lowered names and log, then the image ----

void PutString(std::string& out, absl::string_view s) {
  const uint64_t n = s.size();
  out.append(reinterpret_cast<const char*>(&n), sizeof(n));
  out.append(s.data(), s.size());
}

bool GetString(absl::string_view& in, std::string& s) {
  uint64_t n = 0;
  if (in.size() < sizeof(n)) return false;
  std::memcpy(&n, in.data(), sizeof(n));
  in.remove_prefix(sizeof(n));
  if (n > in.size()) return false;
  s.assign(in.data(), n);
  in.remove_prefix(n);
  return true;
}

constexpr absl::string_view kPayloadMagic = "hsap-cuda-binary-1";

std::string Serialize(const CudaBinary& b) {
  std::string out;
  PutString(out, kPayloadMagic);
  PutString(out, b.target);
  PutString(out, std::to_string(b.lowered_names.size()));
  for (const auto& [expr, lowered] : b.lowered_names) {
    PutString(out, expr);
    PutString(out, lowered);
  }
  PutString(out, b.log);
  PutString(out, b.image);
  return out;
}

absl::StatusOr<CudaBinary> Deserialize(absl::string_view in, CudaBinary::Kind kind) {
  CudaBinary b;
  b.kind = kind;
  std::string magic, count_text;
  int64_t count = 0;
  bool ok = GetString(in, magic) && magic == kPayloadMagic && GetString(in, b.target) &&
            GetString(in, count_text) && absl::SimpleAtoi(count_text, &count) && count >= 0 &&
            count < 100000;
  for (int64_t i = 0; ok && i < count; ++i) {
    std::string expr, lowered;
    ok = GetString(in, expr) && GetString(in, lowered);
    b.lowered_names.emplace_back(std::move(expr), std::move(lowered));
  }
  ok = ok && GetString(in, b.log) && GetString(in, b.image) && in.empty();
  if (!ok) return absl::DataLossError("cached CUDA binary is malformed");
  return b;
}

std::string ProgramLog(const NvrtcApi& api, NvrtcApi::Program prog) {
  size_t size = 0;
  if (api.GetProgramLogSize(prog, &size) != 0 || size == 0) return "";
  std::string log(size, '\0');
  if (api.GetProgramLog(prog, log.data()) != 0) return "";
  while (!log.empty() && (log.back() == '\0' || log.back() == '\n')) log.pop_back();
  return log;
}

double ThreadCpuSeconds() {
  timespec ts{};
  if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) != 0) return 0;
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

struct ProgramGuard {
  const NvrtcApi& api;
  NvrtcApi::Program prog = nullptr;
  ~ProgramGuard() {
    if (prog != nullptr) api.DestroyProgram(&prog);
  }
};

// One NVRTC compile, uncached. On a compile failure returns CompileError with the log;
// `source_path` is filled in by the caller.
absl::StatusOr<CudaBinary> CompileUncached(const NvrtcApi& api, const CudaCompileRequest& request,
                                           const std::string& target,
                                           const std::vector<std::string>& options,
                                           std::string* failure_log) {
  std::vector<const char*> header_contents, header_names;
  for (const auto& [name, content] : request.headers) {
    header_names.push_back(name.c_str());
    header_contents.push_back(content.c_str());
  }
  ProgramGuard guard{api};
  NvrtcApi::Result r = api.CreateProgram(
      &guard.prog, request.source.c_str(), request.program_name.c_str(),
      static_cast<int>(header_names.size()), header_contents.data(), header_names.data());
  if (r != 0) {
    return absl::InternalError(absl::StrCat("nvrtcCreateProgram: ", api.GetErrorString(r)));
  }
  for (const std::string& expr : request.name_expressions) {
    r = api.AddNameExpression(guard.prog, expr.c_str());
    if (r != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("nvrtcAddNameExpression(\"", expr, "\"): ", api.GetErrorString(r)));
    }
  }
  std::vector<const char*> option_ptrs;
  for (const std::string& o : options) option_ptrs.push_back(o.c_str());
  r = api.CompileProgram(guard.prog, static_cast<int>(option_ptrs.size()), option_ptrs.data());
  std::string log = ProgramLog(api, guard.prog);
  if (r != 0) {
    *failure_log = absl::StrCat(api.GetErrorString(r), "\n", log);
    return CompileError("NVRTC compile failed");  // message completed by the caller
  }
  CudaBinary binary;
  binary.target = target;
  binary.log = std::move(log);
  const bool ptx = target.rfind("compute_", 0) == 0;
  binary.kind = ptx ? CudaBinary::Kind::kPtx : CudaBinary::Kind::kCubin;
  size_t size = 0;
  r = ptx ? api.GetPTXSize(guard.prog, &size) : api.GetCUBINSize(guard.prog, &size);
  if (r != 0) return absl::InternalError(absl::StrCat("nvrtcGet*Size: ", api.GetErrorString(r)));
  binary.image.resize(size);
  r = ptx ? api.GetPTX(guard.prog, binary.image.data())
          : api.GetCUBIN(guard.prog, binary.image.data());
  if (r != 0) return absl::InternalError(absl::StrCat("nvrtcGet*: ", api.GetErrorString(r)));
  if (ptx) {
    while (!binary.image.empty() && binary.image.back() == '\0') binary.image.pop_back();
  }
  for (const std::string& expr : request.name_expressions) {
    const char* lowered = nullptr;
    r = api.GetLoweredName(guard.prog, expr.c_str(), &lowered);
    if (r != 0 || lowered == nullptr) {
      return absl::InternalError(
          absl::StrCat("nvrtcGetLoweredName(\"", expr, "\"): ", api.GetErrorString(r)));
    }
    binary.lowered_names.emplace_back(expr, lowered);
  }
  return binary;
}

}  // namespace

std::string NvrtcApi::Identity() const {
  return absl::StrCat("nvrtc ", major, ".", minor, " (", path, ")");
}

bool NvrtcApi::SupportsCubin(int arch) const {
  return std::binary_search(supported_archs.begin(), supported_archs.end(), arch);
}

absl::StatusOr<const NvrtcApi*> LoadNvrtc() {
  static std::mutex mu;
  static auto* loaded = new std::map<std::string, absl::StatusOr<const NvrtcApi*>>();
  const std::vector<std::string> dirs = SearchDirectories();
  const std::string key = absl::StrJoin(dirs, "\n");
  std::lock_guard<std::mutex> lock(mu);
  auto it = loaded->find(key);
  if (it == loaded->end()) it = loaded->emplace(key, Search(dirs)).first;
  return it->second;
}

absl::StatusOr<int> ParseCudaArch(absl::string_view arch) {
  absl::string_view digits = arch;
  if (absl::ConsumePrefix(&digits, "sm_") || absl::ConsumePrefix(&digits, "compute_")) {
    absl::ConsumeSuffix(&digits, "a");
    int value = 0;
    if (!digits.empty() && digits.size() <= 4 &&
        std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }) &&
        absl::SimpleAtoi(digits, &value) && value >= 10) {
      return value;
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("CUDA architecture \"", arch,
                   "\" is not of the form sm_XX, sm_XXa or compute_XX (e.g. sm_90, sm_90a)"));
}

bool IsArchSpecificTarget(absl::string_view arch) { return absl::EndsWith(arch, "a"); }

absl::StatusOr<std::string> CudaBinary::LoweredName(absl::string_view expression) const {
  for (const auto& [expr, lowered] : lowered_names) {
    if (expr == expression) return lowered;
  }
  return absl::NotFoundError(
      absl::StrCat("no lowered name for \"", expression, "\" in the compiled CUDA program"));
}

std::vector<std::string> DefaultNvrtcOptions(absl::string_view target) {
  // No fast-math: masked scores are -inf and must keep their meaning.
  return {absl::StrCat("--gpu-architecture=", target), "-std=c++17", "--fmad=true", "-lineinfo"};
}

absl::StatusOr<CudaBinary> CompileCuda(const CudaCompileRequest& request, CompileCache* cache) {
  HSAP_ASSIGN_OR_RETURN(int arch, ParseCudaArch(request.arch));
  HSAP_ASSIGN_OR_RETURN(const NvrtcApi* loaded, LoadNvrtc());
  const NvrtcApi& api = *loaded;

  const bool want_ptx =
      request.force_ptx || request.arch.rfind("compute_", 0) == 0 || !api.SupportsCubin(arch);
  const bool arch_specific = IsArchSpecificTarget(request.arch);
  if (arch_specific && !api.SupportsCubin(arch)) {
    // sm_XXa code exists for that architecture only: no lower virtual architecture serves.
    return absl::UnimplementedError(absl::StrCat("CUDA architecture ", request.arch,
                                                 " is arch-specific and ", api.Identity(),
                                                 " does not know sm_", arch));
  }
  int target_arch = arch;
  if (want_ptx && !api.SupportsCubin(target_arch)) {
    // The closest lower virtual architecture this NVRTC knows; the driver JITs upward.
    int best = 0;
    for (int a : api.supported_archs) {
      if (a <= target_arch) best = a;
    }
    if (best == 0) {
      return absl::UnimplementedError(
          absl::StrCat("CUDA architecture ", request.arch, " is older than every architecture ",
                       api.Identity(), " supports (oldest: sm_",
                       api.supported_archs.empty() ? 0 : api.supported_archs.front(), ")"));
    }
    target_arch = best;
  }
  const std::string target =
      absl::StrCat(want_ptx ? "compute_" : "sm_", target_arch, arch_specific ? "a" : "");
  std::vector<std::string> options = DefaultNvrtcOptions(target);
  options.insert(options.end(), request.extra_options.begin(), request.extra_options.end());

  CacheKey key;
  key.kind = want_ptx ? "ptx" : "cubin";
  key.source = request.source;
  key.source_suffix = "cu";
  key.headers = request.headers;
  key.options = options;
  key.options.push_back(absl::StrCat("program_name=", request.program_name));
  for (const std::string& e : request.name_expressions) key.options.push_back("name_expr=" + e);
  key.arch = target;
  key.compiler = api.Identity();

  double seconds = 0, cpu_seconds = 0;
  bool compiled = false;
  std::string failure_log;
  auto compile = [&]() -> absl::StatusOr<std::string> {
    compiled = true;
    const auto start = std::chrono::steady_clock::now();
    const double cpu_start = ThreadCpuSeconds();
    absl::StatusOr<CudaBinary> binary =
        CompileUncached(api, request, target, options, &failure_log);
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    cpu_seconds = ThreadCpuSeconds() - cpu_start;
    if (!binary.ok()) return binary.status();
    return Serialize(*binary);
  };
  absl::StatusOr<std::string> payload =
      cache != nullptr ? cache->GetOrCompile(key, compile) : compile();
  if (!payload.ok()) {
    if (!IsCompileError(payload.status())) return payload.status();
    std::string where;
    if (cache != nullptr) {
      absl::StatusOr<std::string> path = cache->KeepSource(key);
      where =
          path.ok() ? *path : absl::StrCat("(could not be written: ", path.status().message(), ")");
    } else {
      CompileCache scratch(CompileCache::OptionsFromEnvironment());
      absl::StatusOr<std::string> path = scratch.KeepSource(key);
      where =
          path.ok() ? *path : absl::StrCat("(could not be written: ", path.status().message(), ")");
    }
    return CompileError(absl::StrCat("NVRTC failed to compile ", request.program_name, " for ",
                                     target, "; generated source kept at ", where, "\n",
                                     failure_log));
  }
  absl::StatusOr<CudaBinary> binary =
      Deserialize(*payload, want_ptx ? CudaBinary::Kind::kPtx : CudaBinary::Kind::kCubin);
  if (!binary.ok()) return binary.status();
  binary->compile_seconds = compiled ? seconds : 0;
  binary->compile_cpu_seconds = compiled ? cpu_seconds : 0;
  binary->from_cache = !compiled;
  return binary;
}

// ---- ELF64 ----

namespace {

template <typename T>
bool ReadAt(absl::string_view image, uint64_t offset, T* out) {
  if (offset > image.size() || image.size() - offset < sizeof(T)) return false;
  std::memcpy(out, image.data() + offset, sizeof(T));
  return true;
}

struct SectionHeader {
  uint32_t name, type;
  uint64_t flags, addr, offset, size;
  uint32_t link, info;
  uint64_t addralign, entsize;
};
static_assert(sizeof(SectionHeader) == 64);

struct Symbol {
  uint32_t name;
  uint8_t info, other;
  uint16_t shndx;
  uint64_t value, size;
};
static_assert(sizeof(Symbol) == 24);

constexpr uint32_t kShtSymtab = 2;

}  // namespace

absl::StatusOr<std::vector<ElfSymbol>> ReadElfSymbols(absl::string_view image) {
  auto bad = [](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("not a valid ELF64 image: ", what));
  };
  if (image.size() < 64 || std::memcmp(image.data(),
                                       "\x7f"
                                       "ELF",
                                       4) != 0) {
    return bad("missing ELF magic");
  }
  if (image[4] != 2 || image[5] != 1) return bad("not 64-bit little-endian");
  uint64_t shoff = 0;
  uint16_t shentsize = 0, shnum = 0;
  if (!ReadAt(image, 0x28, &shoff) || !ReadAt(image, 0x3a, &shentsize) ||
      !ReadAt(image, 0x3c, &shnum)) {
    return bad("truncated header");
  }
  if (shentsize != sizeof(SectionHeader)) return bad("unexpected section header size");
  std::vector<SectionHeader> sections(shnum);
  for (uint16_t i = 0; i < shnum; ++i) {
    if (!ReadAt(image, shoff + uint64_t{i} * sizeof(SectionHeader), &sections[i])) {
      return bad("section header table out of bounds");
    }
  }
  std::vector<ElfSymbol> symbols;
  for (const SectionHeader& sh : sections) {
    if (sh.type != kShtSymtab) continue;
    if (sh.link >= sections.size()) return bad("symbol table links to no string table");
    const SectionHeader& strtab = sections[sh.link];
    if (strtab.offset > image.size() || image.size() - strtab.offset < strtab.size) {
      return bad("string table out of bounds");
    }
    const absl::string_view strings = image.substr(strtab.offset, strtab.size);
    if (sh.entsize != sizeof(Symbol) || sh.size % sizeof(Symbol) != 0) {
      return bad("unexpected symbol entry size");
    }
    for (uint64_t off = 0; off < sh.size; off += sizeof(Symbol)) {
      Symbol s{};
      if (!ReadAt(image, sh.offset + off, &s)) return bad("symbol table out of bounds");
      if (s.name >= strings.size()) return bad("symbol name out of bounds");
      const size_t end = strings.find('\0', s.name);
      if (end == absl::string_view::npos) return bad("unterminated symbol name");
      ElfSymbol out;
      out.name = std::string(strings.substr(s.name, end - s.name));
      out.type = s.info & 0xf;
      out.binding = s.info >> 4;
      out.section = s.shndx;
      out.size = s.size;
      symbols.push_back(std::move(out));
    }
  }
  return symbols;
}

}  // namespace hsap::jit
