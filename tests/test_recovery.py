"""Killing workers with SIGKILL: a trainer resumes exactly; a dead explorer's tasks come back.

Both run the real `reservoir` command in a subprocess against a test database.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from reservoir import pool
from reservoir.config import parse_config
from reservoir.errors import Abandoned
from reservoir.models import build_tiny_model, load_model
from reservoir.monitor import Monitor
from reservoir.prepare import ensure_run
from reservoir.store import Experience, Store
from reservoir.store.engine import sync_engine
from rich.console import Console
from sqlalchemy import text
from sqlalchemy.pool import NullPool

from tests.commands import execute
from tests.test_run import ledger

pytestmark = pytest.mark.process

RESERVOIR = Path(sys.executable).with_name("reservoir")


def start(*args: str, cwd: Path) -> subprocess.Popen:
    """The command in a process group of its own, as a terminal runs a foreground job: with
    Ctrl-C's default action even when the tests themselves run in the background (a shell
    starts background jobs with SIGINT ignored, and Python then keeps ignoring it)."""
    return subprocess.Popen([str(RESERVOIR), *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "COLUMNS": "200"}, preexec_fn=_as_in_a_terminal)


def _as_in_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def finish(process: subprocess.Popen, timeout: float = 300) -> str:
    output, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, output
    return output


def query(db_url: str, sql: str, **params):
    """One statement on a connection of its own, closed at once (NullPool): tests poll with it
    while runs work, and a pooled engine a call left open connections behind on a busy server."""
    engine = sync_engine(db_url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return conn.execute(text(sql), params).all()
    finally:
        engine.dispose()


def wait_for(condition, timeout: float = 120, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(every)
    raise AssertionError("timed out waiting")


def write_config(path: Path, raw: dict) -> Path:
    parse_config(raw)  # fail here, not in the subprocess, if the test's config is wrong
    path.write_text(yaml.safe_dump(raw))
    return path


def offline_groups(run: str, n_groups: int, size: int = 4) -> list[list[Experience]]:
    """Seeded groups with rewards that differ inside each group (so advantages are not 0)."""
    rng = np.random.default_rng(7)
    groups = []
    for _ in range(n_groups):
        prompt = rng.integers(10, 60, 6)
        groups.append([Experience(
            run=run, policy_version=0, prompt_text="p", response_text="r", prompt_ids=prompt,
            response_ids=(response := rng.integers(10, 60, 5)),
            logprobs=-rng.random(len(response)).astype(np.float32) - 2.0,
            reward=float(i % 2), reward_components={"accuracy": float(i % 2)})
            for i in range(size)])
    return groups


def trainer_config(tmp_path: Path, side: str, db_url: str, model: Path) -> Path:
    return write_config(tmp_path / f"{side}.yaml", {
        "run": {"name": "offline", "mode": "async", "seed": 3},
        "model": {"path": str(model)}, "tasks": {"generate": "reverse", "count": 20},
        "explorer": {"n": 4, "max_tokens": 4},
        "trainer": {"steps": 8, "batch_groups": 2, "micro_batch": 3, "lr": 0.01,
                    "eval_interval": 100, "checkpoint_interval": 4,
                    "checkpoint_dir": str(tmp_path / side)},
        "sampler": {"max_staleness": 100}, "store": {"url": db_url}})


@pytest.mark.slow
@pytest.mark.store_agnostic  # signals and checkpoints: the same on any server
def test_trainer_killed_mid_run_resumes_to_the_same_model(tmp_path, new_database, template_db):
    model = build_tiny_model(tmp_path / "tiny", seed=4)
    sides = {side: (new_database(template_db), None) for side in ("straight", "killed")}
    for side, (db_url, _) in sides.items():
        config_path = trainer_config(tmp_path, side, db_url, model)
        with Store(db_url) as store:
            ensure_run(store, parse_config(yaml.safe_load(config_path.read_text())))
            store.write_groups(offline_groups("offline", 8 * 2))
        sides[side] = (db_url, config_path)

    finish(start("train", str(sides["straight"][1]), cwd=tmp_path))
    db_url, config_path = sides["killed"]
    victim = start("train", str(config_path), cwd=tmp_path)
    wait_for(lambda: query(db_url, "SELECT 1 FROM train_steps WHERE step >= 2"))
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    killed_at = query(db_url, "SELECT max(step) FROM train_steps")[0][0]
    assert 2 <= killed_at < 8
    output = finish(start("train", str(config_path), "--resume", cwd=tmp_path))
    replayed = int(re.search(r"replayed (\d+) committed steps", output).group(1))
    checkpoint = int(re.search(r"\(step (\d+)\); replayed", output).group(1))
    assert replayed == killed_at - checkpoint, output  # steps after the checkpoint: the ledger

    found = ledger(db_url)
    assert found["steps"] == list(range(9)) and found["status"] == "finished"
    assert (found["bad_steps"], found["trained_twice"]) == (0, 0)
    assert query(db_url, "SELECT status, count(*) FROM experiences GROUP BY 1") == [
        ("consumed", 64)]
    weights = [load_model(tmp_path / side / "offline" / "step-000008")[0].state_dict()
               for side in ("straight", "killed")]
    for name, tensor in weights[0].items():
        torch.testing.assert_close(weights[1][name], tensor, atol=1e-5, rtol=0, msg=name)


@pytest.mark.slow
def test_killed_explorer_tasks_are_explored_again_and_the_run_finishes(tmp_path, db_url):
    model = build_tiny_model(tmp_path / "tiny", seed=5)
    config_path = write_config(tmp_path / "run.yaml", {
        "run": {"name": "kill-explorer"}, "model": {"path": str(model)},
        "tasks": {"generate": "reverse", "count": 80},
        "explorer": {"n": 4, "batch_tasks": 2, "max_tokens": 24, "workers": 2,
                     "claim_seconds": 3},
        "trainer": {"steps": 8, "batch_groups": 2, "micro_batch": 8, "eval_interval": 100,
                    "checkpoint_dir": str(tmp_path / "checkpoints")},
        "store": {"url": db_url}})
    run = start("run", str(config_path), cwd=tmp_path)
    victim, tasks = wait_for(lambda: _kill_a_claim_holder(db_url), timeout=180, every=0.02)
    output = finish(run)
    found = ledger(db_url)
    assert found["steps"] == list(range(9)) and found["status"] == "finished", output
    assert (found["bad_steps"], found["trained_twice"]) == (0, 0)
    explored = dict(query(db_url, "SELECT id, times_explored FROM tasks WHERE id = ANY(:ids)",
                          ids=list(tasks)))
    assert all(explored[task] > before for task, before in tasks.items()), (victim, explored)


def _kill_a_claim_holder(db_url: str):
    """SIGKILL an explorer while it holds claims; (its name, {task: times explored before})."""
    claims = query(db_url, "SELECT claimed_by, id, times_explored FROM tasks "
                           "WHERE claim_token IS NOT NULL AND claimed_until > now()")
    if not claims:
        return None
    victim = claims[0].claimed_by
    os.kill(int(victim.rsplit(":", 1)[1]), signal.SIGKILL)
    time.sleep(0.5)
    held = {row.id: row.times_explored for row in claims if row.claimed_by == victim}
    still = query(db_url, "SELECT count(*) FROM tasks WHERE claimed_by = :who AND id = ANY(:ids)",
                  who=victim, ids=list(held))[0][0]
    return (victim, held) if still == len(held) else None  # else it finished first: try again


class StopsSlowly:
    """A worker (what `reservoir train` and `explore` run in front): it works until asked to
    stop, then takes `stopping_s` to stop (a checkpoint, say)."""

    def __init__(self, stopping_s: float) -> None:
        self.asked, self.stopping_s, self.thread = threading.Event(), stopping_s, None

    def request_stop(self) -> None:
        self.asked.set()

    def run(self) -> str:
        self.thread = threading.current_thread()
        while not self.asked.wait(0.02):
            pass
        time.sleep(self.stopping_s)
        return "stopped"


@pytest.mark.parametrize("ctrl_cs", [1, 2])
def test_the_worker_runs_in_the_main_thread_and_a_second_ctrl_c_leaves_at_once(store, ctrl_cs):
    """The worker computes in the main thread (a second thread's OpenMP team slowed torch on
    a CPU), the live view in a thread of its own; the first Ctrl-C asks the worker to stop and
    lets it finish, a second raises Abandoned in the worker at once."""
    worker = StopsSlowly(stopping_s=0.5 if ctrl_cs == 1 else 30)
    handler = signal.getsignal(signal.SIGINT)  # pytest's, or SIG_IGN in a background job
    for at in range(ctrl_cs):
        threading.Timer(0.3 + 0.3 * at, os.kill, (os.getpid(), signal.SIGINT)).start()
    started = time.monotonic()
    monitor = Monitor(store, "nothing", 1)
    if ctrl_cs == 1:
        assert pool._in_front(worker, monitor, Console(quiet=True), True) == "stopped"
    else:
        with pytest.raises(Abandoned):
            pool._in_front(worker, monitor, Console(quiet=True), True)
        assert time.monotonic() - started < 5
    assert worker.thread is threading.main_thread() and worker.asked.is_set()
    assert signal.getsignal(signal.SIGINT) is handler  # put back
    assert [t.name for t in threading.enumerate() if t.name == "monitor"] == []


@pytest.mark.slow
@pytest.mark.store_agnostic  # signals and checkpoints: the same on any server
def test_ctrl_c_stops_cleanly_and_resume_finishes_the_run(tmp_path, db_url):
    model = build_tiny_model(tmp_path / "tiny", seed=6)
    config_path = write_config(tmp_path / "run.yaml", {
        "run": {"name": "interrupted"}, "model": {"path": str(model)},
        "tasks": {"generate": "reverse", "count": 200},
        "explorer": {"n": 4, "batch_tasks": 2, "max_tokens": 6},
        "trainer": {"steps": 40, "batch_groups": 2, "micro_batch": 8, "eval_interval": 100,
                    "checkpoint_interval": 100, "checkpoint_dir": str(tmp_path / "ck")},
        "store": {"url": db_url}})
    run = start("run", str(config_path), cwd=tmp_path)
    wait_for(lambda: query(db_url, "SELECT 1 FROM train_steps WHERE step >= 3"), timeout=180)
    os.killpg(run.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group, Ray's daemons too
    output, _ = run.communicate(timeout=180)
    assert run.returncode == 130, output
    (status,), = query(db_url, "SELECT status FROM runs")
    (stopped_at,), = query(db_url, "SELECT max(step) FROM train_steps")
    assert status == "stopped" and 3 <= stopped_at < 40
    assert (tmp_path / "ck" / "interrupted" / f"step-{stopped_at:06d}").is_dir()
    assert query(db_url, "SELECT count(*) FROM tasks WHERE claim_token IS NOT NULL") == [(0,)]
    assert query(db_url, "SELECT count(*) FROM experiences WHERE status = 'leased'") == [(0,)]
    finish(start("run", str(config_path), "--resume", cwd=tmp_path))
    found = ledger(db_url)
    assert found["steps"] == list(range(41)) and found["status"] == "finished"
    assert (found["bad_steps"], found["trained_twice"]) == (0, 0)


def warm_up_config(tmp_path: Path, db_url: str, model: Path, warmup_steps: int) -> Path:
    config = yaml.safe_load(trainer_config(tmp_path, "warm", db_url, model).read_text())
    config["trainer"].update(warmup_steps=warmup_steps, warmup_batch=4, warmup_fraction=0.5)
    return write_config(tmp_path / "warm.yaml", config)


def offline_warm_up_run(tmp_path: Path, side: str, db_url: str, model: Path, warmup_steps: int,
                        groups: int, **trainer) -> Path:
    """`side`.yaml: the warm-up config with `trainer` keys changed, its run created in the
    store and `groups` offline groups written for the steps after the warm-up."""
    config = yaml.safe_load(warm_up_config(tmp_path, db_url, model, warmup_steps).read_text())
    config["trainer"] |= trainer
    path = write_config(tmp_path / f"{side}.yaml", config)
    with Store(db_url) as store:
        ensure_run(store, parse_config(config))
        store.write_groups(offline_groups("offline", groups))
    return path


@pytest.mark.slow
@pytest.mark.store_agnostic  # signals and checkpoints: the same on any server
def test_ctrl_c_in_the_warm_up_stops_within_a_step_and_resume_continues_it(tmp_path, db_url):
    """Issue 8: main showed `created` and `-` through the whole warm-up and ignored Ctrl-C
    until it ended. Issue 10: the warm-up is an sft stage whose steps enter the ledger, so a
    stopped warm-up resumes where it stopped."""
    model = build_tiny_model(tmp_path / "tiny", seed=8)
    config_path = warm_up_config(tmp_path, db_url, model, warmup_steps=100_000)
    with Store(db_url) as store:
        ensure_run(store, parse_config(yaml.safe_load(config_path.read_text())))
        store.write_groups(offline_groups("offline", 8 * 2))
    run = start("train", str(config_path), cwd=tmp_path)
    progress = wait_for(lambda: query(db_url, "SELECT status, progress FROM analytics.runs "
                                              "WHERE (progress ->> 'step')::int >= 5"))
    status, shown = progress[0]
    assert status == "running" and shown["stage"] == "warm-up" and shown["of"] == 100_000
    interrupted = time.monotonic()
    os.killpg(run.pid, signal.SIGINT)
    output, _ = run.communicate(timeout=60)
    assert run.returncode == 130 and time.monotonic() - interrupted < 20, output
    assert query(db_url, "SELECT status, progress FROM runs") == [("stopped", {})]
    (stopped,), = query(db_url, "SELECT max(step) FROM train_steps WHERE stage = 'warm-up'")
    assert stopped >= 5
    resumed = warm_up_config(tmp_path, db_url, model, warmup_steps=stopped + 10)
    output = finish(start("train", str(resumed), "--resume", cwd=tmp_path))
    assert f"resumed run 'offline' from step-{stopped:06d} (step {stopped})" in output
    assert ledger(db_url)["steps"] == list(range(stopped + 10 + 8 + 1))


@pytest.mark.slow
@pytest.mark.store_agnostic  # signals and checkpoints: the same on any server
def test_a_trainer_killed_in_its_warm_up_resumes_to_the_same_weights(tmp_path, new_database,
                                                                      template_db):
    """Issue 8: main refused `--resume` ("no checkpoint"). Killed in its warm-up, the trainer
    resumes from the stage's first checkpoint, replays the warm-up steps the ledger holds (the
    same task draws) and ends at the same weights as a run never killed."""
    model = build_tiny_model(tmp_path / "tiny", seed=9)
    paths = {}
    for side in ("straight", "killed"):
        db_url = new_database(template_db)
        paths[side] = (db_url, offline_warm_up_run(
            tmp_path, side, db_url, model, 60, 8 * 2, checkpoint_dir=str(tmp_path / side),
            checkpoint_interval=100))
    finish(start("train", str(paths["straight"][1]), cwd=tmp_path))
    db_url, config_path = paths["killed"]
    victim = start("train", str(config_path), cwd=tmp_path)
    wait_for(lambda: query(db_url, "SELECT 1 FROM train_steps WHERE step >= 3"))
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    output = finish(start("train", str(config_path), "--resume", cwd=tmp_path))
    assert "from step-000000 (step 0); replayed" in output
    found = ledger(db_url)
    assert found["steps"] == list(range(60 + 8 + 1)) and found["status"] == "finished"
    weights = [load_model(tmp_path / side / "offline" / "step-000068")[0].state_dict()
               for side in ("straight", "killed")]
    for name, tensor in weights[0].items():
        torch.testing.assert_close(weights[1][name], tensor, atol=1e-5, rtol=0, msg=name)


@pytest.mark.slow
def test_a_step_whose_loss_is_not_finite_is_never_committed(tmp_path, db_url):
    """Issue 28: a row's reward of 1e39 (stored before the writer checked rewards against
    float32) made the loss NaN at step 1 and the run failed after committing it. The step is
    not committed, its rows go back to ready, and one line names them."""
    model = build_tiny_model(tmp_path / "tiny", seed=4)
    config_path = trainer_config(tmp_path, "nan", db_url, model)
    with Store(db_url) as store:
        ensure_run(store, parse_config(yaml.safe_load(config_path.read_text())))
        store.write_groups(offline_groups("offline", 4))
    bad = query(db_url, "SELECT min(id) FROM experiences")[0][0]
    execute(db_url, f"UPDATE experiences SET reward = 1e39 WHERE id = {bad}")
    trainer = start("train", str(config_path), cwd=tmp_path)
    output, _ = trainer.communicate(timeout=300)
    assert trainer.returncode == 1, output
    last = output.strip().splitlines()[-1]
    assert last.startswith("error: step 1: the loss is not finite") and f"{bad}," in last, last
    assert "nothing of the step was committed" in last, last
    assert query(db_url, "SELECT array_agg(step) FROM train_steps") == [([0],)]
    assert query(db_url, "SELECT DISTINCT status FROM experiences") == [("ready",)]


@pytest.mark.slow
def test_a_task_s_groups_and_its_count_commit_together(tmp_path, db_url, as_admin):
    """Issue 28: an explorer wrote a batch's groups and counted their tasks explored in two
    transactions; killed between the two, it left tasks with groups written and not counted,
    explored again later (two groups, times_explored 1). Here a trigger holds the count back
    while the explorer is SIGKILLed: nothing of that batch stays, and afterwards every task
    has exactly as many groups as times it was counted."""
    model = build_tiny_model(tmp_path / "tiny", seed=8)
    config_path = write_config(tmp_path / "explore.yaml", {
        "run": {"name": "once", "mode": "async"}, "model": {"path": str(model)},
        "tasks": {"generate": "reverse", "count": 6, "test_fraction": 0.0},
        "explorer": {"n": 2, "batch_tasks": 2, "max_tokens": 4, "claim_seconds": 2},
        "trainer": {"steps": 100, "batch_groups": 2, "checkpoint_dir": str(tmp_path / "ck")},
        "sampler": {"max_staleness": 100}, "store": {"url": db_url}})
    with Store(db_url) as store:
        ensure_run(store, parse_config(yaml.safe_load(config_path.read_text())))
        store.publish_version("once", 0, location=str(model), train_step=0)
    admin = as_admin(db_url)
    execute(admin, """CREATE FUNCTION public.slow_count() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN IF NEW.times_explored > OLD.times_explored THEN PERFORM pg_sleep(60); END IF;
        RETURN NEW; END $$""", "CREATE TRIGGER slow_count BEFORE UPDATE ON tasks FOR EACH ROW "
            "EXECUTE FUNCTION public.slow_count()")
    first = start("explore", str(config_path), "--workers", "1", cwd=tmp_path)
    sleeping = wait_for(lambda: execute(admin, "SELECT pid FROM pg_stat_activity WHERE "
                                               "wait_event = 'PgSleep' AND datname = "
                                               "current_database()"), timeout=180)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    execute(admin, f"SELECT pg_terminate_backend({sleeping[0][0]})",
            "DROP TRIGGER slow_count ON tasks", "DROP FUNCTION public.slow_count()")
    second = start("explore", str(config_path), "--workers", "1", cwd=tmp_path)
    wait_for(lambda: query(db_url, "SELECT min(times_explored) FROM tasks")[0][0] >= 2,
             timeout=180)
    execute(db_url, "UPDATE runs SET status = 'stopped' WHERE name = 'once'")
    finish(second, timeout=120)
    counted = query(db_url, """
        SELECT t.id, t.times_explored, (SELECT count(DISTINCT group_id) FROM experiences e
                                        WHERE e.task_id = t.id) AS groups
        FROM tasks t ORDER BY t.id""")
    assert all(row.groups == row.times_explored for row in counted), counted
