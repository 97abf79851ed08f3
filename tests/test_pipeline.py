"""Pipelines on real PostgreSQL rows with real Data-Juicer operators and great-expectations."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from reservoir.errors import ConfigError, ReservoirError
from reservoir.pipeline.runner import PipelineFailed, run_pipeline
from reservoir.pipeline.spec import load_pipeline, parse_pipeline
from tests.commands import RESERVOIR, command_env
from tests.factories import make_group

CLEAN = {
    "name": "clean", "source": {"runs": ["p"], "status": ["raw"]},
    "process": [{"reward_range_filter": {"min_reward": 0, "max_reward": 1}},
                {"text_length_filter": {"min_len": 1}},
                {"document_deduplicator": {"lowercase": True}},
                {"group_variance_filter": {}}],
}


def rows(store, sql: str, **params):
    with store.engine.connect() as conn:
        return conn.execute(text(sql), params).all()


def mixed_rows(store) -> dict[str, list[int]]:
    """Groups of 4 raw rows, each with one kind of trouble; returns their ids by kind."""
    store.create_run("p", group_size=4)
    groups = {
        "good": make_group("p", seed=1, rewards=[0, 1, 0, 1]),       # reward 0 is kept
        "nan": make_group("p", seed=2, rewards=[0, 1, 1, 0]),        # one NaN reward below
        "empty": make_group("p", seed=3, rewards=[1, 0, 0, 1]),      # one empty response
        "duplicate": make_group("p", seed=4, rewards=[1, 0, 1, 0]),  # one repeats "good"'s
        "flat": make_group("p", seed=5, rewards=[1, 1, 1, 1]),       # zero variance
    }
    groups["duplicate"][2] = make_group("p", seed=4, response_text="response 1.0")[2]
    store.write_groups(list(groups.values()), status="raw")
    with store.engine.begin() as conn:
        # what a careless import could leave (the writer refuses both)
        conn.execute(text("UPDATE experiences SET reward = 'NaN' WHERE id = 6"))
        conn.execute(text("UPDATE experiences SET response_text = '' WHERE id = 10"))
    ids = iter(range(1, 21))
    return {kind: [next(ids) for _ in range(4)] for kind in groups}


def snapshot(store):
    """Every column a pipeline must not touch, for every row."""
    return rows(store, "SELECT id, run_id, task_id, group_id, policy_version, prompt_text, "
                       "response_text, prompt_ids, response_ids, logprobs, action_mask, "
                       "reward::text, reward_components, times_sampled FROM experiences ORDER BY id")


def test_mixed_rows_end_exactly_ready_or_quarantined_with_reasons(store):
    """A group that loses a row is quarantined whole (issue 8: main left three groups with 3
    of their 4 rows ready, and the trainer normalised advantages over what was left)."""
    ids = mixed_rows(store)
    before = snapshot(store)
    result = run_pipeline(store, parse_pipeline(CLEAN))
    status = dict(rows(store, "SELECT id, status FROM experiences"))
    assert {i for i, s in status.items() if s == "ready"} == set(ids["good"])
    assert {i for i, s in status.items() if s == "quarantined"} == set(range(5, 21))
    reasons = dict(rows(store, "SELECT experience_id, operator FROM operator_events "
                               "WHERE kind = 'dropped'"))
    assert reasons == {6: "reward_range_filter", 10: "text_length_filter",
                       15: "document_deduplicator", **{i: "group_variance_filter"
                                                       for i in ids["flat"]}}
    partners = rows(store, "SELECT experience_id, reason FROM operator_events "
                           "WHERE operator = 'whole_groups' ORDER BY experience_id")
    assert [i for i, _ in partners] == [5, 7, 8, 9, 11, 12, 13, 14, 16]
    assert all(f"experience {lost} of its group was dropped" in reason
               for (i, reason), lost in zip(partners, [6] * 3 + [10] * 3 + [15] * 3))
    assert all(reason for (reason,) in rows(store, "SELECT reason FROM operator_events"))
    assert snapshot(store) == before  # statuses changed, nothing else
    assert rows(store, "SELECT status, rows_in, rows_out, rows_dropped FROM pipeline_runs") == [
        ("succeeded", 20, 13, 7)]
    assert [op["out"] for op in result.operators] == [19, 18, 17, 13]


def test_partial_groups_keep_leaves_the_rest_ready_and_the_lease_says_so(store):
    ids = mixed_rows(store)
    keep = parse_pipeline({**CLEAN, "output": {"partial_groups": "keep"}})
    run_pipeline(store, keep)
    status = dict(rows(store, "SELECT id, status FROM experiences"))
    ready = {i for i, s in status.items() if s == "ready"}
    assert ready == set(range(1, 21)) - {6, 10, 15} - set(ids["flat"])
    lease = store.lease("p", groups=4)
    partial = lease.partial_groups()
    assert sorted(partial.values()) == [(3, 4)] * 3 and len(lease.rows) == 13


def test_dry_run_changes_nothing_but_reports(store):
    mixed_rows(store)
    result = run_pipeline(store, parse_pipeline(CLEAN), dry_run=True)
    assert result.dry_run and len(result.changes.statuses) == 20
    assert rows(store, "SELECT DISTINCT status FROM experiences") == [("raw",)]
    assert rows(store, "SELECT count(*) FROM operator_events") == [(0,)]
    assert rows(store, "SELECT status, trigger FROM pipeline_runs") == [("dry_run", "dry-run")]


def test_a_failing_operator_changes_nothing_but_its_pipeline_run(store):
    mixed_rows(store)
    spec = parse_pipeline({**CLEAN, "process": [
        {"reward_range_filter": {"min_reward": 0}},
        {"reward_shaping_mapper": {"source": "no_such_component"}}]})
    with pytest.raises(PipelineFailed, match="no reward component or field 'no_such_component'"):
        run_pipeline(store, spec)
    assert rows(store, "SELECT DISTINCT status FROM experiences") == [("raw",)]
    assert rows(store, "SELECT count(*) FROM operator_events") == [(0,)]
    (status, error), = rows(store, "SELECT status, error FROM pipeline_runs")
    assert status == "failed" and "no_such_component" in error


def test_validation_quarantines_failing_rows_and_stores_results(store):
    mixed_rows(store)
    spec = parse_pipeline({**CLEAN, "process": [], "validate": {
        "expectations": [
            {"expect_column_value_lengths_to_be_between": {"column": "response_text",
                                                            "min_value": 1}},
            {"expect_group_size": {"n": 4}}],
        "on_failure": "quarantine"}})
    run_pipeline(store, spec)
    quarantined = "SELECT id FROM experiences WHERE status = 'quarantined' ORDER BY id"
    assert rows(store, quarantined) == [(9,), (10,), (11,), (12,)]  # row 10 and its group
    found = rows(store, "SELECT expectation, success, unexpected_count FROM validations "
                        "ORDER BY id")
    assert found == [("expect_column_value_lengths_to_be_between", False, 1),
                     ("expect_group_size", True, 0)]
    (reason,), = rows(store, "SELECT reason FROM operator_events WHERE kind = 'quarantined' "
                             "AND operator <> 'whole_groups'")
    assert "expect_column_value_lengths_to_be_between" in reason


def test_validation_fail_changes_nothing(store):
    mixed_rows(store)
    spec = parse_pipeline({**CLEAN, "process": [], "validate": {
        "expectations": [{"expect_column_values_to_be_unique": {"column": "response_text"}}],
        "on_failure": "fail"}})
    with pytest.raises(PipelineFailed, match="expect_column_values_to_be_unique"):
        run_pipeline(store, spec)
    assert rows(store, "SELECT DISTINCT status FROM experiences") == [("raw",)]
    assert rows(store, "SELECT status FROM pipeline_runs") == [("failed",)]


def test_bad_pipelines_name_file_key_and_operator(tmp_path, store):
    bad = tmp_path / "bad.yaml"
    bad.write_text("source:\n  runs: [p]\n  limt: 3\nprocess:\n  - text_length_filter: {}\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: invalid: source.limt \(line 3\): "
                                          r"unknown key; did you mean 'limit'"):
        load_pipeline(bad)
    bad.write_text("process: [\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load_pipeline(bad)
    store.create_run("p")
    for process, message in (
        ({"text_lenght_filter": {}}, r"process\[0\] \(text_lenght_filter\): unknown operator; "
                                     r"did you mean 'text_length_filter'"),
        ({"text_length_filter": {"min_lenn": 3}}, r"process\[0\] \(text_length_filter\): "
                                                  r"unknown argument 'min_lenn'; did you mean"),
        ({"reward_range_filter": {"min_reward": "low"}}, r"argument 'min_reward' = 'low'"),
        ({"text_length_filter": {"skip_op_error": True}}, "skip_op_error is not allowed"),
    ):
        with pytest.raises(ConfigError, match=message):
            run_pipeline(store, parse_pipeline({"name": "bad", "process": [process]}))
    assert rows(store, "SELECT count(*) FROM pipeline_runs") == [(0,)]  # refused before running


def test_source_where_is_read_only_and_bound(store):
    mixed_rows(store)
    spec = parse_pipeline({**CLEAN, "process": [], "source": {
        "runs": ["p"], "status": ["raw"], "where": "reward >= :floor", "params": {"floor": 1}}})
    result = run_pipeline(store, spec)
    assert result.rows_in == 11  # 10 rows with reward 1, and NaN sorts above every number
    evil = parse_pipeline({**CLEAN, "process": [], "source": {
        "runs": ["p"], "status": ["ready"],
        "where": "setval('experience_data_id_seq', 1) > 0"}})  # a write, refused
    with pytest.raises(PipelineFailed, match="read-only transaction"):
        run_pipeline(store, evil)
    assert rows(store, "SELECT count(*) FROM experiences") == [(20,)]


@pytest.mark.slow
@pytest.mark.process
def test_sigkill_mid_run_changes_nothing_and_a_rerun_completes_once(tmp_path, store, db_url):
    import signal
    import subprocess
    import time

    store.create_run("p", group_size=4)
    store.write_groups([make_group("p", seed=i, rewards=[1, 1, 1, 1] if i % 2 else [0, 1, 0, 1])
                        for i in range(800)], status="raw")  # every other group is flat
    pipeline = tmp_path / "clean.yaml"
    pipeline.write_text("source: {runs: [p]}\nprocess:\n"
                        "  - text_length_filter: {min_len: 1}\n"
                        "  - document_deduplicator: {}\n  - group_variance_filter: {}\n")
    command = [str(RESERVOIR), "pipeline", "run", str(pipeline)]
    env = command_env(db_url)
    victim = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not rows(store, "SELECT 1 FROM pipeline_runs") and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # inside the operators
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert rows(store, "SELECT status FROM pipeline_runs") == [("running",)]
    assert rows(store, "SELECT DISTINCT status FROM experiences") == [("raw",)]
    assert rows(store, "SELECT count(*) FROM operator_events") == [(0,)]
    deadline = time.monotonic() + 10  # the server notices the dead client's session closing
    while time.monotonic() < deadline and _history_status(store) != "abandoned":
        time.sleep(0.1)
    assert _history_status(store) == "abandoned"  # issue 8: main showed `running` forever
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert rows(store, "SELECT status, count(*) FROM experiences GROUP BY 1 ORDER BY 1") == [
        ("quarantined", 1600), ("ready", 1600)]
    assert rows(store, "SELECT count(*), count(DISTINCT experience_id) FROM operator_events"
                ) == [(1600, 1600)]  # one decision per dropped row, made once
    assert rows(store, "SELECT status, error LIKE '%its process ended%' FROM pipeline_runs "
                       "ORDER BY id") == [("abandoned", True), ("succeeded", None)]


def _history_status(store) -> str:
    from reservoir.store.pipelines import history

    with store.engine.connect() as conn:
        return history(conn, None, 1)[0]["status"]


def test_held_rows_wait_for_a_verdict(store):
    from reservoir.store.reviews import label, pending

    mixed_rows(store)
    spec = parse_pipeline({**CLEAN, "process": [
        {"human_review_router": {"min_reward": 1, "max_reward": 1, "reason": "check wins"}}]})
    run_pipeline(store, spec)
    held = rows(store, "SELECT id FROM experiences WHERE status = 'held' ORDER BY id")
    assert len(held) == 10  # every row with reward 1 (the NaN one is not in range)
    with store.engine.begin() as conn:
        first, second = pending(conn, "p", 10)[:2]
        assert first["reason"] == "check wins"
        assert label(conn, first["review_id"], verdict="accept", reviewer="ana",
                     values={}) == "ready"
        assert label(conn, second["review_id"], verdict="reject", reviewer="ana", values={}) == \
            "quarantined"
    assert rows(store, "SELECT status FROM experiences WHERE id = ANY(:ids) ORDER BY id",
                ids=[first["experience_id"], second["experience_id"]]) == [
        ("ready",), ("quarantined",)]


def test_rewritten_responses_are_re_encoded_with_the_runs_tokenizer(tmp_path, store):
    from reservoir.models import build_tiny_model, load_model
    from reservoir.store import codec

    model = build_tiny_model(tmp_path / "tiny")
    _, tokenizer = load_model(model)
    store.create_run("t", group_size=4, model=str(model))
    store.create_run("no-model", group_size=4)
    store.write_groups([make_group("t", seed=1), make_group("no-model", seed=2)], status="raw")
    rewrite = {"name": "rewrite", "source": {"runs": ["t"]}, "process": [
        {"replace_content_mapper": {"pattern": "response", "repl": "answer"}}]}
    run_pipeline(store, parse_pipeline(rewrite))
    found = rows(store, "SELECT response_text, response_ids, logprobs, action_mask, status "
                        "FROM experiences WHERE run_id = 1 ORDER BY id")
    for text_, ids, logprobs, mask, status in found:
        assert text_.startswith("answer 1.") and status == "ready" and logprobs is None
        ids = codec.decode(ids, codec.TOKEN)
        assert tokenizer.decode(ids) == text_
        assert list(codec.decode(mask, codec.MASK)) == [1] * len(ids)
    events = rows(store, "SELECT kind, operator FROM operator_events ORDER BY id")
    assert events == [("changed", "replace_content_mapper")] * 4
    with pytest.raises(ReservoirError, match="not here to re-encode it; nothing was changed"):
        run_pipeline(store, parse_pipeline({**rewrite, "source": {"runs": ["no-model"]}}))
    assert rows(store, "SELECT DISTINCT status FROM experiences WHERE run_id = 2") == [("raw",)]


def test_custom_sql_and_compound_unique_expectations_and_scored_priorities(store):
    mixed_rows(store)
    spec = parse_pipeline({**CLEAN, "process": [{"advantage_priority_mapper": {}}], "validate": {
        "expectations": [
            {"expect_compound_columns_to_be_unique": {"column_list": ["group_id",
                                                                      "response_text"]}},
            {"unexpected_rows_expectation": {
                "unexpected_rows_query": "SELECT * FROM {batch} WHERE response_text = ''"}}],
        "on_failure": "quarantine"}})
    run_pipeline(store, spec)
    found = rows(store, "SELECT expectation, success, unexpected_count FROM validations "
                        "ORDER BY id")
    assert found == [("expect_compound_columns_to_be_unique", True, 0),
                     ("unexpected_rows_expectation", False, 1)]
    assert rows(store, "SELECT id FROM experiences WHERE status = 'quarantined' ORDER BY id") == [
        (9,), (10,), (11,), (12,)]
    scored = rows(store, "SELECT count(*) FROM operator_events WHERE kind = 'scored'")
    assert scored[0][0] > 0
    assert rows(store, "SELECT count(*) FROM experiences WHERE priority > 0") == scored


def test_augment_keeps_the_row_and_inserts_a_child_with_a_parent_link(tmp_path, store):
    from reservoir.models import build_tiny_model, load_model
    from reservoir.store import codec

    model = build_tiny_model(tmp_path / "tiny")
    _, tokenizer = load_model(model)
    store.create_run("a", group_size=4, model=str(model))
    store.write_groups([make_group("a", seed=1)], status="raw")
    spec = parse_pipeline({"name": "augment", "source": {"runs": ["a"]},
                           "output": {"mapped": "augment"}, "process": [
        {"replace_content_mapper": {"pattern": "response", "repl": "answer"}}]})
    run_pipeline(store, spec)
    parents = rows(store, "SELECT id, response_text, status, group_id FROM experiences "
                          "WHERE parent_id IS NULL ORDER BY id")
    children = rows(store, "SELECT id, parent_id, response_text, response_ids, logprobs, "
                           "status, group_id, metadata FROM experiences "
                           "WHERE parent_id IS NOT NULL ORDER BY parent_id")
    assert [p.response_text[:9] for p in parents] == ["response "] * 4  # untouched
    assert [p.status for p in parents] == ["ready"] * 4
    assert [c.parent_id for c in children] == [p.id for p in parents]
    assert len({c.group_id for c in children}) == 1 and children[0].group_id != parents[0].group_id
    for child in children:
        assert child.response_text.startswith("answer ") and child.status == "ready"
        assert tokenizer.decode(codec.decode(child.response_ids, codec.TOKEN)) == child.response_text
        assert child.logprobs is None and child.metadata["augmented_from"] == child.parent_id
    # the rewrite is stored on the children, so it is logged there, with the text before/after
    assert rows(store, "SELECT kind, count(*) FROM operator_events GROUP BY 1 ORDER BY 1") == [
        ("added", 4)]
    stats = rows(store, "SELECT stats FROM operator_events ORDER BY experience_id")
    [change] = stats[0][0]["changes"]
    assert change["operator"] == "replace_content_mapper"
    assert change["fields"]["response_text"] == {"before": parents[0].response_text,
                                                 "after": children[0].response_text}
    assert rows(store, "SELECT rows_inserted FROM runs") == [(8,)]  # flow control counts them


def test_a_limit_takes_whole_groups(store):
    store.create_run("p", group_size=4)
    store.write_groups([make_group("p", seed=i) for i in range(3)], status="raw")
    result = run_pipeline(store, parse_pipeline({"name": "first", "process": [], "source": {
        "runs": ["p"], "limit": 5}}))
    assert result.rows_in == 8  # 5 rows reach into the second group: all of it comes along
    assert rows(store, "SELECT status, count(*) FROM experiences GROUP BY 1 ORDER BY 1") == [
        ("raw", 4), ("ready", 8)]


@pytest.mark.parametrize("query, reason", [
    ("WITH RECURSIVE r(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM r) "
     "SELECT * FROM {batch}, r", "ran longer than"),
    ("SELECT * FROM {batch}; DELETE FROM batch", "syntax error"),
])
def test_custom_sql_checks_only_read_and_stop(store, monkeypatch, query, reason):
    from reservoir.pipeline import validate

    monkeypatch.setattr(validate, "CUSTOM_SQL_TIMEOUT_S", 0.5)
    mixed_rows(store)
    spec = parse_pipeline({**CLEAN, "process": [], "validate": {"expectations": [
        {"unexpected_rows_expectation": {"unexpected_rows_query": query}}]}})
    with pytest.raises(ReservoirError, match=reason):
        run_pipeline(store, spec)
    assert rows(store, "SELECT DISTINCT status FROM experiences") == [("raw",)]
