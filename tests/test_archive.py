"""Archiving a run's experiences to Parquet and restoring them, and retention: what leaves the
store comes back identical (every column of every archived table), a damaged archive or a
second restore changes nothing, and retention archives only runs idle long enough."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from reservoir.config import RetentionConfig
from reservoir.errors import StoreError
from reservoir.store import codec, pipelines, reviews, runs
from reservoir.store.archive import apply_retention, archive_run, restore_run
from reservoir.store.engine import sync_engine
from tests.commands import reservoir
from tests.factories import fill, lease_rows_read, make_group

RUN, OTHER = "archived", "kept"
# Every table an archive touches, with the key its rows are compared in.
TABLES = {"experiences": "id", "batch_items": "train_step_id, experience_id",
          "operator_events": "id", "reviews": "id", "preferences": "id",
          "batch_pairs": "train_step_id, preference_id", "review_actions": "id"}
ARRAYS = {"prompt_ids": codec.TOKEN, "response_ids": codec.TOKEN, "logprobs": codec.LOGPROB,
          "action_mask": codec.MASK}


def populate(store) -> list[int]:
    """A finished run with trained rows, a pipeline event, a labelled review, a pair trained
    by a DPO step; and another run. Returns the archived run's experience ids."""
    run_id = store.create_run(RUN, group_size=4, vocab_size=1000)
    store.create_run(OTHER, group_size=4)
    store.write_groups([make_group(RUN, seed=i) for i in range(6)])
    fill(store, OTHER, 2, start_seed=100)
    store.commit_step(store.lease(RUN, groups=2), step=1, policy_version=0, loss=0.5)
    with store.engine.begin() as conn:
        ids = conn.execute(text("SELECT id FROM experiences WHERE run_id = :r ORDER BY id"),
                           {"r": run_id}).scalars().all()
        pipeline_run = pipelines.start_run(conn, pipeline="gate", spec={}, spec_hash="h",
                                           source_file=None, run_ids=[run_id], trigger="cli")
        pipelines.apply(conn, pipeline_run, pipelines.Changes(
            events=[{"experience_id": ids[9], "operator": "op", "kind": "scored",
                     "reason": "test", "stats": {"score": 0.5}}],
            held={ids[10]: "look at it"}))
        review_id = conn.execute(text("SELECT id FROM reviews")).scalar()
        reviews.label(conn, review_id, verdict="accept", reviewer="ann", values={"ok": True})
        reviews.prefer(conn, ids[12], ids[13], reviewer="ann")
        runs.set_status(conn, run_id, "finished")
    store.commit_pairs(store.lease_pairs(RUN, pairs=1), step=2, policy_version=0)
    return ids


def contents(engine) -> dict[str, list[dict]]:
    with engine.connect() as conn:
        return {name: [dict(row) for row in conn.execute(
                    text(f"SELECT * FROM {name} ORDER BY {key}")).mappings()]
                for name, key in TABLES.items()}


def count(engine, sql: str, **params) -> int:
    with engine.connect() as conn:
        return conn.execute(text(sql), params).scalar()


@pytest.mark.slow
def test_archive_removes_the_rows_and_restore_brings_back_every_column(store, tmp_path):
    ids = populate(store)
    before = contents(store.engine)
    manifest = archive_run(store.engine, RUN, tmp_path / "a", chunk_rows=5)

    assert manifest.rows() == {"experiences": 24, "batch_items": 10, "operator_events": 1,
                               "reviews": 1, "preferences": 1, "batch_pairs": 1,
                               "review_actions": 2}
    assert count(store.engine, "SELECT count(*) FROM experiences WHERE id = ANY(:i)", i=ids) == 0
    assert count(store.engine, "SELECT count(*) FROM batch_items") == 0
    assert count(store.engine, "SELECT count(*) FROM experiences") == 8  # the other run's
    assert count(store.engine, "SELECT count(*) FROM review_actions WHERE experience_id IS "
                               "NULL AND review_id IS NULL AND preference_id IS NULL") == 2
    written = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert written["run"] == RUN and written["revision"] and written["tables"]["reviews"]["sha256"]
    parquet = pq.read_table(tmp_path / "a" / "experiences.parquet")
    assert str(parquet.schema.field("prompt_ids").type) == "binary"
    assert str(parquet.schema.field("created_at").type) == "timestamp[us, tz=UTC]"

    restore_run(store.engine, tmp_path / "a", chunk_rows=7)
    after = contents(store.engine)
    assert after == before
    for old, new in zip(before["experiences"], after["experiences"]):
        for column, dtype in ARRAYS.items():
            np.testing.assert_array_equal(codec.decode(old[column], dtype),
                                          codec.decode(new[column], dtype))
    first = parquet.to_pylist()[0]
    np.testing.assert_array_equal(codec.decode(first["response_ids"], codec.TOKEN),
                                  codec.decode(before["experiences"][0]["response_ids"],
                                               codec.TOKEN))


def test_a_running_run_or_an_unknown_one_is_refused_with_nothing_written(store, tmp_path):
    run_id = store.create_run(RUN)
    fill(store, RUN, 1)
    with store.engine.begin() as conn:
        runs.set_status(conn, run_id, "running")
    with pytest.raises(StoreError, match=f"run '{RUN}' is running"):
        archive_run(store.engine, RUN, tmp_path / "a")
    with pytest.raises(StoreError, match="run 'nobody' does not exist"):
        archive_run(store.url, "nobody", tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert count(store.engine, "SELECT count(*) FROM experiences") == 4


def partitions(engine) -> dict[str, int]:
    """{partition name: its table's oid}: a dropped and recreated partition has a new oid."""
    with engine.connect() as conn:
        return dict(conn.execute(text(
            "SELECT c.relname, c.oid::bigint FROM pg_inherits i JOIN pg_class c "
            "ON c.oid = i.inhrelid WHERE i.inhparent IN ('experience_data'::regclass, "
            "'experience_state'::regclass)")).all())


def test_the_run_s_rows_leave_with_its_partitions_and_come_back_into_new_ones(store, tmp_path):
    populate(store)
    with store.engine.connect() as conn:
        run_id, other_id = (runs.run_id_of(conn, name) for name in (RUN, OTHER))
    before = partitions(store.engine)
    names = {f"{parent}_r{run}" for parent in ("experience_data", "experience_state")
             for run in (run_id, other_id)}
    assert set(before) == names
    archive_run(store.engine, RUN, tmp_path / "a")
    after = partitions(store.engine)
    assert set(after) == names
    for parent in ("experience_data", "experience_state"):
        assert after[f"{parent}_r{run_id}"] != before[f"{parent}_r{run_id}"]  # dropped, new
        assert after[f"{parent}_r{other_id}"] == before[f"{parent}_r{other_id}"]  # untouched
        assert count(store.engine, f"SELECT count(*) FROM {parent}_r{run_id}") == 0
    groups = f"SELECT count(*) FROM experience_groups WHERE run_id = {run_id}"
    assert count(store.engine, groups) == 0  # the run's group ids leave with its rows
    restore_run(store.engine, tmp_path / "a")
    assert count(store.engine, f"SELECT count(*) FROM experience_state_r{run_id}") == 24
    assert count(store.engine, "SELECT count(*) FROM ONLY experience_state") == 0
    assert count(store.engine, groups) == count(  # and come back with them
        store.engine, f"SELECT count(DISTINCT group_id) FROM experience_data_r{run_id}") > 0


def test_a_restored_run_has_statistics_so_a_group_lease_reads_only_its_groups(store, tmp_path):
    """A restore puts the rows into new partitions, which have no statistics: without them a
    group lease read every ready row of the run to find its groups' rows (partitions.py)."""
    run_id = store.create_run(RUN, group_size=8)
    fill(store, RUN, 300, size=8)  # 2,400 ready rows
    with store.engine.begin() as conn:
        runs.set_status(conn, run_id, "finished")
    archive_run(store.engine, RUN, tmp_path / "a")
    restore_run(store.engine, tmp_path / "a")
    read = lease_rows_read(store, run_id, "groups", 4)
    assert read < 500, f"a lease of 4 groups of 8 read {read} rows of the run's 2,400"


def test_a_changed_byte_fails_the_restore_naming_the_file_and_inserts_nothing(store, tmp_path):
    populate(store)
    archive_run(store.engine, RUN, tmp_path / "a")
    target = tmp_path / "a" / "batch_items.parquet"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="batch_items.parquet: its sha256"):
        restore_run(store.engine, tmp_path / "a")
    assert count(store.engine, "SELECT count(*) FROM experiences") == 8


def test_a_row_cannot_change_while_its_run_is_archived(store, tmp_path):
    """The run's partitions are locked before the archive's snapshot: a write of one of its
    rows waits for the archive (here it gives up after its lock_timeout), so nothing changed
    after the files were read can be dropped with the partitions."""
    populate(store)
    refused = []

    def change_a_row(table: str, done: int, total: int) -> None:  # between read and delete
        if table == "review_actions" and done == 0:
            with store.engine.begin() as conn:
                conn.execute(text("SET LOCAL lock_timeout = '300ms'"))
                try:
                    with conn.begin_nested():
                        conn.execute(text("UPDATE experiences SET priority = 5 WHERE id = "
                                          "(SELECT min(id) FROM experiences)"))
                except OperationalError as exc:
                    refused.append(exc.orig.pgcode)

    manifest = archive_run(store.engine, RUN, tmp_path / "a", progress=change_a_row)
    assert refused == ["55P03"]  # lock_not_available
    assert manifest.tables["experiences"].rows == 24
    assert count(store.engine, "SELECT count(*) FROM experiences") == 8  # the other run's
    restore_run(store.engine, tmp_path / "a")
    assert count(store.engine, "SELECT count(*) FROM experiences WHERE priority = 5") == 0


def test_restoring_twice_is_refused_and_an_archive_folder_is_not_reused(store, tmp_path):
    populate(store)
    archive_run(store.engine, RUN, tmp_path / "a")
    restore_run(store.engine, tmp_path / "a")
    with pytest.raises(StoreError, match="was restored before.*nothing was restored"):
        restore_run(store.engine, tmp_path / "a")
    with pytest.raises(StoreError, match="holds an archive already"):
        archive_run(store.engine, RUN, tmp_path / "a")
    assert count(store.engine, "SELECT count(*) FROM experiences") == 32


def test_retention_archives_an_idle_ended_run_and_retires_old_rows_of_a_recent_one(
        store, tmp_path):
    for name in (RUN, OTHER):
        run_id = store.create_run(name)
        fill(store, name, 2, start_seed=len(name))
        with store.engine.begin() as conn:
            runs.set_status(conn, run_id, "finished")
    with store.engine.begin() as conn:
        conn.execute(text("UPDATE runs SET updated_at = now() - interval '10 days' "
                          "WHERE name = :r"), {"r": RUN})
        conn.execute(text("UPDATE experiences SET created_at = created_at - interval '3 days' "
                          "WHERE run_id = (SELECT id FROM runs WHERE name = :r)"), {"r": OTHER})
    retention = RetentionConfig(archive_dir=str(tmp_path), archive_after_days=5,
                                retire_after_days=2)
    summary = apply_retention(store, retention)
    assert [m.run for m in summary.archived] == [RUN] and not summary.failed
    assert (tmp_path / RUN / "manifest.json").is_file()
    assert summary.retired == 8
    statuses = count(store.engine, "SELECT string_agg(DISTINCT status, ',') FROM experiences")
    assert statuses == "retired"  # only the recent run's rows are left, all retired
    assert apply_retention(store, retention).archived == ()  # nothing is archived twice


@pytest.mark.slow
@pytest.mark.process
def test_cli_archives_lists_and_restores(cli, store, tmp_path):
    populate(store)
    folder = tmp_path / "archive"
    out = cli("runs", "archive", RUN, "-o", str(folder))
    assert f"archived run '{RUN}' to {folder}: 24 experiences, 10 batch_items" in out
    listed = [[cell.strip() for cell in line.split("│")[1:-1]]
              for line in cli("runs", "list").splitlines()]
    assert [RUN, "finished", "0"] in [row[:3] for row in listed], listed
    assert f"restored run '{RUN}' from {folder}" in cli("runs", "restore", str(folder))
    failed = cli.raw("runs", "restore", str(folder))
    assert failed.returncode == 1
    assert failed.stderr.count("\n") == 1 and "restored before" in failed.stderr
    assert count(store.engine, "SELECT count(*) FROM experiences") == 32


# -- issue 28: archives written through no link, restores of damaged or forged ones ----------

@pytest.mark.process
def test_an_archive_writes_through_no_link(cli, store, tmp_path):
    """A symlink planted at DIR/experiences.parquet.partial was followed and its target
    overwritten."""
    populate(store)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    folder = tmp_path / "archive"
    folder.mkdir()
    (folder / "experiences.parquet.partial").symlink_to(victim)
    result = cli.raw("runs", "archive", RUN, "-o", str(folder))
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert "experiences.parquet.partial" in result.stderr and "Traceback" not in result.stderr
    assert victim.read_text() == "keep me"
    assert count(store.engine, "SELECT count(*) FROM experiences") == 32


def reseal(folder, edit=lambda manifest: None) -> None:
    """The manifest edited and its checksums made to match the files again, as someone who
    forges an archive would."""
    from reservoir.store.archive_format import sha256

    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    for table in manifest["tables"].values():
        if (folder / table["file"]).is_file():
            table["sha256"] = sha256(folder / table["file"])
    path.write_text(json.dumps(manifest))


def rewrite(path, change) -> None:
    """A Parquet file read, changed (change(pyarrow table) -> table) and written back."""
    pq.write_table(change(pq.read_table(path)), path)


def _with_column(table, name, values):
    import pyarrow as pa

    return table.set_column(table.schema.get_field_index(name), name,
                            pa.array(values, type=table.schema.field(name).type))


DAMAGE = {
    "truncated": lambda folder, store: (folder / "reviews.parquet").write_bytes(
        (folder / "reviews.parquet").read_bytes()[:100]),
    "garbage": lambda folder, store: (folder / "batch_items.parquet").write_bytes(b"x" * 5000),
    "swapped": lambda folder, store: (
        (folder / "swap").write_bytes((folder / "reviews.parquet").read_bytes()),
        (folder / "reviews.parquet").write_bytes((folder / "operator_events.parquet")
                                                 .read_bytes()),
        (folder / "operator_events.parquet").write_bytes((folder / "swap").read_bytes())),
    "missing-column": lambda folder, store: rewrite(folder / "experiences.parquet",
                                                    lambda t: t.drop_columns(["reward"])),
    "nan-reward": lambda folder, store: rewrite(folder / "experiences.parquet", lambda t:
                                                _with_column(t, "reward", [float("nan")]
                                                             + t["reward"].to_pylist()[1:])),
    "huge-token": lambda folder, store: rewrite(folder / "experiences.parquet", lambda t:
                                                _with_column(t, "response_ids", [
                                                    codec.encode(np.array([2**31 - 1] * 6),
                                                                 codec.TOKEN)]
                                                    + t["response_ids"].to_pylist()[1:])),
    "rows-of-another-run": lambda folder, store: rewrite(
        folder / "experiences.parquet", lambda t: _with_column(
            t, "run_id", [count(store.engine, f"SELECT id FROM runs WHERE name = '{OTHER}'")]
            * t.num_rows)),
}
FORGED = {
    "another-run": lambda manifest: manifest.update(run=OTHER),
    "dot-dot": lambda manifest: manifest["tables"]["reviews"].update(
        file="../outside/reviews.parquet"),
}


def refused_in_one_line(result) -> None:
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.stderr and "nothing was restored" in result.stderr


@pytest.fixture
def archived(cli, store, tmp_path):
    """The populated store with its run archived (CLI) into tmp_path/archive."""
    populate(store)
    folder = tmp_path / "archive"
    cli("runs", "archive", RUN, "-o", str(folder))
    return folder


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_archive_restores_nothing_in_one_line(archived, store, tmp_path, damage,
                                                        new_database, template_db):
    """Truncated, garbage or swapped files and a missing column were tracebacks; NaN rewards
    and token ids past any vocabulary went back in. Restored into another store (where the
    run is made from the archive), each is one line, and nothing is restored or made."""
    DAMAGE[damage](archived, store)
    reseal(archived)
    elsewhere = new_database(template_db)
    refused_in_one_line(reservoir("runs", "restore", str(archived), url=elsewhere,
                                  cwd=tmp_path))
    assert count(sync_engine(elsewhere), "SELECT count(*) FROM runs") == 0


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.parametrize("forgery", sorted(FORGED) + ["resealed"])
def test_a_forged_archive_restores_nothing_in_one_line(archived, cli, store, tmp_path, forgery):
    """A manifest re-sealed to name another run put the archive's rows into it; `../` in it
    was followed. An archive restores only into the run it was made from (or one it makes)."""
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "reviews.parquet").write_bytes((archived / "reviews.parquet")
                                                           .read_bytes())
    before = contents(store.engine)
    reseal(archived, FORGED.get(forgery, lambda manifest: manifest.update(links_lost={})))
    refused_in_one_line(cli.raw("runs", "restore", str(archived)))
    assert contents(store.engine) == before
