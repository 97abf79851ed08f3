"""Waiting for a NOTIFY (for example a new policy version) without polling the tables."""

from __future__ import annotations

import select

from sqlalchemy import Engine


class Listener:
    """LISTEN on one channel over a connection of its own; `wait` returns on a notification
    or after the timeout, whichever is first, so callers can also poll."""

    def __init__(self, engine: Engine, channel: str) -> None:
        self._conn = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        self._conn.exec_driver_sql(f'LISTEN "{channel}"')  # a constant of ours, not user input
        self._dbapi = self._conn.connection.dbapi_connection

    def wait(self, timeout: float) -> list[str]:
        """Payloads received, [] after a timeout."""
        if not self._dbapi.notifies:
            select.select([self._dbapi], [], [], timeout)
            self._dbapi.poll()
        payloads = [notice.payload for notice in self._dbapi.notifies]
        self._dbapi.notifies.clear()
        return payloads

    def close(self) -> None:
        self._conn.exec_driver_sql("UNLISTEN *")
        self._conn.close()

    def __enter__(self) -> "Listener":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
