"""Tasks for explorers: read from JSONL / Parquet / CSV files, a folder of such shards, or a
Hugging Face `datasets` folder (`save_to_disk`), or generated for CPU examples.

A data set's own columns are mapped with a `TaskShape` (tasks.columns, answer_pattern,
system_prompt, prompt_template): e.g. GSM8K's `question` becomes the prompt and the number after
its answer's `####` the answer. A `DatasetDict` folder's splits become the tasks' splits (train;
test or validation: test).

A task row has `prompt` (required, non-empty text), `answer` (the ground truth a reward
function checks: text or a number), optional `split` (train or test), `source`, `reward` (a
registered reward function that scores this task instead of explorer.reward), `messages` (a
demonstration: a conversation whose assistant turns sft on tasks trains on, instead of the
answer alone), and any other columns; all but the first four go to its `payload` (JSON: finite
numbers, text, lists, objects). Every cell is
checked before anything is loaded: no NUL, no text without a UTF-8 form, no NaN or infinity,
no key given twice; a bad one is named by file, row (or line) and column, in one line.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from reservoir.chat import check_demonstration
from reservoir.errors import ConfigError
from reservoir.explorer.rewards import REWARDS
from reservoir.plan.templates import template_fields

KNOWN = ("prompt", "answer", "split", "source")
SPLITS = ("train", "test")
MAPPED = ("prompt", "answer", "split", "source", "reward", "messages")  # tasks.columns' keys
SPLIT_NAMES = {"train": "train", "test": "test", "validation": "test"}  # a DatasetDict's


@dataclass(frozen=True)
class TaskShape:
    """How a data set's rows become tasks: `columns` maps our names (prompt, answer, split,
    source, reward, messages) to its columns; `answer_pattern` (a regular expression) takes the
    answer out of the answer column (its first group, else the whole match);
    `prompt_template` (a format string over the row's columns) makes the prompt;
    `system_prompt` goes with every task (payload.system_prompt: explorers and sft on tasks
    put it before the prompt)."""

    columns: tuple[tuple[str, str], ...] = ()
    answer_pattern: str | None = None
    system_prompt: str | None = None
    prompt_template: str | None = None

    def named(self, ours: str) -> str:
        return dict(self.columns).get(ours, ours)


def read_task_file(path: Path, shape: TaskShape = TaskShape()) -> list[dict[str, Any]]:
    """Task rows from a file or folder; errors name the file, and the row and column when one
    is bad, and nothing is loaded."""
    path = Path(path)
    rows = []
    for source, records, split in _sources(path):
        if not records:
            continue
        columns = list(dict.fromkeys(key for record in records for key in record))
        needed = shape.named("prompt") if shape.prompt_template is None else None
        if needed is not None and needed not in columns:
            raise ConfigError(f"{source}: no {needed!r} column (columns: {', '.join(columns)})"
                              + ("" if needed == "prompt" else " (tasks.columns.prompt)"))
        rows += [_task_row(source, number, _shaped(source, number, record, shape, split))
                 for number, record in enumerate(records, start=1)]
    if not rows:
        raise ConfigError(f"{path}: the {'folder' if path.is_dir() else 'file'} holds no tasks")
    return rows


def _sources(path: Path) -> list[tuple[Path, list[dict[str, Any]], str | None]]:
    """(file, its records, the split its folder names) of a file, a folder of shards or a
    `datasets` folder."""
    if path.is_dir():
        if (path / "dataset_dict.json").exists() or (path / "dataset_info.json").exists():
            return _saved_dataset(path)
        shards = sorted(p for p in path.iterdir() if p.suffix.lower() in READERS)
        if not shards:
            raise ConfigError(f"{path}: a folder of tasks holds {', '.join(READERS)} shards or "
                              "a data set saved with datasets' save_to_disk; found neither")
        return [(shard, _read(shard), None) for shard in shards]
    return [(path, _read(path), None)]


def _read(path: Path) -> list[dict[str, Any]]:
    reader = READERS.get(path.suffix.lower())
    if reader is None:
        raise ConfigError(f"{path}: unknown task file type; use {', '.join(READERS)}, a folder "
                          "of them, or a datasets folder")
    try:
        return reader(path)
    except ConfigError:
        raise
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read tasks: {' '.join(str(exc).split())}") from None


def _saved_dataset(path: Path) -> list[tuple[Path, list[dict[str, Any]], str | None]]:
    """A folder `save_to_disk` wrote: one Dataset, or a DatasetDict whose splits become ours."""
    from datasets import Dataset, load_from_disk

    try:
        loaded = load_from_disk(str(path))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read the data set: {' '.join(str(exc).split())}") \
            from None
    if isinstance(loaded, Dataset):
        return [(path, loaded.to_list(), None)]
    unknown = [name for name in loaded if name not in SPLIT_NAMES]
    if unknown:
        raise ConfigError(f"{path}: split {unknown[0]!r}: a data set's splits are train, test "
                          "or validation (a test split)")
    return [(path / name, loaded[name].to_list(), SPLIT_NAMES[name]) for name in loaded]


def _shaped(source: Path, number: int, record: dict[str, Any], shape: TaskShape,
            split: str | None) -> dict[str, Any]:
    """A data set's record with our column names, its prompt made and its answer taken out."""
    where = f"{source} row {number}"
    theirs = dict(shape.columns)
    renamed = {name: value for name, value in record.items() if name not in theirs.values()}
    for ours, column in theirs.items():
        if column in record:
            renamed[ours] = record[column]
    if shape.prompt_template is not None:
        renamed["prompt"] = _filled(where, shape.prompt_template, record)
    if shape.answer_pattern is not None and not _missing(renamed.get("answer")):
        renamed["answer"] = _extracted(where, shape, str(renamed["answer"]))
    if split is not None and "split" not in theirs:
        renamed["split"] = split
    if shape.system_prompt is not None:
        renamed["system_prompt"] = shape.system_prompt
    return renamed


def _filled(where: str, template: str, record: dict[str, Any]) -> str:
    missing = [name for name in template_fields(template) if name not in record]
    if missing:
        raise ConfigError(f"{where}: tasks.prompt_template names column {missing[0]!r}, which "
                          f"the row does not have; no task was loaded")
    return template.format_map({name: "" if _missing(_plain(value)) else value
                                for name, value in record.items()})


def _extracted(where: str, shape: TaskShape, answer: str) -> str:
    found = re.search(shape.answer_pattern, answer, re.DOTALL)
    if found is None:
        shown = answer if len(answer) <= 60 else answer[:57] + "..."
        raise ConfigError(f"{where}: column {shape.named('answer')!r} = {shown!r}: "
                          f"tasks.answer_pattern {shape.answer_pattern!r} finds no answer in it;"
                          " no task was loaded")
    return (found.group(1) if found.groups() else found.group(0)).strip()




def _jsonl(path: Path) -> list[dict[str, Any]]:
    records = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line, object_pairs_hook=_unique_keys,
                                    parse_constant=_no_constant)
            except _Refused as exc:
                raise ConfigError(f"{path} line {number}: {exc}") from None
            except RecursionError:
                raise ConfigError(f"{path} line {number}: the JSON is nested too deeply") from None
            except ValueError as exc:
                raise ConfigError(f"{path} line {number}: not valid JSON: {exc}") from None
            if not isinstance(record, dict):
                raise ConfigError(f"{path} line {number}: a task is a JSON object (got "
                                  f"{type(record).__name__})")
            records.append(record)
    return records


class _Refused(ValueError):
    """Valid JSON that a task file may not hold."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _Refused(f"key {key!r} appears twice")
        seen[key] = value
    return seen


def _no_constant(name: str):
    raise _Refused(f"{name} is not a JSON number (write a finite number or null)")


def _frame(read: Callable) -> Callable[[Path], list[dict[str, Any]]]:
    return lambda path: read(path).to_dict(orient="records")


def _parquet(path: Path):
    import pandas as pd

    return pd.read_parquet(path)


def _csv(path: Path):
    import pandas as pd

    return pd.read_csv(path, dtype=str, keep_default_na=False)


READERS: dict[str, Callable[[Path], list[dict[str, Any]]]] = {
    ".jsonl": _jsonl, ".parquet": _frame(_parquet), ".csv": _frame(_csv),
}


def _task_row(path: Path, number: int, record: dict[str, Any]) -> dict[str, Any]:
    where = f"{path} row {number}"
    try:
        values = {key: _cell(where, str(key), _plain(value)) for key, value in record.items()}
    except RecursionError:
        raise ConfigError(f"{where}: a value is nested too deeply; no task was loaded") from None
    prompt = values.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ConfigError(f"{where}: column 'prompt' = {prompt!r}: every task needs a non-empty "
                          "prompt (text); no task was loaded")
    answer, split, source = (values.get(key) for key in ("answer", "split", "source"))
    if answer is not None and not isinstance(answer, (str, int, float)):
        raise ConfigError(f"{where}: column 'answer' = {answer!r}: the answer is text or a "
                          "number; no task was loaded")
    if split is not None and split not in SPLITS:
        raise ConfigError(f"{where}: column 'split' = {split!r}: a split is train or test; "
                          "no task was loaded")
    _check_reward(where, values.get("reward"))
    if values.get("messages") is not None:
        try:
            check_demonstration(values["messages"], f"{where}: column 'messages'")
        except ValueError as exc:
            raise ConfigError(f"{exc}; no task was loaded") from None
    elif answer is None:
        raise ConfigError(f"{where}: column 'answer' is missing: every task needs its answer "
                          "(the ground truth its reward checks: text or a number), or a "
                          "demonstration (messages); no task was loaded")
    payload = {k: v for k, v in values.items() if k not in KNOWN}
    return {"prompt": prompt, "answer": None if answer is None else str(answer),
            "split": split or "train", "source": str(source or path.name), "payload": payload}


def _check_reward(where: str, name: Any) -> None:
    if name is not None and (not isinstance(name, str) or name not in REWARDS.names()):
        raise ConfigError(f"{where}: column 'reward' = {name!r}: not a reward function; valid: "
                          f"{', '.join(REWARDS.names())}; no task was loaded")


def _cell(where: str, column: str, value: Any) -> Any:
    """A value PostgreSQL's text and JSONB can hold, checked all the way down."""
    def bad(rule: str):
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise ConfigError(f"{where}: column {column!r} = {shown}: {rule}; no task was loaded")

    if isinstance(value, str):
        if "\x00" in value:
            bad("text cannot hold a NUL character")
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                bad("not valid Unicode text (a lone surrogate)")
    elif isinstance(value, float) and not math.isfinite(value):
        bad("not a finite number")
    elif isinstance(value, dict):
        return {_cell(where, column, str(k)): _cell(where, column, _plain(v))
                for k, v in value.items()}
    elif isinstance(value, (list, tuple)):
        return [_cell(where, column, _plain(v)) for v in value]
    elif not isinstance(value, (int, float, bool, type(None))):
        return _cell(where, column, str(value))
    return value


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _plain(value: Any) -> Any:
    """A plain Python value: numpy scalars and arrays unwrapped, pandas' missing (NaN, '') as
    None."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    return None if _missing(value) or value == "" else value


def write_task_file(rows: list[dict[str, Any]], path: Path) -> None:
    """Write generated tasks as JSONL (payload fields flattened into columns)."""
    with Path(path).open("w") as out:
        for row in rows:
            flat = {k: v for k, v in row.items() if k != "payload"} | row.get("payload", {})
            out.write(json.dumps(flat) + "\n")
