"""Attention for packed rows: several sequences back to back in one, each attending to itself.

transformers' own packed path (position ids restarting at each sequence, no attention mask)
builds a [T, T] block-diagonal mask for sdpa and eager attention: quadratic in the packed
length, and slower than padding on a CPU. `reservoir_packed`, registered with transformers'
attention interface, runs sdpa once per sequence with its causal kernel when a call is packed
(the `packed_lengths` keyword), and is transformers' sdpa itself otherwise (generation, padded
batches): a module set to it computes what sdpa computes everywhere. Where a model runs
flash-attention (`flash_attention_2` and later, on a GPU with the package installed), that
kernel's variable-length path reads the packing from the position ids and is kept.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

IMPLEMENTATION = "reservoir_packed"
FLASH = ("flash_attention_2", "flash_attention_3", "flash_attention_4")


def packed_attention(module, query, key, value, attention_mask, *,
                     packed_lengths: list[int] | None = None, **kwargs):
    """sdpa, one sequence at a time when the call is packed ([1, heads, T, dim] split at
    `packed_lengths`); a sliding-window layer masks its band where a sequence outgrows it."""
    if packed_lengths is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop("is_causal", None)
    window = kwargs.get("sliding_window")
    outputs = []
    for q, k, v in zip(query.split(packed_lengths, 2), key.split(packed_lengths, 2),
                       value.split(packed_lengths, 2)):
        band = _band(q.shape[2], window, q.device) if window and q.shape[2] > window else None
        outputs.append(sdpa_attention_forward(module, q, k, v, band, is_causal=band is None,
                                              **kwargs)[0])
    return torch.cat(outputs, dim=1), None


def _band(length: int, window: int, device) -> torch.Tensor:
    """Causal attention to the last `window` positions, as a boolean [1, 1, L, L] mask."""
    at = torch.arange(length, device=device)
    offset = at[:, None] - at[None, :]
    return ((offset >= 0) & (offset < window))[None, None]


AttentionInterface.register(IMPLEMENTATION, packed_attention)
AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)


def packable(model) -> dict:
    """Keyword arguments for a packed forward of `model` (a transformers decoder, or a peft
    or fsdp2 wrapper of one): no mask is built for any layer type (flash-attention and
    `reservoir_packed` need none). A model on another implementation is set to
    `reservoir_packed`, which gives its unpacked calls the same results as sdpa."""
    config = model.config
    if config._attn_implementation not in (IMPLEMENTATION, *FLASH):
        model.set_attn_implementation(IMPLEMENTATION)
    return {"attention_mask": defaultdict(lambda: None)}
