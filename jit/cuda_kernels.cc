#include "jit/cuda_kernels.h"

#include <algorithm>
#include <atomic>
#include <thread>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "base/status_macros.h"
#include "jit/cache.h"

namespace hsap::jit {

const std::vector<std::string>& ShippedCudaArchs() {
  static const auto* archs = new std::vector<std::string>{"sm_80", "sm_90"};
  return *archs;
}

std::vector<CudaKernelConfig> ShippedCudaConfigs(absl::string_view arch) {
  std::vector<CudaKernelConfig> out;
  auto add = [&](DType dtype, int head_dim, int gqa, bool has_band, CudaTopologyRole role = {}) {
    CudaKernelConfig c;
    c.arch = std::string(arch);
    c.dtype = dtype;
    c.head_dim = head_dim;
    c.gqa = gqa;
    c.has_band = has_band;
    c.role = role;
    out.push_back(c);
  };
  // bf16: the training dtype. Every head dim, MHA and GQA-8 (Llama-style), with causal
  // bands; full-only variants (bidirectional encoders, prefix-free packs) at head dim 128.
  for (int d : {64, 128, 256}) {
    for (int gqa : {1, 8}) add(DType::kBF16, d, gqa, true);
  }
  for (int gqa : {1, 8}) add(DType::kBF16, 128, gqa, false);
  // fp16: MHA with bands at every head dim.
  for (int d : {64, 128, 256}) add(DType::kF16, d, 1, true);
  // fp32: the GPU tests' reference precision.
  for (int d : {64, 128}) add(DType::kF32, d, 1, true);
  // Topology roles with peers (fused kernels): a pair, groups of 4 and 8 with GQA-8, and a
  // group of 4 with MHA.
  add(DType::kBF16, 128, 1, true, {1});
  add(DType::kBF16, 128, 8, true, {3});
  add(DType::kBF16, 128, 8, true, {7});
  add(DType::kBF16, 128, 1, true, {3});
  // The tensor-core backward with atomic dq (deterministic_dq = false, "_adq"), so that the
  // variant compile test covers its kernel too; the runtime requests the deterministic
  // default.
  add(DType::kBF16, 128, 1, true);
  out.back().deterministic_dq = false;
  if (!CudaTensorCoreApplies(out.back())) out.pop_back();  // same variant as the default
  return out;
}

absl::StatusOr<CudaKernelEntry> CompiledCudaKernels::Entry(absl::string_view role) const {
  for (const CudaKernelEntry& e : source.kernels) {
    if (e.role == role) return e;
  }
  return absl::NotFoundError(
      absl::StrCat("no kernel \"", role, "\" in CUDA program ", source.program_name));
}

absl::StatusOr<std::string> CompiledCudaKernels::LoweredName(absl::string_view role) const {
  HSAP_ASSIGN_OR_RETURN(CudaKernelEntry e, Entry(role));
  return binary.LoweredName(e.name_expression);
}

namespace {

// The integer before `unit` in `line` ("Used 96 registers" -> 96 for "registers"), or -1.
int NumberBefore(absl::string_view line, absl::string_view unit) {
  const size_t at = line.find(unit);
  if (at == absl::string_view::npos || at < 2) return -1;
  size_t begin = at - 1;  // the space before the unit
  while (begin > 0 && absl::ascii_isdigit(line[begin - 1])) --begin;
  int value = -1;
  return absl::SimpleAtoi(line.substr(begin, at - 1 - begin), &value) ? value : -1;
}

}  // namespace

absl::StatusOr<std::vector<CudaKernelResources>> ParsePtxasResources(absl::string_view log) {
  // Per kernel: "Compiling entry function 'NAME' for 'sm_90'", then "N bytes stack frame,
  // N bytes spill stores, N bytes spill loads", then "Used N registers, ... N bytes smem".
  std::vector<CudaKernelResources> out;
  bool open = false;
  auto unfinished = [&] {
    return absl::InvalidArgumentError(
        absl::StrCat("ptxas log: no register count for ", out.back().function));
  };
  constexpr absl::string_view kEntry = "Compiling entry function '";
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    if (const size_t at = line.find(kEntry); at != absl::string_view::npos) {
      if (open) return unfinished();
      line.remove_prefix(at + kEntry.size());
      out.push_back({});
      out.back().function = std::string(line.substr(0, line.find('\'')));
      open = true;
    } else if (open && line.find("bytes stack frame") != absl::string_view::npos) {
      out.back().stack_frame_bytes = std::max(0, NumberBefore(line, "bytes stack frame"));
      out.back().spill_store_bytes = std::max(0, NumberBefore(line, "bytes spill stores"));
      out.back().spill_load_bytes = std::max(0, NumberBefore(line, "bytes spill loads"));
    } else if (open && line.find("Used ") != absl::string_view::npos) {
      out.back().registers = NumberBefore(line, "registers");
      out.back().static_smem_bytes = std::max(0, NumberBefore(line, "bytes smem"));
      if (out.back().registers < 0) {
        return absl::InvalidArgumentError(absl::StrCat("ptxas log: unreadable line: ", line));
      }
      open = false;
    }
  }
  if (open) return unfinished();
  return out;
}

int CudaCtasPerSm(int arch, int threads, int registers, int smem_bytes, std::string* limiter) {
  if (threads <= 0) return 0;
  const int warps = (threads + 31) / 32;
  const bool small_sm = arch == 75 || arch == 86 || arch == 89 || arch == 120;
  const int max_threads = arch == 75 ? 1024 : small_sm ? 1536 : 2048;
  const int max_ctas = small_sm ? 16 : 32;
  const int reserved = arch >= 80 ? 1024 : 0;
  const int regs_per_warp = ((std::max(registers, 1) * 32 + 255) / 256) * 256;
  const std::pair<int, const char*> limits[] = {
      {65536 / (regs_per_warp * warps), "registers"},
      {max_threads / (warps * 32), "threads"},
      {max_ctas, "CTA slots"},
      {CudaSharedMemoryPerSm(arch) / (smem_bytes + reserved), "shared memory"}};
  std::pair<int, const char*> least = limits[0];
  for (const auto& l : limits) {
    if (l.first < least.first) least = l;
  }
  if (limiter != nullptr) *limiter = least.second;
  return std::max(least.first, 0);
}

absl::StatusOr<std::vector<CudaKernelResources>> CompiledCudaKernels::Resources() const {
  if (binary.kind != CudaBinary::Kind::kCubin) {
    return absl::FailedPreconditionError(
        absl::StrCat(source.program_name, " was compiled to PTX: no ptxas report"));
  }
  HSAP_ASSIGN_OR_RETURN(std::vector<CudaKernelResources> all, ParsePtxasResources(binary.log));
  std::vector<CudaKernelResources> out;
  for (const CudaKernelEntry& e : source.kernels) {
    HSAP_ASSIGN_OR_RETURN(std::string lowered, binary.LoweredName(e.name_expression));
    const auto it = std::find_if(all.begin(), all.end(), [&](const CudaKernelResources& r) {
      return r.function == lowered;
    });
    if (it == all.end()) {
      return absl::NotFoundError(absl::StrCat("the ptxas report of ", source.program_name,
                                              " has no entry ", lowered, " (", e.role, ")"));
    }
    out.push_back(*it);
  }
  return out;
}

absl::StatusOr<CompiledCudaKernels> CompileCudaKernels(const CudaKernelConfig& config,
                                                       CompileCache* cache, bool force_ptx) {
  absl::StatusOr<CudaKernelSource> source = GenerateCudaKernels(config);
  if (!source.ok()) return source.status();
  CudaCompileRequest request;
  request.program_name = source->program_name;
  request.source = source->source;
  request.headers = source->headers;
  request.arch = config.arch;
  request.force_ptx = force_ptx;
  request.extra_options = {"--ptxas-options=-v"};  // the resource report (Resources())
  request.name_expressions = source->NameExpressions();
  HSAP_ASSIGN_OR_RETURN(CudaBinary binary, CompileCuda(request, cache));
  return CompiledCudaKernels{*std::move(source), std::move(binary)};
}

absl::Status VerifyCubinSymbols(const CompiledCudaKernels& compiled) {
  if (compiled.binary.kind != CudaBinary::Kind::kCubin) {
    return absl::FailedPreconditionError(
        absl::StrCat(compiled.source.program_name, " was compiled to PTX, not a cubin"));
  }
  HSAP_ASSIGN_OR_RETURN(std::vector<ElfSymbol> symbols, ReadElfSymbols(compiled.binary.image));
  for (const CudaKernelEntry& e : compiled.source.kernels) {
    HSAP_ASSIGN_OR_RETURN(std::string lowered, compiled.binary.LoweredName(e.name_expression));
    bool found = false;
    for (const ElfSymbol& s : symbols) {
      // STT_FUNC, STB_GLOBAL or STB_WEAK (template instantiations), defined in a section.
      found = found || (s.name == lowered && s.type == 2 && (s.binding == 1 || s.binding == 2) &&
                        s.section != 0);
    }
    if (!found) {
      return absl::NotFoundError(absl::StrCat("cubin of ", compiled.source.program_name,
                                              " defines no global or weak function ", lowered, " (",
                                              e.name_expression, ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<CudaVariantTiming>> CompileShippedCudaKernels(
    const std::vector<std::string>& archs, CompileCache* cache, int threads) {
  std::vector<CudaKernelConfig> configs;
  for (const std::string& arch : archs) {
    std::vector<CudaKernelConfig> c = ShippedCudaConfigs(arch);
    configs.insert(configs.end(), c.begin(), c.end());
  }
  std::vector<CudaVariantTiming> timings(configs.size());
  std::vector<absl::Status> statuses(configs.size());
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t i = next++; i < configs.size(); i = next++) {
      absl::StatusOr<CompiledCudaKernels> compiled = CompileCudaKernels(configs[i], cache);
      if (!compiled.ok()) {
        statuses[i] = compiled.status();
        continue;
      }
      statuses[i] = compiled->binary.kind == CudaBinary::Kind::kCubin
                        ? VerifyCubinSymbols(*compiled)
                        : absl::OkStatus();
      CudaVariantTiming& t = timings[i];
      t.name = configs[i].Name();
      t.target = compiled->binary.target;
      t.seconds = compiled->binary.compile_seconds;
      t.cpu_seconds = compiled->binary.compile_cpu_seconds;
      t.from_cache = compiled->binary.from_cache;
      t.image_bytes = compiled->binary.image.size();
    }
  };
  const int n = std::max(1, threads);
  std::vector<std::thread> pool;
  for (int t = 1; t < n; ++t) pool.emplace_back(worker);
  worker();
  for (std::thread& t : pool) t.join();
  for (const absl::Status& s : statuses) {
    if (!s.ok()) return s;
  }
  return timings;
}

}  // namespace hsap::jit
