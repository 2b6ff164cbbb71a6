// Argument checks shared by the C entry points.
#ifndef HSAP_LIB_API_CHECKS_H_
#define HSAP_LIB_API_CHECKS_H_

#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attention/dtype.h"
#include "attention/layout.h"
#include "hsap/hsap.h"
#include "lib/api/handles.h"

namespace hsap {

// InvalidArgument "<name> is null" when p is null.
absl::Status CheckNotNull(const void* p, absl::string_view name);

// Checks a config struct header: size at least `min_size` (the size of version 1 of the
// struct), magic == HSAP_CONFIG_MAGIC (the struct was filled by its initializer macro).
absl::Status CheckConfigHeader(size_t size, unsigned magic, absl::string_view name, size_t min_size,
                               absl::string_view initializer);

// The value of an enum field of a caller's struct or array as its underlying integer, read
// without loading it as the enum: callers may store any integer there, and loading a value
// outside the enumerators as the enum type is undefined behaviour in C++.
template <typename E>
std::underlying_type_t<E> RawEnum(const E& field) {
  std::underlying_type_t<E> value;
  std::memcpy(&value, &field, sizeof(value));
  return value;
}

// `t` by reference so that an out-of-range value is read through RawEnum, never loaded.
absl::StatusOr<DType> DTypeFromC(const hsapDataType_t& t, absl::string_view name);

// Checks that `t` is non-null, has data, and has the given dtype and shape; the message
// names the tensor, what it has and what was expected.
absl::Status CheckTensor(const hsapTensor_t* t, absl::string_view name, DType dtype,
                         int64_t num_tokens, int num_heads, int head_dim);

}  // namespace hsap

#endif  // HSAP_LIB_API_CHECKS_H_
