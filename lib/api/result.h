// Errors inside hsap travel as absl::Status; this maps them to hsapResult_t at the C ABI.
//
//   InvalidArgument    -> hsapInvalidArgument      FailedPrecondition -> hsapInvalidUsage
//   Unimplemented      -> hsapUnsupported          DeadlineExceeded   -> hsapTimeout
//   Aborted/Cancelled  -> hsapAborted              ResourceExhausted  -> hsapOutOfMemory
//   Unavailable        -> hsapSystemError          CompileError(...)  -> hsapCompileError
//   anything else      -> hsapInternalError
#ifndef HSAP_LIB_API_RESULT_H_
#define HSAP_LIB_API_RESULT_H_

#include <exception>
#include <new>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "hsap/hsap.h"

namespace hsap {

// The hsapResult_t of `status` (table above).
hsapResult_t ResultFromStatus(const absl::Status& status);

// Records `message` as the calling thread's hsapGetLastError() text.
void SetLastError(std::string_view message);
void ClearLastError();
const char* LastError();

// Runs body() (returning absl::Status) at a C entry point named `api`: clears the last
// error, converts the status into an hsapResult_t, records the message prefixed with the
// entry point's name, and catches every exception so that none crosses the C ABI.
template <typename Body>
hsapResult_t RunApi(std::string_view api, Body&& body) noexcept {
  absl::Status status;
  try {
    ClearLastError();
    status = body();
  } catch (const std::bad_alloc&) {
    status = absl::ResourceExhaustedError("out of host memory");
  } catch (const std::exception& e) {
    status = absl::InternalError(std::string("unexpected exception: ") + e.what());
  } catch (...) {
    status = absl::InternalError("unexpected exception of unknown type");
  }
  if (status.ok()) return hsapSuccess;
  try {
    std::string message(api);
    message.append(": ").append(status.message().data(), status.message().size());
    SetLastError(message);
  } catch (...) {
  }
  return ResultFromStatus(status);
}

}  // namespace hsap

#endif  // HSAP_LIB_API_RESULT_H_
