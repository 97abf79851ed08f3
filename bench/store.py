"""Reservoir's store against bare asyncpg on the same PostgreSQL, measured in the same run.

What is compared (rows/s, and the ratio Reservoir / bare; the target is >= 0.8 for both):

(a) write: `Store.write_groups` of `Experience` objects (numpy arrays, as an explorer hands them
    over) against asyncpg's binary `copy_records_to_table` of identical rows into tables of
    the store's own layout (`experience_data` + `experience_state`, two COPYs a call). The
    writer's cost per row (its time minus the bare time, per row) is printed.
(b) lease+commit: `Store.lease(run, rows=B)` + `Store.commit_step(...)` against a bare loop of
    `UPDATE ... WHERE id IN (SELECT ... FOR UPDATE SKIP LOCKED) RETURNING ...`, one statement
    (one transaction) per batch, returning the columns the sampler returns, on a queue table of
    one wide row per experience (the store's layout before migration 0012: data and state in
    one row, with that table's indexes). Two diagnostic lines: the lease part of the same loop
    timed on its own, and lease+commit against a bare loop that also commits what a step
    commit writes (the rows consumed, a step row, one ledger row per row with its two keys
    checked as foreign keys, in one statement and a transaction of its own), on a second queue
    of its own. Reservoir's lease and step commit are one statement each, committed alone, and
    the ledger's keys are statement triggers (migration 0017). A third diagnostic: the lease a
    trainer makes, `Store.lease(run, groups=B / group size)` + commit, against the bare loop.
(c) scaling: 1, 2 and 4 writer processes at once, each writing its own rows through
    `Store.write_groups` or the bare COPY; rows/s of all of them together, and the ratio.
(d) many runs: Reservoir's writes and lease + commits of the bench run on a store of 200 more
    (empty) runs (`--other-runs`), against the same just before on the store of this run
    alone: each run is three partitions, and a statement that reads a parent without naming
    its runs plans and locks all of them.

Why it is fair:
- Both sides write to the same server and database, into tables of the same shape: the bare
  tables are `LIKE experience_data / experience_state INCLUDING ALL` (columns, generated
  columns, column storage, CHECK constraints, indexes) plus the same keys, their own id
  sequence and the run partitions' storage parameters (migration 0021's rows up to a page
  whole); the script checks the catalog and stops if anything differs. The keys the store
  checks once a statement (to runs, a state row's to its data row: migration 0022) are
  foreign keys on the bare tables, checked a row at a time, as PostgreSQL checks them.
- The rows are identical (one seeded pool; the first row of each table is compared byte for
  byte), and both sides send the same number of rows per call (COPY or write_groups).
- The bare COPY gets its rows pre-encoded (bytes, JSON text) before timing: the baseline is the
  driver and server cost alone; Reservoir's validation and encoding count against Reservoir.
- The bare lease filters on `run_id` and `status = 'ready'` and orders by id, like the
  sampler's FIFO lease of rows, so the same indexes can serve both; the plans are printed.
- The sides take turns call by call: a write call of Reservoir, then one of the bare COPY (the
  order flips every call), and a lease batch of each lease loop in turn, so that both sides
  see the machine in the same state; the lease tables start with the same number of ready rows. Rows/s are medians of repeats; a ratio is the median of
  the repeats' own ratios (each compares two runs minutes apart, so the machine's speed, which
  drifts by tens of percent here, moves both), printed with their range and with the ratio of
  the medians.

    python bench/store.py --url postgresql://postgres@127.0.0.1:5432/bench_store
    python bench/store.py            # embedded server under ./.reservoir/pg
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import statistics
import sys
import time
import uuid
from datetime import timedelta
from dataclasses import dataclass, field
from itertools import count

import asyncpg
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import make_url

from reservoir.config import ReservoirConfig, SamplerConfig, StoreConfig
from reservoir.errors import StoreError
from reservoir.store import Experience, Store, codec
from reservoir.plan.urls import redact
from reservoir.store.retry import describe_outage, is_outage
from reservoir.store.runs import delete_run
from reservoir.store.sampler import lease_statement
from reservoir.store.writer import COPY_DATA_COLUMNS, COPY_STATE_COLUMNS

BARE_DATA, BARE_STATE = "bench_bare_data", "bench_bare_state"
# Each bare COPY table with the store's parent table whose run partition it copies.
BARE_OF = (("experience_data", BARE_DATA), ("experience_state", BARE_STATE))
BARE_QUEUE = "bench_bare_queue"  # one wide row per experience: the layout before 0012
# A second queue like the first, with a step table and a ledger keyed to both: the bare loop
# that also commits (diagnostic), kept apart so that neither queue's leases age the other.
BARE_LEDGER_QUEUE, BARE_STEPS, BARE_ITEMS = ("bench_bare_ledger_queue", "bench_bare_steps",
                                             "bench_bare_items")
QUEUES = (BARE_QUEUE, BARE_LEDGER_QUEUE)
TOKENS = 256
VOCAB = 32_000
TARGET = 0.8
WRITERS = (1, 2, 4)
RETURNED = ("id, run_id, task_id, group_id, policy_version, reward, reward_components, "
            "times_sampled, prompt_ids, response_ids, logprobs, action_mask, shaped_reward, "
            "leased_until")
console = Console(width=None if sys.stdout.isatty() else 120)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="PostgreSQL URL (default: RESERVOIR_DB_URL, else embedded)")
    p.add_argument("--rows", type=int, default=200_000,
                   help="ready rows in each table before the lease measurement")
    p.add_argument("--write-rows", type=int, default=50_000, help="rows per write repeat")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--batch", type=int, default=256, help="rows per lease")
    p.add_argument("--write-batch-groups", type=int, default=64,
                   help="groups per write_groups call (and rows per COPY / group size)")
    p.add_argument("--lease-batches", type=int, default=100, help="leases per repeat and side")
    p.add_argument("--scaling-rows", type=int, default=20_000,
                   help="rows each writer process writes in the scaling measurement")
    p.add_argument("--other-runs", type=int, default=200,
                   help="empty runs created for the many-runs measurement (0: skip it)")
    p.add_argument("--repeat", type=int, default=3, help="repeats; the median is reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the bench run and the bare tables")
    args = p.parse_args()
    if args.group_size < 1 or args.batch < 1 or args.batch % args.group_size:
        p.error(f"--batch {args.batch} must be a positive multiple of --group-size "
                f"{args.group_size} (a lease of whole groups)")
    return args


# --- input rows -----------------------------------------------------------------------------


def _texts(rng: np.random.Generator, n: int) -> list[str]:
    """n lowercase texts of 100 to 300 characters."""
    alphabet = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz  .,", dtype=np.uint8)
    lengths = rng.integers(100, 301, size=n)
    blob = alphabet[rng.integers(0, alphabet.size, size=int(lengths.sum()))].tobytes().decode()
    ends = np.cumsum(lengths).tolist()
    return [blob[end - length:end] for end, length in zip(ends, lengths.tolist())]


@dataclass
class Pool:
    """Rows generated once: Experience groups for the writer, the same rows encoded for COPY."""

    groups: list[list[Experience]]
    encoded: list[list[tuple]]  # per group, per row: the encoded column values

    def records(self, run_id: int, start: int, stop: int, ids) -> tuple[list, list]:
        """COPY tuples (COPY_DATA_COLUMNS, COPY_STATE_COLUMNS order) of groups[start:stop], with ids
        from `ids` and fresh group ids."""
        data, state = [], []
        for group in self.encoded[start:stop]:
            group_id = uuid.uuid4()
            for index, row in enumerate(group):
                row_id = next(ids)
                data.append((row_id, run_id, None, *row, "{}", None, None, group_id, index))
                state.append((row_id, run_id, 0, "ready"))
        return data, state


def make_pool(run: str, n_groups: int, group_size: int, seed: int) -> Pool:
    n = n_groups * group_size
    rng = np.random.default_rng(seed)
    prompt_ids = rng.integers(0, VOCAB, size=(n, TOKENS), dtype=np.int32)
    response_ids = rng.integers(0, VOCAB, size=(n, TOKENS), dtype=np.int32)
    logprobs = -(rng.exponential(1.0, size=(n, TOKENS)) + 1e-4).astype(np.float32)
    mask = np.ones((n, TOKENS), dtype=np.uint8)
    accuracy, fmt = rng.integers(0, 2, size=n).astype(float), rng.random(n) * 0.1
    prompts, responses = _texts(rng, n), _texts(rng, n)
    groups, encoded = [], []
    for g in range(n_groups):
        rows = range(g * group_size, (g + 1) * group_size)
        groups.append([Experience(
            run=run, prompt_text=prompts[i], response_text=responses[i],
            prompt_ids=prompt_ids[i], response_ids=response_ids[i], logprobs=logprobs[i],
            action_mask=mask[i], reward=accuracy[i] + fmt[i],
            reward_components={"accuracy": accuracy[i], "format": fmt[i]}) for i in rows])
        encoded.append([(
            prompts[i], responses[i], codec.encode(prompt_ids[i], codec.TOKEN),
            codec.encode(response_ids[i], codec.TOKEN), codec.encode(logprobs[i], codec.LOGPROB),
            codec.encode(mask[i], codec.MASK), float(accuracy[i] + fmt[i]),
            json.dumps({"accuracy": accuracy[i], "format": fmt[i]})) for i in rows])
    return Pool(groups, encoded)


# --- the bare side: one asyncpg connection on its own event loop ----------------------------


def asyncpg_args(url: str) -> dict:
    """asyncpg.connect arguments for a store URL (a Unix socket dir may sit in ?host=)."""
    parsed = make_url(url)
    return dict(host=parsed.query.get("host") or parsed.host, port=parsed.port,
                user=parsed.username, password=parsed.password, database=parsed.database)


QUEUE_COLUMNS = COPY_DATA_COLUMNS + COPY_STATE_COLUMNS[2:]


class Bare:
    LEASE = ("UPDATE {queue} SET status = 'leased', lease_token = {token}, "
             "leased_until = now() + make_interval(secs => {seconds}) "
             "WHERE id IN (SELECT id FROM {queue} WHERE run_id = {run_id} "
             "AND status = 'ready' ORDER BY created_at, id LIMIT {batch} "
             f"FOR UPDATE SKIP LOCKED) RETURNING {RETURNED}")
    # What Reservoir's step commit does, in one statement: the leased rows become consumed, a
    # step row is inserted and one ledger row per row names both.
    COMMIT = f"""
        WITH consumed AS (
            UPDATE {BARE_LEDGER_QUEUE} SET status = 'consumed', times_sampled = times_sampled + 1,
                lease_token = NULL, leased_until = NULL
            WHERE lease_token = $1 RETURNING id, run_id
        ), step AS (
            INSERT INTO {BARE_STEPS} (run_id, step, policy_version, n_experiences)
            VALUES ($2, $3, 0, $4) RETURNING id
        ), items AS (
            INSERT INTO {BARE_ITEMS} (train_step_id, experience_id, run_id, policy_version)
            SELECT step.id, consumed.id, consumed.run_id, 0 FROM consumed CROSS JOIN step
            RETURNING 1
        )
        SELECT count(*) FROM items"""

    def __init__(self, url: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.conn: asyncpg.Connection = self.run(asyncpg.connect(**asyncpg_args(url)))

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def execute(self, sql: str, *args):
        return self.run(self.conn.execute(sql, *args))

    def fetch(self, sql: str, *args):
        return self.run(self.conn.fetch(sql, *args))

    def copy(self, records: tuple[list, list], rows_per_call: int) -> float:
        """COPY (data, state) records into the bare tables of the store's layout."""
        return self.run(self._copy(records, rows_per_call))

    async def _copy(self, records, rows_per_call) -> float:
        data, state = records
        start = time.perf_counter()
        for i in range(0, len(data), rows_per_call):
            async with self.conn.transaction():
                await self.conn.copy_records_to_table(
                    BARE_DATA, records=data[i:i + rows_per_call], columns=COPY_DATA_COLUMNS)
                await self.conn.copy_records_to_table(
                    BARE_STATE, records=state[i:i + rows_per_call], columns=COPY_STATE_COLUMNS)
        return time.perf_counter() - start

    def copy_queue(self, queue: str, records: tuple[list, list]) -> None:
        """The same rows into a one-table queue (for the lease baselines; untimed)."""
        rows = [d + s[2:] for d, s in zip(*records)]
        self.run(self.conn.copy_records_to_table(queue, records=rows, columns=QUEUE_COLUMNS))

    def lease(self, run_id: int, batches: int, batch: int, lease_seconds: float,
              steps=None) -> list[tuple[float, float]]:
        """Lease `batches` batches (and commit each as a step, given `steps`, a counter);
        per batch (lease seconds, lease+commit seconds)."""
        return self.run(self._lease(run_id, batches, batch, lease_seconds, steps))

    async def _lease(self, run_id, batches, batch, lease_seconds, steps) -> list[tuple]:
        queue = BARE_QUEUE if steps is None else BARE_LEDGER_QUEUE
        sql = self.LEASE.format(queue=queue, token="$1", run_id="$2", batch="$3", seconds="$4")
        times = []
        for _ in range(batches):
            start = time.perf_counter()
            token = uuid.uuid4()
            rows = await self.conn.fetch(sql, token, run_id, batch, lease_seconds)
            leased = time.perf_counter()
            if steps is not None and await self.conn.fetchval(
                    self.COMMIT, token, run_id, next(steps), batch) != batch:
                raise RuntimeError("bare commit consumed fewer rows than it leased")
            times.append((leased - start, time.perf_counter() - start))
            if len(rows) != batch:
                raise RuntimeError(f"bare lease returned {len(rows)} of {batch} rows")
        return times

    def close(self) -> None:
        self.run(self.conn.close())
        self.loop.close()


# --- the bare tables: identical to the store's ----------------------------------------------


CATALOG = """
SELECT 'column ' || attname || ' ' || format_type(atttypid, atttypmod) || ' storage='
       || attstorage::text || ' generated=' || attgenerated::text || ' not null=' || attnotnull
  FROM pg_attribute WHERE attrelid = $1::regclass AND attnum > 0 AND NOT attisdropped
UNION ALL
SELECT 'expression ' || a.attname || ' ' || pg_get_expr(d.adbin, d.adrelid)
  FROM pg_attrdef d JOIN pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
 WHERE d.adrelid = $1::regclass
UNION ALL
SELECT 'constraint ' || contype::text || ' ' || pg_get_constraintdef(oid)
  FROM pg_constraint WHERE conrelid = $1::regclass
UNION ALL
SELECT 'index unique=' || indisunique || ' ' || regexp_replace(pg_get_indexdef(indexrelid), '^.* USING ', '')
  FROM pg_index WHERE indrelid = $1::regclass
UNION ALL
SELECT 'storage parameters ' || coalesce(array_to_string(reloptions, ', '), 'none')
  FROM pg_class WHERE oid = $1::regclass
"""
# The one-table queue: the data columns (the group's among them) plus the state columns, keyed
# by id alone, with the indexes the experiences table had before migrations 0012 and 0013, and
# PostgreSQL's default storage: its arrays out of line past ~2 KB a row. A data partition keeps
# rows up to a page whole (migration 0021: it is written once); the queue rewrites the whole row
# on every lease, and inline it leased a batch of 256 rows 20% slower here (18.9 against 15.7 ms).
QUEUE = """
CREATE TABLE {queue} (LIKE experience_data INCLUDING ALL EXCLUDING INDEXES,
    PRIMARY KEY (id), policy_version integer NOT NULL,
    status text NOT NULL DEFAULT 'ready', priority float8 NOT NULL DEFAULT 0,
    times_sampled integer NOT NULL DEFAULT 0, lease_token uuid, leased_until timestamptz,
    created_at timestamptz NOT NULL DEFAULT now(),
    CHECK ((status = 'leased') = (lease_token IS NOT NULL)));
CREATE INDEX ON {queue} (task_id);
CREATE INDEX ON {queue} (parent_id) WHERE parent_id IS NOT NULL;
CREATE INDEX ON {queue} (run_id, created_at, id) WHERE status = 'ready';
CREATE INDEX ON {queue} (run_id, priority DESC, id) WHERE status = 'ready';
CREATE INDEX ON {queue} (leased_until) WHERE status = 'leased';
CREATE UNIQUE INDEX ON {queue} (group_id, group_row);
CREATE INDEX ON {queue} (run_id, status);
CREATE INDEX ON {queue} (lease_token) WHERE lease_token IS NOT NULL;
"""


# The bare ledger: train_steps' columns a commit fills and batch_items' with their keys (the
# experience key names the queue, a plain table, as the store's names the run's state partition).
LEDGER = f"""
CREATE TABLE {BARE_STEPS} (id bigserial PRIMARY KEY,
    run_id bigint NOT NULL REFERENCES runs (id) ON DELETE CASCADE, step integer NOT NULL,
    policy_version integer NOT NULL, n_experiences integer NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(), UNIQUE (run_id, step));
CREATE TABLE {BARE_ITEMS} (
    train_step_id bigint NOT NULL REFERENCES {BARE_STEPS} (id) ON DELETE CASCADE,
    experience_id bigint NOT NULL REFERENCES {BARE_LEDGER_QUEUE} (id) ON DELETE CASCADE,
    policy_version integer NOT NULL, weight float8 NOT NULL DEFAULT 1, run_id bigint NOT NULL,
    PRIMARY KEY (train_step_id, experience_id, run_id));
CREATE INDEX ON {BARE_ITEMS} (experience_id);
"""


def create_bare_tables(bare: Bare, run_id: int) -> str:
    """Create the bare tables like the store's, with their FKs; return a summary."""
    bare.execute(f"""
        DROP TABLE IF EXISTS {BARE_STATE}, {BARE_DATA}, {BARE_ITEMS}, {BARE_STEPS},
            {BARE_QUEUE}, {BARE_LEDGER_QUEUE};
        CREATE TABLE {BARE_DATA} (LIKE experience_data INCLUDING ALL,
            FOREIGN KEY (run_id) REFERENCES runs (id) ON DELETE CASCADE,
            FOREIGN KEY (task_id) REFERENCES tasks (id) ON DELETE SET NULL);
        CREATE TABLE {BARE_STATE} (LIKE experience_state INCLUDING ALL,
            CONSTRAINT experience_state_data FOREIGN KEY (run_id, id)
                REFERENCES {BARE_DATA} (run_id, id) ON DELETE CASCADE,
            FOREIGN KEY (run_id) REFERENCES runs (id) ON DELETE CASCADE);
        ALTER TABLE {BARE_DATA} ADD FOREIGN KEY (parent_run_id, parent_id)
            REFERENCES {BARE_STATE} (run_id, id) ON DELETE SET NULL;""")
    for ours, theirs in BARE_OF:
        [options] = bare.fetch("SELECT reloptions FROM pg_class WHERE oid = $1::regclass",
                               f"{ours}_r{run_id}")[0]
        if options:  # the partition's storage parameters (LIKE copies none)
            bare.execute(f"ALTER TABLE {theirs} SET ({', '.join(options)})")
    for queue in QUEUES:
        bare.execute(QUEUE.format(queue=queue))
    bare.execute(LEDGER)
    return check_same_shape(bare, run_id)


def _catalog(bare: Bare, table: str) -> list[str]:
    """The table's catalog lines, with the names of the store's run partitions and of the bare
    tables both written as the store's parent tables."""
    lines = [row[0] for row in bare.fetch(CATALOG, table)]
    return sorted(re.sub(r"(experience_(?:data|state))_r\d+", r"\1",
                         re.sub(r"nextval\('[^']*'::regclass\)", "nextval(<seq>)", line))
                  .replace(BARE_DATA, "experience_data").replace(BARE_STATE, "experience_state")
                  for line in lines)


# The store's keys that are statement triggers (migration 0022: one query a statement): the bare
# tables hold them as foreign keys, checked a row at a time.
KEYS_AS_TRIGGERS = (
    "constraint f FOREIGN KEY (run_id) REFERENCES runs(id) ON DELETE CASCADE",
    "constraint f FOREIGN KEY (run_id, id) REFERENCES experience_data(run_id, id) "
    "ON DELETE CASCADE",
)


def check_same_shape(bare: Bare, run_id: int) -> str:
    """The bare tables against the run's partitions, which the writer COPYs into: columns,
    constraints and indexes, and storage parameters; the store's keys that are triggers are
    foreign keys on the bare tables."""
    summary = []
    for ours, theirs in BARE_OF:
        mine = _catalog(bare, f"{ours}_r{run_id}")
        bares = [line for line in _catalog(bare, theirs) if line not in KEYS_AS_TRIGGERS]
        if mine != bares:
            diff = sorted(set(mine) ^ set(bares))
            raise SystemExit(f"{theirs} does not match {ours}:\n  " + "\n  ".join(diff))
        n = {kind: sum(line.startswith(kind) for line in mine)
             for kind in ("column", "constraint", "index")}
        summary.append(f"{ours}: {n['column']} columns, {n['constraint']} constraints, "
                       f"{n['index']} indexes")
    return ("; ".join(summary) + ": same as the store's (the store's keys to runs and to the "
            "data row, statement triggers there, are foreign keys here)")


def check_same_rows(bare: Bare, run_id: int) -> None:
    """The first row each side wrote came from the same pool row: compare the stored values."""
    columns = ("prompt_text, response_text, prompt_ids, response_ids, logprobs, action_mask, "
               "reward, reward_components, metadata, status, prompt_len, response_len")
    sides = ("experience_data d JOIN experience_state s USING (id, run_id)",
             f"{BARE_DATA} d JOIN {BARE_STATE} s USING (id, run_id)")
    first = [bare.fetch(f"SELECT {columns} FROM {side} WHERE run_id = $1 ORDER BY id LIMIT 1",
                        run_id)[0] for side in sides]
    if tuple(first[0]) != tuple(first[1]):
        raise SystemExit("the writer and the bare COPY stored different values for one row")


# --- measurements ---------------------------------------------------------------------------


@dataclass
class Measure:
    side: str
    rates: list[float] = field(default_factory=list)
    batch_ms: list[float] = field(default_factory=list)

    repeat_seconds: float = 0.0

    def add(self, rows: int, seconds: float, batch_times: list[float] | None = None) -> None:
        self.rates.append(rows / seconds)
        self.batch_ms.extend(t * 1000 for t in batch_times or [])

    def start_repeat(self) -> None:
        self.repeat_seconds = 0.0

    def add_batch(self, seconds: float) -> None:
        self.repeat_seconds += seconds
        self.batch_ms.append(seconds * 1000)

    def end_repeat(self, rows: int) -> None:
        self.rates.append(rows / self.repeat_seconds)

    @property
    def rate(self) -> float:
        return statistics.median(self.rates)


def timed_writes(store: Store, groups: list[list[Experience]], groups_per_call: int) -> float:
    start = time.perf_counter()
    for i in range(0, len(groups), groups_per_call):
        store.write_groups(groups[i:i + groups_per_call])
    return time.perf_counter() - start


def timed_leases(store: Store, run: str, batches: int, batch: int, steps,
                 group_size: int | None = None) -> list[tuple]:
    """Lease and commit `batches` batches of `batch` rows (whole groups of `group_size`, given
    one); per batch (lease seconds, lease+commit seconds)."""
    times = []
    for _ in range(batches):
        start = time.perf_counter()
        lease = (store.lease(run, rows=batch) if group_size is None
                 else store.lease(run, groups=batch // group_size))
        leased = time.perf_counter()
        store.commit_step(lease, step=next(steps), policy_version=0)
        times.append((leased - start, time.perf_counter() - start))
        if len(lease.rows) != batch:
            raise RuntimeError(f"Reservoir lease returned {len(lease.rows)} of {batch} rows")
    return times


def measure_writes(store: Store, bare: Bare, pool: Pool, run_id: int, args) -> list[Measure]:
    ours, theirs = Measure("reservoir"), Measure("bare COPY")
    rows = len(pool.groups) * args.group_size
    per_call = args.write_batch_groups * args.group_size
    ids = count(1)
    step = args.write_batch_groups
    for r in range(args.repeat):
        data, state = pool.records(run_id, 0, len(pool.groups), ids)  # untimed: the baseline's input
        seconds = [0.0, 0.0]
        for call, start in enumerate(range(0, len(pool.groups), step)):  # the sides take turns
            rows_of = slice(start * args.group_size, (start + step) * args.group_size)
            sides = [(0, lambda: timed_writes(store, pool.groups[start:start + step], step)),
                     (1, lambda: bare.copy((data[rows_of], state[rows_of]), per_call))]
            for side, write in sides if (call + r) % 2 == 0 else sides[::-1]:
                seconds[side] += write()
        ours.add(rows, seconds[0])
        theirs.add(rows, seconds[1])
        console.print(f"  write repeat {r + 1}: reservoir {ours.rates[-1]:,.0f} rows/s, "
                      f"bare COPY {theirs.rates[-1]:,.0f} rows/s")
    return [ours, theirs]


def measure_leases(store: Store, bare: Bare, run: str, run_id: int, args) -> dict:
    """Lease+commit against the bare loop (the target), the lease part alone against it,
    lease+commit against a bare loop that commits the same step and ledger rows, and the lease
    of whole groups (a trainer's) + commit against the bare loop."""
    ours = Measure("reservoir")
    lease_part = Measure("reservoir (lease part)")
    ours_groups = Measure("reservoir, whole groups")
    theirs = Measure("bare UPDATE..RETURNING, one-table queue")
    theirs_committed = Measure("bare UPDATE..RETURNING + step and ledger rows")
    rows, steps, bare_steps = args.lease_batches * args.batch, count(1), count(1)

    def reservoir_side():
        [(lease, total)] = timed_leases(store, run, 1, args.batch, steps)
        ours.add_batch(total)
        lease_part.add_batch(lease)

    def reservoir_groups_side():
        [(_, total)] = timed_leases(store, run, 1, args.batch, steps, args.group_size)
        ours_groups.add_batch(total)

    def bare_side():
        [(_, total)] = bare.lease(run_id, 1, args.batch, store.flow.lease_seconds)
        theirs.add_batch(total)

    def bare_committing_side():
        [(_, total)] = bare.lease(run_id, 1, args.batch, store.flow.lease_seconds, bare_steps)
        theirs_committed.add_batch(total)

    sides = [reservoir_side, bare_side, bare_committing_side, reservoir_groups_side]
    measures = (ours, lease_part, theirs, theirs_committed, ours_groups)
    for r in range(args.repeat):
        for measure in measures:
            measure.start_repeat()
        for batch in range(args.lease_batches):  # the loops take turns, batch by batch
            turn = (batch + r) % len(sides)
            for side in sides[turn:] + sides[:turn]:
                side()
        for measure in measures:
            measure.end_repeat(rows)
        console.print(f"  lease repeat {r + 1}: reservoir lease+commit {ours.rates[-1]:,.0f} "
                      f"rows/s (lease part {lease_part.rates[-1]:,.0f}), bare "
                      f"{theirs.rates[-1]:,.0f} rows/s, bare with step and ledger "
                      f"{theirs_committed.rates[-1]:,.0f} rows/s, reservoir whole groups "
                      f"{ours_groups.rates[-1]:,.0f} rows/s")
    return {"lease+commit": [ours, theirs], "lease only": [lease_part, theirs],
            "lease+commit, same ledger": [ours, theirs_committed],
            "lease+commit, whole groups": [ours_groups, theirs]}


def fill(store: Store, bare: Bare, pool: Pool, run_id: int, target: int, args) -> int:
    """Write through Reservoir and into both bare queues, one call each in turn, until each
    holds `target` ready rows."""
    have = bare.fetch(f"SELECT count(*) FROM {BARE_QUEUE} WHERE run_id = $1 "
                      "AND status = 'ready'", run_id)[0][0]
    per_call = args.write_batch_groups * args.group_size
    calls = max(0, -(-(target - have) // per_call))
    if calls == 0:
        return have
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn()]
    with Progress(*columns, console=console) as progress:
        ours = progress.add_task("fill: Reservoir writer", total=calls * per_call)
        theirs = progress.add_task("fill: bare queues", total=calls * per_call)
        ids = count(10**9)
        for call in range(calls):
            start = call * args.write_batch_groups % len(pool.groups)
            stop = start + args.write_batch_groups
            store.write_groups(pool.groups[start:stop])
            progress.advance(ours, per_call)
            for queue in QUEUES:
                bare.copy_queue(queue, pool.records(run_id, start, stop, ids))
            progress.advance(theirs, per_call)
    return have + calls * per_call


def settle(bare: Bare) -> None:
    """Same starting state for both tables: visibility map set, planner statistics fresh."""
    for table in ("experience_data", "experience_state") + QUEUES:
        bare.execute(f"VACUUM (ANALYZE, PROCESS_TOAST FALSE) {table}")


def environment(bare: Bare, store: Store, run_id: int, config: ReservoirConfig,
                args) -> list[str]:
    version = bare.fetch("SHOW server_version")[0][0]
    names = ["shared_buffers", "synchronous_commit", "fsync", "autovacuum", "max_wal_size"]
    settings = bare.fetch("SELECT name, current_setting(name) FROM unnest($1::text[]) AS name",
                          names)
    others = bare.fetch("SELECT count(*) FROM experience_state WHERE run_id <> $1",
                        run_id)[0][0]
    where = (f"server at {redact(store.url)}" if config.store.resolved_url()
             else f"embedded ({config.store.data_dir})")
    return [
        f"PostgreSQL {version}, {where}",
        "settings: " + ", ".join(f"{name}={value}" for name, value in settings),
        f"experiences rows of other runs: {others:,}",
        f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}, asyncpg {asyncpg.__version__}",
        f"rows: {TOKENS} prompt + {TOKENS} response tokens; lease table >= {args.rows:,} ready "
        f"rows; lease batch {args.batch}; {args.lease_batches} leases per repeat and side; write "
        f"{args.write_batch_groups} groups x {args.group_size} rows per call; "
        f"{args.repeat} repeats (median reported); seed {args.seed}",
    ]


def _scans(plan: dict) -> list[str]:
    """The scans of an EXPLAIN (FORMAT JSON) plan, e.g. 'Index Scan experiences_pkey + filter'."""
    node, found = plan, []
    if "Relation Name" in node:
        found.append(f"{node['Node Type']} {node.get('Index Name') or node['Relation Name']}"
                     + (" + filter" if "Filter" in node else ""))
    for child in node.get("Plans", []):
        found.extend(_scans(child))
    return found


def plan_lines(bare: Bare, store: Store, run_id: int, batch: int) -> list[str]:
    """How the server runs each side's lease now (EXPLAIN, nothing executed)."""
    ours = lease_statement("rows", store.flow, False, (run_id,), batch).params(
        wanted=batch, token=uuid.uuid4(),
        lease_for=timedelta(seconds=store.flow.lease_seconds))
    reservoir_sql = str(ours.compile(dialect=postgresql.dialect(),
                                     compile_kwargs={"literal_binds": True}))
    sql = {
        "reservoir lease": reservoir_sql,
        "bare lease": Bare.LEASE.format(queue=BARE_QUEUE, token=f"'{uuid.uuid4()}'",
                                        run_id=run_id, batch=batch,
                                        seconds=store.flow.lease_seconds),
        "commit_step's rows (by id and token)": "SELECT id FROM experience_state WHERE "
                                                f"run_id = {run_id} AND id = ANY('{{1,2}}') "
                                                f"AND lease_token = '{uuid.uuid4()}'",
    }
    lines = []
    for name, statement in sql.items():
        plan = json.loads(bare.fetch(f"EXPLAIN (FORMAT JSON) {statement}")[0][0])[0]["Plan"]
        lines.append(f"plan, {name}: " + ", ".join(_scans(plan)))
    return lines


def drift_note(bare_lease: Measure, plans: list[str]) -> None:
    first, last = bare_lease.rates[0], bare_lease.rates[-1]
    if last >= 0.7 * first:
        return
    walk = any("pkey + filter" in line for line in plans)
    console.print(
        f"note: the bare lease fell from {first:,.0f} to {last:,.0f} rows/s over the repeats as "
        "leased and consumed rows piled up ahead of the ready ones"
        + ("; a scan of the primary key with a status filter walks all of them on every lease"
           if walk else ""), highlight=False)


# --- report and clean-up --------------------------------------------------------------------


def _percentile(values: list[float], q: float) -> str:
    return f"{np.percentile(values, q):.1f}" if values else "-"


def paired_ratios(ours: Measure, theirs: Measure) -> list[float]:
    """Reservoir / bare within each repeat: the two sides ran minutes apart at most, so a
    machine that speeds up or slows down between repeats moves both."""
    return [o / t for o, t in zip(ours.rates, theirs.rates)]


def report(pairs: dict[str, list[Measure]], args) -> None:
    table = Table(title=f"Reservoir vs bare asyncpg, rows/s (median of {args.repeat} repeats; "
                        "ratio: median of the repeats' ratios, and their range)")
    for name in ("measurement", "side", "median rows/s", "per repeat", "ms/batch p50",
                 "ms/batch p99", "ratio", "range"):
        table.add_column(name, justify="left" if name in ("measurement", "side") else "right")
    shown = set()
    for what, (ours, theirs) in pairs.items():
        for m in (ours, theirs):
            if id(m) in shown:
                continue
            shown.add(id(m))
            ratios = paired_ratios(ours, theirs)
            table.add_row(what, m.side, f"{m.rate:,.0f}", " ".join(f"{r:,.0f}" for r in m.rates),
                          _percentile(m.batch_ms, 50), _percentile(m.batch_ms, 99),
                          f"{statistics.median(ratios):.2f}" if m is ours else "",
                          f"{min(ratios):.2f}-{max(ratios):.2f}" if m is ours else "")
    console.print(table)
    for what, (ours, theirs) in pairs.items():
        goal = f"target >= {TARGET}" if what in ("write", "lease+commit") else "diagnostic"
        ratios = paired_ratios(ours, theirs)
        print(f"{what}: reservoir {ours.rate:,.0f} rows/s | {theirs.side} {theirs.rate:,.0f} "
              f"rows/s | ratio {statistics.median(ratios):.2f} (repeats {min(ratios):.2f}-"
              f"{max(ratios):.2f}, of the medians {ours.rate / theirs.rate:.2f}; {goal})")
    ours, theirs = pairs["write"]
    print(f"writer cost per row: reservoir {1e6 / ours.rate:.1f} us, bare COPY "
          f"{1e6 / theirs.rate:.1f} us, Reservoir's own {1e6 / ours.rate - 1e6 / theirs.rate:.1f} "
          "us (validation, encoding, ids)")


NOTES = """\
notes: the bare COPY's rows were encoded (bytes, JSON text) before timing and its ids are
  counted in Python, so the baseline is the driver and server cost alone; Reservoir's
  validation, encoding and id draw are timed. The bare tables check the rows' keys (to runs,
  state to data) as foreign keys, a query a row; the store checks them once a statement
  (migration 0022). The bare lease is one UPDATE .. RETURNING per
  batch (its own transaction) on a one-table queue (each lease rewrites the wide row) and
  commits no step; Reservoir's lease+commit rewrites the narrow state row twice and writes
  the step and one ledger row per experience. "same ledger" is a bare loop that commits
  those too (its ledger keys are foreign keys), in a second transaction a batch like
  Reservoir's. Scaling: each writer is a process of its own with its own connection; rows/s
  is all rows over the time from the first start to the last end."""


def cleanup(store: Store, bare: Bare, run: str, run_id: int) -> None:
    start = time.perf_counter()
    bare.execute(f"DROP TABLE IF EXISTS {BARE_STATE}, {BARE_DATA}, {BARE_ITEMS}, {BARE_STEPS}, "
                 f"{', '.join(QUEUES)}")
    rows = bare.fetch("SELECT count(*) FROM experience_state WHERE run_id = $1", run_id)[0][0]
    with store.engine.begin() as conn:  # the run's partitions are dropped, not its rows deleted
        delete_run(conn, run)
    console.print(f"clean-up: dropped the bare tables, deleted run {run} and its {rows:,} "
                  f"experiences in {time.perf_counter() - start:.1f}s")


# --- main -----------------------------------------------------------------------------------


def run_bench(store: Store, bare: Bare, run: str, run_id: int, args) -> dict[str, list[Measure]]:
    console.print("bare tables: " + create_bare_tables(bare, run_id))
    started = time.perf_counter()
    calls = -(-args.write_rows // (args.write_batch_groups * args.group_size))
    pool = make_pool(run, calls * args.write_batch_groups, args.group_size, args.seed)
    console.print(f"input: {len(pool.groups) * args.group_size:,} rows generated in "
                  f"{time.perf_counter() - started:.1f}s")
    pairs = {"write": measure_writes(store, bare, pool, run_id, args)}
    check_same_rows(bare, run_id)
    target = max(args.rows, (3 * args.repeat * args.lease_batches + 1) * args.batch)
    ready = fill(store, bare, pool, run_id, target, args)
    settle(bare)
    console.print(f"lease tables: {ready:,} ready rows each (run {run})")
    pairs.update(measure_leases(store, bare, run, run_id, args))
    plans = plan_lines(bare, store, run_id, args.batch)
    for line in plans:
        console.print(line, highlight=False)
    drift_note(pairs["lease+commit"][1], plans)
    if args.other_runs:
        pairs.update(measure_other_runs(store, pool, run, args))
    for writers in WRITERS:
        pairs[f"{writers} writer{'s' if writers > 1 else ''}"] = measure_scaling(
            store.url, run, run_id, writers, args)
    return pairs


# --- a store of many runs -------------------------------------------------------------------


def _reservoir_round(store: Store, pool: Pool, run: str, calls: int, args, steps,
                     write: Measure, lease: Measure) -> None:
    """`calls` write calls and `calls` lease + commit batches of the bench run, timed."""
    per_call = args.write_batch_groups
    write.add(calls * per_call * args.group_size,
              timed_writes(store, pool.groups[:calls * per_call], per_call))
    lease.start_repeat()
    for _ in range(calls):
        [(_, total)] = timed_leases(store, run, 1, args.batch, steps)
        lease.add_batch(total)
    lease.end_repeat(calls * args.batch)


def measure_other_runs(store: Store, pool: Pool, run: str, args) -> dict:
    """Reservoir's writes and lease + commits of the bench run on a store of `--other-runs`
    more (empty) runs, against the same on the store of this run alone, measured just before:
    a statement that reads a parent table without naming the run plans every run's
    partitions."""
    calls = max(5, args.lease_batches // 5)
    steps = count(10**6)
    alone_write, alone_lease = Measure("reservoir, store of one run"), \
        Measure("reservoir, store of one run")
    many_write, many_lease = Measure(f"reservoir, {args.other_runs} more runs"), \
        Measure(f"reservoir, {args.other_runs} more runs")
    for _ in range(args.repeat):
        _reservoir_round(store, pool, run, calls, args, steps, alone_write, alone_lease)
    started = time.perf_counter()
    others = [f"{run}-other-{i}" for i in range(args.other_runs)]
    for name in others:
        store.create_run(name, group_size=args.group_size)
    console.print(f"many runs: created {len(others)} empty runs in "
                  f"{time.perf_counter() - started:.1f}s")
    try:
        for r in range(args.repeat):
            _reservoir_round(store, pool, run, calls, args, steps, many_write, many_lease)
            console.print(f"  many runs, repeat {r + 1}: write {many_write.rates[-1]:,.0f} rows/s "
                          f"(alone {alone_write.rates[r]:,.0f}), lease+commit "
                          f"{many_lease.rates[-1]:,.0f} rows/s (alone {alone_lease.rates[r]:,.0f})")
    finally:  # one run a transaction: dropping 600 partitions at once runs out of locks
        for name in others:
            with store.engine.begin() as conn:
                delete_run(conn, name)
    return {f"write, {args.other_runs} more runs": [many_write, alone_write],
            f"lease+commit, {args.other_runs} more runs": [many_lease, alone_lease]}


# --- N writer processes ---------------------------------------------------------------------


def _writer_process(side: str, url: str, run: str, run_id: int, rows: int, seed: int, args,
                    ready, results) -> None:
    """One writer: make its rows (untimed), wait for the others, write, report its times."""
    per_call = args.write_batch_groups
    pool = make_pool(run, rows // args.group_size, args.group_size, seed)
    config = ReservoirConfig(store=StoreConfig(url=url), sampler=SamplerConfig(unit="rows"))
    store = Store.open(config, quiet=True) if side == "reservoir" else None
    bare = Bare(url) if side == "bare" else None
    records = pool.records(run_id, 0, len(pool.groups), count(seed * 10**5)) if bare else None
    ready.wait()
    start = time.time()
    try:
        if store is not None:
            timed_writes(store, pool.groups, per_call)
            store.close()
        else:
            bare.copy(records, per_call * args.group_size)
            bare.close()
    except Exception as exc:
        results.put(exc)
        raise
    results.put((start, time.time()))


def measure_scaling(url: str, run: str, run_id: int, writers: int, args) -> list[Measure]:
    """Rows/s of `writers` processes writing at once, through Reservoir and bare (alternating)."""
    ours, theirs = Measure("reservoir"), Measure("bare COPY")
    context = multiprocessing.get_context("spawn")
    rows = args.scaling_rows // (args.write_batch_groups * args.group_size) \
        * args.write_batch_groups * args.group_size
    for r in range(args.repeat):
        for side, measure in ((("reservoir", ours), ("bare", theirs)) if r % 2 == 0
                              else (("bare", theirs), ("reservoir", ours))):
            ready, results = context.Barrier(writers + 1), context.Queue()
            procs = [context.Process(target=_writer_process, args=(
                side, url, run, run_id, rows, 10_000 * writers + 1000 * (r + 1) + w, args, ready,
                results))
                for w in range(writers)]
            for proc in procs:
                proc.start()
            ready.wait()
            times = [results.get(timeout=600) for _ in procs]
            for proc in procs:
                proc.join()
            for failed in (t for t in times if isinstance(t, Exception)):
                raise SystemExit(f"a {side} writer process failed: {failed}")
            measure.add(rows * writers, max(e for _, e in times) - min(s for s, _ in times))
        console.print(f"  {writers} writer(s), repeat {r + 1}: reservoir {ours.rates[-1]:,.0f} "
                      f"rows/s, bare COPY {theirs.rates[-1]:,.0f} rows/s")
    return [ours, theirs]


def main() -> None:
    args = parse_args()
    config = ReservoirConfig(store=StoreConfig(url=args.url), sampler=SamplerConfig(unit="rows"))
    store = Store.open(config, migrate=True)
    bare = Bare(store.url)
    run = f"bench-{int(time.time())}"
    run_id = store.create_run(run, group_size=args.group_size)
    try:
        for line in environment(bare, store, run_id, config, args):
            console.print(line, highlight=False)
        pairs = run_bench(store, bare, run, run_id, args)
        report(pairs, args)
        print(NOTES)
    finally:
        if args.keep:
            console.print(f"kept run {run} and the bare tables")
        else:
            cleanup(store, bare, run, run_id)
        bare.close()
        store.close()


def run_main(script: str, bench_main) -> None:
    """A bench's main, where a server that cannot be reached or opened ends in one line."""
    try:
        bench_main()
    except Exception as exc:
        if not (isinstance(exc, StoreError) or is_outage(exc)):
            raise
        raise SystemExit(f"bench/{script}: {describe_outage(exc)}") from None


if __name__ == "__main__":
    run_main("store.py", main)
