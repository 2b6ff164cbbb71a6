#include "lib/staged.h"

#include <utility>

namespace hsap {

absl::Status RunStaged(size_t num_stages, const PostStage& post,
                       const std::function<absl::Status()>& local,
                       const std::function<absl::Status(size_t)>& on_stage) {
  std::unique_ptr<Transport::Pending> current, next;
  if (num_stages > 0) {
    absl::StatusOr<std::unique_ptr<Transport::Pending>> p = post(0);
    if (!p.ok()) return p.status();
    current = *std::move(p);
  }
  if (absl::Status s = local(); !s.ok()) return s;
  for (size_t i = 0; i < num_stages; ++i) {
    if (i + 1 < num_stages) {
      absl::StatusOr<std::unique_ptr<Transport::Pending>> p = post(i + 1);
      if (!p.ok()) return p.status();
      next = *std::move(p);
    }
    if (absl::Status s = current->Wait(); !s.ok()) return s;
    if (absl::Status s = on_stage(i); !s.ok()) return s;
    current = std::move(next);
  }
  return absl::OkStatus();
}

void StoreRows(DType dtype, const std::vector<float>& from, void* to) {
  DispatchDType(dtype, [&]<typename T>() {
    T* dst = static_cast<T*>(to);
    for (size_t i = 0; i < from.size(); ++i) dst[i] = FromFloat<T>(from[i]);
  });
}

}  // namespace hsap
