#include "lib/exec/staged.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "lib/exec/protocol.h"

namespace hsap {

absl::Status RunStaged(size_t num_stages, const PostStage& post,
                       const std::function<absl::Status()>& local,
                       const std::function<absl::Status(size_t)>& on_stage) {
  std::unique_ptr<Transport::Pending> current, next;
  if (num_stages > 0) {
    HSAP_ASSIGN_OR_RETURN(std::unique_ptr<Transport::Pending> p, post(0));
    current = std::move(p);
  }
  HSAP_RETURN_IF_ERROR(local());
  for (size_t i = 0; i < num_stages; ++i) {
    if (i + 1 < num_stages) {
      HSAP_ASSIGN_OR_RETURN(std::unique_ptr<Transport::Pending> p, post(i + 1));
      next = std::move(p);
    }
    HSAP_RETURN_IF_ERROR(current->Wait());
    HSAP_RETURN_IF_ERROR(on_stage(i));
    current = std::move(next);
  }
  return absl::OkStatus();
}

absl::Status RunBackwardStages(absl::Span<const int> steps, const BackwardStages& hooks) {
  std::unique_ptr<Transport::Pending> kv[2], grad[2];
  auto complete_grad = [&](size_t j) -> absl::Status {
    HSAP_RETURN_IF_ERROR(grad[j % 2]->Wait());
    grad[j % 2].reset();
    return hooks.add_returned(j);
  };
  bool local_done = false;
  for (const protocol::BackwardGroup& group : protocol::BackwardPostingOrder(steps)) {
    const size_t i = group.index;
    const size_t slot = i % 2;
    if (!group.is_grad) {
      HSAP_ASSIGN_OR_RETURN(kv[slot], hooks.post_kv(i));
    } else {
      HSAP_RETURN_IF_ERROR(kv[slot]->Wait());
      kv[slot].reset();
      HSAP_RETURN_IF_ERROR(hooks.compute(i));
      HSAP_ASSIGN_OR_RETURN(grad[slot], hooks.post_grad(i));
      if (i > 0) HSAP_RETURN_IF_ERROR(complete_grad(i - 1));
    }
    if (!local_done) {
      local_done = true;
      HSAP_RETURN_IF_ERROR(hooks.local());
    }
  }
  if (!local_done) HSAP_RETURN_IF_ERROR(hooks.local());
  if (!steps.empty()) HSAP_RETURN_IF_ERROR(complete_grad(steps.size() - 1));
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

absl::Status RunBackwardStagesThenFanOuts(absl::Span<const int> steps, size_t fan,
                                          const BackwardStages& hooks) {
  HSAP_RETURN_IF_ERROR(RunBackwardStages(steps.first(fan), hooks));
  if (fan == steps.size()) return absl::OkStatus();
  BackwardStages fan_out;
  fan_out.post_kv = [&](size_t i) { return hooks.post_kv(fan + i); };
  fan_out.local = [] { return absl::OkStatus(); };
  fan_out.compute = [&](size_t i) { return hooks.compute(fan + i); };
  fan_out.post_grad = [&](size_t i) { return hooks.post_grad(fan + i); };
  fan_out.add_returned = [&](size_t i) { return hooks.add_returned(fan + i); };
  return RunBackwardStages(steps.subspan(fan), fan_out);
}

}  // namespace hsap
