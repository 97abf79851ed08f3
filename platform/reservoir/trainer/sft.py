"""Batches of conversations in the chat format for sft on tasks (the warm-up): a task's
demonstration (its `messages`), or its prompt answered with its answer.

A freshly built tiny model writes noise, so every sampled group scores 0 and GRPO has no
signal; a short sft stage on part of the train tasks gives it one.
"""

from __future__ import annotations

import random
from typing import Sequence

import torch

from reservoir.chat import Message, Tokens, demonstration
from reservoir.trainer.batch import TrainBatch
from reservoir.trainer.optimizer import adamw
from reservoir.plan.presets import PRESETS
from reservoir.trainer.step import train_step


def conversation(prompt: str, answer: str | None, payload: dict | None = None) -> list[Message]:
    """What sft on a task trains on: the demonstration its `messages` hold, else its prompt
    (after its system prompt, if any) answered with its answer."""
    if payload and payload.get("messages"):
        return payload["messages"]
    system = (payload or {}).get("system_prompt")
    return ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}, {"role": "assistant", "content": answer or ""}]


def demonstrations(tokenizer, conversations: Sequence[Sequence[Message]]) -> list[Tokens]:
    """Each conversation's tokens and mask, computed once for a stage (rendering a chat
    template costs more than the step's batching)."""
    return [demonstration(tokenizer, messages) for messages in conversations]


def sft_batch(pad_id: int, rows: Sequence[Tokens]) -> TrainBatch:
    """Right-padded conversations; only the assistant turns (each up to its end-of-turn
    token) train."""
    width = max(len(r.prompt_ids) + len(r.response_ids) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width - 1))
    for i, row in enumerate(rows):
        prompt, length = len(row.prompt_ids), len(row.prompt_ids) + len(row.response_ids)
        ids[i, :length] = torch.tensor(row.prompt_ids + row.response_ids)
        attention[i, :length] = 1
        mask[i, prompt - 1:length - 1] = torch.tensor(row.mask, dtype=torch.float32)
    zeros = torch.zeros(len(rows))
    return TrainBatch(ids, attention, mask, torch.zeros_like(mask), zeros, zeros.long())


def task_batch(pad_id: int, rows: Sequence[Tokens], size: int, *, seed: int,
               step: int) -> TrainBatch:
    """Step `step`'s batch of an sft stage on tasks: `size` of the stage's conversations
    (`demonstrations`) drawn without replacement by a generator seeded from (seed, step), so
    any rank, and a resumed trainer, draws the same batch for the same step."""
    rng = random.Random(f"{seed}:{step}")
    return sft_batch(pad_id, rng.sample(list(rows), min(size, len(rows))))


def supervised(model, tokenizer, pairs: Sequence[tuple[str, str]], *, steps: int,
               batch_size: int, lr: float, seed: int = 0) -> list[float]:
    """`steps` AdamW steps of answer-token cross-entropy outside any run (benchmarks make start
    models with it; a run's sft stage draws the same batches through `task_batch`); returns
    each step's loss."""
    rows = demonstrations(tokenizer, [conversation(prompt, answer) for prompt, answer in pairs])
    optimizer = adamw(model, lr)
    device = next(model.parameters()).device
    model.train()
    return [train_step(model, optimizer, task_batch(tokenizer.pad_token_id, rows, batch_size,
                                                    seed=seed, step=step).to(device),
                       PRESETS["sft"], micro_batch=batch_size)["loss"]
            for step in range(1, steps + 1)]
