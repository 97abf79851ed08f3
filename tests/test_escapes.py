"""The escapes issue 8 found on main, each reproduced through the real `reservoir` command:
read-only and reader access escaped with one string, and a pipeline's `where` pasted into SQL.

Every test checks the store afterwards: nothing was created, read or changed."""

from __future__ import annotations

import asyncio
import select
import textwrap

import asyncpg
import psycopg2
import pytest

from reservoir.store.urls import with_user
from tests.factories import fill
from tests.commands import scalar

PROBE = "SELECT to_regclass('public.probe') IS NOT NULL"


@pytest.fixture
def sql(cli):
    """`reservoir sql ...` returning the finished process (exit code, stdout, stderr)."""
    return lambda *args: cli.raw("sql", *args)


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
    result = sql("--as-reader", statement)
    refused(result)
    assert "secret-run" not in result.stdout and "<n>" not in result.stdout
    assert scalar(cli.url, PROBE) is False


def test_reader_cannot_write_a_large_object_even_with_write(cli, sql):
    before = scalar(cli.url, "SELECT count(*) FROM pg_largeobject_metadata")
    refused(sql("--as-reader", "--write", "SELECT lo_from_bytea(0, 'x')"), "permission denied")
    assert scalar(cli.url, "SELECT count(*) FROM pg_largeobject_metadata") == before


def test_reader_logs_in_as_itself(cli, sql):
    out = cli("sql", "--as-reader", "--format", "csv", "SELECT current_user, session_user")
    assert out.splitlines()[1] == "reservoir_reader,reservoir_reader"


def test_a_notification_from_user_sql_never_reaches_listeners(cli, sql):
    listener = psycopg2.connect(cli.url)
    listener.autocommit = True
    listener.cursor().execute("LISTEN reservoir_policy")
    sql("--as-reader", "SELECT pg_notify('reservoir_policy', '1:999')")
    sql("SELECT pg_notify('reservoir_policy', '1:998')")
    select.select([listener], [], [], 0.5)
    listener.poll()
    assert listener.notifies == []
    listener.close()


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


@pytest.mark.parametrize("dry_run", [True, False])
def test_where_cannot_run_a_second_statement(cli, pipeline, dry_run):
    where = "true); COMMIT; DROP TABLE t; SELECT * FROM experiences WHERE (true"
    before = statuses(cli.url)
    result = pipeline(f"source: {{runs: [quickstart], where: {where!r}}}\nprocess: []\n",
                      *(["--dry-run"] if dry_run else []))
    refused(result, "where")
    assert scalar(cli.url, "SELECT to_regclass('public.t') IS NOT NULL") is True
    assert statuses(cli.url) == before


@pytest.mark.parametrize("where", ["false) OR (true", "true) OR (status = 'consumed'"])
def test_where_cannot_escape_the_run_and_status_filter(cli, pipeline, where):
    before = statuses(cli.url)
    result = pipeline(f"source: {{runs: [quickstart], where: {where!r}}}\nprocess: []\n")
    refused(result, "where")
    assert statuses(cli.url) == before
    assert scalar(cli.url, "SELECT count(*) FROM batch_items bi JOIN experiences e "
                           "ON e.id = bi.experience_id WHERE e.status <> 'consumed'") == 0


def test_a_pipeline_cannot_select_consumed_rows(cli, pipeline):
    before = statuses(cli.url)
    refused(pipeline("source: {runs: [quickstart], status: [consumed]}\nprocess: []\n"),
            "source.status")
    assert statuses(cli.url) == before


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
    out = cli("sql", "--as-reader", "--format", "csv", "SELECT config FROM analytics.runs")
    assert "hunter2" not in out


def test_reader_sees_the_views_and_no_base_table(cli, store):
    store.create_run("r", group_size=4)
    fill(store, "r", 2)
    assert cli("sql", "--as-reader", "--format", "csv",
               "SELECT count(*) FROM analytics.experiences").splitlines()[1] == "8"
    refused(cli.raw("sql", "--as-reader", "SELECT count(*) FROM public.experiences"),
            "permission denied")
