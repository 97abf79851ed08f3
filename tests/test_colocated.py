"""Colocated runs (run.placement: colocated): one process, one model, the store as the hub.

Rounds are generated with the trainer's own module, written, passed through the run's stream
pipelines, leased and committed through the ledger as in a split run; a SIGKILLed run resumes
to the uninterrupted run's weights.
"""

from __future__ import annotations

import re
import signal

import pytest
import torch
import yaml
from sqlalchemy import text

from reservoir import pool
from reservoir.config import parse_config
from reservoir.errors import ConfigError
from reservoir.explorer.rewards import REWARDS
from reservoir.models import build_tiny_model, load_model
from reservoir.store.engine import sync_engine
from tests.test_recovery import finish, query, start, wait_for, write_config
from tests.test_run import ledger


def colocated(tmp_path, db_url, **sections) -> dict:
    model = tmp_path / "tiny"
    if not model.exists():
        build_tiny_model(model, seed=0)
    raw = {"run": {"name": "c", "placement": "colocated", "seed": 5},
           "model": {"path": str(model)}, "tasks": {"generate": "reverse", "count": 80},
           "explorer": {"n": 4, "batch_tasks": 3, "max_tokens": 5},
           "trainer": {"steps": 4, "batch_groups": 3, "micro_batch": 12, "eval_interval": 2,
                       "lr": 0.01, "checkpoint_dir": str(tmp_path / "checkpoints")},
           "store": {"url": db_url}}
    for name, values in sections.items():
        raw[name] = raw.get(name, {}) | values
    return raw


def sql(db_url: str, statement: str):
    with sync_engine(db_url).connect() as conn:
        return conn.execute(text(statement)).all()


@pytest.mark.parametrize("key, value, message", [
    ("trainer", {"workers": 2}, "trainer.workers is 2 but run.placement is colocated"),
    ("explorer", {"workers": 2}, "explorer.workers is 2 but run.placement is colocated"),
    ("explorer", {"engine": "vllm"}, "explorer.engine is vllm but run.placement is colocated"),
    ("explorer", {"device": "cuda"}, "explorer.device is cuda but run.placement is colocated"),
])
def test_what_a_colocated_run_cannot_be_is_one_line(key, value, message):
    raw = {"run": {"placement": "colocated"}, "tasks": {"generate": "reverse"},
           key: ({"device": "cpu"} if key == "explorer" and "device" in value else {}) | value}
    if key == "explorer" and "device" in value:
        raw["trainer"] = {"device": "cpu"}
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(raw)


@pytest.mark.slow
def test_a_colocated_run_trains_its_stages_through_the_store(tmp_path, db_url):
    """A warm-up, then GRPO on rounds the trainer's own module generated, a stream pipeline
    deciding in the same process what may train: every step's rows are of the version just
    before it, versions are store rows without weight files, the pipeline's passes are rows."""
    pipeline = tmp_path / "gate.yaml"
    pipeline.write_text("mode: stream\nsource: {status: [raw]}\n"
                        "process:\n  - text_length_filter: {min_len: 2}\n")
    raw = colocated(tmp_path, db_url, trainer={"warmup_steps": 3, "warmup_batch": 8})
    raw["pipelines"] = [str(pipeline)]
    summary = pool.run(parse_config(raw))
    assert (summary.steps, summary.version) == (7, 4)
    found = ledger(db_url)
    assert found == {"steps": list(range(8)), "bad_steps": 0, "trained_twice": 0,
                     "max_staleness": 0, "versions": [0, 1, 2, 3, 4], "status": "finished",
                     "live_claims": 0}
    # the warm-up's demonstrations carry no reward: its steps claim no reward mean (trackers
    # log every metric of a step; a 0 there drew a flat line of false rewards before the RL)
    assert sql(db_url, "SELECT count(*) FROM train_steps WHERE step BETWEEN 1 AND 3 "
                       "AND metrics ? 'reward_mean'") == [(0,)]
    # version 0 is the warmed-up weights: no version has a weight file
    assert sql(db_url, "SELECT count(*) FROM policy_versions WHERE location IS NULL") == [(5,)]
    assert not (tmp_path / "checkpoints" / "c" / "policy").exists()  # no weight file written
    # each RL step trained exactly one round of the version before it, filtered by the stream
    steps = sql(db_url, "SELECT t.step, min(e.policy_version), max(e.policy_version), "
                        "count(DISTINCT e.group_id) FROM train_steps t JOIN batch_items b "
                        "ON b.train_step_id = t.id JOIN experiences e ON e.id = b.experience_id "
                        "GROUP BY t.step ORDER BY t.step")
    assert [(step, low, high) for step, low, high, _ in steps] == [
        (4, 0, 0), (5, 1, 1), (6, 2, 2), (7, 3, 3)]
    assert all(groups == 3 for *_, groups in steps)
    passes, dropped_trained = sql(db_url, """
        SELECT (SELECT count(*) FROM pipeline_runs WHERE trigger = 'stream'
                AND status = 'succeeded'),
               (SELECT count(*) FROM batch_items b JOIN operator_events o
                ON o.experience_id = b.experience_id WHERE o.kind = 'dropped')""")[0]
    assert passes >= 4 and dropped_trained == 0
    with pytest.raises(ConfigError, match="run.placement is colocated: its trainer explores"):
        pool.explore(parse_config(raw))


GENERATING_THREADS: list[int] = []


@REWARDS.register("test_records_threads")
def records_threads(response: str, answer: str) -> dict:
    """Scored while the round generates: torch's threads then (a process-wide setting)."""
    GENERATING_THREADS.append(torch.get_num_threads())
    return {"accuracy": float(response.strip() == answer)}


@pytest.mark.slow
def test_a_colocated_round_generates_with_the_explorer_threads_and_trains_with_the_trainers(
        tmp_path, db_url):
    """explorer.threads holds while a colocated round generates (it was ignored: the round
    took the trainer's); the trainer's threads come back for its steps. No task is held out:
    the trainer's evaluation generates with its own threads, as in a split run."""
    GENERATING_THREADS.clear()
    raw = colocated(tmp_path, db_url, explorer={"threads": 1, "reward": "test_records_threads"},
                    trainer={"threads": 2, "steps": 2}, tasks={"test_fraction": 0.0})
    assert pool.run(parse_config(raw)).steps == 2
    assert GENERATING_THREADS and set(GENERATING_THREADS) == {1}
    assert torch.get_num_threads() == 2


@pytest.mark.slow
def test_ppo_with_a_critic_and_a_tool_workflow_run_colocated_and_async(tmp_path, db_url):
    raw = colocated(tmp_path, db_url, run={"mode": "async"}, sampler={"max_staleness": 1},
                    tasks={"generate": "calculator", "count": 60},
                    explorer={"workflow": "calculator", "max_tokens": 12},
                    trainer={"algorithm": "ppo", "steps": 3})
    summary = pool.run(parse_config(raw))
    found = ledger(db_url)
    assert summary.steps == 3 and found["status"] == "finished"
    assert (found["bad_steps"], found["trained_twice"]) == (0, 0)
    assert found["max_staleness"] <= 1
    critic_loss = sql(db_url, "SELECT count(*) FROM train_steps WHERE metrics ? 'critic/loss'")
    assert critic_loss == [(3,)]


@pytest.mark.slow
@pytest.mark.store_agnostic  # signals and checkpoints: the same on any server
def test_a_colocated_run_killed_mid_step_resumes_to_the_uninterrupted_weights(
        tmp_path, new_database, template_db):
    sides = {}
    for side in ("straight", "killed"):
        db_url = new_database(template_db)
        raw = colocated(tmp_path, db_url, trainer={"steps": 8, "checkpoint_interval": 3,
                                                   "eval_interval": 100,
                                                   "checkpoint_dir": str(tmp_path / side)})
        sides[side] = db_url, write_config(tmp_path / f"{side}.yaml", raw)
    finish(start("run", str(sides["straight"][1]), cwd=tmp_path))
    db_url, config_path = sides["killed"]
    victim = start("run", str(config_path), cwd=tmp_path)
    # mid-step: the batch of step 5 is leased (or being explored), step 5 not committed
    wait_for(lambda: query(db_url, "SELECT 1 FROM train_steps WHERE step >= 4"))
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    killed_at = query(db_url, "SELECT max(step) FROM train_steps")[0][0]
    assert 4 <= killed_at < 8
    output = finish(start("run", str(config_path), "--resume", cwd=tmp_path))
    assert "resumed run 'c' from step-000003" in output or killed_at < 6, output

    runs = {side: ledger(url) for side, (url, _) in sides.items()}
    assert runs["killed"] == runs["straight"]
    assert (runs["killed"]["bad_steps"], runs["killed"]["trained_twice"]) == (0, 0)
    rows = {side: query(url, "SELECT status, count(*) FROM experiences GROUP BY 1")
            for side, (url, _) in sides.items()}
    assert rows["killed"] == rows["straight"] == [("consumed", 8 * 3 * 4)]
    weights = [load_model(tmp_path / side / "c" / "step-000008")[0].state_dict()
               for side in ("straight", "killed")]
    for name, tensor in weights[0].items():
        torch.testing.assert_close(weights[1][name], tensor, atol=1e-5, rtol=0, msg=name)
    assert yaml.safe_load(config_path.read_text())["run"]["placement"] == "colocated"


@pytest.mark.store_agnostic
def test_the_colocated_example_is_the_main_job_in_one_process():
    """examples/reverse_colocated is examples/reverse_grpo but for its name and placement (the
    README compares their wall time and accuracy)."""
    from pathlib import Path

    from reservoir.config import load_config

    examples = Path(__file__).resolve().parents[1] / "examples"
    split = load_config(examples / "reverse_grpo" / "config.yaml").model_dump()
    colocated = load_config(examples / "reverse_colocated" / "config.yaml").model_dump()
    assert (split["run"]["placement"], colocated["run"]["placement"]) == ("split", "colocated")
    for config in (split, colocated):
        config["run"].pop("name"), config["run"].pop("placement")
    assert colocated == split


@pytest.mark.slow
def test_a_served_colocated_run_nobody_calls_stops_after_its_wait_timeout(tmp_path, db_url):
    from reservoir.errors import FlowControlTimeout
    from tests.test_serve import free_port

    port = free_port()
    raw = colocated(tmp_path, db_url, tasks={"generate": None}, serve={"port": port},
                    trainer={"wait_timeout_s": 2})
    with pytest.raises(FlowControlTimeout, match=re.escape(
            f"trainer.wait_timeout_s: no episode was reported to http://127.0.0.1:{port}/v1 "
            "and no task was explored in 2s")):
        pool.run(parse_config(raw))
    assert ledger(db_url)["status"] == "failed"
