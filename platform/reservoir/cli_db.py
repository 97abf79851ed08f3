"""`reservoir db`: the store's schema, the embedded server, and the reader's password."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from reservoir.cli_common import ConfigOption, _config, console
from reservoir.errors import ReservoirError

db_app = typer.Typer(help="The experience store's database: schema, embedded server, reader.",
                     no_args_is_help=True)


def _engine(config: Optional[Path]):
    """(url, psycopg2 engine) of the configured store, the embedded server started if needed."""
    from reservoir.store import engine as engines

    url = engines.resolve_url(_config(config).store)
    return url, engines.sync_engine(url)


@db_app.command("upgrade")
def db_upgrade(config: Optional[Path] = ConfigOption,
               revision: str = typer.Argument("head", help="Target revision.")) -> None:
    """Upgrade the schema (idempotent)."""
    from reservoir.store import migrate
    from reservoir.store.urls import redact

    url, engine = _engine(config)
    before = migrate.current_revision(engine)
    migrate.upgrade(engine, revision)
    after = migrate.current_revision(engine)
    change = "already at" if before == after else f"upgraded from {before or 'empty'} to"
    console.print(f"{redact(url)}: {change} revision {after}", highlight=False)


@db_app.command("downgrade")
def db_downgrade(revision: str = typer.Argument(..., help="Target revision, e.g. -1, 0001 or "
                                                          "base (removes everything)."),
                 config: Optional[Path] = ConfigOption) -> None:
    """Downgrade the schema (drops what later revisions added)."""
    from reservoir.store import migrate
    from reservoir.store.urls import redact

    url, engine = _engine(config)
    migrate.downgrade(engine, revision)
    console.print(f"{redact(url)}: now at revision {migrate.current_revision(engine) or 'base'}",
                  highlight=False)


@db_app.command("status")
def db_status(config: Optional[Path] = ConfigOption) -> None:
    """Where the store is, and whether its schema is current."""
    from reservoir.store import migrate
    from reservoir.store.urls import redact

    cfg = _config(config)
    url, engine = _engine(config)
    current, head = migrate.current_revision(engine), migrate.head_revision()
    table = Table(show_header=False)
    table.add_row("url", redact(url))
    embedded = cfg.store.resolved_url() is None
    table.add_row("server", f"embedded ({cfg.store.data_dir})" if embedded else "configured URL")
    table.add_row("revision", f"{current or 'empty'} (code expects {head})")
    table.add_row("schema", "up to date" if current == head else "run `reservoir db upgrade`")
    console.print(table)


@db_app.command("url")
def db_url(config: Optional[Path] = ConfigOption,
           show_password: bool = typer.Option(False, help="Print the password too.")) -> None:
    """Print the store's URL (starting the embedded server if needed)."""
    from reservoir.cli_common import target
    from reservoir.store.urls import redact

    url = target(config).url
    print(url if show_password else redact(url))


@db_app.command("start")
def db_start(config: Optional[Path] = ConfigOption) -> None:
    """Start the embedded server (a no-op when it runs)."""
    from reservoir.store import server

    cfg = _config(config)
    if cfg.store.resolved_url():
        raise ReservoirError("a server URL is configured: there is no embedded server to start")
    console.print(f"embedded PostgreSQL running: {server.start(cfg.store.data_dir)}",
                  highlight=False)


@db_app.command("stop")
def db_stop(config: Optional[Path] = ConfigOption) -> None:
    """Stop the embedded server."""
    from reservoir.store import server

    data_dir = _config(config).store.data_dir
    stopped = server.stop(data_dir)
    console.print(f"embedded PostgreSQL in {data_dir} "
                  + ("stopped" if stopped else "was not running"), highlight=False)


@db_app.command("reader-password")
def db_reader_password(
        from_env: str = typer.Option("RESERVOIR_READER_PASSWORD", help="Environment variable "
                                     "holding the new password (it is never printed or stored)."),
        config: Optional[Path] = ConfigOption) -> None:
    """Set the reservoir_reader login's password (sent as a SCRAM verifier, not in clear)."""
    from reservoir.store.roles import set_reader_password

    password = os.environ.get(from_env)
    if not password:
        raise ReservoirError(f"--from-env {from_env}: the variable is unset or empty; put the "
                             "password there (e.g. read -s)")
    _, engine = _engine(config)
    set_reader_password(engine, password)
    console.print("reservoir_reader's password is set (readers set RESERVOIR_READER_PASSWORD)",
                  highlight=False)
