"""One rank of the HuggingFace transformers tests (test_transformers.py), started by
torchrun: tiny random-init Llama / Qwen2 models with attn_implementation="hsap" on this
rank's tokens of a packed row, against the same model in one process with PyTorch's
per-document SDPA on the whole row (fp64 reference, fp32 or bf16-autocast naive run), loss
and every gradient under the project's tolerance rule. Prints "RANK <r> HF OK <case> ..."
per case."""

import copy
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hsap  # noqa: E402
import hsap.integrations.transformers as hsap_hf  # noqa: E402
from conftest import assert_close  # noqa: E402

from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config  # noqa: E402

VOCAB = 96


def make_config(case: str):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  max_position_embeddings=1024, attention_dropout=0.0)
    if case.startswith("llama"):
        return LlamaConfig(**common)
    if case.startswith("qwen2_hybrid"):
        return Qwen2Config(**common, use_sliding_window=True, sliding_window=12,
                           layer_types=["full_attention", "sliding_attention",
                                        "sliding_attention"])
    if case.startswith("qwen2_sliding"):
        return Qwen2Config(**common, use_sliding_window=True, sliding_window=12,
                           layer_types=["sliding_attention"] * 3)
    raise ValueError(case)


def packed_row(seed: int):
    """Documents of 1 to 90 tokens (many shorter than the window, one long one), the same
    on every rank."""
    rng = np.random.default_rng(seed)
    lengths = [1, 90] + list(rng.integers(2, 40, size=5))
    rng.shuffle(lengths)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = torch.from_numpy(rng.integers(0, VOCAB, size=int(cu[-1]))).unsqueeze(0)
    return cu, ids


def run_case(case: str, seed: int) -> str:
    rank, world = dist.get_rank(), dist.get_world_size()
    bf16 = case.endswith("bf16")
    torch.manual_seed(seed)
    config = make_config(case)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=hsap_hf.NAME)
    reference = copy.deepcopy(model)
    reference.config._attn_implementation = hsap_hf.REFERENCE_NAME
    cu, ids = packed_row(seed)
    # hsap: this rank's tokens; the key from HF-style position_ids (restarting per document).
    key = hsap_hf.step_key(model.config, cu_seqlens=cu)
    position_ids = key.position_ids().unsqueeze(0)
    assert np.array_equal(hsap.cu_seqlens_from_position_ids(position_ids), cu)
    assert hsap_hf.step_key(model.config, position_ids=position_ids) is key  # cached
    with key, torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = model(**hsap_hf.dispatch_inputs(key, ids, position_ids))
    out.loss.backward()
    loss = out.loss.detach().double().clone()
    dist.all_reduce(loss)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    for g in grads.values():
        dist.all_reduce(g)
    # The logits back on the whole row (undispatch) equal the reference's below.
    logits = key.undispatch(out.logits[0]).float()

    def reference_run(dtype, autocast):
        m = copy.deepcopy(reference).to(dtype)
        labels = key.shift_labels(ids)
        with hsap_hf.reference_row(cu), torch.autocast("cpu", dtype=torch.bfloat16,
                                                       enabled=autocast):
            o = m(input_ids=ids, position_ids=position_ids, labels=labels, shift_labels=labels,
                  num_items_in_batch=torch.tensor(float(key.num_label_tokens())))
        o.loss.backward()
        return o.loss.detach(), o.logits[0].detach(), {n: p.grad for n, p in m.named_parameters()}

    ref_loss, ref_logits, ref_grads = reference_run(torch.float64, False)
    naive_loss, naive_logits, naive_grads = reference_run(torch.float32, bf16)
    assert_close(f"{case} loss", loss, ref_loss, naive_loss)
    assert_close(f"{case} logits", logits, ref_logits, naive_logits.float())
    worst = 0.0
    for n in grads:
        assert_close(f"{case} grad {n}", grads[n], ref_grads[n], naive_grads[n])
        worst = max(worst, (grads[n].double() - ref_grads[n]).abs().max().item())
    rel = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    return (f"{case} tokens {key.local_tokens}/{key.num_tokens} loss {loss.item():.6f} "
            f"rel {rel:.2e} worst_grad_err {worst:.2e} masks {key.masks} "
            f"key_ms {1e3 * key.create_seconds:.2f}")


def main(cases):
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    hsap_hf.register()
    hsap_hf.register_reference()
    for i, case in enumerate(cases):
        msg = run_case(case, 11 + i)
        print(f"RANK {dist.get_rank()} HF OK {msg}", flush=True)
    hsap.StepKey.clear_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
