"""Operators on rewards: keep a range, shape the reward, penalise length."""

from __future__ import annotations

from data_juicer.ops.base_op import OPERATORS, Filter, Mapper
from data_juicer.utils.constant import Fields

from reservoir.operators.common import finite, loads


@OPERATORS.register_module("reward_range_filter")
class RewardRangeFilter(Filter):
    """Keep rows whose reward lies in [min_reward, max_reward]; either bound may be left open.

    A reward of 0 is a reward like any other (Data-Juicer's specified_numeric_field_filter
    drops it); a missing or NaN reward is dropped with the reason "reward is missing or NaN".
    """

    _batched_op = True

    def __init__(self, min_reward: float | None = None, max_reward: float | None = None,
                 *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.min_reward, self.max_reward = min_reward, max_reward

    def compute_stats_batched(self, samples, *args, **kwargs):
        for stats, reward in zip(samples[Fields.stats], samples["reward"]):
            stats["reward"] = reward = finite(reward)
            keep = reward is not None and self.get_keep_boolean(reward, self.min_reward,
                                                                 self.max_reward)
            stats["reason"] = "" if keep else (
                "reward_range_filter: reward is missing or NaN" if reward is None else
                f"reward_range_filter: reward {reward:g} outside "
                f"[{self.min_reward}, {self.max_reward}]")
        return samples

    def process_batched(self, samples):
        return [not stats["reason"] for stats in samples[Fields.stats]]


@OPERATORS.register_module("reward_shaping_mapper")
class RewardShapingMapper(Mapper):
    """shaped_reward := scale * r + weight * value, where r is the row's shaped reward so far
    (its reward when none) and value a reward component (e.g. `format`) or a numeric field
    (e.g. `response_len`). `reward` stays as the reward function wrote it; the trainer trains
    on shaped_reward where it is set."""

    _batched_op = True

    def __init__(self, source: str, weight: float = 1.0, scale: float = 1.0, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.source, self.weight, self.scale = source, weight, scale

    def _value(self, samples, index: int) -> float:
        components = loads(samples["reward_components"][index])
        if self.source in components:
            return float(components[self.source])
        if self.source in samples:
            return float(samples[self.source][index] or 0.0)
        raise ValueError(f"reward_shaping_mapper: row {samples['id'][index]} has no reward "
                         f"component or field {self.source!r}")

    def process_batched(self, samples):
        shaped = list(samples.get("shaped_reward") or [None] * len(samples["reward"]))
        for index, base in enumerate(_current(samples)):
            shaped[index] = self.scale * base + self.weight * self._value(samples, index)
        samples["shaped_reward"] = shaped
        return samples


@OPERATORS.register_module("length_penalty_mapper")
class LengthPenaltyMapper(Mapper):
    """Subtract `penalty` per response token beyond `max_len` (DAPO's overlong shaping, linear),
    at most `max_penalty`, from the shaped reward (the reward when none): writes shaped_reward,
    never reward."""

    _batched_op = True

    def __init__(self, max_len: int, penalty: float = 0.01, max_penalty: float = 1.0,
                 *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_len, self.penalty, self.max_penalty = max_len, penalty, max_penalty

    def process_batched(self, samples):
        shaped = list(samples.get("shaped_reward") or [None] * len(samples["reward"]))
        for index, (base, length) in enumerate(zip(_current(samples), samples["response_len"])):
            over = max(0, int(length or 0) - self.max_len)
            if over:
                shaped[index] = base - min(self.max_penalty, over * self.penalty)
        samples["shaped_reward"] = shaped
        return samples


def _current(samples) -> list[float]:
    """Each row's reward as shaped so far: shaped_reward where set, else reward."""
    shaped = samples.get("shaped_reward") or [None] * len(samples["reward"])
    return [float(s) if finite(s) is not None else float(r)
            for s, r in zip(shaped, samples["reward"])]
