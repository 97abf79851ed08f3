"""Who holds the locks a bounded wait ran out on, in a line an error can end with.

Reservoir's waits for a lock are bounded (lock_timeout, or a number of tries); when one runs
out, the error names the sessions holding what it waited for: their pid, login and lock mode,
and their state and transaction start where this login may see them (PostgreSQL shows those
of other logins' sessions only to superusers and pg_read_all_stats).
"""

from __future__ import annotations

from typing import Sequence

from sqlalchemy import Engine, text

HOLDERS = text("""
SELECT l.pid, coalesce(a.usename::text, '?') AS login, a.state,
       to_char(a.xact_start AT TIME ZONE 'UTC', 'HH24:MI:SS') AS since, l.mode,
       coalesce(l.relation::regclass::text, 'advisory lock ' || l.objid::text) AS what
FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.granted AND l.pid <> pg_backend_pid()
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND ((l.locktype = 'relation' AND (l.relation::regclass::text = ANY(:tables)
                                     OR (:every_table AND l.relation >= 16384)))
       OR (l.locktype = 'advisory' AND :key IS NOT NULL
           AND (l.classid::bigint << 32 | l.objid::bigint) = :key))
ORDER BY l.pid, what
""")


def holders(engine: Engine, *, tables: Sequence[str] = (), every_table: bool = False,
            advisory_key: int | None = None) -> str:
    """'held by pid 123 (reservoir_reader, idle in transaction since 12:00:01 UTC,
    AccessShareLock on experience_data)' for each session holding one of `tables` (with
    `every_table`, any table of the database's own) or the advisory lock; never raises (it
    only adds to an error)."""
    try:
        with engine.connect() as conn:
            rows = conn.execute(HOLDERS, {"tables": list(tables), "every_table": every_table,
                                          "key": advisory_key}).all()
    except Exception:
        return "who holds it could not be read"
    if not rows:
        return "no session holds it any more"
    return "held by " + "; ".join(_holder(row) for row in rows)


def _holder(row) -> str:
    seen = f", {row.state} since {row.since} UTC" if row.state and row.since else ""
    return f"pid {row.pid} ({row.login}{seen}, {row.mode} on {row.what})"
