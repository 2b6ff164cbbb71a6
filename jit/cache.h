// The JIT compile cache: compiled artifacts (cubins, host shared objects) kept in memory and
// on disk, keyed by everything that can change the compiler's output.
//
// Key. A CacheKey lists the generated source, the content of every header it includes, all
// compiler options, the exact target architecture, the compiler's identity and version, and
// an artifact kind; its digest (SHA-256 over length-prefixed fields, plus the library's
// HSAP_VERSION_CODE and the cache format version) names the entry. Two keys that differ in
// any field get different entries.
//
// Disk. Entries live under, in order of preference, $HSAP_CACHE_DIR, $XDG_CACHE_HOME/hsap,
// $HOME/.cache/hsap; relative paths are ignored (the cache never lands in the working
// directory) and with none of them the cache is memory-only. An entry is one file
// `<kind>-<digest hex>.bin` holding a header (magic, format version, key digest, payload
// length, payload SHA-256) then the payload. It is written to a temporary file in the same
// directory and rename()d into place, so readers see either no entry or a whole one, and
// processes racing on one directory all succeed (the last rename wins; contents are equal).
// A truncated, corrupt or foreign file is detected, deleted and rebuilt, never returned.
//
// Artifacts are returned as bytes. The host JIT stores shared objects this way and loads
// them from an anonymous in-memory file (see jit/host_compiler.h), so no .so is left behind.
//
// Environment (base/params.h). HSAP_JIT_DISABLE_CACHE=1 bypasses memory and disk: every call
// compiles (so does a value that is not a boolean, reported on stderr). HSAP_JIT_DUMP=dir writes
// each generated source to dir/<kind>-<digest>.<suffix>.
//
// Thread safety: all methods may be called concurrently. Concurrent calls with the same key
// compile once; the others wait and then count a memory hit.
#ifndef HSAP_JIT_CACHE_H_
#define HSAP_JIT_CACHE_H_

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace hsap::jit {

// SHA-256 (FIPS 180-4), incremental.
class Sha256 {
 public:
  using Digest = std::array<uint8_t, 32>;

  Sha256();
  void Update(const void* data, size_t size);
  void Update(absl::string_view s) { Update(s.data(), s.size()); }
  Digest Finish();  // the object must not be updated afterwards

  static Digest Of(absl::string_view s);
  static std::string Hex(const Digest& d);

 private:
  void Block(const uint8_t* p);
  uint32_t h_[8];
  uint8_t buffer_[64];
  size_t buffered_ = 0;
  uint64_t total_bytes_ = 0;
};

// Everything that determines a compiled artifact.
struct CacheKey {
  std::string kind;           // artifact kind, e.g. "host-so", "cubin"; [a-z0-9_-] only
  std::string source;         // the generated source
  std::string source_suffix;  // file suffix of the source for dumps, e.g. "cc", "cu"
  // (include name, content) of every header the source includes.
  std::vector<std::pair<std::string, std::string>> headers;
  std::vector<std::string> options;  // compiler options, in order
  std::string arch;                  // exact target, e.g. "sm_90", "x86-64 avx512f,..."
  std::string compiler;              // compiler identity and version, e.g. its --version
  // The digest of all of the above plus HSAP_VERSION_CODE and the cache format version.
  Sha256::Digest Digest() const;
  // "<kind>-<first 32 hex digits of the digest>": the entry's file stem.
  std::string EntryName() const;
};

struct CacheStats {
  int64_t memory_hits = 0;
  int64_t disk_hits = 0;
  int64_t compiles = 0;          // calls of the compile function (successful or not)
  int64_t compile_failures = 0;  // of which failed
  int64_t corrupt_entries = 0;   // disk entries found invalid, deleted and rebuilt
  int64_t disk_write_failures = 0;
  double compile_seconds = 0;  // wall time spent in the compile function

  int64_t lookups() const { return memory_hits + disk_hits + compiles; }
  // Hits over lookups, 0 with no lookups.
  double hit_rate() const;
};

class CompileCache {
 public:
  struct Options {
    std::string dir;       // disk cache directory; empty: memory only
    bool enabled = true;   // false: every call compiles (HSAP_JIT_DISABLE_CACHE)
    std::string dump_dir;  // non-empty: keep generated sources here (HSAP_JIT_DUMP)
  };

  // Options from the environment as described above.
  static Options OptionsFromEnvironment();
  // The process-wide cache, built from the environment on first use.
  static CompileCache& Global();

  explicit CompileCache(Options options);
  CompileCache(const CompileCache&) = delete;
  CompileCache& operator=(const CompileCache&) = delete;

  // The artifact of `key`: from memory, else from disk, else from compile() (then stored in
  // both). A failed compile is returned as is and not cached.
  absl::StatusOr<std::string> GetOrCompile(
      const CacheKey& key, absl::FunctionRef<absl::StatusOr<std::string>()> compile);

  // Writes key.source where a user can read it after a failure: the dump directory, else
  // <dir>/failed/, else $TMPDIR (or /tmp). Returns the path. Compilers call this to report
  // the source path together with a compile log.
  absl::StatusOr<std::string> KeepSource(const CacheKey& key) const;

  // Path of the disk entry of `key` (empty when the cache is memory-only); for tests.
  std::string EntryPath(const CacheKey& key) const;

  CacheStats stats() const;
  void ResetStats();
  // Forgets the in-memory entries (the disk stays); for tests and benches.
  void ClearMemory();
  const Options& options() const { return options_; }

 private:
  struct Entry {
    absl::Mutex mu;
    std::shared_ptr<const std::string> artifact;  // guarded by mu
  };

  // The payload of the disk entry at `path`: NotFound when there is none, DataLoss (after
  // deleting the file) when it is truncated, corrupt or belongs to another key.
  absl::StatusOr<std::string> ReadEntry(const std::string& path, const Sha256::Digest& digest);
  absl::Status WriteEntry(const std::string& path, const Sha256::Digest& digest,
                          absl::string_view payload) const;
  void Dump(const CacheKey& key, const std::string& name) const;

  const Options options_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Entry>> entries_;  // guarded by mu_
  CacheStats stats_;                                                  // guarded by mu_
};

}  // namespace hsap::jit

#endif  // HSAP_JIT_CACHE_H_
