"""Each operator in operators/ on its own: through Data-Juicer's own API and `dj-process` (a
plain recipe, no Reservoir runner), and the ones that read the store through a pipeline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import text

from reservoir.pipeline.bridge import registry
from reservoir.pipeline.runner import run_pipeline
from reservoir.pipeline.spec import parse_pipeline
from tests.factories import make_group


def row(i: int, reward, group: str = "g", **extra) -> dict:
    return {"id": i, "run_id": 1, "task_id": 1, "group_id": group, "policy_version": 0,
            "prompt_text": "p", "response_text": f"r{i}", "reward": reward,
            "reward_components": json.dumps({"accuracy": reward, "format": 0.5}),
            "metadata": "{}", "priority": 0.0, "response_len": 10 * i,
            "created_at": f"2026-11-30T08:00:{i:02d}+00:00", **extra}


def apply(rows: list[dict], name: str, **args) -> list[dict]:
    """Data-Juicer's own API: load_ops + process, in this process."""
    registry()
    from data_juicer.core.data import NestedDataset
    from data_juicer.ops import load_ops

    ops = load_ops([{name: {"auto_op_parallelism": False, **args}}])
    return NestedDataset.from_list(rows).process(ops, open_monitor=False).to_list()


def test_reward_range_filter_keeps_zero_and_drops_nan():
    kept = apply([row(1, 0.0), row(2, 1.0), row(3, float("nan")), row(4, 1.5)],
                 "reward_range_filter", min_reward=0, max_reward=1)
    assert [r["id"] for r in kept] == [1, 2]


def test_group_variance_filter_drops_groups_with_equal_rewards():
    rows = [row(1, 1.0, "a"), row(2, 1.0, "a"), row(3, 0.0, "b"), row(4, 1.0, "b")]
    assert [r["id"] for r in apply(rows, "group_variance_filter")] == [3, 4]


def test_reward_shaping_writes_shaped_reward_and_keeps_the_reward():
    shaped = apply([row(1, 1.0), row(2, 0.0)], "reward_shaping_mapper", source="format",
                   weight=0.2, scale=2.0)
    assert [r["shaped_reward"] for r in shaped] == pytest.approx([2.1, 0.1])
    assert [r["reward"] for r in shaped] == [1.0, 0.0]  # issue 8: main overwrote it


def test_length_penalty_beyond_max_len_shapes_on_top_of_earlier_shaping():
    out = apply([row(1, 1.0), row(5, 1.0)], "length_penalty_mapper", max_len=20, penalty=0.01)
    assert [r["shaped_reward"] for r in out] == [None, pytest.approx(0.7)]  # 50 tokens: 30 over
    assert [r["reward"] for r in out] == [1.0, 1.0]
    again = apply([row(1, 1.0, shaped_reward=0.5), row(5, 1.0, shaped_reward=0.5)],
                  "length_penalty_mapper", max_len=20, penalty=0.01)
    assert [r["shaped_reward"] for r in again] == pytest.approx([0.5, 0.2])


def test_advantage_priority_is_the_absolute_group_advantage():
    out = apply([row(1, 1.0), row(2, 0.0), row(3, 0.0), row(4, 0.0)],
                "advantage_priority_mapper")
    mean, std = 0.25, (0.25 * 0.75) ** 0.5
    assert [r["priority"] for r in out] == pytest.approx(
        [abs(r - mean) / (std + 1e-6) for r in (1, 0, 0, 0)])


def test_recency_priority_halves_per_half_life():
    out = apply([row(0, 1.0), row(10, 1.0), row(20, 1.0)], "recency_priority_mapper",
                half_life_s=10)
    assert [r["priority"] for r in out] == pytest.approx([0.25, 0.5, 1.0])


def test_human_review_router_marks_rows_in_its_range():
    out = apply([row(1, 0.0), row(2, 0.5), row(3, 1.0)], "human_review_router",
                min_reward=0.4, max_reward=0.6, reason="borderline")
    assert [r["review_reason"] for r in out] == [None, "borderline", None]


@pytest.mark.slow
@pytest.mark.process
def test_a_plain_data_juicer_recipe_finds_our_operators(tmp_path):
    """dj-process with no Reservoir code in the recipe: the entry point registers ours."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row(i, r)) + "\n"
                            for i, r in enumerate([0.0, 1.0, 2.0, -1.0], start=1)))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"""
project_name: plain
dataset_path: {data}
export_path: {tmp_path / 'out.jsonl'}
np: 1
text_keys: response_text
skip_op_error: false
process:
  - reward_range_filter: {{min_reward: 0, max_reward: 1}}
""")
    dj = Path(sys.executable).with_name("dj-process")
    done = subprocess.run([str(dj), "--config", str(recipe)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    kept = [json.loads(line)["id"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert kept == [1, 2]


def rows_of(store, sql: str):
    with store.engine.connect() as conn:
        return conn.execute(text(sql)).all()


def test_store_reading_operators_in_a_pipeline(store):
    store.create_run("s", group_size=2)
    for version in range(4):
        store.publish_version("s", version)
    store.write_groups([make_group("s", size=2, seed=1, rewards=[0, 1], version=0)])
    store.write_groups([make_group("s", size=2, seed=2, rewards=[1, 1], version=3)],
                       status="raw")
    store.write_groups([make_group("s", size=2, seed=1, rewards=[0, 1], version=3)],
                       status="raw")  # the same texts as the ready group
    spec = parse_pipeline({"name": "store-ops", "source": {"runs": ["s"], "status": ["raw"]},
                           "process": [{"store_dedup_filter": {}},
                                       {"staleness_filter": {"max_staleness": 1}}]})
    run_pipeline(store, spec)
    assert rows_of(store, "SELECT id, status FROM experiences ORDER BY id") == [
        (1, "ready"), (2, "ready"), (3, "ready"), (4, "ready"), (5, "quarantined"),
        (6, "quarantined")]
    reasons = rows_of(store, "SELECT reason FROM operator_events ORDER BY experience_id")
    assert [r for (r,) in reasons] == ["store_dedup_filter: same text as experience 1",
                                       "store_dedup_filter: same text as experience 2"]


def test_task_difficulty_is_written_to_the_task(store):
    from reservoir.store.tasks import add_tasks

    run_id = store.create_run("d", group_size=4)
    with store.engine.begin() as conn:
        easy, hard = add_tasks(conn, run_id, [{"prompt": "easy"}, {"prompt": "hard"}])
    store.write_groups([make_group("d", seed=1, task_id=easy, rewards=[1, 1, 1, 0]),
                        make_group("d", seed=2, task_id=hard, rewards=[0, 0, 0, 1])],
                       status="raw")
    spec = parse_pipeline({"name": "curriculum", "source": {"runs": ["d"]},
                           "process": [{"task_difficulty_mapper": {"set_priority": True}}]})
    run_pipeline(store, spec)
    assert rows_of(store, "SELECT prompt, difficulty FROM tasks ORDER BY id") == [
        ("easy", 0.25), ("hard", 0.75)]
    assert {p for (p,) in rows_of(store, "SELECT priority FROM experiences")} == {0.75}
