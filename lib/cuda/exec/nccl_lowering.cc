#include "lib/cuda/exec/nccl_lowering.h"

#include <algorithm>
#include <map>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "lib/exec/protocol.h"

namespace hsap::cuda {
namespace {

using protocol::Payload;
using protocol::RingTag;

size_t KvRowBytes(const AttentionDims& dims, DType dtype) {
  return static_cast<size_t>(dims.heads_kv) * dims.head_dim * DTypeSize(dtype);
}

// The K/V group of stage `st` (sends to send_to, receives from recv_from).
P2pGroup KvGroup(const Stage& st, size_t row_bytes, uint64_t call_id, std::string label) {
  std::vector<SendOp> sends;
  std::vector<RecvOp> recvs;
  if (st.send_to >= 0) {
    const size_t bytes = static_cast<size_t>(st.send_rows) * row_bytes;
    sends.push_back({st.send_to, nullptr, bytes, RingTag(call_id, Payload::kKey, st.step)});
    sends.push_back({st.send_to, nullptr, bytes, RingTag(call_id, Payload::kValue, st.step)});
  }
  if (st.recv_from >= 0) {
    const size_t bytes = static_cast<size_t>(st.recv_rows) * row_bytes;
    recvs.push_back({st.recv_from, nullptr, bytes, RingTag(call_id, Payload::kKey, st.step)});
    recvs.push_back({st.recv_from, nullptr, bytes, RingTag(call_id, Payload::kValue, st.step)});
  }
  return GroupOfStage(sends, recvs, std::move(label));
}

size_t GradRowBytes(const AttentionDims& dims) {
  return static_cast<size_t>(dims.heads_kv) * dims.head_dim * sizeof(float);
}

// The gradient group of stage `st`: fp32 dK/dV of the received rows go back to recv_from,
// those of this rank's rows come from send_to (except a relay's, which wait for the return
// phase).
P2pGroup GradGroup(const Stage& st, const AttentionDims& dims, uint64_t call_id,
                   std::string label) {
  const size_t row = GradRowBytes(dims);
  std::vector<SendOp> sends;
  std::vector<RecvOp> recvs;
  if (st.recv_from >= 0 && st.store_begin < 0) {
    const size_t bytes = static_cast<size_t>(st.recv_rows) * row;
    sends.push_back({st.recv_from, nullptr, bytes, RingTag(call_id, Payload::kKeyGrad, st.step)});
    sends.push_back({st.recv_from, nullptr, bytes, RingTag(call_id, Payload::kValueGrad, st.step)});
  }
  if (st.send_to >= 0 && !st.send_grads_deferred) {
    const size_t bytes = static_cast<size_t>(st.send_rows) * row;
    recvs.push_back({st.send_to, nullptr, bytes, RingTag(call_id, Payload::kKeyGrad, st.step)});
    recvs.push_back({st.send_to, nullptr, bytes, RingTag(call_id, Payload::kValueGrad, st.step)});
  }
  return GroupOfStage(sends, recvs, std::move(label));
}

}  // namespace

P2pProgram LowerForward(const Schedule& schedule, const AttentionDims& dims, DType dtype,
                        uint64_t call_id) {
  const size_t row = KvRowBytes(dims, dtype);
  P2pProgram program;
  for (const Stage& st : schedule.stages) {
    program.push_back(KvGroup(st, row, call_id, absl::StrCat("fwd kv ", st.step)));
  }
  return program;
}

P2pProgram LowerBackward(const Schedule& schedule, const AttentionDims& dims, DType dtype,
                         uint64_t call_id) {
  const size_t row = KvRowBytes(dims, dtype);
  const std::vector<Stage>& stages = schedule.stages;
  std::vector<int> steps;
  for (const Stage& st : stages) steps.push_back(st.step);
  P2pProgram program;
  // The global order of labels (protocol::BackwardPostingOrder) over a run of stages
  // starting at `first`: a rank emits the labels of its own stages only.
  auto lower = [&](size_t first, absl::Span<const int> run) {
    for (const protocol::BackwardGroup& g : protocol::BackwardPostingOrder(run)) {
      const Stage& st = stages[first + g.index];
      program.push_back(g.is_grad ? GradGroup(st, dims, call_id, absl::StrCat("bwd grad ", st.step))
                                  : KvGroup(st, row, call_id, absl::StrCat("bwd kv ", st.step)));
    }
  };
  // The direct stages, then the fan-outs (relays), then the return phase.
  const size_t fan = schedule.first_fan_out();
  lower(0, absl::MakeConstSpan(steps).first(fan));
  lower(fan, absl::MakeConstSpan(steps).subspan(fan));
  const size_t grad_row = GradRowBytes(dims);
  std::vector<SendOp> sends;
  std::vector<RecvOp> recvs;
  for (size_t i = 0; i < fan; ++i) {
    const Stage& st = stages[i];
    if (st.recv_from >= 0 && st.store_begin >= 0) {
      const size_t bytes = static_cast<size_t>(st.recv_rows) * grad_row;
      for (Payload p : {Payload::kRelayKeyGrad, Payload::kRelayValueGrad}) {
        sends.push_back({st.recv_from, nullptr, bytes, RingTag(call_id, p, st.step)});
      }
    }
    if (st.send_to >= 0 && st.send_grads_deferred) {
      const size_t bytes = static_cast<size_t>(st.send_rows) * grad_row;
      for (Payload p : {Payload::kRelayKeyGrad, Payload::kRelayValueGrad}) {
        recvs.push_back({st.send_to, nullptr, bytes, RingTag(call_id, p, st.step)});
      }
    }
  }
  if (!sends.empty() || !recvs.empty()) {
    program.push_back(GroupOfStage(sends, recvs, "bwd relay return"));
  }
  return program;
}

absl::Status CheckNcclPrograms(absl::Span<const P2pProgram> programs) {
  const int R = static_cast<int>(programs.size());
  // Where each op sits, per directed pair in stream order: (group index, op index).
  struct Slot {
    int group;
    const P2pOp* op;
  };
  std::map<std::pair<int, int>, std::vector<Slot>> sends, recvs;  // key (src, dst)
  for (int r = 0; r < R; ++r) {
    for (size_t g = 0; g < programs[r].size(); ++g) {
      for (const P2pOp& op : programs[r][g].ops) {
        if (op.peer < 0 || op.peer >= R) {
          return absl::FailedPreconditionError(absl::StrCat("rank ", r, " group ", g, " (",
                                                            programs[r][g].label, ") names peer ",
                                                            op.peer, " outside [0, ", R, ")"));
        }
        if (op.send) {
          sends[{r, op.peer}].push_back({static_cast<int>(g), &op});
        } else {
          recvs[{op.peer, r}].push_back({static_cast<int>(g), &op});
        }
      }
    }
  }
  // Every matched message as two endpoints: (rank, group) of the send and of the receive.
  struct Message {
    int src, src_group, dst, dst_group;
    bool done = false;
  };
  std::vector<Message> messages;
  // messages_of[r][g]: the messages group g of rank r takes part in.
  std::vector<std::vector<std::vector<size_t>>> messages_of(R);
  for (int r = 0; r < R; ++r) messages_of[r].resize(programs[r].size());
  for (const auto& [pair, out] : sends) {
    const auto [src, dst] = pair;
    const std::vector<Slot>& in = recvs[pair];
    if (in.size() != out.size()) {
      return absl::FailedPreconditionError(
          absl::StrCat("rank ", src, " sends ", out.size(), " messages to rank ", dst, " but rank ",
                       dst, " posts ", in.size(), " receives from it"));
    }
    for (size_t n = 0; n < out.size(); ++n) {
      if (out[n].op->bytes != in[n].op->bytes || out[n].op->tag != in[n].op->tag) {
        return absl::FailedPreconditionError(absl::StrCat(
            "message ", n, " from rank ", src, " to rank ", dst, ": send of ", out[n].op->bytes,
            " bytes (tag ", out[n].op->tag, ", group ", programs[src][out[n].group].label,
            ") meets a receive of ", in[n].op->bytes, " bytes (tag ", in[n].op->tag, ", group ",
            programs[dst][in[n].group].label, ")"));
      }
      messages_of[src][out[n].group].push_back(messages.size());
      messages_of[dst][in[n].group].push_back(messages.size());
      messages.push_back({src, out[n].group, dst, in[n].group});
    }
  }
  for (const auto& [pair, in] : recvs) {
    if (!in.empty() && sends.find(pair) == sends.end()) {
      return absl::FailedPreconditionError(absl::StrCat("rank ", pair.second, " posts ", in.size(),
                                                        " receives from rank ", pair.first,
                                                        " which never sends to it"));
    }
  }
  // Stream semantics: a rank runs its groups one after another; a message completes once
  // both its sender and its receiver are in the groups that hold it (a rendezvous); a group
  // completes when all its messages have. Iterate to a fixed point.
  std::vector<size_t> at(R, 0);
  for (;;) {
    bool progress = false;
    for (Message& m : messages) {
      if (!m.done && at[m.src] == static_cast<size_t>(m.src_group) &&
          at[m.dst] == static_cast<size_t>(m.dst_group)) {
        m.done = true;
        progress = true;
      }
    }
    bool done = true;
    for (int r = 0; r < R; ++r) {
      while (at[r] < programs[r].size()) {
        bool complete = true;
        for (size_t id : messages_of[r][at[r]]) complete = complete && messages[id].done;
        if (!complete) break;
        ++at[r];
        progress = true;
      }
      done = done && at[r] >= programs[r].size();
    }
    if (done) return absl::OkStatus();
    if (!progress) {
      std::string msg = "deadlock: no group can complete;";
      for (int r = 0; r < R; ++r) {
        if (at[r] < programs[r].size()) {
          absl::StrAppend(&msg, " rank ", r, " waits in group ", at[r], " (",
                          programs[r][at[r]].label, ");");
        }
      }
      return absl::FailedPreconditionError(msg);
    }
  }
}

std::string FormatNcclProgram(const P2pProgram& program) {
  std::string out;
  for (const P2pGroup& g : program) {
    absl::StrAppend(&out, g.label, ": group_start;");
    for (const P2pOp& op : g.ops) {
      absl::StrAppend(&out, " ", op.send ? "send" : "recv", "(peer ", op.peer, ", ", op.bytes,
                      " B);");
    }
    absl::StrAppend(&out, " group_end\n");
  }
  return out;
}

}  // namespace hsap::cuda
