"""An explorer worker: claim tasks, run the workflow on them with the latest policy, write
their groups, repeat.

It runs in any process (a Ray actor of a pool, or plainly) and meets the trainer only in the
store: it reads the latest policy version and loads its weights in place when it changes,
claims as many tasks as the pace allows (`reservoir.store.pace`), writes one group per task
stamped with the version that made it, and stops when the run is finished or stopped, or when
asked to. Its claims are given back when it stops; if it dies they expire.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch

from reservoir.config import ReservoirConfig
from reservoir.errors import ClaimLost
from reservoir.explorer.engine import Engine, take_policy
from reservoir.explorer.engines import make_engine
from reservoir.explorer.batcher import Batcher
from reservoir.explorer.policy import Sampling
from reservoir.explorer.workflow import Task, explore, make_workflow
from reservoir.logs import relayed, say
from reservoir.store import (POLICY_CHANNEL, Listener, Pace, Patience, Resumption, Round, Store,
                             TaskOrder, finishing, is_outage, recording)
from reservoir.plan.streams import written_status
from reservoir.plan.stages import last_step, plan, step_seed

DONE = ("finished", "stopped")  # a failed run waits for its trainer to resume (Resumption)
IDLE_POLL_S = 1.0  # re-check the store this often even without a notification


@dataclass
class ExplorerStats:
    worker: str
    groups: int = 0
    versions_loaded: int = 0
    update_seconds: list[float] = field(default_factory=list)  # each in-place weight update

    def line(self) -> str:
        updates = self.update_seconds
        timing = (f" (in-place updates: mean {sum(updates) / len(updates):.2f} s, max "
                  f"{max(updates):.2f} s)" if updates else "")
        return f"{self.worker}: {self.groups} groups, {self.versions_loaded} policy versions " \
               f"loaded{timing}"


def set_threads(threads: int) -> None:
    """Torch's intra-op threads (Ray sets 1 in its workers through OMP_NUM_THREADS)."""
    torch.set_num_threads(threads)


class ExplorerWorker:
    """Each round seeds its sampling from the worker's seed, the policy version and the
    round's first task, so a resumed run samples what the first attempt did, and a sync run
    samples the same whether split or colocated. `shared`: the engine is the trainer's own
    module (a colocated run): it always holds the latest policy, so nothing is loaded."""

    def __init__(self, config: ReservoirConfig, index: int = 0, *,
                 shared: bool = False, relay=None) -> None:
        self.config, self.shared, self.relay = config, shared, relay
        self.name = f"explorer-{index}@{socket.gethostname()}:{os.getpid()}"
        self.seed = config.run.seed + 1000 * (index + 1)
        self.token = uuid.uuid4()
        self.version: int | None = None
        self.update_s: float | None = None  # the last in-place update, until a round is written
        self.workflow = make_workflow(config.explorer.workflow, config.explorer.workflow_options)
        self._stop = threading.Event()

    def request_stop(self) -> None:
        self._stop.set()

    def pid(self) -> int:
        return os.getpid()

    def run(self) -> ExplorerStats:
        """Explore until the run ends or a stop is requested."""
        with relayed(self.relay, self.name):
            return self._explore()

    def _explore(self) -> ExplorerStats:
        set_threads(self.config.torch_threads("explorer"))
        torch.manual_seed(self.seed)
        stats = ExplorerStats(self.name)
        engine = make_engine(self.config, seed=self.seed)
        patience = Patience(self.config.store.outage_patience_s,
                            say=lambda line: say(self.name, line))
        with Store.open(self.config, quiet=True) as store, Batcher(engine, inline=True) as batcher, \
                Listener(store.engine, POLICY_CHANNEL) as listener:
            run_id = store.run_id(self.config.run.name)
            resumption = Resumption(self.config.run.name, self.config.run.resume_wait_s,
                                    say=lambda line: say(self.name, line))
            try:
                while not self._stop.is_set():
                    outcome = patience(lambda: self.round(store, run_id, batcher, stats),
                                       self.name, before_retry=lambda: self.release(store))
                    if outcome == "done":
                        break
                    resumption.check(outcome == "failed")
                    if outcome in ("wait", "failed"):
                        listener.wait(IDLE_POLL_S)
            finally:
                self.release(store, quietly=True)
        return stats

    def release(self, store: Store, quietly: bool = False) -> None:
        """Give back the claims this worker holds (after a lost round, or when it stops; if
        the store is out then, they expire by themselves)."""
        try:
            store.tasks.release_claims(self.token)
        except Exception as exc:
            if not (quietly and is_outage(exc)):
                raise

    def round(self, store: Store, run_id: int, batcher: Batcher, stats: ExplorerStats) -> str:
        """One round: 'done' (the run ended), 'failed' (its trainer failed), 'wait' (nothing
        to do yet) or 'explored'."""
        status, policy = store.runs.status_and_policy(run_id)
        if status in DONE:
            return "done"
        if status == "failed":
            return "failed"
        if policy is None:
            return "wait"  # the trainer has not published version 0 yet
        if policy[0] != self.version:
            self._load(batcher.engine, *policy, stats)
        claimed = self._claim(store, run_id)
        if claimed is None:
            return "explored"  # a new version appeared meanwhile: load it first
        if not claimed:
            return "wait"
        explorer = self.config.explorer
        torch.manual_seed(step_seed(self.seed, self.version * 1_000_003 + claimed[0][0]))
        started = time.monotonic()
        groups = explore(self.workflow, [Task.of(row) for row in claimed], batcher,
                         Sampling(explorer.n, explorer.temperature, explorer.max_tokens),
                         run=self.config.run.name, version=self.version,
                         reward=explorer.reward, reward_options=explorer.reward_options)
        done = self._written(run_id, claimed, groups, time.monotonic() - started)
        try:  # the groups, their tasks' counts and the round's row commit together, or none
            store.write_groups(groups, status=written_status(self.config.pipelines),
                               before_copy=done)
        except ClaimLost as exc:
            say(self.name, str(exc))
            return "explored"
        stats.groups += len(claimed)
        self.update_s = None  # the update is the first written round's
        return "explored"

    def _written(self, run_id: int, claimed, groups, seconds: float):
        """What the write of a round's groups runs in its transaction: the claims finished and
        the round's row (explorer_rounds) recorded."""
        finish = finishing(self.token, [row[0] for row in claimed])
        rows = [row for group in groups for row in group]
        record = recording(Round(run_id, self.name, self.version, len(groups), len(rows),
                                 sum(len(row.response_ids) for row in rows), seconds,
                                 self.update_s)) if groups else None

        async def done(conn) -> None:
            await finish(conn)
            if record is not None:
                await record(conn)
        return done

    def _claim(self, store: Store, run_id: int):
        """Tasks within the pace, claimed only if the latest version is the one loaded."""
        config = self.config
        stages = plan(config)
        pace = Pace(batch_groups=config.trainer.batch_groups,
                    sync_interval=config.trainer.sync_interval, staleness=config.staleness,
                    group_size=config.explorer.n, steps=last_step(stages),
                    explorer_stages=tuple((s.first_step, s.last_step, s.batch)
                                          for s in stages if s.explores))
        return store.tasks.claim_within_pace(run_id, pace, loaded=self.version,
                                             most=config.explorer.batch_tasks, token=self.token,
                                             worker=self.name,
                                             seconds=config.explorer.claim_seconds,
                                             order=TaskOrder(config.explorer.task_order,
                                                             config.explorer.pass_rate_band))

    def _load(self, engine: Engine, version: int, location: str | None,
              stats: ExplorerStats) -> None:
        """Take a published policy's weights in place (the engine is not rebuilt); the seconds
        each update took go to the stats."""
        started = time.monotonic()
        if not self.shared and take_policy(engine, location, self.config.model.path):
            self.update_s = time.monotonic() - started
            stats.update_seconds.append(self.update_s)
        self.version = version
        stats.versions_loaded += 1
