"""Looking after a store rather than using it (`reservoir db`): the embedded server, the schema's
revision, the passwords of Reservoir's logins.

SQLAlchemy and Alembic are imported by the schema functions alone, so a quick command that only
needs the embedded server's URL (`reservoir sql`) does not load them.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from reservoir.errors import StoreError
from reservoir.plan import urls
from reservoir.store import roles, server

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from reservoir.config import StoreConfig


def start_server(data_dir: Path) -> str:
    """Start (or attach to) the embedded server in `data_dir`; the owner's URL of its database."""
    return server.start(data_dir)


def stop_server(data_dir: Path) -> bool:
    """Stop the embedded server in `data_dir`; True when it was running."""
    return server.stop(data_dir)


@dataclass(frozen=True)
class Revisions:
    """Where a store is and its schema's revisions around a command (None: an empty database,
    or one downgraded to base)."""

    url: str  # holds the login's password: redact it before showing
    before: str | None
    after: str | None
    head: str  # the revision this code expects


@contextmanager
def _engine(config: StoreConfig) -> Iterator[tuple[str, Engine]]:
    """The configured store's URL and an engine on it (the embedded server started if needed)."""
    from reservoir.store import engine as engines

    url = engines.resolve_url(config)
    engine = engines.sync_engine(url)
    try:
        yield url, engine
    finally:
        engine.dispose()


def upgrade_schema(config: StoreConfig, revision: str = "head") -> Revisions:
    """Upgrade the store's schema to `revision` (at it already: nothing is done)."""
    from reservoir.store import migrate

    with _engine(config) as (url, engine):
        before = migrate.current_revision(engine)
        migrate.upgrade(engine, revision)
        return Revisions(url, before, migrate.current_revision(engine), migrate.head_revision())


def downgrade_schema(config: StoreConfig, revision: str) -> Revisions:
    """Downgrade the store's schema to `revision` (base: nothing of Reservoir's is left)."""
    from reservoir.store import migrate

    with _engine(config) as (url, engine):
        before = migrate.current_revision(engine)
        migrate.downgrade(engine, revision)
        return Revisions(url, before, migrate.current_revision(engine), migrate.head_revision())


def schema_status(config: StoreConfig) -> Revisions:
    """The store's revision and the one this code expects; changes nothing."""
    from reservoir.store import migrate

    with _engine(config) as (url, engine):
        current = migrate.current_revision(engine)
        return Revisions(url, current, current, migrate.head_revision())


def set_login_password(config: StoreConfig, role: str, password: str) -> None:
    """Set `role`'s password (owner or reader) as the superuser of the configured URL, or of
    the embedded server (started if needed); StoreError when that login is no superuser."""
    url = config.resolved_url()
    if url is None:
        server.start(config.data_dir)
        url = server.admin_url(config.data_dir)
    conn = roles.connect(url)
    try:
        if not roles.is_superuser(conn):
            raise StoreError(f"{urls.redact(url)} logs in as {urls.user_of(url)}, no "
                             f"superuser: only a superuser sets {role}'s password (run "
                             "this with RESERVOIR_DB_URL set to a superuser's URL)")
        roles.set_password(conn, role, password)
    finally:
        conn.close()
