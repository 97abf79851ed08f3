"""Notifications instead of polling: a stream pipeline and a waiting lease wake when rows of
their run are written, not at their next poll."""

from __future__ import annotations

import signal
import threading
import time

import pytest
from sqlalchemy import text

from reservoir.pipeline import stream
from tests.commands import start_reservoir
from tests.factories import make_group


def _status_of_first_row(engine, run: str) -> str | None:
    with engine.connect() as conn:
        return conn.execute(text("SELECT min(e.status) FROM experiences e JOIN runs r "
                                 "ON r.id = e.run_id WHERE r.name = :run"), {"run": run}).scalar()


@pytest.mark.slow
@pytest.mark.process
def test_a_stream_pipeline_moves_a_row_within_100_ms_of_its_insert(store, db_url, tmp_path):
    """`reservoir pipeline run` on a stream, in a process of its own as users run it: timed in
    pytest's process, it shared the interpreter with whatever threads earlier tests left (in CI,
    three quarters into the suite, 107-111 ms where a process of its own takes 44-64)."""
    store.create_run("s", group_size=2)
    spec = tmp_path / "gate.yaml"
    spec.write_text("mode: stream\nsource: {status: [raw], runs: [s]}\n"
                    "process:\n  - text_length_filter: {min_len: 1}\n")
    worker = start_reservoir("pipeline", "run", str(spec), url=db_url, cwd=tmp_path)
    output = tmp_path / "reservoir.log"
    try:
        latencies = []
        for attempt in range(5):  # the first pass waits for the imports and warms operators up
            time.sleep(2 * stream.POLL_S + 0.5)  # idle: the stream waits, its poll is far off
            store.write_groups([make_group("s", size=2, seed=attempt)], status="raw")
            written = time.perf_counter()
            while _status_of_first_row(store.engine, "s") != "ready":
                assert worker.poll() is None, output.read_text()
                assert time.perf_counter() - written < 60, "the stream never moved the row"
                time.sleep(0.002)
            latencies.append(time.perf_counter() - written)
        assert min(latencies[1:]) < 0.1, latencies  # its poll alone would take up to 0.5 s
    finally:
        worker.send_signal(signal.SIGINT)  # Ctrl-C
        worker.wait(timeout=30)
    assert worker.returncode == 0, output.read_text()


def test_a_waiting_lease_wakes_when_rows_are_written(make_store):
    store = make_store(poll_interval_s=5.0)  # only a notification can wake it in time
    writer = make_store()
    store.create_run("w", group_size=2)
    got = {}

    def lease():
        started = time.perf_counter()
        got["lease"] = store.lease("w", rows=2, timeout_s=20)
        got["at"] = time.perf_counter() - started

    thread = threading.Thread(target=lease)
    thread.start()
    time.sleep(0.5)
    writer.write_groups([make_group("w", size=2)])
    thread.join(20)
    assert len(got["lease"].rows) == 2
    assert got["at"] < 2.0, got["at"]  # woken by the write, not by its 5 s poll


@pytest.mark.slow
@pytest.mark.process
def test_a_stream_started_before_its_run_waits_for_it_and_for_a_failed_run_s_trainer(
        store, db_url, tmp_path):
    """Issue 28: a stream started before its run existed stopped at once; a stream of a run
    whose trainer failed exited with code 0, so `--resume` of the trainer alone left raw rows
    nobody processed. It waits for both (saying so) and ends when the run has ended."""
    spec = tmp_path / "gate.yaml"
    spec.write_text("mode: stream\nsource: {status: [raw], runs: [later]}\n"
                    "process:\n  - text_length_filter: {min_len: 1}\n")
    worker = start_reservoir("pipeline", "run", str(spec), url=db_url, cwd=tmp_path)
    output = tmp_path / "reservoir.log"
    try:
        time.sleep(8)  # the imports, then its first look for the run
        assert worker.poll() is None, output.read_text()
        store.create_run("later", group_size=2)
        with store.engine.begin() as conn:
            conn.execute(text("UPDATE runs SET status = 'failed' WHERE name = 'later'"))
        store.write_groups([make_group("later", size=2)], status="raw")
        deadline = time.monotonic() + 60
        while _status_of_first_row(store.engine, "later") != "ready":
            assert worker.poll() is None and time.monotonic() < deadline, output.read_text()
            time.sleep(0.1)
        time.sleep(2 * stream.POLL_S + 1)
        assert worker.poll() is None, output.read_text()  # failed: it waits for a resume
        with store.engine.begin() as conn:
            conn.execute(text("UPDATE runs SET status = 'finished' WHERE name = 'later'"))
        worker.wait(timeout=60)
    finally:
        if worker.poll() is None:
            worker.send_signal(signal.SIGINT)
            worker.wait(timeout=30)
    log = output.read_text()
    assert worker.returncode == 0, log
    assert "waiting for run 'later' to be created" in log, log
    assert "run 'later' failed: waiting up to" in log, log
