"""What a person reads about pipelines: a run's result, the operators, the history."""

from __future__ import annotations

import inspect
from collections import Counter

from rich.console import Console, Group
from rich.table import Table

from reservoir.pipeline.bridge import PLUGIN_FAILURES, origin, parameters, registry
from reservoir.pipeline.runner import PipelineResult
from reservoir.pipeline.spec import PipelineSpec
from reservoir.store import TaskChanges


def show_result(console: Console, spec: PipelineSpec, result: PipelineResult) -> None:
    verb = "would change (dry run, nothing was written)" if result.dry_run else "changed"
    steps = Table(title=f"pipeline {spec.name!r}: run {result.pipeline_run_id}, "
                        f"{result.rows_in} rows in, {result.rows_out} out")
    for column in ("operator", "in", "out", "dropped", "seconds"):
        steps.add_column(column, justify="left" if column == "operator" else "right")
    for op in result.operators:
        steps.add_row(op["operator"], str(op["in"]), str(op["out"]), str(op["in"] - op["out"]),
                      f"{op['seconds']:.2f}")
    parts = [steps]
    if result.validations:
        checks = Table(title="validation")
        for column in ("expectation", "arguments", "success", "unexpected"):
            checks.add_column(column)
        for outcome in result.validations:
            checks.add_row(outcome.expectation, str(outcome.kwargs), str(outcome.success),
                           str(outcome.unexpected_count))
        parts.append(checks)
    console.print(Group(*parts))
    console.print(f"{verb}: {_summary(result)}", highlight=False)
    for event in _events(result)[:5]:
        what = "task" if "task_id" in event and event.get("experience_id") is None \
            else "experience"
        console.print(f"  {what} {event.get(what + '_id')}: {event['kind']} by "
                      f"{event['operator']}: {event.get('reason')}", highlight=False)


def _summary(result: PipelineResult) -> str:
    changes = result.changes
    if isinstance(changes, TaskChanges):
        return (f"{len(changes.retired)} tasks retired, {len(changes.values)} tasks' fields, "
                f"{len(changes.children)} tasks added; {len(_events(result))} operator events")
    statuses = Counter(changes.statuses.values())
    return ((", ".join(f"{n} rows -> {s}" for s, n in statuses.items()) or "no statuses")
            + f"; {len(changes.values)} rows' fields; {len(changes.events)} operator events"
            + (f"; {result.skipped} rows skipped (changed meanwhile)" if result.skipped else ""))


def _events(result: PipelineResult) -> list[dict]:
    changes = result.changes
    if isinstance(changes, TaskChanges):
        return list(changes.retired.values()) + changes.events
    return changes.events


def operators_table(match: str | None = None) -> Table:
    """Every operator with its kind, the package it comes from and its arguments; a plugin that
    failed to import is named in the caption with its error."""
    known = registry()
    table = Table(title="operators (from: the installed package that defines each)")
    for column in ("operator", "kind", "from", "arguments (default)"):
        table.add_column(column)
    if PLUGIN_FAILURES:
        table.caption = "; ".join(failure.describe() for failure in PLUGIN_FAILURES)
    for name, cls in sorted(known.items()):
        if match and match not in name:
            continue
        kind = next((base.__name__.lower() for base in cls.__mro__
                     if base.__name__ in ("Filter", "Mapper", "Deduplicator", "Selector",
                                          "Grouper", "Aggregator", "Pipeline")), "op")
        args = ", ".join(f"{param}={_default(p)}" for param, p in parameters(cls).items())
        table.add_row(name, kind, origin(cls), args)
    return table


def _default(parameter: inspect.Parameter) -> str:
    return "required" if parameter.default is inspect.Parameter.empty else repr(parameter.default)
