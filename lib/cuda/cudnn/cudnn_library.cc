#include "lib/cuda/cudnn/cudnn_library.h"

#include <dlfcn.h>

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "base/params.h"
#include "lib/cuda/runtime/cuda_loader.h"
#include "lib/cuda/runtime/device.h"

namespace hsap::cuda {
namespace {

absl::StatusOr<std::unique_ptr<CudnnLibrary>> Open() {
  auto lib = std::make_unique<CudnnLibrary>();
  std::vector<std::string> tried;
  for (const std::string& dir : CudnnLibrarySearchPath()) {
    const std::string candidate = dir.empty() ? "libcudnn.so.9" : dir + "/libcudnn.so.9";
    lib->handle = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib->handle != nullptr) {
      lib->path = candidate;
      break;
    }
    tried.push_back(candidate);
  }
  if (lib->handle == nullptr) {
    return absl::UnimplementedError(
        absl::StrCat("libcudnn.so.9 not found: no cuDNN 9 (tried ", absl::StrJoin(tried, ", "),
                     "; set $HSAP_CUDA_LIB_PATH to the directory that holds it)"));
  }
  using GetVersionFn = size_t (*)();
  auto get_version = reinterpret_cast<GetVersionFn>(dlsym(lib->handle, "cudnnGetVersion"));
  if (get_version == nullptr) {
    return absl::UnimplementedError(
        absl::StrCat(lib->path, " lacks cudnnGetVersion: not a cuDNN 9 library"));
  }
  lib->version = static_cast<int>(get_version());
  if (lib->version < 90000) {
    return absl::UnimplementedError(
        absl::StrCat(lib->path, " is cuDNN ", lib->version, "; the ragged graphs need cuDNN 9"));
  }
  return lib;
}

}  // namespace

std::vector<std::string> CudnnLibrarySearchPath() {
  if (GetParam(Param::kCudaLibPath).has_value()) return CudaLibrarySearchPath();
  std::vector<std::string> dirs = CudaLibrarySearchPath();  // ends with "" (default)
  dirs.insert(dirs.end() - 1, "/usr/local/cuda-13.0/lib");
  return dirs;
}

absl::StatusOr<const CudnnLibrary*> OpenCudnnLibrary() {
  static std::mutex mu;
  static auto* cache = new std::map<std::string, absl::StatusOr<const CudnnLibrary*>>();
  const std::string key = absl::StrJoin(CudnnLibrarySearchPath(), ":");
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = cache->find(key); it != cache->end()) return it->second;
  absl::StatusOr<std::unique_ptr<CudnnLibrary>> lib = Open();
  absl::StatusOr<const CudnnLibrary*> result =
      lib.ok() ? absl::StatusOr<const CudnnLibrary*>(lib->release()) : lib.status();
  cache->emplace(key, result);
  return result;
}

CudnnAvailability ProbeCudnn() {
  CudnnAvailability a;
  absl::StatusOr<const CudnnLibrary*> lib = OpenCudnnLibrary();
  if (!lib.ok()) {
    a.loaded = lib.status();
    return a;
  }
  a.version = (*lib)->version;
  absl::StatusOr<std::string> arch = CurrentCudaArch();  // "sm_90"
  if (!arch.ok()) {
    a.loaded = arch.status();
    return a;
  }
  absl::string_view digits = *arch;
  absl::ConsumePrefix(&digits, "sm_");
  absl::ConsumeSuffix(&digits, "a");
  if (!absl::SimpleAtoi(digits, &a.sm)) {
    a.loaded = absl::InternalError(absl::StrCat("unexpected CUDA architecture '", *arch, "'"));
    return a;
  }
  a.loaded = absl::OkStatus();
  return a;
}

}  // namespace hsap::cuda
