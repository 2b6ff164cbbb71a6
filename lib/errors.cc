#include "lib/errors.h"

#include <string>

#include "absl/strings/cord.h"

namespace hsap {
namespace {

constexpr absl::string_view kResultPayload = "hsap/result";
constexpr absl::string_view kCompilePayload = "compile";

thread_local std::string last_error;

}  // namespace

absl::Status CompileError(std::string_view message) {
  absl::Status status = absl::UnknownError(absl::string_view(message.data(), message.size()));
  status.SetPayload(kResultPayload, absl::Cord(kCompilePayload));
  return status;
}

bool IsCompileError(const absl::Status& status) {
  auto payload = status.GetPayload(kResultPayload);
  return payload.has_value() && *payload == kCompilePayload;
}

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
