"""Pipelines over tasks (issue 32): Data-Juicer operators on a run's task prompts, every
decision an event with the task's id, retired tasks never claimed again, used tasks never
changed under an explorer, and the claim orders explorers follow."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import text

from reservoir.pipeline.runner import PipelineFailed, run_pipeline
from reservoir.pipeline.spec import load_pipeline, parse_pipeline
from reservoir.errors import ConfigError
from reservoir.store import Store, TaskOrder
from reservoir.store.tasks import add_tasks, claim_tasks
from tests.factories import make_group

PROMPTS = ["Reverse the word: cat", "Reverse the word: dog", "reverse THE word: cat",
           "Reverse the word: " + "x" * 80, "Reverse the word: sun"]
CURATE = {
    "name": "curate", "source": {"table": "tasks", "runs": ["t"]},
    "process": [{"text_length_filter": {"max_len": 40}},
                {"document_deduplicator": {"lowercase": True}},
                {"replace_content_mapper": {"pattern": "^Reverse the word", "repl": "Spell backwards"}}],
    "output": {"mapped": "augment"},
}


def rows(store, sql: str, **params):
    with store.engine.connect() as conn:
        return conn.execute(text(sql), params).all()


def tasks_of(store, run: str = "t", prompts=PROMPTS, split: str = "train") -> list[int]:
    run_id = store.create_run(run, group_size=4, exist_ok=True)
    with store.engine.begin() as conn:
        return add_tasks(conn, run_id, [{"prompt": p, "answer": "a", "split": split}
                                        for p in prompts])


def claim(store, run: str, want: int, order: TaskOrder = TaskOrder()) -> list[int]:
    with store.engine.begin() as conn:
        return [row[0] for row in claim_tasks(conn, store.run_id(run), want, token=uuid.uuid4(),
                                              worker="w", seconds=60, order=order)]


def test_a_task_pipeline_dry_run_changes_nothing_and_the_real_one_records_each_decision(store):
    ids = tasks_of(store)
    before = rows(store, "SELECT * FROM tasks ORDER BY id")
    dry = run_pipeline(store, parse_pipeline(CURATE), dry_run=True)
    assert (dry.rows_in, dry.rows_out) == (5, 3)
    assert rows(store, "SELECT * FROM tasks ORDER BY id") == before
    assert rows(store, "SELECT count(*) FROM operator_events") == [(0,)]

    result = run_pipeline(store, parse_pipeline(CURATE))
    long_one, duplicate = ids[3], ids[2]
    assert rows(store, "SELECT task_id, status FROM analytics.tasks WHERE parent_id IS NULL "
                       "ORDER BY task_id") == [(ids[0], "active"), (ids[1], "active"),
                                               (duplicate, "retired"), (long_one, "retired"),
                                               (ids[4], "active")]
    children = rows(store, "SELECT parent_id, prompt, split, metadata ->> 'augmented_from', "
                           "status FROM analytics.tasks WHERE parent_id IS NOT NULL ORDER BY 1")
    assert children == [(ids[0], "Spell backwards: cat", "train", str(ids[0]), "active"),
                        (ids[1], "Spell backwards: dog", "train", str(ids[1]), "active"),
                        (ids[4], "Spell backwards: sun", "train", str(ids[4]), "active")]
    # the originals keep their prompts: an augmenting mapper adds, it does not rewrite
    assert rows(store, "SELECT prompt FROM tasks WHERE id = :id", id=ids[0]) == [(PROMPTS[0],)]
    events = rows(store, "SELECT task_id, operator, kind, run FROM analytics.operator_events "
                         "WHERE pipeline_run_id = :p AND kind <> 'added' ORDER BY task_id",
                  p=result.pipeline_run_id)
    assert events == [(duplicate, "document_deduplicator", "dropped", "t"),
                      (long_one, "text_length_filter", "dropped", "t")]
    added = rows(store, "SELECT count(*) FROM operator_events WHERE kind = 'added' AND "
                        "task_id IS NOT NULL AND experience_id IS NULL")
    assert added == [(3,)]
    # retired tasks are never claimed again, never deleted
    claimed = claim(store, "t", 10)
    assert long_one not in claimed and duplicate not in claimed and len(claimed) == 6
    assert rows(store, "SELECT count(*) FROM tasks") == [(8,)]


def test_a_rewrite_of_a_used_task_is_a_new_version_and_an_idle_task_is_updated(store):
    idle, explored, claimed_now = tasks_of(store, prompts=["Reverse the word: a",
                                                           "Reverse the word: b",
                                                           "Reverse the word: c"])
    with store.engine.begin() as conn:
        conn.execute(text("UPDATE tasks SET times_explored = 2 WHERE id = :id"), {"id": explored})
        conn.execute(text("UPDATE tasks SET claim_token = gen_random_uuid(), claimed_by = 'w', "
                          "claimed_until = now() + interval '1 hour' WHERE id = :id"),
                     {"id": claimed_now})
    spec = parse_pipeline({**CURATE, "process": CURATE["process"][2:], "output": {}})
    run_pipeline(store, spec)
    got = rows(store, "SELECT id, prompt, status, parent_id, metadata ->> 'version_of' "
                      "FROM tasks ORDER BY id")
    assert got[:3] == [(idle, "Spell backwards: a", "active", None, None),
                       (explored, "Reverse the word: b", "retired", None, None),
                       (claimed_now, "Reverse the word: c", "retired", None, None)]
    assert [row[1:] for row in got[3:]] == [
        ("Spell backwards: b", "active", explored, str(explored)),
        ("Spell backwards: c", "active", claimed_now, str(claimed_now))]
    reasons = dict(rows(store, "SELECT task_id, reason FROM operator_events WHERE kind = "
                               "'retired'"))
    assert "explored 2 times" in reasons[explored] and "claimed" in reasons[claimed_now]


def test_difficulty_from_pass_rates_and_a_priority_from_a_field_are_written_to_tasks(store):
    easy, hard, unseen = tasks_of(store, "d", ["easy", "hard", "unseen"])
    store.write_groups([make_group("d", seed=1, task_id=easy, rewards=[1, 1, 1, 0]),
                        make_group("d", seed=2, task_id=hard, rewards=[0, 0, 0, 1])])
    spec = load_pipeline("pipelines/curriculum.yaml")
    assert spec.on_tasks
    run_pipeline(store, spec, runs=["d"])
    assert rows(store, "SELECT id, difficulty, round(priority::numeric, 4) FROM tasks "
                       "ORDER BY id") == [(easy, 0.25, 0.75), (hard, 0.75, 0.75),
                                          (unseen, None, 0)]
    kinds = rows(store, "SELECT task_id, kind, operator FROM operator_events ORDER BY task_id")
    assert kinds == [(easy, "scored", "task_difficulty_mapper"),
                     (hard, "scored", "task_difficulty_mapper")]


def test_a_task_pipeline_refuses_what_tasks_cannot_be():
    with pytest.raises(ConfigError, match="tasks are never quarantined"):
        parse_pipeline({**CURATE, "output": {"dropped": "quarantined"}})
    with pytest.raises(ConfigError, match="status 'raw'"):
        parse_pipeline({**CURATE, "source": {"table": "tasks", "status": ["raw"]}})
    with pytest.raises(ConfigError, match="unknown column 'reward' of tasks"):
        parse_pipeline({**CURATE, "source": {"table": "tasks", "order_by": ["reward"]}})
    assert parse_pipeline(CURATE).text_key == "prompt"


def test_a_difficulty_outside_zero_to_one_stores_nothing(store):
    ids = tasks_of(store)
    spec = parse_pipeline({**CURATE, "process": [
        {"python_lambda_mapper": {"lambda_str": "lambda s: {**s, 'task_difficulty': 1.5}"}}],
        "output": {}})
    with pytest.raises(PipelineFailed, match=f"task {ids[0]}: difficulty = 1.5"):
        run_pipeline(store, spec)
    assert rows(store, "SELECT count(*) FROM tasks WHERE difficulty IS NOT NULL") == [(0,)]


@pytest.mark.parametrize("order, expected", [
    (TaskOrder("least_explored"), [2, 4, 5, 6, 1, 3]),
    (TaskOrder("priority"), [6, 5, 4, 3, 2, 1]),
    # pass rate = 1 - difficulty: in [0.1, 0.9] are 2 (0.5) and 3 (0.2); unmeasured 5, 6;
    # outside 4 (0.0: never solved, unexplored) and 1 (1.0: always, explored 3 times)
    (TaskOrder("difficulty_band", (0.1, 0.9)), [2, 3, 5, 6, 4, 1]),
])
def test_explorers_claim_tasks_in_the_configured_order(store, order, expected):
    ids = tasks_of(store, prompts=[f"p{i}" for i in range(6)])
    difficulty = [0.0, 0.5, 0.8, 1.0, None, None]
    explored = [3, 0, 5, 0, 0, 0]
    with store.engine.begin() as conn:
        for i, task_id in enumerate(ids):
            conn.execute(text("UPDATE tasks SET difficulty = :d, times_explored = :n, "
                              "priority = :p WHERE id = :id"),
                         {"d": difficulty[i], "n": explored[i], "p": float(i), "id": task_id})
    picked = [claim(store, "t", 1, order)[0] for _ in ids]
    assert [ids.index(task_id) + 1 for task_id in picked] == expected


def test_each_claim_order_reads_an_index_of_active_tasks(store):
    tasks_of(store, prompts=[f"p{i}" for i in range(2000)])
    with store.engine.begin() as conn:
        conn.execute(text("UPDATE tasks SET difficulty = (id % 10) / 10.0, priority = id % 7"))
        conn.execute(text("ANALYZE tasks"))
    from reservoir.store.tasks import _picked
    from sqlalchemy.dialects import postgresql

    for order in (TaskOrder("least_explored"), TaskOrder("priority"),
                  TaskOrder("difficulty_band")):
        sql = str(_picked(order).params(of_run=store.run_id("t"), want=8).compile(
            dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True}))
        with store.engine.begin() as conn:
            plan = "\n".join(row[0] for row in conn.execute(text("EXPLAIN " + sql)))
        assert "tasks_claim_" in plan, (order, plan)
        assert "Seq Scan on tasks" not in plan, (order, plan)


NEAR = ["Reverse each of the following words and write them in the same order: alpha beta "
        "gamma delta epsilon zeta eta theta iota kappa lambda",
        "Reverse each of the following words and write them in the same order: alpha beta "
        "gamma delta epsilon zeta eta theta iota kappa lambda mu",
        "Add the two numbers seven and twelve, then write the sum as digits only"]


@pytest.mark.parametrize("deduplicator", [
    {"document_deduplicator": {"lowercase": True}},
    {"document_minhash_deduplicator": {"tokenization": "space", "jaccard_threshold": 0.7}},
    {"document_simhash_deduplicator": {"tokenization": "space", "window_size": 3,
                                       "hamming_distance": 4}},
])
def test_each_kind_of_deduplicator_retires_repeated_tasks(store, deduplicator):
    prompts = NEAR if "document_deduplicator" not in deduplicator else \
        [NEAR[0], NEAR[0].upper().lower(), NEAR[2]]
    ids = tasks_of(store, prompts=prompts)
    spec = parse_pipeline({"name": "dedup", "source": {"table": "tasks", "runs": ["t"]},
                           "process": [deduplicator]})
    run_pipeline(store, spec)
    assert rows(store, "SELECT id, status FROM tasks ORDER BY id") == [
        (ids[0], "active"), (ids[1], "retired"), (ids[2], "active")]
    name = next(iter(deduplicator))
    assert rows(store, "SELECT task_id, operator, kind FROM operator_events") == [
        (ids[1], name, "dropped")]


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["split", "colocated"])
def test_a_stream_over_tasks_closes_the_curriculum_loop_in_a_run(tmp_path, db_url, placement):
    """A run declaring curriculum.yaml as a stream: each explored task's difficulty is written
    while the run goes, explorers claim in the band, and the experiences are not held raw."""
    from reservoir import pool
    from tests.test_run import run_config

    pipeline = tmp_path / "curriculum_stream.yaml"
    pipeline.write_text("mode: stream\nsource: {table: tasks, where: 'times_explored > 0'}\n"
                        "process:\n  - task_difficulty_mapper: {component: accuracy}\n")
    config = run_config(tmp_path, db_url, run={"name": "r", "placement": placement},
                        explorer={"workers": 1, "max_tokens": 6, "task_order": "difficulty_band"},
                        trainer={"steps": 3, "eval_interval": 3})
    config = config.model_copy(update={"pipelines": (pipeline,)})
    assert pool.run(config).steps == 3
    with Store(db_url) as store:
        measured = rows(store, "SELECT count(*) FILTER (WHERE difficulty IS NOT NULL), "
                               "count(*) FILTER (WHERE times_explored > 0) FROM tasks")[0]
        passes = rows(store, "SELECT count(*) FROM pipeline_runs WHERE trigger = 'stream' AND "
                             "status = 'succeeded'")[0][0]
        raw = rows(store, "SELECT count(*) FROM experiences WHERE status = 'raw'")[0][0]
    assert measured[0] > 0 and passes >= 1 and raw == 0


def test_a_selector_retires_the_tasks_it_does_not_pick_and_a_scorer_sets_priority(store):
    ids = tasks_of(store, prompts=[f"Reverse the word: {w}" for w in
                                   ("a", "bb", "ccc", "dddd", "eeeee")])
    with store.engine.begin() as conn:
        conn.execute(text("UPDATE tasks SET difficulty = (id % 5) / 5.0"))
    spec = parse_pipeline({
        "name": "hardest", "source": {"table": "tasks", "runs": ["t"]},
        "process": [{"python_lambda_mapper": {
                        "lambda_str": "lambda s: {**s, 'priority': float(len(s['prompt']))}"}},
                    {"topk_specified_field_selector": {"field_key": "difficulty", "topk": 3,
                                                       "reverse": True}}],
        "output": {"unselected": "retired"}})
    run_pipeline(store, spec)
    got = rows(store, "SELECT id, status, priority FROM tasks ORDER BY id")
    kept = {task_id for task_id, status, _ in got if status == "active"}
    assert kept == {task_id for task_id in ids if task_id % 5 in (2, 3, 4)}  # the 3 hardest
    assert {task_id: priority for task_id, status, priority in got if status == "active"} == {
        task_id: float(len(f"Reverse the word: {w}"))
        for task_id, w in zip(ids, ("a", "bb", "ccc", "dddd", "eeeee")) if task_id in kept}
    kinds = rows(store, "SELECT kind, count(*) FROM operator_events GROUP BY 1 ORDER BY 1")
    assert kinds == [("retired", 2), ("scored", 3)]
