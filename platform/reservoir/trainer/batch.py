"""Leased rows -> padded tensors aligned for next-token log-probabilities."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from reservoir.store import LeasedExperience


@dataclass
class TrainBatch:
    """Right-padded sequences (prompt + response). Position t of the per-token tensors holds
    the token at t + 1: `mask` marks the response tokens that train, `old_logprobs` their
    logprobs under the policy that sampled them."""

    input_ids: torch.Tensor       # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    mask: torch.Tensor            # [B, L - 1]
    old_logprobs: torch.Tensor    # [B, L - 1]
    rewards: torch.Tensor         # [B]
    group_index: torch.Tensor     # [B]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, index: slice) -> "TrainBatch":
        return TrainBatch(*(tensor[index] for tensor in (
            self.input_ids, self.attention_mask, self.mask, self.old_logprobs, self.rewards,
            self.group_index)))


def make_batch(rows: Sequence[LeasedExperience], pad_id: int) -> TrainBatch:
    lengths = [len(r.prompt_ids) + len(r.response_ids) for r in rows]
    width = max(lengths)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width - 1))
    old = torch.full((len(rows), width - 1), float("nan"))
    groups = {group: index for index, group in enumerate(dict.fromkeys(r.group_id for r in rows))}
    for i, row in enumerate(rows):
        prompt, response = len(row.prompt_ids), len(row.response_ids)
        input_ids[i, :prompt + response] = torch.from_numpy(
            np.concatenate([row.prompt_ids, row.response_ids]).astype(np.int64))
        attention[i, :prompt + response] = 1
        trains = np.ones(response) if row.action_mask is None else row.action_mask
        mask[i, prompt - 1:prompt - 1 + response] = torch.from_numpy(trains.astype(np.float32))
        if row.logprobs is not None:
            old[i, prompt - 1:prompt - 1 + response] = torch.from_numpy(row.logprobs.copy())
    return TrainBatch(input_ids, attention, mask, old,
                      torch.tensor([r.train_reward for r in rows], dtype=torch.float32),
                      torch.tensor([groups[r.group_id] for r in rows]))


def token_logprobs(model, batch: TrainBatch, temperature: float = 1.0) -> torch.Tensor:
    """log p(token t+1 | tokens <= t) under `model`, [B, L - 1]."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logits = logits[:, :-1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
