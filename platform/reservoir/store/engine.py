"""Connections: one URL, two drivers.

psycopg2 (through SQLAlchemy) for general access, inspection and Alembic; asyncpg (through
SQLAlchemy's async engine, raw connection for COPY) for the hot path: writing groups and leasing
batches.
"""

from __future__ import annotations

from sqlalchemy import Engine, create_engine
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from reservoir.config import StoreConfig
from reservoir.errors import StoreError
from reservoir.store import server


def resolve_url(config: StoreConfig) -> str:
    """The configured server URL, or the embedded server's (started if needed)."""
    return config.resolved_url() or server.start(config.data_dir)


def _with_driver(url: str, driver: str) -> URL:
    try:
        parsed = make_url(url)
    except Exception as exc:
        raise StoreError(f"store.url {redact(url)!r} is not a database URL: {exc}") from None
    if parsed.get_backend_name() != "postgresql":
        raise StoreError(f"store.url {redact(url)!r}: Reservoir needs PostgreSQL")
    return parsed.set(drivername=f"postgresql+{driver}")


def redact(url: str) -> str:
    """The URL with its password hidden: safe to log or print."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "<unparseable url>"


def sync_engine(url: str, **kwargs) -> Engine:
    return create_engine(_with_driver(url, "psycopg2"), pool_pre_ping=True, **kwargs)


def async_engine(url: str, **kwargs) -> AsyncEngine:
    parsed = _with_driver(url, "asyncpg")
    socket_dir, port = parsed.query.get("host"), parsed.query.get("port")
    if socket_dir:  # asyncpg takes a Unix socket directory as host, not as a query option
        parsed = parsed.difference_update_query(["host"]).set(host=socket_dir)
    if port:
        parsed = parsed.difference_update_query(["port"]).set(port=int(port))
    return create_async_engine(parsed, pool_pre_ping=True, **kwargs)
