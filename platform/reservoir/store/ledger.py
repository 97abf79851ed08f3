"""The ledger: a train step, the experiences it consumed, and their status, in one transaction."""

from __future__ import annotations

from typing import Any, Sequence

from sqlalchemy import func, insert, literal, select, update
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.types import BigInteger, Float

from reservoir.errors import LeaseLost, StoreError
from reservoir.store.sampler import Lease
from reservoir.store.schema import batch_items, experiences as e, train_steps


async def commit_step(engine: AsyncEngine, lease: Lease, *, run_id: int, step: int,
                      policy_version: int, loss: float | None = None,
                      metrics: dict[str, Any] | None = None,
                      weights: Sequence[float] | None = None) -> int:
    """Record `step` as trained on the lease's rows; returns the train_steps id.

    In one transaction: the leased rows become `consumed` (times_sampled + 1), a train_steps
    row is inserted, and one batch_items row per experience records the policy version the
    trainer held and the row's weight. If any row's lease was lost (expired and reclaimed) or
    the step already exists, nothing is written and LeaseLost / StoreError is raised.
    """
    ids = lease.ids
    if weights is not None and len(weights) != len(ids):
        raise StoreError(f"commit_step: {len(weights)} weights for {len(ids)} leased rows")
    async with engine.begin() as conn:
        consumed = (await conn.execute(
            update(e).where(e.c.lease_token == lease.token)
            .values(status="consumed", times_sampled=e.c.times_sampled + 1,
                    lease_token=None, leased_until=None)
            .returning(e.c.id))).scalars().all()
        if len(consumed) != len(ids):
            raise LeaseLost(
                f"step {step}: lease {lease.token} holds {len(consumed)} of its {len(ids)} rows "
                "(it expired and was reclaimed); nothing was consumed, lease a new batch")
        try:
            step_id = (await conn.execute(
                insert(train_steps).values(run_id=run_id, step=step, policy_version=policy_version,
                                           loss=loss, metrics=metrics or {},
                                           n_experiences=len(ids))
                .returning(train_steps.c.id))).scalar_one()
        except IntegrityError as exc:
            raise StoreError(f"step {step} of run id {run_id} is already committed; "
                             "nothing was consumed") from exc
        items = select(
            literal(step_id, BigInteger),
            func.unnest(literal(ids, ARRAY(BigInteger))),
            literal(policy_version),
            func.unnest(literal(list(weights) if weights is not None else [1.0] * len(ids),
                                ARRAY(Float))),
        )
        await conn.execute(insert(batch_items).from_select(
            ["train_step_id", "experience_id", "policy_version", "weight"], items))
    return step_id
