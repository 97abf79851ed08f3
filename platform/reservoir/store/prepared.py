"""Statements the hot path runs on asyncpg itself, compiled once.

A lease returns 256 rows of 15 columns and a step commit binds arrays of 256 ids. Through
SQLAlchemy's execution (compiling the statement's parameters per call, bind processors over
every array element, a Row object per result row) a lease + commit of 256 rows cost the client
~2 ms more than asyncpg alone (bench/store.py). A `Prepared` is a Core or text statement
compiled once for the asyncpg dialect, to asyncpg's `$n` SQL and the order its parameters bind
in. It runs on the asyncpg connection under a pooled SQLAlchemy connection, so pooling, the
checkout check and the server settings stay the engine's, and inside the transaction that
connection began if it began one (else the statement commits alone); a connection that dies
under it is taken out of the pool. asyncpg prepares it once
per connection. Values go to asyncpg as they are: JSON as its text.
"""

from __future__ import annotations

from typing import Any

import asyncpg
from sqlalchemy.dialects.postgresql.asyncpg import dialect as asyncpg_dialect
from sqlalchemy.ext.asyncio import AsyncConnection

from reservoir.store import retry

_DIALECT = asyncpg_dialect()


class Prepared:
    def __init__(self, statement) -> None:
        compiled = statement.compile(dialect=_DIALECT)
        if compiled.post_compile_params:
            raise ValueError(f"a hot-path statement binds no IN list "
                             f"({sorted(p.key for p in compiled.post_compile_params)})")
        self.sql: str = compiled.string
        self._names: list[str] = list(compiled.positiontup)
        # values the statement carries itself (`.values(status="leased")`, a limit)
        self._own = {name: bind.effective_value for name, bind in compiled.binds.items()
                     if not bind.required}

    def args(self, params: dict[str, Any]) -> list[Any]:
        try:
            return [params[name] if name in params else self._own[name]
                    for name in self._names]
        except KeyError as exc:
            raise ValueError(f"no value for the statement's parameter {exc.args[0]!r}") from None

    async def fetch(self, conn: AsyncConnection, params: dict[str, Any]) -> list[asyncpg.Record]:
        args = self.args(params)
        driver = (await conn.get_raw_connection()).driver_connection
        try:
            return await driver.fetch(self.sql, *args)
        except BaseException as exc:
            # SQLAlchemy did not run it, so it cannot tell a dead connection from an error:
            # one cut off or interrupted mid-statement leaves the pool (an error the server
            # reported leaves the connection as it was)
            if not isinstance(exc, asyncpg.PostgresError) or retry.is_outage(exc):
                await conn.invalidate(exc if isinstance(exc, Exception) else None)
            raise
