"""Operators that read the store: staleness, dedup against stored rows, task difficulty.

They use the store of the pipeline running them; in a plain Data-Juicer recipe, pass `db_url`
(or set RESERVOIR_DB_URL): each batch then opens the store at that URL and closes it after.
"""

from __future__ import annotations

import hashlib
import os
from contextlib import contextmanager
from typing import Iterator

from data_juicer.ops.base_op import OPERATORS, Filter, Mapper
from data_juicer.utils.constant import Fields

from reservoir.operators.common import WHOLE, finite
from reservoir.operators.priority import pass_rate_priority
from reservoir.store import Store

_current: Store | None = None  # set by the pipeline runner (a global: forked workers see it)


@contextmanager
def using(store: Store) -> Iterator[None]:
    """Operators run inside this block read `store`."""
    global _current
    previous, _current = _current, store
    try:
        yield
    finally:
        _current = previous


@contextmanager
def store_for(operator: str, db_url: str | None) -> Iterator[Store]:
    """The store the operator reads: the one at `db_url`, else the running pipeline's, else
    the one at RESERVOIR_DB_URL; a store opened from a URL is closed when the block ends."""
    url = db_url or (None if _current is not None else os.environ.get("RESERVOIR_DB_URL"))
    if url:
        with Store(url) as store:
            yield store
    elif _current is None:
        raise ValueError(f"{operator} reads the store: run it in a Reservoir pipeline, or give "
                         "it db_url (or set RESERVOIR_DB_URL)")
    else:
        yield _current


@OPERATORS.register_module("staleness_filter")
class StalenessFilter(Filter):
    """Drop rows made by a policy more than `max_staleness` versions older than their run's
    latest published version: the trainer would refuse them anyway."""

    _batched_op = True

    def __init__(self, max_staleness: int, db_url: str | None = None, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_staleness, self.db_url = max_staleness, db_url

    def compute_stats_batched(self, samples, *args, **kwargs):
        runs = sorted(set(samples["run_id"]))
        with store_for(self._name, self.db_url) as store:
            latest = store.runs.latest_versions(runs)
        for stats, run_id, version in zip(samples[Fields.stats], samples["run_id"],
                                          samples["policy_version"]):
            stats["staleness"] = staleness = latest.get(run_id, version) - version
            stats["reason"] = "" if staleness <= self.max_staleness else (
                f"staleness_filter: {staleness} versions behind (max {self.max_staleness})")
        return samples

    def process_batched(self, samples):
        return [not stats["reason"] for stats in samples[Fields.stats]]


def _digest(prompt: str, response: str) -> str:
    return hashlib.md5(f"{prompt}\x1f{response}".encode()).hexdigest()


@OPERATORS.register_module("store_dedup_filter")
class StoreDedupFilter(Filter):
    """Drop rows whose (prompt, response) text already exists in the store (in `statuses`,
    other rows than these), and repeats within the selection after the first."""

    _batched_op = True

    def __init__(self, statuses: list[str] | None = None, db_url: str | None = None,
                 *args, **kwargs):
        kwargs.setdefault("batch_size", WHOLE)
        super().__init__(*args, **kwargs)
        self.statuses = statuses or ["ready", "leased", "consumed"]
        self.db_url = db_url

    def compute_stats_batched(self, samples, *args, **kwargs):
        digests = [_digest(p, r) for p, r in zip(samples["prompt_text"], samples["response_text"])]
        with store_for(self._name, self.db_url) as store:
            found = store.pipelines.stored_texts(set(digests), self.statuses,
                                                 list(samples["id"]))
        first: dict[str, int] = {}
        for stats, digest, row_id in zip(samples[Fields.stats], digests, samples["id"]):
            original = found.get(digest) or first.setdefault(digest, row_id)
            stats["duplicate_of"] = original
            stats["reason"] = "" if original == row_id else (
                f"store_dedup_filter: same text as experience {original}")
        return samples

    def process_batched(self, samples):
        return [not stats["reason"] for stats in samples[Fields.stats]]


@OPERATORS.register_module("task_difficulty_mapper")
class TaskDifficultyMapper(Mapper):
    """Pass rate of each row's task over all its experiences in the store (a row passes when
    its `component` reward component, else its reward, is >= threshold). Sets
    `task_difficulty` = 1 - pass rate (a Reservoir pipeline writes it to tasks.difficulty) and,
    with `set_priority`, priority = 4 p (1 - p): tasks solved about half the time first."""

    _batched_op = True

    def __init__(self, component: str | None = "accuracy", threshold: float = 1.0,
                 set_priority: bool = False, db_url: str | None = None, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.component, self.threshold = component, threshold
        self.set_priority, self.db_url = set_priority, db_url

    def _pass_rates(self, task_ids) -> dict[int, float]:
        with store_for(self._name, self.db_url) as store:
            return store.pipelines.task_pass_rates(task_ids, self.component, self.threshold)

    def process_batched(self, samples):
        rates = self._pass_rates(sorted({t for t in samples["task_id"] if t is not None}))
        difficulty = []
        for i, task_id in enumerate(samples["task_id"]):
            rate = finite(rates.get(task_id))
            difficulty.append(None if rate is None else 1.0 - rate)
            if self.set_priority and rate is not None:
                samples["priority"][i] = pass_rate_priority(rate)
        samples["task_difficulty"] = difficulty
        return samples
