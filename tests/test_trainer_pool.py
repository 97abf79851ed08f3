"""The data-parallel trainer pool (trainer.workers: N): real spawned ranks, real gloo.

Two ranks train the same steps to the same weights as one; a follower killed mid-run fails the
step it was in (nothing committed, nothing lost) and `--resume` finishes the run; followers of a
killed rank 0 exit by themselves, and the resumed pool ends where a pool never killed ends.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
import yaml

from reservoir.config import parse_config
from reservoir.errors import ReservoirError
from reservoir.models import build_tiny_model, load_model
from reservoir.prepare import ensure_run
from reservoir.store import Store
from reservoir.trainer.batch import make_batch
from reservoir.trainer.learner import Learner
from reservoir.trainer.ranks import TrainerPool
from tests.test_recovery import (finish, offline_groups, query, start, trainer_config, wait_for,
                                 write_config)
from tests.test_restart import own_server  # noqa: F401 (a fixture)
from tests.test_run import ledger

pytestmark = [pytest.mark.store_agnostic, pytest.mark.slow]  # the same on any server: CI runs it once



def pool_config(tmp_path: Path, db_url: str, model: Path):
    return parse_config({
        "run": {"name": "pool", "mode": "async", "seed": 3}, "model": {"path": str(model)},
        "tasks": {"generate": "reverse", "count": 20}, "explorer": {"n": 4},
        "trainer": {"batch_groups": 2, "micro_batch": 3, "lr": 1e-3, "workers": 2,
                    "device": "cpu", "checkpoint_dir": str(tmp_path / "ck")},
        "sampler": {"max_staleness": 100}, "store": {"url": db_url}})


def test_two_ranks_train_the_weights_one_worker_trains(tmp_path, store, db_url):
    config = pool_config(tmp_path, db_url, build_tiny_model(tmp_path / "tiny", seed=11))
    ensure_run(store, config)
    store.write_groups(offline_groups("pool", 8))
    flat = offline_groups("pool", 2)  # the last step's groups: no signal, the update skipped
    for row in (row for group in flat for row in group):
        row.reward, row.reward_components = 1.0, {"accuracy": 1.0}
    store.write_groups(flat)
    batches = [sorted(store.lease("pool", groups=2).rows, key=lambda row: row.id)
               for _ in range(5)]
    learner = Learner(config)
    learner.begin(learner.plan[0])
    single, pad = learner.model, learner.tokenizer.pad_token_id
    learner.train(1, make_batch(batches[0], pad))  # optimizer state to load
    checkpoint = learner.save(tmp_path / "ck", 1, 0)
    start_weights = {name: p.detach().clone() for name, p in single.named_parameters()}
    alone = [learner.train(step, make_batch(rows, pad))
             for step, rows in enumerate(batches[1:], 2)]

    pooled_learner = Learner(config)
    pooled_learner.load(checkpoint)
    ranked = pooled_learner.model
    with TrainerPool(config, pooled_learner) as pool:
        pool.load(checkpoint)
        pooled = [pool.train(step, rows, make_batch(rows, pad))
                  for step, rows in enumerate(batches[1:], 2)]
        followers = list(pool.followers)
    assert [p.exitcode for p in followers] == [0]  # STOP: a clean exit

    moved = max(float((p.detach() - start_weights[name]).abs().max())
                for name, p in single.named_parameters())
    assert moved > 1e-3  # the steps did change the weights
    # the sums differ in order; AdamW magnifies that most where the true gradient is 0 (the
    # attention key biases), so the learning rate is kept small enough for 1e-5 to be a test
    for (name, a), (_, b) in zip(single.named_parameters(), ranked.named_parameters()):
        assert float((a - b).detach().abs().max()) <= 1e-5, name
    for one, two in zip(alone, pooled):
        assert two["loss"] == pytest.approx(one["loss"], abs=1e-5)
        assert two["train_tokens"] == one["train_tokens"]
    assert [m.get("skipped_update") for m in alone] == [None, None, None, 1.0]
    assert [m.get("skipped_update") for m in pooled] == [None, None, None, 1.0]


def leased_in_a_stage(store, config) -> tuple[list, Learner]:
    """Two groups of the pool's run written and leased (in id order), and a learner that has
    begun the run's first stage."""
    ensure_run(store, config)
    store.write_groups(offline_groups("pool", 2))
    rows = sorted(store.lease("pool", groups=2).rows, key=lambda row: row.id)
    learner = Learner(config)
    learner.begin(learner.plan[0])
    return rows, learner


def test_a_killed_follower_fails_the_step_in_process(tmp_path, store, db_url):
    config = pool_config(tmp_path, db_url, build_tiny_model(tmp_path / "tiny", seed=12))
    rows, learner = leased_in_a_stage(store, config)
    with TrainerPool(config, learner) as pool:
        follower = pool.followers[0]
        os.kill(follower.pid, signal.SIGKILL)
        follower.join(10)
        with pytest.raises(ReservoirError, match=rf"trainer rank 1 \(pid {follower.pid}\) was "
                                                 r"killed by SIGKILL during step 7, which was "
                                                 r"not committed; continue the run with --resume"):
            pool.train(7, rows, make_batch(rows, learner.tokenizer.pad_token_id))


def followers_of(pid: int) -> list[int]:
    """Pids of the trainer ranks a process spawned (multiprocessing's spawn children)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if parent == pid and b"spawn_main" in cmdline:
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_killed_follower_fails_the_run_loses_nothing_and_resume_finishes(tmp_path, db_url):
    model = build_tiny_model(tmp_path / "tiny", seed=13)
    config_path = write_config(tmp_path / "run.yaml", {
        "run": {"name": "pool"}, "model": {"path": str(model)},
        "tasks": {"generate": "reverse", "count": 60},
        "explorer": {"n": 4, "batch_tasks": 2, "max_tokens": 4},
        "trainer": {"steps": 6, "batch_groups": 2, "micro_batch": 8, "workers": 2,
                    "eval_interval": 100, "checkpoint_interval": 100,
                    "checkpoint_dir": str(tmp_path / "ck")},
        "store": {"url": db_url}})
    trainer = start("train", str(config_path), cwd=tmp_path)
    explorer = start("explore", str(config_path), cwd=tmp_path)
    wait_for(lambda: query(db_url, "SELECT 1 FROM train_steps WHERE step >= 2"), timeout=240)
    (follower,) = followers_of(trainer.pid)
    os.kill(follower, signal.SIGKILL)
    killed = time.monotonic()
    output, _ = trainer.communicate(timeout=120)
    assert trainer.returncode == 1 and time.monotonic() - killed < 30, output
    failed = re.fullmatch(rf"error: trainer rank 1 \(pid {follower}\) was killed by SIGKILL "
                          r"during step (\d+), which was not committed; continue the run with "
                          r"--resume", output.strip().splitlines()[-1])
    assert failed, output
    time.sleep(3)  # issue 28: it exited with code 0, and a resumed trainer had no explorer
    assert explorer.poll() is None  # it waits for the trainer to resume
    assert query(db_url, "SELECT status, max(step) FROM runs, train_steps GROUP BY 1") == [
        ("failed", int(failed.group(1)) - 1)]
    assert_nothing_lost(db_url)

    resumed = start("train", str(config_path), "--resume", cwd=tmp_path)
    output = finish(resumed)
    assert f"replayed {int(failed.group(1)) - 1} committed steps" in output  # through the pool
    explored = finish(explorer)
    assert "run 'pool' failed: waiting up to" in explored and "resumed" in explored, explored
    found = ledger(db_url)
    assert found["steps"] == list(range(7)) and found["status"] == "finished", output
    assert (found["bad_steps"], found["trained_twice"]) == (0, 0)
    assert_nothing_lost(db_url)
    assert query(db_url, "SELECT count(*) FROM experiences WHERE status = 'leased'") == [(0,)]


def assert_nothing_lost(db_url: str) -> None:
    """Every row is ready or consumed, and every consumed row is in the ledger."""
    statuses = {status for status, in query(db_url, "SELECT DISTINCT status FROM experiences")}
    assert statuses <= {"ready", "consumed"}, statuses
    assert query(db_url, "SELECT count(*) FROM experiences e WHERE status = 'consumed' AND NOT "
                         "EXISTS (SELECT 1 FROM batch_items b WHERE b.experience_id = e.id)"
                 ) == [(0,)]


def test_followers_exit_when_rank_0_is_killed_and_the_pool_resumes_exactly(
        tmp_path, new_database, template_db):
    """A pool killed mid-run and resumed ends at the weights of a pool never killed (equal
    to one worker's only up to the order of its sums: the first test)."""
    model = build_tiny_model(tmp_path / "tiny", seed=14)
    sides = {}
    for side in ("straight", "killed"):
        db_url = new_database(template_db)
        config = yaml.safe_load(trainer_config(tmp_path, side, db_url, model).read_text())
        config["trainer"] |= {"workers": 2, "checkpoint_interval": 3}
        sides[side] = (db_url, write_config(tmp_path / f"{side}.yaml", config))
        with Store(db_url) as store:
            ensure_run(store, parse_config(config))
            store.write_groups(offline_groups("offline", 8 * 2))
    finish(start("train", str(sides["straight"][1]), cwd=tmp_path))

    db_url, config_path = sides["killed"]
    victim = start("train", str(config_path), cwd=tmp_path)
    wait_for(lambda: query(db_url, "SELECT 1 FROM train_steps WHERE step >= 2"), timeout=180)
    (follower,) = followers_of(victim.pid)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    wait_for(lambda: not alive(follower), timeout=15)
    killed_at = query(db_url, "SELECT max(step) FROM train_steps")[0][0]
    assert 2 <= killed_at < 8
    output = finish(start("train", str(config_path), "--resume", cwd=tmp_path))
    checkpoint, replayed = map(int, re.search(r"\(step (\d+)\); replayed (\d+) committed",
                                              output).groups())
    assert replayed == killed_at - checkpoint, output  # through the pool, from the ledger
    found = ledger(db_url)
    assert found["steps"] == list(range(9)) and found["status"] == "finished"
    weights = [load_model(tmp_path / side / "offline" / "step-000008")[0].state_dict()
               for side in ("straight", "killed")]
    for name, tensor in weights[0].items():
        torch.testing.assert_close(weights[1][name], tensor, atol=1e-5, rtol=0, msg=name)


def test_a_follower_waits_out_a_database_outage_in_its_step(tmp_path, own_server):
    """Issue 28: rank 1 fetched its step's rows with no patience, so a PostgreSQL restart
    failed the run ('connection was closed in the middle of operation') while rank 0 and the
    explorers waited it out. Here the store is down when the follower fetches: it waits, and
    the step finishes once the store is back."""
    import threading

    config = pool_config(tmp_path, own_server.url, build_tiny_model(tmp_path / "tiny", seed=15))
    with Store.open(config, migrate=True, quiet=True) as store:
        rows, learner = leased_in_a_stage(store, config)
    with TrainerPool(config, learner) as pool:
        pool.load(learner.save(tmp_path / "ck", 0, 0))  # every rank in the stage
        own_server.stop()
        outcome: list = []
        stepping = threading.Thread(target=lambda: outcome.append(_train_or_error(
            pool, rows, make_batch(rows, learner.tokenizer.pad_token_id))))
        stepping.start()
        time.sleep(3)  # the follower asks the store for the rows now, and waits
        own_server.start()
        stepping.join(120)
        followers = list(pool.followers)
    assert isinstance(outcome[0], dict) and outcome[0]["loss"] == outcome[0]["loss"], outcome
    assert [p.exitcode for p in followers] == [0]


def _train_or_error(pool, rows, batch):
    try:
        return pool.train(1, rows, batch)
    except Exception as exc:
        return exc
