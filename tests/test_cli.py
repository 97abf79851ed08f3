"""Acceptance tests: the real `reservoir` command in a subprocess, against a test database."""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading

import pytest
from sqlalchemy import text

from reservoir.store import migrate
from reservoir.store.engine import sync_engine
from tests.commands import RESERVOIR, command_env, key_values, reservoir, scalar


@pytest.fixture
def two_runs(cli):
    engine = sync_engine(cli.url)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO runs (name, group_size) VALUES ('a', 4), ('b', 8)"))
    engine.dispose()
    return cli


@pytest.mark.slow
@pytest.mark.process
def test_db_upgrade_on_an_empty_database_then_already_at(new_database, tmp_path):
    url, head = new_database(), migrate.head_revision()
    first = reservoir("db", "upgrade", url=url, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert f"upgraded from empty to revision {head}" in first.stdout
    second = reservoir("db", "upgrade", url=url, cwd=tmp_path)
    assert f"already at revision {head}" in second.stdout


@pytest.mark.process
def test_db_status_shows_the_revision(cli):
    out = cli("db", "status")
    head = migrate.head_revision()
    assert f"{head} (code expects {head})" in out and "up to date" in out


@pytest.mark.process
def test_db_url_hides_the_password(tmp_path):
    url = "postgresql://alice:s3cret@db.example:5432/store"
    hidden = reservoir("db", "url", url=url, cwd=tmp_path)
    assert hidden.returncode == 0, hidden.stderr
    assert hidden.stdout.strip() == "postgresql://alice:***@db.example:5432/store"
    assert reservoir("db", "url", "--show-password", url=url, cwd=tmp_path).returncode == 2


@pytest.mark.slow
@pytest.mark.process
def test_demo_then_inspect_run_and_experience(cli):
    cli("demo", "store", "--groups", "50", "--steps", "2", "--groups-per-step", "4")
    assert scalar(cli.url, "SELECT count(*) FROM train_steps") == 2
    assert scalar(cli.url, "SELECT count(*) FROM experiences WHERE status = 'consumed'") == 64

    run = cli("inspect", "run", "quickstart")
    assert "run quickstart" in run and "recent train steps" in run
    fields = key_values(run)
    assert (fields["consumed"], fields["ready"], fields["last_step"]) == ("64", "336", "2")

    experience = cli("inspect", "experience", "1")
    assert "lineage" in experience
    fields = key_values(experience)
    assert (fields["run"], fields["status"], fields["last_step"]) == ("quickstart", "consumed", "1")
    assert "synthetic://v1" in experience  # trained at step 1, first published in version 1


def test_sql_formats(two_runs):
    query = "SELECT run AS name, group_size FROM analytics.runs ORDER BY run"
    assert two_runs("sql", query, "--format", "csv").splitlines() == [
        "name,group_size", "a,4", "b,8"]
    assert json.loads(two_runs("sql", query, "--format", "json")) == [
        {"name": "a", "group_size": 4}, {"name": "b", "group_size": 8}]
    table = two_runs("sql", query).splitlines()
    assert any("name" in line and "group_size" in line for line in table)
    assert any("a" in line and "4" in line for line in table)
    assert any("b" in line and "8" in line for line in table)


def test_sql_param_binds(two_runs):
    out = two_runs("sql", "SELECT group_size FROM analytics.runs WHERE run = :name", "-p", "name=b",
                   "-f", "csv")
    assert out.splitlines() == ["group_size", "8"]


def test_sql_is_read_only_unless_write(two_runs):
    refused = two_runs.raw("sql", "DELETE FROM runs")
    assert refused.returncode == 1
    assert "DELETE is not a query" in refused.stderr and "Traceback" not in refused.stderr
    hidden = two_runs.raw("sql", "WITH d AS (DELETE FROM runs RETURNING 1) SELECT count(*) FROM d")
    assert "read-only transaction" in hidden.stderr and hidden.stderr.count("\n") == 1
    assert scalar(two_runs.url, "SELECT count(*) FROM runs") == 2
    assert "DELETE 2" in two_runs("sql", "DELETE FROM runs", "--write")
    assert scalar(two_runs.url, "SELECT count(*) FROM runs") == 0


@pytest.mark.process
def test_config_with_an_unknown_key_names_it(cli, tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("store:\n  urll: postgresql://x@y/z\n")
    result = cli.raw("db", "url", "-c", str(config))
    assert result.returncode == 1
    assert "store.urll (line 2): unknown key; did you mean 'url'?" in result.stderr


@pytest.mark.process
def test_inspect_an_unknown_run_fails_clearly(cli):
    result = cli.raw("inspect", "run", "nosuch")
    assert result.returncode == 1
    assert "run 'nosuch' does not exist" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
@pytest.mark.process
def test_pipeline_commands(cli, tmp_path):
    cli("demo", "store", "--groups", "50", "--raw-groups", "20", "--steps", "1")
    pipeline = tmp_path / "gate.yaml"
    pipeline.write_text("source: {runs: [quickstart]}\nprocess:\n  - group_variance_filter: {}\n")
    assert "is valid: 1 operator (group_variance_filter)" in cli("pipeline", "check",
                                                                  str(pipeline))
    assert "would change (dry run, nothing was written)" in cli("pipeline", "run", str(pipeline),
                                                                "--dry-run")
    assert scalar(cli.url, "SELECT count(*) FROM experiences WHERE status = 'raw'") == 160
    cli("pipeline", "run", str(pipeline))
    assert scalar(cli.url, "SELECT count(*) FROM experiences WHERE status = 'raw'") == 0
    history = cli("pipeline", "history", "gate")
    assert "succeeded" in history and "dry_run" in history
    assert "reward_range_filter" in cli("pipeline", "ops", "reward")
    typo = tmp_path / "typo.yaml"
    typo.write_text("process:\n  - text_lenght_filter: {}\n")
    failed = reservoir("pipeline", "check", str(typo), url=cli.url, cwd=tmp_path)
    assert failed.returncode == 1
    assert "typo.yaml: process[0] (text_lenght_filter): unknown operator; did you mean " \
           "'text_length_filter'" in " ".join(failed.stderr.split())
    cli("schedule", "add", str(pipeline), "--cron", "*/5 * * * *")
    assert "*/5 * * * *" in cli("schedule", "list")
    cli("schedule", "remove", "gate")


# -- issue 8: a quick, tidy CLI ---------------------------------------------------------------

def one_line_error(result) -> str:
    assert result.returncode == 1, result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


@pytest.mark.process
def test_sql_binds_with_the_cast_idiom_and_refuses_missing_values_in_one_line(cli):
    assert cli("sql", "SELECT :x::int + 1 AS y, :x AS raw", "-p", "x=41", "-f", "csv"
               ).splitlines() == ["y,raw", "42,41"]
    typed = cli("sql", "SELECT :ids::int[] AS a, :b::bool AS b, :j::jsonb AS j", "-p",
                "ids=[1, 2]", "-p", "b=yes", "-p", 'j={"k": [1]}', "-f", "csv")
    assert typed.splitlines()[1] == '"[1, 2]",True,"{""k"": [1]}"'
    assert "no value was given (-p x=VALUE)" in one_line_error(cli.raw("sql", "SELECT :x"))
    assert "syntax error" in one_line_error(cli.raw("sql", "SELECT 1 FRO nope"))
    assert "not a valid integer" in one_line_error(cli.raw("sql", "SELECT :x::int", "-p", "x=a"))


@pytest.mark.process
def test_errors_print_as_plain_text(cli):
    """Rich markup turned ':x:' in an error into an emoji on main."""
    line = one_line_error(cli.raw("sql", 'SELECT 1 FROM "tbl:x:[bold]"'))
    assert 'relation "tbl:x:[bold]" does not exist' in line


@pytest.mark.process
def test_csv_json_and_table_cells_hold_json(cli):
    query = ("SELECT '{\"a\": 87}'::jsonb AS j, ARRAY[1, 2] AS a, NULL::int AS n, "
             "timestamptz '2026-11-30 12:00:00.123456+00' AS t")
    assert cli("sql", query, "-f", "csv").splitlines()[1] == \
        '"{""a"": 87}","[1, 2]",,2026-11-30 12:00:00+00:00'
    assert json.loads(cli("sql", query, "-f", "json"))[0]["j"] == {"a": 87}
    table = cli("sql", query)
    assert '{"a": 87}' in table and "[1, 2]" in table and "{'a'" not in table


@pytest.mark.slow
@pytest.mark.process
def test_tables_stay_readable_at_80_columns(cli, tmp_path):
    cli("demo", "store", "--groups", "40", "--steps", "2", "--groups-per-step", "4",
        "--raw-groups", "2")
    pipeline = tmp_path / "a_rather_long_pipeline_name.yaml"
    pipeline.write_text("source: {runs: [quickstart]}\nprocess: []\n")
    cli("pipeline", "run", str(pipeline))
    narrow = {**os.environ, "RESERVOIR_DB_URL": cli.url, "COLUMNS": "80"}
    for args in (["inspect", "run", "quickstart"], ["pipeline", "history"],
                 ["sql", "SELECT * FROM analytics.experiences LIMIT 3"]):
        out = subprocess.run([str(RESERVOIR), *args], env=narrow, capture_output=True,
                             text=True, timeout=120).stdout
        assert max(map(len, out.splitlines())) <= 80, out
        if args[0] == "inspect":
            assert re.search(r"│ created_at +│ 20\d\d-\d\d-\d\d \d\d:\d\d:\d\d", out), out
        if args[0] == "pipeline":
            assert "a_rather_long_pipeline_name" in out, out
        if args[0] == "sql":
            assert "more columns:" in out and "--wide" in out
    wide = subprocess.run([str(RESERVOIR), "sql", "SELECT * FROM analytics.experiences LIMIT 1",
                           "--wide"], env=narrow, capture_output=True, text=True).stdout
    assert "more columns" not in wide and "created_at" in wide


@pytest.mark.slow
@pytest.mark.process
def test_read_commands_leave_an_empty_database_empty(new_database, tmp_path):
    url = new_database()
    for args in (["sql", "SELECT 1"], ["inspect", "run", "x"], ["pipeline", "history"],
                 ["schedule", "list"], ["review", "list"]):
        line = one_line_error(reservoir(*args, url=url, cwd=tmp_path))
        assert "has no Reservoir schema" in line and "reservoir db upgrade" in line
    assert scalar(url, "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'") == 0


@pytest.mark.slow
@pytest.mark.process
def test_downgrade_to_base_leaves_nothing_of_reservoir(new_database, tmp_path):
    url = new_database()
    assert reservoir("db", "upgrade", url=url, cwd=tmp_path).returncode == 0
    done = reservoir("db", "downgrade", "base", url=url, cwd=tmp_path)
    assert done.returncode == 0 and "now at revision base" in done.stdout, done.stderr
    assert scalar(url, "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'") == 0
    assert scalar(url, "SELECT to_regnamespace('analytics') IS NULL")
    assert scalar(url, "SELECT count(*) FROM pg_proc WHERE proacl::text LIKE "
                       "'%reservoir_reader%'") == 0


def test_create_run_twice_names_the_run(store):
    from reservoir.errors import StoreError

    store.create_run("twice")
    with pytest.raises(StoreError, match="run 'twice' already exists"):
        store.create_run("twice")


def test_run_steps_keep_step_0_and_the_evaluations(store):
    from reservoir.store.inspect import run_sql
    from reservoir.store.ledger import add_step_metrics, record_step
    from tests.factories import fill

    run_id = store.create_run("e", group_size=4)
    with store.engine.begin() as conn:
        record_step(conn, run_id, 0, policy_version=0, metrics={"eval/accuracy": 0.25})
    fill(store, "e", 1)
    store.commit_step(store.lease("e", groups=1), step=1, policy_version=0)
    with store.engine.begin() as conn:
        add_step_metrics(conn, run_id, 1, {"eval/accuracy": 0.5})
    rows = run_sql(store.url, "SELECT step, n_experiences, eval_accuracy FROM "
                              "analytics.run_steps ORDER BY step").rows
    assert rows == [(0, 0, 0.25), (1, 4, 0.5)]


@pytest.mark.process
@pytest.mark.parametrize("url", [
    "postgresql://no_such_role@127.0.0.1:5432/test",
    "postgresql://postgres@no-such-host.invalid:5432/test",
    "postgresql://postgres@127.0.0.1:5432/test?sslmode=bogus",
    "postgresql://postgres:secret@127.0.0.1:1/test",
    "mysql://root@127.0.0.1/test",
])
@pytest.mark.parametrize("args", [("sql", "SELECT 1"), ("db", "status"), ("pipeline", "history"),
                                  ("inspect", "run", "x")])
def test_a_bad_server_url_is_one_line_without_its_password(tmp_path, monkeypatch, url, args):
    """Issue 8: main printed a 143-line traceback. Reads log in as the reader, not as the
    store's login (issue 28): the bad URL is the reader's too, else `sql` and `inspect` would
    pass as reservoir_reader wherever an earlier test had created it."""
    monkeypatch.setenv("RESERVOIR_READER_URL", url)
    line = one_line_error(reservoir(*args, url=url, cwd=tmp_path))
    assert "secret" not in line


@pytest.mark.slow
@pytest.mark.process
def test_sql_streams_rows_and_stops_at_max_rows(cli):
    """Issue 28: an unbounded SELECT held all its rows in memory (1M rows: 1.9 GB, 345 s, then
    a MemoryError). Rows stream through a cursor: a table shows --max-rows of them (10,000 by
    default) and says how many more there were; CSV streams them all."""
    import time

    import psutil

    def run(*args: str) -> tuple[subprocess.CompletedProcess, float, int]:
        began, peak = time.monotonic(), 0
        process = subprocess.Popen([str(RESERVOIR), "sql", *args], env=command_env(cli.url),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        watched = psutil.Process(process.pid)
        out: list[str] = []
        reader = threading.Thread(target=lambda: out.append(process.stdout.read()))
        reader.start()
        while process.poll() is None:
            try:
                peak = max(peak, watched.memory_info().rss)
            except psutil.NoSuchProcess:
                break
            time.sleep(0.05)
        reader.join()
        done = subprocess.CompletedProcess(args, process.returncode, out[0], process.stderr.read())
        return done, time.monotonic() - began, peak

    wide = "SELECT g, repeat('x', 100) AS pad FROM generate_series(1, 1000000) g"
    table, seconds, peak = run(wide, "--wide")
    assert table.returncode == 0, table.stderr
    assert "990,000 more rows not shown (--max-rows 10000)" in table.stdout + table.stderr
    assert seconds < 60 and peak < 400 * 2**20, (seconds, peak / 2**20)
    few, _, _ = run(wide, "--max-rows", "3", "-f", "json")
    assert len(json.loads(few.stdout)) == 3 and "999,997 more rows" in few.stderr
    csv, _, peak = run("SELECT g FROM generate_series(1, 300000) g", "-f", "csv")
    assert csv.stdout.splitlines()[-1] == "300000" and len(csv.stdout.splitlines()) == 300_001
    assert peak < 400 * 2**20, peak / 2**20
