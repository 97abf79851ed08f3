"""`reservoir db`: the store's schema, the embedded server, and its logins' passwords."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from reservoir.cli_common import ConfigOption, _config, console
from reservoir.errors import ReservoirError

db_app = typer.Typer(help="The experience store's database: schema, embedded server, logins.",
                     no_args_is_help=True)


def _stores(path: Optional[Path]) -> list:
    """The store section, or one for each server of store.urls (the first first)."""
    from reservoir.servers import every_server

    return [config.store for _, config in every_server(_config(path))]


@db_app.command("upgrade")
def db_upgrade(config: Optional[Path] = ConfigOption,
               revision: str = typer.Argument("head", help="Target revision.")) -> None:
    """Upgrade the schema (idempotent)."""
    from reservoir.plan.urls import redact
    from reservoir.store import upgrade_schema

    for store in _stores(config):
        done = upgrade_schema(store, revision)
        change = ("already at" if done.before == done.after
                  else f"upgraded from {done.before or 'empty'} to")
        console.print(f"{redact(done.url)}: {change} revision {done.after}", highlight=False)


@db_app.command("downgrade")
def db_downgrade(revision: str = typer.Argument(..., help="Target revision, e.g. -1, 0001 or "
                                                          "base (removes everything)."),
                 config: Optional[Path] = ConfigOption) -> None:
    """Downgrade the schema (drops what later revisions added)."""
    from reservoir.plan.urls import redact
    from reservoir.store import downgrade_schema

    for store in _stores(config):
        done = downgrade_schema(store, revision)
        console.print(f"{redact(done.url)}: now at revision {done.after or 'base'}",
                      highlight=False)


@db_app.command("status")
def db_status(config: Optional[Path] = ConfigOption) -> None:
    """Where the store is, and whether its schema is current."""
    from reservoir.plan.urls import redact
    from reservoir.store import schema_status

    for store in _stores(config):
        found = schema_status(store)
        table = Table(show_header=False)
        table.add_row("url", redact(found.url))
        embedded = store.resolved_url() is None
        table.add_row("server", f"embedded ({store.data_dir})" if embedded else "configured URL")
        table.add_row("revision", f"{found.after or 'empty'} (code expects {found.head})")
        table.add_row("schema", "up to date" if found.after == found.head
                      else "run `reservoir db upgrade`")
        console.print(table)


@db_app.command("url")
def db_url(config: Optional[Path] = ConfigOption) -> None:
    """Print the store's URL, its password as *** (starting the embedded server if needed)."""
    from reservoir.cli_common import every_target
    from reservoir.plan.urls import redact

    for _, where in every_target(config):  # store.urls: each server's, the first's first
        print(redact(where.url))


@db_app.command("start")
def db_start(config: Optional[Path] = ConfigOption) -> None:
    """Start the embedded server (a no-op when it runs)."""
    from reservoir.store import start_server

    cfg = _config(config)
    if cfg.store.resolved_url():
        raise ReservoirError("a server URL is configured: there is no embedded server to start")
    console.print(f"embedded PostgreSQL running: {start_server(cfg.store.data_dir)}",
                  highlight=False)


@db_app.command("stop")
def db_stop(config: Optional[Path] = ConfigOption) -> None:
    """Stop the embedded server."""
    from reservoir.store import stop_server

    data_dir = _config(config).store.data_dir
    stopped = stop_server(data_dir)
    console.print(f"embedded PostgreSQL in {data_dir} "
                  + ("stopped" if stopped else "was not running"), highlight=False)


@db_app.command("password")
def db_password(
        role: str = typer.Argument(..., help="owner (reservoir_owner) or reader "
                                   "(reservoir_reader)."),
        from_env: Optional[str] = typer.Option(None, help="Environment variable holding the new "
                                               "password (it is never printed or stored); "
                                               "default RESERVOIR_OWNER_PASSWORD or "
                                               "RESERVOIR_READER_PASSWORD."),
        config: Optional[Path] = ConfigOption) -> None:
    """Set the password of Reservoir's owner or reader login (sent as a SCRAM verifier, not in
    clear); only a superuser may: the embedded server's, or a configured URL's login."""
    from reservoir.plan import urls
    from reservoir.store import set_login_password

    logins = {"owner": (urls.OWNER_ROLE, urls.OWNER_PASSWORD_ENV),
              "reader": (urls.READER_ROLE, urls.READER_PASSWORD_ENV)}
    if role not in logins:
        raise ReservoirError(f"db password {role!r}: choose owner or reader")
    name, default_env = logins[role]
    from_env = from_env or default_env
    password = os.environ.get(from_env)
    if not password:
        raise ReservoirError(f"--from-env {from_env}: the variable is unset or empty; put the "
                             "password there (e.g. read -s)")
    for store in _stores(config):
        set_login_password(store, name, password)
    console.print(f"{name}'s password is set (its users set {default_env})", highlight=False)
