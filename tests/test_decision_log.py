"""The decision log tells the truth (issue 8): events only for what was stored, changes with
old and new values, duplicates naming the row kept, unpicked rows with their value and rank
and a kind of their own, plugin import errors shown, operators labelled by package; shaped
rewards beside the raw ones."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import text

from reservoir.pipeline.decide import shown as _shown
from reservoir.pipeline.runner import run_pipeline
from reservoir.pipeline.spec import parse_pipeline
from reservoir.store.inspect import run_sql
from reservoir.trainer.batch import make_batch
from tests.factories import make_group

RESERVOIR = Path(sys.executable).with_name("reservoir")


def rows(store, sql: str, **params):
    with store.engine.connect() as conn:
        return conn.execute(text(sql), params).all()


def spec(process, **output):
    return parse_pipeline({"name": "log", "source": {"runs": ["d"]}, "process": process,
                           "output": output})


@pytest.fixture
def graded(store):
    """Three raw groups of 4 with distinct rewards: 0.1 .. 1.2."""
    store.create_run("d", group_size=4)
    store.write_groups([make_group("d", seed=g, rewards=[0.1 * (4 * g + i + 1) for i in range(4)])
                        for g in range(3)], status="raw")
    return store


def test_no_change_is_logged_for_a_row_that_was_then_dropped(graded):
    run_pipeline(graded, spec([{"advantage_priority_mapper": {}},
                               {"reward_range_filter": {"min_reward": 0.35}}],
                              partial_groups="keep"))
    dropped = {i for (i,) in rows(graded, "SELECT experience_id FROM operator_events "
                                          "WHERE kind = 'dropped'")}
    scored = dict(rows(graded, "SELECT experience_id, stats FROM operator_events "
                               "WHERE kind = 'scored'"))
    assert dropped == {1, 2, 3} and not dropped & set(scored)  # main logged 'scored' for them
    stored = dict(rows(graded, "SELECT id, priority FROM experiences"))
    for row_id, stats in scored.items():
        assert stats["fields"]["priority"]["after"] == pytest.approx(stored[row_id])
        assert stats["fields"]["priority"]["before"] == 0.0
    assert {stored[i] for i in dropped} == {0.0}  # their scores were never written


def test_a_long_text_change_is_logged_as_hashes_and_lengths():
    shown = _shown({"response_text": ("a" * 300, "b" * 250), "priority": (0.0, 1.5)})
    assert shown["priority"] == {"before": 0.0, "after": 1.5}
    before, after = shown["response_text"]["before"], shown["response_text"]["after"]
    assert (before["length"], after["length"]) == (300, 250)
    assert len(before["sha256"]) == 64 and before["sha256"] != after["sha256"]


def test_shaping_keeps_the_raw_reward_and_the_trainer_uses_the_shaped_one(graded):
    run_pipeline(graded, spec([{"reward_shaping_mapper": {"source": "accuracy", "weight": 1.0,
                                                          "scale": 0.0}},
                               {"length_penalty_mapper": {"max_len": 2, "penalty": 0.01}}]))
    stored = rows(graded, "SELECT reward, shaped_reward FROM experiences ORDER BY id")
    assert [r for r, _ in stored] == pytest.approx([0.1 * i for i in range(1, 13)])
    assert [s for _, s in stored] == pytest.approx([0.1 * i - 0.04 for i in range(1, 13)])
    events = rows(graded, "SELECT operator, stats FROM operator_events WHERE experience_id = 1 "
                          "ORDER BY id")
    assert [(op, stats["fields"]["shaped_reward"]) for op, stats in events] == [
        ("reward_shaping_mapper", {"before": None, "after": pytest.approx(0.1)}),
        ("length_penalty_mapper", {"before": pytest.approx(0.1), "after": pytest.approx(0.06)})]
    view = run_sql(graded.url, "SELECT reward, shaped_reward FROM analytics.experiences "
                               "WHERE experience_id = 1")
    assert view.rows == [(pytest.approx(0.1), pytest.approx(0.06))]
    lease = graded.lease("d", groups=1)
    batch = make_batch(lease.rows, pad_id=0)
    assert batch.rewards.tolist() == pytest.approx([r.shaped_reward for r in lease.rows])


def test_a_changed_reward_fails_the_pipeline(graded):
    from reservoir.pipeline.runner import PipelineFailed

    with pytest.raises(PipelineFailed, match="changed reward; the reward as written is kept"):
        run_pipeline(graded, spec([{"python_lambda_mapper": {
            "lambda_str": "lambda row: {**row, 'reward': 0.0}"}}]))
    assert rows(graded, "SELECT DISTINCT status FROM experiences") == [("raw",)]


def test_a_duplicate_names_the_row_it_duplicates(store):
    store.create_run("d", group_size=4)
    groups = [make_group("d", seed=1), make_group("d", seed=2)]
    groups[1][3] = make_group("d", seed=2, response_text="response 1.2")[3]  # = row 3's text
    store.write_groups(groups, status="raw")
    run_pipeline(store, spec([{"document_deduplicator": {}}]))
    (row_id, reason, stats), = rows(store, "SELECT experience_id, reason, stats "
                                          "FROM operator_events WHERE kind = 'dropped'")
    assert (row_id, stats) == (8, {"duplicate_of": 3})
    assert "a duplicate of experience 3 (kept)" in reason


def test_near_duplicates_name_the_kept_row_of_their_cluster(store):
    store.create_run("d", group_size=3)
    texts = ["the cat sat on the mat today", "the cat sat on the mat today!",
             "a different answer entirely"]
    store.write_groups([make_group("d", size=3, seed=1, response_text=t) for t in texts[:1]]
                       + [[exp for exp in make_group("d", size=3, seed=2)]], status="raw")
    with store.engine.begin() as conn:  # two near-copies of row 1 in the second group
        conn.execute(text("UPDATE experiences SET response_text = CASE id WHEN 4 THEN :a "
                          "WHEN 5 THEN :b ELSE response_text END"), {"a": texts[1], "b": texts[0]})
    run_pipeline(store, spec([{"document_minhash_deduplicator": {
        "tokenization": "character", "window_size": 5, "jaccard_threshold": 0.7}}],
        partial_groups="keep"))
    dropped = dict(rows(store, "SELECT experience_id, stats->>'duplicate_of' FROM "
                               "operator_events WHERE kind = 'dropped'"))
    assert dropped == {2: "1", 3: "1", 4: "1", 5: "1"}


@pytest.mark.parametrize("unselected, status", [("keep", "raw"), ("retired", "retired")])
def test_unpicked_rows_get_their_own_kind_value_and_rank(graded, unselected, status):
    run_pipeline(graded, spec([{"topk_specified_field_selector": {
        "field_key": "reward", "topk": 4, "reverse": True}}], partial_groups="keep",
        unselected=unselected))
    events = rows(graded, "SELECT experience_id, kind, stats FROM operator_events ORDER BY 1")
    assert [(i, kind) for i, kind, _ in events] == [(i, "unselected") for i in range(1, 9)]
    assert [(s["value"], s["rank"], s["of"]) for _, _, s in events] == [
        (pytest.approx(0.1 * i), 13 - i, 12) for i in range(1, 9)]
    statuses = dict(rows(graded, "SELECT id, status FROM experiences"))
    assert {statuses[i] for i in range(1, 9)} == {status}
    assert {statuses[i] for i in range(9, 13)} == {"ready"}
    assert not rows(graded, "SELECT 1 FROM operator_events WHERE kind = 'quarantined'")


def test_a_retired_unpicked_row_takes_its_group_with_it(graded):
    run_pipeline(graded, spec([{"topk_specified_field_selector": {
        "field_key": "reward", "topk": 6, "reverse": True}}], unselected="retired"))
    statuses = dict(rows(graded, "SELECT id, status FROM experiences"))
    assert {i for i, s in statuses.items() if s == "ready"} == set(range(9, 13))
    assert {i for i, s in statuses.items() if s == "quarantined"} == {7, 8}  # picked partners
    assert {i for i, s in statuses.items() if s == "retired"} == set(range(1, 7))


def test_a_group_with_unpicked_rows_kept_waits_whole(graded):
    run_pipeline(graded, spec([{"topk_specified_field_selector": {
        "field_key": "reward", "topk": 6, "reverse": True}}]))
    statuses = dict(rows(graded, "SELECT id, status FROM experiences"))
    assert {i for i, s in statuses.items() if s == "raw"} == set(range(1, 7))
    assert {i for i, s in statuses.items() if s == "ready"} == set(range(7, 13))
    lease = graded.lease("d", groups=2, allow_partial=True, timeout_s=0.2)
    assert {row.id for row in lease.rows} == set(range(9, 13))  # group 2 waits for rows 5, 6


@pytest.fixture
def broken_plugin(tmp_path):
    """A package on PYTHONPATH whose data_juicer.ops entry point fails to import."""
    site = tmp_path / "site"
    info = site / "broken_ops-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-ops\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[data_juicer.ops]\nbroken = broken_ops\n")
    (site / "broken_ops.py").write_text("import not_installed_dependency_xyz\n")
    return {**os.environ, "PYTHONPATH": str(site)}


@pytest.mark.slow
@pytest.mark.process
def test_a_plugin_that_fails_to_import_is_named_with_its_error(broken_plugin, tmp_path):
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text("process:\n  - broken_filter: {}\n")
    check = subprocess.run([str(RESERVOIR), "pipeline", "check", str(pipeline)],
                           env=broken_plugin, capture_output=True, text=True, timeout=120)
    assert check.returncode == 1
    assert ("unknown operator" in check.stderr and "operator plugin broken_ops (package "
            "broken-ops) failed to import: ModuleNotFoundError: No module named "
            "'not_installed_dependency_xyz'" in check.stderr), check.stderr
    ops = subprocess.run([str(RESERVOIR), "pipeline", "ops", "reward_range"],
                         env={**broken_plugin, "COLUMNS": "300"}, capture_output=True,
                         text=True, timeout=120)
    assert "broken_ops (package broken-ops) failed to import" in " ".join(ops.stdout.split())


@pytest.mark.slow
@pytest.mark.process
def test_operators_are_labelled_by_the_package_that_defines_them():
    out = subprocess.run([str(RESERVOIR), "pipeline", "ops", "range"],
                         env={**os.environ, "COLUMNS": "300"}, capture_output=True, text=True,
                         timeout=120).stdout
    lines = {line.split("│")[1].strip(): line.split("│")[3].strip()
             for line in out.splitlines() if line.count("│") >= 4}
    assert lines["reward_range_filter"] == "reservoir-rft"
    assert lines["range_specified_field_selector"] == "py-data-juicer"


def test_lease_flags_partial_groups_and_the_trainer_reports_them(store):
    store.create_run("d", group_size=4)
    store.write_groups([make_group("d", seed=i) for i in range(2)])
    with store.engine.begin() as conn:
        conn.execute(text("UPDATE experiences SET status = 'quarantined' WHERE id = 2"))
    lease = store.lease("d", groups=2)
    assert len(lease.rows) == 7 and list(lease.partial_groups().values()) == [(3, 4)]
    assert np.isfinite(make_batch(lease.rows, pad_id=0).rewards.numpy()).all()


@pytest.mark.parametrize("field, value", [("shaped_reward", 1e39), ("shaped_reward", -2e6),
                                          ("shaped_reward", float("nan")),
                                          ("priority", float("inf"))])
def test_a_shaped_reward_or_priority_no_trainer_can_hold_fails_the_pipeline(graded, field,
                                                                            value):
    """Issue 28: a shaped reward goes into the trainer's float32 batch as the reward does; an
    operator writing one outside explorer.reward_range (or a priority that is not finite)
    fails the pipeline, naming the row, and nothing of it is stored."""
    from reservoir.pipeline.runner import PipelineFailed

    before = rows(graded, "SELECT id, status, shaped_reward, priority FROM experiences ORDER BY id")
    lambda_str = f"lambda row: {{**row, {field!r}: float({str(value)!r})}}"
    process = [{"python_lambda_mapper": {"lambda_str": lambda_str}}]
    options = {"priority_from": "priority"} if field == "priority" else {}
    with pytest.raises(PipelineFailed, match=rf"experience 1: {field} = "):
        run_pipeline(graded, spec(process, **options))
    assert rows(graded, "SELECT id, status, shaped_reward, priority FROM experiences "
                        "ORDER BY id") == before
