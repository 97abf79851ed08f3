"""Leasing experiences to trainers: FOR UPDATE SKIP LOCKED, flow control, expiry and reclaim.

A lease marks rows `leased` with a token and an expiry. The trainer then either commits a step
(`ledger.commit_step`: rows become `consumed`) or releases them; a lease that expires is
reclaimed by the next lease of its runs, so a trainer killed while holding one loses nothing.

A lease is one statement (reclaim, pick, lease, count, read the data) that commits alone unless
flow control reads the runs' counters first; it names its runs' ids in its SQL and runs on
asyncpg directly (`prepared`), on connections that keep its plan (`engine.KEPT_PLANS_SETTINGS`).
"""

from __future__ import annotations

import contextlib
import functools
import operator
import json
import numbers
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import NamedTuple, Sequence

import numpy as np
from sqlalchemy import (BigInteger, Integer, Text, and_, bindparam, exists, func, literal,
                        literal_column, select, true, union_all, update)
from sqlalchemy.dialects.postgresql import ARRAY, UUID
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from reservoir.config import SamplerConfig
from reservoir.errors import FlowControlTimeout, LeaseLost, StoreError
from reservoir.store import codec, leasing, lifecycle, runs
from reservoir.store.flow import RateLimit
from reservoir.store.notify import NOTIFY_ROWS, AsyncWake, rows_channel
from reservoir.store.prepared import Prepared
from reservoir.store.records import INT32_MAX
from reservoir.store.schema import EXPERIENCE_STATUSES, experience_data as d
from reservoir.store.schema import experience_state as e
from reservoir.store.schema import runs as runs_table

# Leases read and change `experience_state` (e), the narrow row: a lease and a commit rewrite
# ~80 bytes a row, never the ~2 KB of `experience_data` (d), which a lease only reads: its
# data, and a row's group (id, row number, the group index: migration 0020).
# A group with a row in these states is not complete yet. A row held for review is not among
# them: people may take days, so the rest of its group trains as a partial group (the lease
# reports it, the step's metrics count it).
SETTLING = ("raw", "leased")
RECLAIM_LIMIT = 10_000  # expired rows a statement hands back
# fifo / lifo order by insertion time, then id: only the partial index experience_state_ready
# (run_id, created_at, id) WHERE status = 'ready' serves that order, so the planner cannot pick
# a primary-key scan that walks every consumed row ahead of the ready ones.
ORDERS = {
    "fifo": (e.c.created_at.asc(), e.c.id.asc()),
    "lifo": (e.c.created_at.desc(), e.c.id.desc()),
    "priority": (e.c.priority.desc(), e.c.id.asc()),
    "uniform": (func.random(),),
}


class LeasedExperience(NamedTuple):
    """One leased row. Arrays and reward components are decoded when first read (numpy views
    over the bytes the server sent), so a lease costs no more than the columns it carries. A
    named tuple: made from the driver's row in ~0.7 us, where a frozen dataclass took ~4 us
    (1 ms of a 256-row lease)."""

    id: int
    run_id: int
    task_id: int | None
    group_id: uuid.UUID
    policy_version: int
    reward: float
    reward_components_json: str
    times_sampled: int
    prompt_bytes: bytes
    response_bytes: bytes
    logprob_bytes: bytes | None
    mask_bytes: bytes | None
    shaped_reward: float | None = None
    group_rows: int | None = None  # rows its group has in the store, whatever their status

    @property
    def train_reward(self) -> float:
        """The reward the trainer learns from: shaped where a pipeline shaped it."""
        return self.reward if self.shaped_reward is None else self.shaped_reward

    @property
    def prompt_ids(self) -> np.ndarray:
        return codec.decode(self.prompt_bytes, codec.TOKEN)

    @property
    def response_ids(self) -> np.ndarray:
        return codec.decode(self.response_bytes, codec.TOKEN)

    @property
    def logprobs(self) -> np.ndarray | None:
        return codec.decode(self.logprob_bytes, codec.LOGPROB)

    @property
    def action_mask(self) -> np.ndarray | None:
        return codec.decode(self.mask_bytes, codec.MASK)

    @property
    def reward_components(self) -> dict[str, float]:
        return json.loads(self.reward_components_json)


@dataclass(frozen=True)
class Lease:
    token: uuid.UUID
    run_ids: tuple[int, ...]
    rows: tuple[LeasedExperience, ...]
    leased_until: datetime

    @property
    def ids(self) -> list[int]:
        return [row.id for row in self.rows]

    def groups(self) -> dict[uuid.UUID, list[LeasedExperience]]:
        grouped: dict[uuid.UUID, list[LeasedExperience]] = {}
        for row in self.rows:
            grouped.setdefault(row.group_id, []).append(row)
        return grouped

    def partial_groups(self) -> dict[uuid.UUID, tuple[int, int]]:
        """Groups this lease holds only part of: {group: (rows leased, rows in the store)}.
        A pipeline with `partial_groups: keep` (or a rejected review) leaves such groups; the
        trainer normalises over the rows it got and reports them in the step's metrics."""
        return {group: (len(rows), rows[0].group_rows) for group, rows in self.groups().items()
                if rows[0].group_rows is not None and len(rows) < rows[0].group_rows}


class _NotYet(Exception):
    """Roll the lease transaction back and wait: the reason says why (None: too few rows or
    groups to lease)."""


# A group's rows, found by the group index on their write-once data rows (migration 0020).
_mates = d.alias("mates")
STATE_RETURNED = (e.c.id, e.c.run_id, e.c.policy_version, e.c.times_sampled, e.c.leased_until)


# The data row's columns a lease carries.
DATA_RETURNED = (d.c.task_id, d.c.group_id, d.c.reward, d.c.reward_components, d.c.prompt_ids,
                 d.c.response_ids, d.c.logprobs, d.c.action_mask, d.c.shaped_reward)


def _returned(state, group_rows, data=d):
    """The columns a lease carries, in LeasedExperience's order, from the leased state rows and
    their data rows (or one relation holding both)."""
    return (state.c.id, state.c.run_id, data.c.task_id, data.c.group_id, state.c.policy_version,
            data.c.reward, data.c.reward_components.cast(Text).label("reward_components"),
            state.c.times_sampled, data.c.prompt_ids, data.c.response_ids, data.c.logprobs,
            data.c.action_mask, data.c.shaped_reward, group_rows.label("group_rows"),
            state.c.leased_until)


def _of_runs(table, run_ids: tuple[int, ...]):
    """`run_id IN (the lease's runs)`, the ids written into the SQL (integers from the runs
    table). Each table a lease reads says it, so the server plans and locks only those runs'
    partitions: a join on run_id alone (to the data, to a group's other rows) reads through the
    parent, and on a store of 200 runs the lease took 6.5 times as long as on a store of one."""
    return table.c.run_id.in_([literal_column(str(int(run_id))) for run_id in run_ids])


def _group_rows(rows, run_ids: tuple[int, ...] | None = None):
    """How many rows the group of each of `rows` has in the store, whatever their status."""
    same_group = and_(_mates.c.group_id == rows.c.group_id, _mates.c.run_id == rows.c.run_id,
                      _of_runs(_mates, run_ids) if run_ids else true())
    return select(func.count()).where(same_group).scalar_subquery()


def _with_data(leased, reclaimed, run_ids: tuple[int, ...]):
    """Statement: the leased rows joined to their data rows once (the group's id is there, so
    the groups' sizes read the join too) and to their groups' sizes (counted once a group: a
    lease of 256 rows holds ~32 groups), with the sampled counter updated for the rows leased
    and the rows reclaimed."""
    same_row = and_(d.c.run_id == leased.c.run_id, d.c.id == leased.c.id, _of_runs(d, run_ids))
    rows = (select(leased, *DATA_RETURNED).join_from(leased, d, same_row)
            .cte("leased_rows").prefix_with("MATERIALIZED"))
    groups = select(rows.c.run_id, rows.c.group_id).distinct().cte("leased_groups")
    sizes = (select(groups.c.run_id, groups.c.group_id,
                    _group_rows(groups, run_ids).label("n"))
             .cte("sizes").prefix_with("MATERIALIZED"))  # else inlined: a count a row again
    return (select(*_returned(rows, sizes.c.n, rows))
            .join_from(rows, sizes, and_(sizes.c.run_id == rows.c.run_id,
                                         sizes.c.group_id == rows.c.group_id))
            .add_cte(count_sampled((leased, 1), (reclaimed, -1))))


RETURNED = _returned(e, _group_rows(d))
FIELDS = len(RETURNED) - 1  # what a LeasedExperience holds (all but leased_until)


def status_in(column, statuses: Sequence[str]):
    """`status IN ('ready', ...)` with the statuses written into the SQL, not bound.

    The partial indexes (WHERE status = 'ready' / 'leased') serve a query only when the planner
    can see the status; a bound parameter hides it from the generic plan that a prepared
    statement switches to after five executions. Statuses come from a fixed set, never a user.
    """
    unknown = set(statuses) - set(EXPERIENCE_STATUSES)
    if unknown:
        raise StoreError(f"unknown experience status {sorted(unknown)}")
    return column.in_([literal_column(f"'{status}'") for status in statuses])


def _eligible(table, flow: SamplerConfig):
    """Rows a lease may take: of a status it samples from, sampled fewer times than the most.
    The most is written into the SQL (an integer of the validated config), as the statuses
    are: the lease's kept plan is planned knowing it."""
    return and_(status_in(table.c.status, flow.sample_from),
                table.c.times_sampled < literal_column(str(int(flow.max_times_sampled))))


def count_sampled(*moves):
    """A CTE that adds to runs.rows_sampled the rows of each (CTE, sign) pair: +1 a row leased,
    -1 a row given back. One update a run: a statement changes a row once."""
    signed = union_all(*(select(source.c.run_id, literal(sign).label("n"))
                         for source, sign in moves)).subquery("signed")
    per_run = (select(signed.c.run_id, func.sum(signed.c.n).label("n"))
               .group_by(signed.c.run_id).cte("per_run"))
    return (update(runs_table).where(runs_table.c.id == per_run.c.run_id)
            .values(rows_sampled=runs_table.c.rows_sampled + per_run.c.n)
            .returning(runs_table.c.id).cte("counted"))


def _version_floor(flow: SamplerConfig, explicit_floor: bool):
    if explicit_floor:
        return e.c.policy_version >= bindparam("min_version", type_=Integer)
    if flow.max_staleness is not None:
        return e.c.policy_version >= runs.latest_version(e.c.run_id) - flow.max_staleness
    return true()


@functools.lru_cache(maxsize=256)
def lease_statement(unit: str, flow: SamplerConfig, explicit_floor: bool,
                    run_ids: tuple[int, ...], n: int):
    """The lease statement for a unit ("rows" or "groups"), flow settings, runs and size,
    built once.

    One statement does a lease's work: the runs' expired leases go back, then `n` rows or
    groups are picked and leased, but only if at least `wanted` of them were found (else none
    is, and the statement returns no row), and the sampled counter follows both. `n` is
    written into the SQL: the plan a lease's connection keeps (engine.KEPT_PLANS_SETTINGS) is
    planned once for every execution, and with a bound limit PostgreSQL plans for a tenth of
    the rows: a lease of whole groups hashed every row of its run to find 32 groups (~4 s on
    a run of 190,000 rows).

    Bound at execution: wanted, token, lease_for (an interval) and, with explicit_floor,
    min_version.
    """
    of_runs = _of_runs(e, run_ids)
    reclaimed = lifecycle.given_back(and_(of_runs, _expired(of_runs))).cte("reclaimed")
    picked = _picked(unit, flow, explicit_floor, run_ids, n).cte("picked")
    if unit == "rows":
        chosen = e.c.id == leasing.any_of(select(picked.c.id))
    else:
        members = select(d.c.id).where(
            _of_runs(d, run_ids), d.c.group_id == leasing.any_of(select(picked.c.group_id)))
        chosen = and_(e.c.id == leasing.any_of(members), _eligible(e, flow))
    leased = (lifecycle.leased(of_runs, chosen, _enough(picked))
              .returning(*STATE_RETURNED).cte("leased"))
    return _with_data(leased, reclaimed, run_ids)


def _picked(unit: str, flow: SamplerConfig, explicit_floor: bool, run_ids: tuple[int, ...],
            n: int):
    """Select: the ids of the next `n` rows, or the group ids of the next `n` whole groups
    (each picked by its first eligible row, once no row of it is still settling), in the
    flow's order, skipping rows another transaction holds."""
    where = and_(_of_runs(e, run_ids), _eligible(e, flow), _version_floor(flow, explicit_floor))
    if unit == "rows":
        picked = select(e.c.id).where(where)
    else:  # a row's group is on its data row; each mate's state is read by id
        other_data, other = d.alias("other_data"), e.alias("other")
        leader = ~exists().where(
            other_data.c.group_id == d.c.group_id, other_data.c.run_id == d.c.run_id,
            _of_runs(other_data, run_ids), other.c.run_id == other_data.c.run_id,
            other.c.id == other_data.c.id, _of_runs(other, run_ids),
            status_in(other.c.status, SETTLING)
            | and_(other_data.c.group_row < d.c.group_row, _eligible(other, flow)))
        same_row = and_(d.c.run_id == e.c.run_id, d.c.id == e.c.id, _of_runs(d, run_ids))
        picked = select(d.c.group_id).join_from(e, d, same_row).where(where, leader)
    return (picked.order_by(*ORDERS[flow.order]).limit(literal_column(str(int(n))))
            .with_for_update(of=e, skip_locked=True))


async def _available(engine: AsyncEngine, unit: str, flow: SamplerConfig,
                     min_policy_version: int | None, run_ids: tuple[int, ...],
                     wanted: int) -> str:
    """'3 of 8 rows available': what a lease would find now (for a lease that waited)."""
    picked = _picked(unit, flow, min_policy_version is not None, run_ids, wanted).subquery()
    async with engine.connect() as conn:
        found = (await conn.execute(select(func.count()).select_from(picked),
                                    dict(min_version=min_policy_version))).scalar()
    return f"{found} of {wanted} {unit} available"


@functools.lru_cache(maxsize=256)
def _prepared_lease(unit: str, flow: SamplerConfig, explicit_floor: bool,
                    run_ids: tuple[int, ...], n: int) -> Prepared:
    return Prepared(lease_statement(unit, flow, explicit_floor, run_ids, n))


def _enough(picked):
    """Whether the lease found at least `wanted` rows or groups: a short batch that may not
    train leases nothing (and the locks its pick took end with the statement)."""
    return (select(func.count()).select_from(picked).scalar_subquery()
            >= bindparam("wanted", type_=Integer))


def _to_leased(row) -> LeasedExperience:
    return LeasedExperience._make(row[:FIELDS])


_ID = operator.itemgetter(0)


def _give_back_statement(where):
    """Statement: rows matching `where` leave their lease (counters follow); returns the count."""
    back = lifecycle.given_back(where).cte("back")
    return select(func.count()).select_from(back).add_cte(count_sampled((back, -1)))


def _expired(*where):
    """Rows whose lease expired, oldest expiry first (up to `RECLAIM_LIMIT` a statement): the
    partial index experiences_leased finds them."""
    return leasing.expired(e, *where, limit=RECLAIM_LIMIT)


# The runs a lease names: `run_id = ANY(...)` lets the server skip other runs' partitions.
OF_RUNS = e.c.run_id == func.any(bindparam("run_ids", type_=ARRAY(BigInteger)))
# A lease's rows: its runs, its ids (the primary key finds them: no index has the token,
# migration 0019) and its token.
OF_LEASE = and_(OF_RUNS, e.c.id == func.any(bindparam("ids", type_=ARRAY(BigInteger))),
                leasing.of_token(e))
# Built once: constructing a statement with CTEs costs SQLAlchemy about a millisecond.
RECLAIM = _give_back_statement(_expired())
RELEASE = _give_back_statement(OF_LEASE)


def _of_lease(lease: Lease) -> dict:
    """The values OF_LEASE binds."""
    return {"token": lease.token, "run_ids": list(lease.run_ids), "ids": lease.ids}


async def reclaim_expired(conn: AsyncConnection) -> int:
    """Hand back rows whose lease expired, in every run (up to RECLAIM_LIMIT a call); returns
    how many. A lease reclaims its own runs' rows itself."""
    return (await conn.execute(RECLAIM)).scalar()


async def release(engine: AsyncEngine, lease: Lease) -> int:
    """Hand a lease's rows back unconsumed; returns how many were still held."""
    async with engine.begin() as conn:
        await conn.execute(NOTIFY_ROWS, {"run_ids": list(lease.run_ids), "what": "released"})
        return (await conn.execute(RELEASE, _of_lease(lease))).scalar()


async def release_runs(engine: AsyncEngine, run_ids: Sequence[int]) -> int:
    """Hand back every row these runs have leased, whoever holds it; returns how many.

    For a trainer resuming after a crash: the run's only trainer is the caller, so any lease
    still held is one it lost when it died.
    """
    statement = _give_back_statement(and_(status_in(e.c.status, ["leased"]),
                                          e.c.run_id.in_(list(run_ids))))
    async with engine.begin() as conn:
        return (await conn.execute(statement)).scalar()


async def fetch(engine: AsyncEngine, ids: Sequence[int]) -> list[LeasedExperience]:
    """Rows by id, in id order, as a lease carries them (for replaying a committed step)."""
    async with engine.connect() as conn:
        same_row = and_(d.c.run_id == e.c.run_id, d.c.id == e.c.id)
        result = await conn.execute(select(*RETURNED[:FIELDS]).join_from(e, d, same_row)
                                    .where(e.c.id.in_(list(ids))).order_by(e.c.id))
        return [_to_leased(row) for row in result]


async def renew(engine: AsyncEngine, lease: Lease, seconds: float) -> datetime:
    """Push a lease's expiry to now + seconds; LeaseLost if it was already reclaimed."""
    async with engine.begin() as conn:
        result = await conn.execute(
            update(e).where(OF_LEASE)
            .values(leased_until=func.now() + timedelta(seconds=seconds))
            .returning(e.c.leased_until), _of_lease(lease))
        until = result.scalars().all()
    if len(until) != len(lease.rows):
        raise LeaseLost(f"lease {lease.token} holds {len(until)} of its {len(lease.rows)} rows: "
                        "it expired and was reclaimed")
    return until[0]


async def _check_min_ready(conn: AsyncConnection, run_ids, flow: SamplerConfig,
                           sampled: int) -> None:
    """Before a run's first lease (nothing sampled yet), wait for min_ready ready rows."""
    if flow.min_ready <= 1 or sampled > 0:
        return
    ready = (select(literal(1)).where(_of_runs(e, tuple(run_ids)), status_in(e.c.status, ["ready"]))
             .limit(flow.min_ready).subquery())
    n_ready = (await conn.execute(select(func.count()).select_from(ready))).scalar()
    if n_ready < flow.min_ready:
        raise _NotYet(f"{n_ready} ready rows, min_ready is {flow.min_ready}")


def _checked(flow: SamplerConfig) -> bool:
    """Whether a lease reads the runs' counters first (samples_per_insert, min_ready), in one
    transaction with its statement; otherwise the lease is its one statement."""
    return flow.samples_per_insert is not None or flow.min_ready > 1


async def _lease_once(conn: AsyncConnection, run_ids, *, unit, wanted, flow, min_policy_version,
                      allow_partial):
    limit = None
    if flow.samples_per_insert is not None:
        limit = RateLimit(flow.samples_per_insert, flow.spi_tolerance, flow.min_ready)
        await conn.execute(runs.lock(list(run_ids)))
    if _checked(flow):  # one read of the counters serves both checks
        inserted, sampled = (await conn.execute(runs.counters(list(run_ids)))).one()
        await _check_min_ready(conn, run_ids, flow, sampled)
    token = uuid.uuid4()
    stmt = _prepared_lease(unit, flow, min_policy_version is not None, tuple(run_ids), wanted)
    params = dict(wanted=1 if allow_partial else wanted, token=token,
                  lease_for=timedelta(seconds=flow.lease_seconds), min_version=min_policy_version)
    leased = await stmt.fetch(conn, params)
    if not leased:
        raise _NotYet(None)
    if limit is not None:
        if not limit.can_sample(inserted, sampled, len(leased)):
            raise _NotYet(f"samples_per_insert: inserted {inserted}, sampled {sampled}; "
                          f"trainer is ahead of the explorers")
    if limit is not None:  # writers waiting for room may write now
        await conn.execute(NOTIFY_ROWS, {"run_ids": list(run_ids), "what": "leased"})
    leased.sort(key=_ID)
    return Lease(token, tuple(run_ids), tuple(_to_leased(row) for row in leased),
                 leased[0][FIELDS])


@contextlib.asynccontextmanager
async def _lease_connection(engine: AsyncEngine, flow: SamplerConfig):
    """A transaction for a checked lease; else a connection on which the lease statement runs
    without one, committing alone (no BEGIN and COMMIT round trips around it)."""
    if _checked(flow):
        async with engine.begin() as conn:
            yield conn
        return
    async with engine.connect() as conn:
        yield conn


def _is_count(value) -> bool:
    """A whole number (not a bool) from 1 to INT32_MAX."""
    return (isinstance(value, numbers.Integral) and not isinstance(value, bool)
            and 1 <= value <= INT32_MAX)


async def lease(engine: AsyncEngine, run_ids: Sequence[int], *, rows: int | None = None,
                groups: int | None = None, flow: SamplerConfig,
                min_policy_version: int | None = None, allow_partial: bool = False,
                timeout_s: float | None = None) -> Lease:
    """Lease `rows` experiences or `groups` whole groups, waiting up to the flow timeout.

    Waits while fewer than min_ready rows are ready before the first lease, while the trainer is
    ahead of samples_per_insert, and (unless allow_partial) until the full batch is available.
    """
    unit, wanted = ("rows", rows) if rows is not None else ("groups", groups)
    if (rows is None) == (groups is None) or not _is_count(wanted):
        raise StoreError(f"lease needs exactly one of rows or groups, a whole number from 1 to "
                         f"{INT32_MAX} (got rows={rows!r}, groups={groups!r})")
    wanted = int(wanted)  # written into the lease's SQL
    if flow.samples_per_insert is not None and rows is not None:
        limit = RateLimit(flow.samples_per_insert, flow.spi_tolerance, flow.min_ready)
        limit.check_sample_size(wanted)
    timeout = flow.wait_timeout_s if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout
    async with contextlib.AsyncExitStack() as waiting:
        wake = None
        while True:
            try:
                async with _lease_connection(engine, flow) as conn:
                    return await _lease_once(conn, run_ids, unit=unit, wanted=wanted, flow=flow,
                                             min_policy_version=min_policy_version,
                                             allow_partial=allow_partial)
            except _NotYet as not_yet:
                if time.monotonic() >= deadline:
                    reason = not_yet.args[0] or await _available(
                        engine, unit, flow, min_policy_version, tuple(run_ids), wanted)
                    raise FlowControlTimeout(
                        f"waited {timeout:g}s for a lease of {wanted} {unit}: {reason}") from None
            if wake is None:  # listen only once a lease has to wait: rows written wake it
                wake = await waiting.enter_async_context(
                    AsyncWake(engine, [rows_channel(r) for r in run_ids]))
                continue  # rows written before the LISTEN began are looked for once more
            await wake.wait(flow.poll_interval_s)


async def retire(engine: AsyncEngine, run_ids: Sequence[int], flow: SamplerConfig) -> int:
    """Retire rows that can no longer train: older than max_staleness versions behind.

    Rows that trained max_times_sampled times stay `consumed` (their final state).
    """
    if flow.max_staleness is None:
        return 0
    stmt = lifecycle.retired(
        e.c.run_id.in_(run_ids), _eligible(e, flow),
        e.c.policy_version < runs.latest_version(e.c.run_id) - flow.max_staleness)
    async with engine.begin() as conn:
        return len((await conn.execute(stmt)).all())


# Another lease's rows move under this lease's token (and the earlier expiry).
JOIN = update(e).where(OF_LEASE).values(
    lease_token=bindparam("into", type_=UUID(as_uuid=True)),
    leased_until=func.least(e.c.leased_until, bindparam("until", type_=e.c.leased_until.type)))


def _set_aside_statement():
    """Statement: the lease's rows in :ids leave it retired, each noting :reason in its
    metadata, and the sampled counter of their runs gives them back."""
    aside = lifecycle.set_aside(OF_LEASE).cte("aside")
    note = func.jsonb_build_object(literal_column("'set_aside'"),
                                   bindparam("reason", type_=Text))
    noted = (update(d).where(d.c.run_id == aside.c.run_id, d.c.id == aside.c.id)
             .values(metadata=d.c.metadata.op("||")(note)).returning(d.c.id).cte("noted"))
    counted = count_sampled((aside, -1))
    return select(*(select(func.count()).select_from(cte).scalar_subquery()
                    for cte in (aside, noted, counted))).add_cte(aside, noted, counted)


SET_ASIDE = _set_aside_statement()


async def set_aside(engine: AsyncEngine, lease: Lease, groups: Sequence[uuid.UUID], *,
                    reason: str) -> Lease:
    """Retire leased groups that will not be trained (e.g. dynamic sampling: their rewards
    are all equal), recording why in each row's metadata; the lease keeps the other rows."""
    aside = set(groups)
    ids = [row.id for row in lease.rows if row.group_id in aside]
    async with engine.begin() as conn:
        await conn.execute(SET_ASIDE, {**_of_lease(lease), "ids": ids, "reason": reason})
        for run_id in lease.run_ids:  # explorers may make more now: wake them (a hint only)
            await conn.execute(select(func.pg_notify(runs.POLICY_CHANNEL,
                                                     f"{run_id}:set-aside")))
    kept = tuple(row for row in lease.rows if row.group_id not in aside)
    return Lease(lease.token, lease.run_ids, kept, lease.leased_until)


async def join(engine: AsyncEngine, lease: Lease, other: Lease) -> Lease:
    """One lease holding both leases' rows (under the first's token, the earlier expiry)."""
    until = min(lease.leased_until, other.leased_until)
    async with engine.begin() as conn:
        await conn.execute(JOIN, {**_of_lease(other), "into": lease.token, "until": until})
    return Lease(lease.token, tuple(sorted(set(lease.run_ids) | set(other.run_ids))),
                 lease.rows + other.rows, until)
