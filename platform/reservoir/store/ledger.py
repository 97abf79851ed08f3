"""The ledger: a train step and what trained it (experiences, or preference pairs), each step one
statement; the only writer of train_steps, batch_items and batch_pairs."""

from __future__ import annotations

import functools
import json
import math
from typing import Any, Sequence

import asyncpg
from sqlalchemy import (Connection, bindparam, cast, column, func, insert, literal, literal_column,
                        select, table, true, union_all, update)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.types import BigInteger, Float

from reservoir.store.door import Door, reading, writing
from reservoir.errors import LeaseLost, StoreError
from reservoir.store.engine import REUSE_PLANS
from reservoir.store import leasing, lifecycle
from reservoir.store.preferences import PairLease
from reservoir.store.prepared import Prepared
from reservoir.store.sampler import Lease
from reservoir.store.schema import (batch_items, batch_pairs, experience_data, experience_state,
                                     experiences, preferences, runs, train_steps)

LEASE_LOST = "RS001"  # the SQLSTATE lease_consumed raises (migration 0018)


def _step_row():
    """Insert CTE: the step's train_steps row (its values bound); returns its id."""
    return (insert(train_steps).values(
        run_id=bindparam("run_id"), step=bindparam("step"),
        policy_version=bindparam("policy_version"), loss=bindparam("loss"),
        metrics=bindparam("metrics", type_=JSONB), n_experiences=bindparam("n_experiences"),
        stage=bindparam("stage")).returning(train_steps.c.id).cte("step"))


def commit_statement(run_ids: tuple[int, ...]):
    """The step commit of a lease of these runs: one statement, committed alone.

    The lease's rows become consumed, the step row is inserted, and one ledger row per consumed
    experience joins the two; lease_consumed (migration 0018) fails the whole statement unless
    every leased row was consumed. It returns the step's id (one row: a result of 256 rows cost
    the client more than the server's inserts). The runs' ids are written into the SQL (integers
    from the runs table), so its plan, kept by the connection, reads only their partitions; the
    key check of the step row (to runs) reuses its plan.
    """
    s = experience_state
    runs = [literal_column(str(int(run_id))) for run_id in run_ids]
    consumed = lifecycle.consumed(
        s.c.run_id.in_(runs), s.c.id == func.any(bindparam("ids", type_=ARRAY(BigInteger)))
    ).cte("consumed")
    step = _step_row()
    weighted = func.unnest(bindparam("ids", type_=ARRAY(BigInteger)),
                           bindparam("weights", type_=ARRAY(Float))
                           ).table_valued("experience_id", "weight").render_derived("w")
    items = (insert(batch_items).from_select(
        ["train_step_id", "run_id", "experience_id", "policy_version", "weight"],
        select(step.c.id, consumed.c.run_id, consumed.c.id, bindparam("policy_version"),
               weighted.c.weight)
        .join_from(consumed, weighted, weighted.c.experience_id == consumed.c.id)
        .join(step, true()))
        .returning(batch_items.c.train_step_id).cte("items"))
    n_items = select(func.count()).select_from(items).scalar_subquery()
    return select(select(step.c.id).scalar_subquery(),
                  func.lease_consumed(n_items, bindparam("n_experiences"), leasing.TOKEN),
                  literal_column(REUSE_PLANS)).add_cte(consumed, step, items)


@functools.lru_cache(maxsize=256)
def _prepared_commit(run_ids: tuple[int, ...]) -> Prepared:
    return Prepared(commit_statement(run_ids))


def finite(metrics: dict[str, Any]) -> dict[str, Any]:
    """Metrics as JSON can hold them: NaN and infinities become null."""
    return {name: None if isinstance(value, float) and not math.isfinite(value) else value
            for name, value in metrics.items()}


async def commit_step(engine: AsyncEngine, lease: Lease, *, run_id: int, step: int,
                      policy_version: int, loss: float | None = None,
                      metrics: dict[str, Any] | None = None,
                      weights: Sequence[float] | None = None, stage: str | None = None) -> int:
    """Record `step` (of `stage`) as trained on the lease's rows; returns the train_steps id.

    In one statement: the leased rows become `consumed` (times_sampled + 1), a train_steps
    row is inserted, and one batch_items row per experience records the policy version the
    trainer held and the row's weight. If any row's lease was lost (expired and reclaimed) or
    the step already exists, nothing is written and LeaseLost / StoreError is raised.
    """
    ids = lease.ids
    if weights is not None and len(weights) != len(ids):
        raise StoreError(f"commit_step: {len(weights)} weights for {len(ids)} leased rows")
    params = dict(token=lease.token, run_id=run_id, step=step, policy_version=policy_version,
                  loss=loss, metrics=json.dumps(finite(metrics or {})), n_experiences=len(ids),
                  ids=ids, stage=stage,
                  weights=[float(w) for w in weights] if weights is not None else [1.0] * len(ids))
    async with engine.connect() as conn:  # the statement commits alone
        try:
            [(step_id, _, _)] = await _prepared_commit(lease.run_ids).fetch(conn, params)
        except asyncpg.PostgresError as exc:
            raise _commit_error(exc, step, run_id) from exc
    return step_id


def _commit_error(exc: asyncpg.PostgresError, step: int, run_id: int,
                  unit: str = "rows") -> Exception:
    """What a failed step commit of a lease of `unit` (rows, pairs) tells its caller; nothing
    was consumed."""
    first_line = str(exc).splitlines()[0].replace(" rows ", f" {unit} ")
    if exc.sqlstate == LEASE_LOST:
        return LeaseLost(f"step {step}: {first_line}; nothing was consumed, lease new {unit}")
    if getattr(exc, "constraint_name", None) == "train_steps_run_step":
        return StoreError(f"step {step} of run id {run_id} is already committed; nothing was "
                          "consumed")
    return StoreError(f"step {step} could not be committed; nothing was consumed: {first_line}")


def record_step(conn: Connection, run_id: int, step: int, *, policy_version: int,
                metrics: dict[str, Any], loss: float | None = None, stage: str | None = None,
                experience_ids: Sequence[int] = ()) -> None:
    """A train_steps row and a batch_items row per experience it read without leasing (stored
    history, or none: step 0, a step on tasks); kept as it is if the step was recorded already
    (a trainer that starts again), so the step and its ledger rows are written together or
    not at all."""
    inserted = conn.execute(pg_insert(train_steps).values(
        run_id=run_id, step=step, loss=loss, policy_version=policy_version, stage=stage,
        metrics=finite(metrics), n_experiences=len(experience_ids))
        .on_conflict_do_nothing(constraint="train_steps_run_step")
        .returning(train_steps.c.id)).scalar()
    if inserted is not None and experience_ids:
        state = experience_state
        written = conn.execute(insert(batch_items).from_select(
            ["train_step_id", "run_id", "experience_id", "policy_version"],
            select(literal(inserted), state.c.run_id, state.c.id, literal(policy_version))
            .where(state.c.id.in_(list(experience_ids))))).rowcount
        if written != len(set(experience_ids)):
            raise StoreError(f"step {step} of run id {run_id}: {len(set(experience_ids))} "
                             f"experience ids, {written} of them in the store; nothing recorded")


def add_step_metrics(conn: Connection, run_id: int, step: int, metrics: dict[str, Any]) -> None:
    """Merge metrics measured after a step was committed (for example held-out accuracy)."""
    conn.execute(update(train_steps)
                 .where(train_steps.c.run_id == run_id, train_steps.c.step == step)
                 .values(metrics=train_steps.c.metrics.op("||")(cast(finite(metrics), JSONB))))


def step_experiences(conn: Connection, run_id: int, step: int) -> list[int]:
    """Ids of the experiences a committed step trained on, in id order."""
    stmt = (select(batch_items.c.experience_id)
            .join(train_steps, train_steps.c.id == batch_items.c.train_step_id)
            .where(train_steps.c.run_id == run_id, train_steps.c.step == step)
            .order_by(batch_items.c.experience_id))
    return list(conn.execute(stmt).scalars())


def step_pairs(conn: Connection, run_id: int, step: int) -> list[tuple[int, int]]:
    """(chosen, rejected) experience ids of the pairs a committed step trained on, in pair id
    order."""
    stmt = (select(preferences.c.chosen_id, preferences.c.rejected_id)
            .join(batch_pairs, batch_pairs.c.preference_id == preferences.c.id)
            .join(train_steps, train_steps.c.id == batch_pairs.c.train_step_id)
            .where(train_steps.c.run_id == run_id, train_steps.c.step == step)
            .order_by(preferences.c.id))
    return [tuple(row) for row in conn.execute(stmt)]


def step_samples(conn: Connection, run_id: int, step: int, most: int = 4) -> list[dict]:
    """A few of the rows a committed step trained on, in id order: prompt, response, reward
    (what trackers show beside an evaluation)."""
    return [{str(key): value for key, value in row._mapping.items()}
            for row in conn.execute(samples_statement(run_id, step, most))]


def samples_statement(run_id: int, step: int, most: int):
    """The run named on each partitioned table (batch_items, experience_data): the server then
    reads that run's partitions only, however many runs the store holds."""
    data, items = experience_data.c, batch_items.c
    return (select(data.prompt_text.label("prompt"), data.response_text.label("response"),
                   data.reward, data.shaped_reward)
            .select_from(batch_items.join(train_steps, train_steps.c.id == items.train_step_id)
                         .join(experience_data, (data.run_id == items.run_id)
                               & (data.id == items.experience_id)))
            .where(train_steps.c.run_id == run_id, train_steps.c.step == step,
                   items.run_id == run_id, data.run_id == run_id)
            .order_by(items.experience_id).limit(most))


def step_time(conn: Connection, run_id: int, step: int):
    """When the run's step was committed (None if it was not)."""
    return conn.execute(select(train_steps.c.created_at).where(
        train_steps.c.run_id == run_id, train_steps.c.step == step)).scalar()


def has_step(conn: Connection, run_id: int, step: int) -> bool:
    return conn.execute(select(train_steps.c.id).where(
        train_steps.c.run_id == run_id, train_steps.c.step == step)).first() is not None


def last_step(conn: Connection, run_id: int) -> int | None:
    """The run's last committed step (0 is the step RL starts from), None before any."""
    return conn.execute(select(func.max(train_steps.c.step))
                        .where(train_steps.c.run_id == run_id)).scalar()


_run_steps = table("run_steps", *(column(name) for name in (
    "run", "step", "created_at", "loss", "eval_accuracy", "reward_mean", "response_len_mean")),
    schema="analytics")


def step_history(conn: Connection, run: str) -> list[tuple]:
    """(step, created_at, loss, held-out accuracy, reward mean, response length mean) per step."""
    v = _run_steps.c
    return [tuple(row) for row in conn.execute(
        select(v.step, v.created_at, v.loss, v.eval_accuracy.label("accuracy"), v.reward_mean,
               v.response_len_mean).where(v.run == run).order_by(v.step))]


def staleness_counts(conn: Connection, run: str) -> list[tuple[int, int]]:
    """(staleness in versions, trained rows) of a run's ledger."""
    bi, e = batch_items.c, experiences.c
    staleness = (bi.policy_version - e.policy_version).label("staleness")
    return [tuple(row) for row in conn.execute(
        select(staleness, func.count().label("n"))
        .join_from(batch_items, experiences, e.id == bi.experience_id)
        .join(train_steps, train_steps.c.id == bi.train_step_id)
        .join(runs, runs.c.id == train_steps.c.run_id)
        .where(runs.c.name == run).group_by(staleness).order_by(staleness))]


# A step on preference pairs, one statement: the lease's pairs become consumed, the step row is
# inserted, one batch_pairs row per pair and one batch_items row per experience (chosen +1,
# rejected -1) join them; the keys those rows check reuse their plans (engine.REUSE_PLANS).
def _commit_pairs_statement():
    """A step on preference pairs, one statement: the lease's pairs become consumed, the step
    row is inserted, one batch_pairs row per pair and one batch_items row per experience
    (chosen +1, rejected -1; an experience on both sides gets the sum) join them; the keys
    those rows check reuse their plans (engine.REUSE_PLANS)."""
    f = preferences
    consumed = (leasing.consumed(f, f.c.status == "leased")
                .returning(f.c.id, f.c.run_id, f.c.chosen_id, f.c.rejected_id).cte("consumed"))
    step = _step_row()
    ledger_pairs = (insert(batch_pairs).from_select(
        ["train_step_id", "preference_id"],
        select(step.c.id, consumed.c.id).join_from(consumed, step, true()))
        .returning(batch_pairs.c.preference_id).cte("ledger_pairs"))
    side = union_all(select(consumed.c.run_id, consumed.c.chosen_id.label("experience_id"),
                            literal_column("1.0::float8").label("weight")),
                     select(consumed.c.run_id, consumed.c.rejected_id,
                            literal_column("-1.0::float8"))).subquery("side")
    ledger_items = (insert(batch_items).from_select(
        ["train_step_id", "run_id", "experience_id", "policy_version", "weight"],
        select(step.c.id, side.c.run_id, side.c.experience_id, bindparam("policy_version"),
               func.sum(side.c.weight)).join_from(side, step, true())
        .group_by(step.c.id, side.c.run_id, side.c.experience_id))
        .returning(batch_items.c.experience_id).cte("ledger_items"))
    n_pairs = select(func.count()).select_from(ledger_pairs).scalar_subquery()
    return select(select(step.c.id).scalar_subquery(),
                  func.lease_consumed(n_pairs, bindparam("n_pairs"), leasing.TOKEN),
                  literal_column(REUSE_PLANS)).add_cte(consumed, step, ledger_pairs, ledger_items)


COMMIT_PAIRS = Prepared(_commit_pairs_statement())


async def commit_pairs(engine: AsyncEngine, lease: PairLease, *, run_id: int, step: int,
                       policy_version: int, loss: float | None = None,
                       metrics: dict[str, Any] | None = None, stage: str | None = None) -> int:
    """Record `step` (of `stage`) as trained on the lease's pairs; returns the train_steps id.

    In one transaction: the pairs become `consumed` (times_sampled + 1), a train_steps row is
    inserted (n_experiences = 2 per pair), one batch_pairs row per pair and one batch_items row
    per experience. If any pair's lease was lost (expired and reclaimed) or the step already
    exists, nothing is written and LeaseLost / StoreError is raised.
    """
    n = len(lease.pairs)
    params = dict(token=lease.token, run_id=run_id, step=step, policy_version=policy_version,
                  loss=loss, metrics=json.dumps(finite(metrics or {})), n_experiences=2 * n,
                  n_pairs=n, stage=stage)
    async with engine.connect() as conn:  # the statement commits alone
        try:
            [(step_id, _, _)] = await COMMIT_PAIRS.fetch(conn, params)
        except asyncpg.PostgresError as exc:
            raise _commit_error(exc, step, run_id, "pairs") from exc
    return step_id
    return step_id


def steps_after(conn: Connection, run_id: int, step: int, limit: int = 1000) -> list[tuple]:
    """The run's committed steps after `step`, in order, up to `limit`: (step, stage, loss,
    metrics, created_at) each (what trackers follow)."""
    ts = train_steps.c
    return [tuple(row) for row in conn.execute(
        select(ts.step, ts.stage, ts.loss, ts.metrics, ts.created_at)
        .where(ts.run_id == run_id, ts.step > step).order_by(ts.step).limit(limit))]


class Ledger(Door):
    """`store.ledger`: train steps, what trained them and their metrics."""

    step_experiences = reading(step_experiences)
    step_pairs = reading(step_pairs)
    step_time = reading(step_time)
    step_samples = reading(step_samples)
    last_step = reading(last_step)
    step_history = reading(step_history)
    staleness_counts = reading(staleness_counts)
    steps_after = reading(steps_after)
    record_step = writing(record_step)
    add_step_metrics = writing(add_step_metrics)
