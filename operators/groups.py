"""Operators that look at whole groups (all n responses to one task)."""

from __future__ import annotations

import statistics

from data_juicer.ops.base_op import OPERATORS, Filter, Mapper
from data_juicer.utils.constant import Fields

from reservoir.operators.common import WHOLE, finite, group_rows


@OPERATORS.register_module("group_variance_filter")
class GroupVarianceFilter(Filter):
    """Drop groups whose rewards are all equal (std <= min_std): GRPO gives every row of such
    a group an advantage of 0, so it only costs compute. Groups are judged within the rows the
    pipeline selected (one batch: no group is split)."""

    _batched_op = True

    def __init__(self, min_std: float = 0.0, *args, **kwargs):
        kwargs.setdefault("batch_size", WHOLE)
        super().__init__(*args, **kwargs)
        self.min_std = min_std

    def compute_stats_batched(self, samples, *args, **kwargs):
        for rows in group_rows(samples["group_id"]).values():
            rewards = [finite(samples["reward"][i]) for i in rows]
            known = [r for r in rewards if r is not None]
            std = statistics.pstdev(known) if len(known) > 1 else 0.0
            reason = "" if std > self.min_std else (
                f"group_variance_filter: the group's {len(rows)} rewards have std {std:.3g} "
                f"<= {self.min_std} (zero advantage)")
            for i in rows:
                samples[Fields.stats][i].update(group_reward_std=std, reason=reason)
        return samples

    def process_batched(self, samples):
        return [not stats["reason"] for stats in samples[Fields.stats]]


@OPERATORS.register_module("advantage_priority_mapper")
class AdvantagePriorityMapper(Mapper):
    """priority := |reward - group mean| / (group std + eps): rows far from their group's mean
    teach the most (prioritised replay by absolute advantage)."""

    _batched_op = True

    def __init__(self, eps: float = 1e-6, *args, **kwargs):
        kwargs.setdefault("batch_size", WHOLE)
        super().__init__(*args, **kwargs)
        self.eps = eps

    def process_batched(self, samples):
        for rows in group_rows(samples["group_id"]).values():
            rewards = [finite(samples["reward"][i]) or 0.0 for i in rows]
            mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
            for i, reward in zip(rows, rewards):
                samples["priority"][i] = abs(reward - mean) / (std + self.eps)
        return samples
