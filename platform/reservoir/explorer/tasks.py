"""Tasks for explorers: read from JSONL / Parquet / CSV files, or generated for CPU examples.

A task row has `prompt` (required), `answer` (the ground truth a reward function checks),
optional `split` (train / test), `source`, and any other columns, which go to its `payload`.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from reservoir.errors import ConfigError

READERS: dict[str, Callable[[Path], pd.DataFrame]] = {
    ".jsonl": lambda path: pd.read_json(path, lines=True, dtype=False),
    ".parquet": pd.read_parquet,
    ".csv": lambda path: pd.read_csv(path, dtype=str, keep_default_na=False),
}
KNOWN = ("prompt", "answer", "split", "source")


def read_task_file(path: Path) -> list[dict[str, Any]]:
    """Task rows from a file; errors name the file, and the row and column when one is bad."""
    path = Path(path)
    reader = READERS.get(path.suffix.lower())
    if reader is None:
        raise ConfigError(f"{path}: unknown task file type; use {', '.join(READERS)}")
    try:
        frame = reader(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read tasks: {exc}") from None
    if "prompt" not in frame.columns:
        raise ConfigError(f"{path}: no 'prompt' column (columns: {', '.join(frame.columns)})")
    return [_task_row(path, number, record)
            for number, record in enumerate(frame.to_dict(orient="records"), start=1)]


def _task_row(path: Path, number: int, record: dict[str, Any]) -> dict[str, Any]:
    prompt = record.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ConfigError(f"{path} row {number}: column 'prompt' = {prompt!r}: "
                          "every task needs a non-empty prompt; no task was loaded")
    answer, split, source = (_plain(record.get(key)) for key in ("answer", "split", "source"))
    payload = {k: _plain(v) for k, v in record.items() if k not in KNOWN}
    return {"prompt": prompt, "answer": None if answer is None else str(answer),
            "split": str(split or "train"), "source": str(source or path.name),
            "payload": json.loads(json.dumps(payload, default=str))}


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _plain(value: Any) -> Any:
    """A plain Python value: numpy scalars unwrapped, NaN (pandas' missing) as None."""
    value = value.item() if hasattr(value, "item") else value
    return None if _missing(value) or value == "" else value


def _split(rng: random.Random, test_fraction: float) -> str:
    return "test" if rng.random() < test_fraction else "train"


def addition(n: int, *, seed: int = 0, max_operand: int = 99,
             test_fraction: float = 0.1) -> list[dict[str, Any]]:
    """'What is a + b?' with the sum as answer."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append({"prompt": f"What is {a} + {b}?", "answer": str(a + b),
                     "split": _split(rng, test_fraction), "source": "addition",
                     "payload": {"a": a, "b": b}})
    return rows


def _word(rng: random.Random, low: int, high: int) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(low, high)))


def _word_tasks(n: int, *, seed: int, min_length: int, max_length: int, test_fraction: float,
                verb: str, solve: Callable[[str], str], source: str) -> list[dict[str, Any]]:
    """'<verb>: <random word>' tasks whose answer is solve(word)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        word = _word(rng, min_length, max_length)
        rows.append({"prompt": f"{verb}: {word}", "answer": solve(word),
                     "split": _split(rng, test_fraction), "source": source,
                     "payload": {"word": word}})
    return rows


def reverse(n: int, *, seed: int = 0, min_length: int = 3, max_length: int = 6,
            test_fraction: float = 0.1) -> list[dict[str, Any]]:
    """'Reverse: abc' with 'cba' as answer: a rule to generalise, not facts to memorise."""
    return _word_tasks(n, seed=seed, min_length=min_length, max_length=max_length,
                       test_fraction=test_fraction, verb="Reverse", solve=lambda w: w[::-1],
                       source="reverse")


def sort_letters(n: int, *, seed: int = 0, min_length: int = 3, max_length: int = 6,
                 test_fraction: float = 0.1) -> list[dict[str, Any]]:
    """'Sort: dcab' with 'abcd' as answer."""
    return _word_tasks(n, seed=seed, min_length=min_length, max_length=max_length,
                       test_fraction=test_fraction, verb="Sort",
                       solve=lambda w: "".join(sorted(w)), source="sort")


GENERATORS: dict[str, Callable[..., list[dict[str, Any]]]] = {
    "addition": addition, "reverse": reverse, "sort": sort_letters,
}


def write_task_file(rows: list[dict[str, Any]], path: Path) -> None:
    """Write generated tasks as JSONL (payload fields flattened into columns)."""
    with Path(path).open("w") as out:
        for row in rows:
            flat = {k: v for k, v in row.items() if k != "payload"} | row.get("payload", {})
            out.write(json.dumps(flat) + "\n")
