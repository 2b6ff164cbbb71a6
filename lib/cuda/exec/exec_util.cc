#include "lib/cuda/exec/exec_util.h"

#include <algorithm>

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
  absl::StatusOr<void*> memory = device.Allocate(std::max<size_t>(bytes_.size(), 1));
  if (!memory.ok()) return memory.status();
  DeviceBuffer buffer(&device, *memory);
  if (absl::Status s = device.CopyAsync(*memory, bytes_.data(), bytes_.size(), stream); !s.ok()) {
    return s;
  }
  if (absl::Status s = device.Synchronize(stream, absl::InfiniteFuture(), what); !s.ok()) {
    return s;
  }
  return buffer;
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
  absl::StatusOr<DeviceBuffer> memory = image.Upload(device, stream, "work-list upload");
  if (!memory.ok()) return memory.status();
  auto out = std::unique_ptr<DeviceWorkLists>(new DeviceWorkLists());
  out->memory_ = *std::move(memory);
  for (const HostImage::WorkListAt& w : at) {
    out->lists_.push_back(HostImage::At(static_cast<const char*>(out->memory_.get()), w));
  }
  return out;
}

}  // namespace hsap::cuda
