"""Attention for packed rows: several sequences back to back in one, each attending to itself.

transformers' own packed path (position ids restarting at each sequence, no attention mask)
builds a [T, T] block-diagonal mask for sdpa and eager attention: quadratic in the packed
length, and slower than padding on a CPU. `reservoir_packed`, registered with transformers'
attention interface, runs sdpa's causal kernel over buckets of sequences of nearly equal
length when a call is packed (the `packed_lengths` keyword): the projections, MLPs and output
layer see no padding, attention only a little; it is transformers' sdpa itself otherwise
(generation, padded batches): a module set to it computes what sdpa computes everywhere. Where a model runs
flash-attention (`flash_attention_2` and later, on a GPU with the package installed), that
kernel's variable-length path reads the packing from the position ids and is kept.
"""

from __future__ import annotations

import functools
from collections import defaultdict

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

IMPLEMENTATION = "reservoir_packed"
FLASH = ("flash_attention_2", "flash_attention_3", "flash_attention_4")


def packed_attention(module, query, key, value, attention_mask, *,
                     packed_lengths: list[int] | None = None, **kwargs):
    """sdpa over packed sequences ([1, heads, T, dim] cut at `packed_lengths`): sequences of
    nearly equal length go through one causal sdpa call together, right-padded to the
    longest of them (a query attends only to keys before it, so padding is never attended,
    and the padded queries' outputs are dropped); a sliding-window layer masks its band."""
    if packed_lengths is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop("is_causal", None)
    window = kwargs.get("sliding_window")
    gather, shapes, back = _buckets(tuple(packed_lengths), query.device)
    # one gather in and one out, by index_select: their backward is one index_add each, where
    # per-bucket indexing took a full-size accumulating index_put per bucket on a CPU
    pieces = zip(*(tensor[0].index_select(1, gather).split([r * n for r, n in shapes], dim=1)
                   for tensor in (query, key, value)))
    outputs = []
    for (rows, length), qkv in zip(shapes, pieces):
        q, k, v = (part.unflatten(1, (rows, length)).transpose(0, 1) for part in qkv)
        band = _band(length, window, q.device) if window and length > window else None
        out = sdpa_attention_forward(module, q, k, v, band, is_causal=band is None, **kwargs)[0]
        outputs.append(out.flatten(0, 1))  # [rows x length, heads, dim]
    return torch.cat(outputs).index_select(0, back)[None], None


def _band(length: int, window: int, device) -> torch.Tensor:
    """Causal attention to the last `window` positions, as a boolean [1, 1, L, L] mask."""
    at = torch.arange(length, device=device)
    offset = at[:, None] - at[None, :]
    return ((offset >= 0) & (offset < window))[None, None]


@functools.lru_cache(maxsize=64)
def _buckets(lengths: tuple[int, ...], device) -> tuple[torch.Tensor, list, torch.Tensor]:
    """Sequences sorted longest first, cut where one is shorter than 4/5 of its bucket's
    longest, each bucket right-padded to its longest: the packed positions to gather, bucket
    after bucket (padding repeats position 0); each bucket's (rows, longest); and for each
    packed position, where its token sits among the gathered ones."""
    starts = [0]
    for length in lengths[:-1]:
        starts.append(starts[-1] + length)
    ranked = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups, current = [], []
    for i in ranked:
        if current and lengths[i] < 0.8 * lengths[current[0]]:
            groups.append(current)
            current = []
        current.append(i)
    groups.append(current)
    gathers, shapes, back, offset = [], [], torch.empty(sum(lengths), dtype=torch.long), 0
    for group in groups:
        longest = lengths[group[0]]
        at = torch.arange(longest)
        keep = at[None] < torch.tensor([lengths[i] for i in group])[:, None]
        gather = torch.where(keep, torch.tensor([starts[i] for i in group])[:, None] + at, 0)
        back[gather[keep]] = offset + keep.flatten().nonzero()[:, 0]
        gathers.append(gather.flatten())
        shapes.append((len(group), longest))
        offset += gather.numel()
    return torch.cat(gathers).to(device), shapes, back.to(device)


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
