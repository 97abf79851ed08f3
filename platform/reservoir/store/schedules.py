"""Queries on schedules: cron-scheduled pipelines, and the lock that runs each one once."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Connection, delete, func, insert, select, update

from reservoir.store.schema import schedules

SCHEDULE_LOCK = 7_146_002  # advisory lock class: (SCHEDULE_LOCK, schedule id)


def add(conn: Connection, *, name: str, pipeline_file: str, cron: str,
        next_run_at: datetime) -> int:
    return conn.execute(insert(schedules).values(
        name=name, pipeline_file=pipeline_file, cron=cron, next_run_at=next_run_at)
        .returning(schedules.c.id)).scalar_one()


def remove(conn: Connection, name: str) -> bool:
    return conn.execute(delete(schedules).where(schedules.c.name == name)).rowcount > 0


def listed(conn: Connection) -> list[dict[str, Any]]:
    return [dict(row) for row in conn.execute(select(schedules).order_by(schedules.c.name))
            .mappings()]


def due(conn: Connection) -> list[dict[str, Any]]:
    stmt = (select(schedules).where(schedules.c.enabled, schedules.c.next_run_at <= func.now())
            .order_by(schedules.c.next_run_at))
    return [dict(row) for row in conn.execute(stmt).mappings()]


def still_due(conn: Connection, schedule_id: int) -> dict[str, Any] | None:
    row = conn.execute(select(schedules).where(schedules.c.id == schedule_id,
                                               schedules.c.next_run_at <= func.now())).mappings()
    return next(iter(row), None)


def try_lock(conn: Connection, schedule_id: int) -> bool:
    """A session lock on one schedule: only the scheduler holding it runs the pipeline."""
    return conn.execute(select(func.pg_try_advisory_lock(SCHEDULE_LOCK, schedule_id))).scalar()


def unlock(conn: Connection, schedule_id: int) -> None:
    conn.execute(select(func.pg_advisory_unlock(SCHEDULE_LOCK, schedule_id)))


def advance(conn: Connection, schedule_id: int, *, next_run_at: datetime, missed: int) -> None:
    conn.execute(update(schedules).where(schedules.c.id == schedule_id).values(
        last_run_at=func.now(), next_run_at=next_run_at,
        missed_runs=schedules.c.missed_runs + missed))
