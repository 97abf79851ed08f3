"""Queries on tasks: the prompts explorers work on."""

from __future__ import annotations

from typing import Any, Iterable

from sqlalchemy import Connection, insert

from reservoir.store.schema import tasks


def add_tasks(conn: Connection, run_id: int, rows: Iterable[dict[str, Any]]) -> list[int]:
    """Insert tasks (keys: prompt, answer, payload, source, split) and return their ids in order."""
    values = [dict(run_id=run_id, **row) for row in rows]
    if not values:
        return []
    return list(conn.execute(insert(tasks).returning(tasks.c.id, sort_by_parameter_order=True),
                             values).scalars())
