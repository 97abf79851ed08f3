"""The real `reservoir` command in a subprocess, and one-value queries to check its effects."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from sqlalchemy import text

from reservoir.store.engine import sync_engine

RESERVOIR = Path(sys.executable).with_name("reservoir")


def reservoir(*args: str, url: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "RESERVOIR_DB_URL": url, "COLUMNS": "200"}
    return subprocess.run([str(RESERVOIR), *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def scalar(url: str, sql: str):
    engine = sync_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(text(sql)).scalar()
    finally:
        engine.dispose()


def key_values(out: str) -> dict[str, str]:
    """The two-column tables `inspect` prints, as a dict."""
    rows = ([cell.strip() for cell in line.split("│")[1:-1]] for line in out.splitlines())
    return {row[0]: row[1] for row in rows if len(row) == 2}
