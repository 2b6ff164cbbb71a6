#include "lib/api/result.h"

#include <string>

#include "jit/compile_error.h"

namespace hsap {
namespace {

thread_local std::string last_error;

}  // namespace

hsapResult_t ResultFromStatus(const absl::Status& status) {
  if (status.ok()) return hsapSuccess;
  if (IsCompileError(status)) return hsapCompileError;
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kAlreadyExists:
      return hsapInvalidArgument;
    case absl::StatusCode::kFailedPrecondition:
      return hsapInvalidUsage;
    case absl::StatusCode::kUnimplemented:
      return hsapUnsupported;
    case absl::StatusCode::kDeadlineExceeded:
      return hsapTimeout;
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kCancelled:
      return hsapAborted;
    case absl::StatusCode::kResourceExhausted:
      return hsapOutOfMemory;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kPermissionDenied:
      return hsapSystemError;
    default:
      return hsapInternalError;
  }
}

void SetLastError(std::string_view message) { last_error.assign(message); }
void ClearLastError() { last_error.clear(); }
const char* LastError() { return last_error.c_str(); }

}  // namespace hsap
