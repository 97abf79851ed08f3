"""Running a pipeline: select rows, run the operators, diff, validate, write back at once.

The rows become an in-memory Data-Juicer dataset; operators run one at a time, and after each
the runner diffs its output against its input: rows it dropped (with the filter's stats),
fields it changed, priorities it scored. Then the `validate:` suite runs on what is left. All
decisions are written in one transaction with the pipeline_runs row marked succeeded; a
pipeline that fails (an operator raises, validation fails with `on_failure: fail`, the
database refuses) changes nothing but its pipeline_runs row, which records the error.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import pandas as pd

from reservoir.errors import ConfigError, ReservoirError
from reservoir.pipeline.bridge import Step, build_steps, dataset, run_step
from reservoir.pipeline.spec import PipelineSpec
from reservoir.pipeline.tokens import reencode
from reservoir.pipeline.validate import Outcome, check_specs, jsonable, validate
from reservoir.store import Store
from reservoir.store import pipelines as queries
from reservoir.store.runs import run_id_of
from reservoir.store.source import Source, select_rows

TRACKED = ("response_text", "prompt_text", "reward", "reward_components", "metadata", "priority")
CONTENT = ("response_text", "reward", "reward_components", "metadata")  # what augment copies
JSON_FIELDS = ("reward_components", "metadata")  # JSON text in the dataset, dicts in the store
TASK_DIFFICULTY = "task_difficulty"  # an output field that sets the row's task's difficulty
REVIEW_REASON = "review_reason"  # an output field that holds the row for human review


class PipelineFailed(ReservoirError):
    """A pipeline stopped; nothing but its pipeline_runs row was written."""


@dataclass
class PipelineResult:
    pipeline_run_id: int
    rows_in: int
    rows_out: int
    operators: list[dict[str, Any]]
    changes: queries.Changes
    validations: list[Outcome]
    dry_run: bool = False
    skipped: int = 0  # rows another writer changed between reading and writing back

    @property
    def dropped(self) -> int:
        return self.rows_in - self.rows_out


@dataclass
class _Trace:
    """What the operators did, row by row."""

    dropped: dict[int, dict[str, Any]] = field(default_factory=dict)  # id -> event
    events: list[dict[str, Any]] = field(default_factory=list)
    operators: list[dict[str, Any]] = field(default_factory=list)


def run_pipeline(store: Store, spec: PipelineSpec, *, runs: list[str] | None = None,
                 dry_run: bool = False, trigger: str = "cli", source_file: str | None = None,
                 schedule_id: int | None = None,
                 progress: Callable[[str], None] | None = None) -> PipelineResult:
    """Run once; raises PipelineFailed (or ConfigError before anything is written)."""
    steps = build_steps(spec.operators, spec.text_key)
    check_specs(spec.validate_.expectations)
    with store.engine.connect() as conn:
        run_ids = [run_id_of(conn, name) for name in (runs or spec.source.runs)]
    with store.engine.begin() as conn:
        pipeline_run = queries.start_run(
            conn, pipeline=spec.name, spec=spec.model_dump(mode="json", by_alias=True),
            spec_hash=spec.digest(), source_file=source_file, run_ids=run_ids,
            trigger="dry-run" if dry_run else trigger, schedule_id=schedule_id)
    started = time.monotonic()
    try:
        return _run(store, spec, steps, run_ids, pipeline_run, started, dry_run,
                    progress or (lambda _: None))
    except BaseException as exc:
        with store.engine.begin() as conn:
            queries.finish_run(conn, pipeline_run, status="failed",
                               duration_s=time.monotonic() - started, error=_describe(exc))
        if isinstance(exc, (ConfigError, PipelineFailed)) or not isinstance(exc, Exception):
            raise
        raise PipelineFailed(f"pipeline {spec.name!r} failed, nothing was changed "
                             f"(pipeline run {pipeline_run}): {_describe(exc)}") from exc


def _run(store, spec, steps, run_ids, pipeline_run, started, dry_run, progress):
    source = spec.source
    rows = select_rows(store.url, Source(
        run_ids=run_ids, statuses=source.status, where=source.where, params=source.params,
        order_by=source.order_by, limit=source.limit, timeout_s=source.timeout_s))
    progress(f"{len(rows)} rows selected")
    originals = {row["id"]: _to_dataset_row(row) for row in rows}
    from reservoir.operators.store_ops import using  # after build_steps: Data-Juicer imported quietly

    with using(store.engine):  # operators that read the store read this one
        final, trace = _process(list(originals.values()), steps, progress)
    outcomes = validate(pd.DataFrame(final), spec.validate_.expectations) if final else []
    changes = _decide(spec, originals, final, trace, outcomes, pipeline_run)
    result = PipelineResult(pipeline_run, len(rows), len(final), trace.operators, changes,
                            outcomes, dry_run=dry_run)
    with store.engine.begin() as conn:
        if not dry_run:
            result.skipped = _keep_unchanged(conn, changes, originals)
            reencode(conn, changes, originals)
            queries.apply(conn, pipeline_run, changes)
        queries.finish_run(conn, pipeline_run, status="dry_run" if dry_run else "succeeded",
                           duration_s=time.monotonic() - started, rows_in=len(rows),
                           rows_out=len(final), rows_dropped=len(rows) - len(final),
                           operators=trace.operators)
    return result


def _to_dataset_row(row: dict[str, Any]) -> dict[str, Any]:
    out = dict(row)
    for key, value in row.items():
        if isinstance(value, uuid.UUID) or hasattr(value, "isoformat"):
            out[key] = str(value)
        elif key in JSON_FIELDS or isinstance(value, dict):
            out[key] = json.dumps(value)
    return out


def _process(rows: list[dict], steps: list[Step], progress) -> tuple[list[dict], _Trace]:
    """Run the steps; returns the rows left (without Data-Juicer's columns) and the trace.
    Between steps only the id and tracked columns are read back, not whole rows."""
    trace = _Trace()
    tracked = {row["id"]: {k: row[k] for k in TRACKED if k in row} for row in rows}
    ids = [row["id"] for row in rows]
    data = dataset(rows) if rows else None
    for step in steps:
        began = time.monotonic()
        if ids:
            data, with_stats = run_step(step, data)
            after = list(data["id"])
            _record_drops(step, ids, after, with_stats, trace)
            if step.kind not in ("filter", "deduplicator"):  # those keep or drop, never edit
                _record_changes(step, data, after, tracked, trace)
        else:
            after = []
        trace.operators.append({"operator": step.name, "in": len(ids), "out": len(after),
                                "seconds": round(time.monotonic() - began, 3)})
        progress(f"{step.name}: {len(ids)} -> {len(after)} rows")
        ids = after
    final = data.to_list() if ids else []
    return [{k: v for k, v in row.items() if not k.startswith("__dj__")} for row in final], trace


def _record_drops(step: Step, before: list[int], after: list[int], with_stats,
                  trace: _Trace) -> None:
    kept = set(after)
    dropped = [(position, row_id) for position, row_id in enumerate(before) if row_id not in kept]
    if not dropped:
        return
    stats = ([s or {} for s in with_stats.select([p for p, _ in dropped])["__dj__stats__"]]
             if with_stats is not None else [{}] * len(dropped))
    for (_, row_id), row_stats in zip(dropped, stats):
        row_stats = jsonable(dict(row_stats))
        trace.dropped[row_id] = event = {
            "experience_id": row_id, "operator": step.name, "kind": "dropped",
            "reason": row_stats.get("reason") or _reason(step, row_stats), "stats": row_stats}
        trace.events.append(event)


def _record_changes(step: Step, data, after: list[int], tracked: dict, trace: _Trace) -> None:
    columns = {name: list(data[name]) for name in TRACKED if name in data.column_names}
    for position, row_id in enumerate(after):
        current = tracked.get(row_id)
        if current is None:
            continue
        new = {name: values[position] for name, values in columns.items()}
        changed = [name for name in columns if _differs(current.get(name), new[name])]
        if changed:
            trace.events.append(_change_event(step, row_id, current, new, changed))
            current.update(new)


def _reason(step: Step, stats: dict) -> str:
    if step.kind == "deduplicator":
        return f"{step.name}: a duplicate of a row kept earlier in the batch"
    shown = ", ".join(f"{k}={v}" for k, v in stats.items())
    return f"{step.name}: outside its limits ({shown})" if shown else f"{step.name} removed it"


def _change_event(step: Step, row_id: int, before: dict, after: dict, changed: list[str]) -> dict:
    stats = {"fields": changed}
    for name in ("reward", "priority"):
        if name in changed:
            stats[name] = {"before": before[name], "after": after[name]}
    return {"experience_id": row_id, "operator": step.name,
            "kind": "scored" if changed == ["priority"] else "changed",
            "reason": f"{step.name} set {', '.join(changed)}", "stats": jsonable(stats)}


def _differs(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return False
    return a != b


def _decide(spec, originals, final, trace, outcomes, pipeline_run) -> queries.Changes:
    changes = queries.Changes(events=list(trace.events))
    failing = _validation_failures(spec, outcomes, changes)
    for row_id, event in trace.dropped.items():
        changes.statuses[row_id] = spec.output.dropped
    seen: set[int] = set()
    for row in final:
        row_id = row["id"]
        if row_id in seen and spec.output.mapped == "update":
            raise PipelineFailed(f"an operator returned experience {row_id} twice (it adds rows):"
                                 " use output.mapped: augment to keep them as child rows")
        values = _changed_values(spec, originals[row_id], row)
        if spec.output.mapped == "augment" and values.keys() & CONTENT:
            changes.children.append(_child(row, values, spec, pipeline_run, failing))
            values = {k: v for k, v in values.items() if k not in CONTENT}
        if row_id in seen:
            continue
        seen.add(row_id)
        status = _status(spec, row, failing, changes)
        if status != originals[row_id]["status"]:
            changes.statuses[row_id] = status
        if values:
            changes.values[row_id] = values
        if row.get(TASK_DIFFICULTY) is not None and row.get("task_id") is not None:
            changes.task_values[row["task_id"]] = {"difficulty": float(row[TASK_DIFFICULTY])}
    return changes


def _changed_values(spec, original: dict, row: dict) -> dict[str, Any]:
    values = {name: _stored(name, row[name]) for name in TRACKED
              if name in row and _differs(original[name], row[name])}
    if "prompt_text" in values:
        raise PipelineFailed(f"experience {row['id']}: an operator changed prompt_text; prompts "
                             "are not rewritten by pipelines (their token ids are the explorer's)")
    if spec.output.priority_from and row.get(spec.output.priority_from) is not None:
        values["priority"] = float(row[spec.output.priority_from])
    return values


def _status(spec, row: dict, failing: set[int], changes: queries.Changes) -> str:
    """What a row that came through becomes: quarantined, held for review, or output.status."""
    row_id = row["id"]
    if row_id in failing:
        return "quarantined"
    if row.get(REVIEW_REASON):
        changes.held[row_id] = str(row[REVIEW_REASON])
        changes.events.append({"experience_id": row_id, "operator": "output", "kind": "held",
                               "reason": str(row[REVIEW_REASON]), "stats": {}})
        return "held"
    return spec.output.status


def _child(row: dict, values: dict, spec, pipeline_run: int, failing: set[int]) -> dict:
    """An augmented copy of row: its rewritten content, a parent link, and a group of its own
    (shared with the other children of the parent's group in this pipeline run)."""
    group = uuid.uuid5(uuid.NAMESPACE_URL, f"reservoir:{row['group_id']}:{pipeline_run}")
    metadata = dict(values.get("metadata") or json.loads(row["metadata"] or "{}"))
    metadata["augmented_from"] = row["id"]
    return {"parent": row["id"], "group_id": group, "metadata": metadata,
            "status": "quarantined" if row["id"] in failing else spec.output.status,
            **{name: _stored(name, row[name]) for name in CONTENT if name != "metadata"},
            "priority": values.get("priority", row.get("priority") or 0.0)}


def _validation_failures(spec, outcomes: list[Outcome], changes: queries.Changes) -> set[int]:
    """Store every result; the ids to quarantine (on_failure: quarantine)."""
    on_failure = spec.validate_.on_failure
    failing: set[int] = set()
    for outcome in outcomes:
        changes.validations.append({
            "expectation": outcome.expectation, "kwargs": outcome.kwargs,
            "success": outcome.success, "element_count": outcome.element_count,
            "unexpected_count": outcome.unexpected_count, "on_failure": on_failure,
            "sample": {"failing_ids": outcome.failing_ids[:50], "values": outcome.sample,
                       "error": outcome.error}})
        if outcome.error:
            raise PipelineFailed(f"validation {outcome.expectation} {outcome.kwargs} could not "
                                 f"run: {outcome.error}")
        if outcome.success:
            continue
        if on_failure == "fail":
            raise PipelineFailed(f"validation failed: {outcome.expectation} {outcome.kwargs}: "
                                 f"{outcome.unexpected_count} rows (ids "
                                 f"{outcome.failing_ids[:10]}); nothing was changed")
        if on_failure == "quarantine":
            for row_id in outcome.failing_ids:
                if row_id not in failing:
                    changes.events.append({
                        "experience_id": row_id, "operator": outcome.expectation,
                        "kind": "quarantined", "stats": {"kwargs": outcome.kwargs},
                        "reason": f"failed {outcome.expectation} {json.dumps(outcome.kwargs)}"})
                failing.add(row_id)
    return failing


def _keep_unchanged(conn, changes: queries.Changes, originals: dict) -> int:
    """Drop decisions about rows another writer changed since they were read; how many."""
    ids = sorted(set(changes.statuses) | set(changes.values) | set(changes.held)
                 | {child["parent"] for child in changes.children})
    fresh = queries.lock_unchanged(conn, ids, {i: originals[i]["status"] for i in ids})
    stale = set(ids) - fresh
    for mapping in (changes.statuses, changes.values, changes.held):
        for row_id in stale:
            mapping.pop(row_id, None)
    changes.events = [e for e in changes.events if e.get("experience_id") not in stale]
    changes.children = [c for c in changes.children if c["parent"] not in stale]
    return len(stale)


def _stored(name: str, value):
    return json.loads(value) if name in JSON_FIELDS and isinstance(value, str) else value


def _describe(exc: BaseException) -> str:
    text = str(exc) if isinstance(exc, ReservoirError) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())[:2000]
