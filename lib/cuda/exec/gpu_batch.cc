#include "lib/cuda/exec/gpu_batch.h"

#include <map>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"
#include "jit/codegen_cuda.h"
#include "lib/cuda/exec/gpu_executor.h"
#include "lib/cuda/exec/gpu_hier_executor.h"
#include "lib/cuda/exec/jit_device_kernels.h"

namespace hsap::cuda {
namespace {

// What both GPU runners share: the communicator, the kernels, the mode, the stream of a
// call and its order after the communicator's previous calls, and the end of a call.
class GpuRunner : public BatchRunner {
 public:
  GpuRunner(std::shared_ptr<GpuComm> comm, std::shared_ptr<const DeviceKernels> kernels)
      : comm_(std::move(comm)), kernels_(std::move(kernels)) {}
  void set_mode(GpuExecMode mode) { mode_ = mode; }
  void set_engines(BatchEngines engines) { engines_ = std::move(engines); }
  const BatchEngines& engines() const { return engines_; }
  // The cuDNN engine's calls of the batch (null when cuDNN has no piece of it).
  virtual const CudnnSteps* cudnn_steps() const = 0;

 protected:
  // The stream of this call: the caller's (set_call_stream) or the communicator's.
  cudaStream CallStream() const {
    return call_stream() != nullptr ? static_cast<cudaStream>(call_stream()) : comm_->stream();
  }
  // Whether the call returns after its work finished: on a communicator without a caller's
  // stream, called without a stream of its own.
  bool Synchronous() const { return comm_->synchronous() && call_stream() == nullptr; }
  // Orders the call after the communicator's previous calls (they share its pool).
  absl::Status Begin() { return comm_->OrderAfterCalls(CallStream()); }
  // The end of a call whose enqueueing returned `enqueued`: marked also after a failure (the
  // next call then waits for what was enqueued); a synchronous call waits for its work.
  absl::Status Finish(const char* pass, const absl::Status& enqueued) {
    const absl::Status end = comm_->EndCall(CallStream());
    HSAP_RETURN_IF_ERROR(enqueued);
    HSAP_RETURN_IF_ERROR(end);
    if (!Synchronous()) return absl::OkStatus();
    return comm_->device().Synchronize(comm_->stream(), absl::Now() + comm_->timeout(),
                                       absl::StrCat(pass, " kernels"));
  }

  std::shared_ptr<GpuComm> comm_;
  std::shared_ptr<const DeviceKernels> kernels_;
  GpuExecMode mode_ = GpuExecMode::kFull;
  BatchEngines engines_;
};

// A batch without a plan: the GPU ring executor over a DeviceRingProgram built once, with
// the fused forward through peer windows when every rank reaches every other's.
class GpuRingRunner : public GpuRunner {
 public:
  GpuRingRunner(std::shared_ptr<GpuComm> comm, std::shared_ptr<const DeviceKernels> kernels,
                Transport& transport, const Topology& topology,
                std::unique_ptr<DeviceRingProgram> program, PeerWindow* window, FusedRoutes routes,
                std::unique_ptr<CudnnSteps> cudnn)
      : GpuRunner(std::move(comm), std::move(kernels)),
        program_(std::move(program)),
        window_(window),
        routes_(std::move(routes)),
        cudnn_(std::move(cudnn)) {
    ctx_.cudnn = cudnn_.get();
    ctx_.device = &comm_->device();
    ctx_.kernels = kernels_.get();
    ctx_.transport = &transport;
    ctx_.program = program_.get();
    ctx_.window = window_;
    ctx_.routes = &routes_;
    ctx_.peer_timeout = comm_->timeout();
    ctx_.topology = &topology;
  }

  absl::Status Forward(uint64_t call_id, const void* q, const void* k, const void* v, void* out,
                       float* lse, CallTraffic& traffic) override {
    ScopedDevice on(comm_->device());
    HSAP_RETURN_IF_ERROR(on.status());
    HSAP_RETURN_IF_ERROR(Begin());
    ExecTraffic t;
    absl::Status s = GpuExecuteForward(Context(call_id), q, k, v, out, lse, &t);
    if (s.ok()) traffic = Traffic(t);
    // A fused forward that finishes here also reads its window's error word back, in the
    // same wait as its kernels. (With a caller's stream the call returns before the kernels
    // ran, and the word is not read.)
    uint32_t peer_errors = 0;
    const bool check = s.ok() && window_ != nullptr && Synchronous() && mode_ == GpuExecMode::kFull;
    if (check) {
      s = comm_->device().CopyAsync(&peer_errors, window_->error_word(), sizeof(peer_errors),
                                    comm_->stream());
    }
    HSAP_RETURN_IF_ERROR(Finish("forward", s));
    return check ? PeerErrors(peer_errors) : absl::OkStatus();
  }

  absl::Status Backward(uint64_t call_id, const void* dout, const void* q, const void* k,
                        const void* v, const void* out, const float* lse, void* dq, void* dk,
                        void* dv, CallTraffic& traffic) override {
    ScopedDevice on(comm_->device());
    HSAP_RETURN_IF_ERROR(on.status());
    HSAP_RETURN_IF_ERROR(Begin());
    ExecTraffic t;
    const absl::Status s =
        GpuExecuteBackward(Context(call_id), dout, q, k, v, out, lse, dq, dk, dv, &t);
    if (s.ok()) traffic = Traffic(t);
    return Finish("backward", s);
  }

  bool fused() const { return window_ != nullptr; }

 private:
  // Everything moves along the ring; the executor counted it by link class.
  static CallTraffic Traffic(const ExecTraffic& t) {
    CallTraffic out;
    out.ring_sent = t.bytes_sent;
    out.ring_received = t.bytes_received;
    out.links_counted = true;
    out.links = {t.intra_node_sent, t.intra_node_received, t.inter_node_sent,
                 t.inter_node_received};
    return out;
  }

  GpuExecContext Context(uint64_t call_id) {
    ctx_.stream = CallStream();
    ctx_.pool = comm_->pool().base();
    ctx_.pool_bytes = comm_->pool().size();
    ctx_.call_id = call_id;
    ctx_.mode = mode_;
    return ctx_;
  }

  // The error word of a finished fused forward: a copy CTA that gave up on a peer marked
  // it, and the call's outputs are then invalid. Clears the word.
  absl::Status PeerErrors(uint32_t bits) {
    if (bits == 0) return absl::OkStatus();
    Device& device = comm_->device();
    const absl::Time deadline = absl::Now() + comm_->timeout();
    HSAP_RETURN_IF_ERROR(device.ZeroAsync(window_->error_word(), sizeof(bits), comm_->stream()));
    HSAP_RETURN_IF_ERROR(device.Synchronize(comm_->stream(), deadline, "fused forward check"));
    if ((bits & hsap_dev::kErrorPeerTimeout) != 0) {
      return absl::DeadlineExceededError(
          absl::StrCat("fused forward: a peer did not publish its K/V within ",
                       absl::FormatDuration(comm_->timeout()),
                       " (it failed or stopped calling); this call's outputs are invalid"));
    }
    if ((bits & hsap_dev::kErrorStalled) != 0) {
      return absl::DeadlineExceededError(absl::StrCat(
          "fused forward: CTAs of the kernel waited ", absl::FormatDuration(2 * comm_->timeout()),
          " for work of other CTAs of the same launch while nothing moved (CTAs that never ",
          "became resident, or a kernel bug); this call's outputs are invalid"));
    }
    return absl::InternalError(
        absl::StrCat("fused forward: the kernel reported error bits ", bits));
  }

  std::unique_ptr<DeviceRingProgram> program_;
  PeerWindow* window_ = nullptr;  // the communicator's, when forward is fused
  FusedRoutes routes_;
  std::unique_ptr<CudnnSteps> cudnn_;  // the cuDNN engine's calls, when it has pieces

 public:
  const CudnnSteps* cudnn_steps() const override { return cudnn_.get(); }
  GpuExecContext ctx_;                 // what does not change between calls
};

// A batch under a plan: the GPU plan executor over the rank's DeviceHierProgram.
class GpuPlanRunner : public GpuRunner {
 public:
  GpuPlanRunner(std::shared_ptr<GpuComm> comm, std::shared_ptr<const DeviceKernels> kernels,
                Transport& transport, std::unique_ptr<DeviceHierProgram> program,
                std::vector<int> node_of_rank, std::unique_ptr<CudnnSteps> cudnn)
      : GpuRunner(std::move(comm), std::move(kernels)),
        program_(std::move(program)),
        node_of_rank_(std::move(node_of_rank)),
        cudnn_(std::move(cudnn)) {
    ctx_.cudnn = cudnn_.get();
    ctx_.node_of_rank = &node_of_rank_;
    ctx_.device = &comm_->device();
    ctx_.kernels = kernels_.get();
    ctx_.transport = &transport;
    ctx_.program = program_.get();
  }

  absl::Status Forward(uint64_t call_id, const void* q, const void* k, const void* v, void* out,
                       float* lse, CallTraffic& traffic) override {
    ScopedDevice on(comm_->device());
    HSAP_RETURN_IF_ERROR(on.status());
    HSAP_RETURN_IF_ERROR(Begin());
    const absl::Status s =
        GpuHierarchicalForward(Context(call_id), q, k, v, out, lse, &traffic, &traffic.links);
    traffic.links_counted = true;
    return Finish("forward", s);
  }

  absl::Status Backward(uint64_t call_id, const void* dout, const void* q, const void* k,
                        const void* v, const void* out, const float* lse, void* dq, void* dk,
                        void* dv, CallTraffic& traffic) override {
    ScopedDevice on(comm_->device());
    HSAP_RETURN_IF_ERROR(on.status());
    HSAP_RETURN_IF_ERROR(Begin());
    const absl::Status s = GpuHierarchicalBackward(Context(call_id), dout, q, k, v, out, lse, dq,
                                                   dk, dv, &traffic, &traffic.links);
    traffic.links_counted = true;
    return Finish("backward", s);
  }

 private:
  GpuHierContext Context(uint64_t call_id) {
    ctx_.stream = CallStream();
    ctx_.pool = comm_->pool().base();
    ctx_.pool_bytes = comm_->pool().size();
    ctx_.call_id = call_id;
    ctx_.mode = mode_;
    return ctx_;
  }

  std::unique_ptr<DeviceHierProgram> program_;
  std::vector<int> node_of_rank_;      // the communicator's (empty: one node)
  std::unique_ptr<CudnnSteps> cudnn_;  // the cuDNN engine's calls, when it has pieces

 public:
  const CudnnSteps* cudnn_steps() const override { return cudnn_.get(); }
  GpuHierContext ctx_;                 // what does not change between calls
};

// A ring schedule's steps: local work, then each stage's.
std::vector<const WorkList*> RingSteps(const Schedule& schedule) {
  std::vector<const WorkList*> steps = {&schedule.local_work};
  for (const Stage& stage : schedule.stages) steps.push_back(&stage.recv_work);
  return steps;
}

// A plan rank's steps: local work, then each sub-ring step's.
std::vector<const WorkList*> PlanSteps(const RankHierarchy& rank) {
  std::vector<const WorkList*> steps = {&rank.local_work};
  for (const SubRingStep& step : rank.steps) steps.push_back(&step.recv_work);
  return steps;
}

// The cuDNN engine's calls of a batch whose engine choice gave cuDNN pieces (null when it
// gave none); `engines` decided over `steps`.
absl::StatusOr<std::unique_ptr<CudnnSteps>> BuildCudnnSteps(
    Device& device, const EngineSetup& setup, const BatchEngines& engines,
    const std::vector<const WorkList*>& steps, const EngineShape& shape, float scale,
    cudaStream stream) {
  if (engines.tally().pieces[static_cast<int>(AttentionEngine::kCudnn)] == 0) {
    return std::unique_ptr<CudnnSteps>();
  }
  if (setup.runner == nullptr) {  // Decide gives cuDNN no piece without a runner
    return absl::InternalError("cuDNN pieces were chosen without a cuDNN piece runner");
  }
  const SdpaShape sdpa{shape.dtype, shape.head_dim, shape.heads_q, shape.heads_kv, scale};
  return CudnnSteps::Build(device, engines, steps, sdpa, setup.runner, stream);
}

// A plan rank's engine shape: its own heads and kv-head map.
EngineShape PlanShape(const RankHierarchy& rank, const AttentionDims& dims, DType dtype) {
  EngineShape shape = EngineShapeOf(dims, dtype);
  if (!rank.q_heads.empty()) {
    shape.heads_q = static_cast<int>(rank.q_heads.size());
    shape.heads_kv = static_cast<int>(rank.kv_heads.size());
    const int ratio = shape.heads_kv > 0 ? shape.heads_q / shape.heads_kv : 0;
    for (size_t h = 0; h < rank.kv_head_of_q.size(); ++h) {
      shape.grouped_heads &= ratio > 0 && rank.kv_head_of_q[h] == static_cast<int>(h) / ratio;
    }
  }
  return shape;
}

class GpuRunnerFactory : public RunnerFactory {
 public:
  GpuRunnerFactory(std::shared_ptr<GpuComm> comm, std::shared_ptr<const DeviceKernels> kernels,
                   EngineSetup engines)
      : comm_(std::move(comm)), kernels_(std::move(kernels)), engines_(std::move(engines)) {
    // The executors run cuDNN pieces exactly when there is a runner for them.
    engines_.has_piece_runner = engines_.runner != nullptr;
  }

  bool RunsRelays() const override { return true; }
  // The plan executor runs the hierarchy's node fan-outs (gpu_hier_executor.h).
  bool RunsPlanFanOuts() const override { return true; }
  // The sm_90a forward's 128-row tile where its kernels are those (the default elsewhere).
  int64_t WorkBlockRows() const override {
    const int64_t rows = kernels_ != nullptr ? kernels_->forward_block_rows() : 0;
    return rows > 0 ? rows : kKernelBlockQ;
  }

  absl::StatusOr<std::unique_ptr<BatchRunner>> ForSchedule(Communicator& comm,
                                                           const Schedule& schedule,
                                                           const AttentionDims& dims,
                                                           DType dtype) override {
    Transport& transport = comm.transport();
    ScopedDevice on(comm_->device());
    const absl::Status ready = AfterCalls(on);
    absl::StatusOr<std::unique_ptr<DeviceRingProgram>> program =
        ready.ok() ? DeviceRingProgram::Build(comm_->device(), schedule, dims, dtype,
                                              comm_->stream(), &comm_->pool())
                   : ready;
    const std::vector<const WorkList*> steps = RingSteps(schedule);
    absl::StatusOr<BatchEngines> engines =
        BatchEngines::Decide(engines_, EngineShapeOf(dims, dtype), steps);
    if (program.ok() && !engines.ok()) program = engines.status();
    absl::StatusOr<std::unique_ptr<CudnnSteps>> cudnn = std::unique_ptr<CudnnSteps>();
    if (program.ok()) {
      cudnn = BuildCudnnSteps(comm_->device(), engines_, *engines, steps,
                              EngineShapeOf(dims, dtype), dims.scale, comm_->stream());
      if (!cudnn.ok()) program = cudnn.status();
    }
    // The fused kernel attends whole stages: not with cuDNN pieces.
    const bool cudnn_pieces = cudnn.ok() && *cudnn != nullptr;
    // Every rank of a transport that offers peer windows exchanges them, also after a local
    // failure or without the fused kernel, so that the collectives stay in step. Ranks on
    // several nodes relay K/V (schedule.h), which the fused forward does not: stages.
    PeerWindow* window = nullptr;
    FusedRoutes routes;
    if (OffersPeerWindows(transport)) {
      PeerWindow& w = comm_->peer_window(transport.rank(), transport.size());
      const size_t kv_row_bytes =
          static_cast<size_t>(dims.heads_kv) * dims.head_dim * DTypeSize(dtype);
      HSAP_ASSIGN_OR_RETURN(
          std::optional<FusedRoutes> reached,
          w.Exchange(transport, schedule, kv_row_bytes, kernels_->fused_copy_ctas(),
                     kernels_->fused_resident_ctas(), comm_->stream(), comm_->timeout(),
                     /*willing=*/kernels_->max_fused_steps() > 0 && comm.topology().single_node() &&
                         !cudnn_pieces,
                     program.status()));
      if (reached.has_value()) {  // else out of reach: stages, on every rank
        routes = *std::move(reached);
        window = &w;
      }
    }
    HSAP_RETURN_IF_ERROR(program.status());
    auto runner = std::make_unique<GpuRingRunner>(comm_, kernels_, transport, comm.topology(),
                                                  *std::move(program), window, std::move(routes),
                                                  *std::move(cudnn));
    runner->set_engines(*std::move(engines));
    return runner;
  }

  absl::StatusOr<std::unique_ptr<BatchRunner>> ForHierarchy(Communicator& comm,
                                                            const RankHierarchy& rank,
                                                            const AttentionDims& dims,
                                                            DType dtype) override {
    ScopedDevice on(comm_->device());
    HSAP_RETURN_IF_ERROR(AfterCalls(on));
    const EngineShape shape = PlanShape(rank, dims, dtype);
    const std::vector<const WorkList*> steps = PlanSteps(rank);
    HSAP_ASSIGN_OR_RETURN(BatchEngines engines, BatchEngines::Decide(engines_, shape, steps));
    HSAP_ASSIGN_OR_RETURN(
        std::unique_ptr<DeviceHierProgram> program,
        DeviceHierProgram::Build(comm_->device(), rank, dims, dtype, comm_->stream()));
    HSAP_ASSIGN_OR_RETURN(std::unique_ptr<CudnnSteps> cudnn,
                          BuildCudnnSteps(comm_->device(), engines_, engines, steps, shape,
                                          dims.scale, comm_->stream()));
    HSAP_RETURN_IF_ERROR(
        comm_->pool().Reserve(program->pool_bytes(), absl::StrCat(program->pool_bytes(), " B")));
    auto runner =
        std::make_unique<GpuPlanRunner>(comm_, kernels_, comm.transport(), std::move(program),
                                        comm.topology().node_of_rank(), std::move(cudnn));
    runner->set_engines(std::move(engines));
    return runner;
  }

 private:
  // The communicator's stream after the calls enqueued so far (on callers' streams too): a
  // new batch's uploads and pool or window growth must not overtake them.
  absl::Status AfterCalls(const ScopedDevice& on) {
    HSAP_RETURN_IF_ERROR(on.status());
    return comm_->OrderAfterCalls(comm_->stream());
  }

  std::shared_ptr<GpuComm> comm_;
  std::shared_ptr<const DeviceKernels> kernels_;
  EngineSetup engines_;
};

}  // namespace

absl::StatusOr<std::shared_ptr<GpuComm>> GpuComm::Create(std::unique_ptr<Device> device,
                                                         cudaStream stream,
                                                         absl::Duration timeout) {
  std::shared_ptr<GpuComm> comm(new GpuComm());
  comm->device_ = std::move(device);
  comm->pool_ = std::make_unique<DeviceBufferPool>(*comm->device_);
  comm->timeout_ = timeout;
  HSAP_ASSIGN_OR_RETURN(comm->probe_, comm->device_->CreateEvent());
  HSAP_ASSIGN_OR_RETURN(comm->last_call_, comm->device_->CreateEvent());
  if (stream != nullptr) {
    // Refused here rather than at every call.
    HSAP_RETURN_IF_ERROR(comm->CheckStream(stream, "the communicator's CUDA stream"));
    comm->stream_ = stream;
  } else {
    HSAP_ASSIGN_OR_RETURN(cudaStream s, comm->device_->CreateStream());
    comm->stream_ = s;
    comm->owns_stream_ = true;
  }
  return comm;
}

absl::Status GpuComm::CheckStream(cudaStream stream, absl::string_view what) {
  // Kernels launch only on a stream of their device: a caller's stream of another GPU would
  // fail the call's first launch. An event of the device records only on its streams, so one
  // record tells.
  ScopedDevice on(*device_);
  HSAP_RETURN_IF_ERROR(on.status());
  const absl::Status same_device = device_->RecordEvent(probe_, stream);
  if (same_device.ok()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      what,
      " is not a stream of its device (the communicator's: the device current when the "
      "communicator was created); pass a stream created on that device: ",
      same_device.message()));
}

absl::Status GpuComm::OrderAfterCalls(cudaStream stream) {
  if (last_stream_ == nullptr || last_stream_ == stream) return absl::OkStatus();
  return device_->StreamWaitEvent(stream, last_call_);
}

absl::Status GpuComm::EndCall(cudaStream stream) {
  HSAP_RETURN_IF_ERROR(device_->RecordEvent(last_call_, stream));
  last_stream_ = stream;
  return absl::OkStatus();
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
  for (cudaEvent e : {probe_, last_call_}) {
    if (e != nullptr) device_->DestroyEvent(e);
  }
}

bool UsesFusedForward(const BatchRunner* runner) {
  const auto* ring = dynamic_cast<const GpuRingRunner*>(runner);
  return ring != nullptr && ring->fused();
}

const BatchEngines* EnginesOf(const BatchRunner* runner) {
  const auto* gpu = dynamic_cast<const GpuRunner*>(runner);
  return gpu == nullptr ? nullptr : &gpu->engines();
}

std::string EngineReportOf(const BatchRunner* runner) {
  const auto* gpu = dynamic_cast<const GpuRunner*>(runner);
  if (gpu == nullptr) return "";
  const CudnnSteps* cudnn = gpu->cudnn_steps();
  return gpu->engines().tally().ToString() + (cudnn != nullptr ? cudnn->RuntimeNote() : "");
}

EngineShape EngineShapeOf(const AttentionDims& dims, DType dtype) {
  EngineShape shape;
  shape.dtype = dtype;
  shape.head_dim = dims.head_dim;
  shape.heads_q = dims.heads_q;
  shape.heads_kv = dims.heads_kv;
  shape.grouped_heads = true;  // a batch without a plan reads K/V head h / (Hq / Hkv)
  return shape;
}

bool SetGpuExecMode(BatchRunner* runner, GpuExecMode mode) {
  auto* gpu = dynamic_cast<GpuRunner*>(runner);
  if (gpu == nullptr) return false;
  gpu->set_mode(mode);
  return true;
}

std::unique_ptr<RunnerFactory> NewGpuRunners(std::shared_ptr<GpuComm> comm,
                                             std::shared_ptr<const DeviceKernels> kernels,
                                             EngineSetup engines) {
  return std::make_unique<GpuRunnerFactory>(std::move(comm), std::move(kernels),
                                            std::move(engines));
}

absl::StatusOr<std::shared_ptr<const DeviceKernels>> JitKernelsForBatch(const BatchOptions& options,
                                                                        const Layout& layout,
                                                                        bool fused) {
  HSAP_ASSIGN_OR_RETURN(AttentionDims dims, DimsFromOptions(options));
  HSAP_ASSIGN_OR_RETURN(std::string arch, CurrentCudaArch());
  jit::CudaKernelConfig config;
  config.arch = arch;
  config.dtype = options.dtype;
  config.head_dim = dims.head_dim;
  config.gqa = dims.heads_q / dims.heads_kv;
  config.has_band = false;
  for (const MaskSlice& s : layout.slices()) config.has_band |= !s.IsFull();
  // The fused kernel takes up to 8 stages per launch (more run as further launches).
  if (fused) config.role = {7};
  // Compute capability 9.0: the sm_90a variant (wgmma/TMA forward and backward) where it applies.
  HSAP_ASSIGN_OR_RETURN(config.arch, JitArchForDevice(arch, config));
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
  HSAP_ASSIGN_OR_RETURN(std::unique_ptr<DeviceKernels> kernels, LoadJitDeviceKernels(config));
  std::shared_ptr<const DeviceKernels> shared = std::move(kernels);
  loaded->emplace(key, shared);
  return shared;
}

}  // namespace hsap::cuda
