"""Several trainer processes on one store: no row twice, nothing lost, SIGKILL-safe."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from sqlalchemy import func, select

from reservoir.store.schema import batch_items, experiences
from tests.factories import fill

ROOT = Path(__file__).resolve().parent.parent


def start_worker(url: str, run: str, index: int, batch: int, mode: str, lease_seconds: float):
    return subprocess.Popen(
        [sys.executable, "-m", "tests.workers.lease_worker", url, run, str(index), str(batch),
         mode, str(lease_seconds)],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)})


def start_together(workers) -> None:
    for worker in workers:
        assert worker.stdout.readline().strip() == "ready"
    for worker in workers:
        worker.stdin.write("go\n")
        worker.stdin.flush()


def test_concurrent_processes_never_share_a_row(store, db_url):
    store.create_run("r")
    fill(store, "r", 300)  # 1,200 rows
    workers = [start_worker(db_url, "r", i, 16, "commit", 60) for i in range(4)]
    start_together(workers)
    leased: list[list[int]] = []
    for worker in workers:
        out, _ = worker.communicate(timeout=120)
        assert worker.returncode == 0
        leased.append([i for line in out.splitlines() for i in json.loads(line)])
    every = [i for ids in leased for i in ids]
    assert len(every) == len(set(every)) == 1200
    assert all(ids for ids in leased), "each worker should have leased something"
    with store.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(batch_items)).scalar() == 1200
        statuses = conn.execute(select(experiences.c.status).distinct()).scalars().all()
    assert statuses == ["consumed"]


def test_sigkill_while_holding_a_lease_loses_nothing(store, db_url):
    store.create_run("r")
    fill(store, "r", 4)
    worker = start_worker(db_url, "r", 0, 10, "hold", 1.0)
    start_together([worker])
    held = json.loads(worker.stdout.readline())
    worker.send_signal(signal.SIGKILL)
    worker.wait(timeout=10)
    assert len(held) == 10
    assert sorted(store.lease("r", rows=16, allow_partial=True).ids) == [
        i for i in range(1, 17) if i not in held]
    time.sleep(1.1)  # the killed worker's lease expires ...
    back = store.lease("r", rows=10)  # ... and the next lease reclaims it
    assert sorted(back.ids) == sorted(held)
    store.commit_step(back, step=1, policy_version=0)
    with store.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(batch_items)).scalar() == 10
