#include "lib/cuda/exec/exec_util.h"

#include <algorithm>

#include "base/status_macros.h"

namespace hsap::cuda {

DeviceWorkLists::List HostImage::At(const char* base, const WorkListAt& at) {
  DeviceWorkLists::List l;
  l.blocks = reinterpret_cast<const hsap_dev::QueryBlock*>(base + at.blocks);
  l.segments = reinterpret_cast<const hsap_dev::KeySegment*>(base + at.segments);
  l.num_blocks = at.num_blocks;
  return l;
}

absl::StatusOr<DeviceBuffer> HostImage::Upload(Device& device, cudaStream stream,
                                               absl::string_view what) const {
  HSAP_ASSIGN_OR_RETURN(void* memory, device.Allocate(std::max<size_t>(bytes_.size(), 1)));
  DeviceBuffer buffer(&device, memory);
  HSAP_RETURN_IF_ERROR(device.CopyAsync(memory, bytes_.data(), bytes_.size(), stream));
  HSAP_RETURN_IF_ERROR(device.Synchronize(stream, absl::InfiniteFuture(), what));
  return buffer;
}

hsap_dev::FwdParams ForwardParams(const QuerySide& side, const void* q, float* out, float* lse) {
  hsap_dev::FwdParams p{};
  p.q = q;
  p.out = out;
  p.lse = lse;
  p.kv_head_of_q = side.kv_head_of_q;
  p.error_flag = nullptr;
  p.q_rows = side.q_rows;
  p.heads_q = side.heads_q;
  p.heads_kv = side.heads_kv;
  p.scale = side.scale;
  return p;
}

hsap_dev::BwdParams BackwardParams(const QuerySide& side, const void* q, const void* dout,
                                   const float* lse, const float* delta, float* dq) {
  hsap_dev::BwdParams p{};
  p.q = q;
  p.dout = dout;
  p.lse = lse;
  p.delta = delta;
  p.dq = dq;
  p.kv_head_of_q = side.kv_head_of_q;
  p.error_flag = nullptr;
  p.q_rows = side.q_rows;
  p.heads_q = side.heads_q;
  p.heads_kv = side.heads_kv;
  p.scale = side.scale;
  return p;
}

absl::Status LaunchForward(const DeviceKernels& kernels, hsap_dev::FwdParams p,
                           const DeviceWorkLists::List& list, const void* k, const void* v,
                           int64_t k_rows, cudaStream stream) {
  if (list.num_blocks == 0 || p.heads_q == 0) return absl::OkStatus();
  p.k = k;
  p.v = v;
  p.k_rows = k_rows;
  p.blocks = list.blocks;
  p.segments = list.segments;
  p.num_blocks = list.num_blocks;
  return kernels.Forward(p, stream);
}

absl::Status LaunchBackward(const DeviceKernels& kernels, hsap_dev::BwdParams p,
                            const DeviceWorkLists::List& list, const void* k, const void* v,
                            int64_t k_rows, float* dk, float* dv, cudaStream stream) {
  if (list.num_blocks == 0 || p.heads_q == 0) return absl::OkStatus();
  p.k = k;
  p.v = v;
  p.k_rows = k_rows;
  p.dk = dk;
  p.dv = dv;
  p.blocks = list.blocks;
  p.segments = list.segments;
  p.num_blocks = list.num_blocks;
  return kernels.Backward(p, stream);
}

absl::StatusOr<std::unique_ptr<DeviceWorkLists>> DeviceWorkLists::Upload(Device& device,
                                                                         const Schedule& schedule,
                                                                         cudaStream stream) {
  HostImage image;
  std::vector<HostImage::WorkListAt> at = {image.Add(schedule.local_work)};
  for (const Stage& st : schedule.stages) at.push_back(image.Add(st.recv_work));
  HSAP_ASSIGN_OR_RETURN(DeviceBuffer memory, image.Upload(device, stream, "work-list upload"));
  auto out = std::unique_ptr<DeviceWorkLists>(new DeviceWorkLists());
  out->memory_ = std::move(memory);
  for (const HostImage::WorkListAt& w : at) {
    out->lists_.push_back(HostImage::At(static_cast<const char*>(out->memory_.get()), w));
  }
  return out;
}

}  // namespace hsap::cuda
