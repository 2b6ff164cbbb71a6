#include "lib/api/checks.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace hsap {

absl::Status CheckNotNull(const void* p, absl::string_view name) {
  if (p == nullptr) return absl::InvalidArgumentError(absl::StrCat(name, " is null"));
  return absl::OkStatus();
}

absl::Status CheckConfigHeaderAt(const void* config, size_t size, unsigned magic, unsigned version,
                                 size_t known_size, absl::string_view name, size_t min_size,
                                 absl::string_view initializer) {
  if (magic != HSAP_CONFIG_MAGIC) {
    return absl::InvalidArgumentError(absl::StrCat(name, " was not initialised (magic is 0x",
                                                   absl::Hex(magic), ", expected 0x",
                                                   absl::Hex(HSAP_CONFIG_MAGIC), "): fill it with ",
                                                   initializer, " before setting its fields"));
  }
  constexpr unsigned kFirstVersion = HSAP_VERSION(0, 1, 0);
  if (version < kFirstVersion || version / 10000 != HSAP_MAJOR) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, "->version is ", version, "; this library (version code ",
                     HSAP_VERSION_CODE, ") accepts codes of major version ", HSAP_MAJOR, " from ",
                     kFirstVersion, ": fill it with ", initializer, " and leave version as set"));
  }
  if (size < min_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " has size ", size, ", smaller than the oldest supported layout (",
                     min_size, " bytes): fill it with ", initializer, " and pass it unmodified"));
  }
  if (size > kMaxConfigSize) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, " has size ", size, ", more than the largest a config may have (", kMaxConfigSize,
        " bytes): fill it with ", initializer, " and pass it unmodified"));
  }
  const auto* bytes = static_cast<const unsigned char*>(config);
  for (size_t i = known_size; i < size; ++i) {
    if (bytes[i] != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " has size ", size, " but this library knows its first ", known_size,
                       " bytes, and byte ", i,
                       " (a field of a newer version) is set; a newer field can be "
                       "used only with a library that knows it"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckHeadCount(int64_t heads, absl::string_view name) {
  if (heads < 1 || heads > kMaxHeads) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " = ", heads, "; it must be in [1, ", kMaxHeads, "]"));
  }
  return absl::OkStatus();
}

absl::StatusOr<DType> DTypeFromC(const hsapDataType_t& t, absl::string_view name) {
  const auto raw = RawEnum(t);
  if (raw == hsapFloat32) return DType::kF32;
  if (raw == hsapBFloat16) return DType::kBF16;
  if (raw == hsapFloat16) return DType::kF16;
  return absl::InvalidArgumentError(absl::StrCat(name, " has unknown data type ",
                                                 static_cast<int64_t>(raw),
                                                 "; use hsapFloat32, hsapBFloat16 or hsapFloat16"));
}

absl::Status CheckTensor(const hsapTensor_t* t, absl::string_view name, DType dtype,
                         int64_t num_tokens, int num_heads, int head_dim) {
  if (t == nullptr) return absl::InvalidArgumentError(absl::StrCat(name, " is null"));
  HSAP_ASSIGN_OR_RETURN(DType got, DTypeFromC(t->dtype, absl::StrCat(name, ".dtype")));
  if (got != dtype) {
    return absl::InvalidArgumentError(absl::StrCat(name, " is ", std::string(DTypeName(got)),
                                                   ", expected ", std::string(DTypeName(dtype)),
                                                   " (one dtype for every tensor)"));
  }
  if (t->numTokens != num_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " has ", t->numTokens, " tokens, expected ", num_tokens));
  }
  if (t->numHeads != num_heads) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " has ", t->numHeads, " heads, expected ", num_heads));
  }
  if (t->headDim != head_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " has head dim ", t->headDim, ", expected ", head_dim));
  }
  if (t->data == nullptr && num_tokens > 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, ".data is null"));
  }
  return absl::OkStatus();
}

}  // namespace hsap
