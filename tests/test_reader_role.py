"""reservoir_reader logs in as itself, sees the analytics views and nothing else; run_sql is
read-only by default."""

from __future__ import annotations

import pytest

from reservoir.errors import StoreError
from reservoir.store.inspect import run_sql
from reservoir.store.tasks import add_tasks
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


def as_reader(store, sql: str, **kwargs):
    return run_sql(store.url, sql, as_reader=True, **kwargs)


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
    counts = "SELECT (SELECT count(*) FROM runs), (SELECT count(*) FROM batch_items)"
    assert run_sql(trained.url, counts).rows == [(1, 4)]


def test_run_sql_is_read_only_unless_write(trained):
    with pytest.raises(StoreError, match="not a query"):
        run_sql(trained.url, "DELETE FROM batch_items")
    with pytest.raises(StoreError, match="read-only transaction"):
        run_sql(trained.url, "WITH gone AS (DELETE FROM batch_items RETURNING 1) SELECT 1")
    assert run_sql(trained.url, "SELECT count(*) FROM batch_items").rows == [(4,)]
    assert run_sql(trained.url, "DELETE FROM batch_items", write=True).rowcount == 4
    assert run_sql(trained.url, "SELECT count(*) FROM batch_items").rows == [(0,)]
