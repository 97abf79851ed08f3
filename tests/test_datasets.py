"""Real data sets as tasks (issue 32): a Hugging Face `datasets` folder and folders of shards,
their columns mapped, GSM8K's answer taken out of its text, a prompt template and a system
prompt; bad cells named by file, row and column; examples/gsm8k_qwen run as it is on a
GSM8K-shaped folder and the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml

from reservoir.config import ConfigError, parse_config
from reservoir.explorer.tasks import TaskShape, read_task_file
from reservoir.explorer.workflow import Task
from reservoir.trainer.sft import conversation

GSM8K = TaskShape(columns=(("prompt", "question"),), answer_pattern="#### (.+)")


def gsm8k_rows(n: int, start: int = 0) -> list[dict]:
    return [{"question": f"Tom has {i} apples and buys {i + 2} more. How many?",
             "answer": f"He has {i} + {i + 2} = <<{i}+{i + 2}={2 * i + 2}>>{2 * i + 2}.\n"
                       f"#### {2 * i + 2}"} for i in range(start, start + n)]


def saved_gsm8k(folder: Path, train: int = 12, test: int = 4) -> Path:
    from datasets import Dataset, DatasetDict

    DatasetDict({"train": Dataset.from_list(gsm8k_rows(train)),
                 "test": Dataset.from_list(gsm8k_rows(test, start=100))}).save_to_disk(folder)
    return folder


def test_a_datasets_folder_becomes_tasks_with_its_splits_and_gsm8k_answers(tmp_path):
    rows = read_task_file(saved_gsm8k(tmp_path / "gsm8k"), GSM8K)
    assert [row["split"] for row in rows].count("train") == 12 and len(rows) == 16
    first = rows[0]
    assert first["prompt"] == "Tom has 0 apples and buys 2 more. How many?"
    assert first["answer"] == "2" and first["source"] == "train"
    assert rows[-1]["answer"] == "208" and rows[-1]["split"] == "test"
    assert "question" not in first["payload"]  # a mapped column is ours, not payload


def test_a_template_and_a_system_prompt_shape_the_conversation(tmp_path):
    shape = TaskShape(answer_pattern="#### (.+)", system_prompt="Be brief.",
                      prompt_template="Q: {question}\nPut the answer after ####.")
    rows = read_task_file(saved_gsm8k(tmp_path / "gsm8k", 2, 1), shape)
    task = Task(1, rows[0]["prompt"], rows[0]["answer"], rows[0]["payload"])
    assert task.prompt == "Q: Tom has 0 apples and buys 2 more. How many?\nPut the answer " \
                          "after ####."
    assert task.messages == [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": task.prompt}]
    assert conversation(task.prompt, task.answer, task.payload)[0] == {
        "role": "system", "content": "Be brief."}
    plain = Task(2, "p", "a", {})
    assert plain.messages == [{"role": "user", "content": "p"}]  # as before: no system turn


def test_a_folder_of_shards_is_read_in_order_and_a_bad_cell_is_named(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    pd.DataFrame(gsm8k_rows(3)).to_parquet(folder / "part-0.parquet")
    (folder / "part-1.jsonl").write_text("\n".join(json.dumps(r) for r in gsm8k_rows(2, 10)))
    rows = read_task_file(folder, GSM8K)
    assert [row["answer"] for row in rows] == ["2", "4", "6", "22", "24"]
    assert [row["source"] for row in rows] == ["part-0.parquet"] * 3 + ["part-1.jsonl"] * 2
    bad = gsm8k_rows(2, 20)
    bad[1]["answer"] = "no marker here"
    (folder / "part-2.jsonl").write_text("\n".join(json.dumps(r) for r in bad))
    with pytest.raises(ConfigError) as caught:
        read_task_file(folder, GSM8K)
    assert str(caught.value) == (
        f"{folder / 'part-2.jsonl'} row 2: column 'answer' = 'no marker here': "
        "tasks.answer_pattern '#### (.+)' finds no answer in it; no task was loaded")
    with pytest.raises(ConfigError, match=r"part-0.parquet: no 'query' column \(columns: "
                                          r"question, answer\) \(tasks.columns.prompt\)"):
        read_task_file(folder, TaskShape(columns=(("prompt", "query"),)))


@pytest.mark.parametrize("tasks, message", [
    ({"prompt_template": "{question.__class__}"}, "a template names columns only"),
    ({"prompt_template": "{question!r}"}, "a template names columns only"),
    ({"prompt_template": "no fields"}, "names no column"),
    ({"answer_pattern": "(a)(b)"}, "has 2 groups"),
    ({"answer_pattern": "(unclosed"}, "is not a regular expression"),
    ({"columns": {"promt": "question"}}, "tasks.columns.promt"),
])
def test_bad_shapes_are_refused_when_the_config_is_read(tasks, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({"run": {"name": "x"}, "model": {"path": "m"},
                      "tasks": {"file": "data.jsonl", **tasks}})


@pytest.mark.slow
def test_the_gsm8k_example_runs_as_it_is_on_a_gsm8k_shaped_folder(tmp_path, db_url):
    from reservoir import pool
    from reservoir.models import build_tiny_model
    from reservoir.store import Store

    example = yaml.safe_load((Path(__file__).parents[1] / "examples/gsm8k_qwen/config.yaml")
                             .read_text())
    example["model"]["path"] = str(build_tiny_model(tmp_path / "tiny"))
    example["tasks"]["file"] = str(saved_gsm8k(tmp_path / "gsm8k", 24, 4))
    example["explorer"].update(batch_tasks=4, max_tokens=8, n=4, engine="transformers")
    example["trainer"].update(steps=2, batch_groups=2, micro_batch=8, eval_interval=2,
                              dtype="float32", checkpoint_dir=str(tmp_path / "checkpoints"))
    example["store"] = {"url": db_url}
    summary = pool.run(parse_config(example))
    assert summary.steps == 2
    with Store(db_url) as store, store.engine.connect() as conn:
        from sqlalchemy import text

        prompts = conn.execute(text("SELECT prompt, answer FROM tasks ORDER BY id LIMIT 1")).one()
        components = conn.execute(text(
            "SELECT DISTINCT jsonb_object_keys(reward_components) FROM experiences")).scalars()
        assert prompts.prompt.endswith('output the final answer after "####".')
        assert prompts.answer.isdigit() and set(components) <= {"accuracy", "reward_failed"}
