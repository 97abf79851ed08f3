"""Archives: a run's experiences, and every row that hangs off them, moved out of the store into
Parquet files, and back; and retention, which does that (and retires rows) by age.

An archive is a folder with one Parquet file per table and `manifest.json`:

| table           | rows archived                                            |
| --------------- | -------------------------------------------------------- |
| experiences     | the run's, every column (token arrays as the stored bytes) |
| batch_items     | those experiences' ledger rows                           |
| operator_events | pipeline decisions about those experiences               |
| reviews         | those experiences' reviews                               |
| preferences     | pairs whose chosen or rejected row is one of them         |
| batch_pairs     | those pairs' ledger rows                                 |
| review_actions  | actions that name one of those experiences, reviews or pairs |

Once the files are durable, the rows of operator_events, reviews, preferences and batch_pairs
are deleted, `review_actions` rows stay in the store with their links set NULL (the archive
keeps them whole and a restore sets the links back; an action deleted meanwhile comes back too),
and parent links to the run's rows are cleared. Then the run's ledger and experiences leave in
one statement a table: its three partitions (of batch_items, experience_state and
experience_data) are detached and dropped, and empty ones take their place for a restore. Rows of other runs whose parent is an archived experience lose that link for
good: the manifest counts them (`links_lost`).

Columns are read from the database (a table's or the view's), never assumed; values keep their
stored form (`archive_format`: bytea as binary, JSON and UUIDs as their text, timestamps in UTC).
"""

from __future__ import annotations

import datetime as dt
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq
from sqlalchemy import Connection, Engine, RootTransaction, TextClause, text
from sqlalchemy.exc import DBAPIError

from reservoir.config import DAY, RetentionConfig
from reservoir.errors import StoreError
from reservoir.store.archive_format import (ARROW, MANIFEST, Column, Manifest, TableFile, fsync,
                                            sha256, write_durably)
from reservoir.store import partitions
from reservoir.store.engine import sync_engine

if TYPE_CHECKING:
    from reservoir.store.store import Store

CHUNK_ROWS = 10_000
ENDED = ["stopped", "finished", "failed"]  # run statuses retention archives
# Generated from other columns (they are plain columns of the view): archived, never inserted.
DERIVED = ("prompt_len", "response_len")
TEXT_FORM = ("json", "jsonb", "uuid")  # archived as their text, cast back on restore

Progress = Callable[[str, int, int], None]  # (table, rows done, rows in all)

RUN_PAIRS = "SELECT id FROM preferences WHERE run_id = :run"
# Each archived table, in restore order: which of its rows are the run's (a row naming an
# experience names its run, migration 0013), and their order.
TABLES = {
    "experiences": ("run_id = :run", "id"),
    "batch_items": ("run_id = :run", "train_step_id, experience_id"),
    "operator_events": ("run_id = :run", "id"),
    "reviews": ("run_id = :run", "id"),
    "preferences": ("run_id = :run", "id"),
    "batch_pairs": (f"preference_id IN ({RUN_PAIRS})", "train_step_id, preference_id"),
    "review_actions": (f"run_id = :run OR preference_id IN ({RUN_PAIRS}) OR "
                       "review_id IN (SELECT id FROM reviews WHERE run_id = :run)", "id"),
}
RUNS = ("run_id", "parent_run_id")  # remapped when the run's id changed
RELINKED = "review_actions"  # kept by the store, links set NULL: restored by setting them back

COLUMNS = text("""
SELECT a.attname AS name, format_type(a.atttypid, a.atttypmod) AS type,
       a.attgenerated <> '' AS generated
FROM pg_attribute a
WHERE a.attrelid = CAST(:relation AS regclass) AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attnum""")
FIND_RUN = text("SELECT id, status FROM runs WHERE name = :name")
LOCK_RUN = text("SELECT id, status FROM runs WHERE name = :name FOR UPDATE")
REVISION = text("SELECT version_num FROM alembic_version")
LINKS_LOST = text("SELECT count(*) FROM experiences WHERE parent_run_id = :run "
                  "AND run_id <> :run")
PRESENT = text("SELECT id FROM experiences WHERE id = ANY(CAST(:ids AS bigint[])) "
               "ORDER BY id LIMIT 3")
ID_DEFAULT = text("""
SELECT pg_get_expr(d.adbin, d.adrelid) FROM pg_attrdef d
JOIN pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
WHERE d.adrelid = CAST(:relation AS regclass) AND a.attname = 'id'""")
TOUCH_RUN = text("UPDATE runs SET updated_at = now() WHERE id = :run")
IDLE_RUNS = text("""
SELECT name FROM runs r
WHERE status = ANY(:ended) AND updated_at < now() - make_interval(secs => :seconds)
  AND EXISTS (SELECT 1 FROM experiences e WHERE e.run_id = r.id)
ORDER BY id""")
RETIRE = text("""
UPDATE experiences SET status = 'retired'
WHERE status IN ('ready', 'raw') AND created_at < now() - make_interval(secs => :seconds)
  AND run_id IN (SELECT id FROM runs WHERE status = ANY(:ended))""")


@dataclass(frozen=True)
class RetentionSummary:
    retired: int
    archived: tuple[Manifest, ...]
    failed: tuple[str, ...]  # one line per run that could not be archived


@contextmanager
def _engine(target: Store | Engine | str) -> Iterator[Engine]:
    """The engine of a Store, an Engine, or a URL (an engine of its own, closed after)."""
    if isinstance(target, str):
        engine = sync_engine(target)
        try:
            yield engine
        finally:
            engine.dispose()
    else:
        yield getattr(target, "engine", target)


@contextmanager
def _failures(what: str, consequence: str) -> Iterator[None]:
    """Driver and file errors as one StoreError line: what failed, why, and what it left."""
    try:
        yield
    except DBAPIError as exc:
        lines = str(exc.orig).strip().splitlines() or [type(exc.orig).__name__]
        detail = getattr(getattr(exc.orig, "diag", None), "message_detail", None)
        why = f"{lines[0]} ({detail})" if detail else lines[0]
        if getattr(exc.orig, "pgcode", None) == "40001":
            why += " (a concurrent change: try again)"
        raise StoreError(f"{what}: the database: {why}; {consequence}") from exc
    except OSError as exc:
        raise StoreError(f"{what}: {exc}; {consequence}") from exc


def columns_of(conn: Connection, relation: str) -> list[Column]:
    """The relation's columns as the database declares them, in order."""
    return [Column(row.name, row.type, row.generated or row.name in DERIVED)
            for row in conn.execute(COLUMNS, {"relation": relation})]


def _lock_run(conn: Connection, name: str, statement: TextClause = LOCK_RUN) -> tuple[int, str]:
    row = conn.execute(statement, {"name": name}).first()
    if row is None:
        raise StoreError(f"run {name!r} does not exist (`reservoir runs list` shows the runs)")
    return row.id, row.status


def archive_run(target: Store | Engine | str, run: str, out_dir: Path | str, *, chunk_rows: int = CHUNK_ROWS,
                progress: Progress | None = None) -> Manifest:
    """Write a run's experiences and their dependent rows to Parquet files in `out_dir`, then
    delete them from the store, in one transaction that holds the run's row and partitions
    locked (writes of its rows wait for the archive; reads go on) and reads one snapshot.
    Refuses a running run and a folder that holds an archive. If the delete fails, nothing is
    deleted and the complete archive stays in `out_dir`."""
    directory = Path(out_dir)
    if (directory / MANIFEST).exists():
        raise StoreError(f"{directory} holds an archive already ({MANIFEST}): choose another "
                         "folder; nothing was archived")
    with (_engine(target) as engine,
          _failures(f"archiving run {run!r}", "nothing was deleted")):
        with engine.connect() as conn:
            run_id, _ = _lock_run(conn, run, FIND_RUN)
        with (engine.connect().execution_options(isolation_level="REPEATABLE READ") as conn,
              conn.begin() as transaction):
            return _archive(conn, transaction, run, run_id, directory, chunk_rows, progress)


def _archive(conn: Connection, transaction: RootTransaction, run: str, run_id: int,
             directory: Path, chunk_rows: int, progress: Progress | None) -> Manifest:
    # The lock comes before the snapshot (the first query takes it): no write of the run's rows
    # can commit between what the files hold and the drop.
    conn.execute(text(f"LOCK TABLE {', '.join(partitions.names(run_id))} IN SHARE MODE"))
    locked_id, status = _lock_run(conn, run)
    if locked_id != run_id:
        raise StoreError(f"run {run!r} was replaced while archiving began; nothing was "
                         "archived (try again)")
    if status == "running":
        raise StoreError(f"run {run!r} is running: stop it before archiving; nothing was "
                         "archived")
    directory.mkdir(parents=True, exist_ok=True)
    manifest = _write_archive(conn, run, run_id, directory, chunk_rows, progress)
    with _failures(f"run {run!r} is archived in {directory}, but deleting its rows failed",
                   f"nothing was deleted and the archive stays (remove {directory} "
                   "before archiving again)"):
        deleted = partitions.drop(conn, run_id)
        partitions.add(conn, run_id)  # empty, for a restore
        if deleted != manifest.tables["experiences"].rows:
            raise StoreError(f"run {run!r}: {deleted} experiences to delete, "
                             f"{manifest.tables['experiences'].rows} archived in "
                             f"{directory}; nothing was deleted (the archive stays)")
        transaction.commit()
    return manifest


def _write_archive(conn: Connection, run: str, run_id: int, directory: Path, chunk_rows: int,
                   progress: Progress | None) -> Manifest:
    tables = {name: _write_table(conn, name, run_id, directory, chunk_rows, progress)
              for name in TABLES}
    manifest = Manifest(
        run=run, run_id=run_id, revision=conn.execute(REVISION).scalar(),
        created_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        tables=tables, directory=directory,
        links_lost={"experiences.parent_id": conn.execute(LINKS_LOST, {"run": run_id}).scalar()})
    write_durably(directory / MANIFEST, manifest.to_json().encode())
    return manifest


def _write_table(conn: Connection, name: str, run_id: int, directory: Path, chunk_rows: int,
                 progress: Progress | None) -> TableFile:
    """The run's rows of one table as `<table>.parquet`, written in chunks, fsynced."""
    columns = columns_of(conn, name)
    unknown = [f"{c.name} ({c.type})" for c in columns if c.type not in ARROW]
    if unknown:
        raise StoreError(f"{name}: the archive cannot hold columns of type {', '.join(unknown)}")
    where, order = TABLES[name]
    total = conn.execute(text(f"SELECT count(*) FROM {name} WHERE {where}"),
                         {"run": run_id}).scalar()
    shown = ", ".join(f"{_quote(c.name)}::text" if c.type in TEXT_FORM else _quote(c.name)
                      for c in columns)
    rows = conn.execute(text(f"SELECT {shown} FROM {name} WHERE {where} ORDER BY {order}"),
                        {"run": run_id}, execution_options={"stream_results": True,
                                                            "max_row_buffer": chunk_rows})
    schema = pa.schema([(c.name, ARROW[c.type]) for c in columns])
    final, partial = directory / f"{name}.parquet", directory / f"{name}.parquet.partial"
    done = 0
    if progress:
        progress(name, 0, total)
    with pq.ParquetWriter(partial, schema, compression="zstd") as writer:
        for chunk in rows.partitions(chunk_rows):
            values = list(zip(*chunk))
            writer.write_table(pa.Table.from_arrays(
                [_arrow(v, f.type) for v, f in zip(values, schema)], schema=schema))
            done += len(chunk)
            if progress:
                progress(name, done, total)
    fsync(partial)
    os.replace(partial, final)
    fsync(directory)
    return TableFile(final.name, done, sha256(final), tuple(columns))


def _arrow(values: tuple, kind: pa.DataType) -> pa.Array:
    """One column of a chunk; bytea arrives as memoryviews, which pa.array would keep alive
    (pyarrow 26 holds a reference to each), so they are copied to bytes first."""
    if kind == pa.binary():
        values = tuple(None if value is None else bytes(value) for value in values)
    return pa.array(values, type=kind)


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def restore_run(target: Store | Engine | str, in_dir: Path | str, *, chunk_rows: int = CHUNK_ROWS,
                progress: Progress | None = None) -> Manifest:
    """Put an archive's rows back, with their ids, in one transaction: all or nothing. The
    run must exist (a run of that name with another id takes the rows) and hold none of the
    archived experiences; every file must match its sha256."""
    directory = Path(in_dir)
    manifest = Manifest.read(directory, tuple(TABLES))
    for table in manifest.tables.values():
        path = directory / table.file
        if not path.is_file() or sha256(path) != table.sha256:
            raise StoreError(f"{path}: {'missing' if not path.is_file() else 'its sha256 is not'}"
                             f" the one {MANIFEST} records (the file changed or is damaged); "
                             "nothing was restored")
    what = f"restoring run {manifest.run!r} from {directory}"
    with (_engine(target) as engine, _failures(what, "nothing was restored"),
          engine.begin() as conn):
        run_id, _ = _lock_run(conn, manifest.run)
        _check_absent(conn, manifest, chunk_rows)
        for name, table in manifest.tables.items():
            with _failures(f"{what}: {table.file}", "nothing was restored"):
                _insert_table(conn, manifest, name, run_id, chunk_rows, progress)
            _advance_ids(conn, name)
        conn.execute(partitions.analyze(run_id))  # new partitions: no statistics yet
        conn.execute(TOUCH_RUN, {"run": run_id})
    return manifest


def _check_absent(conn: Connection, manifest: Manifest, chunk_rows: int) -> None:
    path = manifest.directory / manifest.tables["experiences"].file
    for batch in pq.ParquetFile(path).iter_batches(batch_size=chunk_rows, columns=["id"]):
        present = conn.execute(PRESENT, {"ids": batch.column(0).to_pylist()}).scalars().all()
        if present:
            raise StoreError(f"run {manifest.run!r}: experiences of {manifest.directory} are in "
                             f"the store already (ids {', '.join(map(str, present))} ...): it was "
                             "restored before, or its rows were never deleted; nothing was "
                             "restored")


def _insert_table(conn: Connection, manifest: Manifest, name: str, run_id: int, chunk_rows: int,
                  progress: Progress | None) -> None:
    """Insert one table's archived rows by column name, in chunks, with the run's id."""
    table = manifest.tables[name]
    archived = [c.name for c in table.columns]
    store = {c.name: c for c in columns_of(conn, name)}
    missing = [column for column in archived if column not in store]
    if missing:
        raise StoreError(f"{table.file}: the store's {name} has no column {', '.join(missing)} "
                         f"(archived at revision {manifest.revision}); nothing was restored")
    columns = [store[column] for column in archived if not store[column].derived]
    missing_run = ("run_id" in store and "run_id" not in archived
                   and "experience_id" in archived)
    statement = _insert_statement(name, columns, missing_run)
    done, remap = 0, {"old_run": manifest.run_id, "new_run": run_id}
    path = manifest.directory / table.file
    if progress:
        progress(name, 0, table.rows)
    batches = pq.ParquetFile(path).iter_batches(batch_size=chunk_rows,
                                                columns=[c.name for c in columns])
    for batch in batches:
        values = {f"c{i}": batch.column(i).to_pylist() for i in range(len(columns))}
        inserted = conn.execute(statement, {**values, **remap}).rowcount
        if inserted != batch.num_rows:
            raise StoreError(f"{path}: {inserted} of {batch.num_rows} rows went in; nothing "
                             "was restored")
        done += batch.num_rows
        if progress:
            progress(name, done, table.rows)
    if done != table.rows:
        raise StoreError(f"{path}: {done} rows, {MANIFEST} says {table.rows}; nothing was "
                         "restored")


def _insert_statement(name: str, columns: list[Column], missing_run: bool) -> TextClause:
    """INSERT INTO <name> (columns) SELECT ... FROM unnest(one array per column), run_id
    remapped; review_actions' links are set back where they are NULL."""
    names = ", ".join(_quote(c.name) for c in columns)
    arrays = ", ".join(f"CAST(:c{i} AS {'text' if c.type in TEXT_FORM else c.type}[])"
                       for i, c in enumerate(columns))
    values = ", ".join(
        f"CASE WHEN v.{c.name} = :old_run THEN :new_run ELSE v.{c.name} END" if c.name in RUNS
        else f"CAST(v.{_quote(c.name)} AS {c.type})" for c in columns)
    target = names
    if missing_run:  # archived before rows named their experience's run (revision 0012)
        target += ", run_id"
        values += ", CASE WHEN v.experience_id IS NULL THEN NULL ELSE :new_run END"
    sql = (f"INSERT INTO {name} AS t ({target}) SELECT {values} "
           f"FROM unnest({arrays}) AS v ({names})")
    if name == RELINKED:
        links = [_quote(c.name) for c in columns if c.name.endswith("_id")]
        sql += " ON CONFLICT (id) DO UPDATE SET " + ", ".join(
            f"{link} = coalesce(t.{link}, EXCLUDED.{link})" for link in links)
    return text(sql)


def _advance_ids(conn: Connection, name: str) -> None:
    """Move the sequence behind a table's id past the restored ids (into another database,
    they may be ahead of it)."""
    default = conn.execute(ID_DEFAULT, {"relation": name}).scalar()
    found = re.fullmatch(r"nextval\('(.+)'::regclass\)", default or "")
    if found:
        conn.execute(text(
            f"SELECT setval(CAST(:seq AS regclass), m) FROM (SELECT max(id) AS m FROM {name}) s "
            "WHERE m > coalesce(pg_sequence_last_value(CAST(:seq AS regclass)), 0)"),
            {"seq": found.group(1)})


def apply_retention(target: Store | Engine | str, retention: RetentionConfig, *,
                    progress: Progress | None = None) -> RetentionSummary:
    """Retire ready and raw rows older than `retire_after_days` of ended runs (stopped,
    finished, failed); then archive, into `archive_dir/<run name>`, every ended run with rows
    whose `updated_at` is older than `archive_after_days`. A run that cannot be archived is
    named in `failed`; the others go on."""
    retired, archived, failed = 0, [], []
    with _engine(target) as engine:
        if retention.retire_after_days is not None:
            with (_failures("retiring old rows", "none was retired"),
                  engine.begin() as conn):
                retired = conn.execute(RETIRE, {"seconds": retention.retire_after_days * DAY,
                                                "ended": ENDED}).rowcount
        if retention.archive_after_days is not None:
            with engine.connect() as conn:
                names = conn.execute(IDLE_RUNS, {"seconds": retention.archive_after_days * DAY,
                                                 "ended": ENDED}).scalars().all()
            for name in names:
                try:
                    archived.append(archive_run(engine, name, Path(retention.archive_dir) / name,
                                                progress=progress))
                except StoreError as exc:
                    failed.append(str(exc))
    return RetentionSummary(retired, tuple(archived), tuple(failed))
