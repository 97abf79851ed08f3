"""The experience store: the hub every other part of Reservoir meets in, and its one door.

Everything outside `reservoir.store` uses the names below and nothing else: the `Store` (its
families of tables, `store.runs`, `store.tasks`, `store.ledger`, ..., each method one
transaction), record types, and the few functions that take a URL rather than a store. No
module outside imports a store submodule or opens a transaction (tools/layout.py checks).

Names are imported on first use, so a quick command that needs only `run_sql` does not pay
for NumPy and SQLAlchemy."""

from __future__ import annotations

import importlib

_EXPORTS = {
    # the store and what it holds
    "AsyncStore": "store", "Store": "store",
    "Experience": "records", "Lease": "sampler", "LeasedExperience": "sampler",
    "WriteResult": "writer", "Pair": "preferences",
    # served episodes
    "Call": "episodes", "as_group": "episodes", "closing": "episodes", "rewarded": "episodes",
    # what a pipeline or a stored-data stage reads
    "Source": "source", "select_rows": "source", "FIELDS": "source", "ORDERABLE": "source",
    "TASK_ORDERABLE": "source", "TASK_FIELDS": "source", "select_tasks": "source",
    "TRAINABLE_STATUSES": "source", "Changes": "pipelines", "HISTORY_COLUMNS": "pipelines",
    # pace, notifications and patience with the database
    "Pace": "pace", "Listener": "notify", "rows_channel": "notify", "POLICY_CHANNEL": "runs",
    "Patience": "retry", "Resumption": "retry", "describe_outage": "retry",
    "is_outage": "retry", "finishing": "tasks", "TaskOrder": "tasks",
    "Round": "rounds", "recording": "rounds",
    "TaskChanges": "tasks",
    # SQL a person typed, and what the CLI shows
    "run_sql": "inspect", "run_summary": "inspect", "experience_detail": "inspect",
    "DEMO_RUNS": "inspect", "DEMO_STEPS": "inspect", "DEMO_TRAINED": "inspect",
    "read_gauges": "gauges",
    # archives and retention
    "archive_run": "archive", "restore_run": "archive", "archived_run": "archive",
    "apply_retention": "archive",
    # looking after a store: its embedded server, schema revision and logins' passwords
    "start_server": "admin", "stop_server": "admin", "upgrade_schema": "admin",
    "downgrade_schema": "admin", "schema_status": "admin", "set_login_password": "admin",
    # binary columns
    "encode": "codec", "decode": "codec", "TOKEN": "codec", "MASK": "codec", "LOGPROB": "codec",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'reservoir.store' has no attribute {name!r}")
    return getattr(importlib.import_module(f"reservoir.store.{_EXPORTS[name]}"), name)
