// Parsing JSON text with errors that say where the text went wrong (shared by the plan,
// cluster and model readers).
#ifndef HSAP_LIB_SCHED_JSON_TEXT_H_
#define HSAP_LIB_SCHED_JSON_TEXT_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace hsap {

// The JSON value of `text`, or InvalidArgument "the text is not valid JSON at byte N (line
// L, column C): <what the parser expected>". Never throws.
absl::StatusOr<nlohmann::json> ParseJsonText(absl::string_view text);

}  // namespace hsap

#endif  // HSAP_LIB_SCHED_JSON_TEXT_H_
