// The layers of docs/architecture.md hold: every quoted #include of the library, the public
// header and the benches goes to the including file's own folder or to one its row of the
// "Allowed includes" table lists.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "gtest/gtest.h"

namespace {

namespace fs = std::filesystem;

using Rules = std::map<std::string, std::set<std::string>>;  // folder -> may include

std::string ReadFile(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Parses the rows between the layering-rules markers of docs/architecture.md.
Rules ParseRules(const std::string& doc) {
  Rules rules;
  const size_t begin = doc.find("<!-- layering-rules:begin -->");
  const size_t end = doc.find("<!-- layering-rules:end -->");
  if (begin == std::string::npos || end == std::string::npos) return rules;
  for (absl::string_view line : absl::StrSplit(doc.substr(begin, end - begin), '\n')) {
    line = absl::StripAsciiWhitespace(line);
    if (!absl::ConsumePrefix(&line, "|") || !absl::ConsumeSuffix(&line, "|")) continue;
    std::vector<std::string> cells = absl::StrSplit(line, '|');
    if (cells.size() != 2) continue;
    const std::string folder(absl::StripAsciiWhitespace(cells[0]));
    if (folder == "folder" || folder.find("---") != std::string::npos) continue;
    std::set<std::string>& allowed = rules[folder];
    for (absl::string_view dep : absl::StrSplit(cells[1], ',', absl::SkipWhitespace())) {
      allowed.insert(std::string(absl::StripAsciiWhitespace(dep)));
    }
  }
  return rules;
}

// The longest folder of `rules` that is a prefix of `path` (as whole path components).
std::optional<std::string> FolderOf(const Rules& rules, const std::string& path) {
  std::optional<std::string> best;
  for (const auto& [folder, allowed] : rules) {
    if (path.rfind(folder + "/", 0) == 0 && (!best || folder.size() > best->size())) {
      best = folder;
    }
  }
  return best;
}

struct Violation {
  std::string file, include;
};

// Checks one file's text against the rules. `path` is relative to the source root.
std::vector<Violation> CheckFile(const Rules& rules, const std::string& path,
                                 const std::string& text) {
  std::vector<Violation> out;
  const std::optional<std::string> from = FolderOf(rules, path);
  if (!from) return out;
  static const std::regex kInclude(R"re(^\s*#\s*include\s*"([^"]+)")re");
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    std::smatch m;
    if (!std::regex_search(line, m, kInclude)) continue;
    std::string target = m[1];
    if (target.rfind("hsap/", 0) == 0) target = "include/" + target;
    const std::optional<std::string> to = FolderOf(rules, target);
    if (!to) continue;  // a file of the same folder named relatively, or a generated header
    if (*to == *from || rules.at(*from).count(*to)) continue;
    out.push_back({path, m[1]});
  }
  return out;
}

Rules TreeRules() {
  return ParseRules(ReadFile(fs::path(HSAP_SOURCE_DIR) / "docs/architecture.md"));
}

TEST(Layering, TableCoversEveryLibraryFolder) {
  const Rules rules = TreeRules();
  ASSERT_FALSE(rules.empty()) << "docs/architecture.md lost its layering-rules table";
  const fs::path root(HSAP_SOURCE_DIR);
  for (const char* top : {"attention", "base", "jit", "lib", "bench", "include"}) {
    for (const auto& e : fs::recursive_directory_iterator(root / top)) {
      if (!e.is_regular_file()) continue;
      const std::string rel = fs::relative(e.path(), root).generic_string();
      EXPECT_TRUE(FolderOf(rules, rel).has_value())
          << rel << " is in no folder of docs/architecture.md's table: add its row";
    }
  }
  for (const auto& [folder, allowed] : rules) {
    for (const std::string& dep : allowed) {
      EXPECT_TRUE(rules.count(dep)) << folder << " may include " << dep << ", which has no row";
    }
  }
}

TEST(Layering, EveryIncludeGoesDownward) {
  const Rules rules = TreeRules();
  ASSERT_FALSE(rules.empty());
  const fs::path root(HSAP_SOURCE_DIR);
  int files = 0;
  for (const char* top : {"attention", "base", "jit", "lib", "bench", "include"}) {
    for (const auto& e : fs::recursive_directory_iterator(root / top)) {
      if (!e.is_regular_file()) continue;
      const std::string ext = e.path().extension().string();
      if (ext != ".h" && ext != ".cc" && ext != ".cuh") continue;
      ++files;
      const std::string rel = fs::relative(e.path(), root).generic_string();
      for (const Violation& v : CheckFile(rules, rel, ReadFile(e.path()))) {
        ADD_FAILURE() << v.file << " includes \"" << v.include
                      << "\", a folder its layer may not use (docs/architecture.md)";
      }
    }
  }
  EXPECT_GT(files, 100);
}

// The checker itself: an include planted against the direction is found.
TEST(Layering, PlantedUpwardIncludeIsFound) {
  const Rules rules = TreeRules();
  ASSERT_FALSE(rules.empty());
  const std::vector<Violation> v = CheckFile(
      rules, "lib/comm/transport.cc",
      "#include \"lib/comm/transport.h\"\n#include <vector>\n  #include \"lib/exec/batch.h\"\n");
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].include, "lib/exec/batch.h");
  EXPECT_EQ(CheckFile(rules, "attention/kernel.cc", "#include \"hsap/hsap.h\"\n").size(), 1u);
  EXPECT_TRUE(CheckFile(rules, "lib/api/core.cc", "#include \"hsap/hsap.h\"\n").empty());
  // lib/cuda/exec is not lib/cuda/execute: folders match as whole path components.
  EXPECT_EQ(FolderOf(rules, "lib/cuda/exec/gpu_batch.cc").value_or(""), "lib/cuda/exec");
}

}  // namespace
