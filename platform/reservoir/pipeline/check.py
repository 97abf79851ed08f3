"""`reservoir pipeline check`: a pipeline file, its operators and expectations, without running."""

from __future__ import annotations

from pathlib import Path

from reservoir.errors import ConfigError
from reservoir.pipeline.bridge import Step, build_steps
from reservoir.pipeline.spec import PipelineSpec, load_pipeline
from reservoir.pipeline.validate import check_specs
from reservoir.store import FIELDS, TASK_FIELDS

# Fields Reservoir's own operators add to rows, and the group size validation computes.
ADDED_FIELDS = ("task_difficulty", "review_reason", "_group_size", "preferred_over",
                "preference_margin")


def check_file(path: Path) -> tuple[PipelineSpec, list[Step]]:
    """The spec and its operators; a ConfigError names the file, the key or operator, and why."""
    spec = load_pipeline(path)
    try:
        steps = check_spec(spec)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return spec, steps


def check_spec(spec: PipelineSpec) -> list[Step]:
    """Operators built (names, arguments, ranges checked), expectations, the text key and the
    priority field on known columns."""
    steps = build_steps(spec.operators, spec.text_key)
    columns = row_columns(spec)
    check_specs(spec.validate_.expectations, columns)
    for key, value in (("text_key", spec.text_key), ("output.priority_from",
                                                      spec.output.priority_from)):
        if value is not None and value not in columns:
            raise ConfigError(f"{key}: {value!r} is no field of the rows (they have "
                              f"{', '.join(sorted(columns))})")
    selectors = [step.name for step in steps if step.kind == "selector"]
    if selectors and spec.mode == "stream" and spec.output.unselected == "keep":
        raise ConfigError(f"process ({selectors[0]}): a stream pipeline that keeps unselected "
                          "rows in their status would select among them again forever; set "
                          "output.unselected: retired")
    return steps


def row_columns(spec: PipelineSpec) -> set[str]:
    """The columns rows can have after the operators: the source's, ours, and any field an
    operator is told to write (an argument naming a key)."""
    written = {value for _, args in spec.operators for key, value in args.items()
               if isinstance(value, str) and (key.endswith("_key") or key.startswith("target"))}
    source = (*TASK_FIELDS, "task_id", "claimed") if spec.on_tasks else FIELDS
    return set(source) | set(ADDED_FIELDS) | written
