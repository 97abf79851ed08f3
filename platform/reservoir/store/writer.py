"""Writing groups of experiences: validated first, then COPY in one transaction.

A row is two rows (schema.py): its data and its state, each sent by one COPY, with ids drawn
from the data table's sequence in one statement first. Rows are encoded while the server
takes the COPY (the records are a generator asyncpg reads chunk by chunk), so Python's
encoding and the server's insert work overlap.

Rules checked before anything is written: every field has its type; token, logprob and mask
lengths agree; the reward and its components are finite, logprobs finite as stored (float32)
and <= 0; texts are valid Unicode without NUL and the response is not empty; the run exists; a
group has the size its run declares; a group id is new (a group is written once: the unique
index on (group_id, group_row) holds that against concurrent writers too). A bad row raises
ExperienceInvalid naming group, row, field and value. The writer writes `raw` or `ready` rows
only: every later status belongs to the sampler, the ledger and pipelines.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Literal, Sequence

import asyncpg
from sqlalchemy import select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from reservoir.config import SamplerConfig
from reservoir.errors import ExperienceInvalid, FlowControlTimeout, StoreError
from reservoir.store import runs
from reservoir.store.flow import RateLimit
from reservoir.store.notify import NOTIFY_ROWS, AsyncWake, rows_channel
from reservoir.store.records import (ROW_COLUMNS, Experience, ShapedGroup, check_group_shape,
                                     shape_group, values_ok)
from reservoir.store.schema import experience_state

DATA_COLUMNS = ("id", "run_id") + ROW_COLUMNS
STATE_COLUMNS = ("id", "run_id", "group_id", "group_row", "policy_version", "status")
NEXT_IDS = "SELECT nextval('experience_data_id_seq') FROM generate_series(1, $1)"
WRITABLE = ("raw", "ready")


@dataclass
class WriteResult:
    groups: int = 0
    rows: int = 0
    group_ids: list[uuid.UUID] = field(default_factory=list)
    rejected: list[ExperienceInvalid] = field(default_factory=list)


@dataclass(frozen=True)
class _CheckedGroup:
    run_id: int
    group_id: uuid.UUID
    shaped: ShapedGroup


async def write_groups(
    engine: AsyncEngine,
    groups: Sequence[Sequence[Experience]],
    *,
    flow: SamplerConfig,
    status: Literal["raw", "ready"] = "ready",
    on_invalid: Literal["raise", "skip"] = "raise",
    before_copy: Callable[[AsyncConnection], Awaitable[None]] | None = None,
) -> WriteResult:
    """Write groups in one transaction. With on_invalid="skip", bad groups are returned, not raised.

    Every group is checked before anything is sent: structure row by row, values (token ranges,
    finite logprobs, 0/1 masks) in one pass over the whole batch. A bad group in "raise" mode
    raises ExperienceInvalid and nothing is written. `before_copy(conn)` runs in the same
    transaction before the rows go in (what must commit with them); if it raises, nothing is
    written.
    """
    if status not in WRITABLE:
        raise StoreError(f"status {status!r}: the writer writes raw or ready rows (the sampler, "
                         "the ledger and pipelines set every later status); nothing was written")
    result = WriteResult()
    if not isinstance(groups, Sequence) or isinstance(groups, (str, bytes)):
        raise StoreError(f"write_groups takes a list of groups, got {type(groups).__name__}")
    heads = [group[0] for group in groups  # first rows of what look like groups; the checks
             if isinstance(group, Sequence) and group  # below name everything else
             and isinstance(group[0], Experience)]
    run_info, existing = await _lookup(
        engine, sorted({head.run for head in heads if isinstance(head.run, str)}),
        sorted({head.group_id for head in heads if isinstance(head.group_id, uuid.UUID)}))
    checked = _checked_groups(groups, run_info, existing, on_invalid, result)
    rows_per_run: Counter = Counter()
    for group in checked:
        rows_per_run[group.run_id] += len(group.shaped.rows)
        result.group_ids.append(group.group_id)
    result.groups, result.rows = len(checked), sum(rows_per_run.values())
    if not checked:
        return result
    await _wait_for_room(engine, rows_per_run, flow)
    try:
        async with engine.begin() as conn:
            for run_id, n in sorted(rows_per_run.items()):  # also opens the transaction COPY joins
                await conn.execute(runs.add_inserted(run_id, n))
            if before_copy is not None:
                await before_copy(conn)
            await _copy(conn, checked, status, result.rows)
            await conn.execute(NOTIFY_ROWS, {"run_ids": sorted(rows_per_run), "what": status})
    except asyncpg.UniqueViolationError as exc:
        raise StoreError(f"a group id of this batch was written by another writer meanwhile "
                         f"({exc.constraint_name}); nothing of this batch was written") from None
    except (asyncpg.PostgresError, DBAPIError) as exc:
        raise StoreError(f"writing {result.rows} rows in {result.groups} groups failed in the "
                         f"database; nothing of this batch was written: {exc}") from exc
    return result


async def _copy(conn: AsyncConnection, checked: list[_CheckedGroup], status: str,
                n: int) -> None:
    """COPY the groups' data rows (encoded as the server reads them), then their state rows."""
    raw = (await conn.get_raw_connection()).driver_connection
    ids = [row[0] for row in await raw.fetch(NEXT_IDS, n)]
    await raw.copy_records_to_table("experience_data", columns=DATA_COLUMNS,
                                    records=_data_records(checked, ids))
    await raw.copy_records_to_table("experience_state", columns=STATE_COLUMNS,
                                    records=_state_records(checked, ids, status))


def _data_records(checked: list[_CheckedGroup], ids: list[int]):
    next_id = iter(ids)
    for group in checked:
        for row in group.shaped.encode():
            yield (next(next_id), group.run_id) + row


def _state_records(checked: list[_CheckedGroup], ids: list[int], status: str):
    next_id = iter(ids)
    for group in checked:
        version = int(group.shaped.group[0].policy_version)
        for index in range(len(group.shaped.rows)):
            yield next(next_id), group.run_id, group.group_id, index, version, status


def _checked_groups(groups, run_info, existing: set[uuid.UUID], on_invalid,
                    result: WriteResult) -> list[_CheckedGroup]:
    """Groups that pass every rule; the others raise or land in result.rejected."""
    checked: list[_CheckedGroup] = []
    seen: set[uuid.UUID] = set()
    for index, group in enumerate(groups):
        try:
            one = _check_group(group, index, run_info)
            _check_new(one.group_id, index, existing, seen)
            checked.append(one)
        except ExperienceInvalid as exc:
            if on_invalid == "raise":
                raise
            result.rejected.append(exc)
    if values_ok([row for group in checked for row in group.shaped.rows]):
        return checked
    passing = []
    for group in checked:  # slow path: find the groups with bad values
        try:
            group.shaped.check_values()
            passing.append(group)
        except ExperienceInvalid as exc:
            if on_invalid == "raise":
                raise
            result.rejected.append(exc)
    result.rejected.sort(key=lambda exc: exc.group_index)
    return passing


def _check_new(group_id: uuid.UUID, index: int, existing: set[uuid.UUID],
               seen: set[uuid.UUID]) -> None:
    if group_id in existing:
        raise ExperienceInvalid(f"group {index}: group_id {group_id} already exists in the store "
                                "(a group is written once); nothing of this group was written",
                                group_index=index, row_index=None, field="group_id")
    if group_id in seen:
        raise ExperienceInvalid(f"group {index}: group_id {group_id} appears twice in this "
                                "batch; nothing of this group was written",
                                group_index=index, row_index=None, field="group_id")
    seen.add(group_id)


async def _lookup(engine: AsyncEngine, names: list[str], group_ids: list[uuid.UUID]
                  ) -> tuple[dict[str, tuple[int, int | None]], set[uuid.UUID]]:
    """The runs by name (id, group size), and which of the given group ids already exist."""
    if not names and not group_ids:
        return {}, set()
    async with engine.connect() as conn:
        rows = (await conn.execute(runs.lookup(names))).all() if names else []
        taken = (await conn.execute(existing_groups(group_ids))).scalars().all() if group_ids else []
    return {row.name: (row.id, row.group_size) for row in rows}, set(taken)


def existing_groups(group_ids: list[uuid.UUID]):
    """Statement: which of these group ids have rows (the unique index answers it)."""
    return (select(experience_state.c.group_id).distinct()
            .where(experience_state.c.group_id.in_(group_ids), experience_state.c.group_row == 0))


def _check_group(group: Sequence[Experience], index: int,
                 run_info: dict[str, tuple[int, int | None]]) -> _CheckedGroup:
    check_group_shape(group, index)
    first = group[0]
    if first.run not in run_info:
        raise ExperienceInvalid(
            f"group {index} row 0: field 'run' = {first.run!r}: the run does not exist "
            "(create it first); nothing of this group was written",
            group_index=index, row_index=0, field="run")
    run_id, group_size = run_info[first.run]
    if group_size is not None and len(group) != group_size:
        raise ExperienceInvalid(
            f"group {index}: {len(group)} rows, but run {first.run!r} declares group_size "
            f"{group_size}; nothing of this group was written",
            group_index=index, row_index=None, field="group_size")
    return _CheckedGroup(run_id, first.group_id or uuid.uuid4(), shape_group(group, index))


async def _wait_for_room(engine: AsyncEngine, rows_per_run: Counter, flow: SamplerConfig) -> None:
    """Block while explorers are ahead of the samples_per_insert ratio (within its tolerance)."""
    if flow.samples_per_insert is None:
        return
    limit = RateLimit(flow.samples_per_insert, flow.spi_tolerance, flow.min_ready)
    n = sum(rows_per_run.values())
    limit.check_insert_size(n)
    if not rows_per_run:
        return
    deadline = time.monotonic() + flow.wait_timeout_s
    async with AsyncWake(engine, [rows_channel(r) for r in rows_per_run]) as wake:
        while True:
            async with engine.connect() as conn:
                inserted, sampled = (await conn.execute(runs.counters(list(rows_per_run)))).one()
            if limit.can_insert(inserted, sampled, n):
                return
            if time.monotonic() >= deadline:
                raise FlowControlTimeout(
                    f"waited {flow.wait_timeout_s:g}s to write {n} rows: explorers are ahead of "
                    f"samples_per_insert={flow.samples_per_insert} (inserted {inserted}, sampled "
                    f"{sampled}, tolerance {flow.spi_tolerance:g}); nothing was written")
            await wake.wait(flow.poll_interval_s)  # a lease of the run wakes it sooner
