"""Held-out accuracy: greedy answers to test tasks, scored by the run's reward."""

from __future__ import annotations

import numpy as np

from reservoir.explorer.engine import Engine
from reservoir.explorer.rewards import RewardFunction


def accuracy(engine: Engine, tasks: list[tuple], reward: RewardFunction,
             max_tokens: int) -> float:
    """Mean of the reward's `accuracy` component over (id, prompt, answer) tasks; NaN if none."""
    if not tasks:
        return float("nan")
    samples = engine.sample([prompt for _, prompt, _ in tasks], 1, temperature=0,
                            max_tokens=max_tokens)
    return float(np.mean([reward(group[0].text, answer or "")["accuracy"]
                          for (_, _, answer), group in zip(tasks, samples)]))
