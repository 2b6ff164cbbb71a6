#include "lib/exec/staged.h"

#include <utility>

#include "absl/strings/str_cat.h"

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

std::string StageName(const char* pass, const Stage& st, const char* what) {
  std::string name = absl::StrCat(pass, " step ", st.step, " (", what);
  if (st.recv_from >= 0) absl::StrAppend(&name, " from rank ", st.recv_from);
  if (st.send_to >= 0)
    absl::StrAppend(&name, st.recv_from >= 0 ? ", " : " ", "to rank ", st.send_to);
  absl::StrAppend(&name, ")");
  return name;
}

void StoreRows(DType dtype, const std::vector<float>& from, void* to) {
  DispatchDType(dtype, [&]<typename T>() {
    T* dst = static_cast<T*>(to);
    for (size_t i = 0; i < from.size(); ++i) dst[i] = FromFloat<T>(from[i]);
  });
}

}  // namespace hsap
