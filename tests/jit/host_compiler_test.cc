#include "jit/host_compiler.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "jit/codegen_host.h"
#include "jit/compile_error.h"
#include "jit/host_abi.h"
#include "jit/subprocess.h"
#include "lib/api/result.h"
#include "tests/support/test_files.h"

namespace hsap::jit {
namespace {

using ::testing::HasSubstr;

std::string MakeTempDir() { return testing::MakeTestTempDir("hsap_host_compiler_test"); }

CompileCache& TestCache() {
  static CompileCache* cache = [] {
    CompileCache::Options options;
    options.dir = MakeTempDir() + "/cache";
    return new CompileCache(options);
  }();
  return *cache;
}

TEST(SubprocessTest, ArgumentsAreNotInterpretedByAShell) {
  auto r = RunProcess({"echo", "a; echo injected", "$(id)"}, absl::Seconds(30));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 0);
  EXPECT_EQ(r->output, "a; echo injected $(id)\n");
}

TEST(SubprocessTest, CapturesStderrAndExitCode) {
  auto r = RunProcess({"sh", "-c", "echo out; echo err >&2; exit 3"}, absl::Seconds(30));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 3);
  EXPECT_THAT(r->output, HasSubstr("out"));
  EXPECT_THAT(r->output, HasSubstr("err"));
}

TEST(SubprocessTest, TimeoutKillsTheProcessGroup) {
  // The shell's child (sleep) holds the output pipe too: both must die.
  auto r = RunProcess({"sh", "-c", "sleep 30 & sleep 30; echo never"}, absl::Milliseconds(300));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->timed_out);
  EXPECT_NE(r->signal, 0);
  EXPECT_THAT(r->output, ::testing::Not(HasSubstr("never")));
}

TEST(SubprocessTest, MissingProgramIsAnError) {
  auto r = RunProcess({"/nonexistent/hsap-no-such-compiler"}, absl::Seconds(5));
  EXPECT_FALSE(r.ok());
}

TEST(HostCompilerTest, FindsACompilerAndDescribesTheCpu) {
  auto c = FindHostCompiler();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->version.empty());
  EXPECT_THAT(HostArchString(), HasSubstr(HostHasAvx2Fma() ? "avx2" : ""));
  const std::vector<std::string> options = StandardHostOptions(*c);
  for (const char* o : {"-O3", "-march=native", "-shared", "-fPIC", "-fno-finite-math-only"}) {
    EXPECT_THAT(options, ::testing::Contains(std::string(o)));
  }
}

// Distinct modules loaded one after another resolve to their own code, also after one is
// unloaded (dlopen identifies objects by path, so a reused path would return a stale one).
TEST(HostCompilerTest, EveryModuleIsItsOwn) {
  auto make = [](int value) {
    HostSource src;
    src.code = absl::StrCat(
        "#include \"value.h\"\nextern \"C\" __attribute__((visibility(\"default\"))) int "
        "hsap_value() { return VALUE_BASE + ",
        value, "; }\n");
    src.headers = {{"value.h", "#define VALUE_BASE 1000\n"}};
    return CompileHostModule(src, TestCache());
  };
  auto call = [](const HostModule& m) {
    auto sym = m.Symbol("hsap_value");
    EXPECT_TRUE(sym.ok()) << sym.status();
    return sym.ok() ? reinterpret_cast<int (*)()>(*sym)() : -1;
  };
  auto a = make(1);
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = make(2);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(call(**a), 1001);
  EXPECT_EQ(call(**b), 1002);
  a->reset();
  auto c = make(3);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(call(**c), 1003);
  EXPECT_EQ(call(**b), 1002);
  // The same source again comes from the cache and still loads as a separate object.
  const int64_t compiles = TestCache().stats().compiles;
  auto b2 = make(2);
  ASSERT_TRUE(b2.ok()) << b2.status();
  EXPECT_EQ(call(**b2), 1002);
  EXPECT_EQ(TestCache().stats().compiles, compiles);
  EXPECT_EQ((*b2)->Symbol("no_such_symbol").status().code(), absl::StatusCode::kNotFound);
}

TEST(HostCompilerTest, SyntaxErrorIsACompileErrorWithLogAndSource) {
  HostSource src;
  src.code = "extern \"C\" int broken( { return 1 }\n";
  auto m = CompileHostModule(src, TestCache());
  ASSERT_FALSE(m.ok());
  EXPECT_TRUE(IsCompileError(m.status())) << m.status();
  const std::string msg(m.status().message());
  EXPECT_THAT(msg, HasSubstr("error"));
  EXPECT_THAT(msg, HasSubstr("source kept at "));
  EXPECT_THAT(msg, HasSubstr("-march=native"));
  EXPECT_GE(TestCache().stats().compile_failures, 1);
}

TEST(HostCompilerTest, GarbageBytesDoNotLoad) {
  auto m = LoadHostModule("this is not an ELF shared object", "garbage");
  EXPECT_FALSE(m.ok());
}

TEST(HostCompilerTest, AbiHeaderTextMatchesTheLibrary) {
  // The generated code sees exactly the declarations the library was compiled with.
  const std::string text = HostAbiHeaderText();
  EXPECT_THAT(text, HasSubstr("HsapHostForwardTask"));
  EXPECT_THAT(text,
              HasSubstr(absl::StrCat("#define HSAP_HOST_ABI_VERSION ", HSAP_HOST_ABI_VERSION)));
  HostSource src;
  src.code = absl::StrCat(
      "#include \"hsap_host_abi.h\"\nextern \"C\" __attribute__((visibility(\"default\"))) "
      "unsigned long sizes() { return sizeof(HsapHostForwardTask) * 1000000ul + "
      "sizeof(HsapHostBackwardTask) * 1000ul + sizeof(HsapHostKernelInfo); }\n");
  src.headers = {{"hsap_host_abi.h", text}};
  auto m = CompileHostModule(src, TestCache());
  ASSERT_TRUE(m.ok()) << m.status();
  auto sym = (*m)->Symbol("sizes");
  ASSERT_TRUE(sym.ok());
  EXPECT_EQ(reinterpret_cast<unsigned long (*)()>(*sym)(),
            sizeof(HsapHostForwardTask) * 1000000ul + sizeof(HsapHostBackwardTask) * 1000ul +
                sizeof(HsapHostKernelInfo));
}

}  // namespace
}  // namespace hsap::jit
