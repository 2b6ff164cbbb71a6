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

// Struct sizes above this are errors rather than tails to read: no config struct will ever
// grow this large, and a size this large is a field that was never set.
inline constexpr size_t kMaxConfigSize = size_t{64} << 10;

// Checks the header of the config struct at `config`, whose type this library knows as
// `known_size` bytes (the rule hsap.h states under "Limits"): magic == HSAP_CONFIG_MAGIC
// (the struct was filled by its initializer macro); version a code of this library's major
// version, at least 0.1.0 (the first with config structs); size at least `min_size` (the
// size of the struct's first version) and at most kMaxConfigSize; the bytes past
// `known_size` (fields of a newer minor version) all zero, since this library cannot honour
// them. The checks run in that order, so that no tail is read before size is bounded.
absl::Status CheckConfigHeaderAt(const void* config, size_t size, unsigned magic, unsigned version,
                                 size_t known_size, absl::string_view name, size_t min_size,
                                 absl::string_view initializer);

// CheckConfigHeaderAt for a config struct of the C ABI (size, magic and version first).
template <typename Config>
absl::Status CheckConfigHeader(const Config& config, absl::string_view name, size_t min_size,
                               absl::string_view initializer) {
  return CheckConfigHeaderAt(&config, config.size, config.magic, config.version, sizeof(Config),
                             name, min_size, initializer);
}

// The most query or K/V heads any entry point accepts: a CUDA grid has at most 65535 blocks
// in y, and the attention kernels give each query head its own.
inline constexpr int kMaxHeads = 65535;

// InvalidArgument naming `name` and the range [1, kMaxHeads] when `heads` is outside it.
absl::Status CheckHeadCount(int64_t heads, absl::string_view name);

// The value of an enum field of a caller's struct or array as a signed integer (a C caller
// stores an int there: -1 reads back as -1, whatever unsigned type C++ gives the enum), read
// without loading it as the enum: callers may store any integer there, and loading a value
// outside the enumerators as the enum type is undefined behaviour in C++.
template <typename E>
std::make_signed_t<std::underlying_type_t<E>> RawEnum(const E& field) {
  std::make_signed_t<std::underlying_type_t<E>> value;
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
