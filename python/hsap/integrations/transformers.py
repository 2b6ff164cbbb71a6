"""hsap as a HuggingFace transformers attention implementation.

    import hsap.integrations.transformers as hsap_hf
    hsap_hf.register()                                  # attn_implementation="hsap"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="hsap")
    key = hsap_hf.step_key(model.config, position_ids=position_ids)   # per step, cached
    with key:
        out = model(**hsap_hf.dispatch_inputs(key, input_ids, position_ids))

The attention function receives HF's [B, H, S, D] tensors of this rank's tokens (B = 1: one
packed row per rank, tokens dispatched by the step key) and returns [B, S, H, D]. It reads
the step key from `with key:` (hsap.StepKey) or the `hsap_key` keyword, and the mask from
the layer: `sliding_window` (an int: token i sees (i - w, i] of its document, per
document) or causal, or full when the module says `is_causal = False`; `scaling` is the
softmax scale; GQA comes from the head counts. It refuses attention dropout and returned
attention weights (hsap computes neither).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from hsap.step import StepKey, current_key

__all__ = ["NAME", "attention_forward", "dispatch_inputs", "model_masks", "register",
           "step_key"]

NAME = "hsap"


def _layer_mask(module: Any, sliding_window: Any) -> Any:
    causal = getattr(module, "is_causal", True)
    if sliding_window is not None and int(sliding_window) > 0:
        if not causal:
            raise NotImplementedError("hsap: a sliding window on bidirectional attention "
                                      "(is_causal=False) is not supported")
        return ("sliding_window", int(sliding_window))
    return "causal" if causal else "full"


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      scaling: float | None = None, dropout: float = 0.0,
                      sliding_window: int | None = None, **kwargs: Any):
    """The function registered as "hsap" (AttentionInterface's calling convention)."""
    if dropout:
        raise ValueError(f"hsap: attention dropout {dropout} is not supported; set the "
                         "config's attention_dropout to 0 (or call model.eval())")
    if kwargs.get("output_attentions"):
        raise ValueError("hsap: returns no attention weights (output_attentions=True); use "
                         "attn_implementation='eager' to inspect them")
    step = kwargs.get("hsap_key") or current_key()
    if step is None:
        raise RuntimeError("hsap: no step key for this forward; run the model inside "
                           "`with key:` (key = hsap.integrations.transformers.step_key(...)) "
                           "or pass hsap_key=key to the model")
    if query.dim() != 4 or query.shape[0] != 1:
        raise ValueError(f"hsap: one packed row per rank: query is [1, heads, tokens, "
                         f"head_dim]; got {tuple(query.shape)} (pack the batch into one row "
                         "and dispatch it with the step key)")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [S, H, D]
    out = step.attention(q, k, v, _layer_mask(module, sliding_window), softmax_scale=scaling)
    return out.unsqueeze(0), None  # [1, S, H, D]


def register(name: str = NAME) -> str:
    """Registers attention_forward with transformers' AttentionInterface under `name`
    (models made with attn_implementation=name then call it; transformers builds no mask
    for it) and returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, attention_forward)
    return name


def model_masks(config: Any) -> list[Any]:
    """The masks of a model's layers from its config: `layer_types` ("full_attention",
    "sliding_attention"; other kinds of layer need no attention mask) with `sliding_window`,
    else every layer sliding when the config has a sliding_window (Mistral-style), else
    causal."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    masks: list[Any] = []
    if layer_types:
        for t in layer_types:
            if t == "sliding_attention":
                if not window:
                    raise ValueError("hsap: the config has sliding_attention layers but no "
                                     "sliding_window")
                masks.append(("sliding_window", int(window)))
            elif t in ("full_attention", "attention"):
                masks.append("causal")
    elif window:
        masks.append(("sliding_window", int(window)))
    if not masks:
        masks.append("causal")
    return list(dict.fromkeys(masks))


def step_key(config: Any = None, *, position_ids: Any = None, cu_seqlens: Any = None,
             masks: Iterable[Any] | None = None, comm: Any = None, group: Any = None,
             weights: Any = None, dtypes: Iterable[Any] | None = None) -> StepKey:
    """The step's key (cached: a row that comes again reuses its key) from HF-style
    position_ids ([1, T], restarting at 0 per document) or cu_seqlens, for the masks of
    `config`'s layers (or `masks`), on `comm` (default: the communicator of the
    torch.distributed group `group`, made on first use). With `dtypes` (e.g.
    [torch.float32], or [torch.bfloat16] under autocast) and a config, the batches of every
    mask in those dtypes are made now, in one collective call (StepKey.prepare), rather than
    one by one by the first layer of each mask."""
    from hsap.step import cu_seqlens_from_position_ids

    if (position_ids is None) == (cu_seqlens is None):
        raise ValueError("hsap: pass position_ids or cu_seqlens (one of them)")
    cu = cu_seqlens if cu_seqlens is not None else cu_seqlens_from_position_ids(position_ids)
    if masks is None:
        masks = model_masks(config) if config is not None else ["causal"]
    comm = comm if comm is not None else StepKey.comm_for(group)
    key = StepKey.get(comm, cu, masks, weights=weights, group=group)
    if dtypes is not None and config is not None:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        key.prepare(heads, getattr(config, "num_key_value_heads", None) or heads, head_dim,
                    dtypes)
    return key


def dispatch_inputs(key: StepKey, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                    ignore_index: int = -100, average_over_ranks: bool = False) -> dict:
    """The keyword arguments of a causal-LM forward on this rank's tokens: input_ids and
    position_ids ([1, T] -> [1, local]), labels shifted inside documents (`shift_labels`,
    with `labels` so that the model computes the loss), and num_items_in_batch = the row's
    labelled tokens, so that the local loss is this rank's share of the row's mean loss
    (sum the ranks' losses and gradients to get the one-process values). With
    average_over_ranks (DDP/FSDP average gradients over ranks) the divisor is divided by
    the number of ranks, which makes the averaged gradients the row's."""
    if position_ids is None:
        position_ids = key.position_ids().unsqueeze(0)
    shift = key.shift_labels(input_ids, ignore_index)
    items = key.num_label_tokens()
    if average_over_ranks:
        items = items / key.size
    local_labels = key.dispatch(shift, dim=1)
    return {
        "input_ids": key.dispatch(input_ids, dim=1),
        "position_ids": key.dispatch(position_ids.to(input_ids.device), dim=1),
        "labels": local_labels,
        "shift_labels": local_labels,
        "num_items_in_batch": torch.tensor(items, dtype=torch.float32),
    }


# ---- a one-process reference: PyTorch's SDPA per document of the whole row -------------

REFERENCE_NAME = "hsap_sdpa_varlen"
_reference_cu: list[Any] = []


def reference_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                value: torch.Tensor, attention_mask: torch.Tensor | None,
                                scaling: float | None = None, dropout: float = 0.0,
                                sliding_window: int | None = None, **kwargs: Any):
    """PyTorch's scaled_dot_product_attention per document of the whole packed row (one
    process, no hsap kernel): the reference the tests and examples check hsap against. The
    row's cu_seqlens come from `with reference_row(cu_seqlens):`."""
    from hsap.torch import sdpa_varlen

    if not _reference_cu:
        raise RuntimeError("hsap: run the reference model inside `with reference_row(cu):`")
    cu = _reference_cu[-1]
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    mask = _layer_mask(module, sliding_window)
    kind, param = (mask, 0) if isinstance(mask, str) else mask
    out = sdpa_varlen(q, k, v, cu, kind, param, softmax_scale=scaling)
    return out.unsqueeze(0), None


class reference_row:  # noqa: N801 (a context manager, used like a function)
    """`with reference_row(cu_seqlens):` runs reference_attention_forward over that row."""

    def __init__(self, cu_seqlens: Any):
        self.cu = cu_seqlens

    def __enter__(self) -> "reference_row":
        _reference_cu.append(self.cu)
        return self

    def __exit__(self, *exc: Any) -> None:
        _reference_cu.pop()


def register_reference(name: str = REFERENCE_NAME) -> str:
    """Registers reference_attention_forward under `name` (default "hsap_sdpa_varlen")."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, reference_attention_forward)
    return name
