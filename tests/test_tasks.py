"""Task files (JSONL, Parquet, CSV) into the store, and the generated CPU example tasks."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from sqlalchemy import text

from reservoir.errors import ConfigError
from reservoir.explorer.tasks import read_task_file, write_task_file
from reservoir.plan.tasks import addition, reverse, sort_letters
from reservoir.store.tasks import add_tasks

ROWS = [{"prompt": "What is 1 + 2?", "answer": "3", "split": "test", "level": 1},
        {"prompt": "What is 0 + 0?", "answer": "0", "level": 2}]


@pytest.fixture(params=["jsonl", "parquet", "csv"])
def task_file(request, tmp_path) -> Path:
    path = tmp_path / f"tasks.{request.param}"
    frame = pd.DataFrame(ROWS)
    if request.param == "jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    elif request.param == "parquet":
        frame.to_parquet(path)
    else:
        frame.to_csv(path, index=False)
    return path


def test_every_format_reads_the_same_tasks(task_file):
    rows = read_task_file(task_file)
    assert [(r["prompt"], r["answer"], r["split"]) for r in rows] == [
        ("What is 1 + 2?", "3", "test"), ("What is 0 + 0?", "0", "train")]
    assert str(rows[0]["payload"]["level"]) == "1"  # CSV keeps text, the others numbers


def test_missing_prompt_column_and_empty_prompt_are_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "x"}) + "\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl: no 'prompt' column \(columns: question\)"):
        read_task_file(path)
    path.write_text(json.dumps({"prompt": "ok", "answer": "1"}) + "\n"
                    + json.dumps({"prompt": " "}) + "\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl row 2: column 'prompt' = ' '"):
        read_task_file(path)
    with pytest.raises(ConfigError, match="unknown task file type"):
        read_task_file(tmp_path / "tasks.txt")


@pytest.mark.parametrize("make, check", [
    (addition, lambda r: int(r["answer"]) == r["payload"]["a"] + r["payload"]["b"]),
    (reverse, lambda r: r["answer"] == r["payload"]["word"][::-1]),
    (sort_letters, lambda r: r["answer"] == "".join(sorted(r["payload"]["word"]))),
])
def test_generators_are_correct_seeded_and_hold_some_out(make, check):
    rows = make(500, seed=1)
    assert all(check(row) for row in rows)
    assert rows == make(500, seed=1) and rows != make(500, seed=2)
    assert 20 < sum(row["split"] == "test" for row in rows) < 90


def test_generated_file_round_trips_into_the_store(tmp_path, store):
    write_task_file(reverse(20, seed=0), tmp_path / "rev.jsonl")
    rows = read_task_file(tmp_path / "rev.jsonl")
    run_id = store.create_run("r")
    with store.engine.begin() as conn:
        ids = add_tasks(conn, run_id, rows)
    with store.engine.connect() as conn:
        stored = conn.execute(text("SELECT prompt, answer, payload FROM tasks ORDER BY id")).all()
    assert len(ids) == 20 and stored[0].payload["word"][::-1] == stored[0].answer


@pytest.mark.slow
@pytest.mark.process
def test_cli_load_is_all_or_nothing(tmp_path, db_url):
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    write_task_file(addition(30, seed=0), good)
    bad.write_text(good.read_text() + json.dumps({"prompt": ""}) + "\n")
    script = str(Path(sys.executable).with_name("reservoir"))
    env = {**os.environ, "RESERVOIR_DB_URL": db_url}
    failed = subprocess.run([script, "tasks", "load", str(bad), "--run", "r"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert failed.returncode == 1 and "bad.jsonl row 31" in failed.stderr
    done = subprocess.run([script, "tasks", "load", str(good), "--run", "r"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "loaded 30 tasks" in done.stdout
    count = subprocess.run([script, "sql", "SELECT count(*) FROM analytics.tasks", "-f", "csv"], env=env,
                           capture_output=True, text=True, timeout=120)
    assert count.stdout.splitlines()[1] == "30"


@pytest.mark.slow
@pytest.mark.process
def test_cli_load_shuffles_a_files_order_as_a_run_does(tmp_path, db_url):
    """Issue 30: a file listing one family of tasks after another kept its order through
    `reservoir tasks load`, so explorers (which claim in id order) saw one family for a whole
    stretch of steps; a run's own task file was shuffled by run.seed. Now both are, and
    --in-order keeps a file's order where a curriculum wants it."""
    path = tmp_path / "families.jsonl"
    rows = [{"prompt": f"{a}+{a}", "answer": str(2 * a), "source": "known"} for a in range(40)]
    rows += [{"prompt": f"{a}*{a}", "answer": str(a * a), "source": "unknown"} for a in range(40)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    script = str(Path(sys.executable).with_name("reservoir"))
    env = {**os.environ, "RESERVOIR_DB_URL": db_url}
    for run, flags in (("shuffled", []), ("ordered", ["--in-order"])):
        done = subprocess.run([script, "tasks", "load", str(path), "--run", run, *flags],
                              env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
    listed = subprocess.run([script, "sql", "SELECT run, source FROM analytics.tasks ORDER BY "
                             "run, task_id", "-f", "csv"], env=env, capture_output=True,
                            text=True, timeout=120).stdout.splitlines()[1:]
    shuffled = [line.split(",")[1] for line in listed if line.startswith("shuffled,")]
    ordered = [line.split(",")[1] for line in listed if line.startswith("ordered,")]
    assert ordered == [row["source"] for row in rows]
    assert sorted(shuffled) == sorted(ordered) and 10 <= shuffled[:40].count("known") <= 30


@pytest.mark.parametrize("line, message", [
    ('["What is 1 + 1?", "2"]', r"bad.jsonl line 2: a task is a JSON object \(got list\)"),
    ('"just a prompt"', r"bad.jsonl line 2: a task is a JSON object \(got str\)"),
    ('{"prompt": "a\\u0000b"}', r"bad.jsonl row 2: column 'prompt' .* NUL"),
    ('{"prompt": "p", "answer": "\\u0000"}', r"bad.jsonl row 2: column 'answer' .* NUL"),
    ('{"prompt": "p", "weight": Infinity}', r"bad.jsonl line 2: .*Infinity"),
    ('{"prompt": "p", "weight": NaN}', r"bad.jsonl line 2: .*NaN"),
    ('{"prompt": "p", "split": "validation"}', r"bad.jsonl row 2: column 'split' = 'validation'"),
    ('{"prompt": "\\ud800"}', r"bad.jsonl row 2: column 'prompt' .* not valid Unicode"),
    ('{"prompt": "p", "prompt": "q"}', r"bad.jsonl line 2: key 'prompt' appears twice"),
    ('{"prompt": "p", "answer": {"a": 1}}', r"bad.jsonl row 2: column 'answer' .* text or a number"),
    ('{"prompt": 5}', r"bad.jsonl row 2: column 'prompt' = 5"),
    ('{"prompt": "p"', r"bad.jsonl line 2: not valid JSON"),
])
def test_bad_jsonl_lines_are_named_in_one_line(tmp_path, line, message):
    """Issue 8: main raised TypeError while building the message, tracebacks for NUL and
    Infinity, kept any split, and dropped a lone surrogate silently."""
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine", "answer": "ok"}\n' + line + "\n")
    with pytest.raises(ConfigError, match=message) as info:
        read_task_file(path)
    assert "\n" not in str(info.value)


def test_a_nul_in_a_csv_cell_is_named(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_bytes(b"prompt,answer\nfine,1\nbad\x00cell,2\n")
    with pytest.raises(ConfigError, match=r"bad.csv row 2: column 'prompt' .* NUL"):
        read_task_file(path)
