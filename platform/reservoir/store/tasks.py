"""Queries on tasks: the prompts explorers work on, and the claims explorer workers hold.

A worker claims tasks (a token, its name, an expiry), explores them, and writes their groups
with the claims finished in the same transaction (`finishing`: each task counted as explored
once more): a group is written exactly when its task is counted. A claim that expired and
went to another worker meanwhile fails the whole write, so a task is never explored twice for
one count. A worker that dies leaves claims that expire; the tasks are claimed again, least
explored first.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any, Iterable

from sqlalchemy import Connection, func, insert, literal, or_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from reservoir.store.door import Door, reading, writing
from reservoir.errors import ClaimLost
from reservoir.store.pace import Pace, claim_budget
from reservoir.store.schema import tasks

Claimed = tuple[int, str, str | None, dict]  # id, prompt, answer, payload


def add_tasks(conn: Connection, run_id: int, rows: Iterable[dict[str, Any]]) -> list[int]:
    """Insert tasks (keys: prompt, answer, payload, source, split) and return their ids in order."""
    values = [dict(run_id=run_id, **row) for row in rows]
    if not values:
        return []
    return list(conn.execute(insert(tasks).returning(tasks.c.id, sort_by_parameter_order=True),
                             values).scalars())


COPIED = ("prompt", "answer", "payload", "source", "split", "difficulty", "priority",
          "times_explored")


def copy_tasks(conn: Connection, source_run_id: int, run_id: int) -> int:
    """Give `run_id` a copy of another run's tasks (a branch), with how often each was
    explored; returns how many."""
    columns = [tasks.c[name] for name in COPIED]
    chosen = (select(literal(run_id), *columns).where(tasks.c.run_id == source_run_id)
              .order_by(tasks.c.id))
    return conn.execute(insert(tasks).from_select(["run_id", *COPIED], chosen)).rowcount


def claim_tasks(conn: Connection, run_id: int, want: int, *, token: uuid.UUID, worker: str,
                seconds: float) -> list[Claimed]:
    """Claim up to `want` unclaimed (or expired) train tasks, least explored first.

    Explorers first read their budget with `pace.claim_budget` in the same transaction: it
    holds the run's row lock, so concurrent workers cannot overshoot it.
    """
    if want <= 0:
        return []
    free = or_(tasks.c.claim_token.is_(None), tasks.c.claimed_until < func.now())
    picked = (select(tasks.c.id)
              .where(tasks.c.run_id == run_id, tasks.c.split == "train", free)
              .order_by(tasks.c.times_explored, tasks.c.id).limit(want)
              .with_for_update(skip_locked=True).cte("picked"))
    stmt = (update(tasks).where(tasks.c.id == picked.c.id)
            .values(claim_token=token, claimed_by=worker,
                    claimed_until=func.now() + timedelta(seconds=seconds))
            .returning(tasks.c.id, tasks.c.prompt, tasks.c.answer, tasks.c.payload))
    return sorted((tuple(row) for row in conn.execute(stmt)), key=lambda row: row[0])


def claim_within_pace(conn: Connection, run_id: int, pace: Pace, *, loaded: int | None,
                      most: int, token: uuid.UUID, worker: str,
                      seconds: float) -> list[Claimed] | None:
    """Claim up to `most` tasks within the run's claim budget (`pace.claim_budget`), only if
    the latest published version is `loaded`, the one the worker holds: None (nothing
    claimed) when a newer one appeared. The budget's run-row lock and the claims commit
    together, so concurrent workers cannot overshoot the budget."""
    version, budget = claim_budget(conn, run_id, pace)
    if version != loaded:
        return None
    return claim_tasks(conn, run_id, min(budget, most), token=token, worker=worker,
                       seconds=seconds)


def finishing(token: uuid.UUID, task_ids: list[int]):
    """What a write of these tasks' groups runs in its transaction (the writer's
    `before_copy`): their claims cleared and each counted explored once more; ClaimLost (and
    nothing of the write) when this token no longer holds every one of them."""
    stmt = (update(tasks).where(tasks.c.id.in_(task_ids), tasks.c.claim_token == token)
            .values(times_explored=tasks.c.times_explored + 1, claim_token=None,
                    claimed_by=None, claimed_until=None))

    async def finish(conn: AsyncConnection) -> None:
        held = (await conn.execute(stmt)).rowcount
        if held != len(set(task_ids)):
            raise ClaimLost(f"{len(set(task_ids)) - held} of {len(set(task_ids))} claimed tasks "
                            "expired and went to another explorer meanwhile; their groups were "
                            "not written (another explorer writes them)")
    return finish


def release_claims(conn: Connection, token: uuid.UUID) -> int:
    """Give back every task this claim token still holds, unexplored."""
    stmt = (update(tasks).where(tasks.c.claim_token == token)
            .values(claim_token=None, claimed_by=None, claimed_until=None))
    return conn.execute(stmt).rowcount


def release_run_claims(conn: Connection, run_id: int) -> int:
    """Give back every claim on the run's tasks, whoever holds it (a colocated run, the only
    explorer of its run, restarting after its process died)."""
    stmt = (update(tasks).where(tasks.c.run_id == run_id, tasks.c.claim_token.is_not(None))
            .values(claim_token=None, claimed_by=None, claimed_until=None))
    return conn.execute(stmt).rowcount


def split_tasks(conn: Connection, run_id: int, split: str) -> list[Claimed]:
    stmt = (select(tasks.c.id, tasks.c.prompt, tasks.c.answer, tasks.c.payload)
            .where(tasks.c.run_id == run_id, tasks.c.split == split).order_by(tasks.c.id))
    return [tuple(row) for row in conn.execute(stmt)]


def mark_explored(conn: Connection, task_ids: list[int], times: int = 1_000_000) -> None:
    """Count tasks as explored at least `times` over, so claiming reaches them last (warm-up
    data); marking them again changes nothing."""
    conn.execute(update(tasks).where(tasks.c.id.in_(task_ids))
                 .values(times_explored=func.greatest(tasks.c.times_explored, times)))


def sft_tasks(conn: Connection, run_id: int, fraction: float) -> list[Claimed]:
    """The first `fraction` of the run's train tasks (at least one, if any), in id order:
    what a stage on tasks trains on."""
    train = split_tasks(conn, run_id, "train")
    return train[:max(1, int(len(train) * fraction))]


def mark_sft_tasks(conn: Connection, run_id: int, fraction: float) -> list[Claimed]:
    """`sft_tasks`, marked explored in the same transaction (claiming reaches them last)."""
    seen = sft_tasks(conn, run_id, fraction)
    mark_explored(conn, [task_id for task_id, *_ in seen])
    return seen


class Tasks(Door):
    """`store.tasks`: a run's tasks and the explorers' claims on them."""

    split_tasks = reading(split_tasks)
    sft_tasks = reading(sft_tasks)
    add_tasks = writing(add_tasks)
    claim_within_pace = writing(claim_within_pace)
    release_claims = writing(release_claims)
    release_run_claims = writing(release_run_claims)
    mark_sft_tasks = writing(mark_sft_tasks)
