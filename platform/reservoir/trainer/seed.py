"""One seed for Python's, numpy's and torch's generators (each step's own seed is the plan's:
`reservoir.plan.stages.step_seed`)."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
