"""Preference pairs from groups: the best response of a group over its worst, for DPO.

The mapper does not change the experiences: it marks each chosen row with the rejected row's
id (`preferred_over`) and the reward gap (`preference_margin`). A Reservoir pipeline stores the
marked pairs (`marked_pairs`) in `preferences` in the transaction that writes the rest of its
changes, with one operator event (kind `added`, on the chosen row) per pair new to the store; a
dry run stores none.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from data_juicer.ops.base_op import OPERATORS, Mapper

from reservoir.operators.common import WHOLE, finite, group_rows
from reservoir.store import Pair

NAME = "preference_pair_mapper"
PREFERRED_OVER = "preferred_over"        # on a chosen row: the id of the row it is preferred to
PREFERENCE_MARGIN = "preference_margin"  # its reward minus the rejected row's
NOT_TRAINING = ("quarantined", "retired")  # rows a pipeline sets aside make no pairs


@OPERATORS.register_module(NAME)
class PreferencePairMapper(Mapper):
    """For each group, pair its best response (by shaped reward where set, else reward) with
    its worst when the gap is at least `min_margin`; with `pairs_per_group` k > 1, the i-th
    best with the i-th worst for i < k (each pair must clear the margin; a row is in one pair
    at most, so k is capped at half the group). Equal rewards never make a pair. Groups are
    judged within the rows the pipeline selected (one batch: no group is split)."""

    _batched_op = True

    def __init__(self, min_margin: float = 0.5, pairs_per_group: int = 1, *args, **kwargs):
        kwargs.setdefault("batch_size", WHOLE)
        super().__init__(*args, **kwargs)
        if not (isinstance(min_margin, (int, float)) and math.isfinite(min_margin)
                and min_margin >= 0):
            raise ValueError(f"min_margin={min_margin!r}: give a finite number >= 0 (the least "
                             "reward gap between a chosen and a rejected response)")
        if not isinstance(pairs_per_group, int) or pairs_per_group < 1:
            raise ValueError(f"pairs_per_group={pairs_per_group!r}: give an integer >= 1")
        self.min_margin, self.pairs_per_group = float(min_margin), pairs_per_group

    def pairs(self, scores: dict[int, float]) -> list[tuple[int, int, float]]:
        """(chosen, rejected, margin) among {row: score}: i-th best with i-th worst."""
        ranked = sorted(scores, key=lambda row: (-scores[row], row))
        k = min(self.pairs_per_group, len(ranked) // 2)
        found = []
        for best, worst in zip(ranked[:k], ranked[::-1][:k]):
            margin = scores[best] - scores[worst]
            if margin > 0 and margin >= self.min_margin:
                found.append((best, worst, margin))
        return found

    def process_batched(self, samples):
        n = len(samples["id"])
        rejected: list[Any] = [None] * n
        margins: list[Any] = [None] * n
        shaped = samples.get("shaped_reward") or [None] * n
        for rows in group_rows(samples["group_id"]).values():
            scores = {i: score for i in rows if (score := _score(samples["reward"][i],
                                                                 shaped[i])) is not None}
            for best, worst, margin in self.pairs(scores):
                rejected[best], margins[best] = samples["id"][worst], margin
        samples[PREFERRED_OVER], samples[PREFERENCE_MARGIN] = rejected, margins
        return samples


def _score(reward, shaped) -> float | None:
    return finite(shaped) if finite(shaped) is not None else finite(reward)


def marked_pairs(rows: Sequence[dict], statuses: dict[int, str]) -> list[Pair]:
    """The pairs the mapper marked on the rows a pipeline passed, both of whose rows came
    through and are not set aside (`statuses`: the pipeline's new status of a row by id)."""
    through = {row["id"] for row in rows
               if statuses.get(row["id"], row.get("status")) not in NOT_TRAINING}
    return [Pair(row["id"], int(row[PREFERRED_OVER]), float(row[PREFERENCE_MARGIN]), NAME)
            for row in rows if row.get(PREFERRED_OVER) is not None
            and row["id"] in through and int(row[PREFERRED_OVER]) in through]
