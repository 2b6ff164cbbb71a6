// The objects behind the partition and batch handles of hsap.h.
#ifndef HSAP_LIB_API_BATCH_H_
#define HSAP_LIB_API_BATCH_H_

#include <memory>

#include "lib/batch.h"
#include "lib/partition.h"

struct hsapPartition_st {
  std::shared_ptr<const hsap::Partition> partition;
  // A batch's own partition (hsapBatchGetPartition): hsapPartitionDestroy refuses it.
  bool owned_by_batch = false;
};

struct hsapBatch_st {
  std::unique_ptr<hsap::Batch> batch;
  hsapPartition_st partition;
};

#endif  // HSAP_LIB_API_BATCH_H_
