"""Leased rows -> padded tensors aligned for next-token log-probabilities, on the model's device.

`token_logprobs` never materialises a vocabulary-wide float32 `log_softmax` larger than
CHUNK_ABOVE_BYTES: past that it runs the decoder once, then takes each chunk of positions
through the output layer and its `log_softmax` (and entropy, when asked), recomputing each
chunk in the backward pass (activation checkpointing) so one chunk's logits are alive at a time.
Below it, the model's own forward and one `log_softmax` are faster and the memory is small.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from reservoir.store import LeasedExperience
from reservoir.trainer.packing import packable


@dataclass
class TrainBatch:
    """Right-padded sequences (prompt + response). Position t of the per-token tensors holds
    the token at t + 1: `mask` marks the response tokens that train (the model's own: an
    episode's tool and environment tokens are 0), `old_logprobs` their logprobs under the
    policy that sampled them (NaN where there is none)."""

    input_ids: torch.Tensor       # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    mask: torch.Tensor            # [B, L - 1]
    old_logprobs: torch.Tensor    # [B, L - 1]
    rewards: torch.Tensor         # [B]
    group_index: torch.Tensor     # [B]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.input_ids, self.attention_mask, self.mask, self.old_logprobs, self.rewards,
                self.group_index)

    def columns(self, width: int) -> "TrainBatch":
        """The first `width` positions of every row (the rest being padding)."""
        return TrainBatch(self.input_ids[:, :width], self.attention_mask[:, :width],
                          self.mask[:, :width - 1], self.old_logprobs[:, :width - 1],
                          self.rewards, self.group_index)

    def lengths(self) -> list[int]:
        """Each row's tokens, prompt and response (its padding not counted)."""
        return self.attention_mask.sum(1).tolist()

    def rows(self, index: slice | torch.Tensor) -> "TrainBatch":
        """The rows of a slice or of a tensor of row indices."""
        return TrainBatch(*(tensor[index] for tensor in self._tensors()))

    def to(self, device: torch.device | str) -> "TrainBatch":
        return TrainBatch(*(tensor.to(device) for tensor in self._tensors()))


CHUNK_ABOVE_BYTES = 1 << 30
PAD_SHARE = 0.25  # packing pays when padding would be more than this share of the positions

# config keys of models whose logits are more than the output layer's product (softcapping,
# scaling): they go through the model's own forward
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def make_batch(rows: Sequence[LeasedExperience], pad_id: int,
               device: torch.device | str = "cpu") -> TrainBatch:
    """The rows right-padded, built with whole-array numpy operations (a step's batch is
    hundreds of rows: per-row tensor writes cost more than the step's store work)."""
    prompts = np.array([len(r.prompt_ids) for r in rows])
    responses = np.array([len(r.response_ids) for r in rows])
    lengths = prompts + responses
    width = int(lengths.max())
    real = np.arange(width)[None] < lengths[:, None]  # [B, L]
    input_ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    input_ids[real] = np.concatenate([part for r in rows
                                      for part in (r.prompt_ids, r.response_ids)])
    # position t holds token t + 1: a response's tokens sit at prompt - 1 .. prompt + response - 2
    at = np.arange(width - 1)[None]
    written = (at >= prompts[:, None] - 1) & (at < lengths[:, None] - 1)
    trains = [np.ones(len(r.response_ids), np.float32) if r.action_mask is None
              else np.asarray(r.action_mask, np.float32) for r in rows]
    mask = np.zeros((len(rows), width - 1), np.float32)
    mask[written] = np.concatenate(trains)
    old = np.full((len(rows), width - 1), np.nan, np.float32)
    # the engine's logprobs where the model wrote the token
    old[written] = np.concatenate([
        np.full(len(t), np.nan, np.float32) if r.logprobs is None
        else np.where(t == 1, r.logprobs, np.nan).astype(np.float32)
        for r, t in zip(rows, trains)])
    groups = {group: index for index, group in enumerate(dict.fromkeys(r.group_id for r in rows))}
    return TrainBatch(torch.from_numpy(input_ids), torch.from_numpy(real.astype(np.int64)),
                      torch.from_numpy(mask), torch.from_numpy(old),
                      torch.tensor([r.train_reward for r in rows], dtype=torch.float32),
                      torch.tensor([groups[r.group_id] for r in rows])).to(device)


def token_logprobs(model, batch: TrainBatch, temperature: float = 1.0, *,
                   chunk: int = 1024, entropy: bool = False, packed: bool = False):
    """log p(token t+1 | tokens <= t) under `model`, [B, L - 1], in float32, `chunk` positions
    through the output layer at a time; with `entropy`, (logprobs, entropy of each position's
    distribution). Columns of padding only are not computed (zeros, as for any padding).
    `packed`: the rows' tokens go through the model back to back as one sequence without
    padding (`packed_logprobs`), where padding would be more than PAD_SHARE of the positions;
    the result has the same shape."""
    lengths = batch.attention_mask.sum(1)
    width = int(lengths.max())
    if packed and float(lengths.sum()) < (1 - PAD_SHARE) * len(batch) * width:
        return packed_logprobs(model, batch, temperature, chunk=chunk, entropy=entropy)
    if width < batch.input_ids.shape[1]:
        out = token_logprobs(model, batch.columns(width), temperature, chunk=chunk,
                             entropy=entropy)
        pad = batch.input_ids.shape[1] - width
        return tuple(F.pad(part, (0, pad)) for part in out) if entropy else F.pad(out, (0, pad))
    head = model.get_output_embeddings()
    targets = batch.input_ids[:, 1:]
    logits_bytes = targets.numel() * head.weight.shape[0] * 4
    if logits_bytes <= CHUNK_ABOVE_BYTES or \
            any(getattr(model.config, name, None) for name in LOGIT_TRANSFORMS):
        return full_logprobs(model, batch, temperature, entropy=entropy)
    hidden = model.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                 use_cache=False).last_hidden_state
    hidden = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    logprobs, entropies = _head_logprobs(head, hidden, targets.reshape(-1), temperature, chunk,
                                         entropy)
    if not entropy:
        return logprobs.view_as(targets)
    return logprobs.view_as(targets), entropies.view_as(targets)


def _head_logprobs(head, hidden: torch.Tensor, flat: torch.Tensor, temperature: float,
                   chunk: int, entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs of `flat` targets (and entropies, else an empty tensor) from hidden states
    [N, H]: in one pass when the logits are small, else `chunk` rows through the output layer
    at a time, each recomputed in the backward pass."""
    if flat.shape[0] * head.weight.shape[0] * 4 <= CHUNK_ABOVE_BYTES:
        return _chunk_logprobs(head, hidden, flat, temperature, entropy)
    keep = torch.is_grad_enabled() and hidden.requires_grad
    parts = []
    for start in range(0, flat.shape[0], chunk):
        args = (head, hidden[start:start + chunk], flat[start:start + chunk], temperature,
                entropy)
        parts.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False) if keep
                     else _chunk_logprobs(*args))
    return torch.cat([lp for lp, _ in parts]), torch.cat([ent for _, ent in parts])


def packed_logprobs(model, batch: TrainBatch, temperature: float = 1.0, *,
                    chunk: int = 1024, entropy: bool = False):
    """`token_logprobs` with the rows packed: their real tokens back to back as one sequence
    [1, T], position ids restarting at each row, attention within each row (trainer/packing.py:
    sdpa per row, or flash-attention's variable-length kernel). No position is padding; the
    output layer sees only positions whose next token is the same row's. Models whose logits are
    more than the output layer's product go through their own forward, on the same packing."""
    real = batch.attention_mask.bool()
    lengths = real.sum(1)
    flat = batch.input_ids[real]
    positions = torch.cat([torch.arange(int(n), device=flat.device) for n in lengths])
    ends = lengths.cumsum(0) - 1
    sources = torch.ones_like(flat, dtype=torch.bool)
    sources[ends] = False  # a row's last token predicts nothing of its own row
    targets = flat.roll(-1)[sources]
    taken = sources.nonzero()[:, 0]  # index_select: its backward is index_add, not index_put
    packed = packable(model) | {"input_ids": flat[None], "position_ids": positions[None],
                                "packed_lengths": lengths.tolist(), "use_cache": False}
    if any(getattr(model.config, name, None) for name in LOGIT_TRANSFORMS):
        logits = model(**packed).logits[0].index_select(0, taken)
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        logprobs, entropies = logp.gather(-1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)
    else:
        hidden = model.get_decoder()(**packed).last_hidden_state[0].index_select(0, taken)
        logprobs, entropies = _head_logprobs(model.get_output_embeddings(), hidden, targets,
                                             temperature, chunk, entropy)
    valid = real[:, 1:]  # (row, t) with a next token in the row: the same order as `sources`
    shaped = logprobs.new_zeros(valid.shape).masked_scatter(valid, logprobs)
    if not entropy:
        return shaped
    return shaped, entropies.new_zeros(valid.shape).masked_scatter(valid, entropies)


def _chunk_logprobs(head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                    entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(hidden).float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    entropies = -(logp.exp() * logp).sum(-1) if entropy else logp.new_empty(0)
    return logp.gather(-1, targets[:, None])[:, 0], entropies


def full_logprobs(model, batch: TrainBatch, temperature: float = 1.0, *,
                  entropy: bool = False):
    """The same as `token_logprobs` through the vocabulary-wide `log_softmax` (the reference
    the chunked form is tested and benchmarked against)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   use_cache=False).logits
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    logprobs = logp.gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    return (logprobs, -(logp.exp() * logp).sum(-1)) if entropy else logprobs
