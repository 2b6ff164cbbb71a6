// cuobjdump (CUDA's cubin disassembler, shipped on PyPI as nvidia-cuda-cuobjdump, with the
// nvdisasm it runs for -sass from nvidia-cuda-nvdisasm) for the tests that check the SASS of
// generated kernels.
#ifndef HSAP_TESTS_SUPPORT_CUOBJDUMP_H_
#define HSAP_TESTS_SUPPORT_CUOBJDUMP_H_

#include <glob.h>
#include <unistd.h>

#include <cstdlib>
#include <map>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "gtest/gtest.h"
#include "tests/support/test_files.h"

namespace hsap::testing {

// $HSAP_CUOBJDUMP, else PyPI's nvidia-cuda-cuobjdump in the project venv or in
// /opt/hsap-tools (scripts/install_deps.sh installs it), else PATH. Empty when none is found.
inline std::string FindCuobjdump() {
  if (const char* env = std::getenv("HSAP_CUOBJDUMP"); env != nullptr && *env != '\0') {
    return ::access(env, X_OK) == 0 ? env : "";
  }
  for (const char* pattern : {"/opt/hsap-py/lib/python3*/site-packages/nvidia/cu*/bin/cuobjdump",
                              "/opt/hsap-tools/nvidia/cu*/bin/cuobjdump"}) {
    glob_t g;
    const bool found = ::glob(pattern, 0, nullptr, &g) == 0 && g.gl_pathc > 0;
    const std::string path = found ? g.gl_pathv[0] : "";
    ::globfree(&g);
    if (found && ::access(path.c_str(), X_OK) == 0) return path;
  }
  const char* path = std::getenv("PATH");
  for (absl::string_view dir : absl::StrSplit(path != nullptr ? path : "", ':')) {
    const std::string candidate = absl::StrCat(dir, "/cuobjdump");
    if (!dir.empty() && ::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

// The SASS of each function of `cubin` (an ELF image), by lowered name; `dir` holds the
// temporary files. A failed disassembly fails the calling test.
inline std::map<std::string, std::string> SassByFunction(const std::string& cuobjdump,
                                                         const std::string& cubin,
                                                         const std::string& dir) {
  const std::string image = dir + "/k.cubin", listing = dir + "/k.sass";
  WriteFile(image, cubin);
  // cuobjdump -sass runs nvdisasm (PyPI's nvidia-cuda-nvdisasm), found on PATH: the
  // directory of cuobjdump first, where both packages install.
  const std::string bin = cuobjdump.substr(0, cuobjdump.rfind('/'));
  const std::string cmd = absl::StrCat("PATH='", bin, "':\"$PATH\" '", cuobjdump, "' -sass '",
                                       image, "' > '", listing, "' 2>&1");
  EXPECT_EQ(std::system(cmd.c_str()), 0) << ReadFile(listing);
  std::map<std::string, std::string> out;
  std::string current;
  for (absl::string_view line : absl::StrSplit(ReadFile(listing), '\n')) {
    if (const size_t at = line.find("Function : "); at != absl::string_view::npos) {
      current = std::string(absl::StripAsciiWhitespace(line.substr(at + 11)));
      continue;
    }
    if (!current.empty()) absl::StrAppend(&out[current], line, "\n");
  }
  return out;
}

}  // namespace hsap::testing

#endif  // HSAP_TESTS_SUPPORT_CUOBJDUMP_H_
