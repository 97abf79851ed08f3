"""How far explorers may run ahead of the trainer: the claim budget.

The trainer consumes `batch_groups` groups per step and publishes a policy version every
`sync_interval` steps, so one version trains on `per_version = batch_groups * sync_interval`
groups. With the latest version L published and T steps committed, explorers may have groups
waiting (raw, ready or leased) or being explored (claimed tasks) up to

    (L + 1 + staleness) * per_version - T * batch_groups

With staleness 0 (sync mode) explorers make exactly one version's worth of groups with version
L, then wait for L + 1: on-policy. With staleness s (async mode) they run at most s versions
ahead, so no group is trained more than s versions after the policy that made it. Nothing is
explored beyond the run's last step, and before version 0 is published (the trainer is still
warming up) the budget is 0. Waiting groups too stale for the next lease (a slow explorer's,
overtaken by a faster one's) are not counted: they would hold the budget forever.

A run of several stages (trainer/stages.py) counts the same way inside each stage that trains
on explorers, from the stage's first step and the version published just before it; while a
stage that reads other data trains, the budget is 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import BigInteger, Connection, Integer, bindparam, func, select

from reservoir.store.sampler import status_in
from reservoir.store.schema import experience_state as state
from reservoir.store.schema import policy_versions, runs, tasks, train_steps


@dataclass(frozen=True)
class Pace:
    batch_groups: int
    sync_interval: int
    staleness: int
    group_size: int
    steps: int  # the run's last step: nothing is explored beyond what it will train
    # (first step, last step, groups per step) of each stage that trains on explorers'
    # groups; None: one such stage, steps 1 .. steps of batch_groups
    explorer_stages: tuple[tuple[int, int, int], ...] | None = None

    def stage_after(self, step: int) -> tuple[int, int, int] | None:
        """The explorer stage that trains step + 1, if one does."""
        for first, last, batch in self.explorer_stages or ((1, self.steps, self.batch_groups),):
            if first <= step + 1 <= last:
                return first, last, batch
        return None


def _progress():
    """Statement: last step and live claims of the run :run_id."""
    run_id = bindparam("run_id", type_=BigInteger)
    step = (select(func.coalesce(func.max(train_steps.c.step), 0))
            .where(train_steps.c.run_id == run_id).scalar_subquery())
    claimed = (select(func.count()).select_from(tasks)
               .where(tasks.c.run_id == run_id, tasks.c.claim_token.is_not(None),
                      tasks.c.claimed_until > func.now())
               .scalar_subquery())
    return select(step, claimed)


def _versions():
    """Statement: the latest version of the run :run_id (-1 before any), the stage's first
    version (published after the step :before_first, the one before the stage's first; -1
    until the trainer publishes it), and the rows waiting that the next lease can still take:
    made by the stage's first version or a later one, and no staler than :staleness (older
    ones never train, so they hold no budget)."""
    run_id = bindparam("run_id", type_=BigInteger)
    latest = (select(func.coalesce(func.max(policy_versions.c.version), -1))
              .where(policy_versions.c.run_id == run_id).scalar_subquery())
    start = (select(func.coalesce(func.max(policy_versions.c.version), -1))
             .where(policy_versions.c.run_id == run_id,
                    policy_versions.c.train_step == bindparam("before_first", type_=Integer))
             .scalar_subquery())
    waiting = (select(func.count()).select_from(state)
               .where(state.c.run_id == run_id,
                      status_in(state.c.status, ("raw", "ready", "leased")),
                      state.c.policy_version >= func.greatest(
                          start, latest - bindparam("staleness", type_=Integer)))
               .scalar_subquery())
    return select(latest, start, waiting)


# built once: a claim runs them every round (building one took ~0.3 ms of the client's time)
LOCK_RUN = select(runs.c.id).where(runs.c.id == bindparam("run_id", type_=BigInteger)) \
    .with_for_update()
PROGRESS, VERSIONS = _progress(), _versions()


def claim_budget(conn: Connection, run_id: int, pace: Pace) -> tuple[int | None, int]:
    """(latest version, groups explorers may start now); None, 0 before version 0, and 0
    while the step being trained is not in an explorer stage.

    Locks the run's row until the transaction ends, so the budget read is the budget spent.
    Within a stage that starts at step F with version V0 (published before step F),
    `version` and `step` count from the stage's start: (L - V0 + 1 + staleness) versions'
    worth of groups, minus the groups its steps took, the groups waiting and the claims.
    """
    conn.execute(LOCK_RUN, {"run_id": run_id})
    step, claimed = conn.execute(PROGRESS, {"run_id": run_id}).one()
    stage = pace.stage_after(step)
    first = stage[0] if stage is not None else step + 1
    version, start, waiting_rows = conn.execute(VERSIONS, {
        "run_id": run_id, "before_first": first - 1, "staleness": pace.staleness}).one()
    if version < 0:
        return None, 0
    if stage is None or start < 0:
        return version, 0
    first, last, batch = stage
    per_version = batch * pace.sync_interval
    waiting = -(-waiting_rows // pace.group_size)  # groups, a partial one counted whole
    allowed = min((version - start + 1 + pace.staleness) * per_version,
                  (last - first + 1) * batch)
    allowed -= (step - first + 1) * batch
    return version, max(0, allowed - waiting - claimed)
