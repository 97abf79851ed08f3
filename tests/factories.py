"""Experience groups for tests: small, seeded, and easy to make wrong on purpose."""

from __future__ import annotations

import numpy as np

from reservoir.store import Experience, Store


def make_group(run: str, *, size: int = 4, rewards=None, version: int = 0, seed: int = 0,
               task_id: int | None = None, response_len: int = 6, **overrides) -> list[Experience]:
    rng = np.random.default_rng(seed)
    rewards = rewards if rewards is not None else [float(i % 2) for i in range(size)]
    group = []
    for i in range(size):
        fields = dict(
            run=run, task_id=task_id, policy_version=version, prompt_text=f"prompt {seed}",
            response_text=f"response {seed}.{i}", prompt_ids=rng.integers(0, 1000, 5),
            response_ids=rng.integers(0, 1000, response_len),
            logprobs=-rng.random(response_len).astype(np.float32),
            action_mask=np.ones(response_len, np.uint8), reward=float(rewards[i]),
            reward_components={"accuracy": float(rewards[i])}, metadata={"i": i})
        fields.update(overrides)
        group.append(Experience(**fields))
    return group


def fill(store: Store, run: str, n_groups: int, *, size: int = 4, version: int = 0,
         start_seed: int = 0) -> None:
    store.write_groups([make_group(run, size=size, version=version, seed=start_seed + i)
                        for i in range(n_groups)])


def rollouts(engine, store: Store, run: str, tasks, *, n: int, max_tokens: int,
             version: int = 0, reward: str = "exact_match", workflow: str = "single_turn",
             seed: int = 0, **options):
    """Groups of `workflow` on the tasks with the engine, written to the store (seeded)."""
    import torch

    from reservoir.explorer.batcher import Batcher
    from reservoir.explorer.policy import Sampling
    from reservoir.explorer.workflow import explore, make_workflow

    torch.manual_seed(seed)
    with Batcher(engine) as batcher:
        groups = explore(make_workflow(workflow, options), tasks, batcher,
                         Sampling(n, 1.0, max_tokens), run=run, version=version, reward=reward)
    return store.write_groups(groups)


def _plan(engine, statement, params: dict, options: str = "") -> dict:
    """The server's plan of `statement` bound to `params` (EXPLAIN (FORMAT JSON, options));
    what an ANALYZE executes is rolled back."""
    with engine.connect() as conn:
        bound = statement.compile(dialect=conn.dialect).construct_expanded_state(params)
        plan = conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON{options}) " + bound.statement,
                                    bound.parameters).scalar()
        conn.rollback()
    return plan[0]["Plan"]


def planned_relations(engine, statement, params: dict) -> set[str]:
    """The tables and partitions the server's plan of `statement` (bound to `params`) reads."""
    plan = _plan(engine, statement, params)

    def relations(node):
        yield node.get("Relation Name")
        for child in node.get("Plans", []):
            yield from relations(child)

    return set(relations(plan)) - {None}


def rows_read(engine, statement, params: dict, table_prefix: str) -> int:
    """The rows the server's scans of the tables named `table_prefix*` read (returned or
    removed by a filter, every loop) when it runs `statement`, in a transaction rolled back."""
    return plan_rows_read(_plan(engine, statement, params, ", ANALYZE"), table_prefix)


def plan_rows_read(plan: dict, table_prefix: str) -> int:
    """The rows a plan's scans of the tables named `table_prefix*` read, every loop."""
    def read(node):
        if (node.get("Relation Name") or "").startswith(table_prefix):
            yield (node["Actual Rows"] + node.get("Rows Removed by Filter", 0)
                   + node.get("Rows Removed by Index Recheck", 0)) * node["Actual Loops"]
        for child in node.get("Plans", []):
            yield from read(child)

    return round(sum(read(plan)))


def lease_rows_read(store: Store, run_id: int, unit: str, n: int) -> int:
    """The state rows the server reads for a lease of `n` rows or groups of the run."""
    import uuid
    from datetime import timedelta

    from reservoir.store import sampler

    return rows_read(store.engine, sampler.lease_statement(unit, store.flow, False, (run_id,), n),
                     dict(wanted=n, token=str(uuid.uuid4()), lease_for=timedelta(seconds=60)),
                     "experience_state")


def kept_plan(store: Store, prepared, params: dict) -> dict:
    """The plan, executed (EXPLAIN ANALYZE) in a transaction rolled back, that `prepared` (a
    store.prepared.Prepared) runs with on a lease's connection: planned once, generically
    (engine.KEPT_PLANS_SETTINGS), as PREPARE and EXPLAIN EXECUTE show it."""
    import json

    async def explain() -> dict:
        async with store.aio.leases.connect() as conn:
            driver = (await conn.get_raw_connection()).driver_connection
            statement = await driver.prepare(prepared.sql)
            types = [await driver.fetchval("SELECT format_type($1, NULL)", t.oid)
                     for t in statement.get_parameters()]
            values = [await driver.fetchval(f"SELECT quote_nullable(CAST($1 AS {t}))", value)
                      + f"::{t}" for t, value in zip(types, prepared.args(params))]
            await driver.execute(f"PREPARE kept ({', '.join(types)}) AS {prepared.sql}")
            transaction = driver.transaction()
            await transaction.start()
            try:
                plan = await driver.fetchval(
                    f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE kept({', '.join(values)})")
                return (json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"]
            finally:
                await transaction.rollback()
                await driver.execute("DEALLOCATE kept")  # a session's, not the transaction's

    return store._loop.run(explain())
