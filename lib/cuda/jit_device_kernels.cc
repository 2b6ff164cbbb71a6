#include "lib/cuda/jit_device_kernels.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "jit/cache.h"
#include "jit/cuda_kernels.h"

namespace hsap::cuda {
namespace {

struct Kernel {
  CUfunction function = nullptr;
  int threads = 0;
  int smem = 0;
};

class JitDeviceKernels : public DeviceKernels {
 public:
  ~JitDeviceKernels() override {
    if (module_ != nullptr) driver_->ModuleUnload(module_);
  }

  static absl::StatusOr<std::unique_ptr<DeviceKernels>> Load(const jit::CompiledCudaKernels& c,
                                                             int sm_count) {
    absl::StatusOr<const CudaDriverApi*> driver = LoadCudaDriver();
    if (!driver.ok()) return driver.status();
    auto k = std::unique_ptr<JitDeviceKernels>(new JitDeviceKernels());
    k->driver_ = *driver;
    k->helper_ctas_ = std::max(1, 8 * sm_count);
    const CudaDriverApi& d = **driver;
    // The module belongs to the context current now (the primary context of the current
    // device, made current by LoadJitDeviceKernels); launches bind it again, since a caller
    // may launch from a thread that never made a CUDA runtime call.
    if (absl::Status s = d.Check(d.CtxGetCurrent(&k->context_), "cuCtxGetCurrent"); !s.ok()) {
      return s;
    }
    if (k->context_ == nullptr) {
      return absl::InternalError("no current CUDA context to load the kernels into");
    }
    if (absl::Status s = d.Check(
            d.ModuleLoadData(&k->module_, c.binary.image.c_str()),
            absl::StrCat("cuModuleLoadData(", c.source.program_name, ", ", c.binary.target, ")"));
        !s.ok()) {
      return s;
    }
    struct Slot {
      const char* role;
      Kernel* kernel;
    };
    for (Slot slot : {Slot{"fwd", &k->fwd_}, Slot{"bwd", &k->bwd_}, Slot{"delta", &k->delta_},
                      Slot{"init", &k->init_}, Slot{"convert", &k->convert_},
                      Slot{"accumulate", &k->accumulate_}, Slot{"copy_chunks", &k->copy_chunks_},
                      Slot{"add_chunks", &k->add_chunks_}}) {
      absl::StatusOr<jit::CudaKernelEntry> entry = c.Entry(slot.role);
      if (!entry.ok()) return entry.status();
      absl::StatusOr<std::string> name = c.LoweredName(slot.role);
      if (!name.ok()) return name.status();
      Kernel& kernel = *slot.kernel;
      kernel.threads = entry->threads;
      kernel.smem = entry->dynamic_smem_bytes;
      if (absl::Status s = d.Check(d.ModuleGetFunction(&kernel.function, k->module_, name->c_str()),
                                   absl::StrCat("cuModuleGetFunction(", *name, ")"));
          !s.ok()) {
        return s;
      }
      if (kernel.smem > 48 * 1024) {
        if (absl::Status s =
                d.Check(d.FuncSetAttribute(kernel.function, kCuFuncAttributeMaxDynamicSharedSize,
                                           kernel.smem),
                        absl::StrCat("cuFuncSetAttribute(", entry->role, " kernel, ", kernel.smem,
                                     " B shared memory)"));
            !s.ok()) {
          return s;
        }
      }
    }
    return std::unique_ptr<DeviceKernels>(std::move(k));
  }

  absl::Status Forward(const hsap_dev::FwdParams& p, cudaStream s) const override {
    if (p.num_blocks == 0 || p.heads_q == 0) return absl::OkStatus();
    return Launch(fwd_, "attention forward", p.num_blocks, p.heads_q, &p, s);
  }
  absl::Status Backward(const hsap_dev::BwdParams& p, cudaStream s) const override {
    if (p.num_blocks == 0 || p.heads_q == 0) return absl::OkStatus();
    return Launch(bwd_, "attention backward", p.num_blocks, p.heads_q, &p, s);
  }
  absl::Status Delta(const hsap_dev::DeltaParams& p, cudaStream s) const override {
    return Launch(delta_, "delta", HelperGrid(p.rows * p.heads * 32), 1, &p, s);
  }
  absl::Status Init(const hsap_dev::InitParams& p, cudaStream s) const override {
    return Launch(init_, "init", HelperGrid(p.rows * p.heads * 4), 1, &p, s);
  }
  absl::Status Convert(const hsap_dev::ConvertParams& p, cudaStream s) const override {
    return Launch(convert_, "convert", HelperGrid(p.count), 1, &p, s);
  }
  absl::Status Accumulate(const hsap_dev::AccumulateParams& p, cudaStream s) const override {
    return Launch(accumulate_, "accumulate", HelperGrid(p.count), 1, &p, s);
  }
  absl::Status CopyChunks(const hsap_dev::ChunksParams& p, cudaStream s) const override {
    if (p.num_chunks == 0) return absl::OkStatus();
    return Launch(copy_chunks_, "copy chunks", HelperGrid(p.num_chunks * 256), 1, &p, s);
  }
  absl::Status AddChunks(const hsap_dev::ChunksParams& p, cudaStream s) const override {
    if (p.num_chunks == 0) return absl::OkStatus();
    return Launch(add_chunks_, "add chunks", HelperGrid(p.num_chunks * 256), 1, &p, s);
  }

 private:
  JitDeviceKernels() = default;

  // CTAs of 256 threads for `threads_wanted` threads of work, at most helper_ctas_.
  unsigned HelperGrid(long long threads_wanted) const {
    const long long ctas = (threads_wanted + 255) / 256;
    return static_cast<unsigned>(std::clamp<long long>(ctas, 1, helper_ctas_));
  }

  template <typename Params>
  absl::Status Launch(const Kernel& k, const char* what, unsigned grid_x, unsigned grid_y,
                      const Params* params, cudaStream s) const {
    void* args[] = {const_cast<Params*>(params)};
    if (absl::Status st = driver_->Check(driver_->CtxSetCurrent(context_), "cuCtxSetCurrent");
        !st.ok()) {
      return st;
    }
    return driver_->Check(
        driver_->LaunchKernel(k.function, grid_x, grid_y, 1, static_cast<unsigned>(k.threads), 1, 1,
                              static_cast<unsigned>(k.smem), s, args, nullptr),
        absl::StrCat("cuLaunchKernel(", what, ", grid ", grid_x, "x", grid_y, ", ", k.threads,
                     " threads, ", k.smem, " B shared)"));
  }

  const CudaDriverApi* driver_ = nullptr;
  CUcontext context_ = nullptr;
  CUmodule module_ = nullptr;
  long long helper_ctas_ = 1;
  Kernel fwd_, bwd_, delta_, init_, convert_, accumulate_, copy_chunks_, add_chunks_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceKernels>> LoadJitDeviceKernels(jit::CudaKernelConfig config) {
  if (absl::Status s = CheckCudaDevice(); !s.ok()) return s;
  if (config.arch.empty()) {
    absl::StatusOr<std::string> arch = CurrentCudaArch();
    if (!arch.ok()) return arch.status();
    config.arch = *arch;
  }
  absl::StatusOr<const CudaRuntimeApi*> rt = LoadCudaRuntime();
  if (!rt.ok()) return rt.status();
  int device = 0, sms = 1;
  if (absl::Status s = (*rt)->Check((*rt)->GetDevice(&device), "cudaGetDevice"); !s.ok()) return s;
  if (absl::Status s =
          (*rt)->Check((*rt)->DeviceGetAttribute(&sms, kCudaDevAttrMultiProcessorCount, device),
                       "cudaDeviceGetAttribute(multiprocessor count)");
      !s.ok()) {
    return s;
  }
  // cudaFree(nullptr) initialises the device's primary context and makes it current.
  if (absl::Status s = (*rt)->Check((*rt)->Free(nullptr), "cudaFree(nullptr) (context set-up)");
      !s.ok()) {
    return s;
  }
  absl::StatusOr<jit::CompiledCudaKernels> compiled =
      jit::CompileCudaKernels(config, &jit::CompileCache::Global());
  if (!compiled.ok()) return compiled.status();
  return JitDeviceKernels::Load(*compiled, sms);
}

}  // namespace hsap::cuda
