"""Where a stage's batches come from, and how each step's use of them enters the ledger.

- explorers: whole groups leased from the run's ready rows (no staler than the mode allows);
  the commit consumes them.
- tasks: the run's train tasks as conversations (a task's demonstration, or its prompt and
  answer), drawn by step; the step is recorded with no experiences.
- stored: earlier experiences (trainer/stored.py), read without a lease; the step's ledger
  rows point at them, whichever run wrote them.
- preferences: chosen/rejected pairs leased from `preferences`; the commit consumes them and
  records both responses.

`draw(step)` gives a `Draw` (rows, batch, and how to commit or give it back); `replay(step)`
gives the rows or batch a committed step trained on, from the ledger.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from reservoir.config import ReservoirConfig
from reservoir.errors import FlowControlTimeout
from reservoir.store import Patience, Store
from reservoir.trainer.batch import TrainBatch, make_batch
from reservoir.trainer.sft import conversation, demonstrations, task_batch
from reservoir.plan.stages import Stage
from reservoir.trainer.stored import read_stored

LEASE_POLL_S = 1.0  # between lease attempts, check for a stop request


@dataclass
class Context:
    config: ReservoirConfig
    store: Store
    run_id: int
    tokenizer: object
    device: object
    patience: Patience
    stop: threading.Event
    version: Callable[[], int]   # the policy version the trainer holds
    # a colocated run's explorer: one round explored in this process; whether it explored
    refill: Callable[[], bool] | None = None


@dataclass
class Draw:
    rows: list                    # the experiences in batch order (none for tasks)
    batch: TrainBatch
    commit: Callable[[int, dict], None]   # (step, metrics): the step enters the ledger
    release: Callable[[], None] = lambda: None
    metrics: dict = field(default_factory=dict)


class Feed:
    def __init__(self, context: Context, stage: Stage) -> None:
        self.context, self.stage = context, stage

    def begin(self) -> None:
        """Prepare the stage's data (once, when the stage starts or resumes)."""

    def _batch(self, rows) -> TrainBatch:
        return make_batch(rows, self.context.tokenizer.pad_token_id, self.context.device)

    def _record(self, ids: list[int]) -> Callable[[int, dict], None]:
        context = self.context

        def commit(step: int, metrics: dict) -> None:
            context.store.ledger.record_step(
                context.run_id, step, policy_version=context.version(), metrics=metrics,
                loss=metrics.get("loss"), stage=self.stage.name, experience_ids=ids)
        return commit

    def _wait_for(self, attempt: Callable, waited_out: Callable[[str], str],
                  refill: Callable = lambda: False):
        """`attempt()` (which raises FlowControlTimeout after LEASE_POLL_S) until it gives a
        lease, `refill()` says there may be more now, a stop comes (None), or
        trainer.wait_timeout_s passes: FlowControlTimeout, `waited_out(how long)` in one
        line."""
        started, wait_s = time.monotonic(), self.context.config.trainer.wait_timeout_s
        while not self.context.stop.is_set():
            try:
                return attempt()
            except FlowControlTimeout:
                if refill():
                    continue
                if time.monotonic() - started > wait_s:
                    raise FlowControlTimeout("trainer.wait_timeout_s: " +
                                             waited_out(f"{wait_s:g}s")) from None
        return None

    def replay(self, step: int) -> tuple[list, TrainBatch]:
        ids = self.context.store.ledger.step_experiences(self.context.run_id, step)
        rows = self.context.store.fetch(ids)
        return rows, self._batch(rows)


class ExplorerFeed(Feed):
    """Leases whole groups; each step's metrics carry wait_s (the lease, waits for rows
    included) and commit_s (the previous step's commit: a step's own is known only after
    it is recorded)."""

    commit_s: float | None = None

    def draw(self, step: int) -> Draw | None:
        waited = time.monotonic()
        lease = self._lease(self.stage.batch)
        set_aside = 0
        if lease is not None and self.context.config.sampler.dynamic_sampling:
            lease, set_aside = self._with_signal(lease)
        if lease is None:
            return None
        rows = sorted(lease.rows, key=lambda row: row.id)
        partial = lease.partial_groups()
        store, name = self.context.store, self.context.config.run.name

        def commit(step: int, metrics: dict) -> None:
            retried, started = [], time.monotonic()

            def once() -> None:  # a commit whose answer was lost may have gone through
                if retried and store.step_committed(name, step):
                    return
                store.commit_step(lease, step=step, policy_version=self.context.version(),
                                  loss=metrics["loss"], metrics=metrics, stage=self.stage.name)
            self.context.patience(once, f"trainer step {step}",
                                  before_retry=lambda: retried.append(1))
            self.commit_s = time.monotonic() - started
        timing = {"wait_s": time.monotonic() - waited}
        if self.commit_s is not None:
            timing["commit_s"] = self.commit_s
        return Draw(rows, self._batch(rows), commit, lambda: store.release(lease),
                    {**timing, "partial_groups": len(partial),
                     "partial_group_rows": sum(got for got, _ in partial.values()),
                     **({"dynamic/set_aside_groups": set_aside}
                        if self.context.config.sampler.dynamic_sampling else {})})

    def _with_signal(self, lease):
        """Dynamic sampling: set aside the groups whose rewards are all equal and lease others
        in their place until every group carries signal; (lease or None if stopped, groups
        set aside). Each round renews the lease: the rounds may outlast sampler.lease_seconds,
        and a row whose lease expired would be reclaimed and leased again into this batch."""
        store, set_aside = self.context.store, 0

        def renewed(lease):
            return replace(lease, leased_until=store.renew(lease)) if lease.rows else lease

        while flat := [group for group, rows in lease.groups().items() if len(rows) > 1
                       and len({row.train_reward for row in rows}) == 1]:
            lease = renewed(store.set_aside(lease, flat, reason="zero reward variance"))
            set_aside += len(flat)
            more = self._lease(len(flat))
            if more is None:
                store.release(lease)
                return None, set_aside
            # a join keeps the earlier expiry of the two; a lease left empty is simply replaced
            lease = renewed(store.join(lease, more)) if lease.rows else more
        return lease, set_aside

    def _lease(self, groups: int):
        """Whole groups no staler than allowed; None if a stop came while waiting."""
        config, store = self.context.config, self.context.store
        floor = self.context.version() - config.staleness
        if self.context.refill is not None:
            return self._lease_here(groups, floor)
        lease = lambda: store.lease(  # noqa: E731
            config.run.name, groups=groups, min_policy_version=floor, timeout_s=LEASE_POLL_S)
        # a lease lost with the connection is handed back before the next try
        return self._wait_for(
            lambda: self.context.patience(lease, "trainer lease", before_retry=lambda:
                                          store.release_runs(config.run.name)),
            lambda waited: f"no batch of {groups} groups (version >= {floor}) came in {waited}; "
            "is an explorer running (`reservoir explore CONFIG`)?")


    def _lease_here(self, groups: int, floor: int):
        """A colocated run's lease: explore rounds in this process until the batch is ready
        (pipelines may drop some of a round, dynamic sampling sets flat groups aside)."""
        config, store, context = self.context.config, self.context.store, self.context
        while not context.stop.is_set():
            explored = context.refill()
            try:
                return context.patience(lambda: store.lease(
                    config.run.name, groups=groups, min_policy_version=floor, timeout_s=0),
                    "trainer lease")
            except FlowControlTimeout as exc:
                if not explored:
                    raise FlowControlTimeout(
                        f"no batch of {groups} groups (version >= {floor}) and no task left "
                        f"to explore: {exc}") from None
        return None


class TaskFeed(Feed):
    def begin(self) -> None:
        """The stage's share of the run's train tasks (the first ones); explorers claim them
        last."""
        seen = self.context.store.tasks.mark_sft_tasks(self.context.run_id,
                                                       self.stage.data.tasks.fraction)
        self.rows = demonstrations(self.context.tokenizer,
                                   [conversation(*row[1:]) for row in seen])

    def _task_batch(self, step: int) -> TrainBatch:
        return task_batch(self.context.tokenizer.pad_token_id, self.rows, self.stage.batch,
                          seed=self.context.config.run.seed, step=step).to(self.context.device)

    def draw(self, step: int) -> Draw:
        return Draw([], self._task_batch(step), self._record([]))

    def replay(self, step: int) -> tuple[list, TrainBatch]:
        return [], self._task_batch(step)


class StoredFeed(Feed):
    def begin(self) -> None:
        """Read the stage's groups: of the named runs, or of this run and, for a branch, of
        its parent as it was at the branch step (its rows are read where they are)."""
        context, data = self.context, self.stage.data.stored
        run_ids, until = [context.run_id], {}
        if data.runs:
            run_ids = context.store.aio.run_ids(list(data.runs))
        elif (parent := context.store.runs.parent_of(context.run_id)) is not None:
            run_ids.append(parent[0])
            until[parent[0]] = context.store.ledger.step_time(*parent)
        self.groups = read_stored(context.store.url, run_ids, data, stage=self.stage.name,
                                  seed=context.config.run.seed, until=until)

    def draw(self, step: int) -> Draw:
        ids = self.groups.step_ids(step - self.stage.first_step + 1, self.stage.batch)
        rows = self.context.store.fetch(ids)
        return Draw(rows, self._batch(rows), self._record(ids),
                    metrics={"stored_groups": len(self.groups.groups)})


class PairFeed(Feed):
    def begin(self) -> None:
        context, data = self.context, self.stage.data.preferences
        self.run_ids = (context.store.aio.run_ids(list(data.runs)) if data.runs
                        else [context.run_id])

    def draw(self, step: int) -> Draw | None:
        lease = self._lease()
        if lease is None:
            return None
        context, store = self.context, self.context.store
        rows = self._pair_rows([(p.chosen_id, p.rejected_id) for p in lease.pairs])

        def commit(step: int, metrics: dict) -> None:
            store.commit_pairs(lease, run=context.config.run.name, step=step,
                               policy_version=context.version(), loss=metrics["loss"],
                               metrics=metrics, stage=self.stage.name)
        return Draw(rows, self._batch(rows), commit, lambda: store.release_pairs(lease))

    def _lease(self):
        """Up to `batch` ready pairs; a new epoch over the pairs when all have trained
        (`epochs`); None if a stop came while waiting."""
        store = self.context.store
        return self._wait_for(
            lambda: store.lease_pairs(self.run_ids, pairs=self.stage.batch,
                                      timeout_s=LEASE_POLL_S),
            lambda waited: f"no preference pair of run ids {self.run_ids} became ready in "
            f"{waited} (stage {self.stage.name!r}); write pairs with preference_pair_mapper or "
            "`reservoir review prefer`",
            refill=lambda: self.stage.data.preferences.epochs and store.recycle_pairs(
                self.run_ids))

    def _pair_rows(self, pairs: list[tuple[int, int]]) -> list:
        """The chosen responses, then the rejected ones, pair by pair."""
        by_id = {row.id: row for row in self.context.store.fetch(
            [i for pair in pairs for i in pair])}
        return [by_id[chosen] for chosen, _ in pairs] + [by_id[rejected] for _, rejected in pairs]

    def replay(self, step: int) -> tuple[list, TrainBatch]:
        rows = self._pair_rows(self.context.store.ledger.step_pairs(self.context.run_id, step))
        return rows, self._batch(rows)


FEEDS = {"explorers": ExplorerFeed, "tasks": TaskFeed, "stored": StoredFeed,
         "preferences": PairFeed}


def feed_for(context: Context, stage: Stage) -> Feed:
    feed = FEEDS[stage.data.kind](context, stage)
    feed.begin()
    return feed
