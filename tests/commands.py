"""The real `reservoir` command in a subprocess, and one-value queries to check its effects."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg2
from sqlalchemy import text

from reservoir.store.engine import sync_engine

RESERVOIR = Path(sys.executable).with_name("reservoir")


def command_env(url: str) -> dict[str, str]:
    """This process's environment with the store's URL, and room for wide tables."""
    return {**os.environ, "RESERVOIR_DB_URL": url, "COLUMNS": "200"}


def reservoir(*args: str, url: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(RESERVOIR), *args], env=command_env(url), cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def start_reservoir(*args: str, url: str, cwd: Path) -> subprocess.Popen:
    """The command left running; its output goes to cwd/reservoir.log (a pipe nobody reads
    while it runs would fill and stop it)."""
    with open(cwd / "reservoir.log", "w") as log:
        return subprocess.Popen([str(RESERVOIR), *args], env=command_env(url), cwd=cwd,
                                stdout=log, stderr=subprocess.STDOUT, text=True)


def scalar(url: str, sql: str):
    engine = sync_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(text(sql)).scalar()
    finally:
        engine.dispose()


def execute(url: str, *statements: str) -> list[tuple]:
    """Run statements in autocommit (psycopg2: what a test sets up, often as the server's
    superuser); the rows of the last one, if it returns rows."""
    conn = psycopg2.connect(url)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            for statement in statements:
                cur.execute(statement)
            return cur.fetchall() if cur.description else []
    finally:
        conn.close()


@contextmanager
def holding(admin: str, key: int, *, before: str, table: str,
            condition: str) -> Iterator[Callable[[], list[int]]]:
    """While open, each row `BEFORE {before} ON {table}` for which `condition` holds (plpgsql
    over NEW and OLD) waits, in its transaction, on advisory lock `key`, which this context
    holds: a test stops a run at a chosen write as long as it needs. Yields a function giving
    the pids of the backends waiting. At its end the lock goes (the held writes go on) and the
    trigger is dropped."""
    name = f"hold_{key}"
    execute(admin, f"""CREATE FUNCTION public.{name}() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN IF {condition} THEN PERFORM pg_advisory_xact_lock_shared({key}); END IF;
        RETURN NEW; END $$""", f"CREATE TRIGGER {name} BEFORE {before} ON {table} "
            f"FOR EACH ROW EXECUTE FUNCTION public.{name}()")
    held = psycopg2.connect(admin)
    try:
        held.autocommit = True
        with held.cursor() as cur:
            cur.execute("SELECT pg_advisory_lock(%s)", (key,))
        yield lambda: [pid for (pid,) in execute(
            admin, "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
                   f"AND objid = {key}")]
    finally:
        held.close()
        execute(admin, f"DROP TRIGGER {name} ON {table}", f"DROP FUNCTION public.{name}()")


def key_values(out: str) -> dict[str, str]:
    """The two-column tables `inspect` prints, as a dict."""
    rows = ([cell.strip() for cell in line.split("│")[1:-1]] for line in out.splitlines())
    return {row[0]: row[1] for row in rows if len(row) == 2}
