// The JIT's error label: a failed compile (host compiler or NVRTC) is an absl::Status that
// carries a payload marking it as a compile error, so that the C ABI can report it as
// hsapCompileError while the message keeps the compiler's log.
#ifndef HSAP_JIT_COMPILE_ERROR_H_
#define HSAP_JIT_COMPILE_ERROR_H_

#include <string_view>

#include "absl/status/status.h"

namespace hsap {

// A compile failure with `message` (the log, the kept source's path).
absl::Status CompileError(std::string_view message);
// Whether `status` was made by CompileError.
bool IsCompileError(const absl::Status& status);

}  // namespace hsap

#endif  // HSAP_JIT_COMPILE_ERROR_H_
