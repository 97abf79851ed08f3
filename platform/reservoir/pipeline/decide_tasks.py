"""From what the operators did to tasks to what the store records (a task pipeline).

- A task a filter or deduplicator dropped, or that failed validation (`on_failure:
  quarantine`), retires: never claimed again, never deleted. A task a selector did not pick
  keeps its place (or retires, `output.unselected: retired`).
- A rewrite of a task's prompt or answer updates the task, or, with `output.mapped: augment`,
  adds a child task holding it; the store makes a rewrite of a task an explorer holds or has
  explored a new version instead (store/tasks.py).
- `task_difficulty` (task_difficulty_mapper) sets the task's difficulty, in [0, 1]; a
  priority set by an operator, or read from `output.priority_from`, is finite.
Every decision is an event with the task's id.
"""

from __future__ import annotations

import json
import math
from typing import Any

from reservoir.pipeline.decide import (TASK_DIFFICULTY, PipelineFailed, Trace, change_events,
                                       differs, only, shown, validation_failures)
from reservoir.pipeline.validate import Outcome
from reservoir.store import TaskChanges

TRACKED = ("prompt", "answer", "priority", "metadata")
CONTENT = ("prompt", "answer")


def decide_tasks(spec, originals: dict, final: list[dict], trace: Trace,
                 outcomes: list[Outcome]) -> TaskChanges:
    changes = TaskChanges()
    for event in _failed_validation(spec, outcomes, changes):
        changes.retired[event["task_id"]] = event
    for row_id, event in trace.dropped.items():
        changes.retired[row_id] = _of_task(event)
    for row_id, event in trace.unselected.items():
        if spec.output.unselected == "retired":
            changes.retired[row_id] = {**_of_task(event), "kind": "retired"}
        else:
            changes.events.append(_of_task(event))
    seen: set[int] = set()
    for row in final:
        row_id = row["id"]
        values = _changed_values(spec, originals[row_id], row)
        records = trace.changes.get(row_id, []) if row_id not in seen else []
        if spec.output.mapped == "augment" and values.keys() & set(CONTENT):
            changes.children.append(_child(row, values, records))
            values = {k: v for k, v in values.items() if k not in CONTENT}
            records = only(records, set(TRACKED) - set(CONTENT))
        if row_id in seen or row_id in changes.retired:
            continue
        seen.add(row_id)
        changes.events.extend(_of_task(event) for event in change_events(row_id, records))
        if values:
            changes.values[row_id] = values
    return changes


def _failed_validation(spec, outcomes: list[Outcome], changes: TaskChanges) -> list[dict]:
    """Validation results stored; the events of the tasks that failed (they retire)."""
    validation_failures(spec, outcomes, changes)  # stores the results, an event a failed task
    events = [{**_of_task(event), "kind": "retired"} for event in changes.events]
    changes.events = []
    return events


def _changed_values(spec, original: dict, row: dict) -> dict[str, Any]:
    values = {name: _stored(name, row[name]) for name in TRACKED
              if name in row and differs(original.get(name), row[name])}
    if spec.output.priority_from and row.get(spec.output.priority_from) is not None:
        values["priority"] = row[spec.output.priority_from]
    if row.get(TASK_DIFFICULTY) is not None:
        values["difficulty"] = row[TASK_DIFFICULTY]
    for name, low, high in (("priority", -math.inf, math.inf), ("difficulty", 0.0, 1.0)):
        value = values.get(name)
        if value is None:
            continue
        if not isinstance(value, (int, float)) or not math.isfinite(value) or \
                not low <= value <= high:
            raise PipelineFailed(f"task {row['id']}: {name} = {value!r}: a task's {name} is a "
                                 f"finite number{' in [0, 1]' if name == 'difficulty' else ''}; "
                                 "nothing was stored")
        values[name] = float(value)
    if "prompt" in values and not (isinstance(values["prompt"], str) and values["prompt"].strip()):
        raise PipelineFailed(f"task {row['id']}: an operator left its prompt empty; nothing was "
                             "stored")
    return values


def _child(row: dict, values: dict, records: list[dict]) -> dict:
    return {"parent": row["id"], **{k: values[k] for k in CONTENT if k in values},
            "changes": [{"operator": r["operator"], "fields": shown(r["fields"])}
                        for r in only(records, set(CONTENT))]}


def _of_task(event: dict) -> dict:
    """An event the runner made for a row, as a task's."""
    event = dict(event)
    event["task_id"] = event.pop("experience_id")
    return event


def _stored(name: str, value):
    return json.loads(value) if name == "metadata" and isinstance(value, str) else value
