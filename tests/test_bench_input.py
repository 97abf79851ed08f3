"""The benches take user input too: a server that cannot be reached ends in one line naming it,
not a traceback (bench/store.py printed 119 lines for a wrong database name)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

BENCH = Path(__file__).resolve().parent.parent / "bench"
NOWHERE = "postgresql://postgres@127.0.0.1:1/nowhere"  # port 1: nothing listens there


@pytest.mark.parametrize("script, flag", [("store.py", "--url"), ("state_layout.py", "--url"),
                                          ("cluster.py", "--urls")])
def test_a_bench_given_an_unreachable_server_ends_in_one_line(script, flag):
    done = subprocess.run([sys.executable, str(BENCH / script), flag, NOWHERE],
                          capture_output=True, text=True, timeout=120, cwd=BENCH.parent)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()
    assert len(last) == 1, done.stderr
    assert last[0].startswith(f"bench/{script}: ") and "port 1" in last[0]


def test_store_bench_refuses_a_batch_that_is_not_whole_groups():
    done = subprocess.run([sys.executable, str(BENCH / "store.py"), "--url", NOWHERE,
                           "--batch", "100", "--group-size", "8"],
                          capture_output=True, text=True, timeout=120, cwd=BENCH.parent)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--batch 100 must be a positive multiple of --group-size 8" in done.stderr
