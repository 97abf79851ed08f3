"""Pipeline YAML: which rows, which operators, what to check, what the rows become.

    name: clean                      # default: the file's name
    source:
      table: experiences             # the rows a pipeline reads and decides about
      runs: [reverse-grpo]           # `--run` on the command line overrides
      status: [raw]
      where: "reward >= :floor"      # SQL by the data engineer; runs read-only, values bound
      params: {floor: 0}
      order_by: [created_at, id]
      limit: 10000
    text_key: response_text          # the field text operators read, unless an op sets its own
    process:                         # exactly a Data-Juicer recipe's process list
      - text_length_filter: {min_len: 1, max_len: 200}
      - group_variance_filter: {}
    validate:
      expectations:
        - expect_column_values_to_not_be_null: {column: response_text}
      on_failure: quarantine         # fail | quarantine | warn
    output:
      status: ready                  # what rows that pass become
      priority_from: null            # a field (e.g. a scorer's) that sets the priority column
      dropped: quarantined           # quarantined | retired
      mapped: update                 # rewritten rows are updated | augment: a child row
                                     # (parent link, a group of its own) holds the rewrite
    schedule: "*/10 * * * *"
    mode: once                       # once | stream

Errors name the file, the key's path and its line.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from reservoir.config import suggest_key
from reservoir.errors import ConfigError

SOURCE_COLUMNS = {
    "experiences": ("id", "created_at", "reward", "priority", "policy_version", "group_id",
                    "task_id", "response_len", "times_sampled"),
}


class Part(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Source(Part):
    table: Literal["experiences"] = "experiences"
    runs: tuple[str, ...] = ()
    status: tuple[str, ...] = ("raw",)
    where: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    order_by: tuple[str, ...] = ("created_at", "id")
    limit: int | None = Field(default=None, ge=1)

    @field_validator("order_by")
    @classmethod
    def _known_columns(cls, value: tuple[str, ...], info) -> tuple[str, ...]:
        allowed = set().union(*SOURCE_COLUMNS.values())
        unknown = [column for column in value if column.removeprefix("-") not in allowed]
        if unknown:
            raise ValueError(f"unknown column {unknown[0]!r}; order by one of "
                             f"{', '.join(sorted(allowed))} (prefix - for descending)")
        return value


class Validate(Part):
    expectations: tuple[dict[str, dict[str, Any]], ...] = ()
    on_failure: Literal["fail", "quarantine", "warn"] = "fail"


class Output(Part):
    status: Literal["ready", "raw", "held"] = "ready"
    priority_from: str | None = None
    dropped: Literal["quarantined", "retired"] = "quarantined"
    mapped: Literal["update", "augment"] = "update"


class PipelineSpec(Part):
    name: str
    description: str = ""
    source: Source = Source()
    text_key: str = "response_text"
    process: tuple[dict[str, dict[str, Any] | None], ...] = ()
    validate_: Validate = Field(default=Validate(), alias="validate")
    output: Output = Output()
    schedule: str | None = None
    mode: Literal["once", "stream"] = "once"

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @field_validator("process")
    @classmethod
    def _one_operator_each(cls, steps):
        for index, step in enumerate(steps):
            if len(step) != 1:
                raise ValueError(f"process[{index}] must name exactly one operator, "
                                 f"e.g. '- text_length_filter: {{min_len: 1}}' (got {list(step)})")
        return tuple({name: dict(args or {})} for step in steps for name, args in step.items())

    @property
    def operators(self) -> list[tuple[str, dict[str, Any]]]:
        return [next(iter(step.items())) for step in self.process]

    def digest(self) -> str:
        """A hash of what the pipeline does (not of its file's comments or layout)."""
        canonical = json.dumps(self.model_dump(mode="json", by_alias=True), sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def load_pipeline(path: Path | str) -> PipelineSpec:
    """Read and validate a pipeline file; errors name the file, key and line."""
    path = Path(path)
    try:
        text = path.read_text()
        node = yaml.compose(text)
        raw = yaml.safe_load(text) or {}
    except FileNotFoundError:
        raise ConfigError(f"{path}: pipeline file not found") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping (source, process, ...)")
    return parse_pipeline({"name": path.stem, **raw}, source=str(path), lines=key_lines(node))


def parse_pipeline(raw: dict, *, source: str = "<pipeline>",
                   lines: dict[tuple, int] | None = None) -> PipelineSpec:
    try:
        return PipelineSpec.model_validate(raw)
    except ValidationError as exc:
        messages = [f"{source}: invalid pipeline"]
        for err in exc.errors():
            loc = tuple(err["loc"])
            key = ".".join(str(part) for part in loc) or "(top level)"
            line = _line_of(loc, lines or {})
            message = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                message = "unknown key" + suggest_key(PipelineSpec, loc)
            messages.append(f"  {key}{f' (line {line})' if line else ''}: {message}")
        raise ConfigError("\n".join(messages)) from None


def key_lines(node) -> dict[tuple, int]:
    """Line number (1-based) of every key and list item in a composed YAML document."""
    lines: dict[tuple, int] = {}

    def walk(current, path: tuple) -> None:
        if isinstance(current, yaml.MappingNode):
            for key, value in current.value:
                lines[path + (key.value,)] = key.start_mark.line + 1
                walk(value, path + (key.value,))
        elif isinstance(current, yaml.SequenceNode):
            for index, item in enumerate(current.value):
                lines[path + (index,)] = item.start_mark.line + 1
                walk(item, path + (index,))

    if node is not None:
        walk(node, ())
    return lines


def _line_of(loc: tuple, lines: dict[tuple, int]) -> int | None:
    """The line of the deepest part of loc that the file has (pydantic adds type names)."""
    loc = tuple("validate" if part == "validate_" else part for part in loc)
    for end in range(len(loc), 0, -1):
        if loc[:end] in lines:
            return lines[loc[:end]]
    return None
