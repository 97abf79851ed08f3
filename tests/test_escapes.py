"""The escapes issue 8 found on main, each reproduced through the real `reservoir` command:
read-only and reader access escaped with one string, and a pipeline's `where` pasted into SQL.

Every test checks the store afterwards: nothing was created, read or changed."""

from __future__ import annotations

import asyncio
import json
import select
import subprocess
import textwrap
import uuid
from pathlib import Path

import asyncpg
import psycopg2
import pytest

from reservoir.store import direct, usersql
from reservoir.plan.urls import READER_ROLE, with_user
from tests.factories import fill
from tests.commands import RESERVOIR, command_env, reservoir, scalar

pytestmark = pytest.mark.process

PROBE = "SELECT to_regclass('public.probe') IS NOT NULL"


@pytest.fixture
def sql(cli):
    """`reservoir sql ...` returning the finished process (exit code, stdout, stderr)."""
    return lambda *args: cli.raw("sql", *args)


async def owner_reads(url: str, statement: str):
    """A statement read-only as the store's owner (as a pipeline's `where` runs)."""
    async with direct.connect(url) as conn:
        return await usersql.run(conn, statement)


def refused(result, *needles: str) -> None:
    """A non-zero exit with one line on stderr (no traceback) that contains the needles."""
    assert result.returncode != 0, result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize("statement", [
    "COMMIT; CREATE TABLE public.probe(x int)",
    "SET TRANSACTION READ WRITE; CREATE TABLE public.probe(x int)",
    "CREATE TABLE public.probe(x int)",
    "SELECT 1; CREATE TABLE public.probe(x int)",
])
def test_sql_without_write_creates_nothing(cli, sql, statement):
    refused(sql(statement))
    assert scalar(cli.url, PROBE) is False


def test_sql_without_write_leaves_no_large_object(cli, sql):
    before = scalar(cli.url, "SELECT count(*) FROM pg_largeobject_metadata")
    sql("SELECT lo_from_bytea(0, 'x')")
    assert scalar(cli.url, "SELECT count(*) FROM pg_largeobject_metadata") == before


@pytest.mark.parametrize("statement", [
    "RESET ROLE; SELECT count(*) FROM public.runs",
    "SELECT set_config('role', session_user, true), "
    "query_to_xml('SELECT count(*) AS n FROM public.runs', true, false, '')",
    "SELECT query_to_xml('SELECT name FROM public.runs', true, false, '')",
    "COMMIT; CREATE TABLE public.probe(x int)",
])
def test_reader_cannot_escape_its_role(cli, sql, statement):
    cli("sql", "--write", "INSERT INTO runs (name) VALUES ('secret-run')")
    result = sql(statement)
    refused(result)
    assert "secret-run" not in result.stdout and "<n>" not in result.stdout
    assert scalar(cli.url, PROBE) is False


def test_reader_cannot_write_a_large_object_even_with_write(cli, sql, tmp_path):
    before = scalar(cli.url, "SELECT count(*) FROM pg_largeobject_metadata")
    refused(reservoir("sql", "--write", "SELECT lo_from_bytea(0, 'x')",
                      url=with_user(cli.url, READER_ROLE), cwd=tmp_path), "permission denied")
    assert scalar(cli.url, "SELECT count(*) FROM pg_largeobject_metadata") == before


def test_reader_logs_in_as_itself(cli, sql):
    out = cli("sql", "--format", "csv", "SELECT current_user, session_user")
    assert out.splitlines()[1] == "reservoir_reader,reservoir_reader"


def test_a_notification_from_user_sql_never_reaches_listeners(cli, sql):
    listener = psycopg2.connect(cli.url)
    listener.autocommit = True
    listener.cursor().execute("LISTEN reservoir_policy")
    sql("SELECT pg_notify('reservoir_policy', '1:999')")
    # the owner's read-only SQL (as a pipeline's where runs): rolled back, never sent
    asyncio.run(owner_reads(cli.url, "SELECT pg_notify('reservoir_policy', '1:998')"))
    select.select([listener], [], [], 0.5)
    listener.poll()
    assert listener.notifies == []
    listener.close()


@pytest.mark.slow
def test_reader_holding_a_schedules_lock_does_not_stop_the_scheduler(cli, tmp_path):
    """The reader is a real login: it may call pg_advisory_lock on its own connection. The
    scheduler's lock must not be one it can take."""
    cli("demo", "store", "--groups", "4", "--group-size", "2", "--steps", "1",
        "--groups-per-step", "1", "--raw-groups", "2")
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text("source: {runs: [quickstart]}\nprocess: []\n")
    cli("schedule", "add", str(pipeline), "--cron", "* * * * *")
    cli("sql", "--write", "UPDATE schedules SET next_run_at = now() - interval '1 minute'")
    schedule_id = scalar(cli.url, "SELECT id FROM schedules")

    async def hold_then_serve():
        reader = await asyncpg.connect(with_user(cli.url, "reservoir_reader"))
        for key in ((7_146_002, schedule_id),):
            await reader.execute("SELECT pg_advisory_lock($1, $2)", *key)
        try:
            return await asyncio.to_thread(cli.raw, "schedule", "serve", "--once")
        finally:
            await reader.close()

    result = asyncio.run(hold_then_serve())
    assert result.returncode == 0, result.stderr
    assert scalar(cli.url, "SELECT count(*) FROM pipeline_runs WHERE trigger = 'schedule'") == 1


# -- a pipeline's source.where ----------------------------------------------------------------

@pytest.fixture
def pipeline(cli, tmp_path):
    """Write a pipeline file from YAML text and run `reservoir pipeline ...` on it."""
    cli("demo", "store", "--groups", "6", "--group-size", "2", "--steps", "1",
        "--groups-per-step", "2", "--raw-groups", "2")
    cli("sql", "--write", "CREATE TABLE public.t (x int)")

    def run(body: str, *args: str):
        path = tmp_path / "p.yaml"
        path.write_text(textwrap.dedent(body))
        return cli.raw("pipeline", "run", str(path), *args)

    return run


def statuses(url: str) -> dict[str, int]:
    rows = scalar(url, "SELECT json_object_agg(status, n) FROM (SELECT status, count(*) AS n "
                       "FROM experiences GROUP BY status) s")
    return dict(rows)


@pytest.mark.slow
@pytest.mark.parametrize("dry_run", [True, False])
def test_where_cannot_run_a_second_statement(cli, pipeline, dry_run):
    where = "true); COMMIT; DROP TABLE t; SELECT * FROM experiences WHERE (true"
    before = statuses(cli.url)
    result = pipeline(f"source: {{runs: [quickstart], where: {where!r}}}\nprocess: []\n",
                      *(["--dry-run"] if dry_run else []))
    refused(result, "where")
    assert scalar(cli.url, "SELECT to_regclass('public.t') IS NOT NULL") is True
    assert statuses(cli.url) == before


@pytest.mark.slow
@pytest.mark.parametrize("where", ["false) OR (true", "true) OR (status = 'consumed'"])
def test_where_cannot_escape_the_run_and_status_filter(cli, pipeline, where):
    before = statuses(cli.url)
    result = pipeline(f"source: {{runs: [quickstart], where: {where!r}}}\nprocess: []\n")
    refused(result, "where")
    assert statuses(cli.url) == before
    assert scalar(cli.url, "SELECT count(*) FROM batch_items bi JOIN experiences e "
                           "ON e.id = bi.experience_id WHERE e.status <> 'consumed'") == 0


@pytest.mark.slow
def test_a_pipeline_cannot_select_consumed_rows(cli, pipeline):
    before = statuses(cli.url)
    refused(pipeline("source: {runs: [quickstart], status: [consumed]}\nprocess: []\n"),
            "source.status")
    assert statuses(cli.url) == before


@pytest.mark.slow
def test_where_has_a_statement_timeout(cli, pipeline):
    result = pipeline("source: {runs: [quickstart], where: 'pg_sleep(1) IS NOT NULL', "
                      "timeout_s: 0.3}\nprocess: []\n")
    refused(result, "statement timeout")


def test_stored_configs_hold_no_password(cli, store, tmp_path):
    """A run's config is readable through analytics.runs: its store.url loses its password."""
    from reservoir.config import parse_config
    from reservoir.prepare import ensure_run

    secret_url = with_user(cli.url, "postgres", "hunter2")
    config = parse_config({"run": {"name": "pw"}, "store": {"url": secret_url},
                           "tasks": {"generate": "reverse", "count": 5}})
    ensure_run(store, config)
    stored = scalar(cli.url, "SELECT config::text FROM runs WHERE name = 'pw'")
    assert "hunter2" not in stored and "postgres@" in stored
    out = cli("sql", "--format", "csv", "SELECT config FROM analytics.runs")
    assert "hunter2" not in out


def test_reader_sees_the_views_and_no_base_table(cli, store):
    store.create_run("r", group_size=4)
    fill(store, "r", 2)
    assert cli("sql", "--format", "csv",
               "SELECT count(*) FROM analytics.experiences").splitlines()[1] == "8"
    refused(cli.raw("sql", "SELECT count(*) FROM public.experiences"),
            "permission denied")


# -- issue 28: the store's own logins, and text the server reads otherwise than a scanner -------

def test_a_comment_ended_by_a_carriage_return_runs_no_program(cli, sql):
    """PostgreSQL ends a `--` comment at a carriage return too: the COPY after it ran a shell
    command as the server's user while the scanner took the statement for a SELECT."""
    marker = Path(f"/tmp/reservoir-escape-{uuid.uuid4().hex}")
    for args in ((), ("--write",)):
        result = sql(*args, "--", f"--\rCOPY (SELECT 1) TO PROGRAM 'touch {marker}' /*\nselect */")
        refused(result)
        assert not marker.exists()


@pytest.mark.parametrize("args", [(), ("--write",)])
def test_user_sql_never_runs_as_a_superuser(cli, sql, args):
    out = cli("sql", *args, "--format", "csv",
              "SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
    assert out.splitlines()[1] == "False"
    refused(sql(*args, "SELECT pg_read_file('PG_VERSION')"), "permission denied")


@pytest.mark.slow
@pytest.mark.parametrize("where", [
    "true --\r) OR (true --",
    "EXISTS (SELECT 1 AS ×$a$) ) OR (true OR EXISTS (SELECT 1 AS ×$a$)",
    "1$a$ = $a$) OR (true",
])
def test_where_cannot_hide_a_parenthesis_from_the_check(cli, pipeline, where):
    before = statuses(cli.url)
    result = pipeline(f"source: {{runs: [quickstart], where: {json.dumps(where)}}}\n"
                      "process: []\n")
    refused(result, "source.where")
    assert statuses(cli.url) == before


@pytest.mark.slow
def test_where_runs_no_superuser_function(cli, pipeline):
    before = statuses(cli.url)
    refused(pipeline("source: {runs: [quickstart], where: \"pg_read_file('PG_VERSION') <> ''\"}"
                     "\nprocess: []\n"), "permission denied")
    assert statuses(cli.url) == before


SECRET_URLS = {
    "in the user info": "postgresql://owner:{secret}@{host}/db",
    "as a query option": "postgresql://owner@{host}/db?password={secret}",
    "as sslpassword": "postgresql://owner@{host}/db?sslmode=disable&sslpassword={secret}",
    "with / and @ encoded": "postgresql://owner:{encoded}@{host}/db",
    "with a space": "postgresql://owner:{spaced}@{host}/db",
}
SECRET = "Pw3.4bc"


def secret_url(form: str, host: str = "127.0.0.1:1") -> str:
    return SECRET_URLS[form].format(secret=SECRET, encoded="Pw3%2F4%40bc", spaced="Pw3 4bc",
                                    host=host)


def leaks(text: str) -> bool:
    """Whether any piece of the secret shows (the pieces around its / @ or space too)."""
    return any(piece in text for piece in ("Pw3", "4bc", "Pw3.4bc"))


@pytest.mark.parametrize("form", SECRET_URLS)
def test_no_password_is_stored_in_a_runs_config(cli, store, form):
    from reservoir.config import parse_config
    from reservoir.prepare import ensure_run

    config = parse_config({"run": {"name": "pw"}, "store": {"url": secret_url(form)},
                           "tasks": {"generate": "reverse", "count": 5}})
    ensure_run(store, config)
    assert not leaks(scalar(cli.url, "SELECT config::text FROM runs WHERE name = 'pw'"))
    assert not leaks(cli("sql", "--format", "csv", "SELECT config FROM analytics.runs"))


@pytest.mark.slow
@pytest.mark.parametrize("form", SECRET_URLS)
def test_no_password_is_printed(cli, tmp_path, form):
    from tests.commands import command_env

    env = {**command_env(secret_url(form)), "RESERVOIR_READER_PASSWORD": ""}
    for args in (("db", "url"), ("sql", "--write", "SELECT 1"), ("sql", "SELECT 1"),
                 ("db", "status")):
        result = subprocess.run([str(RESERVOIR), *args], env=env, cwd=tmp_path,
                                capture_output=True, text=True, timeout=120)
        assert not leaks(result.stdout + result.stderr), (args, result.stdout + result.stderr)


# -- issue 28: no lock a reader can take holds back anything Reservoir does -----------------------

RUN_CREATION_LOCK = "SELECT pg_advisory_lock(hashtext('reservoir: run creation'))"
MIGRATION_LOCK = "SELECT pg_advisory_lock(7246120001)"
VIEWS_READ = ["SELECT count(*) FROM analytics.experiences", "SELECT count(*) FROM analytics.runs",
              "SELECT count(*) FROM analytics.lineage", "SELECT count(*) FROM analytics.tasks"]


@pytest.mark.slow
def test_a_reader_holding_every_lock_it_can_take_stops_no_run_from_starting(cli, tmp_path):
    """The reader took the advisory lock run creation waited on (`tasks load`, `run`,
    `train`, `serve` and `demo` waited forever), and keeps a transaction open that has read
    every view (so it holds their tables): runs are created and trained all the same."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"prompt": "abc", "answer": "cba"}) + "\n")

    async def hold_then_create():
        reader = await asyncpg.connect(with_user(cli.url, READER_ROLE))
        for lock in (RUN_CREATION_LOCK, MIGRATION_LOCK):
            await reader.execute(lock)
        holding = reader.transaction()
        await holding.start()
        for query in VIEWS_READ:
            await reader.fetch(query)
        try:
            return [await asyncio.to_thread(
                subprocess.run, [str(RESERVOIR), *args], env=command_env(cli.url),
                cwd=tmp_path, capture_output=True, text=True, timeout=60)
                for args in (("tasks", "load", str(tasks), "--run", "new-run"),
                             ("demo", "store", "--groups", "4", "--group-size", "2",
                              "--steps", "1", "--groups-per-step", "1"),
                             ("db", "upgrade"))]
        finally:
            await reader.close()

    for result in asyncio.run(hold_then_create()):
        assert result.returncode == 0, result.stderr
    assert scalar(cli.url, "SELECT count(*) FROM runs WHERE name IN ('new-run', 'quickstart')") == 2
    assert scalar(cli.url, "SELECT count(*) FROM train_steps") == 1


# -- issue 28: people's SQL signals no session -----------------------------------------------------

KILL_OTHERS = ("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
               "WHERE pid <> pg_backend_pid() AND datname = current_database()")
CANCEL_OTHERS = KILL_OTHERS.replace("pg_terminate_backend", "pg_cancel_backend")


@pytest.mark.parametrize("args", [(), ("--write",)])
@pytest.mark.parametrize("statement", [KILL_OTHERS, CANCEL_OTHERS])
def test_user_sql_ends_no_worker_and_no_other_reader(cli, sql, args, statement):
    """The owner's read-only SQL ended the trainers and explorers (same role), a reader's the
    other readers'."""
    worker, reader = psycopg2.connect(cli.url), psycopg2.connect(with_user(cli.url, READER_ROLE))
    refused(sql(*args, statement), "permission denied for function")
    for survivor in (worker, reader):
        with survivor.cursor() as cur:
            cur.execute("SELECT 1")
        survivor.close()


@pytest.mark.slow
def test_a_where_ends_no_worker(cli, pipeline):
    worker = psycopg2.connect(cli.url)
    where = KILL_OTHERS.replace("SELECT count(", "(SELECT count(") + ") >= 0"
    refused(pipeline(f"source: {{runs: [quickstart], where: {json.dumps(where)}}}\n"
                     "process: []\n"), "permission denied for function")
    with worker.cursor() as cur:
        cur.execute("SELECT 1")
    worker.close()
