#include "lib/sched/json_text.h"

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace hsap {

absl::StatusOr<nlohmann::json> ParseJsonText(absl::string_view text) {
  try {
    return nlohmann::json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::parse_error& e) {
    // what() is "[json.exception.parse_error.101] parse error at line L, column C: ...";
    // the tag means nothing to a caller.
    std::string detail = e.what();
    if (const size_t tag_end = detail.find("] "); tag_end != std::string::npos) {
      detail.erase(0, tag_end + 2);
    }
    return absl::InvalidArgumentError(
        absl::StrCat("the text is not valid JSON at byte ", e.byte, " (", detail, ")"));
  } catch (const nlohmann::json::exception& e) {  // e.g. a number beyond double's range
    return absl::InvalidArgumentError(absl::StrCat("the text is not valid JSON (", e.what(), ")"));
  }
}

}  // namespace hsap
