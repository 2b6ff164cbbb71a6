// Version and error entry points of the C ABI.
#include "base/status_macros.h"
#include "hsap/hsap.h"
#include "lib/api/checks.h"
#include "lib/api/result.h"

extern "C" {

hsapResult_t hsapGetVersion(int* version) {
  return hsap::RunApi("hsapGetVersion", [&]() -> absl::Status {
    HSAP_RETURN_IF_ERROR(hsap::CheckNotNull(version, "version"));
    *version = HSAP_VERSION_CODE;
    return absl::OkStatus();
  });
}

const char* hsapGetErrorString(hsapResult_t result) {
  // Read as an integer: a caller may pass any value, which C++ must not load as the enum.
  switch (hsap::RawEnum(result)) {
    case hsapSuccess:
      return "success";
    case hsapInvalidArgument:
      return "invalid argument";
    case hsapInvalidUsage:
      return "invalid usage";
    case hsapSystemError:
      return "system error";
    case hsapInternalError:
      return "internal error";
    case hsapUnsupported:
      return "unsupported";
    case hsapTimeout:
      return "timeout";
    case hsapAborted:
      return "aborted";
    case hsapCompileError:
      return "compile error";
    case hsapOutOfMemory:
      return "out of memory";
    case hsapNumResults:
      break;
  }
  return "unknown result code";
}

const char* hsapGetLastError(void) { return hsap::LastError(); }

}  // extern "C"
