#include "lib/cuda/peer_window.h"

#include <unistd.h>

#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace hsap::cuda {
namespace {

// Header words: ready, error, 2 spare, 4 kernel counters, then consumed[size].
size_t HeaderBytes(int size) { return (4 * (8 + static_cast<size_t>(size)) + 255) / 256 * 256; }

// What each rank contributes to the exchange, followed by offset_of_step[size].
struct Record {
  uint64_t ok = 0;
  uint64_t pid = 0;
  uint64_t base = 0;
  uint64_t copy_ctas = 0;
};

}  // namespace

FusedExportLayout ExportLayoutOf(const Schedule& schedule, size_t kv_row_bytes) {
  FusedExportLayout out;
  out.offset_of_step.assign(static_cast<size_t>(schedule.num_ranks), kNoExport);
  for (const Stage& st : schedule.stages) {
    if (st.send_to < 0) continue;
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
  if (memory_ == nullptr) return;
  if (Drain(drain_stream_, absl::Now() + timeout_).ok()) device_.Free(memory_);
}

absl::Status PeerWindow::Drain(cudaStream stream, absl::Time deadline) {
  if (memory_ == nullptr) return absl::OkStatus();
  std::vector<uint32_t> seen(size_);
  for (;;) {
    if (absl::Status s = device_.CopyAsync(seen.data(), consumed(rank_, 0),
                                           seen.size() * sizeof(uint32_t), stream);
        !s.ok()) {
      return s;
    }
    if (absl::Status s = device_.Synchronize(stream, deadline, "peer window drain"); !s.ok()) {
      return s;
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
  if (absl::Status s = Drain(stream, absl::Now() + timeout); !s.ok()) return s;
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
  // A fresh window: nothing ready, nothing consumed.
  std::fill(copies_.begin(), copies_.end(), 0u);
  if (absl::Status s = device_.ZeroAsync(memory_, header_bytes_, stream); !s.ok()) return s;
  return device_.Synchronize(stream, absl::Now() + timeout, "peer window set-up");
}

absl::StatusOr<FusedRoutes> PeerWindow::Exchange(Transport& transport, const Schedule& schedule,
                                                 size_t kv_row_bytes, int copy_ctas,
                                                 cudaStream stream, absl::Duration timeout,
                                                 const absl::Status& local) {
  drain_stream_ = stream;
  timeout_ = timeout;
  const FusedExportLayout layout = ExportLayoutOf(schedule, kv_row_bytes);
  // Every rank exchanges, even one that could not grow: its peers learn it and stop too.
  const absl::Status grown = local.ok() ? Grow(layout.bytes, stream, timeout) : local;

  const size_t record_bytes = sizeof(Record) + size_ * sizeof(uint64_t);
  std::vector<char> mine(record_bytes), all(record_bytes * size_);
  Record r;
  r.ok = grown.ok() ? 1 : 0;
  r.pid = static_cast<uint64_t>(getpid());
  r.base = reinterpret_cast<uintptr_t>(bases_[rank_]);
  r.copy_ctas = static_cast<uint64_t>(copy_ctas);
  std::memcpy(mine.data(), &r, sizeof(r));
  std::memcpy(mine.data() + sizeof(r), layout.offset_of_step.data(), size_ * sizeof(uint64_t));
  if (absl::Status s = transport.AllGather(mine.data(), all.data(), record_bytes,
                                           "batch creation (peer windows)");
      !s.ok()) {
    return s;
  }
  if (!grown.ok()) return grown;

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
    if (records[q].pid != r.pid) {
      return absl::FailedPreconditionError(
          absl::StrCat("rank ", q, " runs in another process: peer windows need one process"));
    }
    if (records[q].copy_ctas != r.copy_ctas) {
      return absl::FailedPreconditionError(absl::StrCat("rank ", q, "'s fused kernels copy with ",
                                                        records[q].copy_ctas, " CTAs, rank ", rank_,
                                                        "'s with ", r.copy_ctas));
    }
  }
  for (int q = 0; q < size_; ++q) bases_[q] = reinterpret_cast<char*>(records[q].base);

  FusedRoutes routes;
  routes.copy_ctas = copy_ctas;
  for (const Stage& st : schedule.stages) {
    routes.write_offset.push_back(st.send_to >= 0 ? layout.offset_of_step[st.step] : kNoExport);
    routes.read_offset.push_back(st.recv_from >= 0 ? offsets[st.recv_from][st.step] : kNoExport);
    if (st.recv_from >= 0 && routes.read_offset.back() == kNoExport) {
      return absl::InternalError(absl::StrCat("rank ", st.recv_from, " exports nothing for step ",
                                              st.step, " that rank ", rank_, " reads"));
    }
  }
  return routes;
}

}  // namespace hsap::cuda
