"""The store as one object: `AsyncStore` is the core, `Store` its blocking twin.

    store = Store.open(config)            # embedded server unless a URL is configured
    run_id = store.create_run("demo", group_size=8)
    store.write_groups([[Experience(...), ...], ...])
    lease = store.lease("demo", groups=4)
    store.commit_step(lease, step=1, policy_version=0, loss=0.1)

Every blocking method of `Store` is derived from the coroutine of the same name.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Literal, Sequence

from sqlalchemy import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from reservoir.config import (DEFAULT_REWARD_RANGE, ReservoirConfig, SamplerConfig,
                              check_reward_range)
from reservoir.errors import ConfigError
from reservoir.logs import say
from reservoir.store import engine as engines
from reservoir.store import (episodes, ledger, pipelines, preferences, reviews, run_servers,
                             runs, sampler, rounds, schedules, tasks, trackers, writer)
from reservoir.store import migrate as migrations
from reservoir.plan.urls import redact
from reservoir.store.loop import LoopThread
from reservoir.store.preferences import Pair, PairLease
from reservoir.store.records import Experience
from reservoir.store.sampler import Lease
from reservoir.store.writer import WriteResult


class AsyncStore:
    def __init__(self, url: str, flow: SamplerConfig, sync: Engine,
                 reward_range: tuple[float, float] = DEFAULT_REWARD_RANGE) -> None:
        self.engine: AsyncEngine = engines.async_engine(url)
        # leases and step commits: statements with their runs in their SQL, plans kept
        self.leases: AsyncEngine = engines.async_engine(url, kept_plans=True)
        self.flow, self.reward_range = flow, check_reward_range(*reward_range)
        self._sync = sync
        self._run_ids: dict[str, int] = {}

    def run_ids(self, run: str | Sequence[str]) -> list[int]:
        names = [run] if isinstance(run, str) else list(run)
        missing = [name for name in names if name not in self._run_ids]
        if missing:
            with self._sync.connect() as conn:
                for name in missing:
                    self._run_ids[name] = runs.run_id_of(conn, name)
        return [self._run_ids[name] for name in names]

    async def write_groups(self, groups: Sequence[Sequence[Experience]], *,
                           status: Literal["raw", "ready"] = "ready",
                           on_invalid: Literal["raise", "skip"] = "raise",
                           before_copy=None) -> WriteResult:
        return await writer.write_groups(self.engine, groups, flow=self.flow, status=status,
                                         on_invalid=on_invalid, before_copy=before_copy,
                                         reward_range=self.reward_range)

    async def lease(self, run: str | Sequence[str], *, rows: int | None = None,
                    groups: int | None = None, min_policy_version: int | None = None,
                    allow_partial: bool = False, timeout_s: float | None = None) -> Lease:
        """Lease `rows` rows or `groups` whole groups; neither: `batch` of the configured unit."""
        if rows is None and groups is None:
            rows, groups = ((self.flow.batch, None) if self.flow.unit == "rows"
                            else (None, self.flow.batch))
        return await sampler.lease(self.leases, self.run_ids(run), rows=rows, groups=groups,
                                   flow=self.flow, min_policy_version=min_policy_version,
                                   allow_partial=allow_partial, timeout_s=timeout_s)

    async def commit_step(self, lease: Lease, *, step: int, policy_version: int,
                          run: str | None = None, loss: float | None = None,
                          metrics: dict[str, Any] | None = None,
                          weights: Sequence[float] | None = None,
                          stage: str | None = None) -> int:
        if run is None and len(lease.run_ids) != 1:
            raise ValueError("the lease spans several runs: name the run this step belongs to")
        run_id = self.run_ids(run)[0] if run is not None else lease.run_ids[0]
        return await ledger.commit_step(self.leases, lease, run_id=run_id, step=step,
                                        policy_version=policy_version, loss=loss,
                                        metrics=metrics, weights=weights, stage=stage)

    async def release(self, lease: Lease) -> int:
        return await sampler.release(self.engine, lease)

    async def set_aside(self, lease: Lease, groups, *, reason: str) -> Lease:
        return await sampler.set_aside(self.engine, lease, groups, reason=reason)

    async def join(self, lease: Lease, other: Lease) -> Lease:
        return await sampler.join(self.engine, lease, other)

    async def release_runs(self, run: str | Sequence[str]) -> int:
        return await sampler.release_runs(self.engine, self.run_ids(run))

    async def fetch(self, ids: Sequence[int]) -> list[sampler.LeasedExperience]:
        return await sampler.fetch(self.engine, ids)

    async def renew(self, lease: Lease, seconds: float | None = None):
        return await sampler.renew(self.engine, lease, seconds or self.flow.lease_seconds)

    async def reclaim_expired(self) -> int:
        async with self.engine.begin() as conn:
            return await sampler.reclaim_expired(conn)

    async def retire(self, run: str | Sequence[str]) -> int:
        return await sampler.retire(self.engine, self.run_ids(run), self.flow)

    async def lease_pairs(self, run: str | int | Sequence[str | int], *,
                          pairs: int | None = None, timeout_s: float | None = None) -> PairLease:
        """Lease up to `pairs` ready preference pairs (unset: `batch`) of runs (names or
        ids), oldest first."""
        flow, given = self.flow, [run] if isinstance(run, (str, int)) else list(run)
        run_ids = [r if isinstance(r, int) else self.run_ids(r)[0] for r in given]
        return await preferences.lease_pairs(
            self.engine, run_ids, pairs=pairs or flow.batch,
            lease_seconds=flow.lease_seconds, poll_interval_s=flow.poll_interval_s,
            timeout_s=flow.wait_timeout_s if timeout_s is None else timeout_s)

    async def commit_pairs(self, lease: PairLease, *, step: int, policy_version: int,
                           run: str | None = None, loss: float | None = None,
                           metrics: dict[str, Any] | None = None, stage: str | None = None) -> int:
        if run is None and len(lease.run_ids) != 1:
            raise ValueError("the lease spans several runs: name the run this step belongs to")
        run_id = self.run_ids(run)[0] if run is not None else lease.run_ids[0]
        return await ledger.commit_pairs(self.engine, lease, run_id=run_id, step=step,
                                              policy_version=policy_version, loss=loss,
                                              metrics=metrics, stage=stage)

    async def release_pairs(self, lease: PairLease) -> int:
        return await preferences.release_pairs(self.engine, lease)

    async def recycle_pairs(self, run_ids: Sequence[int]) -> int:
        return await preferences.recycle_pairs(self.engine, run_ids)

    async def close(self) -> None:
        await self.engine.dispose()
        await self.leases.dispose()


def _branch(conn: Connection, run_id: int, parent_name: str, step: int) -> None:
    """A branched run's lineage and its parent's tasks (how often each was explored too)."""
    parent = runs.run_id_of(conn, parent_name)  # StoreError: there is no such run
    if not ledger.has_step(conn, parent, step):
        raise ConfigError(f"--from {parent_name}@{step}: run {parent_name!r} has not "
                          f"committed step {step}")
    runs.set_parent(conn, run_id, parent, step)
    tasks.copy_tasks(conn, parent, run_id)


def _blocking(coroutine_function):
    @functools.wraps(coroutine_function)
    def method(self: "Store", *args, **kwargs):
        return self._loop.run(coroutine_function(self.aio, *args, **kwargs))

    return method


class Store:
    """Blocking access to the store; `store.aio` is the async core, `store.engine` psycopg2."""

    def __init__(self, url: str, flow: SamplerConfig | None = None,
                 reward_range: tuple[float, float] = DEFAULT_REWARD_RANGE) -> None:
        self.url = url
        self.engine: Engine = engines.sync_engine(url)
        self._loop = LoopThread()
        self.aio = AsyncStore(url, flow or SamplerConfig(), self.engine, reward_range)
        # the families of tables, each method one transaction (reservoir.store.door)
        self.runs = runs.Runs(self.engine)
        self.tasks = tasks.Tasks(self.engine)
        self.ledger = ledger.Ledger(self.engine)
        self.pipelines = pipelines.Pipelines(self.engine)
        self.reviews = reviews.Reviews(self.engine)
        self.schedules = schedules.Schedules(self.engine)
        self.episodes = episodes.Episodes(self.engine)
        self.trackers = trackers.Trackers(self.engine)
        self.rounds = rounds.Rounds(self.engine)
        self.run_servers = run_servers.RunServers(self.engine)

    @classmethod
    def open(cls, config: ReservoirConfig | None = None, *, quiet: bool = False,
             migrate: bool = False) -> "Store":
        """Connect (starting the embedded server if no URL is set). An empty database gets
        Reservoir's schema only with `migrate` (commands meant to change the schema); without,
        it is an error that changes nothing. An old schema is always an error."""
        config = config or ReservoirConfig()
        store = cls(engines.resolve_url(config.store), config.sampler,
                    config.explorer.reward_range)
        try:
            upgraded_to = migrations.ensure_schema(store.engine, create=migrate)
        except BaseException:
            store.close()
            raise
        if upgraded_to and not quiet:
            say("store", f"Empty database at {redact(store.url)}: upgraded its schema to "
                         f"revision {upgraded_to}.")
        return store

    @property
    def flow(self) -> SamplerConfig:
        return self.aio.flow

    def create_run(self, name: str, *, group_size: int | None = None, model: str | None = None,
                   config: dict[str, Any] | None = None, vocab_size: int | None = None,
                   exist_ok: bool = False) -> int:
        with self.engine.begin() as conn:
            return runs.create_run(conn, name, group_size=group_size, model=model,
                                   config=config, vocab_size=vocab_size, exist_ok=exist_ok)

    def ensure_run(self, name: str, *, group_size: int | None, model: str,
                   config: dict[str, Any], vocab_size: int | None,
                   branch: tuple[str, int] | None,
                   task_rows: Callable[[], Sequence[dict[str, Any]]]) -> int:
        """The run's id. The first caller creates the run and, in the same transaction, its
        tasks (`task_rows()`, called only then) or, for a branch (parent, step), its lineage
        and a copy of the parent's tasks: all of it commits or none does, and a concurrent
        caller's insert waits for that commit, then finds the run. For a run that exists only
        its vocab_size is brought up to date (when given)."""
        with self.engine.begin() as conn:
            run_id = runs.insert_run(conn, name, group_size=group_size, model=model,
                                     config=config, vocab_size=vocab_size)
            if run_id is None:  # it exists (another process may have created it a moment ago)
                run_id = runs.run_id_of(conn, name)
                if vocab_size is not None:  # made without a model (tasks load), or another one
                    runs.set_vocab_size(conn, run_id, vocab_size)
            elif branch is not None:
                _branch(conn, run_id, *branch)
            else:
                tasks.add_tasks(conn, run_id, task_rows())
            return run_id

    def run_id(self, run: str) -> int:
        """The run's id: the one place a run's name becomes its id (looked up once per store,
        then remembered); StoreError when there is no such run."""
        return self.aio.run_ids(run)[0]

    def step_committed(self, run: str, step: int) -> bool:
        """Whether the run's step is in the ledger (a commit whose answer was lost)."""
        with self.engine.connect() as conn:
            return ledger.has_step(conn, self.aio.run_ids(run)[0], step)

    def publish_version(self, run: str, version: int, *, location: str | None = None,
                        train_step: int | None = None) -> bool:
        with self.engine.begin() as conn:
            return runs.publish_version(conn, self.aio.run_ids(run)[0], version, location=location,
                                 train_step=train_step)

    def add_pairs(self, pairs: Sequence[Pair | tuple]) -> int:
        """Store preference pairs (chosen_id, rejected_id, margin, source); returns how many
        were added (pairs already stored are skipped)."""
        with self.engine.begin() as conn:
            return preferences.add_pairs(conn, pairs)

    write_groups = _blocking(AsyncStore.write_groups)
    lease = _blocking(AsyncStore.lease)
    commit_step = _blocking(AsyncStore.commit_step)
    release = _blocking(AsyncStore.release)
    set_aside = _blocking(AsyncStore.set_aside)
    join = _blocking(AsyncStore.join)
    release_runs = _blocking(AsyncStore.release_runs)
    fetch = _blocking(AsyncStore.fetch)
    renew = _blocking(AsyncStore.renew)
    reclaim_expired = _blocking(AsyncStore.reclaim_expired)
    retire = _blocking(AsyncStore.retire)
    lease_pairs = _blocking(AsyncStore.lease_pairs)
    commit_pairs = _blocking(AsyncStore.commit_pairs)
    release_pairs = _blocking(AsyncStore.release_pairs)
    recycle_pairs = _blocking(AsyncStore.recycle_pairs)

    def close(self) -> None:
        self._loop.run(self.aio.close())
        self._loop.stop()
        self.engine.dispose()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
