#include "lib/cuda/exec/gpu_batch.h"

#include <map>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "jit/codegen_cuda.h"
#include "lib/cuda/exec/gpu_executor.h"
#include "lib/cuda/exec/gpu_hier_executor.h"
#include "lib/cuda/exec/jit_device_kernels.h"

namespace hsap::cuda {
namespace {

class GpuBatchDevice : public BatchDevice {
 public:
  GpuBatchDevice(std::shared_ptr<GpuComm> comm, std::shared_ptr<const DeviceKernels> kernels)
      : comm_(std::move(comm)), kernels_(std::move(kernels)) {}

  absl::Status Prepare(Transport& transport, const Schedule& schedule, const AttentionDims& dims,
                       DType dtype) override {
    ScopedDevice on(comm_->device());
    const absl::Status local = on.status().ok() ? PrepareLocal(schedule, dims, dtype) : on.status();
    // Every rank of a transport that offers peer windows exchanges them, also after a local
    // failure or without the fused kernel, so that the collectives stay in step.
    if (!transport.offers_peer_windows()) return local;
    PeerWindow& window = comm_->peer_window(transport.rank(), transport.size());
    const size_t kv_row_bytes =
        static_cast<size_t>(dims.heads_kv) * dims.head_dim * DTypeSize(dtype);
    absl::StatusOr<std::optional<FusedRoutes>> routes =
        window.Exchange(transport, schedule, kv_row_bytes, kernels_->fused_copy_ctas(),
                        kernels_->fused_resident_ctas(), comm_->stream(), comm_->timeout(),
                        /*willing=*/kernels_->max_fused_steps() > 0, local);
    if (!routes.ok()) return routes.status();
    if (!routes->has_value()) return absl::OkStatus();  // out of reach: stages, on every rank
    routes_ = **std::move(routes);
    window_ = &window;
    return absl::OkStatus();
  }

  absl::Status PrepareHierarchy(const RankHierarchy& rank, const AttentionDims& dims,
                                DType dtype) override {
    ScopedDevice on(comm_->device());
    if (!on.status().ok()) return on.status();
    absl::StatusOr<std::unique_ptr<DeviceHierProgram>> program =
        DeviceHierProgram::Build(comm_->device(), rank, dims, dtype, comm_->stream());
    if (!program.ok()) return program.status();
    if (absl::Status s = comm_->pool().Reserve((*program)->pool_bytes()); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("reserving the communicator's device pool (",
                                                 (*program)->pool_bytes(), " B): ", s.message()));
    }
    hier_ = *std::move(program);
    return absl::OkStatus();
  }

  absl::Status Forward(Transport& transport, uint64_t call_id, const void* q, const void* k,
                       const void* v, void* out, float* lse, HierTraffic* traffic) override {
    ScopedDevice on(comm_->device());
    if (!on.status().ok()) return on.status();
    absl::Status s;
    if (hier_ != nullptr) {
      s = GpuHierarchicalForward(HierContext(transport, call_id), q, k, v, out, lse, traffic);
    } else {
      ExecTraffic t;
      s = GpuExecuteForward(Context(transport, call_id), q, k, v, out, lse, &t);
      *traffic = HierTraffic{0, 0, t.bytes_sent, t.bytes_received};
    }
    if (!s.ok()) return s;
    // A fused forward that finishes here also reads its window's error word back, in the
    // same wait as its kernels. (With a caller's stream the call returns before the kernels
    // ran, and the word is not read.)
    uint32_t peer_errors = 0;
    const bool check = window_ != nullptr && comm_->synchronous() && mode_ == GpuExecMode::kFull;
    if (check) {
      if (absl::Status e = comm_->device().CopyAsync(&peer_errors, window_->error_word(),
                                                     sizeof(peer_errors), comm_->stream());
          !e.ok()) {
        return e;
      }
    }
    if (absl::Status done = Finish("forward"); !done.ok()) return done;
    return check ? PeerErrors(peer_errors) : absl::OkStatus();
  }

  absl::Status Backward(Transport& transport, uint64_t call_id, const void* dout, const void* q,
                        const void* k, const void* v, const void* out, const float* lse, void* dq,
                        void* dk, void* dv, HierTraffic* traffic) override {
    ScopedDevice on(comm_->device());
    if (!on.status().ok()) return on.status();
    absl::Status s;
    if (hier_ != nullptr) {
      s = GpuHierarchicalBackward(HierContext(transport, call_id), dout, q, k, v, out, lse, dq, dk,
                                  dv, traffic);
    } else {
      ExecTraffic t;
      s = GpuExecuteBackward(Context(transport, call_id), dout, q, k, v, out, lse, dq, dk, dv, &t);
      *traffic = HierTraffic{0, 0, t.bytes_sent, t.bytes_received};
    }
    if (!s.ok()) return s;
    return Finish("backward");
  }

  void set_mode(GpuExecMode mode) { mode_ = mode; }
  bool fused() const { return window_ != nullptr; }

 private:
  absl::Status PrepareLocal(const Schedule& schedule, const AttentionDims& dims, DType dtype) {
    schedule_ = &schedule;
    dims_ = dims;
    dtype_ = dtype;
    absl::StatusOr<PoolLayout> layout = ComputePoolLayout(schedule, dims, dtype);
    if (!layout.ok()) return layout.status();
    // Growing the pool frees the old block, which waits for the device.
    if (absl::Status s = comm_->pool().Reserve(layout->total_bytes()); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("reserving the communicator's device pool (",
                                                 layout->DebugString(), "): ", s.message()));
    }
    absl::StatusOr<std::unique_ptr<DeviceWorkLists>> lists =
        DeviceWorkLists::Upload(comm_->device(), schedule, comm_->stream());
    if (!lists.ok()) return lists.status();
    lists_ = *std::move(lists);
    return absl::OkStatus();
  }

  GpuExecContext Context(Transport& transport, uint64_t call_id) const {
    GpuExecContext ctx;
    ctx.device = &comm_->device();
    ctx.kernels = kernels_.get();
    ctx.transport = &transport;
    ctx.schedule = schedule_;
    ctx.lists = lists_.get();
    ctx.pool = comm_->pool().base();
    ctx.pool_bytes = comm_->pool().size();
    ctx.dims = dims_;
    ctx.dtype = dtype_;
    ctx.call_id = call_id;
    ctx.stream = comm_->stream();
    ctx.mode = mode_;
    ctx.window = window_;
    ctx.routes = &routes_;
    ctx.peer_timeout = comm_->timeout();
    return ctx;
  }

  GpuHierContext HierContext(Transport& transport, uint64_t call_id) const {
    GpuHierContext ctx;
    ctx.device = &comm_->device();
    ctx.kernels = kernels_.get();
    ctx.transport = &transport;
    ctx.program = hier_.get();
    ctx.pool = comm_->pool().base();
    ctx.pool_bytes = comm_->pool().size();
    ctx.call_id = call_id;
    ctx.stream = comm_->stream();
    ctx.mode = mode_;
    return ctx;
  }

  // A communicator without a caller's stream returns after the work finished.
  absl::Status Finish(const char* pass) {
    if (!comm_->synchronous()) return absl::OkStatus();
    return comm_->device().Synchronize(comm_->stream(), absl::Now() + comm_->timeout(),
                                       absl::StrCat(pass, " kernels"));
  }

  // The error word of a finished fused forward: a copy CTA that gave up on a peer marked
  // it, and the call's outputs are then invalid. Clears the word.
  absl::Status PeerErrors(uint32_t bits) {
    if (bits == 0) return absl::OkStatus();
    Device& device = comm_->device();
    const absl::Time deadline = absl::Now() + comm_->timeout();
    if (absl::Status s = device.ZeroAsync(window_->error_word(), sizeof(bits), comm_->stream());
        !s.ok()) {
      return s;
    }
    if (absl::Status s = device.Synchronize(comm_->stream(), deadline, "fused forward check");
        !s.ok()) {
      return s;
    }
    if ((bits & hsap_dev::kErrorPeerTimeout) != 0) {
      return absl::DeadlineExceededError(
          absl::StrCat("fused forward: a peer did not publish its K/V within ",
                       absl::FormatDuration(comm_->timeout()),
                       " (it failed or stopped calling); this call's outputs are invalid"));
    }
    return absl::InternalError(
        absl::StrCat("fused forward: the kernel reported error bits ", bits));
  }

  std::shared_ptr<GpuComm> comm_;
  std::shared_ptr<const DeviceKernels> kernels_;
  const Schedule* schedule_ = nullptr;
  AttentionDims dims_;
  DType dtype_ = DType::kBF16;
  std::unique_ptr<DeviceWorkLists> lists_;   // a batch without a plan
  std::unique_ptr<DeviceHierProgram> hier_;  // a batch under a plan
  GpuExecMode mode_ = GpuExecMode::kFull;
  PeerWindow* window_ = nullptr;  // the communicator's, when forward is fused
  FusedRoutes routes_;
};

}  // namespace

absl::StatusOr<std::shared_ptr<GpuComm>> GpuComm::Create(std::unique_ptr<Device> device,
                                                         cudaStream stream,
                                                         absl::Duration timeout) {
  std::shared_ptr<GpuComm> comm(new GpuComm());
  comm->device_ = std::move(device);
  comm->pool_ = std::make_unique<DeviceBufferPool>(*comm->device_);
  comm->timeout_ = timeout;
  if (stream != nullptr) {
    comm->stream_ = stream;
  } else {
    absl::StatusOr<cudaStream> s = comm->device_->CreateStream();
    if (!s.ok()) return s.status();
    comm->stream_ = *s;
    comm->owns_stream_ = true;
  }
  return comm;
}

PeerWindow& GpuComm::peer_window(int rank, int size) {
  if (window_ == nullptr) window_ = std::make_unique<PeerWindow>(*device_, rank, size);
  return *window_;
}

GpuComm::~GpuComm() {
  ScopedDevice on(*device_);
  window_.reset();  // waits until the peers finished reading it
  pool_.reset();    // waits for the device
  if (owns_stream_) device_->DestroyStream(stream_);
}

bool UsesFusedForward(const BatchDevice* device) {
  const auto* gpu = dynamic_cast<const GpuBatchDevice*>(device);
  return gpu != nullptr && gpu->fused();
}

bool SetGpuExecMode(BatchDevice* device, GpuExecMode mode) {
  auto* gpu = dynamic_cast<GpuBatchDevice*>(device);
  if (gpu == nullptr) return false;
  gpu->set_mode(mode);
  return true;
}

std::unique_ptr<BatchDevice> NewGpuBatchDevice(std::shared_ptr<GpuComm> comm,
                                               std::shared_ptr<const DeviceKernels> kernels) {
  return std::make_unique<GpuBatchDevice>(std::move(comm), std::move(kernels));
}

absl::StatusOr<std::shared_ptr<const DeviceKernels>> JitKernelsForBatch(const BatchOptions& options,
                                                                        const Layout& layout,
                                                                        bool fused) {
  absl::StatusOr<AttentionDims> dims = DimsFromOptions(options);
  if (!dims.ok()) return dims.status();
  absl::StatusOr<std::string> arch = CurrentCudaArch();
  if (!arch.ok()) return arch.status();
  jit::CudaKernelConfig config;
  config.arch = *arch;
  config.dtype = options.dtype;
  config.head_dim = dims->head_dim;
  config.gqa = dims->heads_q / dims->heads_kv;
  config.has_band = false;
  for (const MaskSlice& s : layout.slices()) config.has_band |= !s.IsFull();
  // The fused kernel takes up to 8 stages per launch (more run as further launches).
  if (fused) config.role = {7};
  if (absl::Status s = jit::ValidateCudaKernelConfig(config); !s.ok()) {
    return absl::Status(s.code(),
                        absl::StrCat("the CUDA kernels cannot serve this batch: ", s.message()));
  }

  // Loaded modules live as long as the process (one per configuration and device).
  int device = 0;
  if (absl::StatusOr<const CudaRuntimeApi*> rt = LoadCudaRuntime(); rt.ok()) {
    (*rt)->GetDevice(&device);
  }
  static std::mutex mu;
  static auto* loaded = new std::map<std::string, std::shared_ptr<const DeviceKernels>>();
  const std::string key = absl::StrCat(device, "/", config.Name());
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = loaded->find(key); it != loaded->end()) return it->second;
  absl::StatusOr<std::unique_ptr<DeviceKernels>> kernels = LoadJitDeviceKernels(config);
  if (!kernels.ok()) return kernels.status();
  std::shared_ptr<const DeviceKernels> shared = *std::move(kernels);
  loaded->emplace(key, shared);
  return shared;
}

}  // namespace hsap::cuda
