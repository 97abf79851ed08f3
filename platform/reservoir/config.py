"""Typed configuration: one YAML file validated by pydantic.

Unknown or mistyped keys fail with the key's dotted path, the file, and the closest valid key.
Every default lives here, once.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from reservoir.errors import ConfigError

DB_URL_ENV = "RESERVOIR_DB_URL"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StoreConfig(Section):
    """Where the experience store lives."""

    url: str | None = Field(
        default=None,
        description="PostgreSQL URL. Unset: RESERVOIR_DB_URL, else the embedded server.",
    )
    data_dir: Path = Field(
        default=Path(".reservoir/pg"),
        description="Data directory of the embedded server (used only without a URL).",
    )

    def resolved_url(self) -> str | None:
        """The server URL from config or environment; None selects the embedded server."""
        return self.url or os.environ.get(DB_URL_ENV) or None


class SamplerConfig(Section):
    """Flow control: how trainers lease experiences out of the store (see README glossary)."""

    unit: Literal["rows", "groups"] = "groups"
    batch: int = Field(default=32, ge=1)
    order: Literal["fifo", "lifo", "priority", "uniform"] = "fifo"
    sample_from: tuple[Literal["ready", "consumed"], ...] = ("ready",)
    lease_seconds: float = Field(default=300.0, gt=0)
    max_staleness: int | None = Field(default=None, ge=0)
    max_times_sampled: int = Field(default=1, ge=1)
    samples_per_insert: float | None = Field(default=None, gt=0)
    spi_tolerance: float = Field(default=1024.0, ge=0)
    min_ready: int = Field(default=1, ge=1)
    wait_timeout_s: float = Field(default=60.0, ge=0)
    poll_interval_s: float = Field(default=0.05, gt=0)

    @model_validator(mode="after")
    def _consumed_needs_reuse(self) -> SamplerConfig:
        if "consumed" in self.sample_from and self.max_times_sampled == 1:
            raise ValueError(
                "sample_from includes 'consumed' but max_times_sampled is 1: "
                "no consumed row could ever be sampled again; raise max_times_sampled"
            )
        return self


class ModelConfig(Section):
    """The policy: a local Hugging Face folder (build one with `reservoir model tiny`)."""

    path: Path = Path("models/tiny")


class TasksConfig(Section):
    """Where tasks come from: a file, or a generator for the CPU examples."""

    file: Path | None = None
    generate: Literal["addition", "reverse", "sort"] | None = "reverse"
    count: int = Field(default=2000, ge=1)
    test_fraction: float = Field(default=0.1, ge=0.0, lt=1.0)


class ExplorerConfig(Section):
    n: int = Field(default=8, ge=1, description="responses per task (the group size)")
    temperature: float = Field(default=1.0, gt=0)
    max_tokens: int = Field(default=16, ge=1)
    batch_tasks: int = Field(default=8, ge=1,
                             description="tasks a worker claims and samples in one batch")
    reward: Literal["exact_match", "last_number", "boxed"] = "exact_match"
    workers: int = Field(default=1, ge=1, description="explorer workers (Ray actors)")
    claim_seconds: float = Field(default=300.0, gt=0,
                                 description="a dead worker's tasks are claimed again after this")
    threads: int | None = Field(default=None, ge=1,
                                description="torch threads per worker; unset: the cores "
                                "shared by the workers that compute at once")


class TrainerConfig(Section):
    algorithm: Literal["grpo", "grpo-kl", "dr-grpo"] = "grpo"
    lr: float = Field(default=1e-3, gt=0)
    batch_groups: int = Field(default=8, ge=1)
    micro_batch: int = Field(default=16, ge=1)
    sync_interval: int = Field(default=1, ge=1)
    steps: int = Field(default=50, ge=1)
    eval_interval: int = Field(default=10, ge=1)
    warmup_steps: int = Field(default=0, ge=0, description="supervised warm-up steps first")
    warmup_fraction: float = Field(default=0.5, gt=0, le=1,
                                   description="share of the train tasks the warm-up sees")
    warmup_batch: int = Field(default=32, ge=1)
    warmup_lr: float = Field(default=3e-3, gt=0)
    checkpoint_interval: int = Field(default=10, ge=1)
    checkpoint_dir: Path = Path("checkpoints")
    threads: int | None = Field(default=None, ge=1,
                                description="torch threads; unset: every core in sync mode, "
                                "a share of them in async mode")
    wait_timeout_s: float = Field(default=1800.0, gt=0,
                                  description="fail the run if no batch arrives for this long")


class RunSection(Section):
    name: str = "run"
    mode: Literal["sync", "async"] = Field(
        default="sync", description="sync: on-policy; async: explorers run ahead by at most "
        "sampler.max_staleness policy versions")
    seed: int = 0
    ray_address: str | None = Field(
        default=None, description="Ray cluster to run the worker pools on; unset: local Ray")


class ReservoirConfig(Section):
    """The whole config file."""

    run: RunSection = RunSection()
    model: ModelConfig = ModelConfig()
    tasks: TasksConfig = TasksConfig()
    explorer: ExplorerConfig = ExplorerConfig()
    trainer: TrainerConfig = TrainerConfig()
    store: StoreConfig = StoreConfig()
    sampler: SamplerConfig = SamplerConfig()
    pipelines: tuple[Path, ...] = Field(
        default=(), description="stream pipelines a run starts: explorers then write raw rows, "
        "and only rows a pipeline passes become ready for the trainer")

    @model_validator(mode="after")
    def _async_needs_staleness(self) -> ReservoirConfig:
        if self.run.mode == "async" and self.sampler.max_staleness is None:
            raise ValueError("run.mode is async but sampler.max_staleness is unset: set how "
                             "many policy versions explorers may run ahead (e.g. 1)")
        return self

    def torch_threads(self, role: Literal["explorer", "trainer"]) -> int:
        """The configured threads, else the cores shared by the workers that compute at once:
        in sync mode explorers and the trainer take turns, in async mode all run together."""
        configured = self.explorer.threads if role == "explorer" else self.trainer.threads
        if configured:
            return configured
        together = self.explorer.workers + (self.run.mode == "async")
        if role == "trainer" and self.run.mode == "sync":
            together = 1
        return max(1, (os.cpu_count() or 1) // together)

    @property
    def staleness(self) -> int:
        """Policy versions a trained row may lag the trainer by: 0 in sync mode."""
        return 0 if self.run.mode == "sync" else self.sampler.max_staleness


def load_config(path: Path | str | None) -> ReservoirConfig:
    """Read and validate a YAML config; None gives the defaults."""
    if path is None:
        return ReservoirConfig()
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return parse_config(raw, source=str(path))


def parse_config(raw: dict, *, source: str = "<config>") -> ReservoirConfig:
    try:
        return ReservoirConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(describe_errors(exc, source)) from None


def describe_errors(exc: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid config"]
    for err in exc.errors():
        key = ".".join(str(part) for part in err["loc"]) or "(top level)"
        message = err["msg"]
        if err["type"] == "extra_forbidden":
            message = "unknown key" + suggest_key(ReservoirConfig, err["loc"])
        lines.append(f"  {key}: {message} (got {err.get('input')!r})")
    return "\n".join(lines)


def suggest_key(model: type[BaseModel], loc: tuple) -> str:
    """'; did you mean ...' for an unknown key at loc, else the valid keys there."""
    for part in loc[:-1]:
        fields = {field.alias or name: field for name, field in model.model_fields.items()}
        field = fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return ""
        model = annotation
    keys = [field.alias or name for name, field in model.model_fields.items()]
    close = difflib.get_close_matches(str(loc[-1]), keys, n=1)
    return f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(keys)}"
