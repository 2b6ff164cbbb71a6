#include "lib/comm/p2p_group.h"

#include <algorithm>
#include <tuple>
#include <utility>

namespace hsap {

P2pGroup GroupOfStage(absl::Span<const SendOp> sends, absl::Span<const RecvOp> recvs,
                      std::string label) {
  P2pGroup g;
  g.label = std::move(label);
  for (const SendOp& s : sends) g.ops.push_back({true, s.peer, s.bytes, s.tag});
  for (const RecvOp& r : recvs) g.ops.push_back({false, r.peer, r.bytes, r.tag});
  // Per peer, both sides must list their messages in the same order: by tag (a send on one
  // side is a receive on the other, so sorting each direction by tag suffices).
  std::stable_sort(g.ops.begin(), g.ops.end(), [](const P2pOp& a, const P2pOp& b) {
    return std::make_tuple(a.peer, !a.send, a.tag) < std::make_tuple(b.peer, !b.send, b.tag);
  });
  return g;
}

}  // namespace hsap
