"""What every `reservoir` subcommand shares: the console, the store a -c CONFIG names, and the
one-line error every failure prints.

Heavy modules (the config models, SQLAlchemy, torch, Data-Juicer) are imported inside the
commands that need them, so `reservoir --help` and `reservoir sql` start quickly.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import typer
from rich.console import Console

from reservoir.errors import ReservoirError

console = Console()
ConfigOption = typer.Option(None, "--config", "-c", help="Config YAML (store, sampler, ...).")
WideOption = typer.Option(False, "--wide", help="Every column in full, however wide.")


def _config(path: Optional[Path]):
    from reservoir.config import load_config

    return load_config(path)


def _open(path: Optional[Path], *, migrate: bool = False, run: str | None = None,
          create: bool = False):
    """The store; with `migrate`, an empty database is given Reservoir's schema first (only
    commands meant to change the schema pass it). With store.urls: `run`'s server (placed
    there first with `create`, for commands that make runs)."""
    from reservoir.store import Store

    return Store.open(_on_run_server(_config(path), run, create), migrate=migrate)


def _on_run_server(config, run: str | None, create: bool = False):
    """The config on `run`'s server when store.urls names several; as it is otherwise."""
    if not config.store.urls:
        return config
    if run is None:
        raise ReservoirError(f"store.urls names {len(config.store.urls)} servers and this "
                             "command works on one: name the run whose server it is (--run "
                             "NAME)")
    from reservoir.servers import routed

    return routed(config, run, create=create)


@dataclass(frozen=True)
class Gathered:
    """Rows read on every server: each labelled by its server when store.urls names several
    (`labelled`); `complete` is False when a server could not be reached (said on stderr)."""

    rows: list[dict]
    labelled: bool
    complete: bool

    def columns(self, names: list[str]) -> list[str]:
        return ["server", *names] if self.labelled else list(names)


def gathered(path: Optional[Path], read: Callable, *, migrate: bool = False) -> Gathered:
    """`read(store)` (a list of dicts) on the store, or on each server of store.urls."""
    from reservoir.servers import every_server
    from reservoir.store import Store

    def read_on(config):
        with Store.open(config, migrate=migrate) as store:
            return read(store)

    servers = every_server(_config(path))
    done, missing = over_servers(servers, read_on)
    rows = [{"server": server, **row} if server else row for server, found in done
            for row in found]
    return Gathered(rows, servers[0][0] is not None, not missing)


def over_servers(items: list[tuple[str | None, Any]], work: Callable
                 ) -> tuple[list[tuple[str | None, Any]], list[str]]:
    """(server, work(item)) for each (server, item) in turn, and the servers that could not be
    reached or read: each said in one line on stderr, the others go on. Without store.urls
    (server None) an error is raised as it is."""
    done, missing = [], []
    for server, item in items:
        try:
            done.append((server, work(item)))
        except Exception as exc:
            message = unreachable(exc)
            if server is None or message is None:
                raise
            missing.append(server)
            sys.stderr.write(f"error: server {server}: {message}; its rows are missing\n")
    return done, missing


def check_complete(found: Gathered) -> None:
    if not found.complete:
        fail("a server of store.urls could not be reached (said above): its rows are missing")


@dataclass(frozen=True)
class Target:
    """Where quick commands connect: the store's URL and the reader's, and the query timeout."""

    url: str
    reader_url: str | None
    timeout_s: float


def target(path: Optional[Path], run: str | None = None, *, loaded=None) -> Target:
    """Resolved without the config models when no -c is given (RESERVOIR_DB_URL, else the
    embedded server under the working directory, attached without loading the wheel). With
    store.urls, `run`'s server. `loaded`: the config of `path`, when read already."""
    from reservoir.plan import urls
    from reservoir.store import start_server

    if path is None:
        url = urls.from_env() or start_server(Path(urls.DEFAULT_DATA_DIR))
        return Target(url, None, 30.0)
    config = loaded or _config(path)
    if config.store.urls:
        return _server_target(_on_run_server(config, run).store.url, config.store)
    store = config.store
    return Target(store.resolved_url() or start_server(store.data_dir), store.reader_url,
                  store.query_timeout_s)


def every_target(path: Optional[Path]) -> list[tuple[str | None, Target]]:
    """(server, target) for each server of store.urls; without urls the one target, None."""
    config = _config(path) if path is not None else None
    if config is None or not config.store.urls:
        return [(None, target(path, loaded=config))]
    from reservoir.plan.urls import server_key

    return [(server_key(url), _server_target(url, config.store)) for url in config.store.urls]


def _server_target(url: str, store) -> Target:
    """One server of store.urls: people read it as reservoir_reader with
    RESERVOIR_READER_PASSWORD (RESERVOIR_READER_URL names one server, so it is not used)."""
    import os

    from reservoir.plan import urls

    reader = urls.with_user(url, urls.READER_ROLE,
                            os.environ.get(urls.READER_PASSWORD_ENV) or None)
    return Target(url, reader, store.query_timeout_s)


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def fail(message: str, code: int = 1) -> None:
    """One plain line on stderr (no markup: a ':x:' stays ':x:'), then exit."""
    sys.stderr.write(f"error: {' '.join(message.split())}\n")
    sys.exit(code)


def unreachable(exc: BaseException) -> str | None:
    """One line for a server that could not be reached or read (a driver's error or one of
    Reservoir's own); None for anything else."""
    return str(exc) if isinstance(exc, ReservoirError) else external_error(exc)


def external_error(exc: BaseException) -> str | None:
    """One line for an error raised by a database driver or the network; None otherwise (a bug
    in Reservoir keeps its traceback)."""
    module = type(exc).__module__.split(".")[0]
    if module in ("sqlalchemy", "psycopg2", "asyncpg") or isinstance(exc, ConnectionError):
        original = getattr(exc, "orig", None) or exc
        from reservoir.plan.urls import redact_text

        text = str(original).strip().splitlines()
        return redact_text(f"the database: {text[0] if text else type(original).__name__}")
    return None
