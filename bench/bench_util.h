// Pieces shared by the attention bench binaries: command-line reading in the style of
// nccl-tests ("-n 5", "--iters 5" or "--iters=5"), dtype names, and C-API error exits.
#ifndef HSAP_BENCH_BENCH_UTIL_H_
#define HSAP_BENCH_BENCH_UTIL_H_

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "attention/dtype.h"
#include "hsap/hsap.h"

namespace hsap::bench {

// Prints the error (or the help when error is null) and exits.
using UsageFn = void (*)(const char* error);

// One option and its value, with the checks every option needs.
struct Arg {
  std::string name;
  std::string value;
  bool numeric = false;  // value parses entirely as a number
  double num = 0.0;
  UsageFn usage = nullptr;

  // The value as an integer >= lo; exits through usage otherwise.
  int64_t Int(int64_t lo) const {
    if (!numeric || num != std::floor(num) || num < static_cast<double>(lo)) {
      usage(
          (name + " needs an integer >= " + std::to_string(lo) + ", got '" + value + "'").c_str());
    }
    return static_cast<int64_t>(num);
  }
};

// Walks argv: every option takes a value, given as the next argument or after '=' for long
// options; -h/--help calls usage(nullptr).
class ArgReader {
 public:
  ArgReader(int argc, char** argv, UsageFn usage) : argc_(argc), argv_(argv), usage_(usage) {}

  bool Next(Arg& arg) {
    if (i_ >= argc_) return false;
    std::string name = argv_[i_++];
    if (name == "-h" || name == "--help") usage_(nullptr);
    std::string value;
    const size_t eq = name.find('=');
    if (eq != std::string::npos && name.rfind("--", 0) == 0) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    } else {
      if (i_ >= argc_) usage_(("missing value for " + name).c_str());
      value = argv_[i_++];
    }
    char* end = nullptr;
    arg.num = std::strtod(value.c_str(), &end);
    arg.numeric = end != value.c_str() && *end == '\0';
    arg.name = std::move(name);
    arg.value = std::move(value);
    arg.usage = usage_;
    return true;
  }

 private:
  int argc_;
  char** argv_;
  UsageFn usage_;
  int i_ = 1;
};

// "fp32", "bf16" or "fp16" (validated by the caller).
inline DType ParseDType(const std::string& s) {
  return s == "fp32" ? DType::kF32 : s == "bf16" ? DType::kBF16 : DType::kF16;
}
inline hsapDataType_t ToC(DType t) {
  return t == DType::kF32 ? hsapFloat32 : t == DType::kBF16 ? hsapBFloat16 : hsapFloat16;
}

// Exits with the C API's message when r is not hsapSuccess.
inline void Must(hsapResult_t r, const char* what) {
  if (r != hsapSuccess) {
    std::fprintf(stderr, "%s failed: %s: %s\n", what, hsapGetErrorString(r), hsapGetLastError());
    std::exit(1);
  }
}

using Clock = std::chrono::steady_clock;
inline double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace hsap::bench

#endif  // HSAP_BENCH_BENCH_UTIL_H_
