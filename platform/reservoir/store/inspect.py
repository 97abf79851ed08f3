"""What a person reads: ad-hoc SQL (read-only unless asked), a run's summary, one row's lineage.

Everything here runs on a connection of its own through `usersql` (one statement, bound
values, a READ ONLY transaction that is rolled back). People read as themselves: logged in as
reservoir_reader (or store.reader_url), never as the login the workers use; only `write`
runs as the store's owner. It imports no SQLAlchemy, so it answers quickly.
"""

from __future__ import annotations

import asyncio
from typing import Any

from reservoir.errors import StoreError
from reservoir.plan import urls
from reservoir.store import direct, usersql
from reservoir.store.usersql import Result


def run_sql(url: str, sql: str, *, params: dict[str, Any] | None = None, write: bool = False,
            reader_url: str | None = None, timeout_s: float = usersql.DEFAULT_TIMEOUT_S,
            max_rows: int | None = None, sink: usersql.Sink | None = None) -> Result:
    """Run one statement: read-only as the reader, or with `write` as the store's owner; rows
    past `max_rows` are counted, not kept, or stream to `sink` (usersql.fetch)."""
    from reservoir.store import roles

    target = roles.working_url(url) if write else urls.reader_url(url, reader_url)
    return asyncio.run(_queries(target, [(sql, params or {})], write=write, timeout_s=timeout_s,
                                max_rows=max_rows, sink=sink))[0]


async def _queries(url: str, statements: list[tuple[str, dict]], *, write: bool = False,
                   timeout_s: float = usersql.DEFAULT_TIMEOUT_S, **streaming) -> list[Result]:
    async with direct.connect(url) as conn:
        return [await usersql.run(conn, sql, values, write=write, timeout_s=timeout_s,
                                  **streaming) for sql, values in statements]


RUN_SUMMARY = "SELECT * FROM analytics.runs WHERE run = :run"
RECENT_STEPS = """
SELECT step, trainer_version, n_experiences, round(reward_mean::numeric, 4) AS reward_mean,
       round(response_len_mean::numeric, 1) AS response_len_mean, staleness_max,
       round(loss::numeric, 4) AS loss, round(eval_accuracy::numeric, 3) AS eval_accuracy,
       created_at
FROM (SELECT * FROM analytics.run_steps WHERE run = :run ORDER BY step DESC LIMIT :n) recent
ORDER BY step"""
EXPERIENCE = "SELECT * FROM analytics.experiences WHERE experience_id = :id"
LINEAGE = """
SELECT run, task_id, left(task_prompt, 40) AS task_prompt, policy_version, step,
       trainer_version, weight, trained_at, published_version, published_location
FROM analytics.lineage WHERE experience_id = :id ORDER BY step NULLS FIRST"""


# What `reservoir demo store` runs and shows a newcomer, as they would type it.
DEMO_RUNS = ("SELECT run, ready, leased, consumed, last_step, latest_version "
             "FROM analytics.runs WHERE run = :run")
DEMO_STEPS = ("SELECT step, n_experiences, round(reward_mean::numeric, 3) AS reward_mean, "
              "response_len_mean FROM analytics.run_steps WHERE run = :run ORDER BY step")
DEMO_TRAINED = ("SELECT min(experience_id) FROM analytics.lineage WHERE run = :run "
                "AND step IS NOT NULL")


def run_summary(url: str, run: str, *, last_steps: int = 10, reader_url: str | None = None,
                timeout_s: float = usersql.DEFAULT_TIMEOUT_S) -> tuple[Result, Result]:
    summary, steps = asyncio.run(_queries(urls.reader_url(url, reader_url), [(RUN_SUMMARY, {"run": run}),
                                                (RECENT_STEPS, {"run": run, "n": last_steps})],
                                          timeout_s=timeout_s))
    if not summary.rows:
        raise StoreError(f"run {run!r} does not exist (`reservoir sql \"SELECT run FROM "
                         "analytics.runs\"` lists them)")
    return summary, steps


def experience_detail(url: str, experience_id: int, *, reader_url: str | None = None,
                      timeout_s: float = usersql.DEFAULT_TIMEOUT_S) -> tuple[Result, Result]:
    row, lineage = asyncio.run(_queries(urls.reader_url(url, reader_url), [(EXPERIENCE, {"id": experience_id}),
                                              (LINEAGE, {"id": experience_id})],
                                        timeout_s=timeout_s))
    if not row.rows:
        raise StoreError(f"experience {experience_id} does not exist")
    return row, lineage
