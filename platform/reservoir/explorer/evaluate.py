"""Held-out accuracy: greedy answers to test tasks, scored by the run's reward."""

from __future__ import annotations

import numpy as np

from reservoir.config import ReservoirConfig
from reservoir.explorer.engine import Engine, TransformersEngine
from reservoir.explorer.rewards import REWARDS, RewardFunction


def accuracy(engine: Engine, tasks: list[tuple], reward: RewardFunction,
             max_tokens: int) -> float:
    """Mean of the reward's `accuracy` component over (id, prompt, answer) tasks; NaN if none."""
    if not tasks:
        return float("nan")
    samples = engine.sample([prompt for _, prompt, _ in tasks], 1, temperature=0,
                            max_tokens=max_tokens)
    return float(np.mean([reward(group[0].text, answer or "")["accuracy"]
                          for (_, _, answer), group in zip(tasks, samples)]))


def held_out_accuracy(config: ReservoirConfig, model, tokenizer, tasks: list[tuple]) -> float:
    """`accuracy` of a model in memory (the trainer's policy) with the run's reward."""
    return accuracy(TransformersEngine.of(model, tokenizer), tasks,
                    REWARDS.get(config.explorer.reward), config.explorer.max_tokens)
