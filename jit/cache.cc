#include "jit/cache.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "base/params.h"
#include "base/status_macros.h"
#include "hsap/hsap.h"

namespace hsap::jit {
namespace {

// ---- SHA-256 constants (FIPS 180-4, 4.2.2 and 5.3.3) ----
constexpr uint32_t kRoundConstants[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

inline uint32_t Rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

// Disk entry format.
constexpr char kMagic[8] = {'H', 'S', 'A', 'P', 'J', 'I', 'T', '\0'};
constexpr uint32_t kFormatVersion = 1;
struct EntryHeader {
  char magic[8];
  uint32_t format_version;
  uint32_t library_version;
  uint8_t key_digest[32];
  uint64_t payload_length;
  uint8_t payload_digest[32];
};
static_assert(sizeof(EntryHeader) == 88);

// Upper bound on a payload we are willing to read back (a header claiming more is corrupt).
constexpr uint64_t kMaxPayload = uint64_t{1} << 31;

void AppendField(Sha256& h, absl::string_view field) {
  const uint64_t n = field.size();
  h.Update(&n, sizeof(n));
  h.Update(field);
}

// mkdir -p with mode 0700 for the directories it creates.
absl::Status MakeDirs(const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError("empty directory path");
  for (size_t pos = 1; pos <= path.size(); ++pos) {
    if (pos != path.size() && path[pos] != '/') continue;
    const std::string prefix = path.substr(0, pos);
    if (mkdir(prefix.c_str(), 0700) != 0 && errno != EEXIST) {
      return absl::UnavailableError(
          absl::StrCat("cannot create directory ", prefix, ": ", std::strerror(errno)));
    }
  }
  struct stat st;
  if (stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::UnavailableError(absl::StrCat(path, " is not a directory"));
  }
  return absl::OkStatus();
}

absl::Status WriteAll(int fd, const void* data, size_t size) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = write(fd, p, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::UnavailableError(absl::StrCat("write failed: ", std::strerror(errno)));
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// A unique suffix for temporary files: pid plus random bits (threads and processes).
std::string UniqueSuffix() {
  thread_local std::mt19937_64 rng(std::random_device{}() ^
                                   (static_cast<uint64_t>(getpid()) << 32));
  return absl::StrCat(getpid(), ".", absl::Hex(rng()));
}

// Writes `content` to `path` through a temporary file and rename().
absl::Status WriteFileAtomically(const std::string& path, absl::string_view head,
                                 absl::string_view content) {
  const std::string tmp = absl::StrCat(path, ".tmp.", UniqueSuffix());
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat("cannot create ", tmp, ": ", std::strerror(errno)));
  }
  absl::Status status = WriteAll(fd, head.data(), head.size());
  if (status.ok()) status = WriteAll(fd, content.data(), content.size());
  if (close(fd) != 0 && status.ok()) {
    status = absl::UnavailableError(absl::StrCat("close failed: ", std::strerror(errno)));
  }
  if (status.ok() && rename(tmp.c_str(), path.c_str()) != 0) {
    status = absl::UnavailableError(
        absl::StrCat("cannot rename ", tmp, " to ", path, ": ", std::strerror(errno)));
  }
  if (!status.ok()) unlink(tmp.c_str());
  return status;
}

// The bytes of the regular file at `path`. Never blocks and never follows a symlink (O_NOFOLLOW,
// O_NONBLOCK): a FIFO, device or link in place of an entry would otherwise hang the process or
// feed it endless bytes (/dev/zero). Such a file, or one larger than `max_size`, is
// FailedPrecondition; a missing one NotFound.
absl::StatusOr<std::string> ReadRegularFile(const std::string& path, uint64_t max_size) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) {
    if (errno == ENOENT) return absl::NotFoundError(path);
    if (errno == ELOOP) return absl::FailedPreconditionError(absl::StrCat(path, " is a symlink"));
    return absl::UnavailableError(absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
  }
  struct FdCloser {
    int fd;
    ~FdCloser() { close(fd); }
  } closer{fd};
  struct stat st;
  if (fstat(fd, &st) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot stat ", path, ": ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(path, " is not a regular file"));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size > max_size) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, " has ", size, " bytes, more than ", max_size));
  }
  // Exactly the size fstat saw (plus one byte to notice a file that grew): bounded memory.
  std::string data(size + 1, '\0');
  size_t got = 0;
  while (got < data.size()) {
    const ssize_t n = read(fd, data.data() + got, data.size() - got);
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::UnavailableError(absl::StrCat("read failed: ", std::strerror(errno)));
    }
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  data.resize(got);
  return data;
}

}  // namespace

// ------------------------------------------------------------------------------------------
Sha256::Sha256()
    : h_{0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
         0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19} {}

void Sha256::Block(const uint8_t* p) {
  uint32_t w[64];
  for (int i = 0; i < 16; ++i) {
    w[i] = (uint32_t{p[4 * i]} << 24) | (uint32_t{p[4 * i + 1]} << 16) |
           (uint32_t{p[4 * i + 2]} << 8) | uint32_t{p[4 * i + 3]};
  }
  for (int i = 16; i < 64; ++i) {
    const uint32_t s0 = Rotr(w[i - 15], 7) ^ Rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
    const uint32_t s1 = Rotr(w[i - 2], 17) ^ Rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  uint32_t a = h_[0], b = h_[1], c = h_[2], d = h_[3], e = h_[4], f = h_[5], g = h_[6], h = h_[7];
  for (int i = 0; i < 64; ++i) {
    const uint32_t s1 = Rotr(e, 6) ^ Rotr(e, 11) ^ Rotr(e, 25);
    const uint32_t ch = (e & f) ^ (~e & g);
    const uint32_t t1 = h + s1 + ch + kRoundConstants[i] + w[i];
    const uint32_t s0 = Rotr(a, 2) ^ Rotr(a, 13) ^ Rotr(a, 22);
    const uint32_t maj = (a & b) ^ (a & c) ^ (b & c);
    const uint32_t t2 = s0 + maj;
    h = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  h_[0] += a;
  h_[1] += b;
  h_[2] += c;
  h_[3] += d;
  h_[4] += e;
  h_[5] += f;
  h_[6] += g;
  h_[7] += h;
}

void Sha256::Update(const void* data, size_t size) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  total_bytes_ += size;
  if (buffered_ > 0) {
    const size_t take = std::min(size, sizeof(buffer_) - buffered_);
    std::memcpy(buffer_ + buffered_, p, take);
    buffered_ += take;
    p += take;
    size -= take;
    if (buffered_ < sizeof(buffer_)) return;
    Block(buffer_);
    buffered_ = 0;
  }
  for (; size >= 64; p += 64, size -= 64) Block(p);
  std::memcpy(buffer_, p, size);
  buffered_ = size;
}

Sha256::Digest Sha256::Finish() {
  const uint64_t bits = total_bytes_ * 8;
  const uint8_t pad = 0x80;
  Update(&pad, 1);
  const uint8_t zero = 0;
  while (buffered_ != 56) Update(&zero, 1);
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(bits >> (56 - 8 * i));
  Update(len, 8);
  Digest d;
  for (int i = 0; i < 8; ++i) {
    for (int j = 0; j < 4; ++j) d[4 * i + j] = static_cast<uint8_t>(h_[i] >> (24 - 8 * j));
  }
  return d;
}

Sha256::Digest Sha256::Of(absl::string_view s) {
  Sha256 h;
  h.Update(s);
  return h.Finish();
}

std::string Sha256::Hex(const Digest& d) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out(64, '0');
  for (int i = 0; i < 32; ++i) {
    out[2 * i] = kHex[d[i] >> 4];
    out[2 * i + 1] = kHex[d[i] & 15];
  }
  return out;
}

// ------------------------------------------------------------------------------------------
Sha256::Digest CacheKey::Digest() const {
  Sha256 h;
  AppendField(h, "hsap-jit-cache-key");
  AppendField(h, absl::StrCat(kFormatVersion, "/", HSAP_VERSION_CODE));
  AppendField(h, kind);
  AppendField(h, source);
  AppendField(h, absl::StrCat("headers:", headers.size()));
  for (const auto& [name, content] : headers) {
    AppendField(h, name);
    AppendField(h, content);
  }
  AppendField(h, absl::StrCat("options:", options.size()));
  for (const std::string& o : options) AppendField(h, o);
  AppendField(h, arch);
  AppendField(h, compiler);
  return h.Finish();
}

std::string CacheKey::EntryName() const {
  std::string safe_kind;
  for (char c : kind) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
    safe_kind.push_back(ok ? c : '_');
  }
  if (safe_kind.empty()) safe_kind = "artifact";
  return absl::StrCat(safe_kind, "-", Sha256::Hex(Digest()).substr(0, 32));
}

double CacheStats::hit_rate() const {
  const int64_t n = lookups();
  return n == 0 ? 0.0 : static_cast<double>(memory_hits + disk_hits) / static_cast<double>(n);
}

// ------------------------------------------------------------------------------------------
CompileCache::Options CompileCache::OptionsFromEnvironment() {
  Options o;
  const absl::StatusOr<bool> disable = GetBoolParam(Param::kJitDisableCache);
  if (!disable.ok()) {
    // No caller to return it to: say so, and compile every time as the variable asks.
    std::fprintf(stderr, "hsap: %s; the JIT cache is disabled\n",
                 std::string(disable.status().message()).c_str());
  }
  o.enabled = disable.ok() && !*disable;
  o.dump_dir = GetStringParam(Param::kJitDump);
  // Only absolute paths: a relative one would put the cache in the working directory.
  auto absolute = [](const std::string& p) { return !p.empty() && p[0] == '/'; };
  const std::string explicit_dir = GetStringParam(Param::kCacheDir);
  const std::string xdg = GetStringParam(Param::kXdgCacheHome);
  const std::string home = GetStringParam(Param::kHome);
  if (absolute(explicit_dir)) {
    o.dir = explicit_dir;
  } else if (absolute(xdg)) {
    o.dir = xdg + "/hsap";
  } else if (absolute(home)) {
    o.dir = home + "/.cache/hsap";
  }
  return o;
}

CompileCache& CompileCache::Global() {
  static CompileCache* const cache = new CompileCache(OptionsFromEnvironment());
  return *cache;
}

CompileCache::CompileCache(Options options) : options_(std::move(options)) {}

std::string CompileCache::EntryPath(const CacheKey& key) const {
  if (options_.dir.empty()) return "";
  return absl::StrCat(options_.dir, "/", key.EntryName(), ".bin");
}

absl::StatusOr<std::string> CompileCache::ReadEntry(const std::string& path,
                                                    const Sha256::Digest& digest) {
  absl::StatusOr<std::string> data = ReadRegularFile(path, kMaxPayload + sizeof(EntryHeader));
  // Missing, or unreadable for a reason of the system's: compile, leave the file alone.
  if (!data.ok() && !absl::IsFailedPrecondition(data.status())) return data.status();
  EntryHeader header;
  bool valid = data.ok() && data->size() >= sizeof(header);
  if (valid) {
    std::memcpy(&header, data->data(), sizeof(header));
    valid = std::memcmp(header.magic, kMagic, sizeof(kMagic)) == 0 &&
            header.format_version == kFormatVersion &&
            header.library_version == HSAP_VERSION_CODE &&
            std::memcmp(header.key_digest, digest.data(), digest.size()) == 0 &&
            header.payload_length == data->size() - sizeof(header);
  }
  if (valid) {
    const Sha256::Digest payload_digest =
        Sha256::Of(absl::string_view(*data).substr(sizeof(header)));
    valid = std::memcmp(header.payload_digest, payload_digest.data(), 32) == 0;
  }
  if (!valid) {
    unlink(path.c_str());  // rebuilt by the caller; a racing writer's rename still lands
    {
      absl::MutexLock lock(&mu_);
      ++stats_.corrupt_entries;
    }
    return absl::DataLossError(absl::StrCat("invalid cache entry ", path));
  }
  return data->substr(sizeof(header));
}

absl::Status CompileCache::WriteEntry(const std::string& path, const Sha256::Digest& digest,
                                      absl::string_view payload) const {
  HSAP_RETURN_IF_ERROR(MakeDirs(options_.dir));
  EntryHeader header;
  std::memset(&header, 0, sizeof(header));
  std::memcpy(header.magic, kMagic, sizeof(kMagic));
  header.format_version = kFormatVersion;
  header.library_version = HSAP_VERSION_CODE;
  std::memcpy(header.key_digest, digest.data(), digest.size());
  header.payload_length = payload.size();
  const Sha256::Digest payload_digest = Sha256::Of(payload);
  std::memcpy(header.payload_digest, payload_digest.data(), payload_digest.size());
  return WriteFileAtomically(
      path, absl::string_view(reinterpret_cast<const char*>(&header), sizeof(header)), payload);
}

void CompileCache::Dump(const CacheKey& key, const std::string& name) const {
  if (options_.dump_dir.empty()) return;
  if (!MakeDirs(options_.dump_dir).ok()) return;
  const std::string suffix = key.source_suffix.empty() ? "txt" : key.source_suffix;
  // Best effort: a dump that cannot be written must not fail the compile.
  (void)WriteFileAtomically(absl::StrCat(options_.dump_dir, "/", name, ".", suffix), "",
                            key.source);
}

absl::StatusOr<std::string> CompileCache::KeepSource(const CacheKey& key) const {
  std::string dir = options_.dump_dir;
  if (dir.empty() && !options_.dir.empty()) dir = options_.dir + "/failed";
  if (dir.empty() || !MakeDirs(dir).ok()) {
    const std::string tmp = GetStringParam(Param::kTmpDir);
    dir = (!tmp.empty() && tmp[0] == '/') ? tmp : "/tmp";
  }
  const std::string suffix = key.source_suffix.empty() ? "txt" : key.source_suffix;
  const std::string path = absl::StrCat(dir, "/", key.EntryName(), ".", suffix);
  HSAP_RETURN_IF_ERROR(WriteFileAtomically(path, "", key.source));
  return path;
}

absl::StatusOr<std::string> CompileCache::GetOrCompile(
    const CacheKey& key, absl::FunctionRef<absl::StatusOr<std::string>()> compile) {
  const std::string name = key.EntryName();
  Dump(key, name);

  auto timed_compile = [&]() -> absl::StatusOr<std::string> {
    const auto start = std::chrono::steady_clock::now();
    absl::StatusOr<std::string> artifact = compile();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    absl::MutexLock lock(&mu_);
    ++stats_.compiles;
    stats_.compile_seconds += seconds;
    if (!artifact.ok()) ++stats_.compile_failures;
    return artifact;
  };
  if (!options_.enabled) return timed_compile();

  std::shared_ptr<Entry> entry;
  {
    absl::MutexLock lock(&mu_);
    std::shared_ptr<Entry>& slot = entries_[name];
    if (slot == nullptr) slot = std::make_shared<Entry>();
    entry = slot;
  }
  // One compile per key at a time: later callers wait here and find the artifact.
  absl::MutexLock entry_lock(&entry->mu);
  if (entry->artifact != nullptr) {
    absl::MutexLock lock(&mu_);
    ++stats_.memory_hits;
    return *entry->artifact;
  }

  const Sha256::Digest digest = key.Digest();
  const std::string path = EntryPath(key);
  if (!path.empty()) {
    absl::StatusOr<std::string> payload = ReadEntry(path, digest);
    if (payload.ok()) {
      entry->artifact = std::make_shared<const std::string>(*payload);
      absl::MutexLock lock(&mu_);
      ++stats_.disk_hits;
      return std::move(*payload);
    }
  }

  absl::StatusOr<std::string> artifact = timed_compile();
  if (!artifact.ok()) return artifact.status();
  entry->artifact = std::make_shared<const std::string>(*artifact);
  if (!path.empty()) {
    // A cache that cannot be written is not an error: the artifact is still good.
    if (!WriteEntry(path, digest, *artifact).ok()) {
      absl::MutexLock lock(&mu_);
      ++stats_.disk_write_failures;
    }
  }
  return artifact;
}

CacheStats CompileCache::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

void CompileCache::ResetStats() {
  absl::MutexLock lock(&mu_);
  stats_ = CacheStats();
}

void CompileCache::ClearMemory() {
  absl::MutexLock lock(&mu_);
  entries_.clear();
}

}  // namespace hsap::jit
