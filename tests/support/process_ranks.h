// Ranks as child processes, for the tests of the shared-memory host backend.
//
// RunRanksAsProcesses forks one child per rank from the test process. It forks without
// exec, which is safe only while the test process has a single thread (a lock held by
// another thread at fork time would stay locked forever in the child), so it checks
// /proc/self/task first and fails the test otherwise; every distributed test joins its
// threads before it returns, so a test that forks before starting threads is fine. Each
// child runs body(rank), writes the returned report into a memfd that the parent created,
// and leaves with _exit (no atexit handlers, no gtest teardown). The parent waits for every
// child up to a deadline, kills the stragglers (a hang is a test failure, never a hung
// test) and returns each child's report and wait status.
#ifndef HSAP_TESTS_SUPPORT_PROCESS_RANKS_H_
#define HSAP_TESTS_SUPPORT_PROCESS_RANKS_H_

#include <dirent.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "hsap/hsap.h"

namespace hsap::testing {

struct ProcessRank {
  pid_t pid = -1;
  int wait_status = 0;  // from waitpid
  bool hung = false;    // killed by the parent after the deadline
  std::string report;   // what body(rank) returned

  bool exited_normally() const {
    return !hung && WIFEXITED(wait_status) && WEXITSTATUS(wait_status) == 0;
  }
  bool killed_by(int sig) const { return WIFSIGNALED(wait_status) && WTERMSIG(wait_status) == sig; }
};

// Threads of this process (entries of /proc/self/task).
inline int ThreadCount() {
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return -1;
  int n = 0;
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] != '.') ++n;
  }
  closedir(dir);
  return n;
}

// Length-prefixed fields of a report.
class ReportWriter {
 public:
  void Bytes(const void* p, size_t n) {
    const uint64_t len = n;
    out_.append(reinterpret_cast<const char*>(&len), sizeof(len));
    out_.append(static_cast<const char*>(p), n);
  }
  template <typename T>
  void Value(const T& v) {
    Bytes(&v, sizeof(T));
  }
  void String(const std::string& s) { Bytes(s.data(), s.size()); }
  std::string Take() { return std::move(out_); }

 private:
  std::string out_;
};

class ReportReader {
 public:
  explicit ReportReader(const std::string& in) : in_(in) {}
  // Copies the next field into p (which has room for n bytes); false when it does not fit.
  bool Bytes(void* p, size_t n) {
    std::string field;
    if (!Next(field) || field.size() != n) return false;
    if (n > 0) std::memcpy(p, field.data(), n);
    return true;
  }
  template <typename T>
  bool Value(T& v) {
    return Bytes(&v, sizeof(T));
  }
  bool String(std::string& s) { return Next(s); }
  // The next field, whatever its size.
  bool Next(std::string& field) {
    uint64_t len = 0;
    if (at_ + sizeof(len) > in_.size()) return false;
    std::memcpy(&len, in_.data() + at_, sizeof(len));
    at_ += sizeof(len);
    if (len > in_.size() - at_) return false;
    field.assign(in_.data() + at_, len);
    at_ += len;
    return true;
  }

 private:
  const std::string& in_;
  size_t at_ = 0;
};

// Forks `ranks` children running body(rank). `while_running(pids)` runs in the parent once
// every child was started (e.g. to kill one). Children still running after `deadline` are
// killed with SIGKILL and marked hung.
inline std::vector<ProcessRank> RunRanksAsProcesses(
    int ranks, const std::function<std::string(int)>& body,
    const std::function<void(const std::vector<pid_t>&)>& while_running = nullptr,
    std::chrono::milliseconds deadline = std::chrono::minutes(5)) {
  std::vector<ProcessRank> out(ranks);
  const int threads = ThreadCount();
  if (threads != 1) {
    ADD_FAILURE() << "ranks as processes fork the test process, which must be single-threaded "
                     "at that point; it has "
                  << threads << " threads";
    return out;
  }
  std::vector<int> fds(ranks, -1);
  std::vector<pid_t> pids(ranks, -1);
  for (int r = 0; r < ranks; ++r) {
    fds[r] = memfd_create("hsap-rank-report", 0);
    if (fds[r] < 0) {
      ADD_FAILURE() << "memfd_create: " << std::strerror(errno);
      break;
    }
    std::fflush(nullptr);  // nothing buffered is written twice
    const pid_t pid = fork();
    if (pid == 0) {
      const std::string report = body(r);
      size_t at = 0;
      while (at < report.size()) {
        const ssize_t n = write(fds[r], report.data() + at, report.size() - at);
        if (n <= 0) _exit(3);
        at += static_cast<size_t>(n);
      }
      _exit(0);
    }
    if (pid < 0) {
      ADD_FAILURE() << "fork: " << std::strerror(errno);
      break;
    }
    pids[r] = out[r].pid = pid;
  }
  if (while_running) while_running(pids);
  const auto until = std::chrono::steady_clock::now() + deadline;
  int left = 0;
  for (pid_t p : pids) left += p > 0 ? 1 : 0;
  std::vector<bool> reaped(ranks, false);
  while (left > 0) {
    for (int r = 0; r < ranks; ++r) {
      if (pids[r] <= 0 || reaped[r]) continue;
      if (waitpid(pids[r], &out[r].wait_status, WNOHANG) == pids[r]) {
        reaped[r] = true;
        --left;
      }
    }
    if (left == 0) break;
    if (std::chrono::steady_clock::now() >= until) {
      for (int r = 0; r < ranks; ++r) {
        if (pids[r] <= 0 || reaped[r]) continue;
        kill(pids[r], SIGKILL);
        waitpid(pids[r], &out[r].wait_status, 0);
        out[r].hung = true;
        reaped[r] = true;
      }
      ADD_FAILURE() << "ranks still running after " << deadline.count() << " ms were killed";
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  for (int r = 0; r < ranks; ++r) {
    if (fds[r] < 0) continue;
    const off_t size = lseek(fds[r], 0, SEEK_END);
    if (size > 0) {
      out[r].report.resize(static_cast<size_t>(size));
      if (pread(fds[r], out[r].report.data(), out[r].report.size(), 0) != size) {
        out[r].report.clear();
      }
    }
    close(fds[r]);
  }
  return out;
}

// The /dev/shm entry of the segment a token names: hsapGetUniqueId puts the 16 random bytes
// that name it at offset 16 (lib/api/cuda.cc); the name is "hsap-" and their hex digits.
inline std::string HsapSegmentOf(const hsapUniqueId_t& id) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string name = "hsap-";
  for (int i = 16; i < 32; ++i) {
    const auto b = static_cast<uint8_t>(id.internal[i]);
    name.push_back(kHex[b >> 4]);
    name.push_back(kHex[b & 15]);
  }
  return name;
}

// Entries of /dev/shm whose name starts with "hsap-" (segments of the host backend).
inline std::vector<std::string> HsapShmEntries() {
  std::vector<std::string> names;
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return names;
  while (dirent* e = readdir(dir)) {
    if (std::strncmp(e->d_name, "hsap-", 5) == 0) names.push_back(e->d_name);
  }
  closedir(dir);
  return names;
}

}  // namespace hsap::testing

#endif  // HSAP_TESTS_SUPPORT_PROCESS_RANKS_H_
