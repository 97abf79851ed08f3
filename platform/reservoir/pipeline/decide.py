"""From what the operators did to what the store records: statuses, values, child rows and one
event per decision, each event true of what is written.

- A row a filter or deduplicator dropped becomes `output.dropped`; a row a selector did not
  pick keeps its status (or is retired, `output.unselected: retired`); changes an operator
  made to a row that is not written are not logged.
- A change event keeps each field's old and new value (text over 200 characters as its
  SHA-256 and length); in augment mode the rewrite is logged on the child that holds it.
- Groups stay whole: when a row of a group is dropped, fails validation or is retired unpicked,
  its partners are quarantined with a reason that names that row, in this batch and in the
  store (raw or ready rows the source did not select), unless `output.partial_groups: keep`.
"""

from __future__ import annotations

import hashlib
import json
import math
import uuid
from dataclasses import dataclass, field
from typing import Any

from reservoir.config import DEFAULT_REWARD_RANGE
from reservoir.errors import ReservoirError
from reservoir.pipeline.validate import Outcome, jsonable
from reservoir.store import Changes

TRACKED = ("response_text", "prompt_text", "reward", "shaped_reward", "reward_components",
           "metadata", "priority")
CONTENT = ("response_text", "reward", "shaped_reward", "reward_components", "metadata")
JSON_FIELDS = ("reward_components", "metadata")  # JSON text in the dataset, dicts in the store
TASK_DIFFICULTY = "task_difficulty"  # an output field that sets the row's task's difficulty
REVIEW_REASON = "review_reason"  # an output field that holds the row for human review
LONG_TEXT = 200  # longer texts are logged as their hash and length
WHOLE_GROUPS = "whole_groups"  # the operator name on events that quarantine group partners


class PipelineFailed(ReservoirError):
    """A pipeline stopped; nothing but its pipeline_runs row was written."""


@dataclass
class Trace:
    """What the operators did, row by row."""

    dropped: dict[int, dict[str, Any]] = field(default_factory=dict)     # id -> event
    unselected: dict[int, dict[str, Any]] = field(default_factory=dict)  # id -> event
    changes: dict[int, list[dict]] = field(default_factory=dict)  # id -> [{operator, fields}]
    operators: list[dict[str, Any]] = field(default_factory=list)

    @staticmethod
    def event(row_id: int, operator: str, kind: str, reason: str, stats: dict) -> dict:
        return {"experience_id": row_id, "operator": operator, "kind": kind, "reason": reason,
                "stats": jsonable(stats)}


def decide(spec, originals: dict, final: list[dict], trace: Trace, outcomes: list[Outcome],
           pipeline_run: int,
           reward_range: tuple[float, float] = DEFAULT_REWARD_RANGE) -> Changes:
    changes = Changes()
    failing = validation_failures(spec, outcomes, changes)
    for row_id, event in trace.dropped.items():
        changes.statuses[row_id] = spec.output.dropped
        changes.events.append(event)
    for row_id, event in trace.unselected.items():
        changes.events.append(event)
        if spec.output.unselected == "retired":
            changes.statuses[row_id] = "retired"
    seen: set[int] = set()
    for row in final:
        row_id = row["id"]
        if row_id in seen and spec.output.mapped == "update":
            raise PipelineFailed(f"an operator returned experience {row_id} twice (it adds rows):"
                                 " use output.mapped: augment to keep them as child rows")
        values = _changed_values(spec, originals[row_id], row, reward_range)
        records = trace.changes.get(row_id, []) if row_id not in seen else []
        if spec.output.mapped == "augment" and values.keys() & CONTENT:
            changes.children.append(_child(row, values, spec, pipeline_run, failing, records))
            values = {k: v for k, v in values.items() if k not in CONTENT}
            records = only(records, set(TRACKED) - set(CONTENT))
        if row_id in seen:
            continue
        seen.add(row_id)
        changes.events.extend(change_events(row_id, records))
        status = _status(spec, row, failing, changes)
        if status != originals[row_id]["status"]:
            changes.statuses[row_id] = status
        if values:
            changes.values[row_id] = values
        if row.get(TASK_DIFFICULTY) is not None and row.get("task_id") is not None:
            changes.task_values[row["task_id"]] = {"difficulty": float(row[TASK_DIFFICULTY])}
    if spec.output.partial_groups == "quarantine":
        retired = trace.unselected if spec.output.unselected == "retired" else {}
        _keep_groups_whole(originals, final, trace, failing | set(retired), changes)
    return changes


def _keep_groups_whole(originals: dict, final: list[dict], trace: Trace, failing: set[int],
                       changes: Changes) -> None:
    """Partners of a row that will never train (dropped, failed validation, retired unpicked)
    are quarantined; an unpicked row that keeps its status may still train, so its group
    waits whole."""
    lost: dict[str, str] = {}
    for row_id in [*trace.dropped, *sorted(failing)]:
        why = "dropped" if row_id in trace.dropped else (
            "not picked" if row_id in trace.unselected else "failed validation")
        lost.setdefault(originals[row_id]["group_id"], f"experience {row_id} of its group "
                        f"was {why}")
    unheld = set()
    for row in final:
        row_id, group = row["id"], row["group_id"]
        if group in lost and row_id not in failing and changes.statuses.get(row_id) != "quarantined":
            changes.statuses[row_id] = "quarantined"
            if changes.held.pop(row_id, None) is not None:
                unheld.add(row_id)
            changes.events.append(Trace.event(
                row_id, WHOLE_GROUPS, "quarantined", f"{lost[group]}; groups train whole "
                "(output.partial_groups: keep trains the rest)", {"group_id": group}))
    if unheld:  # a partner quarantined is not held for review after all
        changes.events = [e for e in changes.events
                          if not (e["kind"] == "held" and e["experience_id"] in unheld)]
    changes.broken_groups = {uuid.UUID(group): reason for group, reason in lost.items()}


def only(records: list[dict], names: set[str]) -> list[dict]:
    kept = [{**r, "fields": {k: v for k, v in r["fields"].items() if k in names}}
            for r in records]
    return [r for r in kept if r["fields"]]


def change_events(row_id: int, records: list[dict]) -> list[dict]:
    events = []
    for record in records:
        names = list(record["fields"])
        events.append(Trace.event(
            row_id, record["operator"], "scored" if names == ["priority"] else "changed",
            f"{record['operator']} set {', '.join(names)}", {"fields": shown(record["fields"])}))
    return events


def shown(fields: dict[str, tuple]) -> dict[str, dict]:
    """{name: {before, after}} with long texts as their SHA-256 and length."""
    def show(name: str, value):
        if name in JSON_FIELDS and isinstance(value, str):
            value = json.loads(value) if value else {}
        text = value if isinstance(value, str) else None
        if text is not None and len(text) > LONG_TEXT:
            return {"sha256": hashlib.sha256(text.encode()).hexdigest(), "length": len(text)}
        return value
    return {name: {"before": show(name, before), "after": show(name, after)}
            for name, (before, after) in fields.items()}


def _changed_values(spec, original: dict, row: dict,
                    reward_range: tuple[float, float]) -> dict[str, Any]:
    values = {name: _stored(name, row[name]) for name in TRACKED
              if name in row and differs(original.get(name), row[name])}
    if "prompt_text" in values:
        raise PipelineFailed(f"experience {row['id']}: an operator changed prompt_text; prompts "
                             "are not rewritten by pipelines (their token ids are the explorer's)")
    if "reward" in values:
        raise PipelineFailed(f"experience {row['id']}: an operator changed reward; the reward as "
                             "written is kept (shaping operators write shaped_reward)")
    if spec.output.priority_from and row.get(spec.output.priority_from) is not None:
        values["priority"] = float(row[spec.output.priority_from])
    _check_numbers(row["id"], values, reward_range)
    return values


def _check_numbers(row_id: int, values: dict[str, Any], reward_range: tuple[float, float]) -> None:
    """A shaped reward goes into the trainer's float32 batch as a reward does: it stays in the
    reward range; a priority orders leases: it is finite."""
    low, high = reward_range
    shaped, priority = values.get("shaped_reward"), values.get("priority")
    if shaped is not None and not (isinstance(shaped, (int, float)) and math.isfinite(shaped)
                                   and low <= shaped <= high):
        raise PipelineFailed(f"experience {row_id}: shaped_reward = {shaped!r}: an operator wrote "
                             f"a shaped reward outside the reward range [{low:g}, {high:g}] "
                             "(explorer.reward_range); nothing was stored")
    if priority is not None and not math.isfinite(priority):
        raise PipelineFailed(f"experience {row_id}: priority = {priority!r}: a priority is a "
                             "finite number; nothing was stored")


def differs(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return False
    return a != b


def _status(spec, row: dict, failing: set[int], changes: Changes) -> str:
    """What a row that came through becomes: quarantined, held for review, or output.status."""
    row_id = row["id"]
    if row_id in failing:
        return "quarantined"
    if row.get(REVIEW_REASON):
        changes.held[row_id] = str(row[REVIEW_REASON])
        changes.events.append(Trace.event(row_id, "output", "held", str(row[REVIEW_REASON]), {}))
        return "held"
    return spec.output.status


def _child(row: dict, values: dict, spec, pipeline_run: int, failing: set[int],
           records: list[dict]) -> dict:
    """An augmented copy of row: its rewritten content, a parent link, and a group of its own
    (shared with the other children of the parent's group in this pipeline run)."""
    group = uuid.uuid5(uuid.NAMESPACE_URL, f"reservoir:{row['group_id']}:{pipeline_run}")
    metadata = dict(values.get("metadata") or json.loads(row["metadata"] or "{}"))
    metadata["augmented_from"] = row["id"]
    return {"parent": row["id"], "group_id": group, "metadata": metadata,
            "status": "quarantined" if row["id"] in failing else spec.output.status,
            **{name: _stored(name, row.get(name)) for name in CONTENT if name != "metadata"},
            "priority": values.get("priority", row.get("priority") or 0.0),
            "changes": [{"operator": r["operator"], "fields": shown(r["fields"])}
                        for r in only(records, set(CONTENT))]}


def validation_failures(spec, outcomes: list[Outcome], changes: Changes) -> set[int]:
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
                    changes.events.append(Trace.event(
                        row_id, outcome.expectation, "quarantined",
                        f"failed {outcome.expectation} {json.dumps(outcome.kwargs)}",
                        {"kwargs": outcome.kwargs}))
                failing.add(row_id)
    return failing


def _stored(name: str, value):
    return json.loads(value) if name in JSON_FIELDS and isinstance(value, str) else value
