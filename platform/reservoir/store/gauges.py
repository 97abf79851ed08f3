"""What a metrics scrape reads: one statement, as the reader, bounded in time.

`read_gauges` logs in as reservoir_reader (or store.reader_url), sets a statement timeout and
reads the gauge views (analytics.run_gauges, pipeline_gauges, schedule_gauges) and the
database's size and connections as one JSON document. Every part answers from an index, and
the runs read are bounded (the running ones and those changed in the last hour, newest first,
at most `runs`). Connecting, the statement and the whole read each stop after `timeout_s`: a
scrape never hangs on a slow or unreachable server.
"""

from __future__ import annotations

import asyncio
from typing import Any

from reservoir.plan import urls
from reservoir.store import direct, usersql

GAUGES = """
SELECT json_build_object(
  'runs', (SELECT coalesce(json_agg(g), '[]') FROM (
             SELECT * FROM analytics.run_gauges
             WHERE status = 'running' OR updated_at > now() - interval '1 hour'
             ORDER BY updated_at DESC LIMIT $1) g),
  'pipelines', (SELECT coalesce(json_agg(p), '[]') FROM analytics.pipeline_gauges p),
  'schedules', (SELECT coalesce(json_agg(s), '[]') FROM analytics.schedule_gauges s),
  'database', json_build_object(
    'size_bytes', pg_database_size(current_database()),
    'connections', (SELECT coalesce(json_object_agg(state, n), '{}') FROM (
                      SELECT coalesce(state, 'unknown') AS state, count(*) AS n
                      FROM pg_stat_activity WHERE datname = current_database()
                      GROUP BY 1) c)))
"""


def read_gauges(url: str, *, reader_url: str | None = None, timeout_s: float = 5.0,
                runs: int = 50) -> dict[str, Any]:
    """The gauges as {runs, pipelines, schedules, database}; StoreError when the login fails,
    UserSQLError when the statement fails or times out, TimeoutError past 2 * timeout_s."""
    target = urls.reader_url(url, reader_url)
    return asyncio.run(asyncio.wait_for(_read(target, timeout_s, runs), 2 * timeout_s))


async def _read(url: str, timeout_s: float, runs: int) -> dict[str, Any]:
    import asyncpg

    async with direct.connect(url, timeout_s=timeout_s) as conn:
        async with usersql.transaction(conn, timeout_s=timeout_s):
            try:
                return await conn.fetchval(GAUGES, runs)
            except asyncpg.QueryCanceledError:
                raise TimeoutError(f"the gauges took longer than {timeout_s:g} s") from None
