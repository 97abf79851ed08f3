"""Scheduled pipelines: checked when added, run once per due time by any number of schedulers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from sqlalchemy import text

from reservoir.errors import ConfigError
from reservoir.pipeline.schedule import add_schedule, missed_times, run_due
from reservoir.store.schedules import lock_if_due
from tests.factories import make_group

RESERVOIR = Path(sys.executable).with_name("reservoir")


@pytest.fixture
def pipeline(tmp_path, store):
    store.create_run("s", group_size=4)
    store.write_groups([make_group("s", seed=i) for i in range(20)], status="raw")
    path = tmp_path / "clean.yaml"
    path.write_text("source: {runs: [s]}\nprocess:\n  - group_variance_filter: {}\n")
    return path


def one(store, sql: str):
    with store.engine.connect() as conn:
        return conn.execute(text(sql)).one()


def make_due(store, minutes: int = 10, unit: str = "minutes") -> None:
    with store.engine.begin() as conn:
        conn.execute(text(f"UPDATE schedules SET next_run_at = now() - interval '{minutes} {unit}'"))


def two_schedulers_once(db_url: str) -> None:
    """Two `reservoir schedule serve --once` at the same time; both end cleanly."""
    env = {**os.environ, "RESERVOIR_DB_URL": db_url}
    servers = [subprocess.Popen([str(RESERVOIR), "schedule", "serve", "--once"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for _ in range(2)]
    outputs = [server.communicate(timeout=300)[0] for server in servers]
    assert all(server.returncode == 0 for server in servers), outputs


def test_add_checks_cron_and_pipeline(tmp_path, store, pipeline):
    with pytest.raises(ConfigError, match="--cron: 'every day' is not a cron expression"):
        add_schedule(store, pipeline, "every day")
    stream = tmp_path / "stream.yaml"
    stream.write_text("mode: stream\nprocess: []\n")
    with pytest.raises(ConfigError, match="mode is stream"):
        add_schedule(store, stream, "* * * * *")
    assert add_schedule(store, pipeline, "*/5 * * * *")[1] == "*/5 * * * *"
    name, future = one(store, "SELECT name, next_run_at > now() FROM schedules")
    scheduled = tmp_path / "nightly.yaml"
    scheduled.write_text("schedule: '0 3 * * *'\nsource: {runs: [s]}\nprocess: []\n")
    assert add_schedule(store, scheduled)[1] == "0 3 * * *"  # the file's schedule key
    assert (name, future) == ("clean", True)


def test_a_locked_schedule_is_left_to_its_holder_and_runs_once(store, pipeline):
    # yearly: a schedule due every minute is due again when the test crosses a minute
    schedule_id, _ = add_schedule(store, pipeline, "0 0 1 1 *")
    make_due(store, 10, "years")  # 9 or 10 new years' days missed
    with store.engine.begin() as other:
        assert lock_if_due(other, schedule_id)  # another scheduler is running it
        assert run_due(store, Console(quiet=True)) == []
    assert run_due(store, Console(quiet=True)) == [schedule_id]
    assert run_due(store, Console(quiet=True)) == []  # no longer due
    assert one(store, "SELECT count(*), min(trigger), min(status) FROM pipeline_runs") == (
        1, "schedule", "succeeded")
    missed, later = one(store, "SELECT missed_runs, next_run_at > now() FROM schedules")
    assert 9 <= missed <= 10 and later


@pytest.mark.slow
@pytest.mark.process
def test_two_schedulers_run_a_due_pipeline_exactly_once(store, pipeline, db_url):
    add_schedule(store, pipeline, "* * * * *")
    make_due(store, minutes=1)
    two_schedulers_once(db_url)
    assert one(store, "SELECT count(*) FROM pipeline_runs WHERE schedule_id IS NOT NULL") == (1,)
    assert one(store, "SELECT count(*) FROM experiences WHERE status = 'raw'") == (0,)


@pytest.mark.slow
@pytest.mark.process
def test_two_schedulers_run_a_due_task_pipeline_exactly_once(store, tmp_path, db_url):
    """A pipeline over tasks is scheduled like any other (issue 32): one run per due time,
    its decisions written once."""
    from reservoir.store.tasks import add_tasks

    run_id = store.create_run("s", group_size=4)
    with store.engine.begin() as conn:
        add_tasks(conn, run_id, [{"prompt": p} for p in ("Add 1 and 2", "add 1 and 2",
                                                         "Add 3 and 4")])
    path = tmp_path / "tasks_dedup.yaml"
    path.write_text("source: {table: tasks, runs: [s]}\n"
                    "process:\n  - document_deduplicator: {lowercase: true}\n")
    add_schedule(store, path, "* * * * *")
    make_due(store, minutes=1)
    two_schedulers_once(db_url)
    assert one(store, "SELECT count(*) FROM pipeline_runs WHERE schedule_id IS NOT NULL") == (1,)
    assert one(store, "SELECT count(*), min(kind) FROM operator_events WHERE task_id IS NOT "
                      "NULL") == (1, "dropped")
    assert one(store, "SELECT string_agg(status, ',' ORDER BY id) FROM tasks") == (
        "active,retired,active",)


def test_missed_times_are_counted_not_stacked():
    from datetime import datetime, timedelta, timezone

    now = datetime(2026, 11, 30, 12, 0, 30, tzinfo=timezone.utc)
    assert missed_times("* * * * *", now - timedelta(minutes=5, seconds=30), now) == 5
    assert missed_times("0 * * * *", now - timedelta(seconds=30), now) == 0  # due 12:00
