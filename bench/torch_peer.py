#!/usr/bin/env python3
"""PyTorch's CPU attention (scaled_dot_product_attention, flash kernel) timed on one shape.

hsap_kernel_bench --peer=<python> runs this to print PyTorch's figures beside its own, on
the same machine in the same run. Prints one line per direction:
  peer <fwd|bwd> <milliseconds>
or, when torch cannot be imported, one line "peer unavailable: <reason>" and exits 0.

  torch_peer.py --tokens=4096 --heads_q=1 --heads_kv=1 --dim=128 --dtype=fp32
                --mask=causal|full --threads=1 --reps=3
"""
import argparse
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--heads_q", type=int, default=1)
    ap.add_argument("--heads_kv", type=int, default=1)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    ap.add_argument("--mask", choices=["causal", "full"], default="causal")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    try:
        import torch
        import torch.nn.functional as F
    except Exception as e:  # ImportError, or a broken install
        print(f"peer unavailable: cannot import torch ({e})")
        return 0
    torch.set_num_threads(a.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    g = torch.Generator().manual_seed(a.dim)
    shape_q = (1, a.heads_q, a.tokens, a.dim)
    shape_k = (1, a.heads_kv, a.tokens, a.dim)
    q = torch.randn(shape_q, generator=g).to(dtype).requires_grad_()
    k = torch.randn(shape_k, generator=g).to(dtype).requires_grad_()
    v = torch.randn(shape_k, generator=g).to(dtype).requires_grad_()
    dout = torch.randn(shape_q, generator=g).to(dtype)
    causal = a.mask == "causal"
    gqa = a.heads_q != a.heads_kv
    # Only the flash kernel: the math fallback would time a different algorithm.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # Like hsap_kernel_bench: process CPU time on one thread (other processes competing for
    # the cores do not count), the wall clock on several.
    clock = time.process_time if a.threads == 1 else time.perf_counter
    fwd = bwd = float("inf")
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for _ in range(a.reps):
            q.grad = k.grad = v.grad = None
            t0 = clock()
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
            t1 = clock()
            out.backward(dout)
            t2 = clock()
            fwd, bwd = min(fwd, t1 - t0), min(bwd, t2 - t1)
    print(f"peer torch {torch.__version__} threads {torch.get_num_threads()}")
    print(f"peer fwd {fwd * 1e3:.3f}")
    print(f"peer bwd {bwd * 1e3:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
