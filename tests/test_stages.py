"""Stages: sft on tasks -> grpo on the run's groups -> dpo on pairs, in one run; a stage that
trains on another run's stored rows; resume inside a multi-stage run. The real `reservoir`
command in subprocesses against test databases."""

from __future__ import annotations

import signal

import pytest
import torch
import yaml

from reservoir.config import parse_config
from reservoir.models import build_tiny_model, load_model
from reservoir.prepare import ensure_run
from reservoir.store import Store
from tests.test_recovery import (finish, offline_groups, query, start, trainer_config, wait_for,
                                 write_config)

pytestmark = [pytest.mark.store_agnostic, pytest.mark.slow]  # the same on any server: CI runs it once

STAGES = [
    {"name": "warm", "algorithm": "sft", "steps": 4, "batch": 4, "lr": 3e-3,
     "data": {"tasks": {"fraction": 0.25}}},
    {"name": "rl", "algorithm": "rloo", "steps": 4},
    {"name": "prefer", "algorithm": {"preset": "dpo", "beta": 0.2}, "steps": 3, "batch": 2,
     "data": {"preferences": {}}},
]


def staged_config(tmp_path, side, db_url, model, stages=STAGES, name="offline"):
    config = yaml.safe_load(trainer_config(tmp_path, side, db_url, model).read_text())
    del config["trainer"]["steps"]
    config["run"]["name"] = name
    config["stages"] = stages
    config["trainer"]["checkpoint_interval"] = 3
    return write_config(tmp_path / f"{side}.yaml", config)


def fill_with_pairs(db_url, config_path, groups=16):
    """The run's groups (ready for the rl stage) and a pair per group (best over worst)."""
    with Store(db_url) as store:
        ensure_run(store, parse_config(yaml.safe_load(config_path.read_text())))
        store.write_groups(offline_groups("offline", groups))
    rows = query(db_url, "SELECT group_id, id, reward FROM experiences ORDER BY id")
    by_group = {}
    for group, row_id, reward in rows:
        by_group.setdefault(group, []).append((reward, row_id))
    with Store(db_url) as store:
        store.add_pairs([(max(rows)[1], min(rows)[1], 1.0, "test")
                         for rows in by_group.values()])


def test_a_run_of_three_stages_records_each_step_s_stage_and_data(tmp_path, db_url):
    model = build_tiny_model(tmp_path / "tiny", seed=4)
    config_path = staged_config(tmp_path, "staged", db_url, model)
    fill_with_pairs(db_url, config_path)
    output = finish(start("train", str(config_path), cwd=tmp_path))
    assert "stage 'prefer'" in output
    steps = query(db_url, "SELECT step, stage, n_experiences FROM train_steps ORDER BY step")
    assert steps == [(0, None, 0)] + [(s, "warm", 0) for s in range(1, 5)] + \
        [(s, "rl", 8) for s in range(5, 9)] + [(s, "prefer", 4) for s in range(9, 12)]
    train, warmed = query(db_url, "SELECT count(*), count(*) FILTER (WHERE times_explored >= "
                                  "1000000) FROM tasks WHERE split = 'train'")[0]
    assert warmed == max(1, int(train * 0.25))  # the stage's own share (issue 31)
    assert query(db_url, "SELECT count(*), count(DISTINCT preference_id) FROM batch_pairs") == \
        [(6, 6)]
    assert query(db_url, "SELECT DISTINCT status FROM preferences WHERE id IN "
                         "(SELECT preference_id FROM batch_pairs)") == [("consumed",)]
    assert query(db_url, "SELECT min(version), max(version), min(train_step) "
                         "FROM policy_versions") == [(0, 4, 4)]  # rl's versions only
    metrics = query(db_url, "SELECT metrics FROM train_steps WHERE stage = 'prefer'")
    assert all("dpo/accuracy" in m for (m,) in metrics)


def test_a_stage_on_another_run_s_stored_rows_points_the_ledger_at_them(tmp_path, db_url):
    model = build_tiny_model(tmp_path / "tiny", seed=5)
    source = trainer_config(tmp_path, "source", db_url, model)
    with Store(db_url) as store:
        ensure_run(store, parse_config(yaml.safe_load(source.read_text())))
        store.write_groups(offline_groups("offline", 6))
    stages = [{"name": "best", "algorithm": "sft", "steps": 4, "batch": 2,
               "data": {"stored": {"runs": ["offline"], "status": ["ready"],
                                   "select": "best", "where": "reward > 0.5"}}}]
    student = staged_config(tmp_path, "student", db_url, model, stages, name="student")
    finish(start("train", str(student), cwd=tmp_path))
    used = query(db_url, """
        SELECT ts.step, e.id, r.name, e.reward, e.status FROM batch_items bi
        JOIN train_steps ts ON ts.id = bi.train_step_id JOIN runs sr ON sr.id = ts.run_id
        JOIN experiences e ON e.id = bi.experience_id JOIN runs r ON r.id = e.run_id
        WHERE sr.name = 'student' ORDER BY ts.step, e.id""")
    assert {step for step, *_ in used} == {1, 2, 3, 4}
    assert all(run == "offline" and reward == 1.0 and status == "ready"
               for _, _, run, reward, status in used)  # read, not consumed
    per_step = [sum(1 for row in used if row[0] == step) for step in (1, 2, 3, 4)]
    assert per_step == [2, 2, 2, 2]  # one best row per group, two groups per step
    groups = query(db_url, "SELECT count(DISTINCT e.group_id) FROM batch_items bi "
                           "JOIN experiences e ON e.id = bi.experience_id")
    assert groups == [(6,)]  # 8 draws cycle through the 6 groups


def test_resume_inside_a_multi_stage_run_reproduces_the_weights(tmp_path, new_database,
                                                                 template_db):
    model = build_tiny_model(tmp_path / "tiny", seed=6)
    paths = {}
    for side in ("straight", "killed"):
        db_url = new_database(template_db)
        paths[side] = (db_url, staged_config(tmp_path, side, db_url, model))
        fill_with_pairs(db_url, paths[side][1])
    finish(start("train", str(paths["straight"][1]), cwd=tmp_path))
    db_url, config_path = paths["killed"]
    victim = start("train", str(config_path), cwd=tmp_path)
    wait_for(lambda: query(db_url, "SELECT 1 FROM train_steps WHERE step >= 7"), timeout=180)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    output = finish(start("train", str(config_path), "--resume", cwd=tmp_path))
    assert "resumed run 'offline' from step-" in output
    weights = [load_model(tmp_path / side / "offline" / "step-000011")[0].state_dict()
               for side in ("straight", "killed")]
    for name, tensor in weights[0].items():
        torch.testing.assert_close(weights[1][name], tensor, atol=1e-5, rtol=0, msg=name)


def test_from_run_at_step_starts_from_that_step_with_its_tasks_and_experiences(tmp_path,
                                                                               db_url):
    model = build_tiny_model(tmp_path / "tiny", seed=7)
    parent = staged_config(tmp_path, "runs", db_url, model)
    fill_with_pairs(db_url, parent)
    finish(start("train", str(parent), cwd=tmp_path))
    stages = [{"name": "best", "algorithm": "sft", "steps": 2, "batch": 3,
               "data": {"stored": {"status": ["consumed", "ready"], "select": "best"}}}]
    child = staged_config(tmp_path, "runs", db_url, model, stages, name="branch")
    output = finish(start("train", str(child), "--from", "offline@6", cwd=tmp_path))
    assert "run 'branch': 2 steps" in output
    weights = [load_model(tmp_path / "runs" / run / step)[0].state_dict()
               for run, step in (("offline", "step-000006"), ("branch", "step-000000"))]
    for name, tensor in weights[0].items():
        assert torch.equal(weights[1][name], tensor), name
    assert query(db_url, "SELECT parent_run, parent_step FROM analytics.runs "
                         "WHERE run = 'branch'") == [("offline", 6)]
    assert query(db_url, "SELECT count(*) FROM tasks GROUP BY run_id ORDER BY run_id") == \
        [(20,), (20,)]
    read = query(db_url, """
        SELECT DISTINCT r.name, e.created_at <= (SELECT created_at FROM train_steps
                                                 WHERE run_id = e.run_id AND step = 6)
        FROM batch_items bi JOIN train_steps ts ON ts.id = bi.train_step_id
        JOIN runs b ON b.id = ts.run_id AND b.name = 'branch'
        JOIN experiences e ON e.id = bi.experience_id JOIN runs r ON r.id = e.run_id""")
    assert read == [("offline", True)]  # the parent's rows as they were at step 6
    refused = start("train", str(staged_config(tmp_path, "runs", db_url, model, stages,
                                               name="branch2")),
                    "--from", "offline@5", cwd=tmp_path)
    output, _ = refused.communicate(timeout=120)
    assert refused.returncode != 0 and "no checkpoint of step 5" in output
    assert "checkpoints there: 0, 3, 4, 6, 8, 9, 11" in output


def test_dynamic_sampling_trains_only_groups_with_signal_and_records_the_rest(tmp_path,
                                                                             db_url):
    model = build_tiny_model(tmp_path / "tiny", seed=8)
    config = yaml.safe_load(trainer_config(tmp_path, "dapo", db_url, model).read_text())
    config["trainer"]["steps"] = 3
    config["sampler"]["dynamic_sampling"] = True
    config_path = write_config(tmp_path / "dapo.yaml", config)
    groups = offline_groups("offline", 12)
    for group in groups[::2]:  # every other group: one reward for all its responses
        for experience in group:
            experience.reward = 1.0
    with Store(db_url) as store:
        ensure_run(store, parse_config(config))
        store.write_groups(groups)
    finish(start("train", str(config_path), cwd=tmp_path))
    trained = query(db_url, """
        SELECT e.group_id, count(DISTINCT e.reward) FROM batch_items bi
        JOIN experiences e ON e.id = bi.experience_id GROUP BY e.group_id""")
    assert len(trained) == 6 and all(rewards == 2 for _, rewards in trained)
    aside = query(db_url, "SELECT status, metadata ->> 'set_aside', count(*) FROM experiences "
                          "WHERE metadata ? 'set_aside' GROUP BY 1, 2")
    assert aside and all(status == "retired" and reason == "zero reward variance"
                         for status, reason, _ in aside)
    skipped = query(db_url, "SELECT sum((metrics ->> 'dynamic/set_aside_groups')::int), "
                            "max((metrics ->> 'advantage/zero_variance_groups')::float8) "
                            "FROM train_steps WHERE step > 0")
    assert skipped == [(sum(n for *_, n in aside) // 4, 0.0)]
    assert query(db_url, "SELECT rows_sampled FROM runs") == [(24,)]  # set-aside rows uncounted


def test_a_dpo_stage_takes_epochs_over_its_pairs_or_says_it_ran_out(tmp_path, db_url):
    model = build_tiny_model(tmp_path / "tiny", seed=9)
    stages = [{"name": "prefer", "algorithm": "dpo", "steps": 3, "batch": 2,
               "data": {"preferences": {}}}]
    config_path = staged_config(tmp_path, "epochs", db_url, model, stages)
    fill_with_pairs(db_url, config_path, groups=2)
    finish(start("train", str(config_path), cwd=tmp_path))
    # three epochs over the two pairs, one a step
    assert query(db_url, "SELECT count(*), sum(times_sampled) FROM preferences") == [(2, 6)]
    assert query(db_url, "SELECT count(*), count(DISTINCT train_step_id) FROM batch_pairs") == \
        [(6, 3)]
    raw = yaml.safe_load(config_path.read_text())
    raw["run"]["name"] = "once"
    raw["stages"][0]["data"]["preferences"] = {"runs": ["offline"], "epochs": False}
    raw["trainer"]["wait_timeout_s"] = 2
    refused = start("train", str(write_config(tmp_path / "once.yaml", raw)), cwd=tmp_path)
    output, _ = refused.communicate(timeout=120)
    assert refused.returncode == 1 and "no preference pair of run ids" in output


def test_a_hostile_where_in_a_stored_stage_is_one_line_naming_its_key(tmp_path, db_url):
    """Checked with the config (issue 28: it was checked only when its stage started, after
    the run was made and earlier stages had trained)."""
    model = build_tiny_model(tmp_path / "tiny", seed=10)
    config = yaml.safe_load(trainer_config(tmp_path, "hostile", db_url, model).read_text())
    del config["trainer"]["steps"]
    config["stages"] = [{"name": "best", "algorithm": "sft", "steps": 1, "data": {
        "stored": {"status": ["ready"], "where": "true) OR (true"}}}]
    path = tmp_path / "hostile.yaml"
    path.write_text(yaml.safe_dump(config))
    refused = start("train", str(path), cwd=tmp_path)
    output, _ = refused.communicate(timeout=120)
    assert refused.returncode == 1
    last = output.strip().splitlines()[-1]
    assert last.startswith(f"error: {path}: invalid: stages.0.data.stored.where") and \
        "closes a parenthesis" in last, last
    assert query(db_url, "SELECT count(*) FROM runs") == [(0,)]
