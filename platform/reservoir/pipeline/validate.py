"""Data quality with great-expectations: the pipeline's `validate:` suite on the rows it produced.

Expectations are written as in great-expectations' own docs, by snake_case type and kwargs:

    validate:
      expectations:
        - expect_column_values_to_not_be_null: {column: response_text}
        - expect_column_values_to_be_between: {column: reward, min_value: 0, max_value: 1}
        - expect_column_values_to_be_unique: {column: response_text}
        - expect_compound_columns_to_be_unique: {column_list: [group_id, response_text]}
        - expect_group_size: {n: 8}                       # ours: every group has n rows
        - unexpected_rows_expectation:                    # custom SQL over the batch (SQLite)
            unexpected_rows_query: "SELECT * FROM {batch} WHERE reward > 0 AND response_len = 0"
      on_failure: quarantine                              # fail | quarantine | warn

They run in an ephemeral context (no project files) on the batch as a DataFrame, with every
failing row's id; `unexpected_rows_expectation` runs on a SQLite copy of the batch, since
great-expectations runs custom SQL only on SQL sources; each query is first tried on a
read-only connection that allows only SELECT and stops it after 30 s. A NaN reward counts as missing for
`expect_column_values_to_be_between` (pandas semantics): pair it with not-null to fail NaN.
"""

from __future__ import annotations

import logging
import math
import sqlite3
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from reservoir.errors import ConfigError

GROUP_SIZE = "expect_group_size"  # ours: a group-size column checked with between
CUSTOM_SQL = "unexpected_rows_expectation"
RESULT_FORMAT = {"result_format": "COMPLETE", "unexpected_index_column_names": ["id"]}


@dataclass
class Outcome:
    """One expectation's result, JSON-ready, with the ids of the rows that failed it."""

    expectation: str
    kwargs: dict[str, Any]
    success: bool
    element_count: int | None
    unexpected_count: int | None
    failing_ids: list[int] = field(default_factory=list)
    sample: list[Any] = field(default_factory=list)
    error: str | None = None


def _gx():
    """Import great-expectations quietly (it logs ~200 INFO lines at import otherwise)."""
    logger = logging.getLogger("great_expectations")
    if not logger.handlers:
        logger.propagate = False
        handler = logging.StreamHandler(sys.stderr)
        handler.setLevel(logging.WARNING)
        logger.addHandler(handler)
    import great_expectations as gx

    return gx


COLUMN_ARGS = ("column", "column_A", "column_B")


def check_specs(expectations, columns: set[str] | None = None) -> None:
    """Build every expectation once, so a bad type or argument fails before anything runs;
    with `columns`, a column the rows will not have is named too."""
    for index, spec in enumerate(expectations):
        (name, kwargs), = spec.items()
        where = f"validate.expectations[{index}] ({name})"
        try:
            _expectation(name, kwargs or {})
        except Exception as exc:  # great-expectations raises several types for bad specs
            raise ConfigError(f"{where}: {' '.join(str(exc).split())}") from None
        named = [kwargs[key] for key in COLUMN_ARGS if key in (kwargs or {})]
        named += list((kwargs or {}).get("column_list") or [])
        unknown = [c for c in named if columns is not None and c not in columns]
        if unknown:
            raise ConfigError(f"{where}: unknown column {unknown[0]!r}; the rows have "
                              f"{', '.join(sorted(columns))}")


def _expectation(name: str, kwargs: dict):
    _gx()
    from great_expectations.expectations.registry import get_expectation_impl

    if name == GROUP_SIZE:
        n = kwargs.get("n")
        if not isinstance(n, int) or n < 1 or set(kwargs) - {"n"}:
            raise ValueError("takes one argument, n: the rows every group must have")
        return get_expectation_impl("expect_column_values_to_be_between")(
            column="_group_size", min_value=n, max_value=n)
    return get_expectation_impl(name)(**kwargs)


def validate(frame: pd.DataFrame, expectations) -> list[Outcome]:
    """Run the expectations on the rows of `frame` (which has an `id` column)."""
    if not expectations:
        return []
    frame = frame.assign(_group_size=frame.groupby("group_id")["id"].transform("size")
                         if "group_id" in frame else 1)
    specs = [next(iter(spec.items())) for spec in expectations]
    on_frame = [(name, kwargs or {}) for name, kwargs in specs if name != CUSTOM_SQL]
    on_sql = [(name, kwargs or {}) for name, kwargs in specs if name == CUSTOM_SQL]
    outcomes = _run_pandas(frame, on_frame) if on_frame else []
    if on_sql:
        outcomes += _run_sqlite(frame, on_sql)
    return outcomes


def _context():
    gx = _gx()
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    return gx, context


def _run(gx, context, batch, specs, parameters) -> list[Outcome]:
    expectations = [_expectation(name, kwargs) for name, kwargs in specs]
    suite = context.suites.add(gx.ExpectationSuite(name="pipeline", expectations=expectations))
    definition = context.validation_definitions.add(
        gx.ValidationDefinition(name="pipeline", data=batch, suite=suite))
    result = definition.run(batch_parameters=parameters, result_format=RESULT_FORMAT)
    by_id = {r.expectation_config.id: r for r in result.results}  # not in suite order
    return [_outcome(name, kwargs, by_id[expectation.id])
            for (name, kwargs), expectation in zip(specs, suite.expectations)]


def _run_pandas(frame: pd.DataFrame, specs) -> list[Outcome]:
    gx, context = _context()
    batch = (context.data_sources.add_pandas("rows").add_dataframe_asset("rows")
             .add_batch_definition_whole_dataframe("all"))
    return _run(gx, context, batch, specs, {"dataframe": frame})


CUSTOM_SQL_TIMEOUT_S = 30.0
_READING = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION,
            getattr(sqlite3, "SQLITE_RECURSIVE", 33)}


def _try_custom_sql(path: Path, specs) -> None:
    """Run each custom query first on a connection of our own that only reads (an authorizer
    refuses anything but SELECT) and stops after CUSTOM_SQL_TIMEOUT_S (a recursive CTE could
    loop forever; great-expectations has no timeout): a query that fails here fails the
    pipeline with one line before great-expectations runs it."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        conn.set_authorizer(lambda action, *_: sqlite3.SQLITE_OK if action in _READING
                            else sqlite3.SQLITE_DENY)
        deadline = time.monotonic() + CUSTOM_SQL_TIMEOUT_S
        conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 10_000)
        for _, kwargs in specs:
            query = str(kwargs.get("unexpected_rows_query", "")).replace("{batch}", "batch")
            try:
                conn.execute(f"SELECT COUNT(*) FROM ({query}) AS checked").fetchall()
            except sqlite3.Error as exc:
                reason = "it ran longer than 30 s" if "interrupted" in str(exc) else str(exc)
                raise ConfigError(f"{CUSTOM_SQL} {query!r}: {reason}") from None
    finally:
        conn.close()


def _run_sqlite(frame: pd.DataFrame, specs) -> list[Outcome]:
    gx, context = _context()
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "batch.sqlite"
        with sqlite3.connect(path) as conn:
            _sql_safe(frame).to_sql("batch", conn, index=False)
        _try_custom_sql(path, specs)
        batch = (context.data_sources.add_sqlite("batch", connection_string=f"sqlite:///{path}")
                 .add_table_asset("batch", table_name="batch").add_batch_definition_whole_table("all"))
        return _run(gx, context, batch, specs, {})


def _sql_safe(frame: pd.DataFrame) -> pd.DataFrame:
    """Columns SQLite can hold: nested values (dicts, lists) as JSON text."""
    import json

    return frame.apply(lambda column: column.map(
        lambda v: json.dumps(v, default=str) if isinstance(v, (dict, list)) else v)
        if column.dtype == object else column)


def _outcome(name: str, kwargs: dict, result) -> Outcome:
    detail = result.result or {}
    if "unexpected_index_list" in detail:
        ids = [row["id"] if isinstance(row, dict) else row for row in detail["unexpected_index_list"]]
    elif "details" in detail:
        ids = [row.get("id") for row in detail["details"]["unexpected_rows"]]
    else:
        ids = []
    unexpected = detail.get("unexpected_count", len(ids) if "details" in detail else None)
    return Outcome(expectation=name, kwargs=jsonable(kwargs), success=bool(result.success),
                   element_count=jsonable(detail.get("element_count")),
                   unexpected_count=jsonable(unexpected),
                   failing_ids=[int(i) for i in ids if i is not None],
                   sample=jsonable((detail.get("partial_unexpected_list") or [])[:20]),
                   error=_error(result))


def _error(result) -> str | None:
    """The exception great-expectations caught (a missing column, bad SQL), if any: a broken
    check must not read as bad data."""
    info = result.exception_info or {}
    if "raised_exception" in info:
        return info.get("exception_message") if info.get("raised_exception") else None
    messages = [getattr(value, "exception_message", None) for value in info.values()]
    return "; ".join(m for m in messages if m) or None


def jsonable(value):
    """JSON-ready: numpy scalars unwrapped, NaN and infinities as None."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)
