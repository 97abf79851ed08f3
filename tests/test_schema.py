"""platform/reservoir/store/sql/schema.sql is the database the migrations make: a database built
by every migration and one built from that file have the same catalog (tests/catalog.py), and
the comparison does see a change planted in one. The analytics views keep the columns people
read (tests/view_columns.json)."""

from __future__ import annotations

import json
from pathlib import Path

import psycopg2
import pytest
import reservoir.store

from tests import catalog

SCHEMA_SQL = Path(reservoir.store.__file__).with_name("sql") / "schema.sql"
VIEW_COLUMNS = Path(__file__).with_name("view_columns.json")

# A change of each kind, planted in the database built from schema.sql: the object whose line
# the comparison must report, and the statement.
PLANTED = {
    "function body": ("public.lease_consumed(consumed bigint, leased bigint, token uuid)", """
        CREATE OR REPLACE FUNCTION lease_consumed(consumed bigint, leased bigint, token uuid)
        RETURNS bigint LANGUAGE plpgsql AS $$ BEGIN RETURN consumed; END $$"""),
    "function setting": ("public.experience_partitions_add(run bigint)", """
        ALTER FUNCTION experience_partitions_add(bigint) SET search_path = public"""),
    "security definer": ("analytics.int32s(b bytea)",
                         "ALTER FUNCTION analytics.int32s(bytea) SECURITY DEFINER"),
    "trigger": ("public.runs.runs_add_partitions", """
        DROP TRIGGER runs_add_partitions ON runs;
        CREATE TRIGGER runs_add_partitions AFTER INSERT OR UPDATE ON runs
            FOR EACH ROW EXECUTE FUNCTION runs_add_partitions()"""),
    "trigger disabled": ("public.runs.ledger_ids_kept",
                         "ALTER TABLE runs DISABLE TRIGGER ledger_ids_kept"),
    "view": ("analytics.schedules", """
        CREATE OR REPLACE VIEW analytics.schedules AS
        SELECT s.id AS schedule_id, s.name AS schedule, s.pipeline_file, lower(s.cron) AS cron,
               s.enabled, s.last_run_at, s.next_run_at, s.missed_runs, s.created_at
        FROM public.schedules s"""),
    "view option": ("analytics.runs", "ALTER VIEW analytics.runs SET (security_barrier = true)"),
    "grant": ("analytics.tasks", "REVOKE SELECT ON analytics.tasks FROM reservoir_reader"),
    "column grant": ("public.runs.name", "GRANT SELECT (name) ON runs TO reservoir_reader"),
    "schema grant": ("analytics", "GRANT CREATE ON SCHEMA analytics TO reservoir_reader"),
    "default": ("public.tasks.split", "ALTER TABLE tasks ALTER COLUMN split SET DEFAULT 'test'"),
    "index": ("public.tasks_claimed", """
        DROP INDEX tasks_claimed;
        CREATE INDEX tasks_claimed ON tasks (run_id, claimed_until)"""),
    "storage parameter": ("public.tasks", "ALTER TABLE tasks SET (fillfactor = 90)"),
    "comment": ("public.run_archives", "COMMENT ON TABLE run_archives IS 'archives'"),
}


def _connect(url: str):
    conn = psycopg2.connect(url)
    conn.autocommit = True
    return conn


@pytest.fixture
def migrated(db_url):
    """The catalog of a database built by every migration."""
    conn = _connect(db_url)
    try:
        yield catalog.snapshot(conn)
    finally:
        conn.close()


@pytest.fixture
def built(new_database):
    """A connection (autocommit) to an empty database, bootstrapped, that ran schema.sql as the
    owner."""
    conn = _connect(new_database())
    try:
        with conn.cursor() as cur:
            cur.execute(SCHEMA_SQL.read_text())
        yield conn
    finally:
        conn.close()


def test_schema_sql_builds_the_database_the_migrations_build(migrated, built):
    diff = catalog.differences(migrated, catalog.snapshot(built), ("migrations", "schema.sql"))
    assert not diff, "schema.sql and the migrations disagree:\n" + "\n".join(diff)


def test_the_comparison_reports_a_planted_change_of_each_kind(migrated, built):
    assert not catalog.differences(migrated, catalog.snapshot(built))
    missed = {}
    for kind, (name, statement) in PLANTED.items():
        built.autocommit = False
        try:
            with built.cursor() as cur:
                cur.execute(statement)
            changed = catalog.changed_lines(catalog.differences(migrated, catalog.snapshot(built)))
        finally:
            built.rollback()
            built.autocommit = True
        if not any(line[1:].startswith(f"{name}:") for line in changed):
            missed[kind] = changed
    assert not missed, f"planted changes the comparison did not report by name: {missed}"


def test_the_analytics_views_keep_their_columns(db_url):
    """A column people read is an interface: renaming one keeps the old name as an alias for a
    release. A new column is fine (add it to view_columns.json); one gone or retyped is not."""
    conn = _connect(db_url)
    try:
        with conn.cursor() as cur:
            cur.execute("""
                SELECT c.relname, a.attname, format_type(a.atttypid, a.atttypmod)
                FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
                WHERE c.relnamespace = 'analytics'::regnamespace AND c.relkind = 'v'
                  AND a.attnum > 0 AND NOT a.attisdropped""")
            now = {(view, column): type_ for view, column, type_ in cur.fetchall()}
    finally:
        conn.close()
    recorded = json.loads(VIEW_COLUMNS.read_text())
    broken = [f"analytics.{view}.{column} ({type_}): "
              + (f"now {now[view, column]}" if (view, column) in now else "gone")
              for view, columns in recorded.items() for column, type_ in columns.items()
              if now.get((view, column)) != type_]
    assert not broken, "analytics columns people read changed:\n" + "\n".join(broken)
