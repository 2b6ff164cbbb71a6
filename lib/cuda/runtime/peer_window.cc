#include "lib/cuda/runtime/peer_window.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"

namespace hsap::cuda {
namespace {

// Header words: ready, error, 2 spare, 4 kernel counters, then consumed[size].
size_t HeaderBytes(int size) { return (4 * (8 + static_cast<size_t>(size)) + 255) / 256 * 256; }

// What each rank contributes to the exchange, followed by offset_of_step[size].
struct Record {
  uint64_t ok = 0;
  uint64_t base = 0;  // in its own address space
  uint64_t copy_ctas = 0;
  uint64_t exported = 0;  // `handle` holds the window
  DeviceLocation location;
  IpcHandle handle{};
};

bool SameText(const char* a, const char* b, size_t n) { return std::strncmp(a, b, n) == 0; }

}  // namespace

FusedExportLayout ExportLayoutOf(const Schedule& schedule, size_t kv_row_bytes) {
  FusedExportLayout out;
  out.offset_of_step.assign(static_cast<size_t>(schedule.num_ranks), kNoExport);
  for (const Stage& st : schedule.stages) {
    // Fan-out stages of relays (steps >= num_ranks) never run through windows.
    if (st.send_to < 0 || st.step >= schedule.num_ranks) continue;
    out.offset_of_step[st.step] = out.bytes;
    // K rows then V rows, each run 16-byte aligned for the copy CTAs' vector loads.
    out.bytes += (2 * static_cast<size_t>(st.send_rows) * kv_row_bytes + 255) / 256 * 256;
  }
  return out;
}

PeerWindow::PeerWindow(Device& device, int rank, int size)
    : device_(device),
      rank_(rank),
      size_(size),
      header_bytes_(HeaderBytes(size)),
      bases_(size, nullptr),
      copies_(size, 0) {}

PeerWindow::~PeerWindow() {
  if (memory_ == nullptr) {
    CloseAll();
    return;
  }
  // Drain also waits for this rank's own kernels (it synchronizes the stream), which may
  // read the peers' windows: only then are the mappings closed.
  if (Drain(drain_stream_, absl::Now() + timeout_).ok()) {
    CloseAll();
    device_.Free(memory_);
  }
}

void PeerWindow::CloseAll() {
  for (Mapping& m : opened_) {
    device_.ClosePeerMemory(m.base);
    m = Mapping{};
  }
}

absl::StatusOr<char*> PeerWindow::Open(int q, const IpcHandle& handle,
                                       const DeviceLocation& owner) {
  Mapping& m = opened_[q];
  if (m.base != nullptr && m.handle == handle) return m.base;
  if (m.base != nullptr) {
    device_.ClosePeerMemory(m.base);
    m = Mapping{};
  }
  HSAP_ASSIGN_OR_RETURN(void* p, device_.OpenPeerMemory(handle, owner));
  m.base = static_cast<char*>(p);
  m.handle = handle;
  return m.base;
}

absl::Status PeerWindow::Drain(cudaStream stream, absl::Time deadline) {
  if (memory_ == nullptr) return absl::OkStatus();
  auto seen = std::make_unique<uint32_t[]>(size_);
  for (;;) {
    HSAP_RETURN_IF_ERROR(
        device_.CopyAsync(seen.get(), consumed(rank_, 0), size_ * sizeof(uint32_t), stream));
    if (absl::Status synced = device_.Synchronize(stream, deadline, "peer window drain");
        !synced.ok()) {
      // The copy may still land (a stream stuck behind a kernel): leave it its memory.
      static_cast<void>(seen.release());
      return synced;
    }
    int behind = -1;
    for (int q = 0; q < size_ && behind < 0; ++q) {
      if (static_cast<int32_t>(seen[q] - copies_[q]) < 0) behind = q;
    }
    if (behind < 0) return absl::OkStatus();
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("rank ", rank_, ": rank ", behind, " has not finished reading this rank's ",
                       "peer window (", seen[behind], " of ", copies_[behind], " copies)"));
    }
    absl::SleepFor(absl::Microseconds(200));
  }
}

absl::Status PeerWindow::Grow(size_t export_bytes, cudaStream stream, absl::Duration timeout) {
  if (memory_ != nullptr && export_bytes <= export_capacity_) return absl::OkStatus();
  HSAP_RETURN_IF_ERROR(Drain(stream, absl::Now() + timeout));
  device_.Free(memory_);
  memory_ = nullptr;
  bases_[rank_] = nullptr;
  export_capacity_ = 0;
  absl::StatusOr<void*> m = device_.Allocate(header_bytes_ + export_bytes);
  if (!m.ok()) {
    return absl::Status(m.status().code(), absl::StrCat("peer window of ", export_bytes,
                                                        " B: ", m.status().message()));
  }
  memory_ = *m;
  bases_[rank_] = static_cast<char*>(memory_);
  export_capacity_ = export_bytes;
  // A device that cannot export (loopback ranks need not) only reaches its own process.
  absl::StatusOr<IpcHandle> handle = device_.ExportMemory(memory_);
  exported_ = handle.ok();
  if (exported_) handle_ = *handle;
  // A fresh window: nothing ready, nothing consumed.
  std::fill(copies_.begin(), copies_.end(), 0u);
  HSAP_RETURN_IF_ERROR(device_.ZeroAsync(memory_, header_bytes_, stream));
  return device_.Synchronize(stream, absl::Now() + timeout, "peer window set-up");
}

absl::StatusOr<std::optional<FusedRoutes>> PeerWindow::Exchange(
    Transport& transport, const Schedule& schedule, size_t kv_row_bytes, int copy_ctas,
    int resident_ctas, cudaStream stream, absl::Duration timeout, bool willing,
    const absl::Status& local) {
  drain_stream_ = stream;
  timeout_ = timeout;
  opened_.resize(size_);
  const FusedExportLayout layout = ExportLayoutOf(schedule, kv_row_bytes);
  // Every rank exchanges, even one that could not grow: its peers learn it and stop too.
  absl::Status mine_ok = local;
  if (mine_ok.ok()) {
    // A device without a location (no host name, no bus id) is only reached by ranks of
    // this process that have none either: loopback-like stand-ins.
    absl::StatusOr<DeviceLocation> at = device_.Location();
    if (at.ok()) {
      location_ = *at;
    } else if (at.status().code() == absl::StatusCode::kUnimplemented) {
      location_ = DeviceLocation{};
      location_.process = static_cast<uint64_t>(getpid());
    } else {
      mine_ok = at.status();
    }
  }
  if (mine_ok.ok() && willing) mine_ok = Grow(layout.bytes, stream, timeout);

  const size_t record_bytes = sizeof(Record) + size_ * sizeof(uint64_t);
  std::vector<char> mine(record_bytes), all(record_bytes * size_);
  Record r;
  r.ok = mine_ok.ok() ? 1 : 0;
  r.base = reinterpret_cast<uintptr_t>(memory_);
  r.copy_ctas = static_cast<uint64_t>(copy_ctas);
  r.exported = exported_ ? 1 : 0;
  r.location = location_;
  r.handle = handle_;
  std::memcpy(mine.data(), &r, sizeof(r));
  std::memcpy(mine.data() + sizeof(r), layout.offset_of_step.data(), size_ * sizeof(uint64_t));
  HSAP_RETURN_IF_ERROR(
      transport.AllGather(mine.data(), all.data(), record_bytes, "batch creation (peer windows)"));
  if (!mine_ok.ok()) return mine_ok;
  std::vector<Record> records(size_);
  std::vector<std::vector<uint64_t>> offsets(size_, std::vector<uint64_t>(size_));
  for (int q = 0; q < size_; ++q) {
    std::memcpy(&records[q], all.data() + q * record_bytes, sizeof(Record));
    std::memcpy(offsets[q].data(), all.data() + q * record_bytes + sizeof(Record),
                size_ * sizeof(uint64_t));
  }
  for (int q = 0; q < size_; ++q) {
    if (records[q].ok == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("rank ", q, " could not set up its peer window (its own error says why)"));
    }
  }

  // Map every peer's window: the same process and device use its address, another process
  // of this host opens its handle; anything else is out of reach.
  const DeviceLocation& me = r.location;
  int share = 0;  // ranks whose fused kernels run on this device, whatever their process
  // This rank's kernels may still read mappings about to change.
  bool reach_all =
      willing && device_.Synchronize(stream, absl::Now() + timeout, "peer window exchange").ok();
  for (int q = 0; q < size_ && willing; ++q) {
    const Record& p = records[q];
    reach_all &= p.base != 0;  // a rank that is not willing has no window
    const bool same_host = SameText(p.location.host.data(), me.host.data(), me.host.size());
    const bool same_device =
        same_host && SameText(p.location.device.data(), me.device.data(), me.device.size());
    if (same_device) ++share;
    if (p.location.process == me.process) {
      if (q == rank_ || same_device) {
        bases_[q] = reinterpret_cast<char*>(p.base);
      } else {
        reach_all = false;  // one process, two GPUs: peer access is not set up here
      }
    } else if (p.exported != 0 && same_host) {
      // A window that cannot be mapped is nobody's to read any more, also for batches
      // made before (their calls then fail instead of reading a freed window).
      absl::StatusOr<char*> base = Open(q, p.handle, p.location);
      reach_all &= base.ok();
      bases_[q] = base.ok() ? *base : nullptr;
    } else {
      reach_all = false;
    }
    reach_all &= p.copy_ctas == r.copy_ctas;
  }
  // Each fused kernel on this GPU gets 1/share of the resident CTAs: copy CTAs and at least
  // one compute CTA must fit, or a launch would fail in the middle of a call.
  reach_all &= resident_ctas == 0 || resident_ctas / std::max(1, share) > copy_ctas;
  // All or none: the ranks agree whether this batch uses the windows.
  const uint64_t verdict = reach_all ? 1 : 0;
  std::vector<uint64_t> verdicts(size_);
  HSAP_RETURN_IF_ERROR(transport.AllGather(&verdict, verdicts.data(), sizeof(uint64_t),
                                           "batch creation (peer window reach)"));
  for (uint64_t v : verdicts) {
    if (v == 0) return std::optional<FusedRoutes>();
  }

  FusedRoutes routes;
  routes.copy_ctas = copy_ctas;
  routes.share = std::max(1, share);
  for (const Stage& st : schedule.stages) {
    if (st.step >= size_) {
      return absl::InternalError(
          "a schedule with relays (ranks on several nodes) cannot move K/V through peer windows");
    }
    routes.write_offset.push_back(st.send_to >= 0 ? layout.offset_of_step[st.step] : kNoExport);
    routes.read_offset.push_back(st.recv_from >= 0 ? offsets[st.recv_from][st.step] : kNoExport);
    if (st.recv_from >= 0 && routes.read_offset.back() == kNoExport) {
      return absl::InternalError(absl::StrCat("rank ", st.recv_from, " exports nothing for step ",
                                              st.step, " that rank ", rank_, " reads"));
    }
  }
  return std::optional<FusedRoutes>(std::move(routes));
}

}  // namespace hsap::cuda
