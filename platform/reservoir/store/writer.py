"""Writing groups of experiences: validated first, then COPY in one transaction.

Rules checked before anything is written: token, logprob and mask lengths agree; the reward and
its components are finite; the response is not empty; the run exists; a group has the size its
run declares. A bad row raises ExperienceInvalid naming group, row, field and value.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator, Literal, Sequence

import asyncpg
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from reservoir.config import SamplerConfig
from reservoir.errors import ExperienceInvalid, FlowControlTimeout, StoreError
from reservoir.store import runs
from reservoir.store.flow import RateLimit
from reservoir.store.records import EncodedRow, Experience, check_group_shape, encode_group

COPY_COLUMNS = (
    "run_id", "task_id", "group_id", "policy_version", "prompt_text", "response_text",
    "prompt_ids", "response_ids", "logprobs", "action_mask", "reward", "reward_components",
    "metadata", "status", "parent_id",
)


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
    rows: list[EncodedRow]


async def write_groups(
    engine: AsyncEngine,
    groups: Sequence[Sequence[Experience]],
    *,
    flow: SamplerConfig,
    status: Literal["raw", "ready"] = "ready",
    on_invalid: Literal["raise", "skip"] = "raise",
) -> WriteResult:
    """Write groups in one transaction. With on_invalid="skip", bad groups are returned, not raised.

    Groups are checked and encoded while COPY streams the previous ones to the server, so
    validation costs little wall time; a bad group in "raise" mode aborts the COPY and the
    transaction, and nothing of the batch is written.
    """
    result = WriteResult()
    names = sorted({group[0].run for group in groups if group})
    if flow.samples_per_insert is not None:
        run_info = await _lookup_runs(engine, names)
        await _wait_for_room(engine, _rows_per_run(groups, run_info), flow)
    rows_per_run: Counter = Counter()
    try:
        async with engine.begin() as conn:
            run_info = {row.name: (row.id, row.group_size)
                        for row in await conn.execute(runs.lookup(names))}
            raw = await conn.get_raw_connection()
            await raw.driver_connection.copy_records_to_table(
                "experiences", columns=COPY_COLUMNS,
                records=_records(groups, run_info, status, on_invalid, result, rows_per_run))
            for run_id, n in sorted(rows_per_run.items()):
                await conn.execute(runs.add_inserted(run_id, n))
    except (asyncpg.PostgresError, DBAPIError) as exc:
        raise StoreError(f"writing {result.rows} rows in {result.groups} groups failed in the "
                         f"database; nothing of this batch was written: {exc}") from exc
    return result


def _records(groups, run_info, status, on_invalid, result: WriteResult,
             rows_per_run: Counter) -> Iterator[tuple]:
    """COPY records of every valid group; invalid ones raise or land in result.rejected."""
    for index, group in enumerate(groups):
        try:
            checked = _check_group(group, index, run_info)
        except ExperienceInvalid as exc:
            if on_invalid == "raise":
                raise
            result.rejected.append(exc)
            continue
        result.groups += 1
        result.rows += len(checked.rows)
        result.group_ids.append(checked.group_id)
        rows_per_run[checked.run_id] += len(checked.rows)
        for row in checked.rows:
            yield (checked.run_id, row.task_id, checked.group_id, row.policy_version,
                   row.prompt_text, row.response_text, row.prompt_ids, row.response_ids,
                   row.logprobs, row.action_mask, row.reward, row.reward_components,
                   row.metadata, status, row.parent_id)


def _rows_per_run(groups, run_info) -> Counter:
    counts: Counter = Counter()
    for group in groups:
        if group and group[0].run in run_info:
            counts[run_info[group[0].run][0]] += len(group)
    return counts


async def _lookup_runs(engine: AsyncEngine, names: list[str]) -> dict[str, tuple[int, int | None]]:
    async with engine.connect() as conn:
        rows = (await conn.execute(runs.lookup(names))).all()
    return {row.name: (row.id, row.group_size) for row in rows}


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
    return _CheckedGroup(run_id, first.group_id or uuid.uuid4(), encode_group(group, index))


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
        await asyncio.sleep(flow.poll_interval_s)
