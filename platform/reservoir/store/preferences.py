"""The preference pool: chosen / rejected pairs of experiences, leased and committed like
experiences (sampler.py, ledger.py), for DPO.

A pair is two experiences of one run and one task; it is stored once (chosen_id, rejected_id).
Its status goes ready -> leased -> consumed (a commit) or back to ready (a release, or a lease
that expired and was reclaimed by the next lease call): the experiences' lease machinery
(leasing.py), with a pair's own picking (oldest first) and epochs (recycle_pairs). A step's
commit is the ledger's (`ledger.commit_pairs`): its train_steps row, one batch_pairs row per
pair and one batch_items row per experience (weight +1 chosen, -1 rejected; an experience on
both sides of a step's pairs gets their sum) in one statement.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import NamedTuple, Sequence

from sqlalchemy import (BigInteger, Connection, Integer, bindparam, exists, func, literal_column,
                        select, update)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncEngine

from reservoir.errors import FlowControlTimeout, StoreError
from reservoir.store import leasing
from reservoir.store.schema import experiences, preferences


class Pair(NamedTuple):
    """A verdict to store: `chosen_id`'s response is preferred to `rejected_id`'s."""

    chosen_id: int
    rejected_id: int
    margin: float | None = None
    source: str | None = None


@dataclass(frozen=True, slots=True)
class LeasedPair:
    id: int
    run_id: int
    task_id: int | None
    chosen_id: int
    rejected_id: int
    margin: float | None
    times_sampled: int


@dataclass(frozen=True)
class PairLease:
    token: uuid.UUID
    run_ids: tuple[int, ...]
    pairs: tuple[LeasedPair, ...]
    leased_until: datetime

    @property
    def ids(self) -> list[int]:
        return [pair.id for pair in self.pairs]

    @property
    def experience_ids(self) -> list[int]:
        """Every experience the lease's pairs name, chosen or rejected, in id order."""
        return sorted({i for pair in self.pairs for i in (pair.chosen_id, pair.rejected_id)})


def _pair(value: Sequence) -> Pair:
    """A Pair from a Pair or a plain (chosen_id, rejected_id[, margin[, source]]) tuple."""
    chosen, rejected, margin, source = Pair(*value)
    return Pair(int(chosen), int(rejected), None if margin is None else float(margin), source)


def _run_and_task(conn: Connection, pairs: Sequence[Pair]) -> dict[int, tuple]:
    """{experience id: (run_id, task_id)}; StoreError if a pair names an unknown
    experience, one experience twice, or two responses that answer different prompts: of
    different runs, or neither of one group nor of one task (served rows have no task)."""
    ids = {i for pair in pairs for i in pair[:2]}
    rows = {row.id: row for row in conn.execute(
        select(experiences.c.id, experiences.c.run_id, experiences.c.task_id,
               experiences.c.group_id).where(experiences.c.id.in_(ids)))}
    found = {i: (row.run_id, row.task_id) for i, row in rows.items()}
    for pair in pairs:
        missing = [i for i in pair[:2] if i not in found]
        if missing:
            raise StoreError(f"pair ({pair.chosen_id}, {pair.rejected_id}): experience "
                             f"{missing[0]} does not exist; no pair was added")
        if pair.chosen_id == pair.rejected_id:
            raise StoreError(f"pair ({pair.chosen_id}, {pair.rejected_id}): an experience "
                             "cannot be preferred to itself; no pair was added")
        chosen, rejected = rows[pair.chosen_id], rows[pair.rejected_id]
        one_prompt = chosen.run_id == rejected.run_id and (
            chosen.group_id == rejected.group_id
            or (chosen.task_id is not None and chosen.task_id == rejected.task_id))
        if not one_prompt:
            raise StoreError(
                f"pair ({pair.chosen_id}, {pair.rejected_id}): a pair compares two responses to "
                f"one prompt, of one group or one task (run {chosen.run_id} task "
                f"{chosen.task_id} vs run {rejected.run_id} task {rejected.task_id}, other "
                "groups); no pair was added")
    return found


def insert_pairs(conn: Connection, pairs: Sequence[Pair]) -> dict[tuple[int, int], int]:
    """Store pairs (in the caller's transaction), each in its chosen experience's run and task,
    `ready`; pairs already stored are skipped. Returns {(chosen_id, rejected_id): preference
    id} of those added. StoreError (nothing added) if an id is unknown or the two experiences
    of a pair belong to different runs or tasks."""
    pairs = [_pair(p) for p in pairs]
    if not pairs:
        return {}
    found = _run_and_task(conn, pairs)
    rows = [{**p._asdict(), "run_id": found[p.chosen_id][0],
             "task_id": found[p.chosen_id][1]} for p in pairs]
    stmt = (pg_insert(preferences).values(rows)
            .on_conflict_do_nothing(constraint="preferences_pair")
            .returning(preferences.c.chosen_id, preferences.c.rejected_id, preferences.c.id))
    return {(row.chosen_id, row.rejected_id): row.id for row in conn.execute(stmt)}


def add_pairs(conn: Connection, pairs: Sequence[Pair]) -> int:
    """Store pairs (see insert_pairs); returns how many were added."""
    return len(insert_pairs(conn, pairs))


RECLAIM_LIMIT = 10_000  # expired pairs a lease call hands back

_f = preferences
# Expired leases go back to ready, whichever run holds them (the oldest first).
RECLAIM_PAIRS = leasing.given_back(_f, leasing.expired(_f, limit=RECLAIM_LIMIT), "ready")
# A lease's pairs go back to ready.
RELEASE_PAIRS = leasing.given_back(_f, leasing.of_token(_f), "ready")
_RUN_IDS = bindparam("run_ids", type_=ARRAY(BigInteger))
_OF_RUNS = _f.c.run_id == func.any(_RUN_IDS)
# Up to :n ready pairs of the runs, oldest first, become leased under :token until
# now + :lease_for.
LEASE_PAIRS = leasing.taken(_f, _f.c.id == leasing.any_of(
    select(_f.c.id).where(_OF_RUNS, _f.c.status == literal_column("'ready'"))
    .order_by(_f.c.id).limit(bindparam("n", type_=Integer)).with_for_update(skip_locked=True))
).returning(_f.c.id, _f.c.run_id, _f.c.task_id, _f.c.chosen_id, _f.c.rejected_id, _f.c.margin,
            _f.c.times_sampled, _f.c.leased_until)


async def lease_pairs(engine: AsyncEngine, run_ids: Sequence[int], *, pairs: int,
                      lease_seconds: float, timeout_s: float,
                      poll_interval_s: float = 0.05) -> PairLease:
    """Lease up to `pairs` ready pairs of the runs (oldest first), reclaiming expired leases
    first; waits up to timeout_s while none is ready, then raises FlowControlTimeout."""
    if pairs < 1:
        raise StoreError(f"lease_pairs: pairs={pairs}; lease at least 1")
    deadline = time.monotonic() + timeout_s
    params = dict(run_ids=list(run_ids), n=pairs, lease_for=timedelta(seconds=lease_seconds))
    while True:
        token = uuid.uuid4()
        async with engine.begin() as conn:
            await conn.execute(RECLAIM_PAIRS)
            leased = (await conn.execute(LEASE_PAIRS, {**params, "token": token})).all()
        if leased:
            leased.sort(key=lambda row: row.id)
            return PairLease(token, tuple(run_ids), tuple(LeasedPair(*row[:-1]) for row in leased),
                             leased[0].leased_until)
        if time.monotonic() >= deadline:
            raise FlowControlTimeout(f"waited {timeout_s:g}s for a lease of {pairs} preference "
                                     f"pairs of run ids {list(run_ids)}: none is ready")
        await asyncio.sleep(poll_interval_s)


# Every pair of the runs has trained and none is ready or leased: all become ready again (the
# next epoch over them).
_open = _f.alias("open")
RECYCLE_PAIRS = update(_f).where(
    _OF_RUNS, _f.c.status == "consumed",
    ~exists().where(_open.c.run_id == func.any(_RUN_IDS),
                    _open.c.status.in_(["ready", "leased"]))).values(status="ready")


async def recycle_pairs(engine: AsyncEngine, run_ids: Sequence[int]) -> int:
    """Start another epoch over the runs' pairs once all have trained; returns how many."""
    async with engine.begin() as conn:
        return (await conn.execute(RECYCLE_PAIRS, {"run_ids": list(run_ids)})).rowcount


async def release_pairs(engine: AsyncEngine, lease: PairLease) -> int:
    """Hand a lease's pairs back to ready; returns how many it still held."""
    async with engine.begin() as conn:
        return (await conn.execute(RELEASE_PAIRS, {"token": lease.token})).rowcount
