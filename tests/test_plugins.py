"""A package outside Reservoir (examples/partial_credit_plugin), installed for real with pip,
registers a reward function and a workflow through entry points: configs and task files name
them, a run's explorer uses them, and a name nobody registered is one line naming the file,
row and column."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reservoir.plan.tasks import reverse
from reservoir.models import build_tiny_model, load_model
from reservoir.trainer.sft import supervised
from tests.commands import RESERVOIR
from tests.test_recovery import query
from tests.test_run import ledger

pytestmark = [pytest.mark.store_agnostic, pytest.mark.process]  # the same on any server: CI runs it once

PLUGIN = Path(__file__).resolve().parent.parent / "examples" / "partial_credit_plugin"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The example package installed with pip into a folder of its own (put on PYTHONPATH)."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--target", str(target), str(PLUGIN)],
                   check=True, capture_output=True, timeout=300)
    return target


def with_plugin(site: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(site), "COLUMNS": "200"}


def answering_model(folder: Path) -> Path:
    """The tiny model after a little sft: it ends its turns, so second attempts happen."""
    model, tokenizer = load_model(build_tiny_model(folder, seed=0))
    torch.manual_seed(0)
    supervised(model, tokenizer, [(row["prompt"], row["answer"]) for row in reverse(200)],
               steps=60, batch_size=32, lr=3e-3)
    model.save_pretrained(folder)
    return folder


def test_the_installed_package_s_names_are_registered(site):
    check = ("from reservoir.explorer.rewards import REWARDS\n"
             "from reservoir.explorer.workflow import WORKFLOWS\n"
             "print(REWARDS.get('char_match')('olxeh', 'olleh'), 'second_try' in WORKFLOWS.names())")
    out = subprocess.run([sys.executable, "-c", check], env=with_plugin(site), text=True,
                         capture_output=True, check=True).stdout
    assert out.strip() == "{'chars': 0.8} True"


@pytest.mark.slow
def test_a_task_file_names_a_reward_per_row(site, tmp_path, db_url):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(json.dumps(row) for row in [
        {"prompt": "Reverse: abc", "answer": "cba", "reward": "char_match"},
        {"prompt": "What is 2 + 2?", "answer": "4", "reward": "last_number"}]) + "\n")
    env = {**with_plugin(site), "RESERVOIR_DB_URL": db_url}
    loaded = subprocess.run([str(RESERVOIR), "tasks", "load", str(tasks), "--run", "t"],
                            env=env, text=True, capture_output=True, cwd=tmp_path)
    assert loaded.returncode == 0, loaded.stderr
    assert query(db_url, "SELECT payload->>'reward' FROM tasks ORDER BY id") == [
        ("char_match",), ("last_number",)]
    tasks.write_text(json.dumps({"prompt": "p", "answer": "a", "reward": "char_matc"}) + "\n")
    refused = subprocess.run([str(RESERVOIR), "tasks", "load", str(tasks), "--run", "u"],
                             env=env, text=True, capture_output=True, cwd=tmp_path)
    assert refused.returncode == 1
    assert refused.stderr.startswith(f"error: {tasks} row 1: column 'reward' = 'char_matc': not "
                                     "a reward function; valid: ")
    assert "char_match" in refused.stderr and query(db_url, "SELECT count(*) FROM tasks") == [(2,)]


@pytest.mark.slow
def test_a_run_explores_with_the_package_s_workflow_and_reward(site, tmp_path, db_url):
    raw = {"run": {"name": "plugin"}, "model": {"path": str(answering_model(tmp_path / "m"))},
           "tasks": {"generate": "reverse", "count": 20},
           "explorer": {"n": 2, "batch_tasks": 2, "max_tokens": 8, "workers": 1,
                        "reward": "char_match", "workflow": "second_try",
                        "workflow_options": {"retry_below": 0.5}},
           "trainer": {"steps": 1, "batch_groups": 2, "micro_batch": 4, "eval_interval": 100,
                       "checkpoint_dir": str(tmp_path / "checkpoints")},
           "store": {"url": db_url}}
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps(raw))  # YAML reads JSON; this process has no plugin to check it
    sides = [subprocess.Popen([str(RESERVOIR), *args, str(config)], env=with_plugin(site),
                              cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
             for args in (("train",), ("explore", "--workers", "1"))]
    for process in sides:
        output = process.communicate(timeout=240)[0]
        assert process.returncode == 0, output
    assert ledger(db_url)["status"] == "finished"
    rows = query(db_url, "SELECT reward, reward_components, metadata, "
                         "position('\\x00'::bytea in action_mask) > 0 AS has_zero "
                         "FROM experiences")
    assert rows and all(set(row.reward_components) == {"chars"} for row in rows)
    assert any(row.metadata["attempts"] == 2 for row in rows)
    assert all(row.reward == row.reward_components["chars"] for row in rows)
    for row in rows:  # a second attempt follows the user's request (mask 0) in one episode
        assert row.metadata["attempts"] in (1, 2) and row.has_zero == (row.metadata["attempts"] == 2)
