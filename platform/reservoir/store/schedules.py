"""Queries on schedules: cron-scheduled pipelines, and the row lock that runs each one once.

The lock is the schedule's own row (FOR NO KEY UPDATE SKIP LOCKED, so the pipeline runs it
starts may still reference it), held by the scheduler running it until it has advanced the next
due time. Only a login that may update `schedules` can take it, so the reader (which may take
any advisory lock) cannot hold a schedule back."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Iterator

from sqlalchemy import Connection, delete, func, insert, select, update

from reservoir.store.door import Door, reading, writing
from reservoir.store.schema import schedules

def add(conn: Connection, *, name: str, pipeline_file: str, cron: str,
        next_run_at: datetime) -> int:
    return conn.execute(insert(schedules).values(
        name=name, pipeline_file=pipeline_file, cron=cron, next_run_at=next_run_at)
        .returning(schedules.c.id)).scalar_one()


def remove(conn: Connection, name: str) -> bool:
    return conn.execute(delete(schedules).where(schedules.c.name == name)).rowcount > 0


def listed(conn: Connection) -> list[dict[str, Any]]:
    """Every schedule, its name as `schedule` (as analytics.schedules calls it)."""
    return [{**row, "schedule": row["name"]} for row in conn.execute(
        select(schedules).order_by(schedules.c.name)).mappings()]


def due(conn: Connection) -> list[dict[str, Any]]:
    stmt = (select(schedules).where(schedules.c.enabled, schedules.c.next_run_at <= func.now())
            .order_by(schedules.c.next_run_at))
    return [dict(row) for row in conn.execute(stmt).mappings()]


def lock_if_due(conn: Connection, schedule_id: int) -> dict[str, Any] | None:
    """Lock the schedule's row if it is still due and no other scheduler holds it; the row, or
    None. The lock lasts until the caller's transaction ends."""
    row = conn.execute(select(schedules)
                       .where(schedules.c.id == schedule_id,
                              schedules.c.next_run_at <= func.now())
                       .with_for_update(skip_locked=True, key_share=True)).mappings().first()
    return dict(row) if row is not None else None


def advance(conn: Connection, schedule_id: int, *, next_run_at: datetime, missed: int) -> None:
    conn.execute(update(schedules).where(schedules.c.id == schedule_id).values(
        last_run_at=func.now(), next_run_at=next_run_at,
        missed_runs=schedules.c.missed_runs + missed))


@dataclass(frozen=True)
class Held:
    """A due schedule whose row this scheduler holds (`schedule`: the row) until the block of
    `Schedules.held_if_due` ends."""

    schedule: dict[str, Any]
    _conn: Connection

    def advance(self, *, next_run_at: datetime, missed: int) -> None:
        """The next due time, and `missed` due times counted; commits when the block ends."""
        advance(self._conn, self.schedule["id"], next_run_at=next_run_at, missed=missed)


class Schedules(Door):
    """`store.schedules`: pipelines run on a cron schedule."""

    listed = reading(listed)
    due = reading(due)
    add = writing(add)
    remove = writing(remove)

    @contextlib.contextmanager
    def held_if_due(self, schedule_id: int) -> Iterator[Held | None]:
        """The schedule held for the block if it is still due and no other scheduler holds it
        (None: nothing to run). Its row stays locked until the block ends, so the pipeline
        run inside and `Held.advance` happen once per due time; the advance commits when the
        block ends, and an exception out of the block rolls it back."""
        with self.engine.begin() as conn:
            row = lock_if_due(conn, schedule_id)
            yield None if row is None else Held(row, conn)
