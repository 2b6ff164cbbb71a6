// The single-device C API (hsapLayout*, hsapAttention*Local) called from C++: argument
// checks (result code, a message naming the argument, outputs untouched) and results
// against the fp64 reference.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "attention/dtype.h"
#include "attention/layout.h"
#include "attention/reference.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "hsap/hsap.h"
#include "lib/api/checks.h"
#include "tests/support/tolerance.h"

namespace hsap {
namespace {

using ::testing::HasSubstr;

// Stores an integer into an enum field of a C struct the way C code may, without forming
// an out-of-range enum value in C++.
template <typename E>
void SetRaw(E& field, int value) {
  const std::underlying_type_t<E> raw = static_cast<std::underlying_type_t<E>>(value);
  std::memcpy(&field, &raw, sizeof(raw));
}

// Owns a layout handle.
struct LayoutHandle {
  hsapLayout_t h = nullptr;
  LayoutHandle() = default;
  explicit LayoutHandle(hsapLayout_t layout) : h(layout) {}
  LayoutHandle(const LayoutHandle&) = delete;
  LayoutHandle& operator=(const LayoutHandle&) = delete;
  ~LayoutHandle() { hsapLayoutDestroy(h); }
};

hsapLayout_t MustCreate(const std::vector<int64_t>& cu, const std::vector<hsapMaskKind_t>& kinds,
                        const std::vector<int64_t>& params) {
  hsapLayout_t layout = nullptr;
  EXPECT_EQ(hsapLayoutCreate(&layout, cu.data(), static_cast<int64_t>(cu.size()) - 1,
                             kinds.empty() ? nullptr : kinds.data(),
                             params.empty() ? nullptr : params.data()),
            hsapSuccess)
      << hsapGetLastError();
  return layout;
}

hsapDataType_t ToC(DType t) {
  return t == DType::kF32 ? hsapFloat32 : t == DType::kBF16 ? hsapBFloat16 : hsapFloat16;
}

// A tensor stored in `dtype`, with uniform random values in [-1, 1).
struct HostTensor {
  DType dtype = DType::kF32;
  int64_t tokens = 0;
  int heads = 0, head_dim = 0;
  std::vector<uint8_t> bytes;

  HostTensor(DType t, int64_t n, int h, int d) : dtype(t), tokens(n), heads(h), head_dim(d) {
    bytes.assign(size() * DTypeSize(t), 0);
  }
  size_t size() const { return static_cast<size_t>(tokens) * heads * head_dim; }
  void Randomize(std::mt19937& rng) {
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (size_t i = 0; i < size(); ++i) StoreFromFloat(dtype, bytes.data(), i, u(rng));
  }
  void Fill(uint8_t byte) { std::fill(bytes.begin(), bytes.end(), byte); }
  float At(size_t i) const { return LoadAsFloat(dtype, bytes.data(), i); }
  hsapTensor_t C() { return hsapTensor_t{bytes.data(), ToC(dtype), tokens, heads, head_dim}; }
};

// Inputs and outputs of one local attention problem.
struct Problem {
  int64_t tokens;
  int hq, hkv, d;
  HostTensor q, k, v, out, dout, dq, dk, dv;
  std::vector<float> lse;

  Problem(DType t, int64_t n, int heads_q, int heads_kv, int head_dim, uint32_t seed = 7)
      : tokens(n),
        hq(heads_q),
        hkv(heads_kv),
        d(head_dim),
        q(t, n, heads_q, head_dim),
        k(t, n, heads_kv, head_dim),
        v(t, n, heads_kv, head_dim),
        out(t, n, heads_q, head_dim),
        dout(t, n, heads_q, head_dim),
        dq(t, n, heads_q, head_dim),
        dk(t, n, heads_kv, head_dim),
        dv(t, n, heads_kv, head_dim),
        lse(static_cast<size_t>(n) * heads_q, 0.0f) {
    std::mt19937 rng(seed);
    q.Randomize(rng);
    k.Randomize(rng);
    v.Randomize(rng);
    dout.Randomize(rng);
  }
};

// Calls the forward with the problem's tensors, optionally edited by `edit`.
struct ForwardCall {
  const hsapAttentionConfig_t* config = nullptr;
  hsapLayout_t layout = nullptr;
  hsapTensor_t q, k, v, out;
  float* lse;

  ForwardCall(Problem& p, hsapLayout_t l)
      : layout(l), q(p.q.C()), k(p.k.C()), v(p.v.C()), out(p.out.C()), lse(p.lse.data()) {}
  hsapResult_t Run(bool null_q = false, bool null_k = false, bool null_v = false,
                   bool null_out = false) {
    return hsapAttentionForwardLocal(config, layout, null_q ? nullptr : &q, null_k ? nullptr : &k,
                                     null_v ? nullptr : &v, null_out ? nullptr : &out, lse);
  }
};

class ApiLocalErrorsTest : public ::testing::Test {
 protected:
  static constexpr int64_t kTokens = 48;
  ApiLocalErrorsTest()
      : layout_(MustCreate({0, 20, 20, 48}, {hsapMaskCausal, hsapMaskFull, hsapMaskPrefixLM},
                           {0, 0, 8})),
        p_(DType::kF32, kTokens, 4, 2, 32) {
    p_.out.Fill(0xab);
    p_.dq.Fill(0xcd);
    p_.dk.Fill(0xcd);
    p_.dv.Fill(0xcd);
    std::fill(p_.lse.begin(), p_.lse.end(), 123.0f);
    saved_out_ = p_.out.bytes;
    saved_grad_ = p_.dq.bytes;
  }
  void ExpectOutputsUntouched() {
    EXPECT_EQ(p_.out.bytes, saved_out_);
    EXPECT_TRUE(std::all_of(p_.lse.begin(), p_.lse.end(), [](float x) { return x == 123.0f; }));
    EXPECT_EQ(p_.dq.bytes, saved_grad_);
    EXPECT_TRUE(
        std::all_of(p_.dk.bytes.begin(), p_.dk.bytes.end(), [](uint8_t b) { return b == 0xcd; }));
    EXPECT_TRUE(
        std::all_of(p_.dv.bytes.begin(), p_.dv.bytes.end(), [](uint8_t b) { return b == 0xcd; }));
  }
  void ExpectForwardFails(ForwardCall& call, hsapResult_t want, const std::string& message,
                          bool null_q = false, bool null_k = false, bool null_v = false,
                          bool null_out = false) {
    EXPECT_EQ(call.Run(null_q, null_k, null_v, null_out), want) << hsapGetLastError();
    EXPECT_THAT(std::string(hsapGetLastError()), HasSubstr(message));
    EXPECT_THAT(std::string(hsapGetLastError()), HasSubstr("hsapAttentionForwardLocal: "));
    ExpectOutputsUntouched();
  }

  LayoutHandle layout_;
  Problem p_;
  std::vector<uint8_t> saved_out_, saved_grad_;
};

TEST(ApiLayoutTest, RejectsBadDocumentsAndNamesTheArgument) {
  hsapLayout_t sentinel = reinterpret_cast<hsapLayout_t>(uintptr_t{0x1234});
  hsapLayout_t layout = sentinel;
  const int64_t cu[] = {0, 10, 30};
  struct Case {
    std::vector<int64_t> cu;
    std::vector<hsapMaskKind_t> kinds;
    std::vector<int64_t> params;
    const char* message;
  };
  const std::vector<Case> cases = {
      {{1, 10, 30}, {}, {}, "cu_seqlens[0]"},
      {{0, 10, 5}, {}, {}, "non-decreasing"},
      // A window longer than its document is the whole document (clamped); a negative one
      // is an error.
      {{0, 10, 30}, {hsapMaskCausal, hsapMaskSlidingWindow}, {0, -3}, "params[1]"},
      {{0, 10, 30}, {hsapMaskPrefixLM, hsapMaskCausal}, {11, 0}, "params[0]"},
      {{0, 10, 30}, {hsapMaskCausal, hsapMaskSlidingWindow}, {0, 0}, "params[1]"},
      {{0, 10, 30}, {hsapMaskCausal, hsapMaskSlidingWindow}, {}, "params"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(hsapLayoutCreate(&layout, c.cu.data(), static_cast<int64_t>(c.cu.size()) - 1,
                               c.kinds.empty() ? nullptr : c.kinds.data(),
                               c.params.empty() ? nullptr : c.params.data()),
              hsapInvalidArgument)
        << c.message;
    EXPECT_THAT(std::string(hsapGetLastError()), HasSubstr(c.message));
    EXPECT_THAT(std::string(hsapGetLastError()), HasSubstr("hsapLayoutCreate: "));
    EXPECT_EQ(layout, sentinel);
  }
  // An integer that is no mask kind (stored raw: C++ may not form such an enum value).
  hsapMaskKind_t bad_kinds[2] = {hsapMaskCausal, hsapMaskCausal};
  SetRaw(bad_kinds[1], 9);
  EXPECT_EQ(hsapLayoutCreate(&layout, cu, 2, bad_kinds, nullptr), hsapInvalidArgument);
  EXPECT_THAT(std::string(hsapGetLastError()), HasSubstr("kinds[1] is 9"));
  EXPECT_EQ(hsapLayoutCreate(nullptr, cu, 2, nullptr, nullptr), hsapInvalidArgument);
  EXPECT_THAT(std::string(hsapGetLastError()), HasSubstr("layout is null"));
  EXPECT_EQ(hsapLayoutCreate(&layout, nullptr, 2, nullptr, nullptr), hsapInvalidArgument);
  EXPECT_THAT(std::string(hsapGetLastError()), HasSubstr("cuSeqlens is null"));
  EXPECT_EQ(hsapLayoutCreate(&layout, cu, -1, nullptr, nullptr), hsapInvalidArgument);
  EXPECT_THAT(std::string(hsapGetLastError()), HasSubstr("numDocs"));
  EXPECT_EQ(layout, sentinel);

  // Zero documents: an empty row.
  const int64_t zero[] = {0};
  ASSERT_EQ(hsapLayoutCreate(&layout, zero, 0, nullptr, nullptr), hsapSuccess);
  LayoutHandle empty(layout);
  int64_t tokens = -1, pairs = -1;
  EXPECT_EQ(hsapLayoutGetNumTokens(empty.h, &tokens), hsapSuccess);
  EXPECT_EQ(hsapLayoutGetVisiblePairs(empty.h, &pairs), hsapSuccess);
  EXPECT_EQ(tokens, 0);
  EXPECT_EQ(pairs, 0);
  EXPECT_EQ(std::string(hsapGetLastError()), "");
}

TEST(ApiLayoutTest, RejectsBadSlices) {
  hsapLayout_t layout = nullptr;
  hsapMaskSlice_t s{0, 4, 0, 4, hsapSliceFull, 0};
  EXPECT_EQ(hsapLayoutCreateFromSlices(&layout, 8, nullptr, 1), hsapInvalidArgument);
  EXPECT_THAT(std::string(hsapGetLastError()), HasSubstr("slices is null"));
  EXPECT_EQ(hsapLayoutCreateFromSlices(&layout, -1, &s, 1), hsapInvalidArgument);
  EXPECT_THAT(std::string(hsapGetLastError()), HasSubstr("numTokens"));
  EXPECT_EQ(hsapLayoutCreateFromSlices(&layout, 8, &s, -2), hsapInvalidArgument);
  EXPECT_THAT(std::string(hsapGetLastError()), HasSubstr("numSlices"));
  s.window = 3;
  EXPECT_EQ(hsapLayoutCreateFromSlices(&layout, 8, &s, 1), hsapInvalidArgument);
  EXPECT_THAT(std::string(hsapGetLastError()), HasSubstr("slices[0]"));
  s.kind = hsapSliceCausal;
  s.window = -1;
  EXPECT_EQ(hsapLayoutCreateFromSlices(&layout, 8, &s, 1), hsapInvalidArgument);
  EXPECT_THAT(std::string(hsapGetLastError()), HasSubstr("slices[0].window"));
  s.window = 0;
  SetRaw(s.kind, 5);
  EXPECT_EQ(hsapLayoutCreateFromSlices(&layout, 8, &s, 1), hsapInvalidArgument);
  EXPECT_THAT(std::string(hsapGetLastError()), HasSubstr("slices[0].kind"));
  s.kind = hsapSliceFull;
  s.qEnd = 9;
  EXPECT_EQ(hsapLayoutCreateFromSlices(&layout, 8, &s, 1), hsapInvalidArgument);
  EXPECT_THAT(std::string(hsapGetLastError()), HasSubstr("slices[0]"));
  const hsapMaskSlice_t overlap[2] = {{0, 4, 0, 4, hsapSliceFull, 0},
                                      {2, 6, 2, 6, hsapSliceCausal, 0}};
  EXPECT_EQ(hsapLayoutCreateFromSlices(&layout, 8, overlap, 2), hsapInvalidArgument);
  EXPECT_EQ(layout, nullptr);

  int64_t n = 0;
  EXPECT_EQ(hsapLayoutGetNumTokens(nullptr, &n), hsapInvalidArgument);
  EXPECT_THAT(std::string(hsapGetLastError()), HasSubstr("layout is null"));
  LayoutHandle ok(MustCreate({0, 8}, {}, {}));
  EXPECT_EQ(hsapLayoutGetNumTokens(ok.h, nullptr), hsapInvalidArgument);
  EXPECT_THAT(std::string(hsapGetLastError()), HasSubstr("numTokens is null"));
  EXPECT_EQ(hsapLayoutGetVisiblePairs(ok.h, nullptr), hsapInvalidArgument);
  EXPECT_EQ(hsapLayoutGetSlices(ok.h, nullptr, nullptr), hsapInvalidArgument);
  EXPECT_EQ(hsapLayoutDestroy(nullptr), hsapSuccess);
}

// Whether the C slices cover (q, k), and how often.
int Coverage(const std::vector<hsapMaskSlice_t>& slices, int64_t q, int64_t k) {
  int n = 0;
  for (const hsapMaskSlice_t& s : slices) {
    if (q < s.qBegin || q >= s.qEnd || k < s.kBegin || k >= s.kEnd) continue;
    if (s.kind == hsapSliceFull) {
      ++n;
      continue;
    }
    const int64_t dq = q - s.qBegin, dk = k - s.kBegin;
    if (dk <= dq && (s.window == 0 || dk > dq - s.window)) ++n;
  }
  return n;
}

std::vector<hsapMaskSlice_t> GetSlices(hsapLayout_t layout) {
  int64_t n = -1;
  EXPECT_EQ(hsapLayoutGetSlices(layout, nullptr, &n), hsapSuccess);
  std::vector<hsapMaskSlice_t> slices(static_cast<size_t>(std::max<int64_t>(n, 0)));
  int64_t cap = n;
  EXPECT_EQ(hsapLayoutGetSlices(layout, slices.data(), &cap), hsapSuccess);
  EXPECT_EQ(cap, n);
  return slices;
}

TEST(ApiLayoutTest, SlicesCoverTheMaskExactlyOnce) {
  LayoutHandle docs(MustCreate(
      {0, 9, 9, 25, 40, 52},
      {hsapMaskCausal, hsapMaskFull, hsapMaskPrefixLM, hsapMaskSlidingWindow, hsapMaskFull},
      {0, 0, 5, 4, 0}));
  // Bands that do not pass through their slice's corner, built through the C++ API: the C
  // form must split them.
  std::vector<MaskSlice> bands = {
      {0, 10, 0, 12, -kNoDiagLimit, 3},     // causal shifted right
      {10, 20, 10, 20, -kNoDiagLimit, -2},  // causal shifted down
      {20, 30, 20, 30, -2, kNoDiagLimit},   // anti-causal with a bound
      {30, 40, 30, 44, -3, 5},              // general band
      {40, 50, 44, 60, -4, 0},              // windowed causal
  };
  absl::StatusOr<Layout> banded = Layout::FromSlices(60, bands);
  ASSERT_TRUE(banded.ok()) << banded.status();
  hsapLayout_st banded_handle{*banded};

  for (hsapLayout_t layout : {docs.h, &banded_handle}) {
    const Layout& l = layout->layout;
    const std::vector<hsapMaskSlice_t> slices = GetSlices(layout);
    ASSERT_FALSE(slices.empty());
    int64_t pairs = 0;
    for (int64_t q = 0; q < l.num_tokens(); ++q) {
      for (int64_t k = 0; k < l.num_tokens(); ++k) {
        ASSERT_EQ(Coverage(slices, q, k), l.Visible(q, k) ? 1 : 0) << q << ", " << k;
        pairs += l.Visible(q, k);
      }
    }
    int64_t got_pairs = -1;
    ASSERT_EQ(hsapLayoutGetVisiblePairs(layout, &got_pairs), hsapSuccess);
    EXPECT_EQ(got_pairs, pairs);
    // Round trip through hsapLayoutCreateFromSlices.
    hsapLayout_t rebuilt = nullptr;
    ASSERT_EQ(hsapLayoutCreateFromSlices(&rebuilt, l.num_tokens(), slices.data(),
                                         static_cast<int64_t>(slices.size())),
              hsapSuccess)
        << hsapGetLastError();
    LayoutHandle owner(rebuilt);
    for (int64_t q = 0; q < l.num_tokens(); ++q) {
      for (int64_t k = 0; k < l.num_tokens(); ++k) {
        ASSERT_EQ(rebuilt->layout.Visible(q, k), l.Visible(q, k));
      }
    }
  }

  // A short buffer receives a prefix; *numSlices reports the full count.
  const std::vector<hsapMaskSlice_t> all = GetSlices(docs.h);
  ASSERT_GE(all.size(), 2u);
  std::vector<hsapMaskSlice_t> two(2);
  int64_t cap = 2;
  ASSERT_EQ(hsapLayoutGetSlices(docs.h, two.data(), &cap), hsapSuccess);
  EXPECT_EQ(cap, static_cast<int64_t>(all.size()));
  for (int i = 0; i < 2; ++i) {  // field by field: the struct has padding
    EXPECT_EQ(two[i].qBegin, all[i].qBegin);
    EXPECT_EQ(two[i].qEnd, all[i].qEnd);
    EXPECT_EQ(two[i].kBegin, all[i].kBegin);
    EXPECT_EQ(two[i].kEnd, all[i].kEnd);
    EXPECT_EQ(two[i].kind, all[i].kind);
    EXPECT_EQ(two[i].window, all[i].window);
  }
  cap = -1;
  EXPECT_EQ(hsapLayoutGetSlices(docs.h, two.data(), &cap), hsapInvalidArgument);
}

TEST_F(ApiLocalErrorsTest, NullArguments) {
  ForwardCall call(p_, layout_.h);
  ExpectForwardFails(call, hsapInvalidArgument, "q is null", true);
  ExpectForwardFails(call, hsapInvalidArgument, "k is null", false, true);
  ExpectForwardFails(call, hsapInvalidArgument, "v is null", false, false, true);
  ExpectForwardFails(call, hsapInvalidArgument, "out is null", false, false, false, true);
  call.lse = nullptr;
  ExpectForwardFails(call, hsapInvalidArgument, "lse is null");
  call.lse = p_.lse.data();
  call.layout = nullptr;
  ExpectForwardFails(call, hsapInvalidArgument, "layout is null");
  call.layout = layout_.h;
  call.v.data = nullptr;
  ExpectForwardFails(call, hsapInvalidArgument, "v.data is null");
}

TEST_F(ApiLocalErrorsTest, ShapesAgainstTheLayoutAndEachOther) {
  {
    ForwardCall call(p_, layout_.h);
    call.q.numTokens = kTokens - 1;
    ExpectForwardFails(call, hsapInvalidArgument,
                       "q has 47 tokens, expected 48 (the layout's token count)");
  }
  {
    ForwardCall call(p_, layout_.h);
    call.k.numTokens = kTokens + 1;
    ExpectForwardFails(call, hsapInvalidArgument, "k has 49 tokens, expected 48");
  }
  {
    ForwardCall call(p_, layout_.h);
    call.q.numHeads = 3;  // not a multiple of k's 2 heads
    ExpectForwardFails(call, hsapInvalidArgument, "not a multiple of k's 2 heads");
  }
  {
    ForwardCall call(p_, layout_.h);
    call.v.numHeads = 1;
    ExpectForwardFails(call, hsapInvalidArgument, "v has 1 heads, expected 2");
  }
  {
    ForwardCall call(p_, layout_.h);
    call.out.headDim = 40;
    ExpectForwardFails(call, hsapInvalidArgument, "out has head dim 40, expected 32");
  }
  {
    ForwardCall call(p_, layout_.h);
    call.k.headDim = 40;
    ExpectForwardFails(call, hsapInvalidArgument, "k has head dim 40, expected 32");
  }
  for (int bad_dim : {16, 36, 264}) {
    ForwardCall call(p_, layout_.h);
    for (hsapTensor_t* t : {&call.q, &call.k, &call.v, &call.out}) t->headDim = bad_dim;
    ExpectForwardFails(call, hsapInvalidArgument, "head dim " + std::to_string(bad_dim));
  }
  {
    ForwardCall call(p_, layout_.h);
    for (hsapTensor_t* t : {&call.q, &call.k, &call.v, &call.out}) t->headDim = 0;
    ExpectForwardFails(call, hsapInvalidArgument, "q has head dim 0");
  }
  {
    ForwardCall call(p_, layout_.h);
    call.q.numHeads = 0;
    ExpectForwardFails(call, hsapInvalidArgument, "q has 0 heads");
  }
}

TEST_F(ApiLocalErrorsTest, DTypes) {
  {
    ForwardCall call(p_, layout_.h);
    call.v.dtype = hsapBFloat16;
    ExpectForwardFails(call, hsapInvalidArgument, "mismatched dtypes: v is bf16 but q is fp32");
  }
  {
    ForwardCall call(p_, layout_.h);
    call.out.dtype = hsapFloat16;
    ExpectForwardFails(call, hsapInvalidArgument, "mismatched dtypes: out is fp16 but q is fp32");
  }
  {
    ForwardCall call(p_, layout_.h);
    SetRaw(call.q.dtype, 11);
    ExpectForwardFails(call, hsapInvalidArgument, "q->dtype has unknown data type 11");
  }
}

TEST_F(ApiLocalErrorsTest, Config) {
  ForwardCall call(p_, layout_.h);
  hsapAttentionConfig_t config = HSAP_ATTENTION_CONFIG_INITIALIZER;
  call.config = &config;
  config.magic = 0;
  ExpectForwardFails(call, hsapInvalidArgument, "HSAP_ATTENTION_CONFIG_INITIALIZER");
  config = HSAP_ATTENTION_CONFIG_INITIALIZER;
  config.size = 8;
  ExpectForwardFails(call, hsapInvalidArgument, "config has size 8");
  config = HSAP_ATTENTION_CONFIG_INITIALIZER;
  config.softmaxScale = -1.0f;
  ExpectForwardFails(call, hsapInvalidArgument, "config->softmaxScale");
  config.softmaxScale = std::numeric_limits<float>::quiet_NaN();
  ExpectForwardFails(call, hsapInvalidArgument, "config->softmaxScale");
  config = HSAP_ATTENTION_CONFIG_INITIALIZER;
  config.numThreads = -2;
  ExpectForwardFails(call, hsapInvalidArgument, "config->numThreads");
  // A larger struct from a newer header (its new fields zero) is accepted.
  struct {
    hsapAttentionConfig_t config;
    unsigned char newer_fields[16];
  } grown{HSAP_ATTENTION_CONFIG_INITIALIZER, {}};
  grown.config.size += sizeof(grown.newer_fields);
  call.config = &grown.config;
  EXPECT_EQ(call.Run(), hsapSuccess) << hsapGetLastError();
  EXPECT_EQ(std::string(hsapGetLastError()), "");
}

TEST_F(ApiLocalErrorsTest, Backward) {
  // A valid forward first, so that out and lse are meaningful.
  ForwardCall fwd(p_, layout_.h);
  ASSERT_EQ(fwd.Run(), hsapSuccess) << hsapGetLastError();
  saved_out_ = p_.out.bytes;
  const std::vector<float> saved_lse = p_.lse;
  std::fill(p_.lse.begin(), p_.lse.end(), 123.0f);  // for ExpectOutputsUntouched
  std::vector<float> lse = saved_lse;

  struct Args {
    hsapTensor_t dout, q, k, v, out, dq, dk, dv;
  };
  auto valid = [&] {
    return Args{p_.dout.C(), p_.q.C(),  p_.k.C(),  p_.v.C(),
                p_.out.C(),  p_.dq.C(), p_.dk.C(), p_.dv.C()};
  };
  auto run = [&](Args a, const float* l = nullptr, bool null_dout = false, bool null_dk = false) {
    return hsapAttentionBackwardLocal(nullptr, layout_.h, null_dout ? nullptr : &a.dout, &a.q, &a.k,
                                      &a.v, &a.out, l == nullptr ? lse.data() : l, &a.dq,
                                      null_dk ? nullptr : &a.dk, &a.dv);
  };
  auto expect = [&](hsapResult_t got, const std::string& message) {
    EXPECT_EQ(got, hsapInvalidArgument);
    EXPECT_THAT(std::string(hsapGetLastError()), HasSubstr(message));
    EXPECT_THAT(std::string(hsapGetLastError()), HasSubstr("hsapAttentionBackwardLocal: "));
    ExpectOutputsUntouched();
  };
  expect(run(valid(), nullptr, true), "dout is null");
  expect(run(valid(), nullptr, false, true), "dk is null");
  {
    Args a = valid();
    a.dq.numHeads = 2;
    expect(run(a), "dq has 2 heads, expected 4");
  }
  {
    Args a = valid();
    a.dv.numTokens = 3;
    expect(run(a), "dv has 3 tokens, expected 48");
  }
  {
    Args a = valid();
    a.dout.dtype = hsapBFloat16;
    expect(run(a), "mismatched dtypes: dout is bf16 but q is fp32");
  }
  {
    Args a = valid();
    a.out.numHeads = 2;
    expect(run(a), "out has 2 heads");
  }
  {
    hsapLayout_t null_layout = nullptr;
    Args a = valid();
    EXPECT_EQ(hsapAttentionBackwardLocal(nullptr, null_layout, &a.dout, &a.q, &a.k, &a.v, &a.out,
                                         lse.data(), &a.dq, &a.dk, &a.dv),
              hsapInvalidArgument);
    EXPECT_THAT(std::string(hsapGetLastError()), HasSubstr("layout is null"));
  }
  {
    Args a = valid();
    EXPECT_EQ(hsapAttentionBackwardLocal(nullptr, layout_.h, &a.dout, &a.q, &a.k, &a.v, &a.out,
                                         nullptr, &a.dq, &a.dk, &a.dv),
              hsapInvalidArgument);
    EXPECT_THAT(std::string(hsapGetLastError()), HasSubstr("lse is null"));
  }
  ExpectOutputsUntouched();
  EXPECT_EQ(run(valid()), hsapSuccess) << hsapGetLastError();
}

// ---- Numerical results ------------------------------------------------------------------

using ::hsap::testing::ExpectWithinRule;
using ::hsap::testing::MaxAbs;
using ::hsap::testing::MaxAbsError;

struct NumericCase {
  DType dtype;
  int hq, hkv, d;
};

void PrintTo(const NumericCase& c, std::ostream* os) {
  *os << DTypeName(c.dtype) << " hq=" << c.hq << " hkv=" << c.hkv << " d=" << c.d;
}

class ApiLocalNumericTest : public ::testing::TestWithParam<NumericCase> {};

// Documents of lengths drawn with a fixed seed, every mask kind, one empty document, one
// long document.
LayoutHandle MixedLayout(int64_t* tokens) {
  std::mt19937 rng(2024);
  std::vector<int64_t> cu = {0};
  std::vector<hsapMaskKind_t> kinds;
  std::vector<int64_t> params;
  const hsapMaskKind_t cycle[] = {hsapMaskCausal, hsapMaskFull, hsapMaskPrefixLM,
                                  hsapMaskSlidingWindow};
  for (int d = 0; d < 9; ++d) {
    // One empty document and one long enough to span several 64-row kernel blocks.
    const int64_t length = d == 4   ? 0
                           : d == 6 ? 190
                                    : std::uniform_int_distribution<int64_t>(1, 70)(rng);
    cu.push_back(cu.back() + length);
    kinds.push_back(cycle[d % 4]);
    params.push_back(std::min<int64_t>(length, 1 + static_cast<int64_t>(rng() % 24)));
  }
  *tokens = cu.back();
  return LayoutHandle(MustCreate(cu, kinds, params));
}

TEST_P(ApiLocalNumericTest, ForwardAndBackwardMatchTheReference) {
  const NumericCase c = GetParam();
  int64_t tokens = 0;
  LayoutHandle layout = MixedLayout(&tokens);
  Problem p(c.dtype, tokens, c.hq, c.hkv, c.d);
  hsapAttentionConfig_t config = HSAP_ATTENTION_CONFIG_INITIALIZER;
  config.numThreads = 2;
  ForwardCall fwd(p, layout.h);
  fwd.config = &config;
  ASSERT_EQ(fwd.Run(), hsapSuccess) << hsapGetLastError();

  ReferenceInputs in;
  in.dims.heads_q = c.hq;
  in.dims.heads_kv = c.hkv;
  in.dims.head_dim = c.d;
  in.dims.scale = 1.0f / std::sqrt(static_cast<float>(c.d));
  in.dtype = c.dtype;
  in.q = p.q.bytes.data();
  in.k = p.k.bytes.data();
  in.v = p.v.bytes.data();
  const Layout& l = layout.h->layout;
  const ReferenceForwardResult ref = ReferenceForward(l, in);
  const ReferenceForwardResult naive = NaiveForward(l, in);
  ExpectWithinRule("out", MaxAbsError(p.out, ref.out), MaxAbsError(naive.out, ref.out),
                   MaxAbs(ref.out), c.dtype);
  std::vector<double> lse(p.lse.begin(), p.lse.end());
  ExpectWithinRule("lse", MaxAbsError(lse, ref.lse), MaxAbsError(naive.lse, ref.lse),
                   MaxAbs(ref.lse), DType::kF32);

  hsapTensor_t dout = p.dout.C(), q = p.q.C(), k = p.k.C(), v = p.v.C(), out = p.out.C();
  hsapTensor_t dq = p.dq.C(), dk = p.dk.C(), dv = p.dv.C();
  ASSERT_EQ(hsapAttentionBackwardLocal(&config, layout.h, &dout, &q, &k, &v, &out, p.lse.data(),
                                       &dq, &dk, &dv),
            hsapSuccess)
      << hsapGetLastError();
  const ReferenceGradients gref = ReferenceBackward(l, in, p.dout.bytes.data());
  const ReferenceGradients gnaive = NaiveBackward(l, in, p.dout.bytes.data());
  ExpectWithinRule("dq", MaxAbsError(p.dq, gref.dq), MaxAbsError(gnaive.dq, gref.dq),
                   MaxAbs(gref.dq), c.dtype);
  ExpectWithinRule("dk", MaxAbsError(p.dk, gref.dk), MaxAbsError(gnaive.dk, gref.dk),
                   MaxAbs(gref.dk), c.dtype);
  ExpectWithinRule("dv", MaxAbsError(p.dv, gref.dv), MaxAbsError(gnaive.dv, gref.dv),
                   MaxAbs(gref.dv), c.dtype);

  // Deterministic: one thread gives the same bits as two.
  Problem p1(c.dtype, tokens, c.hq, c.hkv, c.d);
  config.numThreads = 1;
  ForwardCall fwd1(p1, layout.h);
  fwd1.config = &config;
  ASSERT_EQ(fwd1.Run(), hsapSuccess) << hsapGetLastError();
  EXPECT_EQ(p1.out.bytes, p.out.bytes);
  EXPECT_EQ(p1.lse, p.lse);
}

INSTANTIATE_TEST_SUITE_P(
    DTypes, ApiLocalNumericTest,
    ::testing::Values(NumericCase{DType::kF32, 4, 2, 64}, NumericCase{DType::kBF16, 4, 2, 64},
                      NumericCase{DType::kF16, 4, 2, 64}, NumericCase{DType::kBF16, 3, 1, 128},
                      NumericCase{DType::kF32, 2, 2, 40}),
    [](const ::testing::TestParamInfo<NumericCase>& info) {
      return absl::StrCat(std::string(DTypeName(info.param.dtype)), "_hq", info.param.hq, "_hkv",
                          info.param.hkv, "_d", info.param.d);
    });

TEST(ApiLocalTest, QueriesThatSeeNoKey) {
  // Rows 0..9 are covered by no slice: their output is 0, their lse -inf, their dq 0.
  const hsapMaskSlice_t slices[] = {{10, 30, 0, 30, hsapSliceFull, 0}};
  hsapLayout_t raw = nullptr;
  ASSERT_EQ(hsapLayoutCreateFromSlices(&raw, 30, slices, 1), hsapSuccess) << hsapGetLastError();
  LayoutHandle layout(raw);
  Problem p(DType::kF32, 30, 2, 1, 32);
  ForwardCall fwd(p, layout.h);
  ASSERT_EQ(fwd.Run(), hsapSuccess) << hsapGetLastError();
  for (int64_t t = 0; t < 10; ++t) {
    for (int h = 0; h < 2; ++h) {
      EXPECT_EQ(p.lse[h * 30 + t], -std::numeric_limits<float>::infinity());
      for (int d = 0; d < 32; ++d) EXPECT_EQ(p.out.At((t * 2 + h) * 32 + d), 0.0f);
    }
  }
  hsapTensor_t dout = p.dout.C(), q = p.q.C(), k = p.k.C(), v = p.v.C(), out = p.out.C();
  hsapTensor_t dq = p.dq.C(), dk = p.dk.C(), dv = p.dv.C();
  ASSERT_EQ(hsapAttentionBackwardLocal(nullptr, layout.h, &dout, &q, &k, &v, &out, p.lse.data(),
                                       &dq, &dk, &dv),
            hsapSuccess)
      << hsapGetLastError();
  for (size_t i = 0; i < 10 * 2 * 32; ++i) EXPECT_EQ(p.dq.At(i), 0.0f);
  for (size_t i = 0; i < p.dk.size(); ++i) EXPECT_TRUE(std::isfinite(p.dk.At(i)));
}

TEST(ApiLocalTest, EmptyRow) {
  const int64_t zero[] = {0};
  hsapLayout_t raw = nullptr;
  ASSERT_EQ(hsapLayoutCreate(&raw, zero, 0, nullptr, nullptr), hsapSuccess);
  LayoutHandle layout(raw);
  hsapTensor_t t{nullptr, hsapFloat32, 0, 2, 32};
  EXPECT_EQ(hsapAttentionForwardLocal(nullptr, layout.h, &t, &t, &t, &t, nullptr), hsapSuccess)
      << hsapGetLastError();
}

}  // namespace
}  // namespace hsap
