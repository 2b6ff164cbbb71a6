"""The smallest complete use of hsap from PyTorch: one packed row of four documents (every
mask kind), distributed attention over the processes of a torch.distributed group, forward
and backward, checked against PyTorch's scaled_dot_product_attention per document.

    export HSAP_LIBRARY=$PWD/build/libhsap.so PYTHONPATH=$PWD/python   # or: pip install ./python
    torchrun --nproc-per-node 2 examples/hello_torch.py                # CPU, gloo
"""

import torch
import torch.distributed as dist

import hsap

dist.init_process_group("gloo")
comm = hsap.Comm.from_process_group()  # hsap ranks = the group's ranks (host backend)

# One packed row: documents of 300, 40, 600 and 500 tokens.
cu_seqlens = [0, 300, 340, 940, 1440]
kinds, params = ["causal", "full", "prefix_lm", "sliding_window"], [0, 0, 64, 128]
layout = hsap.Layout(cu_seqlens, kinds, params)
batch = hsap.Batch(comm, layout, num_heads_q=8, num_heads_kv=2, head_dim=64, dtype=torch.float32)

torch.manual_seed(0)  # every rank builds the same full row, then keeps its own tokens
q_row, k_row, v_row = (torch.randn(1440, h, 64) for h in (8, 2, 2))
q, k, v = (hsap.shard(t, batch).requires_grad_() for t in (q_row, k_row, v_row))
out = hsap.attention(q, k, v, batch)  # collective; so is the backward
out.square().sum().backward()

# The same on the whole row in this process, with PyTorch's attention per document. The loss
# of the whole row is the sum of the ranks' losses, whose gradient hsap's collective backward
# computes: compare this rank's tokens.
qr, kr, vr = (t.clone().requires_grad_() for t in (q_row, k_row, v_row))
ref = hsap.sdpa_varlen(qr, kr, vr, cu_seqlens, kinds, params)
ref.square().sum().backward()
err = (out - hsap.shard(ref, batch)).abs().max().item()
grad_err = max((mine.grad - hsap.shard(full.grad, batch)).abs().max().item()
               for mine, full in ((q, qr), (k, kr), (v, vr)))
print(f"rank {dist.get_rank()}: {q.shape[0]} of 1440 tokens; max |out - sdpa| {err:.1e}, "
      f"max |grad - sdpa| {grad_err:.1e}")
ok = err < 1e-4 and grad_err < 1e-3
batch.close()
comm.close()
dist.destroy_process_group()
raise SystemExit(0 if ok else 1)
