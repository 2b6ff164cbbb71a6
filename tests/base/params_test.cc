#include "base/params.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/scoped_env.h"

namespace hsap {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

TEST(ParamsTest, TableIsComplete) {
  std::set<std::string> names;
  for (const ParamInfo& info : AllParams()) {
    EXPECT_EQ(&DescribeParam(info.param), &info);
    EXPECT_TRUE(names.insert(info.name).second) << info.name << " is listed twice";
    EXPECT_NE(std::string(info.meaning), "") << info.name;
  }
  EXPECT_EQ(DescribeParam(Param::kTimeoutMs).name, std::string("HSAP_TIMEOUT_MS"));
  EXPECT_EQ(DescribeParam(Param::kTmpDir).name, std::string("TMPDIR"));
}

TEST(ParamsTest, ReadOncePerProcess) {
  testing::ScopedEnv dump("HSAP_JIT_DUMP", "/first");
  EXPECT_EQ(GetStringParam(Param::kJitDump), "/first");
  setenv("HSAP_JIT_DUMP", "/second", 1);  // behind the registry's back
  EXPECT_EQ(GetStringParam(Param::kJitDump), "/first");
  ReloadParamsForTesting();
  EXPECT_EQ(GetStringParam(Param::kJitDump), "/second");
}

TEST(ParamsTest, UnsetEmptyAndDefault) {
  testing::ScopedEnv kernels("HSAP_HOST_KERNELS", nullptr);
  EXPECT_EQ(GetParam(Param::kHostKernels), std::nullopt);
  EXPECT_EQ(GetStringParam(Param::kHostKernels), "jit");
  kernels.Set("");
  EXPECT_EQ(GetParam(Param::kHostKernels), "");  // set, if empty
  EXPECT_EQ(GetStringParam(Param::kHostKernels), "jit");
  kernels.Set("handwritten");
  EXPECT_EQ(GetParam(Param::kHostKernels), "handwritten");
  EXPECT_EQ(GetStringParam(Param::kHostKernels), "handwritten");
}

TEST(ParamsTest, Booleans) {
  testing::ScopedEnv fused("HSAP_FUSED_FORWARD", nullptr);
  EXPECT_EQ(*GetBoolParam(Param::kFusedForward), true);  // the default
  for (const char* yes : {"1", "true", "TRUE", "yes", "On"}) {
    fused.Set(yes);
    EXPECT_EQ(GetBoolParam(Param::kFusedForward).value_or(false), true) << yes;
  }
  for (const char* no : {"0", "false", "No", "off"}) {
    fused.Set(no);
    EXPECT_EQ(GetBoolParam(Param::kFusedForward).value_or(true), false) << no;
  }
  for (const char* bad : {"", "2", "maybe", "0 "}) {
    fused.Set(bad);
    const absl::StatusOr<bool> b = GetBoolParam(Param::kFusedForward);
    EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument) << "'" << bad << "'";
    EXPECT_THAT(b.status().message(), HasSubstr(std::string("$HSAP_FUSED_FORWARD = '") + bad));
    EXPECT_THAT(b.status().message(), HasSubstr("not a boolean"));
    EXPECT_THAT(b.status().message(), HasSubstr("peer windows"));  // the meaning
  }
}

TEST(ParamsTest, Integers) {
  testing::ScopedEnv timeout("HSAP_TIMEOUT_MS", nullptr);
  EXPECT_EQ(*GetInt64Param(Param::kTimeoutMs), 300000);
  timeout.Set("1234");
  EXPECT_EQ(*GetInt64Param(Param::kTimeoutMs), 1234);
  timeout.Set("-5");
  EXPECT_EQ(*GetInt64Param(Param::kTimeoutMs), -5);  // the range is the caller's to check
  for (const char* bad : {"", "abc", "12ms", "1.5", "99999999999999999999999"}) {
    timeout.Set(bad);
    const absl::StatusOr<int64_t> v = GetInt64Param(Param::kTimeoutMs);
    EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << "'" << bad << "'";
    EXPECT_THAT(v.status().message(), HasSubstr(std::string("$HSAP_TIMEOUT_MS = '") + bad));
    EXPECT_THAT(v.status().message(), HasSubstr("not an integer"));
    EXPECT_THAT(v.status().message(), HasSubstr("default (300000)"));
  }
}

TEST(ParamsTest, ConcurrentReadersSeeOneSnapshot) {
  testing::ScopedEnv dump("HSAP_JIT_DUMP", "/dumps");
  std::vector<std::thread> readers;
  std::vector<int> wrong(8, 0);
  for (int t = 0; t < 8; ++t) {
    readers.emplace_back([t, &wrong] {
      for (int i = 0; i < 2000; ++i) {
        if (GetStringParam(Param::kJitDump) != "/dumps") ++wrong[t];
      }
    });
  }
  for (int i = 0; i < 200; ++i) ReloadParamsForTesting();  // the environment is unchanged
  for (std::thread& t : readers) t.join();
  for (int t = 0; t < 8; ++t) EXPECT_EQ(wrong[t], 0) << "reader " << t;
}

// ---------------------------------------------------------------------------------------
// The registry is the only reader of the environment, and docs/environment.md documents it.

std::string ReadFile(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(ParamsTest, NoOtherFileCallsGetenv) {
  static const std::set<std::string> kSourceExtensions = {".h", ".cc", ".c", ".cuh", ".inc"};
  const fs::path root = HSAP_SOURCE_DIR;
  std::vector<std::string> offenders;
  int scanned = 0;
  for (const char* folder : {"base", "attention", "jit", "lib", "bench", "include"}) {
    for (const auto& e : fs::recursive_directory_iterator(root / folder)) {
      const std::string ext = e.path().extension().string();
      if (!e.is_regular_file() || !kSourceExtensions.count(ext)) continue;
      const std::string rel = fs::relative(e.path(), root).string();
      ++scanned;
      if (rel != "base/params.cc" && absl::StrContains(ReadFile(e.path()), "getenv(")) {
        offenders.push_back(rel);
      }
    }
  }
  EXPECT_GT(scanned, 50) << "no sources under " << root;
  EXPECT_THAT(offenders, ::testing::IsEmpty())
      << "read the environment through base/params.h instead";
}

// Where the environment variables are documented (README.md links to it), and the heading
// of their table there.
constexpr char kEnvironmentDoc[] = "docs/environment.md";
constexpr char kEnvironmentHeading[] = "## Variables\n";

// The variable names in the first column of the table under kEnvironmentHeading: every
// `NAME` or `NAME=value` of that column.
std::set<std::string> DocumentedEnvironmentNames(const std::string& doc) {
  std::set<std::string> names;
  const size_t begin = doc.find(kEnvironmentHeading);
  if (begin == std::string::npos) return names;
  const size_t end = doc.find("\n#", begin + 1);
  for (absl::string_view line :
       absl::StrSplit(doc.substr(begin, end == std::string::npos ? end : end - begin), '\n')) {
    if (!absl::ConsumePrefix(&line, "|")) continue;
    const absl::string_view first = line.substr(0, line.find('|'));
    std::vector<absl::string_view> quoted = absl::StrSplit(first, '`');
    for (size_t i = 1; i < quoted.size(); i += 2) {  // the odd pieces sit between backticks
      names.insert(std::string(quoted[i].substr(0, quoted[i].find('='))));
    }
  }
  return names;
}

TEST(ParamsTest, DocsListExactlyTheHsapVariables) {
  const std::set<std::string> documented =
      DocumentedEnvironmentNames(ReadFile(fs::path(HSAP_SOURCE_DIR) / kEnvironmentDoc));
  ASSERT_FALSE(documented.empty())
      << kEnvironmentDoc << " has no table under \"" << kEnvironmentHeading << "\"";
  std::set<std::string> registered, hsap_registered, hsap_documented;
  for (const ParamInfo& info : AllParams()) {
    registered.insert(info.name);
    if (absl::StartsWith(info.name, "HSAP_")) hsap_registered.insert(info.name);
  }
  for (const std::string& name : documented) {
    EXPECT_TRUE(registered.count(name))
        << kEnvironmentDoc << " documents " << name << ", which base/params.cc does not list";
    if (absl::StartsWith(name, "HSAP_")) hsap_documented.insert(name);
  }
  EXPECT_EQ(hsap_documented, hsap_registered);
}

}  // namespace
}  // namespace hsap
