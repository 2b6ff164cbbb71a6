// Running a program in a child process without a shell, with its output captured and a
// time limit. Used by the host JIT to run the C++ compiler (LLVM never enters our process).
#ifndef HSAP_JIT_SUBPROCESS_H_
#define HSAP_JIT_SUBPROCESS_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace hsap::jit {

struct ProcessResult {
  int exit_code = -1;  // valid when the process exited normally
  int signal = 0;      // non-zero when it was killed by a signal
  bool timed_out = false;
  std::string output;  // stdout and stderr, interleaved as written
};

// Runs argv[0] (an absolute path, or a name looked up in $PATH) with arguments argv[1..],
// stdin from /dev/null, in its own process group. After `timeout` the whole group is
// killed and timed_out is set. Errors only when the process cannot be started; a failing
// program is a successful call with a non-zero exit code.
absl::StatusOr<ProcessResult> RunProcess(const std::vector<std::string>& argv,
                                         absl::Duration timeout);

}  // namespace hsap::jit

#endif  // HSAP_JIT_SUBPROCESS_H_
