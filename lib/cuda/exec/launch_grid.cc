#include "lib/cuda/exec/launch_grid.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace hsap::cuda {

absl::StatusOr<LaunchGrid> AttentionGrid(long long num_blocks, long long heads_q) {
  if (num_blocks < 0 || heads_q < 0 || num_blocks > kMaxGridX || heads_q > kMaxGridY) {
    return absl::InvalidArgumentError(absl::StrCat(
        "an attention launch of ", num_blocks, " query blocks x ", heads_q,
        " query heads: one CTA each needs a grid of at most ", kMaxGridX, " x ", kMaxGridY));
  }
  if (num_blocks == 0 || heads_q == 0) return LaunchGrid{};
  return LaunchGrid{static_cast<unsigned int>(num_blocks), static_cast<unsigned int>(heads_q)};
}

LaunchGrid HelperGrid(long long threads_wanted, long long max_ctas) {
  // Rounded up without forming threads_wanted + 255, which overflows near the maximum.
  const long long ctas = threads_wanted / kHelperThreads + (threads_wanted % kHelperThreads > 0);
  const long long cap = std::clamp<long long>(max_ctas, 1, kMaxGridX);
  return LaunchGrid{static_cast<unsigned int>(std::clamp<long long>(ctas, 1, cap)), 1};
}

LaunchGrid HelperGrid(const hsap_dev::DeltaParams& p, long long max_ctas) {
  return HelperGrid(p.rows * p.heads * 32, max_ctas);
}
LaunchGrid HelperGrid(const hsap_dev::InitParams& p, long long max_ctas) {
  return HelperGrid(p.rows * p.heads * 4, max_ctas);
}
LaunchGrid HelperGrid(const hsap_dev::ConvertParams& p, long long max_ctas) {
  return HelperGrid(p.count, max_ctas);
}
LaunchGrid HelperGrid(const hsap_dev::AccumulateParams& p, long long max_ctas) {
  return HelperGrid(p.count, max_ctas);
}
LaunchGrid HelperGrid(const hsap_dev::ChunksParams& p, long long max_ctas) {
  if (p.num_chunks <= 0) return LaunchGrid{};
  return HelperGrid(p.num_chunks * kHelperThreads, max_ctas);
}

LaunchGrid HelperGrid(const hsap_dev::EntryMergeParams& p, long long max_ctas) {
  if (p.num_entries <= 0) return LaunchGrid{};
  return HelperGrid(p.total_rows * p.heads * 32, max_ctas);
}
LaunchGrid HelperGrid(const hsap_dev::StatsGatherParams& p, long long max_ctas) {
  if (p.num_entries <= 0) return LaunchGrid{};
  return HelperGrid(p.total_rows * p.heads, max_ctas);
}
LaunchGrid HelperGrid(const hsap_dev::EntryAddParams& p, long long max_ctas) {
  if (p.num_entries <= 0) return LaunchGrid{};
  return HelperGrid(p.total_rows * p.row_elems, max_ctas);
}

absl::StatusOr<LaunchGrid> FusedForwardGrid(absl::Span<const hsap_dev::FusedStep> steps,
                                            int heads_q, long long resident_ctas, int share,
                                            int copy_ctas) {
  if (steps.empty()) return LaunchGrid{};
  long long work = 1, tasks = 0;
  for (const hsap_dev::FusedStep& step : steps) {
    const long long items = static_cast<long long>(step.num_blocks) * heads_q;
    work = std::max(work, items);
    tasks += items + copy_ctas;
  }
  if (tasks >= (1LL << 31)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "a fused forward launch of ", tasks, " tasks (the kernel counts them in 32 bits)"));
  }
  const long long resident = resident_ctas / std::max(1, share);
  const long long compute = std::min({work, resident - copy_ctas, kMaxGridX - copy_ctas});
  if (compute < 1) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the fused forward needs ", copy_ctas + 1, " resident CTAs; this GPU keeps ",
                     resident_ctas, " resident, shared by ", share, " ranks"));
  }
  return LaunchGrid{static_cast<unsigned int>(copy_ctas + compute), 1};
}

absl::StatusOr<std::vector<FusedWgmmaLaunch>> FusedWgmmaLaunches(
    const hsap_dev::FusedFwdHead& head, absl::Span<const hsap_dev::FusedStep> steps, int copy_ctas,
    int head_dim, int element_bytes) {
  if (copy_ctas < 1 || copy_ctas > kMaxGridX / 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("the sm_90a fused forward with ", copy_ctas, " copy CTAs (at least 1)"));
  }
  std::vector<FusedWgmmaLaunch> launches;
  if (steps.empty()) return launches;
  const long long row_bytes = static_cast<long long>(head.heads_kv) * head_dim * element_bytes;
  for (size_t s = 0; s <= steps.size(); ++s) {
    FusedWgmmaLaunch l;
    if (s < steps.size()) {
      const hsap_dev::FusedStep& st = steps[s];
      l.copy = hsap_dev::FusedCopy{st.k_src,
                                   st.v_src,
                                   head.stage_k[s % 2],
                                   head.stage_v[s % 2],
                                   st.k_rows * row_bytes,
                                   st.ready_flag,
                                   st.consumed_flag,
                                   head.ready_timeout_ns,
                                   st.ready_value,
                                   copy_ctas};
    }
    hsap_dev::FwdParams& f = l.fwd;
    f.q = head.q;
    f.out = head.out;
    f.lse = head.lse;
    f.kv_head_of_q = head.kv_head_of_q;
    f.error_flag = head.error_flag;
    f.q_rows = head.q_rows;
    f.heads_q = head.heads_q;
    f.heads_kv = head.heads_kv;
    f.scale = head.scale;
    // The attended step's buffer, also in the first launch (the tensor maps need an address).
    const size_t b = (s + 1) % 2;
    f.k = head.stage_k[b];
    f.v = head.stage_v[b];
    if (s > 0) {
      const hsap_dev::FusedStep& st = steps[s - 1];
      f.blocks = st.blocks;
      f.segments = st.segments;
      f.k_rows = st.k_rows;
      f.num_blocks = st.num_blocks;
    }
    HSAP_ASSIGN_OR_RETURN(const LaunchGrid attention,
                          AttentionGrid(f.num_blocks + static_cast<long long>(l.copy.parts),
                                        f.num_blocks > 0 ? head.heads_q : 1));
    l.grid = attention;
    launches.push_back(l);
  }
  return launches;
}

}  // namespace hsap::cuda
