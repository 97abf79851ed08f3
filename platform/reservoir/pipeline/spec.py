"""Pipeline YAML: which rows, which operators, what to check, what the rows become.

    name: clean                      # default: the file's name
    source:
      table: experiences             # the rows a pipeline reads and decides about: experiences
                                     # or tasks (text_key prompt; dropped tasks retire)
      runs: [reverse-grpo]           # or `all`; `--run` on the command line overrides; a
                                     # pipeline that names none runs only with --run
      status: [raw]                  # raw, ready or quarantined (never leased or consumed);
                                     # tasks: active
      where: "reward >= :floor"      # one boolean expression; runs alone, read-only, bound
      params: {floor: 0}
      order_by: [created_at, id]
      limit: 10000                   # rows, rounded up to whole groups
      timeout_s: 60                  # the source query's statement timeout
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
      partial_groups: quarantine     # a dropped row's group partners too | keep them
      unselected: keep               # rows a selector did not pick: keep their status | retired
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
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationError,
                      field_validator, model_validator)

from reservoir.config import RunName, describe_errors, expression
from reservoir.errors import ConfigError
from reservoir.yamlfile import read_yaml
from reservoir.store import ORDERABLE, TASK_ORDERABLE


class Part(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


TABLE_STATUSES = {"experiences": ("raw", "ready", "quarantined"), "tasks": ("active",)}


class Source(Part):
    table: Literal["experiences", "tasks"] = "experiences"
    runs: tuple[RunName, ...] | Literal["all"] = ()
    status: tuple[Literal["raw", "ready", "quarantined", "active"], ...] = ("raw",)
    where: Annotated[str | None, AfterValidator(expression)] = None
    params: dict[str, Any] = Field(default_factory=dict)
    order_by: tuple[str, ...] = ("created_at", "id")
    limit: int | None = Field(default=None, ge=1, le=10_000_000, strict=True)
    timeout_s: float = Field(default=60.0, gt=0, le=86_400, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _table_defaults(cls, value):
        """A task source reads active tasks unless it says otherwise."""
        if isinstance(value, dict) and value.get("table") == "tasks" and "status" not in value:
            return {**value, "status": ("active",)}
        return value

    @field_validator("status")
    @classmethod
    def _some_status(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("name at least one status to read (raw, ready or quarantined; "
                             "active for tasks)")
        return value

    @model_validator(mode="after")
    def _of_the_table(self) -> "Source":
        allowed = TABLE_STATUSES[self.table]
        wrong = [status for status in self.status if status not in allowed]
        if wrong:
            raise ValueError(f"status {wrong[0]!r}: a pipeline reads {self.table} that are "
                             f"{' or '.join(allowed)}")
        orderable = ORDERABLE if self.table == "experiences" else TASK_ORDERABLE
        unknown = [column for column in self.order_by if column.removeprefix("-") not in orderable]
        if unknown:
            raise ValueError(f"order_by: unknown column {unknown[0]!r} of {self.table}; order "
                             f"by one of {', '.join(sorted(orderable))} (prefix - for descending)")
        return self


class Validate(Part):
    expectations: tuple[dict[str, dict[str, Any]], ...] = ()
    on_failure: Literal["fail", "quarantine", "warn"] = "fail"


class Output(Part):
    status: Literal["ready", "raw", "held"] = "ready"
    priority_from: str | None = None
    dropped: Literal["quarantined", "retired"] = "quarantined"
    partial_groups: Literal["quarantine", "keep"] = "quarantine"
    unselected: Literal["keep", "retired"] = "keep"
    mapped: Literal["update", "augment"] = "update"


class PipelineSpec(Part):
    name: RunName
    description: str = ""
    source: Source = Source()
    text_key: str = "response_text"  # "prompt" on tasks
    process: tuple[dict[str, dict[str, Any] | None], ...] = ()
    validate_: Validate = Field(default=Validate(), alias="validate")
    output: Output = Output()
    schedule: str | None = None
    mode: Literal["once", "stream"] = "once"

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _task_defaults(cls, value):
        """Text operators of a task pipeline read the prompt unless it says otherwise."""
        source = value.get("source") if isinstance(value, dict) else None
        if isinstance(source, dict) and source.get("table") == "tasks" and \
                "text_key" not in value:
            return {**value, "text_key": "prompt"}
        return value

    @model_validator(mode="after")
    def _output_of_the_table(self) -> "PipelineSpec":
        """A task is active or retired: a dropped task retires, and no output may ask for
        another status."""
        if self.source.table != "tasks":
            return self
        given = self.output.model_fields_set
        if "dropped" in given and self.output.dropped != "retired":
            raise ValueError("output.dropped: a task a pipeline drops is retired (tasks are "
                             "never quarantined)")
        if "status" in given:
            raise ValueError("output.status: tasks that pass stay active; a task pipeline sets "
                             "no status")
        return self

    @property
    def on_tasks(self) -> bool:
        return self.source.table == "tasks"

    @field_validator("schedule")
    @classmethod
    def _cron(cls, value: str | None) -> str | None:
        if value is not None:
            check_cron(value)
        return value

    @field_validator("process")
    @classmethod
    def _one_operator_each(cls, steps):
        for index, step in enumerate(steps):
            if len(step) != 1:
                raise ValueError(f"process[{index}] must name exactly one operator, "
                                 f"e.g. '- text_length_filter: {{min_len: 1}}' (got {list(step)})")
        return tuple({name: dict(args or {})} for step in steps for name, args in step.items())

    def runs_to_read(self, given: list[str] | None = None) -> list[str]:
        """The runs a pass reads: `given` (--run, or the run a stream serves), else the file's
        own; [] for every run (`runs: all`). ConfigError when neither names any: an empty
        file ran on every run's rows."""
        if given:
            return list(given)
        if self.source.runs == "all":
            return []
        if self.source.runs:
            return list(self.source.runs)
        raise ConfigError(f"pipeline {self.name!r}: source.runs: it names no run: give --run "
                          "NAME, name them in the file (runs: [NAME, ...]) or say runs: all; "
                          "nothing was changed")

    @property
    def operators(self) -> list[tuple[str, dict[str, Any]]]:
        return [next(iter(step.items())) for step in self.process]

    def digest(self) -> str:
        """A hash of what the pipeline does (not of its file's comments or layout)."""
        canonical = json.dumps(self.model_dump(mode="json", by_alias=True), sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def check_cron(value: str) -> str:
    """A cron expression of five fields (croniter also takes six, the first seconds: a
    schedule meant every ten minutes would run every ten seconds); ValueError otherwise."""
    from croniter import croniter

    if len(value.split()) != 5 or not croniter.is_valid(value):
        raise ValueError(f"{value!r} is not a cron expression of five fields (minute hour "
                         "day month weekday, e.g. '*/10 * * * *' for every ten minutes)")
    return value


def load_pipeline(path: Path | str) -> PipelineSpec:
    """Read and validate a pipeline file; errors name the file, key and line."""
    raw, lines = read_yaml(path, "pipeline")
    if raw is None or raw == {}:
        raise ConfigError(f"{path}: the file is empty; a pipeline says at least which rows it "
                          "reads (source: {runs: [NAME]} or runs: all) and what it does with "
                          "them")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping (source, process, ...)")
    return parse_pipeline({"name": Path(path).stem, **raw}, source=str(path), lines=lines)


def parse_pipeline(raw: dict, *, source: str = "<pipeline>",
                   lines: dict[tuple, int] | None = None) -> PipelineSpec:
    try:
        return PipelineSpec.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(describe_errors(exc, source, PipelineSpec, lines)) from None
