// Sets (or, with a null value, unsets) an environment variable for the lifetime of the
// object and restores what it was afterwards; hsap's parameters (base/params.h) are read
// again on every change. Tests only: setenv is not thread-safe, so use it where no other
// thread reads the environment.
#ifndef HSAP_TESTS_SUPPORT_SCOPED_ENV_H_
#define HSAP_TESTS_SUPPORT_SCOPED_ENV_H_

#include <cstdlib>
#include <optional>
#include <string>

#include "base/params.h"

namespace hsap::testing {

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name); old != nullptr) saved_ = old;
    Set(value);
  }
  ~ScopedEnv() { Set(saved_ ? saved_->c_str() : nullptr); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

  // Changes the value again (still restored at the end of the scope).
  void Set(const char* value) {
    if (value == nullptr) {
      unsetenv(name_.c_str());
    } else {
      setenv(name_.c_str(), value, 1);
    }
    ReloadParamsForTesting();
  }

 private:
  std::string name_;
  std::optional<std::string> saved_;
};

}  // namespace hsap::testing

#endif  // HSAP_TESTS_SUPPORT_SCOPED_ENV_H_
