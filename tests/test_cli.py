"""Acceptance tests: the real `reservoir` command in a subprocess, against a test database."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import text

from reservoir.store import migrate
from reservoir.store.engine import sync_engine
from tests.commands import key_values, reservoir, scalar


@pytest.fixture
def two_runs(cli):
    engine = sync_engine(cli.url)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO runs (name, group_size) VALUES ('a', 4), ('b', 8)"))
    engine.dispose()
    return cli


def test_db_upgrade_on_an_empty_database_then_already_at(new_database, tmp_path):
    url, head = new_database(), migrate.head_revision()
    first = reservoir("db", "upgrade", url=url, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert f"upgraded from empty to revision {head}" in first.stdout
    second = reservoir("db", "upgrade", url=url, cwd=tmp_path)
    assert f"already at revision {head}" in second.stdout


def test_db_status_shows_the_revision(cli):
    out = cli("db", "status")
    head = migrate.head_revision()
    assert f"{head} (code expects {head})" in out and "up to date" in out


def test_db_url_hides_the_password(tmp_path):
    url = "postgresql://alice:s3cret@db.example:5432/store"
    hidden = reservoir("db", "url", url=url, cwd=tmp_path)
    assert hidden.returncode == 0, hidden.stderr
    assert hidden.stdout.strip() == "postgresql://alice:***@db.example:5432/store"
    shown = reservoir("db", "url", "--show-password", url=url, cwd=tmp_path)
    assert shown.stdout.strip() == url


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
    query = "SELECT name, group_size FROM runs ORDER BY name"
    assert two_runs("sql", query, "--format", "csv").splitlines() == [
        "name,group_size", "a,4", "b,8"]
    assert json.loads(two_runs("sql", query, "--format", "json")) == [
        {"name": "a", "group_size": 4}, {"name": "b", "group_size": 8}]
    table = two_runs("sql", query).splitlines()
    assert any("name" in line and "group_size" in line for line in table)
    assert any("a" in line and "4" in line for line in table)
    assert any("b" in line and "8" in line for line in table)


def test_sql_param_binds(two_runs):
    out = two_runs("sql", "SELECT group_size FROM runs WHERE name = :name", "-p", "name=b",
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


def test_config_with_an_unknown_key_names_it(cli, tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("store:\n  urll: postgresql://x@y/z\n")
    result = cli.raw("db", "url", "-c", str(config))
    assert result.returncode == 1
    assert "store.urll (line 2): unknown key; did you mean 'url'?" in result.stderr


def test_inspect_an_unknown_run_fails_clearly(cli):
    result = cli.raw("inspect", "run", "nosuch")
    assert result.returncode == 1
    assert "run 'nosuch' does not exist" in result.stderr and "Traceback" not in result.stderr


def test_pipeline_commands(cli, tmp_path):
    cli("demo", "store", "--groups", "50", "--raw-groups", "20", "--steps", "1")
    pipeline = tmp_path / "gate.yaml"
    pipeline.write_text("source: {runs: [quickstart]}\nprocess:\n  - group_variance_filter: {}\n")
    assert "is valid: 1 operators (group_variance_filter)" in cli("pipeline", "check",
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
