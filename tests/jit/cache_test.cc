#include "jit/cache.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <future>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/scoped_env.h"
#include "tests/support/test_files.h"

namespace hsap::jit {
namespace {

using ::hsap::testing::ReadFile;
using ::hsap::testing::WriteFile;

using ::testing::HasSubstr;

std::string MakeTempDir() { return testing::MakeTestTempDir("hsap_cache_test"); }

CompileCache::Options InDir(const std::string& dir) {
  CompileCache::Options options;
  options.dir = dir;
  return options;
}

bool Exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

CacheKey SampleKey() {
  CacheKey key;
  key.kind = "test-so";
  key.source = "int f() { return 42; }\n#include \"abi.h\"\n";
  key.source_suffix = "cc";
  key.headers = {{"abi.h", "struct P { int x; };"}};
  key.options = {"-O3", "-march=native"};
  key.arch = "x86-64 avx512f";
  key.compiler = "clang version 14.0.6";
  return key;
}

// A "compiler" that counts its calls and returns an artifact derived from the key.
struct FakeCompiler {
  std::atomic<int> calls{0};
  absl::StatusOr<std::string> operator()(const CacheKey& key) {
    ++calls;
    return absl::StrCat("artifact of ", Sha256::Hex(key.Digest()), std::string(1000, 'x'));
  }
};

TEST(Sha256Test, KnownVectors) {
  EXPECT_EQ(Sha256::Hex(Sha256::Of("")),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(Sha256::Hex(Sha256::Of("abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(Sha256::Hex(Sha256::Of("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  // One million 'a', fed in uneven pieces to exercise the buffering.
  Sha256 h;
  const std::string chunk(997, 'a');
  size_t left = 1000000;
  while (left > 0) {
    const size_t n = std::min(left, chunk.size());
    h.Update(chunk.data(), n);
    left -= n;
  }
  EXPECT_EQ(Sha256::Hex(h.Finish()),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(CacheKeyTest, EveryFieldChangesTheDigest) {
  const CacheKey base = SampleKey();
  std::vector<CacheKey> variants(8, base);
  variants[0].kind = "cubin";
  variants[1].source += " ";
  variants[2].headers[0].second = "struct P { long x; };";
  variants[3].headers[0].first = "abi2.h";
  variants[4].options.push_back("-ffp-contract=fast");
  variants[5].options = {"-march=native", "-O3"};  // order matters
  variants[6].arch = "x86-64 avx2";
  variants[7].compiler = "g++ 12.2";
  for (const CacheKey& v : variants) {
    EXPECT_NE(v.Digest(), base.Digest());
    EXPECT_NE(v.EntryName(), base.EntryName());
  }
  // Field boundaries are unambiguous: moving a character between fields changes the digest.
  CacheKey a = base, b = base;
  a.options = {"-O3", "x"};
  b.options = {"-O3x"};
  EXPECT_NE(a.Digest(), b.Digest());
  EXPECT_EQ(SampleKey().Digest(), base.Digest());
}

TEST(CompileCacheTest, SecondRunCompilesNothing) {
  const std::string dir = MakeTempDir();
  FakeCompiler compiler;
  const CacheKey key = SampleKey();
  std::string first;
  {
    CompileCache cache(InDir(dir));
    auto a = cache.GetOrCompile(key, [&] { return compiler(key); });
    ASSERT_TRUE(a.ok()) << a.status();
    first = *a;
    auto b = cache.GetOrCompile(key, [&] { return compiler(key); });
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(*b, first);
    EXPECT_EQ(cache.stats().compiles, 1);
    EXPECT_EQ(cache.stats().memory_hits, 1);
    EXPECT_TRUE(Exists(cache.EntryPath(key)));
  }
  // A new cache object (a second process) finds the entry on disk.
  CompileCache cache(InDir(dir));
  auto c = cache.GetOrCompile(key, [&] { return compiler(key); });
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(*c, first);
  EXPECT_EQ(compiler.calls, 1);
  EXPECT_EQ(cache.stats().compiles, 0);
  EXPECT_EQ(cache.stats().disk_hits, 1);
  EXPECT_DOUBLE_EQ(cache.stats().hit_rate(), 1.0);
}

TEST(CompileCacheTest, ChangingAnOptionOrAHeaderRecompiles) {
  const std::string dir = MakeTempDir();
  CompileCache cache(InDir(dir));
  FakeCompiler compiler;
  CacheKey key = SampleKey();
  ASSERT_TRUE(cache.GetOrCompile(key, [&] { return compiler(key); }).ok());
  key.options.push_back("-DTILE=32");
  ASSERT_TRUE(cache.GetOrCompile(key, [&] { return compiler(key); }).ok());
  EXPECT_EQ(compiler.calls, 2);
  key.headers[0].second += "\n// edited";
  auto r = cache.GetOrCompile(key, [&] { return compiler(key); });
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(compiler.calls, 3);
  EXPECT_THAT(*r, HasSubstr(Sha256::Hex(key.Digest())));
  EXPECT_EQ(cache.stats().compiles, 3);
}

// Lets `replace(path)` put something in place of the disk entry and checks that a fresh
// cache rebuilds it.
void ExpectRebuiltAfterReplacing(const std::function<void(const std::string&)>& replace) {
  const std::string dir = MakeTempDir();
  FakeCompiler compiler;
  const CacheKey key = SampleKey();
  std::string good;
  std::string path;
  {
    CompileCache cache(InDir(dir));
    auto a = cache.GetOrCompile(key, [&] { return compiler(key); });
    ASSERT_TRUE(a.ok());
    good = *a;
    path = cache.EntryPath(key);
  }
  const std::string entry = ReadFile(path);
  ASSERT_GT(entry.size(), good.size());
  replace(path);

  CompileCache cache(InDir(dir));
  auto b = cache.GetOrCompile(key, [&] { return compiler(key); });
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(*b, good);
  EXPECT_EQ(compiler.calls, 2);
  EXPECT_EQ(cache.stats().corrupt_entries, 1);
  EXPECT_EQ(cache.stats().disk_hits, 0);
  // The rebuilt entry is valid again.
  EXPECT_EQ(ReadFile(path), entry);
  CompileCache again(InDir(dir));
  ASSERT_TRUE(again.GetOrCompile(key, [&] { return compiler(key); }).ok());
  EXPECT_EQ(again.stats().disk_hits, 1);
}

// Replaces the disk entry with `damage(entry)` and checks that a fresh cache rebuilds it.
void ExpectRebuiltAfter(const std::function<std::string(const std::string&)>& damage) {
  ExpectRebuiltAfterReplacing(
      [&](const std::string& path) { WriteFile(path, damage(ReadFile(path))); });
}

TEST(CompileCacheTest, TruncatedEntryIsRebuilt) {
  ExpectRebuiltAfter([](const std::string& e) { return e.substr(0, e.size() - 100); });
  ExpectRebuiltAfter([](const std::string& e) { return e.substr(0, 20); });  // inside header
  ExpectRebuiltAfter([](const std::string&) { return std::string(); });
}

TEST(CompileCacheTest, CorruptEntryIsRebuilt) {
  ExpectRebuiltAfter([](std::string e) {
    e[e.size() - 7] ^= 0x01;  // one bit of the payload
    return e;
  });
  ExpectRebuiltAfter([](std::string e) {
    e[0] = 'X';  // magic
    return e;
  });
  ExpectRebuiltAfter([](std::string e) { return e + "trailing"; });
}

TEST(CompileCacheTest, ForeignEntryIsRebuilt) {
  // A valid entry of another key copied over this key's file.
  ExpectRebuiltAfter([](const std::string& e) {
    const std::string dir = MakeTempDir();
    CacheKey other = SampleKey();
    other.source = "something else";
    CompileCache cache(InDir(dir));
    EXPECT_TRUE(cache.GetOrCompile(other, [&] { return std::string(e.size(), 'y'); }).ok());
    return ReadFile(cache.EntryPath(other));
  });
  ExpectRebuiltAfter([](const std::string&) {
    return std::string(
        "\x7f"
        "ELF garbage");
  });
}

TEST(CompileCacheTest, FifoInPlaceOfAnEntryDoesNotBlock) {
  std::string fifo;
  std::future<void> rebuilt = std::async(std::launch::async, [&] {
    ExpectRebuiltAfterReplacing([&](const std::string& path) {
      ASSERT_EQ(unlink(path.c_str()), 0);
      ASSERT_EQ(mkfifo(path.c_str(), 0600), 0);
      fifo = path;
    });
  });
  if (rebuilt.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
    ADD_FAILURE() << "reading a FIFO cache entry blocks";
    // Release the blocked reader (a writer that closes at once gives it EOF), so the test ends.
    const int fd = open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
    if (fd >= 0) close(fd);
  }
  rebuilt.get();
}

TEST(CompileCacheTest, SymlinkToDevZeroIsRebuiltWithoutReadingIt) {
  rusage before;
  ASSERT_EQ(getrusage(RUSAGE_SELF, &before), 0);
  ExpectRebuiltAfterReplacing([](const std::string& path) {
    ASSERT_EQ(unlink(path.c_str()), 0);
    ASSERT_EQ(symlink("/dev/zero", path.c_str()), 0);
  });
  rusage after;
  ASSERT_EQ(getrusage(RUSAGE_SELF, &after), 0);
  // ru_maxrss is the peak in KiB: reading /dev/zero up to the payload bound would add GiBs.
  EXPECT_LT(after.ru_maxrss - before.ru_maxrss, 64 * 1024);
}

TEST(CompileCacheTest, DirectoryInPlaceOfAnEntryIsReportedNotRead) {
  const std::string dir = MakeTempDir();
  FakeCompiler compiler;
  const CacheKey key = SampleKey();
  CompileCache cache(InDir(dir));
  ASSERT_EQ(mkdir(cache.EntryPath(key).c_str(), 0700), 0);
  // A directory cannot be unlinked or renamed over; the artifact is still returned.
  auto a = cache.GetOrCompile(key, [&] { return compiler(key); });
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(compiler.calls, 1);
  EXPECT_EQ(cache.stats().corrupt_entries, 1);
  EXPECT_EQ(cache.stats().disk_write_failures, 1);
}

TEST(CompileCacheTest, FailedCompileIsReturnedAndNotCached) {
  const std::string dir = MakeTempDir();
  CompileCache cache(InDir(dir));
  const CacheKey key = SampleKey();
  int calls = 0;
  auto fail = [&]() -> absl::StatusOr<std::string> {
    ++calls;
    return absl::UnknownError("error: expected ';'");
  };
  auto a = cache.GetOrCompile(key, fail);
  EXPECT_FALSE(a.ok());
  EXPECT_THAT(std::string(a.status().message()), HasSubstr("expected ';'"));
  EXPECT_FALSE(cache.GetOrCompile(key, fail).ok());
  EXPECT_EQ(calls, 2);
  EXPECT_FALSE(Exists(cache.EntryPath(key)));
  EXPECT_EQ(cache.stats().compile_failures, 2);
}

TEST(CompileCacheTest, DisabledCacheAlwaysCompiles) {
  const std::string dir = MakeTempDir();
  CompileCache::Options options = InDir(dir);
  options.enabled = false;
  CompileCache cache(options);
  FakeCompiler compiler;
  const CacheKey key = SampleKey();
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(cache.GetOrCompile(key, [&] { return compiler(key); }).ok());
  }
  EXPECT_EQ(compiler.calls, 3);
  EXPECT_FALSE(Exists(cache.EntryPath(key)));
}

TEST(CompileCacheTest, MemoryOnlyWithoutDirectory) {
  CompileCache cache(CompileCache::Options{});
  FakeCompiler compiler;
  const CacheKey key = SampleKey();
  ASSERT_TRUE(cache.GetOrCompile(key, [&] { return compiler(key); }).ok());
  ASSERT_TRUE(cache.GetOrCompile(key, [&] { return compiler(key); }).ok());
  EXPECT_EQ(compiler.calls, 1);
  EXPECT_EQ(cache.EntryPath(key), "");
}

TEST(CompileCacheTest, ConcurrentThreadsCompileOnce) {
  const std::string dir = MakeTempDir();
  CompileCache cache(InDir(dir));
  FakeCompiler compiler;
  const CacheKey key = SampleKey();
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      auto r = cache.GetOrCompile(key, [&] { return compiler(key); });
      if (r.ok() && r->find(Sha256::Hex(key.Digest())) != std::string::npos) ++ok;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok, 8);
  EXPECT_EQ(compiler.calls, 1);
  EXPECT_EQ(cache.stats().memory_hits, 7);
}

TEST(CompileCacheTest, ProcessesRacingOnOneDirectoryAllSucceed) {
  const std::string dir = MakeTempDir();
  constexpr int kProcesses = 4;
  constexpr int kKeys = 12;
  std::vector<pid_t> children;
  for (int p = 0; p < kProcesses; ++p) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      // Child: its own cache object on the shared directory; every key, twice, in an order
      // that differs per process; exit 0 only if every artifact is right.
      CompileCache cache(InDir(dir));
      int bad = 0;
      for (int round = 0; round < 2; ++round) {
        for (int i = 0; i < kKeys; ++i) {
          CacheKey key = SampleKey();
          key.source = absl::StrCat("kernel ", (i + p * 5) % kKeys);
          cache.ClearMemory();  // force the disk path every time
          auto r = cache.GetOrCompile(key, [&]() -> absl::StatusOr<std::string> {
            return absl::StrCat(key.source, std::string(200000, 'z'));
          });
          if (!r.ok() || *r != absl::StrCat(key.source, std::string(200000, 'z'))) ++bad;
        }
      }
      _exit(bad == 0 ? 0 : 1);
    }
    children.push_back(pid);
  }
  for (pid_t pid : children) {
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  }
  // Every entry on disk is valid: a fresh cache reads all of them without compiling.
  CompileCache cache(InDir(dir));
  for (int i = 0; i < kKeys; ++i) {
    CacheKey key = SampleKey();
    key.source = absl::StrCat("kernel ", i);
    auto r = cache.GetOrCompile(key, []() -> absl::StatusOr<std::string> {
      return absl::InternalError("should not compile");
    });
    ASSERT_TRUE(r.ok()) << r.status();
  }
  EXPECT_EQ(cache.stats().disk_hits, kKeys);
  EXPECT_EQ(cache.stats().corrupt_entries, 0);
}

TEST(CompileCacheTest, DumpAndKeepSource) {
  const std::string dir = MakeTempDir();
  const std::string dump = dir + "/dump/nested";
  CompileCache::Options options = InDir(dir + "/cache");
  options.dump_dir = dump;
  CompileCache cache(options);
  const CacheKey key = SampleKey();
  ASSERT_TRUE(cache.GetOrCompile(key, [] { return absl::StatusOr<std::string>("a"); }).ok());
  EXPECT_EQ(ReadFile(dump + "/" + key.EntryName() + ".cc"), key.source);

  CompileCache no_dump(InDir(dir + "/cache2"));
  auto path = no_dump.KeepSource(key);
  ASSERT_TRUE(path.ok()) << path.status();
  EXPECT_THAT(*path, HasSubstr(dir + "/cache2/failed/"));
  EXPECT_EQ(ReadFile(*path), key.source);
}

TEST(CompileCacheTest, OptionsFromEnvironment) {
  testing::ScopedEnv cache_dir("HSAP_CACHE_DIR", nullptr);
  testing::ScopedEnv xdg("XDG_CACHE_HOME", nullptr);
  testing::ScopedEnv home("HOME", "/home/u");
  testing::ScopedEnv disable("HSAP_JIT_DISABLE_CACHE", nullptr);
  testing::ScopedEnv dump("HSAP_JIT_DUMP", nullptr);
  EXPECT_EQ(CompileCache::OptionsFromEnvironment().dir, "/home/u/.cache/hsap");
  xdg.Set("relative/xdg");  // relative: ignored
  EXPECT_EQ(CompileCache::OptionsFromEnvironment().dir, "/home/u/.cache/hsap");
  xdg.Set("/xdg");
  EXPECT_EQ(CompileCache::OptionsFromEnvironment().dir, "/xdg/hsap");
  cache_dir.Set("/explicit");
  EXPECT_EQ(CompileCache::OptionsFromEnvironment().dir, "/explicit");
  cache_dir.Set("cache");  // never the working directory
  EXPECT_EQ(CompileCache::OptionsFromEnvironment().dir, "/xdg/hsap");
  home.Set(nullptr);
  xdg.Set(nullptr);
  EXPECT_EQ(CompileCache::OptionsFromEnvironment().dir, "");
  EXPECT_TRUE(CompileCache::OptionsFromEnvironment().enabled);
  disable.Set("0");
  EXPECT_TRUE(CompileCache::OptionsFromEnvironment().enabled);
  disable.Set("1");
  EXPECT_FALSE(CompileCache::OptionsFromEnvironment().enabled);
  disable.Set("false");
  EXPECT_TRUE(CompileCache::OptionsFromEnvironment().enabled);
  disable.Set("sometimes");  // not a boolean: reported on stderr, and the cache stays off
  EXPECT_FALSE(CompileCache::OptionsFromEnvironment().enabled);
  dump.Set("/dumps");
  EXPECT_EQ(CompileCache::OptionsFromEnvironment().dump_dir, "/dumps");
}

}  // namespace
}  // namespace hsap::jit
