"""Data-Juicer in process: operators resolved from its registry (ours included), arguments
checked against each operator's signature, and one operator at a time on an in-memory dataset,
so every row an operator drops or changes can be attributed to it.

Data-Juicer accepts unknown and mistyped arguments silently and, with `skip_op_error`, turns a
batch where one row raises into an empty batch; here an unknown argument, a wrong type or
`skip_op_error: true` is an error that names the operator, and errors inside an operator
propagate.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import math
import os
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError

from reservoir.errors import ConfigError
from reservoir.pipeline import trace

STALE_COLUMNS = ("__dj__stats__", trace.HASH, trace.MINHASH, trace.SIMHASH)

# Arguments every Data-Juicer operator takes (data_juicer.ops.base_op.OP.__init__).
COMMON_ARGS = {
    "accelerator", "adaptive_batching", "audio_key", "auto_op_parallelism", "batch_mode",
    "batch_size", "cpu_required", "gpu_required", "history_key", "image_bytes_key",
    "image_key", "index_key", "instruction_key", "mem_required", "memory", "num_cpus",
    "num_gpus", "num_proc", "prompt_key", "query_key", "ray_execution_mode", "response_key",
    "runtime_env", "skip_op_error", "system_key", "text_key", "turbo", "video_key", "work_dir",
}


@dataclass(frozen=True)
class PluginFailure:
    """An operator package (entry point group `data_juicer.ops`) whose module failed to
    import: Data-Juicer logs a warning and goes on, so its operators are simply missing."""

    entry_point: str
    module: str
    distribution: str | None
    error: str

    def describe(self) -> str:
        package = f" (package {self.distribution})" if self.distribution else ""
        return f"operator plugin {self.module}{package} failed to import: {self.error}"


PLUGIN_FAILURES: list[PluginFailure] = []


def registry() -> dict[str, type]:
    """Every operator Data-Juicer knows, ours (reservoir.operators) and plugins' included.

    Importing Data-Juicer configures logging for the whole process (a loguru sink on stderr at
    INFO, and the standard root logger at INFO): both are put back as they were. A plugin
    that fails to import is recorded in PLUGIN_FAILURES with its exception."""
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    import sys

    from loguru import logger

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    import data_juicer  # noqa: F401  (configures loguru; the plugins load with .ops below)

    logger.remove()
    first = "data_juicer.ops" not in sys.modules
    sink = logger.add(_capture_plugin_failure, level="WARNING",
                      filter=lambda r: r["function"] == "load_op_plugins") if first else None
    import datasets
    from data_juicer.ops import OPERATORS

    import reservoir.operators  # noqa: F401  (registers ours)

    logger.remove(sink) if sink is not None else None
    logger.remove()
    logger.disable("data_juicer")
    root.handlers[:], root.level = handlers, level
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return OPERATORS.modules


def _capture_plugin_failure(message) -> None:
    """A loguru sink called inside Data-Juicer's `except` around each plugin's import: the
    exception and the entry point (a local of that frame) are still at hand."""
    import sys

    _, exc, tb = sys.exc_info()
    entry_point = tb.tb_frame.f_locals.get("ep") if tb is not None else None
    if exc is None or entry_point is None:
        return
    PLUGIN_FAILURES.append(PluginFailure(
        entry_point.name, entry_point.module,
        entry_point.dist.name if entry_point.dist else None, f"{type(exc).__name__}: {exc}"))


def origin(cls: type) -> str:
    """The installed package an operator class comes from (e.g. py-data-juicer, reservoir-rft,
    a third party's), from the top-level module it is defined in."""
    from importlib.metadata import packages_distributions

    top = cls.__module__.split(".")[0]
    packages = _distributions(packages_distributions).get(top) or [top]
    return packages[0]


def _distributions(read, _cache: dict = {}):  # noqa: B006 (a cache kept between calls)
    if "map" not in _cache:
        _cache["map"] = read()
    return _cache["map"]


@dataclass(frozen=True)
class Step:
    index: int
    name: str
    op: Any  # a Data-Juicer operator instance

    @property
    def kind(self) -> str:
        from data_juicer.ops.base_op import Deduplicator, Filter, Mapper, Selector

        for base, kind in ((Filter, "filter"), (Deduplicator, "deduplicator"),
                           (Selector, "selector"), (Mapper, "mapper")):
            if isinstance(self.op, base):
                return kind
        return "other"


def parameters(cls: type) -> dict[str, inspect.Parameter]:
    """Named constructor parameters of an operator class and its bases up to OP."""
    found: dict[str, inspect.Parameter] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass.__name__ == "OP":
            continue
        for name, parameter in _signature(init).parameters.items():
            if name != "self" and parameter.kind not in (parameter.VAR_POSITIONAL,
                                                          parameter.VAR_KEYWORD):
                found.setdefault(name, parameter)
    return found


def _signature(function) -> inspect.Signature:
    """With string annotations resolved where they can be (modules using postponed ones)."""
    try:
        return inspect.signature(function, eval_str=True)
    except Exception:  # an annotation that names something not importable here
        return inspect.signature(function)


def check_args(index: int, name: str, args: dict[str, Any], known: dict[str, type]) -> None:
    """Unknown operator, unknown argument or wrong type: a ConfigError naming all three."""
    where = f"process[{index}] ({name})"
    if name not in known:
        close = difflib.get_close_matches(name, list(known), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else "; `reservoir pipeline ops` lists them"
        broken = "".join(f"; note: {failure.describe()}" for failure in PLUGIN_FAILURES)
        raise ConfigError(f"{where}: unknown operator{hint}{broken}")
    if args.get("skip_op_error"):
        raise ConfigError(f"{where}: skip_op_error is not allowed: Data-Juicer would replace a "
                          "batch where one row fails with an empty batch and report no error")
    params = parameters(known[name])
    for key, value in args.items():
        if key not in params and key not in COMMON_ARGS:
            close = difflib.get_close_matches(key, list(params) + sorted(COMMON_ARGS), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"{where}: unknown argument '{key}'{hint}")
        annotation = params[key].annotation if key in params else inspect.Parameter.empty
        _check_type(where, key, value, annotation)
    _check_ranges(where, args)


# Arguments whose names say they count or measure something: a negative one means nothing.
_NON_NEGATIVE = re.compile(r"(^|_)(len|num|size|count|ratio|rate|tokens|topk|fraction|"
                           r"threshold|window|blocks|bands|permutations|distance|percentile|"
                           r"rank|penalty|proc)(_|$)")


def _check_ranges(where: str, args: dict[str, Any]) -> None:
    """Numbers finite; counts and measures not negative; each min_X at most its max_X."""
    for key, value in args.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not math.isfinite(value):
            raise ConfigError(f"{where}: argument '{key}' = {value}: must be a finite number "
                              "(leave it out for no bound)")
        if value < 0 and _NON_NEGATIVE.search(key):
            raise ConfigError(f"{where}: argument '{key}' = {value}: must not be negative")
    for key, low in args.items():
        high = args.get("max_" + key[4:]) if key.startswith("min_") else None
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (low, high)) \
                and low > high:
            raise ConfigError(f"{where}: {key} = {low} is above max_{key[4:]} = {high}: no row "
                              "could pass")


def _check_type(where: str, key: str, value: Any, annotation: Any) -> None:
    if annotation is inspect.Parameter.empty or isinstance(annotation, str):
        return
    try:
        adapter = TypeAdapter(annotation)
    except Exception:  # an annotation pydantic cannot check (a forward reference, a class)
        return
    try:
        adapter.validate_python(value, strict=False)
    except ValidationError as exc:
        reason = exc.errors()[0]["msg"]
        raise ConfigError(f"{where}: argument '{key}' = {value!r}: {reason}") from None


def build_steps(operators: list[tuple[str, dict[str, Any]]], text_key: str) -> list[Step]:
    """Operator instances, after checking every name and argument."""
    known = registry()
    for index, (name, args) in enumerate(operators):
        check_args(index, name, args, known)
    steps = []
    for index, (name, args) in enumerate(operators):
        # in this process (num_proc 1 still forks a pool of one), one batch for single-row
        # operators (without turbo every later operator gets one-row table chunks)
        options = {"text_key": text_key, "auto_op_parallelism": False, "turbo": True, **args,
                   "skip_op_error": False}
        try:
            steps.append(Step(index, name, known[name](**options)))
        except Exception as exc:  # the operator's own argument checks
            raise ConfigError(f"process[{index}] ({name}): {exc}") from None
    return steps


def dataset(rows: list[dict[str, Any]]):
    """The rows as a Data-Juicer dataset, with a fingerprint of its own: `from_list` makes one
    by hashing the dataset's state (8-19 ms even for 2 rows, a stream pass's whole budget), and
    nothing here is cached by fingerprint. The columns' types are Arrow's, as from_list's."""
    import pyarrow as pa
    from data_juicer.core.data import NestedDataset
    from datasets import Dataset
    from datasets.table import InMemoryTable

    table = InMemoryTable(pa.Table.from_pylist(rows))
    return NestedDataset(Dataset(table, fingerprint=uuid.uuid4().hex))


def run_step(step: Step, data):
    """(output, detail): a filter's detail is its input with stats (computed once, then kept);
    a deduplicator's {dropped id: kept id}; a selector's {id: field, value, rank}; else None.

    Stats and hashes are removed before each operator: Data-Juicer caches them by name, so a
    second filter or deduplicator on another field would reuse the first one's."""
    stale = [c for c in data.column_names if c in STALE_COLUMNS]
    data = data.remove_columns(stale) if stale else data
    if step.kind == "filter":  # an empty stats column added at once (Data-Juicer adds it row
        data = data.add_column("__dj__stats__", [{}] * len(data))  # by row, ~0.5 s a filter)
        with_stats = step.op.run(data, reduce=False)
        kept = with_stats.filter(step.op.process, num_proc=step.op.runtime_np(),  # nothing is
                                 batch_size=step.op.batch_size,  # cached: no hash of the
                                 new_fingerprint=uuid.uuid4().hex)  # function and rows needed
        return kept, with_stats
    if step.kind == "deduplicator":
        return trace.deduplicate(step.op, data)
    if step.kind == "selector":
        return step.op.run(data), trace.selector_ranks(step.op, data)
    return step.op.run(data), None
