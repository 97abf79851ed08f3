"""reservoir_reader logs in as itself, sees the analytics views and nothing else; run_sql is
read-only by default."""

from __future__ import annotations

import os
import subprocess

import pytest

from reservoir.errors import StoreError
from reservoir.store.inspect import run_sql
from reservoir.store.tasks import add_tasks
from reservoir.plan.urls import READER_ROLE, with_user
from tests.commands import RESERVOIR, execute, scalar
from tests.factories import fill

BASE_TABLES = ["runs", "tasks", "experiences", "policy_versions", "train_steps", "batch_items",
               "pipeline_runs", "operator_events", "validations", "schedules", "reviews"]
VIEWS = ["experiences", "experience_tokens", "run_steps", "lineage", "runs", "tasks",
         "policy_versions"]
PIPELINE_VIEWS = ["pipeline_runs", "operator_events", "validations", "reviews", "schedules",
                  "preferences"]  # empty here
A_COLUMN = {"runs": "name", "tasks": "prompt", "experiences": "reward",
            "policy_versions": "location", "train_steps": "loss", "batch_items": "weight"}
WRITES = [statement for table, column in A_COLUMN.items() for statement in (
    f"INSERT INTO {table} DEFAULT VALUES", f"UPDATE {table} SET {column} = {column}",
    f"DELETE FROM {table}")]


@pytest.fixture
def trained(store):
    """A run with two groups written, one of them trained at step 1 and published as version 1."""
    run_id = store.create_run("r", group_size=4)
    with store.engine.begin() as conn:
        add_tasks(conn, run_id, [{"prompt": "What is 1 + 1?", "answer": "2"}])
    fill(store, "r", 2)
    store.commit_step(store.lease("r", groups=1), step=1, policy_version=0)
    store.publish_version("r", 1, location="file:///v1", train_step=1)
    return store


def as_reader(store, sql: str, *, write: bool = False):
    """Reads go to the reader by themselves; with `write`, the reader's own login is the
    store's URL (the store's owner is the one that writes)."""
    return run_sql(with_user(store.url, READER_ROLE) if write else store.url, sql, write=write)


@pytest.mark.parametrize("view", VIEWS)
def test_reader_reads_every_view(trained, view):
    assert as_reader(trained, f"SELECT * FROM analytics.{view}").rows


@pytest.mark.parametrize("view", PIPELINE_VIEWS)
def test_reader_may_read_the_pipeline_views(trained, view):
    assert as_reader(trained, f"SELECT * FROM analytics.{view}").columns


def test_reader_sees_the_data_written_through_the_store(trained):
    assert as_reader(trained, "SELECT run, consumed, ready, last_step, latest_version "
                              "FROM analytics.runs").rows == [("r", 4, 4, 1, 1)]
    lineage = as_reader(trained, "SELECT step, published_version FROM analytics.lineage "
                                 "WHERE step IS NOT NULL")
    assert lineage.rows == [(1, 1)] * 4
    tokens = as_reader(trained, "SELECT response_ids FROM analytics.experience_tokens "
                                "ORDER BY experience_id")
    assert len(tokens.rows) == 8 and all(len(row[0]) == 6 for row in tokens.rows)


@pytest.mark.parametrize("table", BASE_TABLES)
def test_reader_cannot_select_base_tables(trained, table):
    with pytest.raises(StoreError, match="permission denied"):
        as_reader(trained, f"SELECT * FROM {table}")


@pytest.mark.parametrize("statement", WRITES)
def test_reader_cannot_write_base_tables(trained, statement):
    with pytest.raises(StoreError, match="permission denied"):
        as_reader(trained, statement, write=True)
    counts = "SELECT ARRAY[(SELECT count(*) FROM runs), (SELECT count(*) FROM batch_items)]"
    assert scalar(trained.url, counts) == [1, 4]


def test_run_sql_reads_as_the_reader_and_writes_as_the_owner(trained):
    with pytest.raises(StoreError, match="not a query"):
        run_sql(trained.url, "DELETE FROM batch_items")
    with pytest.raises(StoreError, match="read-only transaction"):
        run_sql(trained.url, "WITH gone AS (DELETE FROM batch_items RETURNING 1) SELECT 1")
    with pytest.raises(StoreError, match="permission denied"):
        run_sql(trained.url, "SELECT count(*) FROM batch_items")
    assert run_sql(trained.url, "SELECT current_user").rows == [(READER_ROLE,)]
    assert run_sql(trained.url, "SELECT count(*) FROM batch_items", write=True).rows == [(4,)]
    assert run_sql(trained.url, "DELETE FROM batch_items", write=True).rowcount == 4
    assert scalar(trained.url, "SELECT count(*) FROM batch_items") == 0


def test_the_scram_verifier_is_the_one_libpq_computes(store):
    """Same salt and iterations, same keys as libpq's PQencryptPasswordConn."""
    import base64

    from psycopg2.extensions import encrypt_password

    from reservoir.store.roles import scram_verifier

    with store.engine.connect() as conn:
        libpq = encrypt_password("pencil s3cret", "reservoir_reader",
                                 conn.connection.dbapi_connection, "scram-sha-256")
    iterations, salt = libpq.split("$")[1].split(":")
    ours = scram_verifier("pencil s3cret", salt=base64.b64decode(salt),
                          iterations=int(iterations))
    assert ours == libpq


@pytest.mark.process
def test_reader_password_sets_a_scram_verifier(cli, as_admin):
    """Issue 8 review: the command failed (text() read ':ServerKey' as a parameter). Only a
    superuser may set it: the owner is told so in one line."""
    def set_password(url):
        return subprocess.run([str(RESERVOIR), "db", "password", "reader"], capture_output=True,
                              text=True, env={**os.environ, "RESERVOIR_DB_URL": url,
                                              "RESERVOIR_READER_PASSWORD": "a:b'c"}, timeout=120)

    refused = set_password(cli.url)
    assert refused.returncode == 1 and "superuser" in refused.stderr, refused.stderr
    out = set_password(as_admin(cli.url))
    assert out.returncode == 0, out.stderr
    assert "a:b'c" not in out.stdout + out.stderr
    admin = as_admin(cli.url)
    stored = scalar(admin, "SELECT rolpassword FROM pg_authid WHERE rolname = 'reservoir_reader'")
    assert stored.startswith("SCRAM-SHA-256$4096:")
    execute(admin, "ALTER ROLE reservoir_reader PASSWORD NULL")


def test_upgrade_stops_when_the_reader_could_still_write(new_database, template_db, as_admin):
    """A role that does not own lo_from_bytea cannot revoke it from PUBLIC (PostgreSQL only
    warns): migration 0006 checks what the reader can do and stops with the fix."""
    from reservoir.store import migrate
    from reservoir.store.engine import sync_engine

    url = new_database(template_db)
    engine, grant = sync_engine(url), "EXECUTE ON FUNCTION lo_from_bytea(oid, bytea)"
    migrate.downgrade(engine, "0005")
    execute(as_admin(url), f"GRANT {grant} TO reservoir_reader")
    with pytest.raises(Exception, match="reservoir_reader could still write.*superuser run once"):
        migrate.upgrade(engine)
    assert migrate.current_revision(engine) == "0005"
    execute(as_admin(url), f"REVOKE {grant} FROM reservoir_reader")
    migrate.upgrade(engine)
    assert migrate.current_revision(engine) == migrate.head_revision()
    engine.dispose()
