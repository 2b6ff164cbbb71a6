// Partition entry points of the C ABI.
#include "lib/sched/partition.h"

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "hsap/hsap.h"
#include "lib/api/batch.h"
#include "lib/api/checks.h"
#include "lib/api/result.h"

namespace hsap {

// Shared with api_batch.cc.
absl::StatusOr<const Partition*> PartitionFromHandle(hsapPartition_t partition) {
  if (partition == nullptr || partition->partition == nullptr) {
    return absl::InvalidArgumentError(
        "partition is null; pass a partition from hsapPartitionCreate or hsapBatchGetPartition");
  }
  return partition->partition.get();
}

namespace {

absl::Status CheckShards(const Partition& p, const void* const* shards, const char* name) {
  HSAP_RETURN_IF_ERROR(CheckNotNull(shards, name));
  for (int r = 0; r < p.num_ranks(); ++r) {
    if (shards[r] == nullptr && p.local_tokens(r) > 0) {
      return absl::InvalidArgumentError(absl::StrCat(name, "[", r, "] is null but rank ", r,
                                                     " holds ", p.local_tokens(r), " tokens"));
    }
  }
  return absl::OkStatus();
}

// The largest row in bytes: 2^56, the user address space of a 64-bit host with 5-level
// paging. Every byte offset of the copies, at most num_tokens * bytes_per_token, then fits
// size_t, and a size no buffer can have is an error rather than a wild copy.
constexpr size_t kMaxRowBytes = size_t{1} << 56;

absl::Status CheckBytesPerToken(const Partition& p, size_t bytes_per_token) {
  if (bytes_per_token == 0) {
    return absl::InvalidArgumentError(
        "bytesPerToken is 0; pass the size of one token's row (numHeads * headDim * element "
        "size)");
  }
  const auto num_tokens = static_cast<size_t>(p.num_tokens());
  if (bytes_per_token > kMaxRowBytes ||
      (num_tokens > 0 && bytes_per_token > kMaxRowBytes / num_tokens)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bytesPerToken = ", bytes_per_token, " with ", num_tokens,
        " tokens exceeds the largest row of 2^56 bytes (numTokens * bytesPerToken); pass the "
        "size of one token's row (numHeads * headDim * element size)"));
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace hsap

extern "C" {

hsapResult_t hsapPartitionCreate(hsapPartition_t* partition, hsapLayout_t layout, int nranks,
                                 const double* weights) {
  return hsap::RunApi("hsapPartitionCreate", [&]() -> absl::Status {
    HSAP_RETURN_IF_ERROR(hsap::CheckNotNull(partition, "partition"));
    if (layout == nullptr) {
      return absl::InvalidArgumentError("layout is null; create one with hsapLayoutCreate");
    }
    if (nranks < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("nranks = ", nranks, "; a partition needs at least one rank"));
    }
    absl::Span<const double> w;
    if (weights != nullptr) w = absl::MakeConstSpan(weights, static_cast<size_t>(nranks));
    HSAP_ASSIGN_OR_RETURN(hsap::Partition p, hsap::Partition::Create(layout->layout, nranks, w));
    auto handle = std::make_unique<hsapPartition_st>();
    handle->partition = std::make_shared<const hsap::Partition>(std::move(p));
    *partition = handle.release();
    return absl::OkStatus();
  });
}

hsapResult_t hsapPartitionCreateForLayouts(hsapPartition_t* partition, const hsapLayout_t* layouts,
                                           int numLayouts, int nranks, const double* weights) {
  return hsap::RunApi("hsapPartitionCreateForLayouts", [&]() -> absl::Status {
    HSAP_RETURN_IF_ERROR(hsap::CheckNotNull(partition, "partition"));
    HSAP_RETURN_IF_ERROR(hsap::CheckNotNull(layouts, "layouts"));
    if (numLayouts < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "numLayouts = ", numLayouts, "; pass at least one layout (the mask of each layer)"));
    }
    std::vector<const hsap::Layout*> list(static_cast<size_t>(numLayouts));
    for (int i = 0; i < numLayouts; ++i) {
      if (layouts[i] == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat("layouts[", i, "] is null; create it with hsapLayoutCreate"));
      }
      list[i] = &layouts[i]->layout;
    }
    if (nranks < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("nranks = ", nranks, "; a partition needs at least one rank"));
    }
    absl::Span<const double> w;
    if (weights != nullptr) w = absl::MakeConstSpan(weights, static_cast<size_t>(nranks));
    HSAP_ASSIGN_OR_RETURN(hsap::Partition p, hsap::Partition::Create(list, nranks, w));
    auto handle = std::make_unique<hsapPartition_st>();
    handle->partition = std::make_shared<const hsap::Partition>(std::move(p));
    *partition = handle.release();
    return absl::OkStatus();
  });
}

hsapResult_t hsapPartitionDestroy(hsapPartition_t partition) {
  return hsap::RunApi("hsapPartitionDestroy", [&]() -> absl::Status {
    if (partition == nullptr) return absl::OkStatus();
    if (partition->owned_by_batch) {
      return absl::FailedPreconditionError(
          "partition belongs to a batch (hsapBatchGetPartition); it is freed with the batch by "
          "hsapBatchDestroy");
    }
    delete partition;
    return absl::OkStatus();
  });
}

hsapResult_t hsapPartitionGetRanges(hsapPartition_t partition, int rank, int64_t* ranges,
                                    int64_t* numRanges, int64_t* numTokens) {
  return hsap::RunApi("hsapPartitionGetRanges", [&]() -> absl::Status {
    HSAP_ASSIGN_OR_RETURN(const hsap::Partition* p, hsap::PartitionFromHandle(partition));
    HSAP_RETURN_IF_ERROR(hsap::CheckNotNull(numRanges, "numRanges"));
    if (rank < 0 || rank >= p->num_ranks()) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank = ", rank, " is outside [0, ", p->num_ranks(), ")"));
    }
    const std::vector<hsap::TokenRange>& mine = p->ranges(rank);
    const int64_t count = static_cast<int64_t>(mine.size());
    if (ranges != nullptr) {
      if (*numRanges < count) {
        return absl::InvalidArgumentError(
            absl::StrCat("*numRanges = ", *numRanges, " but rank ", rank, " holds ", count,
                         " ranges; call with ranges = NULL first to get the count"));
      }
      for (int64_t i = 0; i < count; ++i) {
        ranges[2 * i] = mine[i].begin;
        ranges[2 * i + 1] = mine[i].end;
      }
    }
    *numRanges = count;
    if (numTokens != nullptr) *numTokens = p->local_tokens(rank);
    return absl::OkStatus();
  });
}

hsapResult_t hsapPartitionScatter(hsapPartition_t partition, const void* row, size_t bytesPerToken,
                                  void* const* shards) {
  return hsap::RunApi("hsapPartitionScatter", [&]() -> absl::Status {
    HSAP_ASSIGN_OR_RETURN(const hsap::Partition* p, hsap::PartitionFromHandle(partition));
    HSAP_RETURN_IF_ERROR(hsap::CheckBytesPerToken(*p, bytesPerToken));
    if (row == nullptr && p->num_tokens() > 0) {
      return absl::InvalidArgumentError("row is null");
    }
    HSAP_RETURN_IF_ERROR(hsap::CheckShards(*p, shards, "shards"));
    p->Scatter(row, bytesPerToken, shards);
    return absl::OkStatus();
  });
}

hsapResult_t hsapPartitionGather(hsapPartition_t partition, const void* const* shards,
                                 size_t bytesPerToken, void* row) {
  return hsap::RunApi("hsapPartitionGather", [&]() -> absl::Status {
    HSAP_ASSIGN_OR_RETURN(const hsap::Partition* p, hsap::PartitionFromHandle(partition));
    HSAP_RETURN_IF_ERROR(hsap::CheckBytesPerToken(*p, bytesPerToken));
    if (row == nullptr && p->num_tokens() > 0) {
      return absl::InvalidArgumentError("row is null");
    }
    HSAP_RETURN_IF_ERROR(hsap::CheckShards(*p, shards, "shards"));
    p->Gather(shards, bytesPerToken, row);
    return absl::OkStatus();
  });
}

}  // extern "C"
