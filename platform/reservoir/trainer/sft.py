"""Batches of (prompt, answer) pairs in the chat format for sft on tasks (the warm-up).

A freshly built tiny model writes noise, so every sampled group scores 0 and GRPO has no
signal; a short sft stage on part of the train tasks gives it one.
"""

from __future__ import annotations

import random
from typing import Sequence

import torch

from reservoir.trainer.batch import TrainBatch


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


def task_batch(tokenizer, pairs: Sequence[tuple[str, str]], size: int, *, seed: int,
               step: int) -> TrainBatch:
    """Step `step`'s batch of an sft stage on tasks: `size` (prompt, answer) pairs drawn
    without replacement by a generator seeded from (seed, step), so any rank, and a resumed
    trainer, draws the same batch for the same step."""
    rng = random.Random(f"{seed}:{step}")
    return sft_batch(tokenizer, rng.sample(list(pairs), min(size, len(pairs))))
