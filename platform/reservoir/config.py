"""Typed configuration: one YAML file validated by pydantic.

Unknown or mistyped keys fail with the key's dotted path, the file, and the closest valid key.
Every default lives here, once.
"""

from __future__ import annotations

import difflib
import importlib
import ipaddress
import math
import os
import re
import sys
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field,
                      ValidationError, model_validator)

from reservoir.errors import ConfigError, UserSQLError
from reservoir.plan.presets import PRESETS
from reservoir.plan.tasks import GENERATORS
from reservoir.plan.urls import (DEFAULT_DATA_DIR, UrlError, canonical, from_env, redact_text,
                                 server_key)
from reservoir.sqltext import check_expression
from reservoir.yamlfile import line_of, read_yaml

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]{1,3})?")


def _run_name(value: str) -> str:
    if not _NAME.fullmatch(value) or value in (".", ".."):
        raise ValueError("a name is 1 to 100 letters, digits, '.', '_' or '-', starting with "
                         "a letter or digit (it names folders and rows)")
    return value


def checked_run_name(value: str, key: str) -> str:
    """A run name given outside a config (a CLI option): ConfigError naming `key`."""
    try:
        return _run_name(value)
    except ValueError as exc:
        raise ConfigError(f"{key} {value!r}: {exc}") from None


def checked_checkpoint(value: str, key: str) -> tuple[str, int | None]:
    """RUN or RUN@STEP given outside a config: (run, step or None), ConfigError naming `key`."""
    name, at, step = value.rpartition("@") if "@" in value else (value, "", "")
    if at and not (step.isdigit() and len(step) <= 9):
        raise ConfigError(f"{key} {value!r}: RUN or RUN@STEP, e.g. reverse-1@200")
    return checked_run_name(name, key), int(step) if at else None


def _not_bool(value):
    if isinstance(value, bool):
        raise ValueError("a number, not true or false")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


def _database_url(value: str | None) -> str | None:
    """The URL as libpq reads it, written so that every driver reads it alike."""
    try:
        return None if value is None else canonical(value)
    except UrlError as exc:
        raise ValueError(str(exc)) from None


def expression(value: str | None) -> str | None:
    """One boolean SQL expression (sqltext.check_expression), checked with the config."""
    try:
        if value is not None:
            check_expression(value, "one boolean expression")
    except UserSQLError as exc:
        raise ValueError(str(exc)) from None
    return value


def _branch(value: str | None) -> str | None:
    if value is not None:
        name, _, step = value.rpartition("@")
        if not (name and step.isdigit() and len(step) <= 9):
            raise ValueError("RUN@STEP, e.g. reverse-1@200")
        _run_name(name)
    return value


def _host(value: str) -> str:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,252})", value):
            raise ValueError("an IP address or a host name (e.g. 127.0.0.1, 0.0.0.0, ::1, "
                             "localhost)") from None
    return value


def _env_name(value: str) -> str:
    if not re.fullmatch(r"[A-Z_][A-Z0-9_]{0,99}", value):
        raise ValueError("an environment variable name: capitals, digits and '_'")
    return value


def _device(value: str) -> str:
    if not _DEVICE.fullmatch(value):
        raise ValueError("a device is auto, cpu, cuda or cuda:N (auto: cuda when available)")
    return value


def _local_path(value: Path) -> Path:
    if "\x00" in str(value) or not str(value).strip():
        raise ValueError("a path is a non-empty file or folder name without NUL characters")
    return value


FLOAT32_MAX = 3.4028234663852886e38
# Rewards and their components a group may carry (explorer.reward_range): a trainer computes
# in float32, where 1e39 is inf and every advantage of its batch NaN.
DEFAULT_REWARD_RANGE = (-1e6, 1e6)


def check_reward_range(low: float, high: float) -> tuple[float, float]:
    """A reward range both ends finite, inside float32, low < high; ValueError otherwise."""
    if not (math.isfinite(low) and math.isfinite(high) and -FLOAT32_MAX <= low < high
            <= FLOAT32_MAX):
        raise ValueError(f"[{low:g}, {high:g}]: a reward range is two finite numbers, low < high,"
                         f" inside float32 (|x| <= {FLOAT32_MAX:.3g})")
    return float(low), float(high)


RunName = Annotated[str, AfterValidator(_run_name)]
LocalPath = Annotated[Path, AfterValidator(_local_path)]  # every file or folder in a config
Device = Annotated[str, AfterValidator(_device)]
DatabaseUrl = Annotated[str | None, AfterValidator(_database_url)]
ServerUrl = Annotated[str, AfterValidator(_database_url)]
# Numbers are checked for type (no true/false, no 1.5 where a count is meant), range and
# finiteness; the bounds keep values inside what the store's columns and a machine can hold.
Count = Annotated[int, Field(strict=True)]
Number = Annotated[float, BeforeValidator(_not_bool), Field(allow_inf_nan=False)]


def count(default: int | None, low: int, high: int, description: str = ""):
    return Field(default=default, ge=low, le=high, description=description)


def number(default: float, *, gt: float | None = None, ge: float | None = None,
           le: float | None = None, lt: float | None = None, description: str = ""):
    return Field(default=default, gt=gt, ge=ge, le=le, lt=lt, description=description)


DAY = 86_400.0
RAY_OWN = ("CPU", "GPU", "memory", "object_store_memory")  # asked for through Ray's own options


def _ray_resources(value: dict[str, float]) -> dict[str, float]:
    for name, amount in value.items():
        if name in RAY_OWN:
            raise ValueError(f"{name!r} is Ray's own (set device and threads); name a custom "
                             "resource the nodes were started with (ray start --resources)")
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_.:-]{0,99}", name):
            raise ValueError(f"resource name {name[:100]!r}: a letter, then letters, digits, "
                             "_ . : - (at most 100)")
        if not 0 < amount <= 1e6:
            raise ValueError(f"resource {name!r}: {amount} is not in (0, 1e6]")
    return value


RayResources = Annotated[dict[str, Number], AfterValidator(_ray_resources)]


def resources(role: str, extra: str = ""):
    return Field(default_factory=dict, description=f"custom Ray resources each {role} actor "
                 "asks for ({NAME: amount}): Ray places it only on nodes started with them "
                 "(`ray start --resources '{\"NAME\": 1}'`), so this pins the role to "
                 f"machines{extra}; empty: any node")


PIECES = "reservoir.trainer.algorithms"  # imported only when a config names a piece (torch)


def _registered(module: str, registry: str):
    """A validator: the value (unless None) names an entry of `module`'s `registry` (entry
    points of installed packages included), imported only when such a value is checked."""
    def check(value: str | None) -> str | None:
        found = getattr(importlib.import_module(module), registry)
        if value is not None and value not in found.names():
            close = difflib.get_close_matches(value, found.names(), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(f"unknown {found.kind} {value!r}; {hint}valid: "
                             f"{', '.join(found.names())}")
        return value
    return AfterValidator(check)


def _option(value):
    """A workflow option: text, a finite number, true/false, or a list or mapping of them."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("must be a finite number")
    if isinstance(value, (list, tuple)):
        return [_option(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _option(item) for key, item in value.items()}
    if value is not None and not isinstance(value, (str, int, float, bool)):
        raise ValueError("an option is text, a number, true/false, or a list or mapping")
    return value


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RetentionConfig(Section):
    """How long ended runs (stopped, finished, failed) keep their rows in the store
    (`reservoir runs retention` applies it); unset: forever."""

    archive_dir: LocalPath | None = Field(
        default=None, description="folder that archives go to, one folder per "
        "run (archive_dir/<run name>)")
    archive_after_days: Number | None = number(
        None, gt=0, le=36_500, description="an ended run whose updated_at is older than this "
        "is archived into archive_dir and its rows leave the store (`reservoir runs restore` "
        "brings them back)")
    retire_after_days: Number | None = number(
        None, gt=0, le=36_500, description="ready and raw rows of ended runs that are older "
        "than this become retired (no stage samples them)")

    @model_validator(mode="after")
    def _archive_needs_dir(self) -> RetentionConfig:
        if self.archive_after_days is not None and self.archive_dir is None:
            raise ValueError("archive_after_days is set but archive_dir is not: set the folder "
                             "the archives go to")
        return self


class StoreConfig(Section):
    """Where the experience store lives."""

    url: DatabaseUrl = Field(
        default=None,
        description="PostgreSQL URL. Unset: RESERVOIR_DB_URL, else the embedded server.",
    )
    urls: tuple[ServerUrl, ...] = Field(
        default=(), max_length=1024,
        description="Several PostgreSQL servers, each run's rows on one of them: the first "
        "holds run_servers (run -> server, chosen when the run is created by least declared "
        "demand, run.demand, or named by run.store). Excludes url and reader_url (people "
        "read each server as reservoir_reader with RESERVOIR_READER_PASSWORD).")
    data_dir: LocalPath = Field(
        default=Path(DEFAULT_DATA_DIR),
        description="Data directory of the embedded server (used only without a URL).",
    )
    reader_url: DatabaseUrl = Field(
        default=None,
        description="Login people read as (`reservoir sql`, `inspect`). Unset: "
        "RESERVOIR_READER_URL, else the store's server as reservoir_reader with "
        "RESERVOIR_READER_PASSWORD.",
    )
    query_timeout_s: Number = number(
        30.0, gt=0, le=DAY,
        description="Statement timeout of `reservoir sql` and `reservoir inspect` queries.")
    outage_patience_s: Number = number(
        120.0, ge=0, le=DAY,
        description="How long workers wait out an unreachable store (a restart) before they "
        "stop with one line; started again, they carry on")
    retention: RetentionConfig = Field(
        default=RetentionConfig(), description="archiving and retiring the rows of ended runs")

    @model_validator(mode="after")
    def _one_way_to_servers(self) -> StoreConfig:
        if self.urls and (self.url or self.reader_url):
            raise ValueError("store.urls: set it or store.url / store.reader_url, not both "
                             "(with urls each run's server is read from run_servers)")
        if len(set(map(server_key, self.urls))) != len(self.urls):
            raise ValueError("store.urls: a server is named twice (same host, port and "
                             "database)")
        return self

    def resolved_url(self) -> str | None:
        """The server URL from config or environment; None selects the embedded server."""
        if self.urls:
            raise ConfigError("store.urls names several servers: work on one run's server "
                              "(reservoir.servers.routed), not on the store as a whole")
        return self.url or from_env()


class SamplerConfig(Section):
    """Flow control: how trainers lease experiences out of the store (see the glossary,
    docs/concepts/glossary.md)."""

    unit: Literal["rows", "groups"] = Field(
        default="groups", description="what store.lease(run) takes by default: rows, or "
        "groups (whole groups)")
    batch: Count = count(32, 1, 1_000_000, "how many rows or groups (see unit) a lease takes "
                         "by default")
    order: Literal["fifo", "lifo", "priority", "uniform"] = Field(
        default="fifo", description="which eligible rows a lease takes first: fifo / lifo (by "
        "insertion time, then id), priority (highest priority first), uniform (random)")
    sample_from: tuple[Literal["ready", "consumed"], ...] = Field(
        default=("ready",), description="statuses a lease takes rows from; add consumed to "
        "train rows again (needs max_times_sampled > 1)")
    lease_seconds: Number = number(300.0, gt=0, le=7 * DAY,
                                   description="a lease not committed by then is reclaimed")
    max_staleness: Count | None = count(None, 0, 1_000_000, "policy versions: train only rows "
                                        "whose policy_version >= latest - this (required by "
                                        "run.mode async; sync mode trains on-policy)")
    max_times_sampled: Count = count(1, 1, 1_000_000, "most times a row may be sampled")
    samples_per_insert: Number | None = number(
        None, gt=0, le=1e6, description="Reverb's SampleToInsertRatio: the target number of "
        "times each written row is sampled; unset: no rate limit")
    spi_tolerance: Number = number(1024.0, ge=0, le=1e12, description="rows of slack either "
                                   "way around samples_per_insert (Reverb's error_buffer)")
    min_ready: Count = count(1, 1, 1_000_000_000, "ready rows needed before a run's first lease")
    wait_timeout_s: Number = number(60.0, ge=0, le=30 * DAY, description="how long a lease or "
                                    "a write waits for flow control")
    poll_interval_s: Number = number(0.05, gt=0, le=60, description="how often a waiting lease "
                                     "or write looks again when no notification wakes it")
    dynamic_sampling: bool = Field(
        default=False, description="DAPO's dynamic sampling: a leased group whose rewards are "
        "all equal is set aside (status retired, metadata.set_aside) and replaced by another "
        "until the batch is full; explorers keep producing")

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

    path: LocalPath = Field(
        default=Path("models/tiny"), description="a local Hugging Face model folder (its "
        "config.json's vocab_size becomes the run's: token ids at or past it are refused)")


def _generator(value: str | None) -> str | None:
    if value is not None and value not in GENERATORS:
        raise ValueError(f"unknown task generator {value!r}; valid: {', '.join(GENERATORS)}")
    return value


def _tracking_uri(value: str) -> str:
    scheme = value.split(":", 1)[0].lower()
    if scheme not in ("http", "https", "file", "sqlite", "postgresql", "mysql", "databricks"):
        raise ValueError(f"{redact_text(value)!r}: an MLflow tracking URI starts with "
                         "http(s)://, file://, sqlite:// or a database scheme")
    return value


def _column_name(value: str) -> str:
    if not value or len(value) > 200 or "\x00" in value:
        raise ValueError(f"{value!r} is not a column name")
    return value


def _pattern(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        compiled = re.compile(value)
    except re.error as exc:
        raise ValueError(f"{value!r} is not a regular expression: {exc}") from None
    if compiled.groups > 1:
        raise ValueError(f"{value!r} has {compiled.groups} groups; the answer is its one group "
                         "(or the whole match without one)")
    return value


def _template(value: str | None) -> str | None:
    if value is not None:
        from reservoir.plan.templates import template_fields

        if not template_fields(value):
            raise ValueError(f"{value!r} names no column: a template fills the prompt from "
                             "the row, e.g. '{question}'")
    return value


class TasksConfig(Section):
    """Where tasks come from: a file, or a generator for the CPU examples (neither: a served
    run, whose agents bring their own)."""

    file: LocalPath | None = Field(
        default=None, description="a task file (JSONL, Parquet or CSV: prompt, answer, "
        "optional split, source, reward, messages), a folder of such shards, or a Hugging Face "
        "datasets folder (save_to_disk), shuffled by run.seed as the run loads it")
    columns: dict[Literal["prompt", "answer", "split", "source", "reward", "messages"],
                  Annotated[str, AfterValidator(_column_name)]] = Field(
        default_factory=dict, description="our column names mapped to the data set's, e.g. "
        "{prompt: question, answer: answer}")
    answer_pattern: Annotated[str | None, AfterValidator(_pattern)] = Field(
        default=None, description="a regular expression that takes the answer out of the "
        "answer column: its first group, else the whole match (GSM8K: '#### (.+)')")
    prompt_template: Annotated[str | None, AfterValidator(_template)] = Field(
        default=None, description="the prompt as a format string over the row's columns, e.g. "
        "'{question} Put the final answer after ####.' (column names only)")
    system_prompt: str | None = Field(
        default=None, min_length=1, max_length=100_000, description="a system message every "
        "task's conversation starts with (explorers, evaluation and sft on tasks)")
    generate: Annotated[str | None, AfterValidator(_generator)] = Field(
        default="reverse", description="addition, reverse, sort, calculator or guess_number")
    count: Count = count(2000, 1, 10_000_000, "how many tasks the generator makes")
    test_fraction: Number = number(0.1, ge=0.0, lt=1.0, description="share of the generated "
                                   "tasks held out (split test) for evaluation")

    @model_validator(mode="after")
    def _one_source(self) -> TasksConfig:
        if self.file is not None and "generate" in self.model_fields_set and self.generate:
            raise ValueError("give tasks.file or tasks.generate, not both (the file's tasks "
                             "would be loaded and the generator silently ignored)")
        return self

    @property
    def any(self) -> bool:
        return self.file is not None or self.generate is not None


class TensorBoardTracking(Section):
    dir: LocalPath = Field(description="the log folder (one subfolder per run: "
                           "tensorboard --logdir DIR)")


class MlflowTracking(Section):
    tracking_uri: Annotated[str, AfterValidator(_tracking_uri)] = Field(
        description="an MLflow tracking URI: a server (http://host:5000) or a local store "
        "(file:///path, sqlite:///path.db)")
    experiment: str = Field(default="reservoir", min_length=1, max_length=500,
                            description="the MLflow experiment runs are logged under")


class WandbTracking(Section):
    project: str = Field(min_length=1, max_length=128, description="the W&B project")
    entity: str | None = Field(default=None, max_length=128,
                               description="the W&B entity (team or user); unset: yours")
    mode: Literal["online", "offline"] = Field(
        default="offline", description="offline writes the run's files (wandb sync sends "
        "them later); online needs WANDB_API_KEY in the environment")
    dir: LocalPath | None = Field(default=None, description="where wandb writes its files; "
                                  "unset: ./wandb")


class TrackingConfig(Section):
    """Experiment trackers that follow the run (views of the store: each step is logged once,
    after it committed; a tracker that fails is one warning and the run goes on)."""

    tensorboard: TensorBoardTracking | None = Field(
        default=None, description="TensorBoard event files: {dir}")
    mlflow: MlflowTracking | None = Field(
        default=None, description="MLflow: {tracking_uri, experiment}")
    wandb: WandbTracking | None = Field(
        default=None, description="Weights & Biases: {project, entity, mode, dir}")
    interval_s: Number = number(5.0, ge=0.1, le=3600, description="seconds between the "
                                "trackers' reads of the newly committed steps (each read logs "
                                "every step since the last: fewer reads, less of the run's CPU)")

    @property
    def any(self) -> bool:
        return any((self.tensorboard, self.mlflow, self.wandb))


class ServeConfig(Section):
    """`reservoir serve`: an OpenAI-compatible endpoint on the run's latest policy (a colocated
    run's own process serves it, between steps). Every call is recorded; an episode's calls
    become one group when its reward is reported. The bearer token is read from the
    environment variable `token_env` (a secret stays out of configs)."""

    host: Annotated[str, AfterValidator(_host)] = Field(
        default="127.0.0.1", description="address to bind; anything but a loopback address "
        "needs the token")
    port: Count = count(8000, 1, 65_535, "port to bind")
    model_name: RunName | None = Field(default=None, description="the model id clients "
                                       "name; unset: the run's name")
    token_env: Annotated[str, AfterValidator(_env_name)] = Field(
        default="RESERVOIR_SERVE_TOKEN", description="the environment variable holding the "
        "bearer token; once it is set, every request must carry it")
    max_tokens: Count = count(256, 1, 1_000_000, "a call's max_tokens when it gives none")
    max_n: Count = count(16, 1, 1024, "most choices one call may ask for")
    max_request_bytes: Count = count(2 * 2**20, 1024, 2**30, "largest request body taken "
                                     "(413 past it, before it is read)")
    max_messages: Count = count(1000, 1, 1_000_000, "most messages one call may hold")
    max_tools: Count = count(128, 0, 100_000, "most tools one call may offer")
    allowed_hosts: tuple[Annotated[str, AfterValidator(_host)], ...] = Field(
        default=(), description="names clients reach the server by besides its address (its "
        "Host header must be one: a rebound DNS name is not)")


def _reward_range(value: tuple[float, float]) -> tuple[float, float]:
    return check_reward_range(*value)


def _band(value: tuple[float, float]) -> tuple[float, float]:
    low, high = value
    if not 0 <= low <= high <= 1:
        raise ValueError(f"[{low:g}, {high:g}]: a band of pass rates is [low, high] with "
                         "0 <= low <= high <= 1")
    return value


class ExplorerConfig(Section):
    n: Count = count(8, 1, 1024, "responses per task (the group size)")
    reward_range: Annotated[tuple[Number, Number], AfterValidator(_reward_range)] = Field(
        default=DEFAULT_REWARD_RANGE, description="rewards (and their components) the store "
        "takes, [low, high] inside float32: a reward or a reported one outside is refused")
    temperature: Number = number(1.0, gt=0, le=100, description="sampling temperature; "
                                 "logprobs are recorded under it")
    max_tokens: Count = count(16, 1, 1_000_000, "most tokens a response (or a turn of an "
                              "episode) may have")
    batch_tasks: Count = count(8, 1, 100_000, "tasks a worker claims and samples in one batch")
    reward: Annotated[str, _registered("reservoir.explorer.rewards", "REWARDS")] = Field(
        default="exact_match", description="the reward function (a task file's `reward` "
        "column overrides it per task): built in or registered by a package")
    reward_options: dict[str, Annotated[object, BeforeValidator(_option)]] = Field(
        default_factory=dict, description="options of rewards that take them: llm_judge (url, "
        "model, rubric, max_score, max_concurrency, timeout_s), reward_model (path, device, "
        "batch_size), code_exec (timeout_s, memory_mb, cpu_s), math_verify (timeout_s)")
    workflow: Annotated[str, _registered("reservoir.explorer.workflow", "WORKFLOWS")] = Field(
        default="single_turn", description="how a task becomes a group: single_turn, "
        "calculator, guess_number, or one a package registers")
    workflow_options: dict[str, Annotated[object, BeforeValidator(_option)]] = Field(
        default_factory=dict, description="keyword options of the workflow (e.g. max_calls)")
    task_order: Literal["least_explored", "priority", "difficulty_band"] = Field(
        default="least_explored", description="the order explorers claim tasks in: "
        "least_explored first, highest priority first, or difficulty_band (tasks whose pass "
        "rate lies in pass_rate_band first, unmeasured ones next, the rest last)")
    pass_rate_band: Annotated[tuple[Number, Number], AfterValidator(_band)] = Field(
        default=(0.1, 0.9), description="[low, high] pass rates (1 - tasks.difficulty) that "
        "task_order: difficulty_band claims first")
    workers: Count = count(1, 1, 1024, "explorer workers (Ray actors)")
    resources: RayResources = resources("explorer")
    claim_seconds: Number = number(300.0, gt=0, le=7 * DAY,
                                   description="a dead worker's tasks are claimed again after this")
    threads: Count | None = count(None, 1, 1024, "torch threads per worker (a colocated "
                                  "run: while its rounds generate); unset: the cores shared by "
                                  "the workers that compute at once (colocated: the trainer's)")
    device: Device = Field(default="auto", description="where the engine runs: auto (cuda when "
                           "available), cpu, cuda or cuda:N")
    engine: Literal["auto", "transformers", "vllm"] = Field(
        default="auto", description="auto: vllm where it is installed and a GPU is present, "
        "else transformers")
    gpu_memory_utilization: Number = number(
        0.5, gt=0, le=1, description="share of the device's memory vLLM reserves (on a CPU, of "
        "the machine's memory: keep it small there)")


def _preset(value: str) -> str:
    if value not in PRESETS:
        close = difflib.get_close_matches(value, PRESETS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"unknown algorithm {value!r}; {hint}valid: {', '.join(PRESETS)}")
    return value


def _algorithm_mapping(value):
    return {"preset": value} if isinstance(value, str) else value


class AlgorithmConfig(Section):
    """A preset (trainer/presets.py) and the options that override it; unset keys keep the
    preset's values."""

    preset: Annotated[str, AfterValidator(_preset)] = Field(
        default="grpo", description="the preset: ppo, grpo, grpo-kl, dr-grpo, rloo, "
        "reinforce++, gspo, cispo, opmd, sft or dpo")
    advantage: Annotated[str | None, _registered(PIECES, "ADVANTAGES")] = Field(
        default=None, description="advantage estimator (gae, grpo, dr-grpo, rloo, "
        "reinforce++, opmd, none); unset: the preset's")
    policy_loss: Annotated[str | None, _registered(PIECES, "POLICY_LOSSES")] = Field(
        default=None, description="policy loss (ppo, gspo, cispo, opmd, sft); unset: the "
        "preset's")
    preference_loss: Annotated[str | None, _registered(PIECES, "PREFERENCE_LOSSES")] = Field(
        default=None, description="preference loss (dpo): the algorithm then trains on "
        "chosen/rejected pairs; unset: the preset's")
    kl_estimator: Annotated[str | None, _registered(PIECES, "KL_ESTIMATORS")] = Field(
        default=None, description="KL estimator: k1, k2 or k3; unset: the preset's (k1 for "
        "reinforce++, else k3)")
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] | None = Field(
        default=None, description="how token losses become the loss; unset: the preset's")
    clip_low: Number | None = number(None, gt=0, le=1, description="lower clip of the "
                                     "importance ratio (1 - clip_low); unset: the preset's")
    clip_high: Number | None = number(None, gt=0, le=100, description="upper clip of the "
                                      "importance ratio (1 + clip_high); unset: the preset's")
    dual_clip: Number | None = number(None, gt=1, le=1e6, description="PPO's dual clip c > 1, "
                                      "bounding the loss of negative advantages; unset: the "
                                      "preset's")
    kl_coef: Number | None = number(None, ge=0, le=1e3, description="weight of the KL to the "
                                    "frozen stage-start policy (> 0 loads that reference); "
                                    "unset: the preset's")
    kl_in: Literal["loss", "reward"] | None = Field(
        default=None, description="loss: a KL term in the loss; reward: -kl_coef x KL folded "
        "into each token's reward, from the sampling logprobs; unset: the preset's")
    entropy_coef: Number | None = number(None, ge=0, le=1e3, description="weight of an entropy "
                                         "bonus; unset: the preset's (0)")
    gamma: Number | None = number(None, ge=0, le=1, description="discount (reinforce++, gae); "
                                  "unset: the preset's (1)")
    lam: Number | None = number(None, ge=0, le=1, description="GAE's lambda; unset: the "
                                "preset's (0.95)")
    tau: Number | None = number(None, gt=0, le=1e6, description="OPMD's temperature; unset: "
                                "the preset's (1)")
    opmd_baseline: Literal["mean", "logavgexp"] | None = Field(
        default=None, description="OPMD's baseline: the group mean or tau-logavgexp; unset: "
        "the preset's (mean)")
    beta: Number | None = number(None, gt=0, le=1e6, description="DPO's beta; unset: the "
                                 "preset's (0.1)")
    value_clip: Number | None = number(None, gt=0, le=1e6, description="clipping of the "
                                       "critic's value loss; unset: the preset's (0.2)")
    epochs: Count | None = count(None, 1, 1000, "passes over each step's batch (PPO epochs); "
                                 "the step still consumes one batch and commits once")
    mini_batches: Count | None = count(None, 1, 100_000, "optimizer updates per pass, each on "
                                       "a shuffled share of the batch")
    old_logprobs: Literal["engine", "recompute"] | None = Field(
        default=None, description="what ratios are taken against: the engine's sampled "
        "logprobs, or the policy's, recomputed before the step's first update")
    flat_updates: Literal["skip", "step"] | None = Field(
        default=None, description="an update in which no row has signal (every group's "
        "rewards equal) and the loss is proportional to the advantage: skip (the default) "
        "leaves the weights and AdamW's moments as they are; step takes AdamW's step on zero "
        "gradients, as TRL does (its moments keep moving the weights)")

    @model_validator(mode="after")
    def _updates_fit(self) -> AlgorithmConfig:
        algorithm = self.resolve()
        if algorithm.preference_loss is not None and algorithm.updates > 1:
            raise ValueError("epochs, mini_batches: a preference algorithm (dpo) takes one "
                             "update a step")
        return self

    def resolve(self, **extra):
        """The `Algorithm` this names: the preset with every set key replaced."""
        changes = {k: v for k, v in self.model_dump(exclude={"preset"}).items() if v is not None}
        return PRESETS[self.preset].replace(**changes, **extra)


AlgorithmChoice = Annotated[AlgorithmConfig, BeforeValidator(_algorithm_mapping)]


class CriticConfig(Section):
    """PPO's value model (used by algorithms whose advantage is gae)."""

    path: LocalPath | None = Field(default=None, description="a Hugging Face model folder whose "
                              "decoder becomes the critic; unset: a copy of the policy's start")
    lr: Number = number(1e-3, gt=0, le=1, description="the critic's learning rate (its own "
                        "AdamW)")


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ModuleName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=200)]


class LoraConfig(Section):
    """LoRA adapters (peft) on the policy: only the adapters train and sit in the optimizer;
    the base stays frozen and, adapters off, is the reference KL and DPO measure against."""

    rank: Count = count(8, 1, 4096, "the adapters' rank r")
    alpha: Number | None = number(None, gt=0, le=1e6, description="scale alpha (the update "
                                  "is alpha / r x B A); unset: 2 x rank")
    dropout: Number = number(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    target_modules: tuple[ModuleName, ...] = Field(
        default=LORA_TARGETS, min_length=1, max_length=1000, description="names of the linear "
        "layers that get adapters (default: attention and MLP projections)")

    @property
    def scale_alpha(self) -> float:
        return self.alpha if self.alpha is not None else 2.0 * self.rank


class TrainerConfig(Section):
    algorithm: AlgorithmChoice = Field(
        default=AlgorithmConfig(), description="a preset name (ppo, grpo, grpo-kl, dr-grpo, "
        "rloo, reinforce++, gspo, cispo, opmd, sft, dpo) or {preset: NAME, option: value, ...}")
    critic: CriticConfig = Field(default=CriticConfig(), description="PPO's value model "
                                 "(algorithms whose advantage is gae)")
    lora: LoraConfig | None = Field(default=None, description="train LoRA adapters instead of "
                                    "every weight: {rank: 8} or {rank, alpha, dropout, "
                                    "target_modules}; unset: full fine-tuning")
    lr: Number = number(1e-3, gt=0, le=1, description="learning rate (AdamW)")
    weight_decay: Number = number(0.0, ge=0, le=1, description="AdamW's decoupled weight decay "
                                  "of matrices (never biases or norms); 0, as TRL's default")
    batch_groups: Count = count(8, 1, 100_000, "whole groups a step leases and trains on")
    micro_batch: Count = count(16, 1, 1_000_000, "rows per micro-batch when packing is off "
                               "(and per preference micro-batch)")
    packing: bool = Field(default=True, description="micro-batches are their rows' tokens back "
                          "to back without padding (position ids restart per row, attention "
                          "stays within each row), sized by micro_batch_tokens; false: rows "
                          "padded to the batch's longest, micro_batch rows at a time")
    micro_batch_tokens: Count = count(4096, 1, 100_000_000, "tokens per packed micro-batch "
                                      "(a longer row goes alone)")
    sync_interval: Count = count(1, 1, 1_000_000, "steps between published policy versions")
    steps: Count = count(50, 1, 100_000_000, "RL steps of trainer.algorithm (without stages)")
    eval_interval: Count = count(10, 1, 100_000_000, "steps between held-out evaluations "
                                 "(greedy, the test split); also at step 0 and each stage's end")
    warmup_steps: Count = count(0, 0, 100_000_000, "supervised warm-up steps first")
    warmup_fraction: Number = number(0.5, gt=0, le=1,
                                     description="share of the train tasks the warm-up sees "
                                     "(trainer.warmup_steps); with stages: deprecated, write "
                                     "the stage's data: {tasks: {fraction: F}}")
    warmup_batch: Count = count(32, 1, 1_000_000, "tasks per warm-up step")
    warmup_lr: Number = number(3e-3, gt=0, le=1, description="the warm-up's learning rate")
    checkpoint_interval: Count = count(10, 1, 100_000_000, "steps between checkpoints (model, "
                                       "optimizer, RNG and step, under checkpoint_dir/RUN/step-N)")
    checkpoint_dir: LocalPath = Field(
        default=Path("checkpoints"), description="folder of checkpoints and of published "
        "weights (RUN/policy/vN.safetensors); explorers on other machines need it shared")
    threads: Count | None = count(None, 1, 1024, "torch threads; unset: every core in sync "
                                  "mode, a share of them in async mode")
    wait_timeout_s: Number = number(1800.0, gt=0, le=30 * DAY,
                                    description="fail the run if no batch arrives for this long")
    device: Device = Field(default="auto", description="auto (cuda when available), cpu, cuda "
                           "or cuda:N; a pool's rank r takes the r-th GPU")
    dtype: Literal["float32", "bfloat16"] = Field(
        default="float32", description="compute precision; bfloat16 runs the forward and "
        "backward passes in bf16 (autocast) while weights and optimizer state stay float32")
    gradient_checkpointing: bool = Field(default=False, description="recompute activations in "
                                         "the backward pass: less memory, ~30% more compute")
    resources: RayResources = resources("trainer", " (its ranks run on its node)")
    workers: Count = count(1, 1, 1024, "data-parallel trainer ranks (torch.distributed: gloo "
                           "on CPU, NCCL on GPU); each step's groups are split between them")
    sharding: Literal["none", "fsdp2"] = Field(
        default="none", description="none: every rank holds the whole model and optimizer; "
        "fsdp2: torch's fully_shard on each decoder layer, every rank holds 1/workers of the "
        "weights, gradients and optimizer state (checkpoints sharded, any world size loads them)")
    logprob_chunk: Count = count(1024, 1, 1_000_000, "positions per chunk when computing token "
                                 "logprobs (the vocabulary-wide softmax is never materialised)")
    tis_cap: Number | None = number(
        None, gt=0, le=1e6, description="truncated importance sampling: weight each token by "
        "min(p_trainer / p_engine, tis_cap), correcting the engine/trainer mismatch; unset: off")


class StoredData(Section):
    """Stored experiences a stage trains on, read in a fixed order (no lease: stored rows are
    history, several runs may read them); the ledger records every row each step used."""

    runs: tuple[RunName, ...] = Field(default=(), description="runs whose rows are read; "
                                      "empty: this run")
    status: tuple[Literal["ready", "consumed", "quarantined", "retired"], ...] = Field(
        default=("consumed",), description="statuses of the rows read")
    where: Annotated[str | None, AfterValidator(expression)] = Field(
        default=None, description="a boolean SQL expression over experiences' columns (run "
        "alone, read-only, like a pipeline's)")
    order: Literal["id", "reward", "random"] = Field(
        default="id", description="the order rows are read in: id, reward or random")
    select: Literal["groups", "best"] = Field(
        default="groups", description="groups: whole groups; best: each group's "
        "highest-reward response (e.g. SFT on an earlier run's best answers)")


class PreferenceData(Section):
    """Chosen/rejected pairs leased from `preferences`."""

    runs: tuple[RunName, ...] = Field(default=(), description="runs whose pairs are leased; "
                                      "empty: this run")
    epochs: bool = Field(default=True, description="once every pair has trained, all become "
                         "ready again (another epoch); false: the stage waits for new pairs")


class TaskData(Section):
    """A stage's share of the run's train tasks (`data: {tasks: {fraction: 0.3}}`)."""

    fraction: Number = number(0.5, gt=0, le=1, description="share of the run's train tasks "
                              "(the first ones, in the order explorers claim them last) the "
                              "stage trains on")


def _task_data(value):
    return {} if value is True else None if value is False else value


class StageData(Section):
    """Exactly one source: explorers (the run's own rollouts), tasks (SFT on the run's train
    tasks' answers), stored rows, or preference pairs."""

    explorers: bool = Field(default=False, description="lease the run's groups, as explorers "
                            "write them (`data: explorers`)")
    tasks: Annotated[TaskData | None, BeforeValidator(_task_data)] = Field(
        default=None, description="sft on the answers (or demonstrations) of the first "
        "tasks.fraction of the train tasks (`data: tasks` takes half)")
    stored: StoredData | None = Field(default=None, description="experiences already in the "
                                      "store, read, not leased")
    preferences: PreferenceData | None = Field(default=None, description="chosen/rejected "
                                               "pairs leased from preferences")

    @model_validator(mode="after")
    def _one_source(self) -> StageData:
        chosen = [self.explorers, self.tasks is not None, self.stored is not None,
                  self.preferences is not None]
        if sum(chosen) != 1:
            raise ValueError("a stage's data is one of: explorers, tasks, {stored: {...}}, "
                             "{preferences: {...}}")
        return self

    @property
    def kind(self) -> str:
        return ("explorers" if self.explorers else "tasks" if self.tasks is not None
                else "stored" if self.stored is not None else "preferences")


def _stage_data(value):
    return {"explorers": True} if value == "explorers" else {"tasks": {}} if value == "tasks" \
        else value


class StageConfig(Section):
    """One stage of a run: an algorithm trained for `steps` steps on one data source."""

    name: RunName = Field(description="the stage's name (train_steps.stage; unique in the run)")
    algorithm: AlgorithmChoice = Field(description="a preset name or {preset: NAME, option: "
                                       "value, ...}, as trainer.algorithm")
    steps: Count = Field(ge=1, le=100_000_000, description="optimizer steps (required)")
    lr: Number | None = number(None, gt=0, le=1, description="unset: trainer.lr")
    batch: Count | None = count(None, 1, 1_000_000, "groups (pairs for preferences, tasks "
                                "for tasks) per step; unset: trainer.batch_groups")
    data: Annotated[StageData, BeforeValidator(_stage_data)] = Field(
        default=StageData(explorers=True), description="explorers, tasks, {stored: {...}} or "
        "{preferences: {...}}")

    @model_validator(mode="after")
    def _data_fits_algorithm(self) -> StageConfig:
        pairs = self.algorithm.resolve().preference_loss is not None
        if pairs != (self.data.preferences is not None):
            raise ValueError(f"stage {self.name!r}: a preference algorithm (dpo) trains on "
                             "data: {preferences: ...} and only it does")
        if self.data.tasks is not None and self.algorithm.resolve().policy_loss != "sft":
            raise ValueError(f"stage {self.name!r}: data: tasks has answers, not rollouts: "
                             "only sft trains on it")
        return self


class RunSection(Section):
    name: RunName = Field(default="run", description="1-100 letters, digits, '.', '_', '-', "
                          "starting with a letter or digit (it names folders and rows)")
    mode: Literal["sync", "async"] = Field(
        default="sync", description="sync: on-policy; async: explorers run ahead by at most "
        "sampler.max_staleness policy versions")
    placement: Literal["split", "colocated"] = Field(
        default="split", description="split: a trainer and explorer.workers explorers in "
        "processes of their own (Ray), each holding the model; colocated: one process holds "
        "one model on trainer.device and alternates generating a round with it and training "
        "on it (one device, no weight files between the two)")
    seed: Count = count(0, 0, 2**32 - 1, "seeds the run: task shuffling, sampling, training")
    branch_from: Annotated[str | None, AfterValidator(_branch)] = Field(
        default=None, description="RUN@STEP (`--from`): start from that run's weights at that "
        "step, with its tasks and, for stored-data stages, its experiences up to that step")
    store: Count | None = count(None, 0, 1023, "with store.urls: the server a new run is "
                                "placed on, by its place in the list (0 is the first); unset: "
                                "the one with the least declared demand")
    demand: Number = number(
        1.0, ge=0, le=1e9, description="with store.urls: the load this run declares, in any "
        "unit used alike for every run (its GPUs, say); a new run goes to the server whose runs "
        "declare the least")
    ray_address: str | None = Field(
        default=None, description="Ray cluster to run the worker pools on; unset: "
        "RAY_ADDRESS, else the cluster `ray start` last started on this machine, else a Ray "
        "of the run's own")
    resume_wait_s: Number = number(
        3600.0, ge=0, le=30 * DAY, description="how long the run's explorers and stream "
        "pipelines started on their own wait for its trainer to resume once the run failed "
        "(`train --resume`), and a stream for its run to be created; past it they stop with "
        "exit code 1")


class ReservoirConfig(Section):
    """The whole config file."""

    run: RunSection = Field(default=RunSection(), description="the run: name, mode, "
                            "placement, seed")
    model: ModelConfig = Field(default=ModelConfig(), description="the policy model")
    tasks: TasksConfig = Field(default=TasksConfig(), description="where tasks come from")
    explorer: ExplorerConfig = Field(default=ExplorerConfig(), description="the explorers: "
                                     "sampling, reward, workflow, engine, devices")
    trainer: TrainerConfig = Field(default=TrainerConfig(), description="the trainer: "
                                   "algorithm, optimizer, batches, checkpoints, devices")
    store: StoreConfig = Field(default=StoreConfig(), description="where the experience "
                               "store lives")
    sampler: SamplerConfig = Field(default=SamplerConfig(), description="flow control: how "
                                   "trainers lease experiences out of the store")
    stages: tuple[StageConfig, ...] = Field(
        default=(), description="stages in order, each with its algorithm, steps, lr and data; "
        "unset: trainer.warmup_steps of sft on tasks, then trainer.steps of trainer.algorithm "
        "on the explorers' rollouts")
    tracking: TrackingConfig = Field(
        default=TrackingConfig(), description="TensorBoard, MLflow and W&B trackers that "
        "follow the run's steps from the store")
    serve: ServeConfig | None = Field(
        default=None, description="set (`serve: {}` for the defaults) when agents feed the run "
        "through `reservoir serve`: its groups are episodes of any size")
    pipelines: tuple[LocalPath, ...] = Field(
        default=(), description="stream pipelines a run starts: with one over experiences, "
        "explorers write raw rows and only rows a pipeline passes become ready for the "
        "trainer; one over tasks (a curriculum) passes as rows are written")

    @model_validator(mode="after")
    def _pool_fits_a_batch(self) -> ReservoirConfig:
        if self.trainer.workers > self.trainer.batch_groups:
            raise ValueError(f"trainer.workers ({self.trainer.workers}) exceeds "
                             f"trainer.batch_groups ({self.trainer.batch_groups}): every rank "
                             "trains at least one whole group")
        return self

    @model_validator(mode="after")
    def _store_in_urls(self) -> ReservoirConfig:
        if self.run.store is not None and self.run.store >= len(self.store.urls):
            raise ValueError(f"run.store: {self.run.store} is not a place in store.urls "
                             f"({len(self.store.urls)} servers, counted from 0)")
        return self

    @model_validator(mode="after")
    def _stages_alone(self) -> ReservoirConfig:
        if self.stages and self.trainer.warmup_steps:
            raise ValueError("stages and trainer.warmup_steps: put the warm-up in the stages "
                             "(an sft stage with data: tasks)")
        names = [stage.name for stage in self.stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stage names repeat: {names}")
        return self

    @model_validator(mode="after")
    def _tasks_unless_served(self) -> ReservoirConfig:
        if not self.tasks.any and self.serve is None:
            raise ValueError("tasks need a source: set tasks.file (JSONL, Parquet or CSV) or "
                             "tasks.generate (addition, reverse, sort, calculator, "
                             "guess_number); only a served run (serve:) may have none")
        return self

    @model_validator(mode="after")
    def _async_needs_staleness(self) -> ReservoirConfig:
        if self.run.mode == "async" and self.sampler.max_staleness is None:
            raise ValueError("run.mode is async but sampler.max_staleness is unset: set how "
                             "many policy versions explorers may run ahead (e.g. 1)")
        return self

    @model_validator(mode="after")
    def _colocated_fits(self) -> ReservoirConfig:
        if self.run.placement != "colocated":
            return self
        alone = {"trainer.workers": self.trainer.workers, "explorer.workers": self.explorer.workers}
        for key, value in alone.items():
            if value != 1:
                raise ValueError(f"{key} is {value} but run.placement is colocated: one process "
                                 "trains and explores; use placement: split for pools")
        if self.explorer.engine == "vllm":
            raise ValueError("explorer.engine is vllm but run.placement is colocated: a "
                             "colocated run generates with the trainer's own module "
                             "(transformers); use placement: split for vLLM")
        if self.explorer.device not in ("auto", self.trainer.device):
            raise ValueError(f"explorer.device is {self.explorer.device} but run.placement is "
                             f"colocated: the explorer uses the trainer's model on "
                             f"trainer.device ({self.trainer.device})")
        return self

    @property
    def deprecations(self) -> list[str]:
        """One line for each old key the config still uses (they keep working)."""
        if self.stages and "warmup_fraction" in self.trainer.model_fields_set:
            return ["trainer.warmup_fraction is deprecated with stages: write the share in the "
                    "stage, data: {tasks: {fraction: "
                    f"{self.trainer.warmup_fraction}}}}} (stages whose data sets none take it "
                    "until then)"]
        return []

    @property
    def branch(self) -> tuple[str, int] | None:
        """(run, step) this run branches from, if it does."""
        if self.run.branch_from is None:
            return None
        name, _, step = self.run.branch_from.rpartition("@")
        return name, int(step)

    def torch_threads(self, role: Literal["explorer", "trainer"]) -> int:
        """The configured threads, else the cores shared by the workers that compute at once:
        in sync mode explorers and the trainer take turns, in async mode all run together; a
        colocated run is one process that does one thing at a time."""
        configured = self.explorer.threads if role == "explorer" else self.trainer.threads
        if configured:
            return configured
        together = self.explorer.workers + (self.run.mode == "async")
        if self.run.placement == "colocated" or (role == "trainer" and self.run.mode == "sync"):
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
    raw, lines = read_yaml(path, "config")
    raw = raw if raw is not None else {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return parse_config(raw, source=str(path), lines=lines)


def parse_config(raw: dict, *, source: str = "<config>",
                 lines: dict[tuple, int] | None = None) -> ReservoirConfig:
    try:
        config = ReservoirConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(describe_errors(exc, source, ReservoirConfig, lines)) from None
    for line in config.deprecations:
        print(f"{source}: {line}", file=sys.stderr)
    return config


def describe_errors(exc: ValidationError, source: str, model: type[BaseModel],
                    lines: dict[tuple, int] | None = None) -> str:
    """One line: the file, then each bad key (with its line) and what is wrong with it."""
    problems = []
    for err in exc.errors():
        loc = tuple(part for part in err["loc"] if not _is_type_tag(part))
        key = ".".join(str(part) for part in loc) or "(top level)"
        line = line_of(loc, lines or {})
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            message = "unknown key" + suggest_key(model, loc)
        shown = redact_text(repr(err.get("input")))
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        where = f"{key} (line {line})" if line else key
        problems.append(f"{where}: {message} (got {shown})")
    return f"{source}: invalid: " + "; ".join(problems)


def _is_type_tag(part) -> bool:
    """pydantic puts the branch of a union into an error's location (e.g. 'int', 'str')."""
    return isinstance(part, str) and ("[" in part or part in ("int", "float", "str", "none"))


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
