// The size/version rule of hsap.h for every config struct of the C ABI: a larger struct
// from a newer caller only with a zero tail, a bounded size, and a version of this
// library's major version.
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "hsap/hsap.h"

namespace {

using ::testing::HasSubstr;

// A config followed by bytes a newer header would have added: reading up to
// sizeof(Config) + kTail bytes stays inside the object.
template <typename Config>
struct Grown {
  static constexpr size_t kTail = 64;
  Config config;
  unsigned char tail[kTail];

  explicit Grown(const Config& initial) {
    std::memset(static_cast<void*>(this), 0, sizeof(*this));
    config = initial;
  }
};

// Calls `create` with configs that break the rule and one that keeps it; `create` returns
// the result and frees what it created.
template <typename Config>
void ExpectTheRuleHolds(const Config& initial,
                        const std::function<hsapResult_t(const Config*)>& create) {
  SCOPED_TRACE(::testing::Message() << "config of " << sizeof(Config) << " bytes");
  Grown<Config> grown(initial);
  ASSERT_EQ(create(&grown.config), hsapSuccess) << hsapGetLastError();

  // Newer struct, zero tail: accepted; a set byte of the tail: rejected, naming it.
  grown.config.size = sizeof(Config) + Grown<Config>::kTail;
  EXPECT_EQ(create(&grown.config), hsapSuccess) << hsapGetLastError();
  grown.tail[5] = 1;
  EXPECT_EQ(create(&grown.config), hsapInvalidArgument);
  EXPECT_THAT(hsapGetLastError(), HasSubstr("byte " + std::to_string(sizeof(Config) + 5) + " "));
  grown.tail[5] = 0;

  // Sizes no struct has: rejected before any tail is read.
  for (const size_t size :
       {size_t{64} * 1024 + 1, size_t{1} << 40, std::numeric_limits<size_t>::max()}) {
    grown.config.size = size;
    EXPECT_EQ(create(&grown.config), hsapInvalidArgument) << size;
    EXPECT_THAT(hsapGetLastError(), HasSubstr("65536 bytes"));
  }
  grown.config.size = sizeof(Config);

  // Version 0, codes before 0.1.0, and a later major version.
  for (const unsigned version : {0u, 99u, unsigned{HSAP_VERSION(HSAP_MAJOR + 1, 0, 0)}, UINT_MAX}) {
    grown.config.version = version;
    EXPECT_EQ(create(&grown.config), hsapInvalidArgument) << version;
    EXPECT_THAT(hsapGetLastError(), HasSubstr("config->version is " + std::to_string(version)));
  }
  // A later minor version of the same major is a newer caller: accepted.
  grown.config.version = HSAP_VERSION(HSAP_MAJOR, HSAP_MINOR + 1, 0);
  EXPECT_EQ(create(&grown.config), hsapSuccess) << hsapGetLastError();
}

TEST(ApiConfigTest, AttentionConfig) {
  const int64_t cu[] = {0, 4};
  hsapLayout_t layout = nullptr;
  ASSERT_EQ(hsapLayoutCreate(&layout, cu, 1, nullptr, nullptr), hsapSuccess);
  std::vector<float> q(4 * 32, 0.5f), out(4 * 32), lse(4);
  hsapTensor_t tq = {q.data(), hsapFloat32, 4, 1, 32};
  hsapTensor_t tout = {out.data(), hsapFloat32, 4, 1, 32};
  const hsapAttentionConfig_t initial = HSAP_ATTENTION_CONFIG_INITIALIZER;
  ExpectTheRuleHolds<hsapAttentionConfig_t>(initial, [&](const hsapAttentionConfig_t* config) {
    return hsapAttentionForwardLocal(config, layout, &tq, &tq, &tq, &tout, lse.data());
  });
  hsapLayoutDestroy(layout);
}

TEST(ApiConfigTest, CommConfig) {
  const hsapCommConfig_t initial = HSAP_COMM_CONFIG_INITIALIZER;
  ExpectTheRuleHolds<hsapCommConfig_t>(initial, [](const hsapCommConfig_t* config) {
    hsapComm_t comm = nullptr;
    const hsapResult_t result = hsapCommInitAll(&comm, 1, config);
    if (comm != nullptr) hsapCommDestroy(comm);
    return result;
  });
  // The CUDA entry points read the same struct first (no GPU needed to reject it).
  hsapCommConfig_t zero_version = HSAP_COMM_CONFIG_INITIALIZER;
  zero_version.version = 0;
  hsapComm_t comm = nullptr;
  EXPECT_EQ(hsapCommInitLoopback(&comm, 1, &zero_version), hsapInvalidArgument);
  EXPECT_THAT(hsapGetLastError(), HasSubstr("config->version is 0"));
}

class ApiBatchConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const int64_t cu[] = {0, 8};
    ASSERT_EQ(hsapLayoutCreate(&layout_, cu, 1, nullptr, nullptr), hsapSuccess);
    ASSERT_EQ(hsapCommInitAll(&comm_, 1, nullptr), hsapSuccess);
  }
  void TearDown() override {
    hsapCommDestroy(comm_);
    hsapLayoutDestroy(layout_);
  }
  static hsapBatchConfig_t Initial() {
    hsapBatchConfig_t config = HSAP_BATCH_CONFIG_INITIALIZER;
    config.dtype = hsapFloat32;
    config.numHeadsQ = 2;
    config.numHeadsKV = 1;
    config.headDim = 32;
    return config;
  }
  hsapLayout_t layout_ = nullptr;
  hsapComm_t comm_ = nullptr;
};

TEST_F(ApiBatchConfigTest, WithoutPlan) {
  ExpectTheRuleHolds<hsapBatchConfig_t>(Initial(), [&](const hsapBatchConfig_t* config) {
    hsapBatch_t batch = nullptr;
    const hsapResult_t result = hsapBatchCreate(&batch, comm_, layout_, nullptr, config);
    if (batch != nullptr) hsapBatchDestroy(batch);
    return result;
  });
}

TEST_F(ApiBatchConfigTest, WithPlan) {
  const int group_sizes[] = {1}, group_ranks[] = {0}, head_counts[] = {2}, heads[] = {0, 1};
  hsapPlan_t plan = nullptr;
  ASSERT_EQ(hsapPlanCreate(&plan, 1, 2, 1, 1, group_sizes, group_ranks, nullptr, nullptr,
                           head_counts, heads, nullptr),
            hsapSuccess)
      << hsapGetLastError();
  ExpectTheRuleHolds<hsapBatchConfig_t>(Initial(), [&](const hsapBatchConfig_t* config) {
    hsapBatch_t batch = nullptr;
    const hsapResult_t result = hsapBatchCreateWithPlan(&batch, comm_, layout_, plan, config);
    if (batch != nullptr) hsapBatchDestroy(batch);
    return result;
  });
  hsapPlanDestroy(plan);
}

}  // namespace
