"""The preference pool: chosen / rejected pairs of experiences, leased and committed like
experiences (sampler.py, ledger.py), for DPO.

A pair is two experiences of one run and one task; it is stored once (chosen_id, rejected_id).
Its status goes ready -> leased -> consumed (a commit) or back to ready (a release, or a lease
that expired and was reclaimed by the next lease call). A step's commit is the ledger's
(`ledger.commit_pairs`): its train_steps row, one batch_pairs row per pair and one batch_items
row per experience (weight +1 chosen, -1 rejected; an experience on both sides of a step's pairs
gets their sum) in one statement.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import NamedTuple, Sequence

from sqlalchemy import BigInteger, Connection, bindparam, select, text
from sqlalchemy.dialects.postgresql import ARRAY, UUID
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncEngine

from reservoir.errors import FlowControlTimeout, StoreError
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


# Expired leases go back to ready, whichever run holds them (the oldest first; rows another
# lease call is reclaiming are skipped).
RECLAIM_PAIRS = text("""
UPDATE preferences SET status = 'ready', lease_token = NULL, leased_until = NULL
WHERE id IN (
    SELECT id FROM preferences WHERE status = 'leased' AND leased_until < now()
    ORDER BY leased_until FOR UPDATE SKIP LOCKED
)""")

# Up to :n ready pairs of the runs, oldest first, become leased under :token until now + :lease_for.
LEASE_PAIRS = text("""
WITH picked AS (
    SELECT id FROM preferences
    WHERE run_id = ANY(:run_ids) AND status = 'ready'
    ORDER BY id LIMIT :n FOR UPDATE SKIP LOCKED
)
UPDATE preferences f
SET status = 'leased', lease_token = :token, leased_until = now() + :lease_for
FROM picked WHERE f.id = picked.id
RETURNING f.id, f.run_id, f.task_id, f.chosen_id, f.rejected_id, f.margin, f.times_sampled,
          f.leased_until
""").bindparams(bindparam("run_ids", type_=ARRAY(BigInteger)),
                bindparam("token", type_=UUID(as_uuid=True)))

# A lease's pairs go back to ready.
RELEASE_PAIRS = text("""
UPDATE preferences SET status = 'ready', lease_token = NULL, leased_until = NULL
WHERE lease_token = :token
""").bindparams(bindparam("token", type_=UUID(as_uuid=True)))


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
RECYCLE_PAIRS = text("""
UPDATE preferences SET status = 'ready'
WHERE run_id = ANY(:run_ids) AND status = 'consumed'
AND NOT EXISTS (SELECT 1 FROM preferences p
                WHERE p.run_id = ANY(:run_ids) AND p.status IN ('ready', 'leased'))
""").bindparams(bindparam("run_ids", type_=ARRAY(BigInteger)))


async def recycle_pairs(engine: AsyncEngine, run_ids: Sequence[int]) -> int:
    """Start another epoch over the runs' pairs once all have trained; returns how many."""
    async with engine.begin() as conn:
        return (await conn.execute(RECYCLE_PAIRS, {"run_ids": list(run_ids)})).rowcount


async def release_pairs(engine: AsyncEngine, lease: PairLease) -> int:
    """Hand a lease's pairs back to ready; returns how many it still held."""
    async with engine.begin() as conn:
        return (await conn.execute(RELEASE_PAIRS, {"token": lease.token})).rowcount
