"""Schema migrations through Alembic: upgrade, downgrade, status, first-use upgrade."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, text

import reservoir.migrations
from reservoir.errors import SchemaOutOfDate, StoreError
from reservoir.plan.urls import redact


def alembic_config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(Path(reservoir.migrations.__file__).parent))
    return config


def head_revision() -> str:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine, target: str = "head") -> None:
    """Upgrade to `target`; a database at head already is left alone (no lock is taken)."""
    if target == "head" and current_revision(engine) == head_revision():
        return
    _run(engine, command.upgrade, target)


def downgrade(engine: Engine, target: str) -> None:
    """Downgrade; at base the database holds nothing of Reservoir's (no alembic_version)."""
    _run(engine, command.downgrade, target)
    if current_revision(engine) is None:
        with engine.begin() as conn:
            conn.execute(text("DROP TABLE IF EXISTS alembic_version"))


def _run(engine: Engine, action, target: str) -> None:
    config = alembic_config()
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        action(config, target)


@dataclass(frozen=True)
class SchemaState:
    current: str | None
    head: str

    @property
    def up_to_date(self) -> bool:
        return self.current == self.head


def ensure_schema(engine: Engine, *, create: bool = True) -> str | None:
    """Upgrade an empty database (with `create`, else refuse it); refuse an older revision.

    Returns the revision an empty database was upgraded to, or None when nothing was done.
    """
    state = SchemaState(current_revision(engine), head_revision())
    if state.up_to_date:
        return None
    if state.current is None:
        if not create:
            plain = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
            raise StoreError(f"{redact(plain)} "
                             "has no Reservoir schema: `reservoir db upgrade` creates it; "
                             "nothing was changed")
        upgrade(engine)
        return state.head
    raise SchemaOutOfDate(
        f"the database schema is at revision {state.current}, this Reservoir needs {state.head}: "
        "run `reservoir db upgrade`"
    )
