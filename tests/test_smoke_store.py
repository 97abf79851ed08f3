import pytest

from tests.commands import scalar
from tests.factories import fill


def test_write_lease_commit_roundtrip(store):
    store.create_run("r", group_size=4)
    fill(store, "r", 3)
    lease = store.lease("r", groups=2)
    assert len(lease.groups()) == 2 and len(lease.rows) == 8
    step_id = store.commit_step(lease, step=1, policy_version=0)
    assert step_id > 0


@pytest.mark.slow
def test_a_run_waiting_too_long_for_its_partitions_is_refused_in_one_line(store):
    """Creating a run attaches its partitions, which waits for locks on the experience tables
    (at most 10 s): held longer (an archive holds them), the run is refused in one line that
    names the holder (issue 28: it said how to find one), and nothing of it is created. Only
    a login with rights on the tables can hold such a lock: never the reader."""
    import pytest
    from sqlalchemy import text

    from reservoir.errors import StoreError

    with store.engine.connect() as holder, holder.begin():
        holder.execute(text("LOCK TABLE experience_data IN SHARE MODE"))
        pid = holder.execute(text("SELECT pg_backend_pid()")).scalar()
        with pytest.raises(StoreError, match=rf"run 'late' was not created: attaching its "
                           rf"partitions waited 10 s .*held by pid {pid} \(reservoir_owner, "
                           rf"idle in transaction since .* UTC, ShareLock on experience_data\)"):
            store.create_run("late", group_size=4)
    with store.engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM runs WHERE name = 'late'")).scalar() == 0
    store.create_run("late", group_size=4)  # the lock gone, the same name goes in


def test_processes_creating_one_run_at_once_all_get_it(store):
    """A trainer and explorers started together all create their run: the first creates it
    (and its partitions), the others wait and get its id. Attaching partitions locks `runs`
    (their keys to it), so a second INSERT already waiting on the first's row deadlocked."""
    import threading

    errors, ids = [], []

    def create(name: str, barrier: threading.Barrier) -> None:
        barrier.wait()
        try:
            ids.append((name, store.create_run(name, group_size=2, exist_ok=True)))
        except Exception as exc:  # collected: the assertion below names it
            errors.append(str(exc).splitlines()[0])

    for round_ in range(8):
        barrier = threading.Barrier(4)
        threads = [threading.Thread(target=create, args=(f"together-{round_}", barrier))
                   for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert errors == []
    assert len(ids) == 32 and len({run_id for _, run_id in ids}) == 8


def test_pooled_connections_the_server_ended_are_replaced_without_an_error(store, as_admin):
    """A pooled connection the server ended while it sat idle (a restart, an idle timeout,
    pg_terminate_backend) is replaced at checkout: the next commit, write and lease work."""
    import time


    store.create_run("r", group_size=4)
    fill(store, "r", 2)
    lease = store.lease("r", groups=1)  # the async pool now holds an idle connection
    ended = scalar(as_admin(store.url), "SELECT count(pg_terminate_backend(pid)) "
                   "FROM pg_stat_activity WHERE datname = current_database() "
                   "AND pid <> pg_backend_pid()")
    assert ended >= 1
    time.sleep(0.2)  # the server's goodbye reaches the idle connection
    store.commit_step(lease, step=1, policy_version=0)
    fill(store, "r", 1, start_seed=5)
    assert len(store.lease("r", groups=2).rows) == 8


def test_a_lease_cut_off_mid_statement_leaves_no_connection_in_the_pool(store, as_admin):
    """The lease and the step commit run on asyncpg itself (store/prepared.py), where
    SQLAlchemy cannot see that a connection died under them: a connection the server ended in
    the middle of a statement is discarded, not handed out again in an unknown state (it was:
    the next commit failed with asyncpg's "cannot switch to state 11; another operation (2)
    is in progress", which no worker takes for an outage), and the next lease works."""
    import threading
    import time

    from sqlalchemy import event, text

    from reservoir.store.retry import is_outage

    store.create_run("r", group_size=4)
    fill(store, "r", 2)
    store.release(store.lease("r", groups=1))  # the lease pool holds one idle connection
    discarded: list = []
    event.listen(store.aio.leases.sync_engine.pool, "invalidate",
                 lambda *args: discarded.append(args[2]))
    with store.engine.connect() as holder:  # holds the run's row: the next lease waits on it
        holder.execute(text("SELECT 1 FROM runs WHERE name = 'r' FOR UPDATE"))
        outcome: list = []
        leasing = threading.Thread(target=lambda: outcome.append(_lease_or_error(store)))
        leasing.start()
        time.sleep(0.5)
        ended = scalar(as_admin(store.url), "SELECT count(pg_terminate_backend(pid)) "
                       "FROM pg_stat_activity WHERE datname = current_database() "
                       "AND wait_event_type = 'Lock'")
        leasing.join(10)
        holder.rollback()
    assert ended == 1 and is_outage(outcome[0]), outcome
    assert len(discarded) == 1 and is_outage(discarded[0])  # before anyone takes it again
    assert len(store.lease("r", groups=2).rows) == 8


def _lease_or_error(store):
    try:
        return store.lease("r", groups=1, timeout_s=5)
    except Exception as exc:
        return exc
