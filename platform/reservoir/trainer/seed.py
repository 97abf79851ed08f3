"""One seed for Python's, numpy's and torch's generators, and the seed of each step."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def step_seed(seed: int, step: int) -> int:
    """The seed of a step's own draws (its mini-batches' order): the same on every rank and
    when the step is replayed on resume, different from step to step."""
    return (seed * 1_000_003 + step) % 2**63
