"""Batches of (prompt, answer) pairs in the chat format for sft on tasks (the warm-up).

A freshly built tiny model writes noise, so every sampled group scores 0 and GRPO has no
signal; a short sft stage on part of the train tasks gives it one.
"""

from __future__ import annotations

import random
from typing import Sequence

import torch

from reservoir.trainer.batch import TrainBatch
from reservoir.trainer.presets import PRESETS
from reservoir.trainer.step import train_step


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


def supervised(model, tokenizer, pairs: Sequence[tuple[str, str]], *, steps: int,
               batch_size: int, lr: float, seed: int = 0) -> list[float]:
    """`steps` AdamW steps of answer-token cross-entropy outside any run (benchmarks make start
    models with it; a run's sft stage draws the same batches through `task_batch`); returns
    each step's loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    device = next(model.parameters()).device
    model.train()
    return [train_step(model, optimizer, task_batch(tokenizer, pairs, batch_size, seed=seed,
                                                    step=step).to(device),
                       PRESETS["sft"], micro_batch=batch_size)["loss"]
            for step in range(1, steps + 1)]
