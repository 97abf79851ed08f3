"""Experiment trackers follow a run from the store (issue 33): TensorBoard, MLflow (file
store) and W&B (offline) at once, read back with their own libraries and compared with
analytics.run_steps; no step logged twice when tracking resumes; a tracker that cannot reach
its server is one warning and the run finishes; `reservoir runs track` replays a finished run."""

from __future__ import annotations

import glob
import json
import os
import struct
from pathlib import Path

import pytest
from sqlalchemy import text

from reservoir import pool
from reservoir.store import Store
from reservoir.tracking import replay
from reservoir.tracking.trackers import configured
from tests.commands import RESERVOIR, command_env
from tests.test_run import run_config

pytestmark = pytest.mark.slow


def run_steps(db_url: str) -> dict[int, tuple]:
    """{step: (loss, reward_mean)} of run r, as analytics.run_steps says."""
    with Store(db_url) as store, store.engine.connect() as conn:
        return {row.step: (row.loss, row.reward_mean) for row in conn.execute(text(
            "SELECT step, loss, reward_mean FROM analytics.run_steps WHERE run = 'r'"))}


def tensorboard_series(folder: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)] if tag in events.Tags()["scalars"] \
        else []


def mlflow_series(uri: str, tag: str) -> list[tuple[int, float]]:
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # mlflow 3 opts in to a file store so
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    [run] = client.search_runs([client.get_experiment_by_name("reservoir").experiment_id])
    return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, tag))


def _wandb_records(path: str):
    """The records of a .wandb file (its own framing: 32 KiB blocks of [crc][len][type][data])."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    position, pending, block = 7, b"", 32768
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:
            position += left
            continue
        length, kind = struct.unpack("<HB", data[position + 4:position + 7])
        chunk = data[position + 7:position + 7 + length]
        position += 7 + length
        if len(chunk) < length:
            break
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_series(folder: Path, tag: str) -> list[tuple[int, float]]:
    """Every offline run folder's history rows, merged by step."""
    found = []
    for path in sorted(glob.glob(str(folder / "wandb" / "offline-run-*" / "*.wandb"))):
        for record in _wandb_records(path):
            if record.WhichOneof("record_type") == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                       for item in record.history.item}
                if tag in row:
                    found.append((row["_step"], float(row[tag])))
    return sorted(found)


def all_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of a TensorBoard run folder, and the steps of its samples."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    found = {tag: [(e.step, e.value) for e in events.Scalars(tag)]
             for tag in events.Tags()["scalars"]}
    if "samples" in events.Tags()["tensors"]:
        found["samples"] = [(e.step, 0.0) for e in events.Tensors("samples")]
    return found


def same(series: list[tuple[int, float]], expected: list[tuple[int, float]]) -> bool:
    """The same steps, once each, with the same values (float32 in TensorBoard)."""
    return [step for step, _ in series] == [step for step, _ in expected] and \
        [value for _, value in series] == pytest.approx([v for _, v in expected], rel=1e-6,
                                                        abs=1e-7)


def tracked_config(tmp_path, db_url, placement: str = "split", **tracking):
    config = run_config(tmp_path, db_url, explorer={"workers": 1},
                        trainer={"steps": 4, "eval_interval": 2},
                        run={"name": "r", "placement": placement})
    return config.model_copy(update={"tracking": type(config.tracking).model_validate(tracking)})


def test_three_trackers_at_once_log_every_step_as_the_store_has_it(tmp_path, db_url,
                                                                   monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = f"file://{tmp_path / 'mlruns'}"
    config = tracked_config(tmp_path, db_url, tensorboard={"dir": str(tmp_path / "tb")},
                            mlflow={"tracking_uri": uri}, wandb={"project": "reservoir-test",
                                                                "dir": str(tmp_path)})
    gate = tmp_path / "gate.yaml"
    gate.write_text("mode: stream\nsource: {status: [raw]}\n"
                    "process:\n  - text_length_filter: {min_len: 2}\n")
    config = config.model_copy(update={"pipelines": [gate]})
    assert pool.run(config).steps == 4
    expected = run_steps(db_url)
    losses = [(s, loss) for s, (loss, _) in sorted(expected.items()) if loss is not None]
    rewards = [(s, r) for s, (_, r) in sorted(expected.items()) if r is not None]
    assert len(losses) >= 4 and len(rewards) >= 4
    for series in (lambda tag: tensorboard_series(tmp_path / "tb" / "r", tag),
                   lambda tag: mlflow_series(uri, tag),
                   lambda tag: wandb_series(tmp_path, tag)):
        assert same(series("loss"), losses) and same(series("reward_mean"), rewards)
    # tracking again (a resumed run, or runs track) continues where it got to: nothing twice
    with Store(db_url) as store:
        assert replay(store, "r", configured(config.tracking)) == 0
    assert same(tensorboard_series(tmp_path / "tb" / "r", "loss"), losses)
    assert same(mlflow_series(uri, "loss"), losses)
    the_step_windows_say_what_the_views_say(db_url, tmp_path, uri)


WINDOWS = """
WITH s AS (SELECT step, created_at AS until,
                  lag(created_at) OVER (ORDER BY step) AS since
           FROM analytics.run_steps WHERE run = 'r')
SELECT s.step, {value} FROM s JOIN {view} x ON x.{time} >= s.since AND x.{time} < s.until
{where} GROUP BY s.step ORDER BY s.step"""


def the_step_windows_say_what_the_views_say(db_url: str, tmp_path: Path, uri: str) -> None:
    """Each step's explorer and pipeline series are the sums, over the window since the step
    before, that analytics.explorer_rounds and analytics.pipeline_runs give; evaluations carry
    samples and the run's report went to the trackers as artifacts."""
    from mlflow.tracking import MlflowClient

    def windows(value: str, view: str, time: str, where: str = "") -> list[tuple]:
        with Store(db_url) as store, store.engine.connect() as conn:
            return [(step, float(v)) for step, v in conn.execute(text(WINDOWS.format(
                value=value, view=view, time=time, where=where)))]

    tensorboard = tmp_path / "tb" / "r"
    rollouts = windows("sum(x.experiences)", "analytics.explorer_rounds", "finished_at",
                       "WHERE x.run = 'r'")
    assert len(rollouts) >= 3 and same(tensorboard_series(tensorboard, "explorer/rollouts"),
                                       rollouts)
    assert same(mlflow_series(uri, "explorer/rollouts"), rollouts)
    assert tensorboard_series(tensorboard, "explorer/rollouts_per_s")
    assert tensorboard_series(tensorboard, "explorer/update_s")  # weights loaded in place
    kept = windows("sum((o ->> 'out')::int)", "analytics.pipeline_runs", "finished_at",
                   ", jsonb_array_elements(x.operators) o WHERE x.pipeline = 'gate' "
                   "AND x.status = 'succeeded'")
    assert kept and same(tensorboard_series(tensorboard, "pipeline/gate/text_length_filter/kept"),
                         [(step, value) for step, value in kept])
    # samples at the evaluations (steps 2 and 4), the report's plots as artifacts
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tensorboard), size_guidance={"tensors": 0, "images": 0})
    events.Reload()
    assert [e.step for e in events.Tensors("samples")] == [2, 4]
    assert any(tag.startswith("report/") for tag in events.Tags()["images"])
    client = MlflowClient(tracking_uri=uri)
    [run] = client.search_runs([client.get_experiment_by_name("reservoir").experiment_id])
    listed = {item.path for folder in ("samples", "report")
              for item in client.list_artifacts(run.info.run_id, folder)}
    assert {"samples/step-000002.json", "samples/step-000004.json"} <= listed
    assert any(path.startswith("report/") and path.endswith(".png") for path in listed)


def test_a_tracker_that_cannot_reach_its_server_is_one_warning_and_the_run_finishes(
        tmp_path, db_url, capfd):
    config = tracked_config(tmp_path, db_url, "colocated",  # the trainer in this process
                            mlflow={"tracking_uri": "http://127.0.0.1:9"})
    assert pool.run(config).steps == 4
    warnings = [line for line in capfd.readouterr().err.splitlines()
                if "trackers: warning: tracker mlflow" in line]
    assert len(warnings) == 1, warnings


def test_runs_track_replays_a_finished_run_as_live_tracking_logged_it(tmp_path, db_url):
    import subprocess

    config = tracked_config(tmp_path, db_url, tensorboard={"dir": str(tmp_path / "live")})
    pool.run(config)
    done = subprocess.run([RESERVOIR, "runs", "track", "r", str(tmp_path / "later"), "--to",
                           "tensorboard"], env=command_env(db_url), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "steps logged to tensorboard" in done.stdout
    live, later = (all_scalars(tmp_path / folder / "r") for folder in ("live", "later"))
    assert {"loss", "reward_mean", "eval/accuracy", "explorer/rollouts"} <= live.keys()
    assert later == live  # every series, the explorers' and the samples' steps included
    again = subprocess.run([RESERVOIR, "runs", "track", "r", str(tmp_path / "later"), "--to",
                            "tensorboard"], env=command_env(db_url), capture_output=True,
                           text=True, timeout=120)
    assert "0 steps logged" in again.stdout  # it continues where it got to


@pytest.fixture(autouse=True)
def _quiet_trackers(monkeypatch):
    for name in ("WANDB_MODE", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.delenv(name, raising=False)
    yield
    for name in ("WANDB_MODE", "MLFLOW_ALLOW_FILE_STORE"):
        os.environ.pop(name, None)


HOLD_STEP = 5_550_001  # the advisory lock key a test holds a step's commit on


@pytest.mark.process
def test_a_run_killed_and_resumed_logs_each_step_once(tmp_path, db_url, as_admin):
    """SIGKILL mid-run, then --resume: the same MLflow run continues, and TensorBoard and
    MLflow hold every step once, with the store's values."""
    import signal

    from tests.commands import execute, holding
    from tests.test_colocated import colocated
    from tests.test_recovery import finish, query, start, wait_for, write_config

    uri = f"file://{tmp_path / 'mlruns'}"
    raw = colocated(tmp_path, db_url, trainer={"steps": 60, "checkpoint_interval": 3,
                                               "eval_interval": 100,
                                               "checkpoint_dir": str(tmp_path / "ckpt")})
    raw["tracking"] = {"tensorboard": {"dir": str(tmp_path / "tb")},
                       "mlflow": {"tracking_uri": uri}, "interval_s": 0.5}
    config = write_config(tmp_path / "run.yaml", raw)
    # step 5's commit waits on a lock the test holds until both trackers logged step 3 (their
    # imports take longer than the run on a loaded machine); the run is killed in that commit
    admin = as_admin(db_url)
    with holding(admin, HOLD_STEP, before="INSERT", table="train_steps",
                 condition="NEW.step >= 5") as waiting:
        victim = start("run", str(config), cwd=tmp_path)
        wait_for(lambda: query(db_url, "SELECT count(*) FROM run_trackers WHERE last_step >= 3"
                                       )[0][0] == 2, timeout=240)  # each tracker logged steps
        held = wait_for(waiting, timeout=120)
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        execute(admin, f"SELECT pg_terminate_backend({held[0]})")  # step 5 never commits
    assert query(db_url, "SELECT max(step) FROM train_steps")[0][0] == 4  # killed mid-run
    finish(start("run", str(config), "--resume", cwd=tmp_path))
    expected = sorted((step, loss) for step, loss in query(
        db_url, "SELECT step, loss FROM analytics.run_steps WHERE loss IS NOT NULL"))
    assert [step for step, _ in expected][-1] == 60
    run_name = raw["run"]["name"]
    assert same(tensorboard_series(tmp_path / "tb" / run_name, "loss"), expected)
    assert same(mlflow_series(uri, "loss"), expected)  # one MLflow run, continued


@pytest.mark.process
def test_trackers_that_cannot_reach_the_store_at_their_start_are_one_warning(tmp_path):
    """The trackers' process opens its own store; unreachable at its start it says one
    warning line back to the trainer (no traceback) and exits: the run goes on."""
    import subprocess
    import sys

    gone = "postgresql://nobody:secret@127.0.0.1:1/nothing"
    orders = {"config": {"run": {"name": "r"}, "store": {"url": gone}, "sampler": {},
                         "tracking": {"tensorboard": {"dir": str(tmp_path / "tb")}}},
              "parent": os.getpid(), "report": None}
    done = subprocess.run(
        [sys.executable, "-c", "from reservoir.tracking.follow import follower; follower()"],
        input=json.dumps(orders) + "\n", capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(lines) == 1 and "the trackers stopped (the run goes on)" in json.dumps(lines[0])
    assert "secret" not in done.stdout
