"""Queries for pipelines: their runs, the rows they read, and everything they write back.

A pipeline's changes are written by `write_back` in one transaction with its pipeline_runs row
marked succeeded: row updates, child rows, preference pairs, operator events, validations and
task fields together, so they commit whole or not at all. Otherwise the pipeline_runs row is
written in transactions of its own (`running`, `finish_run`), so a failed run leaves it
(status failed, the error) and nothing else.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from sqlalchemy import (BigInteger, Connection, DateTime, Float, LargeBinary, Numeric, Text, and_,
                        bindparam, case, cast, column, exists, func, insert, literal_column, or_,
                        select, table, update)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, UUID

from reservoir.store import arrays, lifecycle
from reservoir.store.door import Door, reading, writing
from reservoir.store.ledger import finite
from reservoir.store.notify import ROWS_CHANNEL
from reservoir.store.preferences import Pair, insert_pairs
from reservoir.store.runs import add_inserted
from reservoir.store.tasks import TaskChanges
from reservoir.store.tasks import apply_changes as apply_task_changes
from reservoir.plan.urls import scrub
from reservoir.store.schema import experience_state as state
from reservoir.store.schema import (experiences, operator_events, pipeline_runs, reviews, runs, tasks,
                                    validations)

@dataclass
class Changes:
    """Everything one pipeline run writes back."""

    statuses: dict[int, str] = field(default_factory=dict)            # id -> new status
    values: dict[int, dict[str, Any]] = field(default_factory=dict)   # id -> changed fields
    events: list[dict[str, Any]] = field(default_factory=list)
    validations: list[dict[str, Any]] = field(default_factory=list)
    task_values: dict[int, dict[str, Any]] = field(default_factory=dict)
    held: dict[int, str] = field(default_factory=dict)                # id -> review reason
    children: list[dict[str, Any]] = field(default_factory=list)      # augmented copies
    broken_groups: dict[uuid.UUID, str] = field(default_factory=dict)  # group -> why partners go


def start_run(conn: Connection, *, pipeline: str, spec: dict, spec_hash: str,
              source_file: str | None, run_ids: list[int], trigger: str,
              schedule_id: int | None = None) -> int:
    """A `running` row naming this connection's server session: the caller keeps it open for
    the whole run, so a run whose session is gone is known to be abandoned."""
    backend = select(func.pg_backend_pid()).scalar_subquery()
    started = (select(_activity.c.backend_start)
               .where(_activity.c.pid == func.pg_backend_pid()).scalar_subquery())
    return conn.execute(insert(pipeline_runs).values(
        pipeline=pipeline, spec=scrub(spec), spec_hash=spec_hash, source_file=source_file,
        run_ids=run_ids, trigger=trigger, schedule_id=schedule_id, backend_pid=backend,
        backend_started_at=started).returning(pipeline_runs.c.id)).scalar_one()


_activity = table("pg_stat_activity", column("pid"), column("backend_start"))
# A running row is alive while its server session is: same pid, same start (the start is NULL
# when the session belongs to a role whose sessions this login may not inspect: pid decides).
SESSION_GONE = ~exists().where(
    _activity.c.pid == pipeline_runs.c.backend_pid,
    or_(_activity.c.backend_start.is_(None),
        _activity.c.backend_start == pipeline_runs.c.backend_started_at))


def mark_abandoned(conn: Connection) -> int:
    """Running rows whose process died (their session is gone) become `abandoned`."""
    return conn.execute(
        update(pipeline_runs)
        .where(pipeline_runs.c.status == "running", SESSION_GONE)
        .values(status="abandoned", finished_at=func.now(),
                error="its process ended before the run finished (the server session it held "
                      "is gone); nothing of it was written")).rowcount


def finish_run(conn: Connection, run_id: int, *, status: str, duration_s: float,
               rows_in: int | None = None, rows_out: int | None = None,
               rows_dropped: int | None = None, operators: list | None = None,
               error: str | None = None) -> None:
    conn.execute(update(pipeline_runs).where(pipeline_runs.c.id == run_id).values(
        status=status, duration_s=duration_s, rows_in=rows_in, rows_out=rows_out,
        rows_dropped=rows_dropped, operators=operators or [], error=error,
        finished_at=func.now()))


def has_rows(conn: Connection, run_ids: Sequence[int], statuses: Sequence[str]) -> bool:
    """Whether any experience of these runs is in these statuses (a stream's cheap check)."""
    stmt = select(state.c.id).where(state.c.status.in_(list(statuses))).limit(1)
    if run_ids:
        stmt = stmt.where(state.c.run_id.in_(list(run_ids)))
    return conn.execute(stmt).first() is not None


def lock_unchanged(conn: Connection, ids: list[int], statuses: dict[int, str]) -> set[int]:
    """Lock the rows still in the status they were read in; others changed meanwhile."""
    rows = conn.execute(select(state.c.id, state.c.status)
                        .where(state.c.id.in_(ids)).with_for_update())
    return {row.id for row in rows if statuses.get(row.id) == row.status}


def keep_unchanged(conn: Connection, changes: Changes, read: dict[int, str]) -> int:
    """Lock the rows the changes are about and drop the decisions about rows another writer
    changed since they were read (`read`: each row's status then); how many were dropped."""
    ids = sorted(set(changes.statuses) | set(changes.values) | set(changes.held)
                 | {child["parent"] for child in changes.children})
    fresh = lock_unchanged(conn, ids, {i: read[i] for i in ids})
    stale = set(ids) - fresh
    for mapping in (changes.statuses, changes.values, changes.held):
        for row_id in stale:
            mapping.pop(row_id, None)
    changes.events = [e for e in changes.events if e.get("experience_id") not in stale]
    changes.children = [c for c in changes.children if c["parent"] not in stale]
    return len(stale)


def write_back(conn: Connection, pipeline_run_id: int, changes: Changes, read: dict[int, str],
               settle: Callable[[], Sequence[Pair]], *, started: float, **counts) -> int:
    """Everything a pipeline run writes, committed together with its pipeline_runs row marked
    succeeded (`counts`: rows_in, rows_out, rows_dropped, operators; the duration since
    `started`, a time.monotonic()). In order: `keep_unchanged`; `settle()` finishes the
    changes left (re-encodes rewritten responses) and returns the preference pairs to store;
    the pairs new to the store, each with an `added` event on its chosen row; `apply`.
    Returns how many rows were skipped, changed by another writer meanwhile."""
    skipped = keep_unchanged(conn, changes, read)
    pairs = settle()
    added = insert_pairs(conn, pairs)
    changes.events += [_pair_added(pair, added[pair[:2]]) for pair in pairs
                       if pair[:2] in added]
    apply(conn, pipeline_run_id, changes)
    finish_run(conn, pipeline_run_id, status="succeeded",
               duration_s=time.monotonic() - started, **counts)
    return skipped


def write_back_tasks(conn: Connection, pipeline_run_id: int, changes: TaskChanges, *,
                     started: float, **counts) -> None:
    """Everything a task pipeline run writes (tasks.apply_changes: retirements, rewrites or
    new versions, children, priorities and difficulties), its events and validations,
    committed together with its pipeline_runs row marked succeeded."""
    events = apply_task_changes(conn, changes)
    if events:
        conn.execute(insert(operator_events), [
            {**event, "pipeline_run_id": pipeline_run_id, "stats": finite(event["stats"])}
            for event in events])
    if changes.validations:
        conn.execute(insert(validations), [
            {**row, "pipeline_run_id": pipeline_run_id} for row in changes.validations])
    finish_run(conn, pipeline_run_id, status="succeeded",
               duration_s=time.monotonic() - started, **counts)


def _pair_added(pair: Pair, preference_id: int) -> dict[str, Any]:
    """The event of a stored pair, on its chosen row, named for its source (the operator
    that marked it)."""
    return {"experience_id": pair.chosen_id, "operator": pair.source, "kind": "added",
            "reason": f"{pair.source}: preference pair {preference_id}: experience "
                      f"{pair.chosen_id} over {pair.rejected_id} (margin {pair.margin:.3g})",
            "stats": {"preference_id": preference_id, "chosen_id": pair.chosen_id,
                      "rejected_id": pair.rejected_id, "margin": pair.margin}}


def apply(conn: Connection, pipeline_run_id: int, changes: Changes) -> None:
    """Write a pipeline's decisions (the caller's transaction makes them one)."""
    _update_experiences(conn, changes)
    _quarantine_partners(conn, changes)
    _notify_changed(conn, changes)
    _insert_children(conn, changes)
    if changes.task_values:
        for task_id, values in changes.task_values.items():
            conn.execute(update(tasks).where(tasks.c.id == task_id).values(**values))
    run_of = _runs_of(conn, [event.get("experience_id") for event in changes.events]
                      + list(changes.held))
    if changes.events:
        conn.execute(insert(operator_events), [
            {**event, "pipeline_run_id": pipeline_run_id, "stats": finite(event.get("stats", {})),
             "run_id": run_of.get(event.get("experience_id"))}
            for event in changes.events])
    if changes.validations:
        conn.execute(insert(validations), [
            {**row, "pipeline_run_id": pipeline_run_id} for row in changes.validations])
    if changes.held:
        conn.execute(insert(reviews), [
            {"experience_id": eid, "run_id": run_of.get(eid), "pipeline_run_id": pipeline_run_id,
             "reason": reason} for eid, reason in changes.held.items()])


def _runs_of(conn: Connection, ids: list[int | None]) -> dict[int, int]:
    """{experience id: its run id} (events and reviews name both)."""
    wanted = sorted({i for i in ids if i is not None})
    if not wanted:
        return {}
    return dict(conn.execute(select(state.c.id, state.c.run_id)
                             .where(state.c.id.in_(wanted))).all())


# Statement: tell the channel of each run with a row in :ids that its rows changed.
_changed = (select(state.c.run_id)
            .where(state.c.id == func.any(bindparam("ids", type_=ARRAY(BigInteger))))
            .distinct().subquery("changed"))
NOTIFY_CHANGED = select(func.count(func.pg_notify(
    func.concat(literal_column(f"'{ROWS_CHANNEL}'"), _changed.c.run_id),
    literal_column("'changed'"))))


def _notify_changed(conn: Connection, changes: Changes) -> None:
    """Wake whoever waits on the changed rows' runs (leases waiting for ready rows)."""
    if changes.statuses:
        conn.execute(NOTIFY_CHANGED, {"ids": sorted(changes.statuses)})


def _update_experiences(conn: Connection, changes: Changes) -> None:
    """One statement for every changed row. A row whose response was re-encoded (new
    response_ids) loses its logprobs: they belonged to the old tokens."""
    ids = sorted(set(changes.statuses) | set(changes.values))
    if not ids:
        return
    values = [changes.values.get(i, {}) for i in ids]
    as_json = lambda v: None if v is None else json.dumps(v)  # noqa: E731
    conn.execute(lifecycle.PIPELINE_CHANGES, arrays.bound(
        id=ids, status=[changes.statuses.get(i) for i in ids],
        **{name: [v.get(name) for v in values]
           for name in ("priority", "shaped_reward", "response_text", "response_ids",
                        "action_mask")},
        reward_components=[as_json(v.get("reward_components")) for v in values],
        metadata=[as_json(v.get("metadata")) for v in values]))


def _insert_children():
    """Insert: one augmented row per row of the unnested arrays, copied from its parent (prompt,
    ids, version, task, reward) with the child's own response and decisions; a group's children
    are numbered in parent order. Returns each child's id, parent and run."""
    v = arrays.unnested("v", id=BigInteger, group_id=UUID, response_text=Text,
                        response_ids=LargeBinary, action_mask=LargeBinary, shaped_reward=Float,
                        reward_components=Text, metadata=Text, status=Text, priority=Float)
    p = experiences.alias("p")
    rows = {
        "run_id": p.c.run_id, "task_id": p.c.task_id, "group_id": v.c.group_id,
        "group_row": func.row_number().over(partition_by=v.c.group_id, order_by=v.c.id) - 1,
        "policy_version": p.c.policy_version, "prompt_text": p.c.prompt_text,
        "response_text": v.c.response_text, "prompt_ids": p.c.prompt_ids,
        "response_ids": func.coalesce(v.c.response_ids, p.c.response_ids),
        "logprobs": case((v.c.response_ids.is_(None), p.c.logprobs)),
        "action_mask": func.coalesce(v.c.action_mask, p.c.action_mask), "reward": p.c.reward,
        "shaped_reward": v.c.shaped_reward,
        "reward_components": cast(v.c.reward_components, JSONB),
        "metadata": cast(v.c.metadata, JSONB), "status": v.c.status, "priority": v.c.priority,
        "parent_id": p.c.id, "parent_run_id": p.c.run_id}
    x = experiences
    return (insert(x).from_select(list(rows), select(*rows.values())
                                  .join_from(v, p, p.c.id == v.c.id))
            .returning(x.c.id, x.c.parent_id, x.c.run_id))


INSERT_CHILDREN = _insert_children()


def _quarantine_partners(conn: Connection, changes: Changes) -> None:
    """Rows of a broken group the pipeline did not read (another status, outside `where`)
    that could still train: quarantined too, each with an event."""
    if not changes.broken_groups:
        return
    groups = sorted(changes.broken_groups)
    swept = conn.execute(lifecycle.QUARANTINE_PARTNERS, {
        "groups": groups, "reasons": [changes.broken_groups[g] for g in groups],
        "decided": sorted(changes.statuses)}).all()
    for row_id, group_id, reason in swept:
        changes.events.append({"experience_id": row_id, "operator": "whole_groups",
                               "kind": "quarantined", "stats": {"group_id": str(group_id)},
                               "reason": f"{reason}; groups train whole (output.partial_groups:"
                                         " keep trains the rest)"})


def _insert_children(conn: Connection, changes: Changes) -> None:
    """Augmented rows, copied from their parents in SQL (prompt ids, version, task), counted
    as inserted for flow control, each with an `added` event."""
    children = changes.children
    if not children:
        return
    of = lambda name: [child.get(name) for child in children]  # noqa: E731
    added = conn.execute(INSERT_CHILDREN, arrays.bound(
        id=of("parent"), group_id=of("group_id"),
        response_text=of("response_text"), response_ids=of("response_ids"),
        action_mask=of("action_mask"), shaped_reward=of("shaped_reward"),
        reward_components=[json.dumps(v) for v in of("reward_components")],
        metadata=[json.dumps(v) for v in of("metadata")],
        status=of("status"), priority=of("priority"))).all()
    per_run: dict[int, int] = {}
    rewrites = {child["parent"]: child.get("changes", []) for child in children}
    for child_id, parent_id, run_id in added:
        per_run[run_id] = per_run.get(run_id, 0) + 1
        changes.events.append({"experience_id": child_id, "operator": "output", "kind": "added",
                               "reason": f"augmented copy of experience {parent_id}",
                               "stats": {"parent": parent_id,
                                         "changes": rewrites.get(parent_id, [])}})
    for run_id, count in per_run.items():
        conn.execute(add_inserted(run_id, count))


def stored_texts(conn: Connection, digests: set[str], statuses: Sequence[str],
                 exclude: Sequence[int]) -> dict[str, int]:
    """{md5 of prompt + 0x1f + response: the lowest id holding that text} among rows in these
    statuses, other than `exclude` (what store_dedup_filter compares against)."""
    stored = func.md5(experiences.c.prompt_text.concat("\x1f").concat(experiences.c.response_text))
    return dict(conn.execute(
        select(stored, func.min(experiences.c.id))
        .where(stored.in_(digests), experiences.c.status.in_(list(statuses)),
               experiences.c.id.not_in(list(exclude)))
        .group_by(stored)).all())


def task_pass_rates(conn: Connection, task_ids: Sequence[int], component: str | None,
                    threshold: float) -> dict[int, float]:
    """{task id: the share of its experiences whose `component` (else reward) >= threshold}."""
    score = (experiences.c.reward_components[component].as_float() if component
             else experiences.c.reward)
    passed = func.avg(case((score >= threshold, 1.0), else_=0.0))
    return dict(conn.execute(select(experiences.c.task_id, passed)
                             .where(experiences.c.task_id.in_(list(task_ids)))
                             .group_by(experiences.c.task_id)).all())


def run_models(conn: Connection, run_ids: Sequence[int]) -> dict[int, str | None]:
    """The model folder each run records (its tokenizer re-encodes rewritten responses)."""
    return dict(conn.execute(select(runs.c.id, runs.c.model).where(runs.c.id.in_(list(run_ids)))).all())


HISTORY_COLUMNS = ("pipeline_run_id", "pipeline", "status", "rows_in", "rows_out", "rows_dropped",
                   "duration_s", "started_at", "trigger", "error")


def history(conn: Connection, pipeline: str | None, limit: int) -> list[dict[str, Any]]:
    """Recent runs, newest first; a running row whose session is gone reads `abandoned`."""
    status = case((and_(pipeline_runs.c.status == "running", SESSION_GONE), "abandoned"),
                  else_=pipeline_runs.c.status).label("status")
    stmt = select(pipeline_runs.c.id.label("pipeline_run_id"), pipeline_runs.c.pipeline,
                  pipeline_runs.c.trigger, status, pipeline_runs.c.rows_in, pipeline_runs.c.rows_out,
                  pipeline_runs.c.rows_dropped,
                  func.round(pipeline_runs.c.duration_s.cast(Numeric), 2).label("duration_s"),
                  pipeline_runs.c.started_at, pipeline_runs.c.error)
    if pipeline:
        stmt = stmt.where(pipeline_runs.c.pipeline == pipeline)
    stmt = stmt.order_by(pipeline_runs.c.id.desc()).limit(limit)
    return [dict(row) for row in conn.execute(stmt).mappings()]


def operator_counts(conn: Connection, run_id: int, bounds: list) -> dict[int, dict]:
    """{i: {(pipeline, operator): (kept, dropped, changed)}} over the succeeded pipeline runs
    over this run that finished in [bounds[i-1], bounds[i]) (what trackers log at each step)."""
    if len(bounds) < 2:
        return {}
    p = pipeline_runs.c
    edges = bindparam("edges", bounds, type_=ARRAY(DateTime(timezone=True)))
    op = func.jsonb_array_elements(p.operators).table_valued(column("value", JSONB)) \
        .render_derived()
    window = func.width_bucket(p.finished_at, edges).label("window")

    def count(key: str):
        return func.sum(cast(op.c.value[key].astext, BigInteger))
    rows = conn.execute(
        select(window, p.pipeline, op.c.value["operator"].astext.label("operator"),
               count("out"), count("in") - count("out"), func.coalesce(count("changed"), 0))
        .select_from(pipeline_runs.join(op, literal_column("true")))
        .where(p.status == "succeeded", p.run_ids.contains([run_id]),
               p.finished_at >= bounds[0], p.finished_at < bounds[-1])
        .group_by(window, p.pipeline, literal_column("operator")))
    counts: dict[int, dict] = {}
    for index, pipeline, operator, kept, dropped, changed in rows:
        counts.setdefault(index, {})[pipeline, operator] = (int(kept), int(dropped),
                                                            int(changed))
    return counts


class Pipelines(Door):
    """`store.pipelines`: pipeline runs, what they read and their history."""

    operator_counts = reading(operator_counts)

    has_rows = reading(has_rows)
    stored_texts = reading(stored_texts)
    task_pass_rates = reading(task_pass_rates)
    run_models = reading(run_models)
    history = reading(history)
    finish_run = writing(finish_run)
    write_back = writing(write_back)
    write_back_tasks = writing(write_back_tasks)

    @contextlib.contextmanager
    def running(self, **start) -> Iterator[int]:
        """A pipeline run's `running` row (its id; `start`: `start_run`'s values), written
        with the abandoned runs marked, on a server session held open until the block ends:
        if the process dies, the next run (or `history`) sees the session gone and calls the
        run abandoned."""
        with self.engine.connect() as session:
            with session.begin():
                mark_abandoned(session)
                pipeline_run = start_run(session, **start)
            yield pipeline_run
