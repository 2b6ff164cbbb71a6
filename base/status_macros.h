// absl::Status propagation in the manner of Abseil's internal macros.
//
//   HSAP_RETURN_IF_ERROR(expr);          // returns the status of `expr` when not ok
//   HSAP_ASSIGN_OR_RETURN(T x, expr);    // x = *expr, or returns expr's status
//
// `expr` is evaluated once. The function they appear in must return absl::Status or an
// absl::StatusOr<T> (both convert from a non-ok absl::Status).
#ifndef HSAP_BASE_STATUS_MACROS_H_
#define HSAP_BASE_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace hsap::internal {

inline const absl::Status& AsStatus(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& AsStatus(const absl::StatusOr<T>& s) {
  return s.status();
}

}  // namespace hsap::internal

#define HSAP_STATUS_CONCAT_INNER_(a, b) a##b
#define HSAP_STATUS_CONCAT_(a, b) HSAP_STATUS_CONCAT_INNER_(a, b)

#define HSAP_RETURN_IF_ERROR(expr)                        \
  do {                                                    \
    if (auto hsap_status_ = (expr); !hsap_status_.ok()) { \
      return ::hsap::internal::AsStatus(hsap_status_);    \
    }                                                     \
  } while (false)

#define HSAP_ASSIGN_OR_RETURN(lhs, expr) \
  HSAP_ASSIGN_OR_RETURN_IMPL_(HSAP_STATUS_CONCAT_(hsap_statusor_, __LINE__), lhs, expr)

#define HSAP_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                                \
  if (!statusor.ok()) return statusor.status();          \
  lhs = *std::move(statusor)

#endif  // HSAP_BASE_STATUS_MACROS_H_
