"""Where a lease's and a step commit's server time goes, index by index, in the same run.

A lease rewrites each row's narrow state (ready -> leased) and the step commit rewrites it
again (leased -> consumed). Neither rewrite can be in place (HOT: both change `status`, which
the partial indexes read), so each new version takes an entry in every index whose predicate
it meets. Until migration 0020 the state row also held the group's id and row number under a
unique index (group_id, group_row, run_id), the dearest of those entries: the group ids are
random (uuid4), so its entries land on a different leaf page each, where the primary key's (ids
in order) share a few. 0020 moved them, with the index, to the write-once data row.

This bench copies the layout of a run's state partition (`CREATE TABLE .. (LIKE .. INCLUDING
ALL)`: the store's own columns, checks and indexes) into tables of a scratch schema, fills them
with the same rows, and times the two rewrites batch by batch, taking turns:

- `store`: the partition's layout as it is;
- `group index on the state row`: the same with the group's columns and unique index added
  back (the layout before 0020);

and the two ledgers a commit could write: one row per experience (batch_items' layout: its
primary key and experience index), against one row per step holding the ids and weights as
arrays. And what the group index serves: the lease a trainer makes, of whole groups (its
groups' leaders, their rows, their sizes), with the commit after it, on two more copies: the
store's, where the group's columns and index are on a write-once table of (id, run_id,
group_id, group_row) standing for the data partition (the index covering the id) and each
group lookup reads it and then the state row by id; and the layout before 0020. Both group
leases join that table by id, as the store's lease joins the data rows it returns.

Each statement is timed from the client, one at a time on one connection: the server's work
plus one round trip. Medians of the batches (the first tenth left out as warm-up); a ratio is
the store's time over the layout before 0020's.

    python bench/state_layout.py --url postgresql://postgres@127.0.0.1:5432/bench_store
    python bench/state_layout.py            # embedded server under ./.reservoir/pg
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

import asyncpg
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from reservoir.config import ReservoirConfig, SamplerConfig, StoreConfig
from reservoir.errors import StoreError
from reservoir.store import Store, partitions
from reservoir.store.runs import delete_run

from store import asyncpg_args, run_main  # bench/store.py

console = Console()
BEFORE = "group index on the state row"
LAYOUTS = ("store", BEFORE)
LEDGERS = ("one row per experience", "one row per step")
MAX_ROWS = 5_000_000  # rows of each layout's table

LEASE = """
UPDATE {table} SET status = 'leased', lease_token = $1, leased_until = now() + interval '10 min'
WHERE run_id = $2 AND id = ANY(ARRAY(
    SELECT id FROM {table} WHERE run_id = $2 AND status = 'ready'
    ORDER BY created_at, id LIMIT $3 FOR UPDATE SKIP LOCKED))
RETURNING id"""
COMMIT = """
UPDATE {table} SET status = 'consumed', times_sampled = times_sampled + 1, lease_token = NULL,
    leased_until = NULL
WHERE run_id = $2 AND id = ANY($3::bigint[]) AND lease_token = $1"""
# The sampler's lease of whole groups (fifo, sample_from ready, max_times_sampled 1), without
# the reclaim, the counters and the data columns, written for each layout. $1 token, $2 run,
# $3 groups.
_GROUP_LEASED = """
), sizes AS MATERIALIZED (
    SELECT g.group_id, (SELECT count(*) FROM {groups} m
                        WHERE m.group_id = g.group_id AND m.run_id = $2) AS n
    FROM (SELECT DISTINCT group_id FROM leased) g
)
SELECT l.id, sizes.n FROM leased l JOIN sizes USING (group_id)"""
GROUP_LEASE = {
    BEFORE: """
WITH picked AS (
    SELECT s.group_id FROM {state} s
    WHERE s.run_id = $2 AND s.status = 'ready' AND s.times_sampled < 1 AND NOT EXISTS (
        SELECT FROM {state} o WHERE o.group_id = s.group_id AND o.run_id = s.run_id
          AND (o.status IN ('raw', 'leased')
               OR o.group_row < s.group_row AND o.status = 'ready' AND o.times_sampled < 1))
    ORDER BY s.created_at, s.id LIMIT $3 FOR UPDATE SKIP LOCKED
), updated AS (
    UPDATE {state} SET status = 'leased', lease_token = $1,
        leased_until = now() + interval '10 min'
    WHERE run_id = $2 AND group_id = ANY(ARRAY(SELECT group_id FROM picked))
      AND status = 'ready' AND times_sampled < 1
    RETURNING id, run_id, group_id
), leased AS (
    SELECT u.id, u.group_id FROM updated u JOIN {data} d ON d.run_id = u.run_id AND d.id = u.id
""" + _GROUP_LEASED.format(groups="{state}"),
    "store": """
WITH picked AS (
    SELECT d.group_id FROM {state} s JOIN {data} d ON d.run_id = s.run_id AND d.id = s.id
    WHERE s.run_id = $2 AND s.status = 'ready' AND s.times_sampled < 1 AND NOT EXISTS (
        SELECT FROM {data} od JOIN {state} o ON o.run_id = od.run_id AND o.id = od.id
        WHERE od.group_id = d.group_id AND od.run_id = d.run_id
          AND (o.status IN ('raw', 'leased')
               OR od.group_row < d.group_row AND o.status = 'ready' AND o.times_sampled < 1))
    ORDER BY s.created_at, s.id LIMIT $3 FOR UPDATE OF s SKIP LOCKED
), updated AS (
    UPDATE {state} SET status = 'leased', lease_token = $1,
        leased_until = now() + interval '10 min'
    WHERE run_id = $2 AND id = ANY(ARRAY(
        SELECT id FROM {data}
        WHERE run_id = $2 AND group_id = ANY(ARRAY(SELECT group_id FROM picked))))
      AND status = 'ready' AND times_sampled < 1
    RETURNING id, run_id
), leased AS (
    SELECT u.id, d.group_id FROM updated u JOIN {data} d ON d.run_id = u.run_id AND d.id = u.id
""" + _GROUP_LEASED.format(groups="{data}"),
}
LEDGER = {
    "one row per experience": """
INSERT INTO {schema}.items (train_step_id, run_id, experience_id, policy_version, weight)
SELECT $1, $2, w.id, 0, w.weight FROM unnest($3::bigint[], $4::float8[]) AS w (id, weight)""",
    "one row per step": """
INSERT INTO {schema}.steps (train_step_id, run_id, experience_ids, weights)
VALUES ($1, $2, $3::bigint[], $4::float8[])""",
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="PostgreSQL URL (default: RESERVOIR_DB_URL, else embedded)")
    p.add_argument("--batch", type=int, default=256, help="rows per lease")
    p.add_argument("--batches", type=int, default=150, help="leases per layout")
    p.add_argument("--group-size", type=int, default=8)
    args = p.parse_args()
    for flag, value in {"--batch": args.batch, "--batches": args.batches,
                        "--group-size": args.group_size}.items():
        if not 1 <= value <= 100_000:
            p.error(f"{flag} must be between 1 and 100000, got {value}")
    if args.batch % args.group_size:
        p.error(f"--batch {args.batch} must be a multiple of --group-size {args.group_size} "
                "(a lease of whole groups)")
    if args.batch * (args.batches + 1) > MAX_ROWS:
        p.error(f"--batch x (--batches + 1) is the rows of each table: at most {MAX_ROWS:,}, "
                f"got {args.batch * (args.batches + 1):,}")
    return args


async def _state_table(conn: asyncpg.Connection, table: str, partition: str,
                       layout: str) -> None:
    """A copy of the partition's layout; before 0020, with the group's columns and index."""
    await conn.execute(f"CREATE TABLE {table} (LIKE {partition} INCLUDING ALL)")
    if layout == BEFORE:
        await conn.execute(f"ALTER TABLE {table} ADD COLUMN group_id uuid NOT NULL, "
                           "ADD COLUMN group_row smallint NOT NULL")
        await conn.execute(f"CREATE UNIQUE INDEX ON {table} (group_id, group_row, run_id)")


async def _fill(conn: asyncpg.Connection, table: str, layout: str, rows: str) -> None:
    group = ", group_id, group_row" if layout == BEFORE else ""
    await conn.execute(f"INSERT INTO {table} (id, run_id, policy_version, status, created_at"
                       f"{group}) SELECT id, 1, 0, 'ready', created_at{group} FROM {rows}")
    await conn.execute(f"VACUUM ANALYZE {table}")


async def build(conn: asyncpg.Connection, schema: str, partition: str, rows: int,
                group_size: int) -> dict[str, dict[str, str]]:
    """Per layout its table for the row leases and its table for the group leases, each with
    the same `rows` ready rows; the group columns' table; the two ledgers."""
    source = f"{schema}.source"
    await conn.execute(f"""
CREATE TABLE {source} AS
SELECT n AS id, 1::bigint AS run_id, g.id AS group_id, (n % {group_size})::smallint AS group_row,
       now() + n * interval '1 microsecond' AS created_at
FROM generate_series(0, {rows - 1}) n
JOIN (SELECT g, gen_random_uuid() AS id FROM generate_series(0, {rows // group_size}) g) g
  ON g.g = n / {group_size}""")
    tables = {"rows": {}, "groups": {}}
    for i, layout in enumerate(LAYOUTS):
        for kind in tables:
            table = f"{schema}.{kind}_{i}"
            await _state_table(conn, table, partition, layout)
            await _fill(conn, table, layout, source)
            tables[kind][layout] = table
    data = f"{schema}.group_data"
    await conn.execute(f"CREATE TABLE {data} AS SELECT id, run_id, group_id, group_row "
                       f"FROM {source}")
    await conn.execute(f"ALTER TABLE {data} ADD PRIMARY KEY (id, run_id)")
    await conn.execute(f"CREATE UNIQUE INDEX ON {data} (group_id, group_row, run_id) "
                       "INCLUDE (id)")
    await conn.execute(f"VACUUM ANALYZE {data}")
    await conn.execute(f"CREATE TABLE {schema}.items (LIKE batch_items INCLUDING ALL)")
    await conn.execute(f"CREATE TABLE {schema}.steps (train_step_id bigint PRIMARY KEY, "
                       "run_id bigint NOT NULL, experience_ids bigint[] NOT NULL, "
                       "weights float8[] NOT NULL)")
    return tables


async def timed(statement, *args) -> tuple[float, list]:
    start = time.perf_counter()
    rows = await statement.fetch(*args)
    return time.perf_counter() - start, rows


async def measure(conn: asyncpg.Connection, schema: str, tables: dict[str, dict[str, str]],
                  args) -> dict[str, list[float]]:
    """Per layout the lease and commit times, of rows and of whole groups, and per ledger the
    insert times, in turns."""
    by_rows, by_groups, data = tables["rows"], tables["groups"], f"{schema}.group_data"
    lease = {k: await conn.prepare(LEASE.format(table=t)) for k, t in by_rows.items()}
    commit = {k: await conn.prepare(COMMIT.format(table=t)) for k, t in by_rows.items()}
    ledger = {k: await conn.prepare(sql.format(schema=schema)) for k, sql in LEDGER.items()}
    group_lease = {k: await conn.prepare(GROUP_LEASE[k].format(state=t, data=data))
                   for k, t in by_groups.items()}
    group_commit = {k: await conn.prepare(COMMIT.format(table=t)) for k, t in by_groups.items()}
    times: dict[str, list[float]] = {}
    weights = [1.0] * args.batch
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("lease, commit and ledger, in turns", total=args.batches)
        for step in range(args.batches):
            order = LAYOUTS if step % 2 else LAYOUTS[::-1]  # neither always goes first
            for layout in order:
                token = uuid.uuid4()
                seconds, rows = await timed(lease[layout], token, 1, args.batch)
                if len(rows) != args.batch:
                    raise StoreError(f"{layout}: the lease found {len(rows)} of {args.batch} rows")
                times.setdefault(f"lease|{layout}", []).append(seconds)
                ids = [row[0] for row in rows]
                seconds, _ = await timed(commit[layout], token, 1, ids)
                times.setdefault(f"commit|{layout}", []).append(seconds)
                if layout == "store":
                    for kind in (LEDGERS if step % 2 else LEDGERS[::-1]):
                        seconds, _ = await timed(ledger[kind], step, 1, ids, weights)
                        times.setdefault(f"ledger|{kind}", []).append(seconds)
            for layout in order:
                token = uuid.uuid4()
                seconds, rows = await timed(group_lease[layout], token, 1,
                                            args.batch // args.group_size)
                sizes = sorted({n for _, n in rows})
                if len(rows) != args.batch or sizes != [args.group_size]:
                    raise StoreError(f"{layout}: the group lease found {len(rows)} of "
                                     f"{args.batch} rows, in groups of {sizes}")
                times.setdefault(f"group lease|{layout}", []).append(seconds)
                seconds, _ = await timed(group_commit[layout], token, 1, [r[0] for r in rows])
                times.setdefault(f"group commit|{layout}", []).append(seconds)
            progress.advance(task)
    return times


def report(times: dict[str, list[float]], args) -> None:
    ms = {key: statistics.median(values[len(values) // 10:]) * 1e3  # the first tenth: warm-up
          for key, values in times.items()}
    table = Table(title=f"server + round trip, ms per batch of {args.batch} rows (median)")
    for column in ("part", *LAYOUTS, "ratio"):
        table.add_column(column, justify="right" if column != "part" else "left")
    lines = []
    for part in ("lease", "commit", "group lease", "group commit"):
        a, b = ms[f"{part}|store"], ms[f"{part}|{BEFORE}"]
        table.add_row(part, f"{a:.2f}", f"{b:.2f}", f"{a / b:.2f}")
        lines.append(f"{part}: store {a:.2f} ms | {BEFORE} {b:.2f} ms | ratio {a / b:.2f}"
                     + (f" (the index: {b - a:.2f} ms, {(b - a) * 1e3 / args.batch:.1f} us a row)"
                        if not part.startswith("group") else ""))
    for unit in ("", "group "):
        a = ms[f"{unit}lease|store"] + ms[f"{unit}commit|store"]
        b = ms[f"{unit}lease|{BEFORE}"] + ms[f"{unit}commit|{BEFORE}"]
        table.add_row(f"{unit}lease + commit", f"{a:.2f}", f"{b:.2f}", f"{a / b:.2f}")
        lines.append(f"{unit}lease + commit: store {a:.2f} ms | {BEFORE} {b:.2f} ms | ratio "
                     f"{a / b:.2f}" + (f" (whole groups of {args.group_size})" if unit else ""))
    console.print(table)
    print("\n".join(lines))
    rows, step = ms["ledger|one row per experience"], ms["ledger|one row per step"]
    print(f"ledger: one row per experience {rows:.2f} ms | one row per step {step:.2f} ms | "
          f"ratio {step / rows:.2f} (without batch_items' key trigger, which the store adds)")


async def run(url: str, run_id: int, args) -> None:
    schema = f"layout_bench_{run_id}"
    conn = await asyncpg.connect(**asyncpg_args(url))
    try:
        await conn.execute(f"CREATE SCHEMA {schema}")
        rows = args.batch * (args.batches + 1)
        partition = partitions.name("experience_state", run_id)
        tables = await build(conn, schema, partition, rows, args.group_size)
        report(await measure(conn, schema, tables, args), args)
    finally:
        await conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        await conn.close()


def main() -> None:
    args = parse_args()
    config = ReservoirConfig(store=StoreConfig(url=args.url), sampler=SamplerConfig(unit="rows"))
    store = Store.open(config, migrate=True, quiet=True)
    name = f"layout-bench-{int(time.time())}"
    run_id = store.create_run(name, group_size=args.group_size)
    try:
        asyncio.run(run(store.url, run_id, args))
    except KeyboardInterrupt:
        raise SystemExit("bench/state_layout.py: stopped (Ctrl-C); the scratch tables were "
                         "dropped") from None
    finally:
        with store.engine.begin() as conn:
            delete_run(conn, name)
        store.close()


if __name__ == "__main__":
    run_main("state_layout.py", main)
