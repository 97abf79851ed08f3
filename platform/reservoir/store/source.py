"""The rows a pipeline reads: its runs and statuses, and the data engineer's `where`.

The `where` is SQL text from a YAML file, so it is kept apart from everything else. It must be
one boolean expression (balanced parentheses, no `;`); it runs alone, through the extended
protocol (one statement), with its `:name` values bound, in a READ ONLY transaction that is
rolled back, on a connection of its own, under a statement timeout; and all it can give back
is experience ids. A second statement of ours, which the engineer's text never touches,
then reads the rows: only ids of the pipeline's runs in its statuses, so even a `where` that
found its way out of its parentheses could not select another run's rows or a consumed row.
Groups stay whole: a `limit` that would cut a group takes the rest of it too.
"""

from __future__ import annotations

import asyncio
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


@dataclass(frozen=True)
class Source:
    run_ids: Sequence[int]
    statuses: Sequence[str]
    where: str | None = None
    params: dict[str, Any] | None = None
    order_by: Sequence[str] = ("created_at", "id")
    limit: int | None = None
    timeout_s: float = 60.0


def order_clause(order_by: Sequence[str]) -> str:
    """ORDER BY text from allow-listed column names (`-name` descending); ids break ties."""
    terms = []
    for name in order_by:
        column = name.removeprefix("-")
        if column not in ORDERABLE:
            raise ValueError(f"cannot order by {name!r}")
        terms.append(f"e.{column} {'DESC' if name.startswith('-') else 'ASC'}")
    return ", ".join(terms + ["e.id ASC"])


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
    # Ids travel as text[]: asyncpg decodes text[] itself, but looks up the type of every
    # other array on each new connection (~18 ms), and a pipeline's connection is new.
    run_ids, statuses = [str(r) for r in source.run_ids], list(source.statuses)
    async with direct.connect(url, check_schema=False) as conn:
        async with usersql.transaction(conn, timeout_s=source.timeout_s,
                                       isolation="repeatable_read"):
            ids = None
            if source.where is not None:
                try:
                    found = await usersql.fetch(conn, source.where, source.params,
                                                template=WHERE_IDS, fixed=(run_ids, statuses))
                except usersql.UserSQLError as exc:
                    raise usersql.UserSQLError(f"source.where: {exc}") from None
                ids = [str(row[0]) for row in found.rows]
            limited = source.limit is not None
            sql = (ROWS_OF_WHOLE_GROUPS if limited else ROWS).format(
                filters=FILTERS, order=order_clause(source.order_by),
                fields=", ".join(f"e.{name}" for name in FIELDS))
            args = (run_ids, statuses, ids) + ((source.limit,) if limited else ())
            records = await conn.fetch(sql, *args)
    return [dict(record) for record in records]
