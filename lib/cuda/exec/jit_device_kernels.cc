#include "lib/cuda/exec/jit_device_kernels.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/params.h"
#include "base/status_macros.h"
#include "jit/cache.h"
#include "jit/cuda_kernels.h"
#include "lib/cuda/exec/launch_grid.h"
#include "lib/cuda/exec/wgmma_tensor_maps.h"

namespace hsap::cuda {
namespace {

struct Kernel {
  CUfunction function = nullptr;
  int threads = 0;
  int smem = 0;
  bool tensor_core = false;  // cp.async rows or TMA: q, k, v must be 16-byte aligned
  bool wgmma = false;        // sm_90a forward / backward: tensor maps follow the Params
  int key_tile_rows = 0;     // the forward's K/V box rows (CudaTiles::wgmma_block_n)
  int bwd_box_rows = 0;      // the sm_90a backward's TMA box rows (CudaTiles::wgmma_bwd_box_rows)
};

// The tensor-core kernels move 16-byte rows with cp.async; the kernel would only flag a
// misaligned tensor in an error word the forward does not read back, so the host refuses it.
absl::Status CheckAligned(const Kernel& k, const char* what, const void* q, const void* k_ptr,
                          const void* v) {
  if (!k.tensor_core) return absl::OkStatus();
  const auto bits = reinterpret_cast<uintptr_t>(q) | reinterpret_cast<uintptr_t>(k_ptr) |
                    reinterpret_cast<uintptr_t>(v);
  if ((bits & 15u) == 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrFormat(
      "%s: the tensor-core kernels need 16-byte aligned q, k and v (got %p, %p, %p)", what, q,
      k_ptr, v));
}

class JitDeviceKernels : public DeviceKernels {
 public:
  ~JitDeviceKernels() override {
    if (module_ != nullptr) driver_->ModuleUnload(module_);
  }

  static absl::StatusOr<std::unique_ptr<DeviceKernels>> Load(const jit::CompiledCudaKernels& c,
                                                             int sm_count) {
    HSAP_ASSIGN_OR_RETURN(const CudaDriverApi* driver, LoadCudaDriver());
    auto k = std::unique_ptr<JitDeviceKernels>(new JitDeviceKernels());
    k->driver_ = driver;
    k->helper_ctas_ = std::max(1, 8 * sm_count);
    k->dtype_ = c.source.config.dtype;
    k->head_dim_ = c.source.config.head_dim;
    const CudaDriverApi& d = *driver;
    // The module belongs to the context current now (the primary context of the current
    // device, made current by LoadJitDeviceKernels); launches bind it again, since a caller
    // may launch from a thread that never made a CUDA runtime call.
    HSAP_RETURN_IF_ERROR(d.Check(d.CtxGetCurrent(&k->context_), "cuCtxGetCurrent"));
    if (k->context_ == nullptr) {
      return absl::InternalError("no current CUDA context to load the kernels into");
    }
    HSAP_RETURN_IF_ERROR(d.Check(
        d.ModuleLoadData(&k->module_, c.binary.image.c_str()),
        absl::StrCat("cuModuleLoadData(", c.source.program_name, ", ", c.binary.target, ")")));
    struct Slot {
      const char* role;
      Kernel* kernel;
    };
    std::vector<Slot> slots = {Slot{"fwd", &k->fwd_},
                               Slot{"bwd", &k->bwd_},
                               Slot{"delta", &k->delta_},
                               Slot{"init", &k->init_},
                               Slot{"convert", &k->convert_},
                               Slot{"accumulate", &k->accumulate_},
                               Slot{"copy_chunks", &k->copy_chunks_},
                               Slot{"add_chunks", &k->add_chunks_},
                               Slot{"merge_entries", &k->merge_entries_},
                               Slot{"gather_stats", &k->gather_stats_},
                               Slot{"add_entries", &k->add_entries_}};
    // Configurations with a topology role have the fused forward, kMaxSteps = peers + 1.
    const int max_steps =
        c.source.config.role.num_peers > 0 ? c.source.config.role.num_peers + 1 : 0;
    if (max_steps > 0) slots.push_back(Slot{"fused_fwd", &k->fused_});
    for (Slot slot : slots) {
      HSAP_ASSIGN_OR_RETURN(jit::CudaKernelEntry entry, c.Entry(slot.role));
      HSAP_ASSIGN_OR_RETURN(std::string name, c.LoweredName(slot.role));
      Kernel& kernel = *slot.kernel;
      kernel.threads = entry.threads;
      kernel.smem = entry.dynamic_smem_bytes;
      kernel.tensor_core = entry.tensor_core;
      kernel.wgmma = entry.wgmma;
      kernel.key_tile_rows = c.source.tiles.wgmma_block_n;
      kernel.bwd_box_rows = c.source.tiles.wgmma_bwd_box_rows;
      HSAP_RETURN_IF_ERROR(d.Check(d.ModuleGetFunction(&kernel.function, k->module_, name.c_str()),
                                   absl::StrCat("cuModuleGetFunction(", name, ")")));
      if (kernel.smem > 48 * 1024) {
        HSAP_RETURN_IF_ERROR(d.Check(
            d.FuncSetAttribute(kernel.function, kCuFuncAttributeMaxDynamicSharedSize, kernel.smem),
            absl::StrCat("cuFuncSetAttribute(", entry.role, " kernel, ", kernel.smem,
                         " B shared memory)")));
      }
    }
    // The tensor-core forwards compute a whole tile of query rows per CTA chunk: the sm_90a
    // one 128 (WgmmaFwdShape::kBM), the mma.sync one its block_m (128 where each warp holds
    // two row blocks); work-list blocks of that size leave no warp idle.
    if (k->fwd_.wgmma) {
      k->forward_block_rows_ = 128;
    } else if (k->fwd_.tensor_core) {
      k->forward_block_rows_ = c.source.tiles.block_m;
    }
    if (max_steps > 0) {
      int per_sm = 0;
      HSAP_RETURN_IF_ERROR(d.Check(
          d.OccupancyMaxActiveBlocksPerMultiprocessor(
              &per_sm, k->fused_.function, k->fused_.threads, static_cast<size_t>(k->fused_.smem)),
          "cuOccupancyMaxActiveBlocksPerMultiprocessor(fused forward)"));
      k->fused_resident_ = per_sm * sm_count;
      k->max_fused_steps_ = max_steps;
      k->fused_copy_ctas_ = std::clamp(sm_count / 16, 1, 8);
    }
    return std::unique_ptr<DeviceKernels>(std::move(k));
  }

  absl::Status Forward(const hsap_dev::FwdParams& p, cudaStream s) const override {
    HSAP_RETURN_IF_ERROR(CheckAligned(fwd_, "attention forward", p.q, p.k, p.v));
    HSAP_ASSIGN_OR_RETURN(const LaunchGrid grid, AttentionGrid(p.num_blocks, p.heads_q));
    if (!fwd_.wgmma) return Launch(fwd_, "attention forward", grid, &p, s);
    if (grid.empty()) return absl::OkStatus();
    // The sm_90a forward: its Params, then the tensor maps of q, k and v by value.
    HSAP_ASSIGN_OR_RETURN(const WgmmaForwardMaps maps,
                          EncodeWgmmaForwardMaps(*driver_, p, dtype_, head_dim_,
                                                 fwd_.key_tile_rows));
    void* args[] = {const_cast<hsap_dev::FwdParams*>(&p), const_cast<TensorMapBytes*>(&maps.q),
                    const_cast<TensorMapBytes*>(&maps.k), const_cast<TensorMapBytes*>(&maps.v)};
    return LaunchArgs(fwd_, "attention forward (sm_90a)", grid, args, s);
  }
  absl::Status Backward(const hsap_dev::BwdParams& p, cudaStream s) const override {
    HSAP_RETURN_IF_ERROR(CheckAligned(bwd_, "attention backward", p.q, p.k, p.v));
    HSAP_ASSIGN_OR_RETURN(const LaunchGrid grid, AttentionGrid(p.num_blocks, p.heads_q));
    if (!bwd_.wgmma) return Launch(bwd_, "attention backward", grid, &p, s);
    if (grid.empty()) return absl::OkStatus();
    // The sm_90a backward: its Params, then the tensor maps of q, k, v and dout by value.
    HSAP_ASSIGN_OR_RETURN(
        const WgmmaBackwardMaps maps,
        EncodeWgmmaBackwardMaps(*driver_, p, dtype_, head_dim_, bwd_.bwd_box_rows));
    void* args[] = {const_cast<hsap_dev::BwdParams*>(&p), const_cast<TensorMapBytes*>(&maps.q),
                    const_cast<TensorMapBytes*>(&maps.k), const_cast<TensorMapBytes*>(&maps.v),
                    const_cast<TensorMapBytes*>(&maps.dout)};
    return LaunchArgs(bwd_, "attention backward (sm_90a)", grid, args, s);
  }
  absl::Status Delta(const hsap_dev::DeltaParams& p, cudaStream s) const override {
    return Launch(delta_, "delta", HelperGrid(p, helper_ctas_), &p, s);
  }
  absl::Status Init(const hsap_dev::InitParams& p, cudaStream s) const override {
    return Launch(init_, "init", HelperGrid(p, helper_ctas_), &p, s);
  }
  absl::Status Convert(const hsap_dev::ConvertParams& p, cudaStream s) const override {
    return Launch(convert_, "convert", HelperGrid(p, helper_ctas_), &p, s);
  }
  absl::Status Accumulate(const hsap_dev::AccumulateParams& p, cudaStream s) const override {
    return Launch(accumulate_, "accumulate", HelperGrid(p, helper_ctas_), &p, s);
  }
  absl::Status CopyChunks(const hsap_dev::ChunksParams& p, cudaStream s) const override {
    return Launch(copy_chunks_, "copy chunks", HelperGrid(p, helper_ctas_), &p, s);
  }
  absl::Status AddChunks(const hsap_dev::ChunksParams& p, cudaStream s) const override {
    return Launch(add_chunks_, "add chunks", HelperGrid(p, helper_ctas_), &p, s);
  }
  absl::Status MergeEntries(const hsap_dev::EntryMergeParams& p, cudaStream s) const override {
    return Launch(merge_entries_, "merge entries", HelperGrid(p, helper_ctas_), &p, s);
  }
  absl::Status GatherStats(const hsap_dev::StatsGatherParams& p, cudaStream s) const override {
    return Launch(gather_stats_, "gather stats", HelperGrid(p, helper_ctas_), &p, s);
  }
  absl::Status AddEntries(const hsap_dev::EntryAddParams& p, cudaStream s) const override {
    return Launch(add_entries_, "add entries", HelperGrid(p, helper_ctas_), &p, s);
  }

  int64_t forward_block_rows() const override { return forward_block_rows_; }
  int max_fused_steps() const override { return max_fused_steps_; }
  int fused_copy_ctas() const override { return fused_copy_ctas_; }
  int fused_resident_ctas() const override { return fused_resident_; }
  absl::Status FusedForward(const FusedForwardLaunch& launch, cudaStream s) const override {
    const int steps = static_cast<int>(launch.steps.size());
    if (max_fused_steps_ == 0 || steps > max_fused_steps_) {
      return absl::InternalError(absl::StrCat("fused forward of ", steps, " steps; these kernels ",
                                              "take at most ", max_fused_steps_));
    }
    if (steps == 0) return absl::OkStatus();
    if (fused_.wgmma) return FusedForwardWgmma(launch, s);
    HSAP_ASSIGN_OR_RETURN(const LaunchGrid grid,
                          FusedForwardGrid(launch.steps, launch.head.heads_q, fused_resident_,
                                           launch.share, fused_copy_ctas_));
    // FusedFwdParamsT<kMaxSteps>: the head, then kMaxSteps steps (unused ones zero).
    std::vector<char> params(kFusedStepsOffset + max_fused_steps_ * sizeof(hsap_dev::FusedStep), 0);
    hsap_dev::FusedFwdHead head = launch.head;
    head.num_steps = steps;
    head.num_copy_ctas = fused_copy_ctas_;
    std::memcpy(params.data(), &head, sizeof(head));
    std::memcpy(params.data() + kFusedStepsOffset, launch.steps.data(),
                launch.steps.size() * sizeof(hsap_dev::FusedStep));
    return Launch(fused_, "fused forward", grid, params.data(), s);
  }

 private:
  // Where the steps start in FusedFwdParamsT<N>, whatever N.
  static constexpr size_t kFusedStepsOffset = offsetof(hsap_dev::FusedFwdParamsT<1>, steps);
  static_assert(offsetof(hsap_dev::FusedFwdParamsT<16>, steps) == kFusedStepsOffset &&
                    sizeof(hsap_dev::FusedFwdParamsT<16>) ==
                        kFusedStepsOffset + 16 * sizeof(hsap_dev::FusedStep),
                "the fused parameters must be a head followed by the steps");

  JitDeviceKernels() = default;

  // The sm_90a fused forward: one launch per step (FusedWgmmaLaunches), each with the
  // forward's tensor maps of the buffer it attends.
  absl::Status FusedForwardWgmma(const FusedForwardLaunch& launch, cudaStream s) const {
    HSAP_ASSIGN_OR_RETURN(std::vector<FusedWgmmaLaunch> launches,
                          FusedWgmmaLaunches(launch.head, launch.steps, fused_copy_ctas_, head_dim_,
                                             static_cast<int>(DTypeSize(dtype_))));
    for (FusedWgmmaLaunch& l : launches) {
      if (l.grid.empty()) continue;  // the last step has no blocks
      HSAP_ASSIGN_OR_RETURN(
          WgmmaForwardMaps maps,
          EncodeWgmmaForwardMaps(*driver_, l.fwd, dtype_, head_dim_, fused_.key_tile_rows));
      void* args[] = {&l.fwd, &l.copy, &maps.q, &maps.k, &maps.v};
      HSAP_RETURN_IF_ERROR(LaunchArgs(fused_, "fused forward (sm_90a)", l.grid, args, s));
    }
    return absl::OkStatus();
  }

  // An empty grid launches nothing.
  template <typename Params>
  absl::Status Launch(const Kernel& k, const char* what, LaunchGrid grid, const Params* params,
                      cudaStream s) const {
    if (grid.empty()) return absl::OkStatus();
    void* args[] = {const_cast<void*>(static_cast<const void*>(params))};
    return LaunchArgs(k, what, grid, args, s);
  }
  // `args`: cuLaunchKernel's kernelParams, one pointer per kernel parameter.
  absl::Status LaunchArgs(const Kernel& k, const char* what, LaunchGrid grid, void** args,
                          cudaStream s) const {
    HSAP_RETURN_IF_ERROR(driver_->Check(driver_->CtxSetCurrent(context_), "cuCtxSetCurrent"));
    return driver_->Check(
        driver_->LaunchKernel(k.function, grid.x, grid.y, 1, static_cast<unsigned>(k.threads), 1, 1,
                              static_cast<unsigned>(k.smem), s, args, nullptr),
        absl::StrCat("cuLaunchKernel(", what, ", grid ", grid.x, "x", grid.y, ", ", k.threads,
                     " threads, ", k.smem, " B shared)"));
  }

  const CudaDriverApi* driver_ = nullptr;
  CUcontext context_ = nullptr;
  CUmodule module_ = nullptr;
  long long helper_ctas_ = 1;
  DType dtype_ = DType::kBF16;
  int head_dim_ = 0;
  Kernel fwd_, bwd_, delta_, init_, convert_, accumulate_, copy_chunks_, add_chunks_, fused_,
      merge_entries_, gather_stats_, add_entries_;
  int max_fused_steps_ = 0, fused_copy_ctas_ = 1, fused_resident_ = 0;
  int64_t forward_block_rows_ = 0;  // 0: the default block (kKernelBlockQ)
};

}  // namespace

absl::StatusOr<std::string> JitArchForDevice(const std::string& device_arch,
                                             const jit::CudaKernelConfig& config) {
  HSAP_ASSIGN_OR_RETURN(const bool sm90a, GetBoolParam(Param::kJitSm90a));
  return sm90a ? jit::JitCudaArch(device_arch, config) : device_arch;
}

absl::StatusOr<std::unique_ptr<DeviceKernels>> LoadJitDeviceKernels(jit::CudaKernelConfig config) {
  HSAP_RETURN_IF_ERROR(CheckCudaDevice());
  if (config.arch.empty()) {
    HSAP_ASSIGN_OR_RETURN(std::string arch, CurrentCudaArch());
    HSAP_ASSIGN_OR_RETURN(config.arch, JitArchForDevice(arch, config));
  }
  HSAP_ASSIGN_OR_RETURN(const CudaRuntimeApi* rt, LoadCudaRuntime());
  int device = 0, sms = 1;
  HSAP_RETURN_IF_ERROR(rt->Check(rt->GetDevice(&device), "cudaGetDevice"));
  HSAP_RETURN_IF_ERROR(
      rt->Check(rt->DeviceGetAttribute(&sms, kCudaDevAttrMultiProcessorCount, device),
                "cudaDeviceGetAttribute(multiprocessor count)"));
  // cudaFree(nullptr) initialises the device's primary context and makes it current.
  HSAP_RETURN_IF_ERROR(rt->Check(rt->Free(nullptr), "cudaFree(nullptr) (context set-up)"));
  HSAP_ASSIGN_OR_RETURN(jit::CompiledCudaKernels compiled,
                        jit::CompileCudaKernels(config, &jit::CompileCache::Global()));
  return JitDeviceKernels::Load(compiled, sms);
}

}  // namespace hsap::cuda
