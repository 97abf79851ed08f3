"""The preference pool on real PostgreSQL: pairs from groups through a pipeline, pairs from
people through the CLI, and leases and commits with the ledger's guarantees."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import text

from reservoir.errors import ConfigError, FlowControlTimeout, LeaseLost, StoreError
from reservoir.pipeline.check import check_spec
from reservoir.pipeline.runner import run_pipeline
from reservoir.pipeline.spec import parse_pipeline
from reservoir.store.tasks import add_tasks
from tests.factories import make_group


def rows(store, sql: str, **params):
    with store.engine.connect() as conn:
        return conn.execute(text(sql), params).all()


def pairs_pipeline(**args) -> dict:
    return {"name": "pairs", "source": {"runs": ["p"], "status": ["raw"]},
            "process": [{"preference_pair_mapper": args}]}


CONTENT = ("SELECT id, group_id, prompt_text, response_text, reward::text, shaped_reward, "
           "reward_components, metadata, priority, times_sampled FROM experiences ORDER BY id")


def groups_with_spread(store) -> None:
    """Ids 1-4: rewards 0, 1, 0.2, 0.9; 5-8 flat; 9-12 spread 0.3 (under the default margin);
    13-16: rewards 0, 1, 0, 1 but shaped 2, 0, 0, 0 (shaping decides)."""
    store.create_run("p", group_size=4)
    store.write_groups([make_group("p", seed=1, rewards=[0, 1, 0.2, 0.9]),
                        make_group("p", seed=2, rewards=[1, 1, 1, 1]),
                        make_group("p", seed=3, rewards=[0.3, 0.5, 0.4, 0.6]),
                        make_group("p", seed=4, rewards=[0, 1, 0, 1])], status="raw")
    with store.engine.begin() as conn:
        conn.execute(text("UPDATE experiences SET shaped_reward = CASE id WHEN 13 THEN 2 ELSE 0 "
                          "END WHERE id BETWEEN 13 AND 16"))


def test_mapper_pairs_best_over_worst_and_leaves_experiences_alone(store):
    groups_with_spread(store)
    before = rows(store, CONTENT)
    result = run_pipeline(store, parse_pipeline(pairs_pipeline()))
    assert rows(store, CONTENT) == before
    assert result.rows_out == 16
    assert rows(store, "SELECT DISTINCT status FROM experiences") == [("ready",)]
    assert rows(store, "SELECT chosen_id, rejected_id, margin, source, run_id, status "
                       "FROM preferences ORDER BY chosen_id") == [
        (2, 1, 1.0, "preference_pair_mapper", 1, "ready"),
        (13, 16, 2.0, "preference_pair_mapper", 1, "ready")]
    events = rows(store, "SELECT experience_id, kind, stats->>'rejected_id' FROM operator_events "
                         "WHERE operator = 'preference_pair_mapper' ORDER BY experience_id")
    assert events == [(2, "added", "1"), (13, "added", "16")]


def test_pairs_per_group_pairs_ith_best_with_ith_worst_within_the_margin(store):
    groups_with_spread(store)
    run_pipeline(store, parse_pipeline(pairs_pipeline(min_margin=0.2, pairs_per_group=2)))
    found = rows(store, "SELECT chosen_id, rejected_id, round(margin::numeric, 3) FROM "
                        "preferences WHERE chosen_id <= 12 ORDER BY chosen_id")
    # group 1: 1.0 over 0 and 0.9 over 0.2; group 3: 0.6 over 0.3 (0.5 over 0.4 is too close)
    assert [(c, r, float(m)) for c, r, m in found] == [(2, 1, 1.0), (4, 3, 0.7), (12, 9, 0.3)]


def test_a_dry_run_adds_no_pair_and_a_second_run_adds_none_twice(store):
    groups_with_spread(store)
    spec = parse_pipeline({**pairs_pipeline(), "source": {"runs": ["p"],
                                                          "status": ["raw", "ready"]}})
    run_pipeline(store, spec, dry_run=True)
    assert rows(store, "SELECT count(*) FROM preferences") == [(0,)]
    run_pipeline(store, spec)
    run_pipeline(store, spec)  # the same rows, ready now: the same pairs, skipped
    assert rows(store, "SELECT count(*) FROM preferences") == [(2,)]
    assert rows(store, "SELECT count(*) FROM operator_events WHERE kind = 'added'") == [(2,)]


@pytest.mark.parametrize("args", [{"min_margin": -0.1}, {"min_margin": float("nan")},
                                  {"pairs_per_group": 0}])
def test_mapper_arguments_are_checked(args):
    with pytest.raises(ConfigError):
        check_spec(parse_pipeline(pairs_pipeline(**args)))


def pooled(store, n_groups: int = 3) -> int:
    """Run "d" (its id returned): groups of 4 with rewards 0..3; pairs (4g+4 over 4g+1) and
    (4g+3 over 4g+2)."""
    run_id = store.create_run("d", group_size=4)
    store.write_groups([make_group("d", seed=g, rewards=[0, 1, 2, 3]) for g in range(n_groups)])
    pairs = [(4 * g + c, 4 * g + r, 1.0, "test") for g in range(n_groups)
             for c, r in ((4, 1), (3, 2))]
    assert store.add_pairs(pairs) == len(pairs)
    return run_id


def test_duplicate_pairs_are_skipped(store):
    pooled(store, 1)
    assert store.add_pairs([(4, 1, 2.0, "again"), (1, 4), (1, 4)]) == 1  # the reverse is new
    assert rows(store, "SELECT chosen_id, rejected_id, source FROM preferences ORDER BY id") == [
        (4, 1, "test"), (3, 2, "test"), (1, 4, None)]


def test_pairs_across_runs_or_tasks_or_unknown_ids_are_refused_whole(store):
    pooled(store, 1)
    run_id = store.create_run("other", group_size=2)
    with store.engine.begin() as conn:
        a, b = add_tasks(conn, run_id, [{"prompt": "a"}, {"prompt": "b"}])
    store.write_groups([make_group("other", size=2, task_id=a, seed=5),
                        make_group("other", size=2, task_id=b, seed=6)])
    for pair, said in [((1, 5), "two responses to one prompt"), ((5, 7), "to one prompt"),
                       ((1, 99), "experience 99 does not exist"), ((1, 1), "to itself")]:
        with pytest.raises(StoreError, match=said):
            store.add_pairs([(2, 3), pair])
    assert rows(store, "SELECT count(*) FROM preferences") == [(2,)]
    assert store.add_pairs([(5, 6)]) == 1


def test_two_concurrent_leases_never_share_a_pair(make_store):
    stores = [make_store() for _ in range(4)]
    pooled(stores[0], 10)

    def drain(store) -> list[int]:
        got = []
        while True:
            try:
                got += store.lease_pairs("d", pairs=2, timeout_s=0.2).ids
            except FlowControlTimeout:
                return got

    with ThreadPoolExecutor(len(stores)) as pool:
        leased = [i for ids in pool.map(drain, stores) for i in ids]
    assert sorted(leased) == list(range(1, 21))
    assert rows(stores[0], "SELECT DISTINCT status FROM preferences") == [("leased",)]


def test_commit_writes_the_step_its_pairs_and_both_sides_at_once(store):
    pooled(store, 2)
    lease = store.lease_pairs("d", pairs=3)
    assert lease.ids == [1, 2, 3] and lease.pairs[0].chosen_id == 4
    step_id = store.commit_pairs(lease, step=1, policy_version=0, loss=0.5, stage="dpo",
                                 metrics={"dpo/accuracy": 1.0})
    assert rows(store, "SELECT id, step, stage, n_experiences, loss FROM train_steps") == [
        (step_id, 1, "dpo", 6, 0.5)]
    assert rows(store, "SELECT preference_id FROM batch_pairs ORDER BY 1") == [(1,), (2,), (3,)]
    assert rows(store, "SELECT experience_id, weight FROM batch_items ORDER BY 1") == [
        (1, -1.0), (2, -1.0), (3, 1.0), (4, 1.0), (5, -1.0), (8, 1.0)]
    assert rows(store, "SELECT id, status, times_sampled, lease_token FROM preferences "
                       "ORDER BY id") == [(1, "consumed", 1, None), (2, "consumed", 1, None),
                                          (3, "consumed", 1, None), (4, "ready", 0, None)]
    assert rows(store, "SELECT DISTINCT status, times_sampled FROM experiences") == [("ready", 0)]


def test_a_lost_lease_raises_and_writes_nothing(make_store):
    first, second = make_store(lease_seconds=0.2), make_store()
    pooled(first, 1)
    lost = first.lease_pairs("d", pairs=2)
    time.sleep(0.3)
    taken = second.lease_pairs("d", pairs=1)  # reclaims both, leases one
    with pytest.raises(LeaseLost, match="holds 0 of its 2 pairs"):
        first.commit_pairs(lost, step=1, policy_version=0, stage="dpo")
    for table in ("train_steps", "batch_pairs", "batch_items"):
        assert rows(first, f"SELECT count(*) FROM {table}") == [(0,)]
    assert rows(first, "SELECT id, status FROM preferences ORDER BY id") == [
        (1, "leased"), (2, "ready")]
    second.commit_pairs(taken, step=1, policy_version=0)
    assert rows(first, "SELECT count(*) FROM batch_items") == [(2,)]


def test_a_committed_step_is_not_committed_twice(store):
    pooled(store, 1)
    store.commit_pairs(store.lease_pairs("d", pairs=1), step=1, policy_version=0)
    again = store.lease_pairs("d", pairs=1)
    with pytest.raises(StoreError, match="already committed"):
        store.commit_pairs(again, step=1, policy_version=0)
    assert rows(store, "SELECT status FROM preferences WHERE id = 2") == [("leased",)]
    assert rows(store, "SELECT count(*) FROM batch_pairs") == [(1,)]


def test_release_returns_pairs_to_ready(store):
    run_id = pooled(store, 1)
    lease = store.lease_pairs("d", pairs=5)
    assert len(lease.pairs) == 2  # up to 5: what is ready
    assert store.release_pairs(lease) == 2
    assert rows(store, "SELECT DISTINCT status, lease_token FROM preferences") == [("ready", None)]
    with pytest.raises(LeaseLost):
        store.commit_pairs(lease, step=1, policy_version=0)
    assert store.lease_pairs([run_id]).ids == [1, 2]  # runs by name or id


def test_no_ready_pair_times_out(store):
    pooled(store, 1)
    store.lease_pairs("d")
    began = time.monotonic()
    with pytest.raises(FlowControlTimeout, match="none is ready"):
        store.lease_pairs("d", timeout_s=0.3)
    assert time.monotonic() - began >= 0.3


@pytest.mark.slow
@pytest.mark.process
def test_review_prefer_records_a_persons_pair(store, cli):
    pooled(store, 1)
    store.create_run("other", group_size=2)
    store.write_groups([make_group("other", size=2, seed=9)])
    out = cli("review", "prefer", "2", "3", "--reviewer", "ana")
    assert "pair added" in out
    assert rows(store, "SELECT chosen_id, rejected_id, margin, source, status FROM preferences "
                       "WHERE source LIKE 'review%'") == [(2, 3, None, "review:ana", "ready")]
    assert "already stored" in cli("review", "prefer", "2", "3")
    for args, said in [(("2", "99"), "experience 99 does not exist"),
                       (("2", "5"), "two responses to one prompt")]:
        refused = cli.raw("review", "prefer", *args)
        assert refused.returncode == 1
        assert refused.stderr.count("\n") == 1 and said in refused.stderr
