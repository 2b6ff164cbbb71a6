// No source file of the library, the JIT, the math, base or the benches grows past
// kMaxLines lines: a file that long holds several concepts, and each belongs in a unit of its
// own (the house style: foo.h + foo.cc, a header that states the contract).
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/support/test_files.h"

namespace {

namespace fs = std::filesystem;

constexpr int kMaxLines = 800;

// The folders whose sources are held to the limit, relative to the source root.
constexpr const char* kFolders[] = {"lib", "jit", "attention", "base", "bench"};

// Lines of the file at `p` (a last line without its newline counts too).
int CountLines(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  int lines = 0;
  for (std::string line; std::getline(in, line);) ++lines;
  return lines;
}

bool IsSource(const fs::path& p) {
  const std::string ext = p.extension().string();
  return ext == ".h" || ext == ".cc" || ext == ".cuh";
}

struct Oversized {
  std::string file;
  int lines;
};

// Every source under the folders above the limit.
std::vector<Oversized> OversizedFiles(const fs::path& root, int max_lines, int* files) {
  std::vector<Oversized> out;
  for (const char* top : kFolders) {
    for (const auto& e : fs::recursive_directory_iterator(root / top)) {
      if (!e.is_regular_file() || !IsSource(e.path())) continue;
      ++*files;
      const int lines = CountLines(e.path());
      if (lines > max_lines) {
        out.push_back({fs::relative(e.path(), root).generic_string(), lines});
      }
    }
  }
  return out;
}

TEST(FileSize, NoSourceFileIsOverTheLimit) {
  int files = 0;
  for (const Oversized& o : OversizedFiles(fs::path(HSAP_SOURCE_DIR), kMaxLines, &files)) {
    ADD_FAILURE() << o.file << " has " << o.lines << " lines, over the limit of " << kMaxLines
                  << ": split it along its concepts (a unit foo.h + foo.cc per concept, a "
                     "header that states its contract)";
  }
  EXPECT_GT(files, 100);  // the walk found the tree
}

// The checker itself: a file planted over the limit is found and named, one at it is not.
TEST(FileSize, PlantedLongFileIsFound) {
  const fs::path root = hsap::testing::MakeTestTempDir("file_size_test");
  for (const char* top : kFolders) fs::create_directories(root / top);
  fs::create_directories(root / "lib/comm");
  auto write = [&](const std::string& rel, int lines) {
    std::ofstream out(root / rel);
    for (int i = 0; i < lines; ++i) out << "// line " << i << "\n";
  };
  write("lib/comm/long.cc", kMaxLines + 1);
  write("lib/comm/at_the_limit.h", kMaxLines);
  write("jit/notes.txt", 5 * kMaxLines);  // not a source file
  int files = 0;
  const std::vector<Oversized> found = OversizedFiles(root, kMaxLines, &files);
  fs::remove_all(root);
  EXPECT_EQ(files, 2);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].file, "lib/comm/long.cc");
  EXPECT_EQ(found[0].lines, kMaxLines + 1);
}

}  // namespace
