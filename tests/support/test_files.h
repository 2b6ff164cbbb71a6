// File helpers for tests: a fresh temporary directory and whole-file reads and writes.
#ifndef HSAP_TESTS_SUPPORT_TEST_FILES_H_
#define HSAP_TESTS_SUPPORT_TEST_FILES_H_

#include <stdlib.h>
#include <sys/stat.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "gtest/gtest.h"

namespace hsap::testing {

// A new directory `<root>/<prefix>.XXXXXX`, root being $HSAP_TEST_TMPDIR (set by ctest to a
// folder of the build tree) when absolute, else gtest's temporary directory, else /tmp.
inline std::string MakeTestTempDir(const std::string& prefix) {
  const char* base = std::getenv("HSAP_TEST_TMPDIR");
  std::string root = (base != nullptr && base[0] == '/') ? base : ::testing::TempDir();
  if (root.empty()) root = "/tmp";
  while (root.size() > 1 && root.back() == '/') root.pop_back();
  mkdir(root.c_str(), 0700);
  std::string dir = root + "/" + prefix + ".XXXXXX";
  EXPECT_NE(mkdtemp(dir.data()), nullptr) << "cannot create a directory under " << root;
  return dir;
}

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline void WriteFile(const std::string& path, const std::string& content) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << content;
}

}  // namespace hsap::testing

#endif  // HSAP_TESTS_SUPPORT_TEST_FILES_H_
