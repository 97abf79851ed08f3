"""Which server each run lives on when `store.urls` names several (run_servers, read on the
first server): a run is placed once, when it is created, and every command that reaches it
reads where."""

from __future__ import annotations

from typing import Any, Sequence

from sqlalchemy import Connection, delete, func, insert, select

from reservoir.store.door import Door, reading, writing
from reservoir.store.schema import run_servers as t


def server_of(conn: Connection, run: str) -> str | None:
    """The server (host:port/database) the run was placed on; None before it is placed."""
    return conn.execute(select(t.c.server).where(t.c.run_name == run)).scalar()


def place(conn: Connection, run: str, servers: Sequence[str], demand: float,
          server: str | None = None, finished: Sequence[str] = ()) -> str:
    """The run's server: where it was placed before, else `server` (run.store), else the one of
    `servers` whose placed runs, but the `finished` ones, declare the least demand (the
    earlier one on a tie), recorded. Placements wait for each other (a transaction-scoped
    advisory lock), so two runs created at once each see the other's demand."""
    conn.execute(select(func.pg_advisory_xact_lock(func.hashtextextended(t.name, 0))))
    placed = server_of(conn, run)
    if placed is not None:
        return placed
    if server is None:
        load = dict(conn.execute(
            select(t.c.server, func.sum(t.c.demand))
            .where(t.c.server.in_(servers), t.c.run_name.not_in(list(finished)))
            .group_by(t.c.server)).all())
        server = min(servers, key=lambda name: load.get(name, 0.0))
    conn.execute(insert(t).values(run_name=run, server=server, demand=demand))
    return server


def listed(conn: Connection) -> list[dict[str, Any]]:
    """Every placement: run, server, demand, placed_at (by server, then run)."""
    rows = conn.execute(select(t.c.run_name.label("run"), t.c.server, t.c.demand, t.c.placed_at)
                        .order_by(t.c.server, t.c.run_name))
    return [dict(row._mapping) for row in rows]


def remove(conn: Connection, run: str) -> bool:
    """Forget where the run lived (it was archived or deleted); whether it was placed."""
    return conn.execute(delete(t).where(t.c.run_name == run)).rowcount > 0


class RunServers(Door):
    """`store.run_servers`: where each run lives when the store spans several servers."""

    server_of = reading(server_of)
    place = writing(place)
    listed = reading(listed)
    remove = writing(remove)
