"""Explorer rounds (explorer_rounds): one row a round, written with the round's groups.

`recording(round)` is what an explorer's write of its groups runs in its transaction (the
writer's `before_copy`, beside the claims' `finishing`), so a round is a row exactly when its
groups are. `per_window` sums a run's rounds between consecutive times (the train steps'
commits): what trackers log as the explorers' rates at each step.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import asdict, dataclass

from sqlalchemy import Connection, DateTime, bindparam, func, insert, select
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncConnection

from reservoir.store.door import Door, reading
from reservoir.store.schema import explorer_rounds as x


@dataclass(frozen=True)
class Round:
    run_id: int
    worker: str
    policy_version: int
    groups: int
    experiences: int
    response_tokens: int
    generate_s: float
    update_s: float | None  # the in-place weight update it waited for, if one


def recording(round_: Round):
    """The round's row, as a write's `before_copy`."""
    stmt = insert(x).values(**asdict(round_))

    async def record(conn: AsyncConnection) -> None:
        await conn.execute(stmt)
    return record


@dataclass(frozen=True)
class Window:
    """The rounds that finished in one window."""

    rounds: int
    experiences: int
    response_tokens: int
    generate_s: float
    update_s_max: float | None
    update_s_mean: float | None


def per_window(conn: Connection, run_id: int, bounds: list[dt.datetime]) -> dict[int, Window]:
    """{i: the run's rounds that finished in [bounds[i-1], bounds[i])} for i in 1..len-1
    (windows without a round are left out)."""
    if len(bounds) < 2:
        return {}
    edges = bindparam("edges", bounds, type_=ARRAY(DateTime(timezone=True)))
    window = func.width_bucket(x.c.finished_at, edges).label("window")
    rows = conn.execute(
        select(window, func.count(), func.sum(x.c.experiences), func.sum(x.c.response_tokens),
               func.sum(x.c.generate_s), func.max(x.c.update_s), func.avg(x.c.update_s))
        .where(x.c.run_id == run_id, x.c.finished_at >= bounds[0],
               x.c.finished_at < bounds[-1])
        .group_by(window))
    return {index: Window(count, int(experiences), int(tokens), float(seconds),
                          most, mean)
            for index, count, experiences, tokens, seconds, most, mean in rows}


class Rounds(Door):
    """`store.rounds`: the explorer rounds of each run."""

    per_window = reading(per_window)
