// Peer windows: the memory through which the fused forward moves K/V between ranks that can
// address each other's device memory (Transport::offers_peer_windows), instead of
// send/receive stages.
//
// Each rank of the communicator owns one window of device memory:
//   header: word 0 `ready` (the number of the last fused call whose export is complete),
//           word 1 the error word of this rank's fused kernels, words 4..7 their counters,
//           words 8 + q: `consumed[q]`, the copy CTAs of reader q that finished reading
//           this rank's export, counted over the window's lifetime;
//   export: this rank's K/V rows for every peer of the batch's schedule, stage by stage
//           (K rows, then V rows), at offsets given by FusedExportLayout.
// A rank reaches a peer's window directly when both are in one process on one device
// (loopback ranks), or through CUDA IPC when they are processes of one host whose GPUs have
// peer access and native atomics over the link (NVLink, or PCIe P2P with atomics: the NCCL
// ranks of one node).
//
// A fused forward call (gpu_executor.cc), numbered n on every rank alike:
//   owner  -- waits on its stream until consumed[q] reached what every reader q of the
//             previous calls copied (the export is free again), packs its rows into the
//             export, writes ready = n;
//   reader -- launches fused_fwd_kernel whose copy CTAs wait for each sender's ready >= n
//             (with the communicator's timeout), copy the rows from the sender's export and
//             add to the sender's consumed[reader], while its compute CTAs attend.
// No host waits, no send/receive stage: the streams meet through the flags.
//
// Windows are created and grown collectively at batch creation (Exchange): every rank
// learns every rank's window, location and export layout through Transport::AllGather, maps
// the windows it can reach, and a second gather tells whether every rank reached every
// other; if not, no rank uses the windows for that batch (they fall back to stages). Growing
// first waits (host, with the deadline) until every reader finished with the old window.
#ifndef HSAP_LIB_CUDA_RUNTIME_PEER_WINDOW_H_
#define HSAP_LIB_CUDA_RUNTIME_PEER_WINDOW_H_

#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "lib/comm/transport.h"
#include "lib/cuda/runtime/device.h"
#include "lib/sched/schedule.h"

namespace hsap::cuda {

inline constexpr uint64_t kNoExport = std::numeric_limits<uint64_t>::max();

// Where a schedule's K/V rows for each peer go in the owner's export area.
struct FusedExportLayout {
  std::vector<uint64_t> offset_of_step;  // [num_ranks]: step t's offset, or kNoExport
  size_t bytes = 0;
};
FusedExportLayout ExportLayoutOf(const Schedule& schedule, size_t kv_row_bytes);

// A batch's view of the windows: where this rank writes and reads, per schedule stage.
struct FusedRoutes {
  std::vector<uint64_t> write_offset;  // [stage]: in this rank's export, or kNoExport
  std::vector<uint64_t> read_offset;   // [stage]: in the sender's export, or kNoExport
  int copy_ctas = 1;                   // of every rank's fused kernels
  int share = 1;                       // ranks (this one included) on this rank's device
};

class PeerWindow {
 public:
  // `rank` of `size` ranks; the window lives on `device`.
  PeerWindow(Device& device, int rank, int size);
  // Waits (up to the last Exchange's timeout) until the readers are done, then frees.
  // When they are not done by then, the memory is left allocated rather than freed
  // under a reader.
  ~PeerWindow();
  PeerWindow(const PeerWindow&) = delete;
  PeerWindow& operator=(const PeerWindow&) = delete;

  // Collective over `transport` (every rank, at the same point of its collectives). Grows
  // this rank's export area to what `schedule` needs, then exchanges windows and export
  // layouts and maps the peers' windows. `copy_ctas`: this rank's
  // DeviceKernels::fused_copy_ctas(); `resident_ctas`: its fused_resident_ctas(). Returns
  // the routes of the schedule; nullopt (on every rank alike) when some rank cannot reach
  // some other's window, the ranks' kernels copy with different CTA counts, or the fused
  // kernels of the ranks sharing a GPU cannot all be resident with a compute CTA each: the
  // batch then moves K/V with stages; FailedPrecondition (on every rank alike) when some
  // rank could not take part (its own error says why); other errors are the transport's.
  // `willing`: false when this rank will not use the windows (its kernels have no fused
  // forward): it still exchanges, and every rank gets nullopt. `local`: this rank's verdict
  // on the rest of its preparation; when it is not OK the rank still exchanges (so its peers
  // fail at once) and returns it.
  absl::StatusOr<std::optional<FusedRoutes>> Exchange(Transport& transport,
                                                      const Schedule& schedule, size_t kv_row_bytes,
                                                      int copy_ctas, int resident_ctas,
                                                      cudaStream stream, absl::Duration timeout,
                                                      bool willing = true,
                                                      const absl::Status& local = absl::OkStatus());

  // Whether `rank`'s window is mapped here.
  bool reachable(int rank) const { return bases_[rank] != nullptr; }
  char* export_area(int rank) const { return bases_[rank] + header_bytes_; }
  uint32_t* ready(int rank) const { return Word(rank, 0); }
  uint32_t* error_word() const { return Word(rank_, 1); }
  uint32_t* counters() const { return Word(rank_, 4); }
  uint32_t* consumed(int owner, int reader) const { return Word(owner, 8 + reader); }

  // Blocks the host until every reader finished reading this rank's export (as the
  // destructor and growing do), or DeadlineExceeded naming the reader still behind.
  absl::Status WaitForReaders(absl::Time deadline) { return Drain(drain_stream_, deadline); }

  // The number of the next fused call (1, 2, ...; the same on every rank).
  uint32_t NextCall() { return ++calls_; }
  // The copies reader q has made of this rank's export so far (what consumed[q] must reach
  // before the export is written again).
  uint32_t& copies_by(int reader) { return copies_[reader]; }

 private:
  uint32_t* Word(int rank, int i) const { return reinterpret_cast<uint32_t*>(bases_[rank]) + i; }
  // Waits on the host until every reader's consumed count reached copies_by(reader).
  absl::Status Drain(cudaStream stream, absl::Time deadline);
  absl::Status Grow(size_t export_bytes, cudaStream stream, absl::Duration timeout);
  // Maps peer q's window (IPC); keeps an existing mapping of the same handle.
  absl::StatusOr<char*> Open(int q, const IpcHandle& handle, const DeviceLocation& owner);
  void CloseAll();

  Device& device_;
  const int rank_, size_;
  const size_t header_bytes_;
  void* memory_ = nullptr;  // this rank's window
  size_t export_capacity_ = 0;
  std::vector<char*> bases_;  // every rank's window, as this rank addresses it
  DeviceLocation location_;
  bool exported_ = false;  // handle_ holds this rank's window
  IpcHandle handle_{};
  struct Mapping {
    char* base = nullptr;
    IpcHandle handle{};
  };
  std::vector<Mapping> opened_;  // peers' windows mapped through IPC
  std::vector<uint32_t> copies_;
  uint32_t calls_ = 0;
  cudaStream drain_stream_ = nullptr;
  absl::Duration timeout_ = absl::Seconds(10);
};

}  // namespace hsap::cuda

#endif  // HSAP_LIB_CUDA_RUNTIME_PEER_WINDOW_H_
