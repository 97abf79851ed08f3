"""Several trainer processes on one store: no row twice, nothing lost, SIGKILL-safe."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.exc import IntegrityError

from reservoir.errors import StoreError
from reservoir.store import ledger
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


@pytest.mark.slow
@pytest.mark.process
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


@pytest.mark.slow
@pytest.mark.process
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


def _waiting_for_a_lock(store, timeout: float = 5.0) -> bool:
    """Whether another session waits for a lock, within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    with store.engine.connect() as conn:
        while time.monotonic() < deadline:
            if conn.execute(text("SELECT count(*) FROM pg_locks WHERE NOT granted")).scalar():
                return True
            time.sleep(0.02)
    return False


def _delete_in_thread(store, statement: str) -> tuple[threading.Thread, list]:
    outcome: list = []

    def delete() -> None:
        try:
            with store.engine.begin() as conn:
                conn.execute(text(statement))
            outcome.append("deleted")
        except Exception as exc:  # reported to the test
            outcome.append(exc)

    thread = threading.Thread(target=delete)
    thread.start()
    return thread, outcome


STATE_WITHOUT_DATA = text("""SELECT count(*) FROM experience_state s WHERE NOT EXISTS
    (SELECT FROM experience_data d WHERE d.run_id = s.run_id AND d.id = s.id)""")
DATA_ROW = ("INSERT INTO experience_data (id, run_id, prompt_text, response_text, prompt_ids, "
            "response_ids, reward, group_id, group_row) VALUES ({id}, {run}, 'p', 'r', '\\x', "
            "'\\x', 0, gen_random_uuid(), 0)")
STATE_ROW = "INSERT INTO experience_state (id, run_id, policy_version) VALUES ({id}, {run}, 0)"


def test_a_state_row_written_while_its_data_row_is_deleted_leaves_no_dangling_row(store):
    """An experience's keys are statement triggers (migration 0022), which lock no data row
    they check under READ COMMITTED: a delete of a data row waits for the state writes in
    flight, then takes their rows with it; a state write that starts after the delete finds
    the data row gone."""
    run = store.create_run("r")
    with store.engine.begin() as conn:  # two data rows without their state rows yet
        conn.execute(text(DATA_ROW.format(id=101, run=run) + "; "
                          + DATA_ROW.format(id=102, run=run)))
    with store.engine.connect() as writing:
        with writing.begin():
            writing.execute(text(STATE_ROW.format(id=101, run=run)))
            thread, outcome = _delete_in_thread(
                store, "DELETE FROM experience_data WHERE id = 101")
            assert _waiting_for_a_lock(store), "the delete did not wait for the state write"
        thread.join(10)
    with store.engine.connect() as conn:
        assert outcome == ["deleted"]
        assert conn.execute(text("SELECT count(*) FROM experience_state")).scalar() == 0
    thread, outcome = _delete_in_thread(store, "DELETE FROM experience_data WHERE id = 102; "
                                               "SELECT pg_sleep(0.5)")
    time.sleep(0.25)  # the delete is done, not committed: the state write waits for it
    with pytest.raises(IntegrityError, match="experience 102 of run .* is not in experience_data"):
        with store.engine.begin() as writing:
            writing.execute(text(STATE_ROW.format(id=102, run=run)))
    thread.join(10)
    with store.engine.connect() as conn:
        assert outcome == ["deleted"] and conn.execute(STATE_WITHOUT_DATA).scalar() == 0


DANGLING = text("""SELECT count(*) FROM batch_items b WHERE NOT EXISTS
    (SELECT FROM experience_state s WHERE s.run_id = b.run_id AND s.id = b.experience_id)""")


def test_a_step_recorded_while_its_experience_is_deleted_leaves_no_dangling_row(store):
    """The ledger's keys are statement triggers (migration 0017), which lock no row they check:
    a delete of an experience waits for the ledger writes in flight, then takes their rows with
    it; a ledger write that starts after the delete finds the experience gone."""
    store.create_run("r")
    fill(store, "r", 1)
    with store.engine.connect() as recording:  # a step on stored rows, not committed yet
        with recording.begin():
            ledger.record_step(recording, store.aio.run_ids("r")[0], 1, policy_version=0,
                               metrics={}, experience_ids=[1, 2])
            thread, outcome = _delete_in_thread(store, "DELETE FROM experiences WHERE id = 1")
            assert _waiting_for_a_lock(store), "the delete did not wait for the ledger write"
        thread.join(10)
    with store.engine.connect() as conn:
        left = conn.execute(select(batch_items.c.experience_id)).scalars().all()
        assert outcome == ["deleted"] and left == [2]
        assert conn.execute(DANGLING).scalar() == 0
    thread, outcome = _delete_in_thread(store, "DELETE FROM experiences WHERE id = 2; "
                                               "SELECT pg_sleep(0.5)")
    time.sleep(0.25)  # the delete is done, not committed: the ledger write waits for it
    with pytest.raises((StoreError, IntegrityError),
                       match="1 experience ids, 0 of them|experience 2 of run 1 is not in"):
        with store.engine.begin() as recording:
            ledger.record_step(recording, store.aio.run_ids("r")[0], 2, policy_version=0,
                               metrics={}, experience_ids=[2])
    thread.join(10)
    with store.engine.connect() as conn:
        assert outcome == ["deleted"] and conn.execute(DANGLING).scalar() == 0
