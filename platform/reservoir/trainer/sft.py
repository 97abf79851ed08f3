"""Supervised warm-up: next-token cross-entropy on (prompt, answer) pairs in the chat format.

A freshly built tiny model writes noise, so every sampled group scores 0 and GRPO has no
signal; a short warm-up on part of the train tasks gives it one.
"""

from __future__ import annotations

import random
from typing import Callable, Sequence

import torch

from reservoir.trainer.batch import token_logprobs, TrainBatch


def sft_batch(tokenizer, pairs: Sequence[tuple[str, str]]) -> TrainBatch:
    """Chat-formatted prompt + answer + end-of-turn; only the answer tokens train."""
    rows = []
    for prompt, answer in pairs:
        context = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer(context)["input_ids"]
        answer_ids = tokenizer(answer)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((prompt_ids, answer_ids))
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width - 1))
    for i, (prompt_ids, answer_ids) in enumerate(rows):
        ids[i, :len(prompt_ids) + len(answer_ids)] = torch.tensor(prompt_ids + answer_ids)
        attention[i, :len(prompt_ids) + len(answer_ids)] = 1
        mask[i, len(prompt_ids) - 1:len(prompt_ids) - 1 + len(answer_ids)] = 1
    zeros = torch.zeros(len(rows))
    return TrainBatch(ids, attention, mask, torch.zeros_like(mask), zeros, zeros.long())


def warm_up(model, tokenizer, pairs: Sequence[tuple[str, str]], *, steps: int, batch_size: int,
            lr: float, seed: int = 0, stop: Callable[[], bool] = lambda: False,
            progress: Callable[[int, float], None] = lambda step, loss: None) -> list[float]:
    """`steps` AdamW steps of answer-token cross-entropy; returns the loss per step. `stop` is
    asked before every step (fewer losses come back when it said yes); `progress` hears each
    step's number and loss."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, device = [], next(model.parameters()).device
    model.train()
    for step in range(1, steps + 1):
        if stop():
            break
        batch = sft_batch(tokenizer, rng.sample(list(pairs), min(batch_size, len(pairs))))
        batch = batch.to(device)
        logprobs = token_logprobs(model, batch)
        loss = -(logprobs * batch.mask).sum() / batch.mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        progress(step, losses[-1])
    return losses
