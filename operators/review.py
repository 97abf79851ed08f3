"""Routing rows to people: the human review router."""

from __future__ import annotations

import random

from data_juicer.ops.base_op import OPERATORS, Mapper

from reservoir.operators.common import finite


@OPERATORS.register_module("human_review_router")
class HumanReviewRouter(Mapper):
    """Send rows whose reward lies in [min_reward, max_reward] (a `fraction` of them, seeded) to
    human review: the row gets `review_reason`, and a Reservoir pipeline then holds it (status
    `held`, a `reviews` row) until someone labels it with `reservoir review label`."""

    _batched_op = True

    def __init__(self, min_reward: float | None = None, max_reward: float | None = None,
                 fraction: float = 1.0, reason: str = "needs review", seed: int = 0,
                 *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not 0 < fraction <= 1:
            raise ValueError("fraction must be in (0, 1]")
        self.min_reward, self.max_reward = min_reward, max_reward
        self.fraction, self.reason, self.seed = fraction, reason, seed

    def _matches(self, reward) -> bool:
        reward = finite(reward)
        return reward is not None and \
            (self.min_reward is None or reward >= self.min_reward) and \
            (self.max_reward is None or reward <= self.max_reward)

    def process_batched(self, samples):
        reasons = samples.get("review_reason") or [None] * len(samples["id"])
        for i, (row_id, reward) in enumerate(zip(samples["id"], samples["reward"])):
            if self._matches(reward) and random.Random(f"{self.seed}:{row_id}").random() < self.fraction:
                reasons[i] = self.reason
        samples["review_reason"] = reasons
        return samples
