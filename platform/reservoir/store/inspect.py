"""What a person reads: ad-hoc SQL (read-only by default), a run's summary, one row's lineage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, text
from sqlalchemy.exc import DBAPIError

from reservoir.errors import StoreError

READER_ROLE = "reservoir_reader"


@dataclass(frozen=True)
class QueryResult:
    columns: list[str]
    rows: list[tuple[Any, ...]]
    rowcount: int


def run_sql(engine: Engine, sql: str, *, params: dict[str, Any] | None = None,
            write: bool = False, as_reader: bool = False) -> QueryResult:
    """Run one statement; read-only unless `write`, as reservoir_reader when `as_reader`.

    Values go in as bind parameters (`:name` in the SQL), never into the SQL text.
    """
    options = {} if write else {"postgresql_readonly": True}
    try:
        with engine.connect().execution_options(**options) as conn, conn.begin():
            if as_reader:
                conn.execute(text(f"SET LOCAL ROLE {READER_ROLE}"))
            result = conn.execute(text(sql), params or {})
            if not result.returns_rows:
                return QueryResult([], [], result.rowcount)
            rows = [tuple(row) for row in result.all()]
            return QueryResult(list(result.keys()), rows, len(rows))
    except DBAPIError as exc:
        raise StoreError(f"SQL failed: {str(exc.orig).strip()}") from None


def run_summary(engine: Engine, run: str, *, last_steps: int = 10) -> tuple[QueryResult, QueryResult]:
    summary = run_sql(engine, "SELECT * FROM analytics.runs WHERE run = :run", params={"run": run})
    if not summary.rows:
        raise StoreError(f"run {run!r} does not exist")
    steps = run_sql(
        engine,
        "SELECT step, policy_version, n_experiences, round(reward_mean::numeric, 4) AS reward_mean,"
        " round(response_len_mean::numeric, 1) AS response_len_mean, staleness_max, loss, created_at"
        " FROM (SELECT * FROM analytics.run_steps WHERE run = :run"
        " ORDER BY step DESC LIMIT :n) recent ORDER BY step",
        params={"run": run, "n": last_steps})
    return summary, steps


def experience_detail(engine: Engine, experience_id: int) -> tuple[QueryResult, QueryResult]:
    row = run_sql(engine, "SELECT * FROM analytics.experiences WHERE id = :id",
                  params={"id": experience_id})
    if not row.rows:
        raise StoreError(f"experience {experience_id} does not exist")
    lineage = run_sql(
        engine,
        "SELECT run, task_id, left(task_prompt, 40) AS task_prompt, generated_by_version,"
        " train_step, trained_version, train_weight, trained_at, published_version,"
        " published_location FROM analytics.lineage WHERE experience_id = :id"
        " ORDER BY train_step NULLS FIRST",
        params={"id": experience_id})
    return row, lineage
