"""The rows a pipeline reads (experiences or tasks): its runs and statuses, and the data
engineer's `where`.

The `where` is SQL text from a YAML file, so it is kept apart from everything else. It must be
one boolean expression (balanced parentheses, no `;`); it runs alone, through the extended
protocol (one statement), with its `:name` values bound, in a READ ONLY transaction that is
rolled back, on a connection of its own, under a statement timeout; and all it can give back
is ids. A second statement of ours, which the engineer's text never touches,
then reads the rows: only ids of the pipeline's runs in its statuses, so even a `where` that
found its way out of its parentheses could not select another run's rows or a consumed row.
Groups stay whole: a `limit` that would cut a group takes the rest of it too.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Sequence

from reservoir.store import direct, usersql

# Columns a pipeline reads: token ids and logprobs stay in the store.
FIELDS = ("id", "run_id", "task_id", "group_id", "group_row", "policy_version", "prompt_text",
          "response_text", "reward", "shaped_reward", "reward_components", "metadata", "status",
          "priority", "times_sampled", "response_len", "created_at")
ORDERABLE = ("id", "created_at", "reward", "shaped_reward", "priority", "policy_version",
             "group_id", "task_id", "response_len", "times_sampled")
SELECTABLE_STATUSES = ("raw", "ready", "quarantined")  # never leased, consumed, retired or held
TRAINABLE_STATUSES = ("ready", "consumed", "quarantined", "retired")  # a stage reading history

WHERE_IDS = """SELECT id FROM experiences
WHERE (cardinality($1::text[]) = 0 OR run_id = ANY($1::text[]::bigint[]))
AND status = ANY($2::text[])
AND (
{sql}
)"""
ROWS = "SELECT {fields} FROM experiences e WHERE {filters} ORDER BY {order}"
ROWS_OF_WHOLE_GROUPS = """WITH picked AS (
    SELECT id, group_id FROM experiences e WHERE {filters} ORDER BY {order} LIMIT $4
)
SELECT {fields} FROM experiences e
WHERE {filters} AND e.group_id IN (SELECT group_id FROM picked)
ORDER BY {order}"""
FILTERS = ("(cardinality($1::text[]) = 0 OR e.run_id = ANY($1::text[]::bigint[])) "
           "AND e.status = ANY($2::text[]) "
           "AND ($3::text[] IS NULL OR e.id = ANY($3::text[]::bigint[]))")


# A task pipeline's rows: `task_id` repeats the id (operators that read a row's task read it);
# `claimed` and `times_explored` say whether an explorer holds or has used it (a rewrite of such
# a task makes a new version).
TASK_FIELDS = ("id", "run_id", "prompt", "answer", "payload", "source", "split", "difficulty",
               "priority", "times_explored", "status", "parent_id", "metadata", "created_at")
TASK_ORDERABLE = ("id", "created_at", "difficulty", "priority", "times_explored")
TASK_WHERE_IDS = WHERE_IDS.replace("FROM experiences", "FROM tasks")
TASK_ROWS = """SELECT {fields}, t.id AS task_id,
       (t.claim_token IS NOT NULL AND t.claimed_until > now()) AS claimed
FROM tasks t
WHERE (cardinality($1::text[]) = 0 OR t.run_id = ANY($1::text[]::bigint[]))
AND t.status = ANY($2::text[])
AND ($3::text[] IS NULL OR t.id = ANY($3::text[]::bigint[]))
ORDER BY {order}"""


@dataclass(frozen=True)
class Source:
    run_ids: Sequence[int]
    statuses: Sequence[str]
    where: str | None = None
    params: dict[str, Any] | None = None
    order_by: Sequence[str] = ("created_at", "id")
    limit: int | None = None
    timeout_s: float = 60.0


def order_clause(order_by: Sequence[str], alias: str = "e",
                 orderable: Sequence[str] = ORDERABLE) -> str:
    """ORDER BY text from allow-listed column names (`-name` descending); ids break ties."""
    terms = []
    for name in order_by:
        column = name.removeprefix("-")
        if column not in orderable:
            raise ValueError(f"cannot order by {name!r}")
        terms.append(f"{alias}.{column} {'DESC' if name.startswith('-') else 'ASC'}")
    return ", ".join(terms + [f"{alias}.id ASC"])


def select_rows(url: str, source: Source, *, who: str = "a pipeline",
                allowed: Sequence[str] = SELECTABLE_STATUSES) -> list[dict[str, Any]]:
    """The source rows as dicts of FIELDS (see the module's rules); `who` reads only rows in
    the `allowed` statuses."""
    unknown = set(source.statuses) - set(allowed)
    if unknown:
        raise usersql.UserSQLError(f"source.status {sorted(unknown)}: {who} reads only "
                                   f"{', '.join(allowed)} rows")
    if source.where is not None:
        usersql.check_expression(source.where, "source.where")
    return asyncio.run(_select(url, source))


async def _select(url: str, source: Source) -> list[dict[str, Any]]:
    async with _reading(url, source) as (conn, run_ids, statuses):
        ids = await _where_ids(conn, source, WHERE_IDS, run_ids, statuses)
        limited = source.limit is not None
        sql = (ROWS_OF_WHOLE_GROUPS if limited else ROWS).format(
            filters=FILTERS, order=order_clause(source.order_by),
            fields=", ".join(f"e.{name}" for name in FIELDS))
        args = (run_ids, statuses, ids) + ((source.limit,) if limited else ())
        records = await conn.fetch(sql, *args)
    return [dict(record) for record in records]


@asynccontextmanager
async def _reading(url: str, source: Source):
    """A connection of its own in a repeatable-read, read-only transaction under the source's
    timeout; the runs' ids and the statuses as text[] (asyncpg decodes text[] itself, but looks
    up the type of every other array on each new connection, ~18 ms, and this one is new)."""
    run_ids, statuses = [str(r) for r in source.run_ids], list(source.statuses)
    async with direct.connect(url, check_schema=False) as conn:
        async with usersql.transaction(conn, timeout_s=source.timeout_s,
                                       isolation="repeatable_read"):
            yield conn, run_ids, statuses


async def _where_ids(conn, source: Source, template: str, run_ids: list[str],
                     statuses: list[str]) -> list[str] | None:
    """The ids the engineer's `where` finds (as text), None without one."""
    if source.where is None:
        return None
    try:
        found = await usersql.fetch(conn, source.where, source.params, template=template,
                                    fixed=(run_ids, statuses))
    except usersql.UserSQLError as exc:
        raise usersql.UserSQLError(f"source.where: {exc}") from None
    return [str(row[0]) for row in found.rows]


def select_tasks(url: str, source: Source) -> list[dict[str, Any]]:
    """A task pipeline's rows, as dicts of TASK_FIELDS plus task_id and claimed: the runs'
    tasks in the source's statuses (active) that its `where` finds, under the same rules as
    experiences; a limit counts tasks."""
    if set(source.statuses) - {"active"}:
        raise usersql.UserSQLError("source.status: a task pipeline reads active tasks")
    if source.where is not None:
        usersql.check_expression(source.where, "source.where")
    return asyncio.run(_select_tasks(url, source))


async def _select_tasks(url: str, source: Source) -> list[dict[str, Any]]:
    async with _reading(url, source) as (conn, run_ids, statuses):
        ids = await _where_ids(conn, source, TASK_WHERE_IDS, run_ids, statuses)
        sql = TASK_ROWS.format(fields=", ".join(f"t.{name}" for name in TASK_FIELDS),
                               order=order_clause(source.order_by, "t", TASK_ORDERABLE))
        if source.limit is not None:
            sql += f" LIMIT {int(source.limit)}"
        records = await conn.fetch(sql, run_ids, statuses, ids)
    return [dict(record) for record in records]
