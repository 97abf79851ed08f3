"""A run's log lines (issue 33): Reservoir's own lines, one event a line with its time and
worker, from Ray actors through the relay, not Ray's driver echo (`(TrainerWorker pid=...)`
prefixes, ANSI colours, lines wrapped at 80 columns); `--log-format json` for log shippers."""

from __future__ import annotations

import datetime as dt
import io
import json
import re

import pytest
from rich.console import Console

from reservoir.logs import LogOptions, output, say, warn
from tests.test_recovery import finish, start, write_config
from tests.test_run import run_config

LONG = "a line longer than any terminal: " + "word " * 40 + "end"


def test_lines_are_never_wrapped_and_files_get_whole_lines_without_colour(tmp_path):
    screen = io.StringIO()
    console = Console(file=screen, width=40, force_terminal=True, color_system="truecolor")
    with output(console, LogOptions("text", tmp_path / "run.log")):
        say("explorer-0@host:1", LONG)
        warn("trackers", "tracker mlflow failed")
    shown = screen.getvalue().splitlines()
    assert len(shown) == 2 and shown[0].endswith(f"explorer-0@host:1: {LONG}")
    assert re.match(r"^\d\d:\d\d:\d\d explorer-0@host:1: a line longer", shown[0])
    assert "\x1b[" in shown[1] and "trackers: warning: tracker mlflow failed" in shown[1]
    written = (tmp_path / "run.log").read_text().splitlines()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z info explorer-0@host:1: "
                        + re.escape(LONG), written[0])
    assert written[1].endswith(" warning trackers: tracker mlflow failed")
    assert not any("\x1b" in line for line in written)
    with output(Console(file=io.StringIO()), LogOptions("json", tmp_path / "run.jsonl")):
        say("trainer", "two lines\nof one event")
    [event] = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert (event["worker"], event["level"], event["message"]) == \
        ("trainer", "info", "two lines\nof one event")


@pytest.mark.slow
@pytest.mark.process
def test_a_ray_run_with_json_logs_gives_only_its_own_lines(tmp_path, db_url):
    """Every line `reservoir run --log-format json` prints (stdout and stderr) is one JSON
    event; the trainer's and the explorer's lines come through the relay with their worker's
    name, including what the explorer printed (a reward that fails) and a tracker's warning."""
    raw = run_config(tmp_path, db_url, explorer={"workers": 1, "reward": "llm_judge"},
                     trainer={"steps": 2, "eval_interval": 2}).model_dump(mode="json")
    raw["tracking"] = {"mlflow": {"tracking_uri": "http://127.0.0.1:9"}}
    config = write_config(tmp_path / "run.yaml", raw)
    shown = finish(start("run", str(config), "--log-format", "json", "--log-file",
                         str(tmp_path / "logs" / "run.jsonl"), cwd=tmp_path))
    assert "\x1b" not in shown and "pid=" not in shown
    events = [json.loads(line) for line in shown.splitlines() if line.strip()]
    written = [json.loads(line) for line in (tmp_path / "logs" / "run.jsonl").read_text()
               .splitlines()]
    assert written == events
    by = {event["worker"] for event in events}
    explorer = next(worker for worker in by if worker.startswith("explorer-0@"))
    assert {"trainer", "trackers", "reservoir"} <= by
    assert any(event["message"].startswith("stage ") for event in events
               if event["worker"] == "trainer")
    failed = [event for event in events if event["worker"] == explorer
              and event["message"].startswith("reward llm_judge: ")]
    assert len(failed) >= 8  # printed in the explorer's actor: its stdout, relayed
    [tracker] = [event for event in events if event["worker"] == "trackers"]
    assert tracker["level"] == "warning" and "tracker mlflow" in tracker["message"]
    assert events[-1]["worker"] == "reservoir" and \
        events[-1]["message"].startswith("run 'r': 2 steps")
    times = [dt.datetime.fromisoformat(event["time"].replace("Z", "+00:00")) for event in events
             if event["worker"] == explorer]
    assert times == sorted(times)
