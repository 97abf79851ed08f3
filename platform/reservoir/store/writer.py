"""Writing groups of experiences: checked, then COPY in one transaction.

A row is two rows (schema.py): its data and its state, sent by COPY, with ids drawn from the
data table's sequence in one statement first. Groups are admitted (structure, run, size, new
id) before the transaction; their rows are checked and encoded a chunk of groups at a time,
each chunk one COPY of data rows and one of state rows, while the server takes the chunk
before, so Python's work and the server's inserts overlap. A bad row in "raise" mode ends the
stream and rolls the whole transaction back.

Rules checked before anything is committed: every field has its type; token, logprob and mask
lengths agree; the reward and its components are finite, logprobs finite as stored (float32)
and <= 0; texts are valid Unicode without NUL and the response is not empty; the run exists; a
group has the size its run declares; a group id is new (a group is written once: the unique
index on (group_id, group_row) holds that against concurrent writers too). A bad row raises
ExperienceInvalid naming group, row, field and value. The writer writes `raw` or `ready` rows
only: every later status belongs to the sampler, the ledger and pipelines.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Literal, Sequence

import asyncpg
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from reservoir.config import DEFAULT_REWARD_RANGE, SamplerConfig
from reservoir.errors import ExperienceInvalid, FlowControlTimeout, StoreError
from reservoir.store import partitions, retry, runs
from reservoir.store.engine import REUSE_PLANS
from reservoir.store.flow import RateLimit
from reservoir.store.notify import AsyncWake, rows_channel
from reservoir.store.records import (ROW_COLUMNS, Experience, ShapedGroup, check_group_shape,
                                     shape_group, values_ok)
from reservoir.store.usersql import describe

COPY_DATA_COLUMNS = ("id", "run_id") + ROW_COLUMNS + ("parent_run_id", "group_id", "group_row")
COPY_STATE_COLUMNS = ("id", "run_id", "policy_version", "status")
# One round trip before the COPY: the runs by name, which of the group ids are taken, the
# parents' runs, and an id for every row offered (the rows of groups refused then leave gaps in
# the sequence, as a rolled-back insert does). Arrays travel as text[]: asyncpg looks up the
# type of any other array parameter on each new connection (~18 ms). A parent's run is not
# known, so its lookup plans every run's partition (12 ms on a store of 200 runs, even for no
# parent): the statement has it only when a row names a parent.
_LOOKUP = """
WITH named AS (SELECT id, name, group_size, vocab_size,
                      (SELECT coalesce(max(version), 0) FROM policy_versions v
                       WHERE v.run_id = runs.id) AS published
               FROM runs WHERE name = ANY(CAST(:names AS text[]))),
parents AS ({parents})
SELECT ARRAY(SELECT name FROM named ORDER BY id) AS names,
       ARRAY(SELECT id FROM named ORDER BY id) AS run_ids,
       ARRAY(SELECT group_size FROM named ORDER BY id) AS group_sizes,
       ARRAY(SELECT vocab_size FROM named ORDER BY id) AS vocab_sizes,
       ARRAY(SELECT published FROM named ORDER BY id) AS published,
       ARRAY(SELECT CAST(group_id AS text) FROM experience_groups
             WHERE group_id = ANY(CAST(CAST(:groups AS text[]) AS uuid[]))) AS taken,
       ARRAY(SELECT id FROM parents ORDER BY id) AS parent_ids,
       ARRAY(SELECT run_id FROM parents ORDER BY id) AS parent_runs,
       ARRAY(SELECT nextval('experience_data_id_seq') FROM generate_series(1, :n)) AS ids
"""
LOOKUP = text(_LOOKUP.format(parents="SELECT id, run_id FROM experience_state WHERE "
                                     "id = ANY(CAST(CAST(:parents AS text[]) AS bigint[]))"))
LOOKUP_NO_PARENTS = text(_LOOKUP.format(parents="SELECT 0::bigint AS id, 0::bigint AS run_id "
                                                "WHERE false"))
WRITABLE = ("raw", "ready")
log = logging.getLogger(__name__)


@dataclass
class WriteResult:
    groups: int = 0
    rows: int = 0
    group_ids: list[uuid.UUID] = field(default_factory=list)
    rejected: list[ExperienceInvalid] = field(default_factory=list)


@dataclass(frozen=True)
class _Run:
    """What the writer checks a group against: its run's id, declared group size, its model's
    vocabulary and the latest policy version it published (0 before any)."""

    id: int
    group_size: int | None
    vocab_size: int | None
    published: int


@dataclass(frozen=True)
class _CheckedGroup:
    run_id: int
    group_id: uuid.UUID
    shaped: ShapedGroup
    vocab_size: int | None


async def write_groups(
    engine: AsyncEngine,
    groups: Sequence[Sequence[Experience]],
    *,
    flow: SamplerConfig,
    status: Literal["raw", "ready"] = "ready",
    on_invalid: Literal["raise", "skip"] = "raise",
    before_copy: Callable[[AsyncConnection], Awaitable[None]] | None = None,
    reward_range: tuple[float, float] = DEFAULT_REWARD_RANGE,
) -> WriteResult:
    """Write groups in one transaction. With on_invalid="skip", bad groups are returned, not raised.

    Every group is checked before it is committed: its structure, run, size, id and policy
    version (one the run published) before the transaction, its rows (types, texts, rewards
    in `reward_range`, JSON) and values (token ranges and the run's vocabulary, finite
    logprobs, 0/1 masks, one pass per chunk of groups) while the COPY streams. A bad group in
    "raise" mode raises ExperienceInvalid and the transaction rolls back: nothing is written.
    `before_copy(conn)` runs in the same transaction before the rows go in (what must commit
    with them); if it raises, nothing is written.
    """
    if status not in WRITABLE:
        raise StoreError(f"status {status!r}: the writer writes raw or ready rows (the sampler, "
                         "the ledger and pipelines set every later status); nothing was written")
    result = WriteResult()
    if not isinstance(groups, Sequence) or isinstance(groups, (str, bytes)):
        raise StoreError(f"write_groups takes a list of groups, got {type(groups).__name__}")
    likely = [group for group in groups if _looks_like_group(group)]  # the checks below
    heads = [group[0] for group in likely]                             # name everything else
    parents = sorted({exp.parent_id for group in groups if isinstance(group, Sequence)
                      for exp in group if isinstance(exp, Experience) and _is_id(exp.parent_id)})
    if flow.samples_per_insert is not None:  # before the transaction: it holds nothing waiting
        await _wait_for_room(engine, await _rows_per_run(engine, groups), flow)
    try:
        async with engine.begin() as conn:  # one connection: lookups, ids, rows, counters
            run_info, existing, parent_runs, ids = await _lookup(
                conn, sorted({head.run for head in heads if isinstance(head.run, str)}),
                sorted({head.group_id for head in heads if isinstance(head.group_id, uuid.UUID)}),
                parents, sum(len(group) for group in likely))
            admitted = _admitted_groups(groups, run_info, existing, parent_runs, on_invalid,
                                        result)
            if not admitted:
                return result
            if before_copy is not None:
                await before_copy(conn)
            stream = _Stream(admitted, parent_runs, on_invalid, result, reward_range)
            await _copy(conn, stream, ids, status)
            written = sorted(stream.rows_per_run().items())
            counted = (await conn.execute(runs.INSERTED_AND_NOTIFY, {
                "run_ids": [r for r, _ in written], "counts": [n for _, n in written],
                "what": status})).all()
    except asyncpg.UniqueViolationError as exc:
        raise StoreError(f"a group id of this batch was written by another writer meanwhile "
                         f"({exc.constraint_name}); nothing of this batch was written") from None
    except (asyncpg.PostgresError, DBAPIError) as exc:
        reason = describe(getattr(exc, "orig", None) or exc)  # the driver's first line
        if retry.is_outage(exc):
            reason = f"the connection to the database was lost ({reason})"
        raise StoreError(f"writing {len(groups)} groups failed in the database; nothing of "
                         f"this batch was written: {reason}") from exc
    await _first_statistics(engine, counted)
    result.group_ids = [group.group_id for group in stream.accepted]
    result.groups, result.rows = len(stream.accepted), sum(n for _, n in written)
    result.rejected.sort(key=lambda exc: exc.group_index)
    return result


async def _first_statistics(engine: AsyncEngine, counted) -> None:
    """Analyze the partitions of each run this write took to FIRST_STATISTICS_AT rows
    (partitions.analyze), from INSERTED_AND_NOTIFY's rows (run id, rows before, rows after,
    notified). The rows are committed: if this fails, the statistics wait for autovacuum, and
    the write stands."""
    first = [run_id for run_id, before, after, _ in counted
             if before < partitions.FIRST_STATISTICS_AT <= after]
    try:
        for run_id in first:
            async with engine.begin() as conn:
                await conn.execute(partitions.analyze(run_id))
    except (asyncpg.PostgresError, DBAPIError, OSError) as exc:
        log.warning("the rows were written; analyzing their run's partition failed: %s",
                    describe(getattr(exc, "orig", None) or exc))


async def _copy(conn: AsyncConnection, stream: "_Stream", ids: list[int], status: str) -> None:
    """COPY the rows: each chunk's data rows as one COPY while Python checks and encodes the
    next chunk (asyncpg sends a COPY's rows 512 KB at a time, so one COPY of a 512-row call,
    ~1 MB, started the server only once half of Python's work was done), then all their state
    rows in one COPY (~40 bytes a row; its rows' keys are checked once, at its end: migration
    0022). A bad group in "raise" mode ends the stream and raises here once the COPYs already
    sent are done (the caller's transaction rolls back); a COPY the server refuses raises its
    error."""
    raw = (await conn.get_raw_connection()).driver_connection
    data_table, state_table = _tables(stream)
    await raw.execute(f"SELECT {REUSE_PLANS}")  # the keys some rows check, and the triggers
    copies: asyncio.Queue = asyncio.Queue()

    async def run_copies() -> None:
        while (copy := await copies.get()) is not None:
            table, columns, records = copy
            await raw.copy_records_to_table(table, columns=columns, records=records)

    copying = asyncio.ensure_future(run_copies())
    states: list[tuple] = []
    try:
        async for data, state in stream.chunks(ids, status):
            if copying.done():
                break  # the server refused a COPY: awaited below, it raises
            copies.put_nowait((data_table, COPY_DATA_COLUMNS, data))
            states.extend(state)
        if stream.error is None and states:
            copies.put_nowait((state_table, COPY_STATE_COLUMNS, states))
        copies.put_nowait(None)
        await copying
    finally:
        if not copying.done():
            copying.cancel()
    if stream.error is not None:
        raise stream.error


def _tables(stream: "_Stream") -> tuple[str, str]:
    """(data, state) tables to COPY into: the run's partitions when every row is of one run
    (the server routes no row), else the partitioned tables."""
    run_ids = {group.run.id for group in stream.admitted}
    tables = ("experience_data", "experience_state")
    if len(run_ids) != 1:
        return tables
    run_id = run_ids.pop()
    return partitions.name(tables[0], run_id), partitions.name(tables[1], run_id)


@dataclass(frozen=True)
class _Admitted:
    index: int
    run: _Run
    group_id: uuid.UUID
    rows: Sequence[Experience]


class _Stream:
    """The admitted groups, checked row by row and encoded a chunk at a time while the server
    takes the COPYs of the chunk before."""

    CHUNK_GROUPS = 16  # values are checked in one vectorised pass per chunk

    def __init__(self, admitted: list[_Admitted], parent_runs: dict[int, int], on_invalid: str,
                 result: WriteResult, reward_range: tuple[float, float]):
        self.admitted, self.on_invalid, self.result = admitted, on_invalid, result
        self.parent_runs, self.reward_range = parent_runs, reward_range
        self.accepted: list[_CheckedGroup] = []
        self.error: ExperienceInvalid | None = None

    async def chunks(self, ids: list[int], status: str):
        """(data records, state records) of each chunk's passing groups, the ids in order."""
        next_id = iter(ids)
        for start in range(0, len(self.admitted), self.CHUNK_GROUPS):
            passing = await self._check(self.admitted[start:start + self.CHUNK_GROUPS])
            if passing is None:
                return  # "raise": the first bad group ends the stream; _copy raises it
            data, state = [], []
            for group in passing:
                self.accepted.append(group)
                version = int(group.shaped.group[0].policy_version)
                for index, row in enumerate(group.shaped.encode()):  # parent_id last
                    row_id = next(next_id)
                    data.append((row_id, group.run_id) + row
                                + (self.parent_runs.get(row[-1]), group.group_id, index))
                    state.append((row_id, group.run_id, version, status))
            if data:
                yield data, state

    def rows_per_run(self) -> Counter:
        counts: Counter = Counter()
        for group in self.accepted:
            counts[group.run_id] += len(group.shaped.rows)
        return counts

    async def _check(self, chunk: list[_Admitted]) -> list[_CheckedGroup] | None:
        """The chunk's groups that pass; None once a bad group was found in "raise" mode.
        Between groups the COPY of the chunk before goes on (its I/O is served)."""
        shaped = []
        for group in chunk:
            try:
                shaped.append(_CheckedGroup(
                    group.run.id, group.group_id,
                    shape_group(group.rows, group.index, self.reward_range), group.run.vocab_size))
            except ExperienceInvalid as exc:
                if not self._reject(exc):
                    return None
            await asyncio.sleep(0)
        vocab_sizes = [group.vocab_size for group in shaped if group.vocab_size is not None]
        if values_ok([row for group in shaped for row in group.shaped.rows],
                     min(vocab_sizes, default=None)):
            return shaped
        passing = []
        for group in shaped:  # slow path: find the groups with bad values
            try:
                group.shaped.check_values(group.vocab_size)
                passing.append(group)
            except ExperienceInvalid as exc:
                if not self._reject(exc):
                    return None
        return passing

    def _reject(self, exc: ExperienceInvalid) -> bool:
        """Keep going after a bad group ("skip"), or remember it and stop ("raise")."""
        if self.on_invalid == "raise":
            self.error = exc
            return False
        self.result.rejected.append(exc)
        return True


def _admitted_groups(groups, run_info, existing: set[uuid.UUID], parent_runs: dict[int, int],
                     on_invalid, result: WriteResult) -> list[_Admitted]:
    """Groups whose structure, run, size and id pass; the others raise or land in
    result.rejected (their rows are checked while they stream)."""
    admitted: list[_Admitted] = []
    seen: set[uuid.UUID] = set()
    for index, group in enumerate(groups):
        try:
            one = _admit(group, index, run_info)
            _check_parents(group, index, parent_runs)
            _check_new(one.group_id, index, existing, seen)
            admitted.append(one)
        except ExperienceInvalid as exc:
            if on_invalid == "raise":
                raise
            result.rejected.append(exc)
    return admitted


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


def _check_parents(group: Sequence[Experience], index: int, parent_runs: dict[int, int]) -> None:
    for row_index, exp in enumerate(group):
        if _is_id(exp.parent_id) and exp.parent_id not in parent_runs:
            raise ExperienceInvalid(
                f"group {index} row {row_index}: field 'parent_id' = {exp.parent_id}: no "
                "experience has that id; nothing of this group was written",
                group_index=index, row_index=row_index, field="parent_id")


def _looks_like_group(group) -> bool:
    """A non-empty sequence whose first row is an Experience (its other rows are checked later)."""
    return isinstance(group, Sequence) and bool(group) and isinstance(group[0], Experience)


def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value < 2**63


async def _lookup(conn: AsyncConnection, names: list[str], group_ids: list[uuid.UUID],
                  parents: list[int], rows: int):
    """The runs by name ({name: _Run}), which of the given group ids already exist, the
    parents' runs ({experience id: run id}) and `rows` new ids, in one statement."""
    if not names:
        return {}, set(), {}, []
    params = {"names": names, "groups": [str(group) for group in group_ids], "n": rows}
    if parents:
        params["parents"] = [str(parent) for parent in parents]
    found = (await conn.execute(LOOKUP if parents else LOOKUP_NO_PARENTS, params)).one()
    run_info = {name: _Run(*values) for name, *values in zip(
        found.names, found.run_ids, found.group_sizes, found.vocab_sizes, found.published)}
    return (run_info, {uuid.UUID(group) for group in found.taken},
            dict(zip(found.parent_ids, found.parent_runs)), found.ids)


def _admit(group: Sequence[Experience], index: int, run_info: dict[str, _Run]) -> _Admitted:
    check_group_shape(group, index)
    first = group[0]
    if first.run not in run_info:
        raise ExperienceInvalid(
            f"group {index} row 0: field 'run' = {first.run!r}: the run does not exist "
            "(create it first); nothing of this group was written",
            group_index=index, row_index=0, field="run")
    run = run_info[first.run]
    if run.group_size is not None and len(group) != run.group_size:
        raise ExperienceInvalid(
            f"group {index}: {len(group)} rows, but run {first.run!r} declares group_size "
            f"{run.group_size}; nothing of this group was written",
            group_index=index, row_index=None, field="group_size")
    version = first.policy_version
    if isinstance(version, int) and not isinstance(version, bool) and version > run.published:
        raise ExperienceInvalid(
            f"group {index} row 0: field 'policy_version' = {version}: run {first.run!r} has "
            f"published no version past {run.published} (a row is made by published weights); "
            "nothing of this group was written", group_index=index, row_index=0,
            field="policy_version")
    return _Admitted(index, run, first.group_id or uuid.uuid4(), group)


async def _rows_per_run(engine: AsyncEngine, groups) -> Counter:
    """Rows each run would get if every group passed (what flow control waits for room for)."""
    names = Counter()
    for group in groups:
        if _looks_like_group(group):
            names[group[0].run] += len(group)
    known = [name for name in names if isinstance(name, str)]
    if not known:
        return Counter()
    async with engine.connect() as conn:
        ids = {row.name: row.id for row in await conn.execute(runs.lookup(known))}
    return Counter({ids[name]: n for name, n in names.items() if name in ids})


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
