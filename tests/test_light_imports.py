"""`reservoir train` and `reservoir explore --workers 1` load neither Ray, Data-Juicer nor
great-expectations when the config does not use them: each side runs as its own real process
and reports, as it exits, which of those modules it had imported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from reservoir.models import build_tiny_model
from tests.test_recovery import write_config
from tests.test_run import ledger

pytestmark = [pytest.mark.store_agnostic, pytest.mark.slow, pytest.mark.process]  # the same on any server: CI runs it once

HEAVY = ("ray", "data_juicer", "great_expectations")
# the real command, plus one line at exit naming the heavy modules it imported
REPORTING = (
    "import atexit, sys\n"
    f"atexit.register(lambda: print('HEAVY', sorted(m for m in {HEAVY!r} if m in sys.modules)))\n"
    "from reservoir.cli import main\n"
    "sys.argv = ['reservoir', *sys.argv[1:]]\n"
    "main()\n")


def side(*args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", REPORTING, *args], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_train_and_one_explorer_import_no_ray_data_juicer_or_great_expectations(tmp_path, db_url):
    model = build_tiny_model(tmp_path / "tiny", seed=2)
    config = write_config(tmp_path / "run.yaml", {
        "run": {"name": "light"}, "model": {"path": str(model)},
        "tasks": {"generate": "reverse", "count": 20},
        "explorer": {"n": 2, "batch_tasks": 2, "max_tokens": 4, "workers": 1},
        "trainer": {"steps": 2, "batch_groups": 2, "micro_batch": 4, "eval_interval": 100,
                    "checkpoint_dir": str(tmp_path / "checkpoints")},
        "store": {"url": db_url}})
    trainer = side("train", str(config), cwd=tmp_path)
    explorer = side("explore", str(config), "--workers", "1", cwd=tmp_path)
    outputs = [process.communicate(timeout=240)[0] for process in (trainer, explorer)]
    for process, output in zip((trainer, explorer), outputs):
        assert process.returncode == 0, output
        assert "HEAVY []" in output, output
    assert ledger(db_url)["status"] == "finished"
