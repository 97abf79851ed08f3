"""Waiting for a NOTIFY (a new policy version, rows written or made ready, rows sampled)
without polling the tables.

Channels: `reservoir_policy` (a published version) and one per run, `reservoir_rows_<run id>`,
on which the writer, pipelines and the ledger say that the run's rows changed (written,
made ready, leased, consumed or handed back). Waiters keep their poll as a fallback: a
notification only cuts the wait short.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import time
from typing import Sequence

from sqlalchemy import Engine, bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.types import BigInteger

from reservoir.store.retry import is_outage


ROWS_CHANNEL = "reservoir_rows_"  # + the run id; SQL that notifies builds the same name


def rows_channel(run_id: int) -> str:
    return f"{ROWS_CHANNEL}{int(run_id)}"


# Statement: tell each run's channel that its rows changed (delivered when the transaction
# commits; nothing if it rolls back).
NOTIFY_ROWS = text(f"""
SELECT count(pg_notify(concat('{ROWS_CHANNEL}', run_id), CAST(:what AS text)))
FROM unnest(:run_ids) AS run_id
""").bindparams(bindparam("run_ids", type_=ARRAY(BigInteger)))


class AsyncWake:
    """`async with AsyncWake(engine, channels) as wake: await wake.wait(timeout)`: returns on
    a notification on any of the channels or after the timeout. If the connection cannot
    listen (the server is out), waits are plain sleeps."""

    def __init__(self, engine: AsyncEngine, channels: Sequence[str]) -> None:
        self._engine, self._channels = engine, list(channels)
        self._event = asyncio.Event()
        self._conn = self._raw = None

    def _notified(self, *_) -> None:
        self._event.set()

    async def __aenter__(self) -> "AsyncWake":
        with contextlib.suppress(Exception):
            self._conn = await self._engine.connect()
            self._raw = (await self._conn.get_raw_connection()).driver_connection
            for channel in self._channels:
                await self._raw.add_listener(channel, self._notified)
        return self

    async def wait(self, timeout: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._event.wait(), timeout)
        self._event.clear()

    async def __aexit__(self, *exc) -> None:
        if self._conn is None:
            return
        with contextlib.suppress(Exception):
            for channel in self._channels:
                await self._raw.remove_listener(channel, self._notified)
        with contextlib.suppress(Exception):
            await self._conn.close()


class Listener:
    """LISTEN on channels over a connection of its own; `wait` returns on a notification
    or after the timeout, whichever is first, so callers can also poll.

    A notification is only a hint to look at the tables again: any login may NOTIFY (the
    reader too), so callers read what changed from the store, never from the payload, and a
    burst of notifications wakes them at most once every MIN_INTERVAL_S. A connection lost to
    a server restart is opened again on the next wait."""

    MIN_INTERVAL_S = 0.05

    def __init__(self, engine: Engine, *channels: str) -> None:
        self._engine, self._channels = engine, channels
        self._conn = None
        self._last = 0.0
        self._connect()

    def _connect(self) -> None:
        self._conn = self._engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        for channel in self._channels:  # names of ours, never a user's
            self._conn.exec_driver_sql(f'LISTEN "{channel}"')
        self._dbapi = self._conn.connection.dbapi_connection

    def wait(self, timeout: float) -> list[str]:
        """Payloads received, [] after a timeout (or while the server is out)."""
        time.sleep(max(0.0, self._last + self.MIN_INTERVAL_S - time.monotonic()))
        try:
            if self._conn is None:
                self._connect()
            if not self._dbapi.notifies:
                select.select([self._dbapi], [], [], timeout)
                self._dbapi.poll()
        except Exception as exc:
            if not is_outage(exc):
                raise
            self._drop()
            time.sleep(timeout)
            return []
        self._last = time.monotonic()
        payloads = [notice.payload for notice in self._dbapi.notifies]
        self._dbapi.notifies.clear()
        return payloads

    def _drop(self) -> None:
        if self._conn is not None:
            try:
                self._conn.invalidate()
                self._conn.close()
            except Exception:  # already gone with the server
                pass
        self._conn = None

    def close(self) -> None:
        try:
            if self._conn is not None:
                self._conn.exec_driver_sql("UNLISTEN *")
        except Exception as exc:
            if not is_outage(exc):
                raise
        self._drop()

    def __enter__(self) -> "Listener":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
