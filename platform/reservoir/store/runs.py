"""Queries on runs and policy_versions."""

from __future__ import annotations

from typing import Any

from sqlalchemy import (BigInteger, Connection, Float, Text, bindparam, cast, delete, func,
                        literal_column, select, update)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.exc import OperationalError

from reservoir.store.door import Door, reading, writing
from reservoir.errors import StoreError
from reservoir.store import locks, partitions
from reservoir.store.notify import ROWS_CHANNEL
from reservoir.store.schema import experiences, policy_versions, runs, train_steps
from reservoir.plan.urls import scrub


def insert_run(conn: Connection, name: str, *, group_size: int | None = None,
               model: str | None = None, config: dict[str, Any] | None = None,
               vocab_size: int | None = None) -> int | None:
    """Insert a run and return its id; None if a run of that name exists (a concurrent insert
    of the same name waits for the first to commit, then gets None). Passwords in URLs inside
    the config are removed: the reader can read runs.config. Its partitions are attached,
    which waits for no reader (ATTACH takes SHARE UPDATE EXCLUSIVE on the parents) and at most
    10 s for a session with rights on the experience or ledger tables."""
    stmt = (pg_insert(runs).values(name=name, group_size=group_size, model=model,
                                   config=scrub(config or {}), vocab_size=vocab_size)
            .on_conflict_do_nothing(index_elements=["name"]).returning(runs.c.id))
    try:
        return conn.execute(stmt).scalar()
    except OperationalError as exc:
        if getattr(exc.orig, "pgcode", None) != "55P03":  # lock_not_available
            raise
        held = locks.holders(conn.engine, tables=partitions.PARENTS)
        raise StoreError(f"run {name!r} was not created: attaching its partitions waited 10 s "
                         f"for the experience and ledger tables, {held}; try again when it "
                         "ends") from None


def set_vocab_size(conn: Connection, run_id: int, vocab_size: int) -> None:
    """Record the run's model's vocabulary (a run made before a model was named has none)."""
    conn.execute(update(runs).where(runs.c.id == run_id,
                                    runs.c.vocab_size.is_distinct_from(vocab_size))
                 .values(vocab_size=vocab_size))


def set_parent(conn: Connection, run_id: int, parent_id: int, step: int) -> None:
    """Record that a run was branched from `parent_id` at `step`."""
    conn.execute(update(runs).where(runs.c.id == run_id)
                 .values(parent_run_id=parent_id, parent_step=step))


def parent_of(conn: Connection, run_id: int) -> tuple[int, int] | None:
    """(parent run id, step) of a branched run; None for a run that was not branched."""
    row = conn.execute(select(runs.c.parent_run_id, runs.c.parent_step)
                       .where(runs.c.id == run_id)).first()
    return None if row is None or row.parent_run_id is None else (row.parent_run_id,
                                                                  row.parent_step)


def create_run(conn: Connection, name: str, *, group_size: int | None = None,
               model: str | None = None, config: dict[str, Any] | None = None,
               vocab_size: int | None = None, exist_ok: bool = False) -> int:
    """Insert a run and return its id; with exist_ok, return the id of an existing one."""
    run_id = insert_run(conn, name, group_size=group_size, model=model, config=config,
                        vocab_size=vocab_size)
    if run_id is not None:
        return run_id
    if exist_ok:
        return run_id_of(conn, name)
    raise StoreError(f"run {name!r} already exists: choose another name (its rows stay)")


def run_id_of(conn: Connection, name: str) -> int:
    run_id = conn.execute(select(runs.c.id).where(runs.c.name == name)).scalar()
    if run_id is None:
        raise StoreError(f"run {name!r} does not exist (see `reservoir sql \"SELECT run FROM analytics.runs\"`)")
    return run_id


def ids_of(conn: Connection, names: list[str]) -> dict[str, int]:
    """{name: id} of those of the named runs that exist."""
    return {row.name: row.id for row in conn.execute(lookup(names))}


def config_of(conn: Connection, name: str) -> dict[str, Any]:
    """The config a run was created with (as stored: without secrets)."""
    config = conn.execute(select(runs.c.config).where(runs.c.name == name)).scalar()
    if config is None:
        run_id_of(conn, name)  # one line when the run does not exist
        raise StoreError(f"run {name!r} stored no config")
    return config


def lookup(names: list[str]):
    """Statement: id, name, group_size of the named runs."""
    return select(runs.c.id, runs.c.name, runs.c.group_size).where(runs.c.name.in_(names))


def lock(run_ids: list[int]):
    """Statement: lock runs rows, in id order, so flow-control checks and updates are atomic."""
    return select(runs.c.id).where(runs.c.id.in_(run_ids)).order_by(runs.c.id).with_for_update()


def counters(run_ids: list[int]):
    """Statement: the summed flow-control counters (rows_inserted, rows_sampled) of runs."""
    return select(
        func.coalesce(func.sum(runs.c.rows_inserted), 0).cast(BigInteger),
        func.coalesce(func.sum(runs.c.rows_sampled), 0).cast(BigInteger),
    ).where(runs.c.id.in_(run_ids))


def add_inserted(run_id: int, n: int):
    return (update(runs).where(runs.c.id == run_id)
            .values(rows_inserted=runs.c.rows_inserted + n, updated_at=func.now()))


# Statement: add rows written to each run's counter and notify each run's channel (at commit);
# returns each run's id with its counter before and after.
def _inserted_and_notify():
    written = func.unnest(bindparam("run_ids", type_=ARRAY(BigInteger)),
                          bindparam("counts", type_=ARRAY(BigInteger))
                          ).table_valued("run_id", "n").render_derived("w")
    channel = func.concat(literal_column(f"'{ROWS_CHANNEL}'"), runs.c.id)
    return (update(runs).where(runs.c.id == written.c.run_id)
            .values(rows_inserted=runs.c.rows_inserted + written.c.n, updated_at=func.now())
            .returning(runs.c.id, runs.c.rows_inserted - written.c.n, runs.c.rows_inserted,
                       func.pg_notify(channel, cast(bindparam("what"), Text))))


INSERTED_AND_NOTIFY = _inserted_and_notify()


def set_status(conn: Connection, run_id: int, status: str) -> None:
    conn.execute(update(runs).where(runs.c.id == run_id)
                 .values(status=status, updated_at=func.now()))


def set_progress(conn: Connection, run_id: int, progress: dict[str, Any]) -> None:
    """What the run is doing besides train steps (e.g. the warm-up: phase, step, of, loss);
    {} when nothing."""
    conn.execute(update(runs).where(runs.c.id == run_id).values(progress=progress))


def listing(conn: Connection) -> list[dict[str, Any]]:
    """Every run, oldest first: its name (as `run`), status, experiences held, updated_at."""
    held = (select(func.count()).select_from(experiences)
            .where(experiences.c.run_id == runs.c.id).scalar_subquery())
    stmt = select(runs.c.name.label("run"), runs.c.status, held.label("experiences"),
                  runs.c.updated_at).order_by(runs.c.id)
    return [dict(row) for row in conn.execute(stmt).mappings()]


def finished_names(conn: Connection) -> list[str]:
    """The names of the runs that finished (placement counts every other run's demand)."""
    return list(conn.execute(select(runs.c.name).where(runs.c.status == "finished")).scalars())


def delete_run(conn: Connection, name: str) -> bool:
    """Delete a run and everything that is its (tasks, experiences, steps, versions); its
    experiences go with their partitions."""
    run_id = conn.execute(select(runs.c.id).where(runs.c.name == name)).scalar()
    if run_id is None:
        return False
    partitions.drop(conn, run_id)
    return conn.execute(delete(runs).where(runs.c.id == run_id)).rowcount > 0


def check_resumable(conn: Connection, name: str, steps: int) -> None:
    """A run --resume can continue: it exists and has not trained all its steps."""
    row = conn.execute(select(runs.c.id, runs.c.status).where(runs.c.name == name)).first()
    if row is None:
        raise StoreError(f"--resume: run {name!r} does not exist; start it without --resume")
    done = conn.execute(select(func.max(train_steps.c.step))
                        .where(train_steps.c.run_id == row.id)).scalar() or 0
    if row.status == "finished" and done >= steps:
        raise StoreError(f"--resume: run {name!r} is finished ({done} of {steps} steps); "
                         "nothing to resume")


POLICY_CHANNEL = "reservoir_policy"  # NOTIFY payload: "<run id>:<version>"


def _publishing():
    """Statement: a policy version's row, and a notice to listeners if it is new (no row
    when the version was already published); built once."""
    added = (pg_insert(policy_versions)
             .values(run_id=bindparam("of_run"), version=bindparam("new_version"),
                     location=bindparam("at"), train_step=bindparam("after_step"))
             .on_conflict_do_nothing(constraint="policy_versions_run_version")
             .returning(policy_versions.c.id).cte("added"))
    return select(added.c.id, func.pg_notify(POLICY_CHANNEL, bindparam("notice", type_=Text)))


PUBLISHING = _publishing()


def publish_version(conn: Connection, run_id: int, version: int, *, location: str | None,
                    train_step: int | None) -> bool:
    """Record a policy version and notify listeners; False if it was already published."""
    return conn.execute(PUBLISHING, {
        "of_run": run_id, "new_version": version, "at": location, "after_step": train_step,
        "notice": f"{run_id}:{version}"}).first() is not None


def version_by(conn: Connection, run_id: int, step: int | None = None) -> tuple[int, int] | None:
    """(version, train step) of the latest version published after a step <= `step` (any
    step when None); None before any."""
    stmt = (select(policy_versions.c.version, policy_versions.c.train_step)
            .where(policy_versions.c.run_id == run_id)
            .order_by(policy_versions.c.version.desc()).limit(1))
    if step is not None:
        stmt = stmt.where(policy_versions.c.train_step <= step)
    row = conn.execute(stmt).first()
    return None if row is None else (row.version, row.train_step)


def latest_policy(conn: Connection, run_id: int) -> tuple[int, str | None] | None:
    """(version, weights location) of the run's latest published policy; None before any."""
    row = conn.execute(select(policy_versions.c.version, policy_versions.c.location)
                       .where(policy_versions.c.run_id == run_id)
                       .order_by(policy_versions.c.version.desc()).limit(1)).first()
    return None if row is None else (row.version, row.location)


def latest_versions(conn: Connection, run_ids: list[int]) -> dict[int, int]:
    """{run id: its latest published version} for runs that published one."""
    return dict(conn.execute(
        select(policy_versions.c.run_id, func.max(policy_versions.c.version))
        .where(policy_versions.c.run_id.in_(run_ids)).group_by(policy_versions.c.run_id)).all())


def rows_written(conn: Connection, run_ids: list[int]) -> int:
    """How many rows were ever written to these runs (their counters: no experience read)."""
    return conn.execute(select(func.coalesce(func.sum(runs.c.rows_inserted), 0))
                        .where(runs.c.id.in_(run_ids))).scalar_one()


def status_of(conn: Connection, run_id: int) -> str:
    return conn.execute(select(runs.c.status).where(runs.c.id == run_id)).scalar_one()


def status_and_policy(conn: Connection, run_id: int) -> tuple[str, tuple[int, str | None] | None]:
    """The run's status and `latest_policy`, in one statement (an explorer's every round)."""
    row = conn.execute(select(runs.c.status, policy_versions.c.version, policy_versions.c.location)
                       .select_from(runs.outerjoin(policy_versions,
                                                   policy_versions.c.run_id == runs.c.id))
                       .where(runs.c.id == run_id)
                       .order_by(policy_versions.c.version.desc().nulls_last()).limit(1)).one()
    return row.status, None if row.version is None else (row.version, row.location)


def latest_version(run_id_column):
    """Scalar subquery: the latest published policy version of a run (0 before the first)."""
    return (select(func.coalesce(func.max(policy_versions.c.version), 0))
            .where(policy_versions.c.run_id == run_id_column).scalar_subquery())


def _snapshot():
    r, steps, e = runs.alias("r"), train_steps, experiences

    def last_step_of(column, *where):
        return (select(column).where(steps.c.run_id == r.c.id, *where)
                .order_by(steps.c.step.desc()).limit(1).scalar_subquery())

    def rows(status: str):
        return (select(func.count()).where(e.c.run_id == r.c.id,
                                           e.c.status == literal_column(f"'{status}'"))
                .scalar_subquery().label(status))

    accuracy = steps.c.metrics["eval/accuracy"].astext.cast(Float)
    return select(
        r.c.status, r.c.rows_inserted, r.c.progress,
        select(func.max(policy_versions.c.version))
        .where(policy_versions.c.run_id == r.c.id).scalar_subquery().label("version"),
        last_step_of(steps.c.step).label("step"),
        last_step_of(steps.c.metrics, steps.c.step > 0).label("metrics"),
        last_step_of(accuracy, steps.c.metrics.has_key("eval/accuracy")).label("accuracy"),
        rows("raw"), rows("ready"), rows("leased"),
    ).where(r.c.name == bindparam("run"))


SNAPSHOT = _snapshot()


def snapshot(conn: Connection, name: str) -> dict[str, Any] | None:
    """What the live view shows of a run: status, progress, version, last step and its
    metrics, the latest held-out accuracy, rows raw / ready / leased, rows inserted."""
    row = conn.execute(SNAPSHOT, {"run": name}).mappings().first()
    return None if row is None else dict(row)


class Runs(Door):
    """`store.runs`: runs, their lineage and published policy versions."""

    ids_of = reading(ids_of)
    config_of = reading(config_of)
    parent_of = reading(parent_of)
    latest_policy = reading(latest_policy)
    latest_versions = reading(latest_versions)
    listing = reading(listing)
    finished_names = reading(finished_names)
    snapshot = reading(snapshot)
    status_of = reading(status_of)
    status_and_policy = reading(status_and_policy)
    rows_written = reading(rows_written)
    version_by = reading(version_by)
    check_resumable = reading(check_resumable)
    set_status = writing(set_status)
    set_progress = writing(set_progress)
    delete_run = writing(delete_run)
