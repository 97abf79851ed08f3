"""What every `reservoir` subcommand shares: the console, the store a -c CONFIG names, and the
one-line error every failure prints.

Heavy modules (the config models, SQLAlchemy, torch, Data-Juicer) are imported inside the
commands that need them, so `reservoir --help` and `reservoir sql` start quickly.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

console = Console()
ConfigOption = typer.Option(None, "--config", "-c", help="Config YAML (store, sampler, ...).")
WideOption = typer.Option(False, "--wide", help="Every column in full, however wide.")


def _config(path: Optional[Path]):
    from reservoir.config import load_config

    return load_config(path)


def _open(path: Optional[Path], *, migrate: bool = False):
    """The store; with `migrate`, an empty database is given Reservoir's schema first (only
    commands meant to change the schema pass it)."""
    from reservoir.store import Store

    return Store.open(_config(path), migrate=migrate)


@dataclass(frozen=True)
class Target:
    """Where quick commands connect: the store's URL and the reader's, and the query timeout."""

    url: str
    reader_url: str | None
    timeout_s: float


def target(path: Optional[Path]) -> Target:
    """Resolved without the config models when no -c is given (RESERVOIR_DB_URL, else the
    embedded server under the working directory, attached without loading the wheel)."""
    from reservoir.plan import urls
    from reservoir.store import start_server

    if path is None:
        url = urls.from_env() or start_server(Path(urls.DEFAULT_DATA_DIR))
        return Target(url, None, 30.0)
    store = _config(path).store
    return Target(store.resolved_url() or start_server(store.data_dir), store.reader_url,
                  store.query_timeout_s)


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def fail(message: str, code: int = 1) -> None:
    """One plain line on stderr (no markup: a ':x:' stays ':x:'), then exit."""
    sys.stderr.write(f"error: {' '.join(message.split())}\n")
    sys.exit(code)


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
