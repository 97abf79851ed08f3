"""Running a pipeline: select rows (experiences or tasks), run the operators, diff, validate,
write back at once.

The rows become an in-memory Data-Juicer dataset; operators run one at a time, and after each
the runner diffs its output against its input: rows a filter dropped (with its stats), rows a
deduplicator dropped (with the row each duplicates), rows a selector did not pick (with value
and rank), fields a mapper changed (old and new). Then the `validate:` suite runs on what is
left, and `decide` turns it all into changes. They are written in one transaction with the
pipeline_runs row marked succeeded; a pipeline that fails (an operator raises, validation fails
with `on_failure: fail`, the database refuses) changes nothing but its pipeline_runs row, which
records the error. The run keeps one server session open from start to end: if its process
dies, the next run (or `pipeline history`) sees the session gone and calls the run abandoned.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import pandas as pd

from reservoir.errors import ConfigError, ReservoirError
from reservoir.pipeline.bridge import Step, dataset, run_step
from reservoir.pipeline.check import check_spec
from reservoir.pipeline.decide import JSON_FIELDS, TRACKED, PipelineFailed, Trace, decide
from reservoir.pipeline.spec import PipelineSpec
from reservoir.pipeline.tokens import reencode
from reservoir.pipeline.validate import Outcome, jsonable, validate
from reservoir.pipeline.decide_tasks import TRACKED as TASK_TRACKED
from reservoir.pipeline.decide_tasks import decide_tasks
from reservoir.store import Changes, Source, Store, TaskChanges, select_rows, select_tasks

__all__ = ["PipelineFailed", "PipelineResult", "run_pipeline"]


@dataclass
class PipelineResult:
    pipeline_run_id: int
    rows_in: int
    rows_out: int
    operators: list[dict[str, Any]]
    changes: Changes | TaskChanges
    validations: list[Outcome]
    dry_run: bool = False
    skipped: int = 0  # rows another writer changed between reading and writing back

    @property
    def dropped(self) -> int:
        return self.rows_in - self.rows_out


def run_pipeline(store: Store, spec: PipelineSpec, *, runs: list[str] | None = None,
                 dry_run: bool = False, trigger: str = "cli", source_file: str | None = None,
                 schedule_id: int | None = None,
                 progress: Callable[[str], None] | None = None) -> PipelineResult:
    """Run once; raises PipelineFailed (or ConfigError before anything is written)."""
    steps = check_spec(spec)
    run_ids = [store.run_id(name) for name in spec.runs_to_read(runs)]
    with store.pipelines.running(
            pipeline=spec.name, spec=spec.model_dump(mode="json", by_alias=True),
            spec_hash=spec.digest(), source_file=source_file, run_ids=run_ids,
            trigger="dry-run" if dry_run else trigger, schedule_id=schedule_id) as pipeline_run:
        started = time.monotonic()
        try:
            return _run(store, spec, steps, run_ids, pipeline_run, started, dry_run,
                        progress or (lambda _: None))
        except BaseException as exc:
            store.pipelines.finish_run(pipeline_run, status="failed",
                                       duration_s=time.monotonic() - started,
                                       error=_describe(exc))
            if isinstance(exc, (ConfigError, PipelineFailed)) or not isinstance(exc, Exception):
                raise
            raise PipelineFailed(f"pipeline {spec.name!r} failed, nothing was changed "
                                 f"(pipeline run {pipeline_run}): {_describe(exc)}") from exc


def _source(spec, run_ids) -> Source:
    source = spec.source
    return Source(run_ids=run_ids, statuses=source.status, where=source.where,
                  params=source.params, order_by=source.order_by, limit=source.limit,
                  timeout_s=source.timeout_s)


def _run(store, spec, steps, run_ids, pipeline_run, started, dry_run, progress):
    if spec.on_tasks:
        return _run_on_tasks(store, spec, steps, run_ids, pipeline_run, started, dry_run,
                             progress)
    rows = select_rows(store.url, _source(spec, run_ids))
    progress(f"{len(rows)} rows selected")
    originals = {row["id"]: _to_dataset_row(row) for row in rows}
    from reservoir.operators.preferences import marked_pairs  # after build_steps, as below
    from reservoir.operators.store_ops import using  # after build_steps: Data-Juicer imported quietly

    with using(store):  # operators that read the store read this one
        final, trace = _process(list(originals.values()), steps, progress)
    outcomes = validate(pd.DataFrame(final), spec.validate_.expectations) if final else []
    changes = decide(spec, originals, final, trace, outcomes, pipeline_run,
                     store.aio.reward_range)
    result, counts = _result(store, pipeline_run, rows, final, trace, changes, outcomes,
                             started, dry_run)
    if dry_run:
        return result

    def settle():  # after the rows changed meanwhile are left out: their pairs go too
        reencode(store, changes, originals)
        return marked_pairs(final, changes.statuses)

    read = {row_id: row["status"] for row_id, row in originals.items()}
    result.skipped = store.pipelines.write_back(pipeline_run, changes, read, settle,
                                                started=started, **counts)
    return result


def _run_on_tasks(store, spec, steps, run_ids, pipeline_run, started, dry_run, progress):
    """A pipeline over tasks: the same operators, validation and events; the decisions are
    tasks' (decide_tasks) and are written with store.pipelines.write_back_tasks."""
    rows = select_tasks(store.url, _source(spec, run_ids))
    progress(f"{len(rows)} tasks selected")
    originals = {row["id"]: _to_dataset_row(row) for row in rows}
    from reservoir.operators.store_ops import using  # after build_steps: Data-Juicer imported quietly

    with using(store):
        final, trace = _process(list(originals.values()), steps, progress, TASK_TRACKED)
    outcomes = validate(pd.DataFrame(final), spec.validate_.expectations) if final else []
    changes = decide_tasks(spec, originals, final, trace, outcomes)
    result, counts = _result(store, pipeline_run, rows, final, trace, changes, outcomes,
                             started, dry_run)
    if not dry_run:
        store.pipelines.write_back_tasks(pipeline_run, changes, started=started, **counts)
    return result


def _result(store, pipeline_run, rows, final, trace, changes, outcomes, started, dry_run):
    """The result and its counts; a dry run's pipeline_runs row is finished here."""
    result = PipelineResult(pipeline_run, len(rows), len(final), trace.operators, changes,
                            outcomes, dry_run=dry_run)
    counts = dict(rows_in=len(rows), rows_out=len(final), rows_dropped=len(rows) - len(final),
                  operators=trace.operators)
    if dry_run:
        store.pipelines.finish_run(pipeline_run, status="dry_run",
                                   duration_s=time.monotonic() - started, **counts)
    return result, counts


def _to_dataset_row(row: dict[str, Any]) -> dict[str, Any]:
    out = dict(row)
    for key, value in row.items():
        if isinstance(value, uuid.UUID) or hasattr(value, "isoformat"):
            out[key] = str(value)
        elif key in JSON_FIELDS or isinstance(value, dict):
            out[key] = json.dumps(value)
    return out


def _process(rows: list[dict], steps: list[Step], progress,
             fields: tuple[str, ...] = TRACKED) -> tuple[list[dict], Trace]:
    """Run the steps; returns the rows left (without Data-Juicer's columns) and the trace.
    Between steps only the id and tracked `fields` are read back, not whole rows."""
    trace = Trace()
    tracked = {row["id"]: {k: row[k] for k in fields if k in row} for row in rows}
    ids = [row["id"] for row in rows]
    data = dataset(rows) if rows else None
    for step in steps:
        began, changed = time.monotonic(), 0
        if ids:
            before = data
            data, detail = run_step(step, data)
            after = list(data["id"])
            _record_removals(step, before, ids, after, detail, trace)
            if step.kind == "mapper":  # the others keep, drop or pick rows, never edit them
                changed = _record_changes(step, data, after, tracked, trace, fields)
        else:
            after = []
        trace.operators.append({"operator": step.name, "in": len(ids), "out": len(after),
                                "changed": changed,
                                "seconds": round(time.monotonic() - began, 3)})
        progress(f"{step.name}: {len(ids)} -> {len(after)} rows")
        ids = after
    final = data.to_list() if ids else []
    return [{k: v for k, v in row.items() if not k.startswith("__dj__")} for row in final], trace


def _record_removals(step: Step, before, ids: list[int], after: list[int], detail,
                     trace: Trace) -> None:
    """An event for every row the step removed: why a filter dropped it (its stats), which
    row it duplicates, or its value and rank under a selector."""
    kept = set(after)
    removed = [(position, row_id) for position, row_id in enumerate(ids) if row_id not in kept]
    if not removed:
        return
    if step.kind == "selector":
        for _, row_id in removed:
            trace.unselected[row_id] = trace.event(row_id, step.name, "unselected",
                                                   _unselected_reason(step, detail[row_id]),
                                                   detail[row_id])
        return
    if step.kind == "deduplicator":
        stats = [{"duplicate_of": detail.get(row_id)} for _, row_id in removed]
    elif detail is not None:  # a filter's stats, one per input row
        stats = [s or {} for s in detail.select([p for p, _ in removed])["__dj__stats__"]]
    else:
        stats = [{}] * len(removed)
    for (_, row_id), row_stats in zip(removed, stats):
        row_stats = jsonable(dict(row_stats))
        trace.dropped[row_id] = trace.event(
            row_id, step.name, "dropped", row_stats.get("reason") or _reason(step, row_stats),
            row_stats)


def _unselected_reason(step: Step, detail: dict) -> str:
    if detail.get("rank") is None:
        return f"{step.name}: not picked"
    return (f"{step.name}: not picked (rank {detail['rank']} of {detail['of']} by "
            f"{detail['field']} = {detail['value']!r})")


def _reason(step: Step, stats: dict) -> str:
    if step.kind == "deduplicator":
        original = stats.get("duplicate_of")
        return (f"{step.name}: a duplicate of experience {original} (kept)" if original
                else f"{step.name}: a duplicate of a row kept earlier in the batch")
    shown = ", ".join(f"{k}={v}" for k, v in stats.items())
    return f"{step.name}: outside its limits ({shown})" if shown else f"{step.name} removed it"


def _record_changes(step: Step, data, after: list[int], tracked: dict, trace: Trace,
                    fields: tuple[str, ...]) -> int:
    """Record what the mapper changed in each row; returns how many rows it changed."""
    columns = {name: list(data[name]) for name in fields if name in data.column_names}
    count = 0
    for position, row_id in enumerate(after):
        current = tracked.get(row_id)
        if current is None:
            continue
        new = {name: values[position] for name, values in columns.items()}
        changed = [name for name in columns if _differs(current.get(name), new[name])]
        if changed:
            count += 1
            trace.changes.setdefault(row_id, []).append(
                {"operator": step.name,
                 "fields": {name: (current.get(name), new[name]) for name in changed}})
            current.update(new)
    return count


def _differs(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return False
    return a != b


def _describe(exc: BaseException) -> str:
    text = str(exc) if isinstance(exc, ReservoirError) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())[:2000]
