#include "jit/compile_error.h"

#include "absl/strings/cord.h"

namespace hsap {
namespace {

constexpr absl::string_view kResultPayload = "hsap/result";
constexpr absl::string_view kCompilePayload = "compile";

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

}  // namespace hsap
