#include "lib/comm/shm_segment.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"

namespace hsap::shm_internal {
namespace {

long Futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

// Closes a descriptor on scope exit.
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) close(fd);
  }
};

absl::StatusOr<void*> Map(int fd, size_t bytes, const std::string& name) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return ErrnoError(absl::StrCat("mmap of ", name), errno);
  return p;
}

std::string MissingRanks(Segment& seg) {
  std::vector<int> missing;
  for (int r = 0; r < seg.nranks(); ++r) {
    if (seg.slot(r).pid.load() == 0) missing.push_back(r);
  }
  return absl::StrJoin(missing, ", ");
}

}  // namespace

uint64_t RingBytesFor(int nranks) {
  const uint64_t channels = static_cast<uint64_t>(nranks) * nranks;
  uint64_t bytes = uint64_t{1} << 20;
  while (bytes > (uint64_t{16} << 10) && bytes * channels > (uint64_t{32} << 20)) bytes >>= 1;
  return bytes;
}

void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, Clock::duration duration) {
  const auto ns =
      std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::nanoseconds>(duration).count());
  timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  Futex(word, FUTEX_WAIT, expected, &ts);
}

void FutexWakeAll(std::atomic<uint32_t>* word) { Futex(word, FUTEX_WAKE, INT_MAX, nullptr); }

// False when `pid` no longer exists or is a zombie waiting to be reaped.
bool ProcessAlive(int32_t pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return true;  // no procfs: trust kill()
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* paren = std::strrchr(buf, ')');  // the command name may contain anything
  if (paren == nullptr || paren[1] == '\0' || paren[2] == '\0') return true;
  return paren[2] != 'Z' && paren[2] != 'X';
}

absl::Status ErrnoError(absl::string_view what, int err) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(err)));
}

absl::StatusOr<std::unique_ptr<Segment>> CreateSegment(const std::string& name, int nranks) {
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) {
    const int err = errno;
    if (err == EEXIST) {
      return absl::FailedPreconditionError(absl::StrCat(
          "shared-memory segment ", name,
          " already exists: this unique id is already in use by another communicator; create a "
          "fresh one with hsapGetUniqueId for every communicator"));
    }
    return ErrnoError(absl::StrCat("shm_open(", name, ", O_CREAT)"), err);
  }
  FdCloser closer{fd};
  const uint64_t ring_bytes = RingBytesFor(nranks);
  const SegmentLayout layout(nranks, ring_bytes);
  if (ftruncate(fd, static_cast<off_t>(layout.total)) != 0) {
    const int err = errno;
    shm_unlink(name.c_str());
    return ErrnoError(absl::StrCat("ftruncate of ", name, " to ", layout.total, " bytes"), err);
  }
  absl::StatusOr<void*> base = Map(fd, layout.total, name);
  if (!base.ok()) {
    shm_unlink(name.c_str());
    return base.status();
  }
  auto seg = std::make_unique<Segment>(*base, layout.total, nranks, ring_bytes);
  SegmentHeader& h = seg->header();
  h.nranks = nranks;
  h.ring_bytes = ring_bytes;
  h.magic.store(kSegmentMagic);  // the fresh file is zero: every other field starts at zero
  return seg;
}

// Other ranks: opens the segment rank 0 created, waiting for it until `deadline`.
absl::StatusOr<std::unique_ptr<Segment>> OpenSegment(const std::string& name, int nranks, int rank,
                                                     absl::Duration timeout,
                                                     Clock::time_point deadline) {
  auto backoff = std::chrono::microseconds(200);
  auto sleep = [&] {
    std::this_thread::sleep_for(backoff);
    backoff = std::min<std::chrono::microseconds>(backoff * 2, std::chrono::milliseconds(10));
  };
  auto timed_out = [&](absl::string_view what) {
    return absl::DeadlineExceededError(
        absl::StrCat("rank ", rank, ": timed out after ", absl::ToInt64Milliseconds(timeout),
                     " ms waiting for rank 0 to ", what, " the shared-memory segment ", name,
                     " (did rank 0 call hsapCommInitRank with the same unique id?)"));
  };
  int fd = -1;
  while ((fd = shm_open(name.c_str(), O_RDWR, 0)) < 0) {
    if (errno != ENOENT) return ErrnoError(absl::StrCat("shm_open(", name, ")"), errno);
    if (Clock::now() >= deadline) return timed_out("create");
    sleep();
  }
  FdCloser closer{fd};
  // Rank 0 sizes the file before it sets the magic; wait for both.
  while (true) {
    struct stat st;
    if (fstat(fd, &st) != 0) return ErrnoError(absl::StrCat("fstat of ", name), errno);
    if (static_cast<size_t>(st.st_size) >= sizeof(SegmentHeader)) {
      HSAP_ASSIGN_OR_RETURN(void* p, Map(fd, sizeof(SegmentHeader), name));
      auto* h = static_cast<SegmentHeader*>(p);
      const bool ready = h->magic.load() == kSegmentMagic;
      const int32_t their_nranks = h->nranks;
      const uint64_t ring_bytes = h->ring_bytes;
      munmap(p, sizeof(SegmentHeader));
      if (ready) {
        if (their_nranks != nranks) {
          return absl::InvalidArgumentError(
              absl::StrCat("rank ", rank, " was given nranks = ", nranks,
                           " but rank 0 created the world with nranks = ", their_nranks,
                           "; every rank must pass the same nranks"));
        }
        const SegmentLayout layout(nranks, ring_bytes);
        HSAP_ASSIGN_OR_RETURN(void* base, Map(fd, layout.total, name));
        return std::make_unique<Segment>(base, layout.total, nranks, ring_bytes);
      }
    }
    if (Clock::now() >= deadline) return timed_out("initialize");
    sleep();
  }
}

// Marks `rank` attached and waits until every rank is.
absl::Status JoinBarrier(Segment& seg, int rank, absl::Duration timeout,
                         Clock::time_point deadline) {
  RankSlot& slot = seg.slot(rank);
  int32_t expected = 0;
  const int32_t self = getpid();
  if (!slot.pid.compare_exchange_strong(expected, self)) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " is already attached to this world (by pid ", expected,
                     "); every rank number must be used exactly once per unique id"));
  }
  slot.state.store(kActive);
  SegmentHeader& h = seg.header();
  h.attached.fetch_add(1);
  seg.NotifyAll();
  auto next_liveness_check = Clock::now() + kLivenessPeriod;
  while (true) {
    const uint32_t attached = h.attached.load();
    if (seg.aborted()) {
      return absl::AbortedError(absl::StrCat("rank ", rank, ": the communicator was aborted while ",
                                             "its ranks were joining: ", seg.abort_reason()));
    }
    if (attached >= static_cast<uint32_t>(seg.nranks())) return absl::OkStatus();
    const auto now = Clock::now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "rank ", rank, ": timed out after ", absl::ToInt64Milliseconds(timeout),
          " ms waiting for rank(s) ", MissingRanks(seg),
          " to join the shared-memory communicator (hsapCommInitRank with the same unique id "
          "and nranks = ",
          seg.nranks(), ")"));
    }
    if (now >= next_liveness_check) {
      for (int p = 0; p < seg.nranks(); ++p) {
        const int32_t pid = seg.slot(p).pid.load();
        if (pid > 0 && pid != self && !ProcessAlive(pid)) {
          return absl::AbortedError(absl::StrCat("rank ", rank, ": rank ", p, " (pid ", pid,
                                                 ") died while the ranks were joining"));
        }
      }
      next_liveness_check = now + kLivenessPeriod;
    }
    FutexWait(&h.attached, attached, std::min<Clock::duration>(deadline - now, kLivenessPeriod));
  }
}

void AbortSegment(const std::string& name, absl::string_view reason) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) return;
  FdCloser closer{fd};
  if (absl::StatusOr<void*> p = Map(fd, sizeof(SegmentHeader), name); p.ok()) {
    Segment header_only(*p, sizeof(SegmentHeader), 0, 0);
    header_only.Abort(reason);
    FutexWakeAll(&header_only.header().attached);
  }
}

}  // namespace hsap::shm_internal
