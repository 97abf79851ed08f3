"""Waiting for a NOTIFY (for example a new policy version) without polling the tables."""

from __future__ import annotations

import select
import time

from sqlalchemy import Engine

from reservoir.store.retry import is_outage


class Listener:
    """LISTEN on one channel over a connection of its own; `wait` returns on a notification
    or after the timeout, whichever is first, so callers can also poll.

    A notification is only a hint to look at the tables again: any login may NOTIFY (the
    reader too), so callers read what changed from the store, never from the payload, and a
    burst of notifications wakes them at most once every MIN_INTERVAL_S. A connection lost to
    a server restart is opened again on the next wait."""

    MIN_INTERVAL_S = 0.05

    def __init__(self, engine: Engine, channel: str) -> None:
        self._engine, self._channel = engine, channel
        self._conn = None
        self._last = 0.0
        self._connect()

    def _connect(self) -> None:
        self._conn = self._engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        self._conn.exec_driver_sql(f'LISTEN "{self._channel}"')  # a constant of ours
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
