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
warming up) the budget is 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection, func, select

from reservoir.store.sampler import status_in
from reservoir.store.schema import experiences, policy_versions, runs, tasks, train_steps


@dataclass(frozen=True)
class Pace:
    batch_groups: int
    sync_interval: int
    staleness: int
    group_size: int
    steps: int  # the run's last step: nothing is explored beyond what it will train


def _progress(run_id: int):
    """Statement: latest version (-1 before any), last step, waiting rows, live claims."""
    version = (select(func.coalesce(func.max(policy_versions.c.version), -1))
               .where(policy_versions.c.run_id == run_id).scalar_subquery())
    step = (select(func.coalesce(func.max(train_steps.c.step), 0))
            .where(train_steps.c.run_id == run_id).scalar_subquery())
    waiting = (select(func.count()).select_from(experiences)
               .where(experiences.c.run_id == run_id,
                      status_in(experiences.c.status, ("raw", "ready", "leased")))
               .scalar_subquery())
    claimed = (select(func.count()).select_from(tasks)
               .where(tasks.c.run_id == run_id, tasks.c.claim_token.is_not(None),
                      tasks.c.claimed_until > func.now())
               .scalar_subquery())
    return select(version, step, waiting, claimed)


def claim_budget(conn: Connection, run_id: int, pace: Pace) -> tuple[int | None, int]:
    """(latest version, groups explorers may start now); None, 0 before version 0.

    Locks the run's row until the transaction ends, so the budget read is the budget spent.
    """
    conn.execute(select(runs.c.id).where(runs.c.id == run_id).with_for_update())
    version, step, waiting_rows, claimed = conn.execute(_progress(run_id)).one()
    if version < 0:
        return None, 0
    per_version = pace.batch_groups * pace.sync_interval
    waiting = -(-waiting_rows // pace.group_size)  # groups, a partial one counted whole
    allowed = min((version + 1 + pace.staleness) * per_version, pace.steps * pace.batch_groups)
    allowed -= step * pace.batch_groups
    return version, max(0, allowed - waiting - claimed)
