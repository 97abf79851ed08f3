"""Queries on tasks: the prompts explorers work on, and the claims explorer workers hold.

A worker claims tasks (a token, its name, an expiry), explores them, and writes their groups
with the claims finished in the same transaction (`finishing`: each task counted as explored
once more): a group is written exactly when its task is counted. A claim that expired and
went to another worker meanwhile fails the whole write, so a task is never explored twice for
one count. A worker that dies leaves claims that expire; the tasks are claimed again, least
explored first.
"""

from __future__ import annotations

import functools
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Iterable

from sqlalchemy import (BigInteger, Connection, Integer, Interval, bindparam, func, insert,
                        literal, literal_column, or_, select, union_all, update)
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


@dataclass(frozen=True)
class TaskOrder:
    """The order explorers claim a run's active train tasks in (explorer.task_order).

    least_explored: fewest explorations first. priority: highest priority first (then least
    explored). difficulty_band: tasks whose pass rate (1 - difficulty) lies in `band` first,
    unmeasured ones (no difficulty yet) next, the rest last; least explored first within each.
    Each part is read through an index on active tasks (tasks_claim_*).
    """

    kind: str = "least_explored"
    band: tuple[float, float] = (0.1, 0.9)


def _claimable(*where):
    """Select: the ids of the run :of_run's active train tasks no live claim holds."""
    free = or_(tasks.c.claim_token.is_(None), tasks.c.claimed_until < func.now())
    return (select(tasks.c.id).where(tasks.c.run_id == bindparam("of_run", type_=BigInteger),
                                     tasks.c.split == "train",
                                     tasks.c.status == literal_column("'active'"), free, *where))


def _picked(order: TaskOrder):
    """Select: the ids of up to :want claimable tasks in the order, locked, skipping tasks
    another claim holds."""
    least = (tasks.c.times_explored, tasks.c.id)
    want = bindparam("want", type_=Integer)
    if order.kind == "least_explored":
        return _claimable().order_by(*least).limit(want).with_for_update(skip_locked=True)
    if order.kind == "priority":
        return (_claimable().order_by(tasks.c.priority.desc(), *least).limit(want)
                .with_for_update(skip_locked=True))
    low, high = 1 - order.band[1], 1 - order.band[0]  # a pass rate band as difficulties
    parts = [_claimable(tasks.c.difficulty.between(low, high)),
             _claimable(tasks.c.difficulty.is_(None)),
             _claimable(or_(tasks.c.difficulty < low, tasks.c.difficulty > high))]
    ranked = union_all(*(part.add_columns(literal(rank).label("part"), *least)
                         .order_by(*least).limit(want).subquery().select()
                         for rank, part in enumerate(parts))).subquery("ranked")
    chosen = select(ranked.c.id).order_by(ranked.c.part, ranked.c.times_explored,
                                          ranked.c.id).limit(want)
    return (select(tasks.c.id).where(tasks.c.id.in_(chosen))
            .with_for_update(skip_locked=True))


@functools.lru_cache(maxsize=16)
def _claim_statement(order: TaskOrder):
    """Statement: up to :want tasks of the run :of_run in `order` claimed for :token by
    :worker for :claim_for; built once an order (an explorer claims every round)."""
    picked = _picked(order).cte("picked")
    return (update(tasks).where(tasks.c.id == picked.c.id)
            .values(claim_token=bindparam("token", type_=tasks.c.claim_token.type),
                    claimed_by=bindparam("worker", type_=tasks.c.claimed_by.type),
                    claimed_until=func.now() + bindparam("claim_for", type_=Interval))
            .returning(tasks.c.id, tasks.c.prompt, tasks.c.answer, tasks.c.payload))


def claim_tasks(conn: Connection, run_id: int, want: int, *, token: uuid.UUID, worker: str,
                seconds: float, order: TaskOrder = TaskOrder()) -> list[Claimed]:
    """Claim up to `want` unclaimed (or expired) active train tasks in `order`.

    Explorers first read their budget with `pace.claim_budget` in the same transaction: it
    holds the run's row lock, so concurrent workers cannot overshoot it.
    """
    if want <= 0:
        return []
    rows = conn.execute(_claim_statement(order), {
        "of_run": run_id, "want": want, "token": token, "worker": worker,
        "claim_for": timedelta(seconds=seconds)})
    return sorted((tuple(row) for row in rows), key=lambda row: row[0])


def claim_within_pace(conn: Connection, run_id: int, pace: Pace, *, loaded: int | None,
                      most: int, token: uuid.UUID, worker: str, seconds: float,
                      order: TaskOrder = TaskOrder()) -> list[Claimed] | None:
    """Claim up to `most` tasks within the run's claim budget (`pace.claim_budget`), only if
    the latest published version is `loaded`, the one the worker holds: None (nothing
    claimed) when a newer one appeared. The budget's run-row lock and the claims commit
    together, so concurrent workers cannot overshoot the budget."""
    version, budget = claim_budget(conn, run_id, pace)
    if version != loaded:
        return None
    return claim_tasks(conn, run_id, min(budget, most), token=token, worker=worker,
                       seconds=seconds, order=order)


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
            .where(tasks.c.run_id == run_id, tasks.c.split == split,
                   tasks.c.status == "active").order_by(tasks.c.id))
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


# -- what a task pipeline decides ------------------------------------------------------------

CONTENT = ("prompt", "answer")  # what an explorer saw: rewritten, a used task gets a new version
KEPT = ("run_id", "answer", "payload", "source", "split", "priority")  # a new task's, from its parent


@dataclass
class TaskChanges:
    """Everything a task pipeline run writes back: tasks retired (dropped, not picked, failed
    validation), values changed (prompt, answer, priority, difficulty, metadata), augmented
    children ({parent, prompt, answer?, metadata?}), and the events of changes and scores
    (each with its task_id)."""

    retired: dict[int, dict[str, Any]] = field(default_factory=dict)   # id -> its event
    values: dict[int, dict[str, Any]] = field(default_factory=dict)
    children: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    validations: list[dict[str, Any]] = field(default_factory=list)


def apply_changes(conn: Connection, changes: TaskChanges) -> list[dict[str, Any]]:
    """Write a task pipeline's decisions (in the caller's transaction); returns every event,
    those of the versions and children it made included.

    The tasks it touches are locked first. A task an explorer holds now (an unexpired claim) or
    has explored keeps what the explorer saw: a rewrite of its prompt or answer becomes a new
    task (parent_id, metadata.version_of), and the old one retires. An idle task is updated in
    place. A task already retired stays as it is.
    """
    events = list(changes.events)
    touched = sorted(set(changes.values) | set(changes.retired))
    current = {row.id: row for row in conn.execute(
        select(tasks, (tasks.c.claim_token.is_not(None)
                       & (tasks.c.claimed_until > func.now())).label("claimed"))
        .where(tasks.c.id.in_(touched)).with_for_update(of=tasks)).all()}
    versions = []
    for task_id, values in changes.values.items():
        row = current.get(task_id)
        if row is None or row.status != "active":
            continue
        content = {k: v for k, v in values.items() if k in CONTENT}
        if content and (row.claimed or row.times_explored > 0):
            versions.append((row, values))
            values = {k: v for k, v in values.items() if k not in CONTENT}
        if values:
            conn.execute(update(tasks).where(tasks.c.id == task_id).values(**values))
    retiring = {i: e for i, e in changes.retired.items()
                if i in current and current[i].status == "active"}
    replaced = _versions(conn, versions)
    retiring.update({old: event for old, event, _ in replaced})
    added = [event for _, _, event in replaced] + _children(conn, changes.children, current)
    if retiring:
        conn.execute(update(tasks).where(tasks.c.id.in_(list(retiring)))
                     .values(status="retired", claim_token=None, claimed_by=None,
                             claimed_until=None))
    return events + [retiring[i] for i in sorted(retiring)] + added


def _versions(conn: Connection, versions: list) -> list[tuple[int, dict, dict]]:
    """New tasks holding rewrites of used tasks; (old id, its retirement event, the new task's
    added event) each."""
    made = []
    for row, values in versions:
        new_id = _insert(conn, row, {k: v for k, v in values.items() if k in CONTENT},
                         {"version_of": row.id})
        why = "claimed by an explorer" if row.claimed else f"explored {row.times_explored} times"
        made.append((row.id, _event(row.id, "output", "retired",
                                    f"replaced by task {new_id}: a rewrite of a task {why} is a "
                                    "new version", {"replaced_by": new_id}),
                     _event(new_id, "output", "added", f"new version of task {row.id}",
                            {"version_of": row.id, "fields": sorted(values)})))
    return made


def _children(conn: Connection, children: list[dict], current: dict) -> list[dict]:
    """Augmented tasks, each a copy of its parent with the rewrite (split inherited); their
    added events."""
    parents = {row.id: row for row in conn.execute(select(tasks).where(
        tasks.c.id.in_(sorted({c["parent"] for c in children} - set(current))))).all()}
    parents.update(current)
    made = []
    for child in children:
        parent = parents[child["parent"]]
        new_id = _insert(conn, parent, {k: child[k] for k in CONTENT if k in child},
                         {**child.get("metadata", {}), "augmented_from": parent.id})
        made.append(_event(new_id, "output", "added", f"augmented copy of task {parent.id}",
                           {"parent": parent.id, "changes": child.get("changes", [])}))
    return made


def _insert(conn: Connection, parent, content: dict, noted: dict) -> int:
    values = {name: getattr(parent, name) for name in KEPT}
    values.update(prompt=parent.prompt, parent_id=parent.id,
                  metadata={**(parent.metadata or {}), **noted})
    values.update(content)
    return conn.execute(insert(tasks).values(**values).returning(tasks.c.id)).scalar_one()


def _event(task_id: int, operator: str, kind: str, reason: str, stats: dict) -> dict:
    return {"task_id": task_id, "operator": operator, "kind": kind, "reason": reason,
            "stats": stats}


class Tasks(Door):
    """`store.tasks`: a run's tasks and the explorers' claims on them."""

    split_tasks = reading(split_tasks)
    sft_tasks = reading(sft_tasks)
    add_tasks = writing(add_tasks)
    claim_within_pace = writing(claim_within_pace)
    release_claims = writing(release_claims)
    release_run_claims = writing(release_run_claims)
    mark_sft_tasks = writing(mark_sft_tasks)
