"""Connections of their own (asyncpg, nothing pooled) for SQL a person wrote.

User SQL never shares a session with the store's own work: whatever it leaves in its session
(an advisory lock, a setting) goes when the connection closes. The reader logs in as itself.
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from typing import AsyncIterator

from reservoir.errors import StoreError
from reservoir.plan import urls
from reservoir.store.usersql import describe

SCHEMA_PRESENT = ("SELECT to_regclass('public.alembic_version') IS NOT NULL "
                  "AND to_regclass('public.experiences') IS NOT NULL")


@asynccontextmanager
async def connect(url: str, *, check_schema: bool = True,
                  timeout_s: float = 10.0) -> AsyncIterator:
    """An asyncpg connection to `url` (json and jsonb decoded), closed afterwards (without
    waiting for the server's end of it when idle).

    StoreError in one line when the server cannot be reached or refuses the login, or (with
    check_schema) when the database holds no Reservoir schema."""
    import asyncpg

    try:
        conn = await asyncpg.connect(url, timeout=timeout_s)
    except Exception as exc:  # refused, unknown host or role, bad URL option: one line
        user = urls.user_of(url)
        hint = ""
        if user == urls.READER_ROLE:
            hint = (f" (the reader logs in as itself: set {urls.READER_PASSWORD_ENV} or "
                    f"{urls.READER_URL_ENV}; `reservoir db password reader` sets its password)")
        raise StoreError(f"cannot connect to {urls.redact(url)} as {user or 'the default user'}:"
                         f" {urls.redact_text(describe(exc))}{hint}") from None
    try:
        for name in ("json", "jsonb"):
            await conn.set_type_codec(name, schema="pg_catalog", encoder=_json_text,
                                      decoder=json.loads, format="text")
        if check_schema and not await conn.fetchval(SCHEMA_PRESENT):
            raise StoreError(f"{urls.redact(url)} has no Reservoir schema (no alembic_version "
                             "or experiences table): `reservoir db upgrade` creates it; nothing "
                             "was run or changed")
        yield conn
    finally:
        if conn.is_in_transaction():
            await conn.close()
        else:  # idle: the server ends the session at the socket's end as at a goodbye, and
            conn.terminate()  # close() waits 4-7 ms for that (a stream pass reads in ~20 ms)


def _json_text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, allow_nan=False)
