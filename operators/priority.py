"""Priority scorers that need no groups: recency."""

from __future__ import annotations

import math
from datetime import datetime

from data_juicer.ops.base_op import OPERATORS, Mapper


@OPERATORS.register_module("recency_priority_mapper")
class RecencyPriorityMapper(Mapper):
    """priority := weight * 0.5 ** (age / half_life_s) + (1 - weight) * priority, where age is
    how much older a row is than the newest row selected: newer experience first, decaying."""

    _batched_op = True

    def __init__(self, half_life_s: float = 600.0, weight: float = 1.0, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if half_life_s <= 0 or not 0 <= weight <= 1:
            raise ValueError("half_life_s must be > 0 and weight in [0, 1]")
        self.half_life_s, self.weight = half_life_s, weight

    def process_batched(self, samples):
        times = [datetime.fromisoformat(str(t)) for t in samples["created_at"]]
        newest = max(times)
        for i, created in enumerate(times):
            decay = 0.5 ** ((newest - created).total_seconds() / self.half_life_s)
            samples["priority"][i] = (self.weight * decay
                                      + (1 - self.weight) * float(samples["priority"][i] or 0))
        return samples


def pass_rate_priority(pass_rate: float) -> float:
    """4 p (1 - p): 1 at a pass rate of 0.5, 0 for tasks always or never solved."""
    return 4 * pass_rate * (1 - pass_rate) if not math.isnan(pass_rate) else 0.0
