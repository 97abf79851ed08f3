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

Files are created, never reused, and never through a link. Each archive of a run is recorded
(`run_archives`: the SHA-256 of its manifest), and a restore trusts nothing in the folder: it
writes only into the run the recorded archive was made from (or, in a store without that run,
one it makes), reads only the folder's own files, checks every file's checksum, schema and row
count, every row's run, and every experience as the writer checks one (texts, token ids and the
run's vocabulary, logprobs, masks, rewards in their range); anything wrong is one line, and
nothing is restored.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import re
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq
from sqlalchemy import Connection, Engine, RootTransaction, TextClause, text
from sqlalchemy.exc import DBAPIError

from reservoir.config import DAY, DEFAULT_REWARD_RANGE, RetentionConfig
from reservoir.errors import ExperienceInvalid, StoreError
from reservoir.store.archive_format import (ARROW, MANIFEST, Column, Manifest, TableFile, create,
                                            fsync, sha256, write_durably)
from reservoir.store import codec, lifecycle, partitions, runs
from reservoir.store.engine import sync_engine
from reservoir.store.records import Experience, shape_group

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
RECORD_ARCHIVE = text("INSERT INTO run_archives (run_id, manifest_sha256, experiences) "
                      "VALUES (:run, :digest, :rows)")
FIND_ARCHIVE = text("SELECT id, restored_at FROM run_archives WHERE run_id = :run "
                    "AND manifest_sha256 = :digest FOR UPDATE")
MARK_RESTORED = text("UPDATE run_archives SET restored_at = now() WHERE id = :id")
VOCAB_SIZE = text("SELECT vocab_size FROM runs WHERE id = :run")
RUN_FIELDS = text("SELECT group_size, model, vocab_size FROM runs WHERE id = :run")


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
    if directory.is_symlink():
        raise StoreError(f"{directory} is a link: an archive goes into a folder itself; "
                         "nothing was archived")
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
        links_lost={"experiences.parent_id": conn.execute(LINKS_LOST, {"run": run_id}).scalar()},
        run_fields=dict(conn.execute(RUN_FIELDS, {"run": run_id}).mappings().one()))
    write_durably(directory / MANIFEST, manifest.to_json().encode())
    conn.execute(RECORD_ARCHIVE, {"run": run_id, "digest": bytes.fromhex(
        sha256(directory / MANIFEST)), "rows": tables["experiences"].rows})
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
    with create(partial) as file:  # a link or a file left there is an error, never followed
        try:
            with pq.ParquetWriter(file, schema, compression="zstd") as writer:
                for chunk in rows.partitions(chunk_rows):
                    values = list(zip(*chunk))
                    writer.write_table(pa.Table.from_arrays(
                        [_arrow(v, f.type) for v, f in zip(values, schema)], schema=schema))
                    done += len(chunk)
                    if progress:
                        progress(name, done, total)
        except BaseException:
            partial.unlink(missing_ok=True)  # ours: it was created just now
            raise
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


def archived_run(in_dir: Path | str) -> str:
    """The name of the run an archive folder holds (its manifest read and checked)."""
    return Manifest.read(Path(in_dir), tuple(TABLES)).run


def restore_run(target: Store | Engine | str, in_dir: Path | str, *, chunk_rows: int = CHUNK_ROWS,
                progress: Progress | None = None,
                reward_range: tuple[float, float] | None = None) -> Manifest:
    """Put an archive's rows back, with their ids, in one transaction: all or nothing. The
    run must be the one the archive was made from (run_archives records its manifest) and
    hold none of its experiences; in a store without the run, the restore makes it (and its
    rows take the new run's id). See the module's rules for what is checked; `reward_range`
    is explorer.reward_range (a Store's own, else the default)."""
    directory = Path(in_dir)
    manifest = Manifest.read(directory, tuple(TABLES))
    for name, table in manifest.tables.items():
        _check_file(directory, name, table)
    digest = bytes.fromhex(sha256(directory / MANIFEST))
    reward_range = reward_range or getattr(getattr(target, "aio", None), "reward_range",
                                           DEFAULT_REWARD_RANGE)
    what = f"restoring run {manifest.run!r} from {directory}"
    with (_engine(target) as engine, _failures(what, "nothing was restored"),
          engine.begin() as conn):
        run_id = _restore_into(conn, manifest, digest)
        _check_absent(conn, manifest, chunk_rows)
        vocab_size = conn.execute(VOCAB_SIZE, {"run": run_id}).scalar()
        for name, table in manifest.tables.items():
            with _failures(f"{what}: {table.file}", "nothing was restored"):
                _insert_table(conn, manifest, name, run_id, chunk_rows, progress,
                              lambda batch: _check_batch(manifest, name, batch, vocab_size,
                                                         reward_range))
            _advance_ids(conn, name)
        conn.execute(partitions.analyze(run_id))  # new partitions: no statistics yet
        conn.execute(TOUCH_RUN, {"run": run_id})
    return manifest


def _check_file(directory: Path, name: str, table: TableFile) -> None:
    """The folder's own file (no link), its sha256, and a Parquet schema and row count that
    are the ones the manifest lists."""
    path = directory / table.file
    if path.is_symlink() or not path.is_file():
        raise StoreError(f"{path}: {'a link' if path.is_symlink() else 'missing'}; an archive "
                         "holds its own files; nothing was restored")
    if sha256(path) != table.sha256:
        raise StoreError(f"{path}: its sha256 is not the one {MANIFEST} records (the file "
                         "changed or is damaged); nothing was restored")
    expected = [(c.name, ARROW.get(c.type)) for c in table.columns]
    try:
        parquet = pq.ParquetFile(path)
        found = [(field.name, field.type) for field in parquet.schema_arrow]
        rows = parquet.metadata.num_rows
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise StoreError(f"{path}: not a Parquet file ({_first_line(exc)}); nothing was "
                         "restored") from None
    if found != expected:
        raise StoreError(f"{path}: its columns are not the {name} columns {MANIFEST} lists "
                         f"(first difference: {_difference(found, expected)}); nothing was "
                         "restored")
    if rows != table.rows:
        raise StoreError(f"{path}: {rows} rows, {MANIFEST} says {table.rows}; nothing was "
                         "restored")


def _difference(found: list, expected: list) -> str:
    for index in range(max(len(found), len(expected))):
        one = found[index] if index < len(found) else None
        other = expected[index] if index < len(expected) else None
        if one != other:
            return f"column {index}: {one[0] if one else 'none'} in the file, " \
                   f"{other[0] if other else 'none'} in the manifest"
    return "none"


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _restore_into(conn: Connection, manifest: Manifest, digest: bytes) -> int:
    """The run the archive goes back into: the run it was made from, when this very manifest
    is its archive not restored yet; a run made now, when the store has no run of the name.
    Any other run is refused (a manifest changed to name it)."""
    found = conn.execute(LOCK_RUN, {"name": manifest.run}).first()
    if found is None:
        run_id = runs.insert_run(conn, manifest.run, **manifest.run_fields)
        runs.set_status(conn, run_id, "finished")
        return run_id
    archive = conn.execute(FIND_ARCHIVE, {"run": found.id, "digest": digest}).first()
    if archive is None:
        raise StoreError(f"run {manifest.run!r}: no archive of it has this {MANIFEST} (it was "
                         "made from another run, or changed since); nothing was restored")
    if archive.restored_at is not None:
        raise StoreError(f"run {manifest.run!r}: this archive was restored before "
                         f"({archive.restored_at:%Y-%m-%d %H:%M} UTC); nothing was restored")
    conn.execute(MARK_RESTORED, {"id": archive.id})
    return found.id


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
                  progress: Progress | None, check: Callable[[pa.RecordBatch], None]) -> None:
    """Insert one table's archived rows by column name, in chunks (each passing `check`),
    with the run's id."""
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
    batches = pq.ParquetFile(path).iter_batches(batch_size=chunk_rows)
    for batch in batches:
        check(batch)
        batch = batch.select([c.name for c in columns])
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


def _check_batch(manifest: Manifest, name: str, batch: pa.RecordBatch, vocab_size: int | None,
                 reward_range: tuple[float, float]) -> None:
    """Rows of the archive's run only; experiences as the writer checks them."""
    path = manifest.directory / manifest.tables[name].file
    if "run_id" in batch.schema.names:
        others = set(batch.column("run_id").to_pylist()) - {manifest.run_id, None}
        if others:
            raise StoreError(f"{path}: rows of run id {sorted(others)[0]}, not the archive's "
                             f"run (id {manifest.run_id}); nothing was restored")
    if name == "experiences":
        try:
            _check_experiences(batch.to_pylist(), manifest.run, vocab_size, reward_range)
        except (ValueError, TypeError) as exc:  # bytes that are no array, JSON that is not
            raise StoreError(f"{path}: {_first_line(exc)}; nothing was restored") from None


def _check_experiences(rows: list[dict], run: str, vocab_size: int | None,
                       reward_range: tuple[float, float]) -> None:
    """Each group of archived rows through the writer's checks (records.shape_group);
    ValueError naming the experience otherwise."""
    low, high = reward_range
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["group_id"], []).append(row)
        shaped = row.get("shaped_reward")
        if shaped is not None and not (math.isfinite(shaped) and low <= shaped <= high):
            raise ValueError(f"experience {row['id']}: field 'shaped_reward' = {shaped}: must "
                             f"be a finite number in the reward range [{low:g}, {high:g}]")
    for members in groups.values():
        try:
            _check_group(members, run, vocab_size, reward_range)
        except ExperienceInvalid as exc:
            named = members[exc.row_index or 0]["id"]
            reason = re.sub(r"^group \d+( row \d+)?", f"experience {named}", str(exc))
            raise ValueError(reason.split("; nothing of")[0]) from None


def _check_group(members: list[dict], run: str, vocab_size: int | None,
                 reward_range: tuple[float, float]) -> None:
    """One group's archived rows as the writer's Experience rows, through its checks."""
    group = [Experience(
        run=run, prompt_text=row["prompt_text"], response_text=row["response_text"],
        prompt_ids=codec.decode(row["prompt_ids"], codec.TOKEN),
        response_ids=codec.decode(row["response_ids"], codec.TOKEN),
        logprobs=codec.decode(row["logprobs"], codec.LOGPROB),
        action_mask=codec.decode(row["action_mask"], codec.MASK), reward=row["reward"],
        policy_version=row["policy_version"], task_id=row["task_id"],
        group_id=uuid.UUID(row["group_id"]), parent_id=row["parent_id"],
        reward_components=json.loads(row["reward_components"] or "{}"),
        metadata=json.loads(row["metadata"] or "{}")) for row in members]
    shape_group(group, 0, reward_range).check_values(vocab_size)


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
                age = dt.timedelta(days=retention.retire_after_days)
                retired = conn.execute(lifecycle.RETIRE_AGED,
                                       {"age": age, "ended": ENDED}).rowcount
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
