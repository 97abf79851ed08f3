"""Where each experiment tracker that follows a run has got to (run_trackers)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

from sqlalchemy import Connection, func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert

from reservoir.store.door import Door, reading, writing
from reservoir.store.schema import run_trackers as t


class TrackerState(NamedTuple):
    external_id: str | None
    last_step: int


def state_of(conn: Connection, run_id: int, tracker: str, destination: str) -> TrackerState:
    """The tracker's own run id and the last step it logged (None, -1 before any)."""
    row = conn.execute(select(t.c.external_id, t.c.last_step).where(
        t.c.run_id == run_id, t.c.tracker == tracker, t.c.destination == destination)).first()
    return TrackerState(*row) if row else TrackerState(None, -1)


def save_state(conn: Connection, run_id: int, tracker: str, destination: str,
               external_id: str | None, last_step: int) -> None:
    """Record the tracker's run id and that it logged every step up to `last_step`."""
    values = dict(run_id=run_id, tracker=tracker, destination=destination,
                  external_id=external_id, last_step=last_step)
    conn.execute(pg_insert(t).values(**values).on_conflict_do_update(
        index_elements=[t.c.run_id, t.c.tracker, t.c.destination],
        set_={"external_id": external_id, "last_step": last_step, "updated_at": func.now()}))


def _following_key(run_id: int):
    """The advisory lock's key: the run's, in a space of the trackers' own."""
    return func.hashtextextended("reservoir.trackers", run_id)


class Trackers(Door):
    """`store.trackers`: the experiment trackers following each run."""

    @contextlib.contextmanager
    def following(self, run_id: int) -> Iterator[None]:
        """Held while one process logs a run's trackers (a session advisory lock on a
        connection of its own): another (a resumed run's, `reservoir runs track`) waits until
        the first is done, so no step is logged by both; a process that dies lets go."""
        with self.engine.connect() as conn:
            conn.execute(select(func.pg_advisory_lock(_following_key(run_id))))
            conn.commit()
            try:
                yield
            finally:
                conn.execute(select(func.pg_advisory_unlock(_following_key(run_id))))
                conn.commit()

    state_of = reading(state_of)
    save_state = writing(save_state)
