"""The sampler and the ledger on a real PostgreSQL: orders, groups, limits, leases, commits."""

from __future__ import annotations

import re
import threading
import time
import uuid
from datetime import timedelta

import pytest
from sqlalchemy import func, select, text, update

from reservoir.errors import FlowControlTimeout, LeaseLost, StoreError
from reservoir.store.schema import batch_items, experiences, runs, train_steps
from tests.factories import (fill, kept_plan, lease_rows_read, make_group, plan_rows_read,
                             planned_relations)


def statuses(store) -> dict[str, int]:
    with store.engine.connect() as conn:
        rows = conn.execute(select(experiences.c.status, func.count())
                            .group_by(experiences.c.status)).all()
    return dict(rows)


@pytest.mark.parametrize("order, expected", [("fifo", [1, 2, 3]), ("lifo", [40, 39, 38])])
def test_fifo_and_lifo(make_store, order, expected):
    store = make_store(order=order)
    store.create_run("r")
    fill(store, "r", 10)
    assert sorted(store.lease("r", rows=3).ids, reverse=order == "lifo") == expected


def test_priority_order(make_store):
    store = make_store(order="priority")
    store.create_run("r")
    fill(store, "r", 5)
    with store.engine.begin() as conn:
        conn.execute(update(experiences).where(experiences.c.id.in_([7, 13]))
                     .values(priority=5.0))
    assert sorted(store.lease("r", rows=2).ids) == [7, 13]


def test_uniform_order_is_not_fifo(make_store):
    store = make_store(order="uniform")
    store.create_run("r")
    fill(store, "r", 50)
    firsts = {tuple(store.lease("r", rows=5).ids) for _ in range(3)}
    assert firsts != {(1, 2, 3, 4, 5)} and len(firsts) == 3


def test_group_lease_returns_whole_groups_only(store):
    store.create_run("r", group_size=4)
    fill(store, "r", 6)
    with store.engine.begin() as conn:  # group 1 still has a raw row: it is not complete yet
        conn.execute(update(experiences).where(experiences.c.id == 2).values(status="raw"))
    lease = store.lease("r", groups=5)
    groups = lease.groups()
    assert len(groups) == 5 and all(len(rows) == 4 for rows in groups.values())
    assert 1 not in lease.ids and 2 not in lease.ids


def test_staleness_floor_follows_published_versions(make_store):
    store = make_store(max_staleness=1)
    store.create_run("r")
    for version in range(4):
        store.publish_version("r", version)
        fill(store, "r", 1, version=version, start_seed=version)
    lease = store.lease("r", rows=100, allow_partial=True)
    assert {row.policy_version for row in lease.rows} == {2, 3}
    store.release(lease)
    assert store.retire("r") == 8
    assert statuses(store) == {"ready": 8, "retired": 8}


def test_explicit_min_policy_version(store):
    store.create_run("r")
    store.publish_version("r", 5)
    fill(store, "r", 1, version=0)
    fill(store, "r", 1, version=5, start_seed=1)
    lease = store.lease("r", rows=8, min_policy_version=5, allow_partial=True)
    assert {row.policy_version for row in lease.rows} == {5}


def test_max_times_sampled_allows_reuse_up_to_the_limit(make_store):
    store = make_store(max_times_sampled=2, sample_from=["ready", "consumed"])
    store.create_run("r")
    fill(store, "r", 1)
    for step in (1, 2):
        lease = store.lease("r", rows=4)
        store.commit_step(lease, step=step, policy_version=0)
    with pytest.raises(FlowControlTimeout):
        store.lease("r", rows=1, timeout_s=0.2)
    with store.engine.connect() as conn:
        assert set(conn.execute(select(experiences.c.times_sampled)).scalars()) == {2}


def test_partial_batches_wait_unless_allowed(store):
    store.create_run("r")
    fill(store, "r", 1)
    with pytest.raises(FlowControlTimeout, match="4 of 10 rows"):
        store.lease("r", rows=10, timeout_s=0.2)
    assert statuses(store) == {"ready": 4}
    assert len(store.lease("r", rows=10, allow_partial=True).rows) == 4


def test_min_ready_gates_only_the_first_lease(make_store):
    store = make_store(min_ready=12)
    store.create_run("r")
    fill(store, "r", 2)
    with pytest.raises(FlowControlTimeout, match="min_ready"):
        store.lease("r", rows=4, timeout_s=0.2)
    fill(store, "r", 1, start_seed=9)
    store.commit_step(store.lease("r", rows=4), step=1, policy_version=0)
    assert len(store.lease("r", rows=8).rows) == 8  # 8 ready < 12, but training has started


def test_samples_per_insert_blocks_a_trainer_ahead_of_explorers(make_store):
    # each row should train half a time: diff = inserted * 0.5 - sampled stays in [-3.5, 4.5]
    store = make_store(samples_per_insert=0.5, spi_tolerance=4)
    store.create_run("r")
    fill(store, "r", 2)  # diff = 4
    store.commit_step(store.lease("r", rows=4), step=1, policy_version=0)  # diff = 0
    with pytest.raises(FlowControlTimeout, match="ahead of the explorers"):
        store.lease("r", rows=4, timeout_s=0.3)  # 4 rows are ready, but diff would be -4

    def explorer():
        time.sleep(0.3)
        fill(store, "r", 1, start_seed=10)  # diff = 2

    writer = threading.Thread(target=explorer)
    writer.start()
    started = time.monotonic()
    lease = store.lease("r", rows=4, timeout_s=5)  # blocks until the explorer catches up
    writer.join()
    assert len(lease.rows) == 4 and time.monotonic() - started >= 0.25


@pytest.mark.slow
def test_samples_per_insert_blocks_explorers_ahead_of_the_trainer(make_store):
    store = make_store(samples_per_insert=1.0, spi_tolerance=8)  # window [1 - 8, 1 + 8]
    store.create_run("r")
    fill(store, "r", 2)  # diff = 8: another group would make it 12 > 9
    with pytest.raises(FlowControlTimeout, match="explorers are ahead"):
        store.write_groups([make_group("r", seed=5)])
    with store.engine.connect() as conn:
        assert conn.execute(select(runs.c.rows_inserted)).scalar() == 8
    store.commit_step(store.lease("r", rows=8), step=1, policy_version=0)
    assert store.write_groups([make_group("r", seed=5)]).rows == 4


@pytest.mark.slow
def test_a_writer_waiting_for_room_holds_no_transaction_open(make_store):
    """While explorers are ahead, a write waits before its transaction: no snapshot, no locks,
    no pooled connection held while it waits."""
    store = make_store(samples_per_insert=1.0, spi_tolerance=8, wait_timeout_s=3.0)
    store.create_run("r")
    fill(store, "r", 2)
    waited = []

    def write() -> None:
        with pytest.raises(FlowControlTimeout):
            store.write_groups([make_group("r", seed=5)])
        waited.append(True)

    thread = threading.Thread(target=write)
    thread.start()
    time.sleep(1.0)
    with store.engine.connect() as conn:
        open_transactions = conn.execute(text(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND xact_start IS NOT NULL")).scalar()
    thread.join(10)
    assert waited == [True] and open_transactions == 0


def test_requests_larger_than_the_window_fail_at_once(make_store):
    store = make_store(samples_per_insert=1.0, spi_tolerance=2)
    store.create_run("r")
    with pytest.raises(FlowControlTimeout, match="deadlock"):
        store.lease("r", rows=8)
    with pytest.raises(FlowControlTimeout, match="deadlock"):
        store.write_groups([make_group("r", size=8)])


def test_commit_writes_step_ledger_and_status_together(store):
    store.create_run("r")
    fill(store, "r", 3)
    lease = store.lease("r", rows=6)
    store.commit_step(lease, step=7, policy_version=3, loss=0.25, metrics={"kl": 0.01},
                      weights=[0.5] * 6)
    with store.engine.connect() as conn:
        step = conn.execute(select(train_steps)).one()
        items = conn.execute(select(batch_items)).all()
    assert (step.step, step.policy_version, step.loss, step.n_experiences) == (7, 3, 0.25, 6)
    assert sorted(item.experience_id for item in items) == sorted(lease.ids)
    assert {(item.train_step_id, item.policy_version, item.weight) for item in items} == {
        (step.id, 3, 0.5)}
    assert statuses(store) == {"consumed": 6, "ready": 6}


def test_failure_between_lease_and_commit_consumes_nothing(make_store):
    store = make_store(lease_seconds=0.5)
    store.create_run("r")
    fill(store, "r", 2)
    lease = store.lease("r", rows=8)
    # the trainer crashes here: no commit, no release
    time.sleep(0.6)
    again = store.lease("r", rows=8)  # expiry is reclaimed by the next lease
    assert sorted(again.ids) == sorted(lease.ids)
    with pytest.raises(LeaseLost):
        store.commit_step(lease, step=1, policy_version=0)
    with store.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(train_steps)).scalar() == 0
        assert conn.execute(select(runs.c.rows_sampled)).scalar() == 8
    store.commit_step(again, step=1, policy_version=0)
    assert statuses(store) == {"consumed": 8}


def test_release_hands_rows_back(store):
    store.create_run("r")
    fill(store, "r", 1)
    lease = store.lease("r", rows=4)
    assert store.release(lease) == 4
    assert statuses(store) == {"ready": 4}
    with store.engine.connect() as conn:
        assert conn.execute(select(runs.c.rows_sampled)).scalar() == 0


def test_duplicate_step_consumes_nothing(store):
    store.create_run("r")
    fill(store, "r", 2)
    store.commit_step(store.lease("r", rows=4), step=1, policy_version=0)
    second = store.lease("r", rows=4)
    with pytest.raises(StoreError, match="already committed"):
        store.commit_step(second, step=1, policy_version=0)
    assert statuses(store) == {"consumed": 4, "leased": 4}


def test_renew_extends_a_lease(make_store):
    store = make_store(lease_seconds=0.3)
    store.create_run("r")
    fill(store, "r", 1)
    lease = store.lease("r", rows=4)
    store.renew(lease, 30)
    time.sleep(0.4)
    assert store.reclaim_expired() == 0
    store.commit_step(lease, step=1, policy_version=0)


def test_lease_across_runs_commits_to_the_named_run(store):
    for name in ("old", "new"):
        store.create_run(name)
    fill(store, "old", 1)
    lease = store.lease(["old", "new"], rows=4)
    with pytest.raises(ValueError, match="several runs"):
        store.commit_step(lease, step=1, policy_version=0)
    store.commit_step(lease, step=1, policy_version=0, run="new")
    with store.engine.connect() as conn:
        owner = conn.execute(text("SELECT r.name FROM train_steps t JOIN runs r ON r.id = t.run_id"))
        assert owner.scalar() == "new"


@pytest.mark.parametrize("unit, expected_rows", [("rows", 3), ("groups", 12)])
def test_configured_unit_and_batch_are_the_default_lease(make_store, unit, expected_rows):
    store = make_store(unit=unit, batch=3)
    store.create_run("r")
    fill(store, "r", 5)
    lease = store.lease("r")
    assert len(lease.rows) == expected_rows
    assert all(len(rows) == 4 for rows in lease.groups().values()) or unit == "rows"


@pytest.mark.parametrize("unit", ["rows", "groups"])
def test_a_lease_reads_only_its_runs_partitions(store, unit):
    """Every table a lease reads names the runs it leases from, so the server plans and locks
    only their partitions: joined through the parents (the data row, the group's size, the
    group's leader), a lease on a store of 200 runs took 6.5 times as long as on a store of
    one (43.6 ms against 6.8 ms for the lease statement, 256 rows)."""
    from reservoir.store import partitions, sampler

    leased = store.create_run("leased", group_size=4)
    other = store.create_run("other", group_size=4)
    read = planned_relations(store.engine, sampler.lease_statement(
        unit, store.flow, False, (leased,), 8), dict(
        wanted=8, token=str(uuid.uuid4()), lease_for=timedelta(seconds=60)))
    assert not {name for name in read if name.endswith(f"_r{other}")}, read
    assert {partitions.name("experience_state", leased),
            partitions.name("experience_data", leased)} <= read


@pytest.mark.parametrize("unit", ["rows", "groups"])
def test_a_lease_reads_its_rows_not_every_ready_row_of_its_run(store, unit):
    """A run's partitions start without statistics, and autovacuum, where it is on, analyzes
    them a minute or more later. Without them the planner takes `run_id = N AND status =
    'ready'` to match one row in 40,000, and a group lease found its groups' rows by reading
    every ready row of the run: 14,880 read for 256 leased, 5 ms of a 13 ms lease, growing
    with the backlog. The writer analyzes a run's state partition once it holds 1,024 rows."""
    run_id = store.create_run("r", group_size=8)
    fill(store, "r", 300, size=8)  # 2,400 ready rows
    read = lease_rows_read(store, run_id, unit, 32 if unit == "rows" else 4)  # 32 rows either way
    assert read < 500, f"the lease of 32 rows read {read} rows of the run's 2,400"


@pytest.mark.parametrize("unit", ["rows", "groups"])
def test_the_plan_a_lease_keeps_reads_its_rows_not_every_row_of_its_run(store, unit):
    """A lease's connection plans its statement once, generically, and keeps the plan. With
    the batch size bound, PostgreSQL planned that plan for a tenth of the run's rows: a lease
    of whole groups hashed every row of its run to pick its groups (10,336 data rows read for
    4 groups of a run of 5,120; ~4 s a lease on a run of 190,000). The size and the most
    times sampled are written into the SQL."""
    from reservoir.store import sampler

    run_id = store.create_run("r", group_size=8)
    fill(store, "r", 300, size=8)  # 2,400 ready rows, analyzed by the writer
    n = 32 if unit == "rows" else 4  # 32 rows either way
    lease = sampler._prepared_lease(unit, store.flow, False, (run_id,), n)
    params = dict(wanted=n, token=uuid.uuid4(), lease_for=timedelta(seconds=60))
    plan = kept_plan(store, lease, params)
    read = {table: plan_rows_read(plan, table) for table in ("experience_data", "experience_state")}
    assert max(read.values()) < 500, f"the kept plan of a lease of 32 rows read {read}"


def test_no_execution_of_a_lease_locks_every_run_s_partitions(store):
    """asyncpg prepares each statement, and a generic plan of a statement that names the runs
    by a parameter locks every partition of the tables it names (1,438 locks for a lease on a
    store of 51 runs, against 38): on a store of hundreds of runs that lease could fail with
    "out of shared memory". The lease and the step commit write their runs' ids into their
    SQL, so the plan their connections keep (planned once, generically) locks their run's
    partitions only, every time."""
    from reservoir.store import ledger, sampler

    leased = store.create_run("leased", group_size=4)
    for i in range(20):
        store.create_run(f"other-{i}", group_size=4)
    fill(store, "leased", 3)
    lease = sampler._prepared_lease("rows", store.flow, False, (leased,), 1)
    commit = ledger._prepared_commit((leased,))
    locks = "SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid()"

    async def lease_and_commit_one_row_at_a_time() -> tuple[list[int], list[int], str]:
        held, held_committing = [], []
        async with store.aio.leases.connect() as conn:
            driver = (await conn.get_raw_connection()).driver_connection
            for step in range(1, 9):
                async with driver.transaction():
                    token = uuid.uuid4()
                    [row] = await lease.fetch(conn, dict(
                        wanted=1, token=token, lease_for=timedelta(seconds=60)))
                    held.append(await driver.fetchval(locks))
                async with driver.transaction():
                    await commit.fetch(conn, dict(
                        token=token, run_id=leased, step=step, policy_version=0, loss=None,
                        metrics="{}", n_experiences=1, ids=[row[0]], stage=None, weights=[1.0]))
                    held_committing.append(await driver.fetchval(locks))
            mode = await driver.fetchval("SHOW plan_cache_mode")
        return held, held_committing, mode

    held, held_committing, mode = store._loop.run(lease_and_commit_one_row_at_a_time())
    assert mode == "force_generic_plan"
    assert max(held) < 100 and len(set(held[1:])) == 1, held  # the first plans
    assert max(held_committing) < 100, held_committing  # every run's: 20 x (3 tables + 12 indexes)


def test_the_keys_each_written_row_checks_reuse_their_plans_and_a_commit_is_durable(store):
    """The foreign keys a row checks after a write's COPY or a step commit name plain tables
    (the run's partitions, runs) and keep one plan each: planned again for every row, they cost
    a 512-row write 13 ms and a 256-row commit 5 ms. A trigger of the same kind as the key
    checks (after insert, each row) sees the settings they run under: plans reused, and the
    commit waits for its WAL to reach the disk (a lease too: a trainer's lease survives a crash
    of the server, so its commit after the restart goes through)."""
    run_id = store.create_run("keys", group_size=4)
    with store.engine.begin() as conn:
        conn.execute(text("""
            CREATE TABLE plan_modes (at text, mode text, synchronous text);
            CREATE FUNCTION record_plan_mode() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                INSERT INTO plan_modes VALUES (TG_TABLE_NAME, current_setting('plan_cache_mode'),
                                               current_setting('synchronous_commit'));
                RETURN NULL;
            END $$;"""))
        for table in (f"experience_state_r{run_id}", f"batch_items_r{run_id}", "train_steps"):
            conn.execute(text(f"CREATE TRIGGER record_plan_mode AFTER INSERT ON {table} "
                              "FOR EACH ROW EXECUTE FUNCTION record_plan_mode()"))
    fill(store, "keys", 2)
    store.commit_step(store.lease("keys", rows=8), step=1, policy_version=0)
    with store.engine.connect() as conn:
        modes = conn.execute(text("SELECT at, mode, synchronous, count(*) FROM plan_modes "
                                  "GROUP BY 1, 2, 3 ORDER BY 1")).all()
    assert [tuple(row) for row in modes] == [(f"batch_items_r{run_id}", "auto", "on", 8),
                                             (f"experience_state_r{run_id}", "auto", "on", 8),
                                             ("train_steps", "auto", "on", 1)]


@pytest.mark.parametrize("size", [2.5, 10**20, True, "8", float("inf")])
def test_a_lease_size_that_is_no_whole_number_in_range_is_one_line_and_leases_nothing(store,
                                                                                     size):
    """The size of a lease is written into its SQL (its kept plan is planned for it), so it
    is checked first: a whole number from 1 to 2**31 - 1. 2.5 was leased as 2 rows, and
    10**20 and "8" failed inside the driver."""
    store.create_run("r")
    fill(store, "r", 4)
    for unit in ("rows", "groups"):
        with pytest.raises(StoreError, match=rf"lease needs .*{unit}={re.escape(repr(size))}"):
            store.lease("r", **{unit: size}, timeout_s=0)
    assert statuses(store) == {"ready": 16}
