"""A run's partitions: experience_data_r<id>, experience_state_r<id> and batch_items_r<id>.

Migration 0013 partitions the experience tables by run, 0014 the ledger; the trigger
`runs_add_partitions` creates a run's three partitions with its row
(`experience_partitions_add(run id)`), each with a foreign key to the run's partition it names.
Here they go: every other row that names one of the run's experiences is deleted first
(review_actions keep theirs, links cleared; parent links to the run's rows are cleared), since a
partition that rows name cannot be detached; then each partition is detached and dropped, one
statement a table, instead of a delete row by row.
"""

from __future__ import annotations

from sqlalchemy import Connection, text
from sqlalchemy.exc import DBAPIError

# In this order: a ledger row names a state row, a state row its data row.
PARENTS = ("batch_items", "experience_state", "experience_data")
UNLINK = [text(sql) for sql in (
    "DELETE FROM batch_pairs WHERE preference_id IN "
    "(SELECT id FROM preferences WHERE run_id = :run)",
    "DELETE FROM operator_events WHERE run_id = :run",
    "DELETE FROM reviews WHERE run_id = :run",
    "DELETE FROM preferences WHERE run_id = :run",
    "DELETE FROM experience_groups WHERE run_id = :run",  # a restore adds them again
    "UPDATE review_actions SET run_id = NULL, experience_id = NULL WHERE run_id = :run",
    "UPDATE experience_data SET parent_run_id = NULL, parent_id = NULL "
    "WHERE parent_run_id = :run",
)]
ADD = text("SELECT experience_partitions_add(:run)")
# A run's partitions start without statistics; autovacuum, where it is on, analyzes them a
# minute or more later. Until then the planner takes `run_id = N AND status = 'ready'` to match
# one row in 40,000, and a lease of whole groups read every ready row of its run to find its
# groups' rows (14,880 for 256 leased), or checked every row of the run for being its group's
# leader; the leases' kept plans (engine.KEPT_PLANS_SETTINGS) are planned again once statistics
# come. The writer analyzes a run's state partition, and the columns of its data partition that
# leases look up, when the run first holds this many rows; a restore when it has put them back.
FIRST_STATISTICS_AT = 1024
DETACH_TRIES, DETACH_WAIT = 5, "1s"  # each try holds new leases back for at most DETACH_WAIT


def name(parent: str, run_id: int) -> str:
    """The run's partition of a partitioned table."""
    return f"{parent}_r{int(run_id)}"


def analyze(run_id: int):
    """Statement: the statistics of the run's state partition and of its data partition's keys
    and group columns (not the texts and arrays); a table another ANALYZE or VACUUM holds is
    skipped, not waited for."""
    return text(f"ANALYZE (SKIP_LOCKED) {name('experience_state', run_id)}, "
                f"{name('experience_data', run_id)} (id, run_id, group_id, group_row)")


def names(run_id: int) -> list[str]:
    """The run's partitions, each before the one it names."""
    return [name(parent, run_id) for parent in PARENTS]


def drop(conn: Connection, run_id: int) -> int:
    """Delete what names the run's experiences and drop its partitions, in the caller's
    transaction; returns how many experiences went."""
    for statement in UNLINK:
        conn.execute(statement, {"run": run_id})
    partitions = names(run_id)
    dropped = conn.execute(text(f"SELECT count(*) FROM {name('experience_state', run_id)}")
                           ).scalar()
    for parent, partition in zip(PARENTS, partitions):
        _detach(conn, parent, partition)
        conn.execute(text(f"DROP TABLE {partition}"))
    return dropped


def add(conn: Connection, run_id: int) -> None:
    """Create the run's partitions if they are missing (after a drop, for a restore)."""
    conn.execute(ADD, {"run": run_id})


def _detach(conn: Connection, parent: str, partition: str) -> None:
    """DETACH waits for every open transaction on `parent` and holds back new ones while it
    waits: it gives up after DETACH_WAIT and tries again, so a long reader stalls no lease for
    longer than that."""
    for attempt in range(DETACH_TRIES):
        savepoint = conn.begin_nested()
        try:
            conn.execute(text(f"SET LOCAL lock_timeout = '{DETACH_WAIT}'"))
            conn.execute(text(f"ALTER TABLE {parent} DETACH PARTITION {partition}"))
            conn.execute(text("SET LOCAL lock_timeout = DEFAULT"))
            savepoint.commit()
            return
        except DBAPIError as exc:
            savepoint.rollback()
            if getattr(exc.orig, "pgcode", None) != "55P03" or attempt == DETACH_TRIES - 1:
                raise
