"""Queries on tasks: the prompts explorers work on."""

from __future__ import annotations

from typing import Any, Iterable

from sqlalchemy import Connection, insert, select, update

from reservoir.store.schema import tasks


def add_tasks(conn: Connection, run_id: int, rows: Iterable[dict[str, Any]]) -> list[int]:
    """Insert tasks (keys: prompt, answer, payload, source, split) and return their ids in order."""
    values = [dict(run_id=run_id, **row) for row in rows]
    if not values:
        return []
    return list(conn.execute(insert(tasks).returning(tasks.c.id, sort_by_parameter_order=True),
                             values).scalars())


def claim_train_tasks(conn: Connection, run_id: int, n: int) -> list[tuple[int, str, str | None]]:
    """The n least-explored train tasks (id, prompt, answer), counted as explored once more."""
    picked = (select(tasks.c.id).where(tasks.c.run_id == run_id, tasks.c.split == "train")
              .order_by(tasks.c.times_explored, tasks.c.id).limit(n)
              .with_for_update(skip_locked=True).cte("picked"))
    stmt = (update(tasks).where(tasks.c.id == picked.c.id)
            .values(times_explored=tasks.c.times_explored + 1)
            .returning(tasks.c.id, tasks.c.prompt, tasks.c.answer))
    return sorted(tuple(row) for row in conn.execute(stmt))


def split_tasks(conn: Connection, run_id: int, split: str) -> list[tuple[int, str, str | None]]:
    stmt = (select(tasks.c.id, tasks.c.prompt, tasks.c.answer)
            .where(tasks.c.run_id == run_id, tasks.c.split == split).order_by(tasks.c.id))
    return [tuple(row) for row in conn.execute(stmt)]


def mark_explored(conn: Connection, task_ids: list[int], times: int = 1_000_000) -> None:
    """Count tasks as explored `times` over, so claiming reaches them last (warm-up data)."""
    conn.execute(update(tasks).where(tasks.c.id.in_(task_ids))
                 .values(times_explored=tasks.c.times_explored + times))
