"""Connections: one URL, two drivers.

psycopg2 (through SQLAlchemy) for general access, inspection and Alembic; asyncpg (through
SQLAlchemy's async engine, raw connection for COPY) for the hot path: writing groups and leasing
batches.
"""

from __future__ import annotations

import select

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DisconnectionError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from reservoir.config import StoreConfig
from reservoir.errors import StoreError
from reservoir.plan import urls
from reservoir.store import roles, server


def resolve_url(config: StoreConfig) -> str:
    """The URL Reservoir works as: the embedded server's owner (started if needed), or the
    configured server's login (its owner's when that login is a superuser, see
    `roles.working_url`)."""
    configured = config.resolved_url()
    return roles.working_url(configured) if configured else server.start(config.data_dir)


def _with_driver(url: str, driver: str) -> URL:
    try:
        parsed = make_url(urls.canonical(url))
    except (urls.UrlError, ArgumentError) as exc:
        raise StoreError(f"store.url {urls.redact(url)}: {exc}") from None
    return parsed.set(drivername=f"postgresql+{driver}")


def sync_engine(url: str, **kwargs) -> Engine:
    engine = create_engine(_with_driver(url, "psycopg2"), **kwargs)
    event.listen(engine.pool, "checkout", _replace_if_ended)
    return engine


def _replace_if_ended(dbapi_connection, connection_record, connection_proxy) -> None:
    """Pool checkout: a psycopg2 connection the server ended while it sat idle (a restart, an
    idle timeout) is replaced by a new one. An idle connection has nothing to read unless the
    server wrote to it (its FATAL notice, then the end of the stream; or a notification it
    listened for): a poll of its socket, where pool_pre_ping cost a round trip a checkout."""
    if dbapi_connection.closed or select.select([dbapi_connection], [], [], 0)[0]:
        raise DisconnectionError("the server ended this pooled connection (or wrote to it)")


# asyncpg prepares every statement. At a statement's sixth execution PostgreSQL plans it once
# generically to compare with the plans for its parameters, and a generic plan locks every
# partition of the tables it names: 1,438 locks for one lease on a store of 51 runs (38
# otherwise), enough on a store of hundreds of runs to run out of the server's lock table. The
# plans for the parameters won anyway (they prune the other runs' partitions), so each
# execution is planned for its parameters: the same plans, without the spike.
HOT_PATH_SETTINGS = {"plan_cache_mode": "force_custom_plan"}
# A statement that inserts many rows checks one foreign key a row after it ran, each with the
# key's own prepared plan (every key names a plain table: a run's partition, runs, train_steps).
# Under force_custom_plan each of those checks was planned again: 13 ms of a 512-row write and
# 5 ms of a 256-row step commit here. A transaction that inserts many rows evaluates this once
# the statements that read partitioned tables are planned: the checks after it keep their plans
# (so does the rest of the transaction; the setting ends with it).
REUSE_PLANS = "set_config('plan_cache_mode', 'auto', true)"


# The lease and the step commit write their runs' ids into their SQL (store/prepared.py), so a
# generic plan of theirs prunes to those runs' partitions when it is planned, and locks only
# them. They run on an engine of their own whose connections plan each statement once and reuse
# the plan: planning a 256-row lease for its parameters took 0.7-1.6 ms a call.
KEPT_PLANS_SETTINGS = {"plan_cache_mode": "force_generic_plan"}


def async_engine(url: str, *, kept_plans: bool = False, **kwargs) -> AsyncEngine:
    """The async engine, planning each execution (HOT_PATH_SETTINGS) or, with `kept_plans`,
    reusing one plan a statement (only for statements whose run filters are in their SQL)."""
    parsed = _with_driver(url, "asyncpg")
    socket_dir, port = parsed.query.get("host"), parsed.query.get("port")
    if socket_dir:  # asyncpg takes a Unix socket directory as host, not as a query option
        parsed = parsed.difference_update_query(["host"]).set(host=socket_dir)
    if port:
        parsed = parsed.difference_update_query(["port"]).set(port=int(port))
    settings = KEPT_PLANS_SETTINGS if kept_plans else HOT_PATH_SETTINGS
    engine = create_async_engine(parsed, connect_args={"server_settings": settings}, **kwargs)
    event.listen(engine.sync_engine.pool, "checkout", _replace_if_closed)
    return engine


def _replace_if_closed(dbapi_connection, connection_record, connection_proxy) -> None:
    """Pool checkout: a connection the server ended while it sat idle (a restart, an idle
    timeout) is replaced by a new one. asyncpg saw its socket close, so the check is local:
    pool_pre_ping costs three round trips a checkout (BEGIN, ';', ROLLBACK), 1.3-1.6 ms of a
    lease + commit of 256 rows here."""
    if dbapi_connection.driver_connection.is_closed():
        raise DisconnectionError("the server closed this pooled connection")
