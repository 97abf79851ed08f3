"""Task claims and the explorer pace, on a real store."""

import time
import uuid

import pytest

from reservoir.errors import ClaimLost
from reservoir.store.ledger import record_step
from reservoir.store.pace import Pace, claim_budget
from reservoir.store.tasks import add_tasks, claim_tasks, finishing, release_claims
from tests.factories import fill, make_group

PACE = Pace(batch_groups=2, sync_interval=1, staleness=0, group_size=4, steps=10)


def _tasks(store, n=8):
    run_id = store.create_run("paced", group_size=4)
    with store.engine.begin() as conn:
        add_tasks(conn, run_id, [{"prompt": f"p{i}", "answer": str(i)} for i in range(n)])
    return run_id


def _budget(store, run_id, pace=PACE):
    with store.engine.begin() as conn:
        return claim_budget(conn, run_id, pace)


def _claim(store, run_id, want, token, seconds=60.0):
    with store.engine.begin() as conn:
        return claim_tasks(conn, run_id, want, token=token, worker="w", seconds=seconds)


def test_budget_follows_versions_steps_and_waiting_groups(store):
    run_id = _tasks(store)
    assert _budget(store, run_id) == (None, 0)  # nothing until version 0 is published
    store.publish_version("paced", 0, train_step=0)  # as the trainer does
    assert _budget(store, run_id) == (0, 2)  # sync: one version's worth of groups
    assert _budget(store, run_id, Pace(2, 3, 1, 4, 10)) == (0, 12)  # async: 2 versions x 6
    fill(store, "paced", 1)
    assert _budget(store, run_id) == (0, 1)  # a waiting group counts against the budget
    _claim(store, run_id, 1, uuid.uuid4())
    assert _budget(store, run_id) == (0, 0)  # so does a claimed task
    lease = store.lease("paced", groups=1)
    store.commit_step(lease, step=1, policy_version=0)
    assert _budget(store, run_id) == (0, 0)  # trained, but version 1 is not out yet
    store.publish_version("paced", 1, train_step=1)
    assert _budget(store, run_id) == (1, 1)  # 2 for version 1, less the live claim
    assert _budget(store, run_id, Pace(2, 1, 0, 4, steps=1)) == (1, 0)  # the run's last step


def test_claims_expire_and_finishing_counts_the_task_explored(store):
    run_id = _tasks(store, n=3)
    first, second = uuid.uuid4(), uuid.uuid4()
    claimed = _claim(store, run_id, 2, first, seconds=0.5)
    assert [task_id for task_id, *_ in claimed] == [1, 2]
    assert [task_id for task_id, *_ in _claim(store, run_id, 5, second)] == [3]
    time.sleep(0.6)  # the first worker died: its claims expire
    assert [task_id for task_id, *_ in _claim(store, run_id, 5, second)] == [1, 2]
    def groups(task_ids):
        return [make_group("paced", task_id=task_id, seed=task_id) for task_id in task_ids]

    with pytest.raises(ClaimLost, match="2 of 2 claimed tasks expired"):
        store.write_groups(groups([1, 2]), before_copy=finishing(first, [1, 2]))  # the dead one
    store.write_groups(groups([1, 3]), before_copy=finishing(second, [1, 3]))
    with store.engine.begin() as conn:
        assert release_claims(conn, second) == 1  # task 2 goes back unexplored
        explored = conn.exec_driver_sql(
            "SELECT id, times_explored, claim_token IS NULL, (SELECT count(DISTINCT group_id) "
            "FROM experiences e WHERE e.task_id = t.id) FROM tasks t ORDER BY id").all()
    assert [tuple(row) for row in explored][:3] == [(1, 1, True, 1), (2, 0, True, 0),
                                                    (3, 1, True, 1)]


def test_budget_is_zero_outside_explorer_stages_and_counts_from_the_stage_start(store):
    """Stages: sft on tasks (steps 1-3), grpo on explorers (4-6), dpo on pairs (7-8)."""
    run_id = _tasks(store)
    staged = Pace(2, 1, 0, 4, steps=8, explorer_stages=((4, 6, 2),))
    store.publish_version("paced", 0, train_step=0)
    assert _budget(store, run_id, staged) == (0, 0)  # step 1 is the sft stage's
    with store.engine.begin() as conn:
        for step in (1, 2, 3):
            record_step(conn, run_id, step, policy_version=0, metrics={}, stage="sft")
    assert _budget(store, run_id, staged) == (0, 0)  # version 0 is older than the stage
    store.publish_version("paced", 1, train_step=3)  # the grpo stage's first version
    assert _budget(store, run_id, staged) == (1, 2)
    fill(store, "paced", 2)
    lease = store.lease("paced", groups=2)
    store.commit_step(lease, step=4, policy_version=1)
    store.publish_version("paced", 2, train_step=4)
    assert _budget(store, run_id, staged) == (2, 2)
    with store.engine.begin() as conn:
        for step in (5, 6):
            record_step(conn, run_id, step, policy_version=2, metrics={}, stage="grpo")
    assert _budget(store, run_id, staged) == (2, 0)  # step 7 is the dpo stage's


def test_groups_too_stale_to_train_do_not_hold_the_budget(store):
    """Found by CI in an async run with two explorers: a slow explorer's groups of version 3
    arrived after step 5 had trained (at version 4) on a faster one's; at version 5 they were
    too stale for any lease (max_staleness 1), yet counted as waiting, so the budget stayed 0
    and the run waited forever."""
    run_id = _tasks(store)
    async_pace = Pace(batch_groups=2, sync_interval=1, staleness=1, group_size=4, steps=6)
    store.publish_version("paced", 0, train_step=0)
    with store.engine.begin() as conn:
        for step in range(1, 6):
            record_step(conn, run_id, step, policy_version=step - 1, metrics={}, stage=None)
    for version in range(1, 6):
        store.publish_version("paced", version, train_step=version)
    fill(store, "paced", 2, version=3)  # ready, but below 5 - 1: no lease takes them
    assert _budget(store, run_id, async_pace) == (5, 2)  # step 6's two groups, freshly made
    fill(store, "paced", 1, version=4, start_seed=10)  # still trainable: it counts
    assert _budget(store, run_id, async_pace) == (5, 1)


def test_an_explorer_reads_its_runs_status_and_latest_policy_in_one_statement(store):
    run_id = store.create_run("read", group_size=4)
    assert store.runs.status_and_policy(run_id) == (store.runs.status_of(run_id), None)
    store.publish_version("read", 0, location="/w/v0", train_step=0)
    store.publish_version("read", 1, train_step=1)
    store.runs.set_status(run_id, "running")
    assert store.runs.status_and_policy(run_id) == ("running", (1, None))
    assert store.runs.latest_policy(run_id) == (1, None)


def test_a_new_version_is_published_with_one_notice_and_a_repeat_with_none(store):
    from reservoir.store import POLICY_CHANNEL, Listener

    run_id = store.create_run("notice", group_size=4)
    with Listener(store.engine, POLICY_CHANNEL) as listener:
        assert store.publish_version("notice", 0, location="/w/v0", train_step=0) is True
        assert listener.wait(5.0) == [f"{run_id}:0"]
        assert store.publish_version("notice", 0, location="/w/other", train_step=3) is False
        assert listener.wait(0.5) == []
    assert store.runs.latest_policy(run_id) == (0, "/w/v0")
