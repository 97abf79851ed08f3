"""The trainer worker: lease whole groups, take a GRPO step, commit it, publish weights.

It runs in any process (a Ray actor under `reservoir run`, the CLI's own under `reservoir
train`) and meets explorers only in the store. A fresh run starts by measuring the start
policy, an optional supervised warm-up, and step 0 with policy version 0. Every step leases
`batch_groups` groups no staler than the mode allows, trains, and commits through the ledger;
every `sync_interval` steps it publishes the weights (a file, a policy_versions row, a NOTIFY).
With `trainer.workers: N > 1` the steps are data-parallel: this worker is rank 0 of a pool whose
other ranks train their share of each step in processes of their own (trainer/ranks.py); only
rank 0 talks to the store's ledger, publishes, evaluates and checkpoints, and the other ranks
load each checkpoint it starts or resumes from.

Resuming reloads the last checkpoint and then replays, from the ledger, every step committed
after it (the same rows, in the same order), so the model continues exactly; leases the dead
trainer held go back to ready.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from rich.console import Console

from reservoir.config import ReservoirConfig
from reservoir.devices import resolve_device
from reservoir.errors import ConfigError, FlowControlTimeout
from reservoir.models import save_weights
from reservoir.prepare import check_model, check_resumable
from reservoir.store import Store
from reservoir.store.ledger import add_step_metrics, last_step, record_step, step_experiences
from reservoir.store.retry import Patience
from reservoir.store.runs import run_id_of, set_status
from reservoir.store.tasks import split_tasks
from reservoir.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from reservoir.trainer.ranks import TrainerPool, load_policy, rank_threads
from reservoir.trainer.seed import seed_everything
from reservoir.trainer.warmup import warm_up_stage

LEASE_POLL_S = 1.0  # between lease attempts, check for a stop request
# held-out accuracy of (model, tokenizer) on (id, prompt, answer) tasks; the coordinator
# supplies it (the trainer does not import the explorer, which owns engines and rewards)
Evaluate = Callable[[object, object, list], float]


@dataclass
class RunSummary:
    run: str
    steps: int = 0
    version: int = 0
    accuracy: list[tuple[int | str, float]] = field(default_factory=list)
    stopped: bool = False


class TrainerWorker:
    def __init__(self, config: ReservoirConfig, *, resume: bool = False,
                 evaluate: Evaluate | None = None, console: Console | None = None) -> None:
        self.config, self.resume, self.evaluate = config, resume, evaluate
        self.console = console or Console(stderr=True)
        self.summary = RunSummary(config.run.name)
        self.started = False  # step 0 is recorded: there is a state worth a checkpoint
        self.patience = Patience(config.store.outage_patience_s, say=lambda line:
                                 self.console.print(line, markup=False, highlight=False))
        self._stop = threading.Event()

    def request_stop(self) -> None:
        self._stop.set()

    def run(self) -> RunSummary:
        """Train to trainer.steps (or until stopped); the run ends finished or stopped."""
        check_model(self.config)
        torch.set_num_threads(rank_threads(self.config))
        seed_everything(self.config.run.seed)
        self._load_policy()
        with Store.open(self.config, quiet=True) as store:
            self.store = store
            with store.engine.connect() as conn:
                self.run_id = run_id_of(conn, self.config.run.name)
                self.held_out = split_tasks(conn, self.run_id, "test")
            self._check_can_start()
            try:
                self._set_status("running")
                with TrainerPool(self.config, self.policy, self.optimizer,
                                 self.tokenizer.pad_token_id, self.device) as self.pool:
                    first = self._resume() if self.resume else self._start()
                    if first is not None:  # None: stopped during the warm-up
                        self._train(first)
            except KeyboardInterrupt:
                self._stop.set()
            except BaseException:
                self._set_status("failed")  # explorers see it and stop
                raise
            self._finish()
        return self.summary

    def _load_policy(self) -> None:
        """The policy on trainer.device and its optimizer, built as every rank builds them."""
        self.device = resolve_device(self.config.trainer.device, key="trainer.device")
        self.policy, self.tokenizer, self.optimizer = load_policy(self.config, self.device)

    def _check_can_start(self) -> None:
        with self.store.engine.connect() as conn:
            trained = last_step(conn, self.run_id) is not None
        if trained and not self.resume:
            raise ConfigError(f"run.name: run {self.config.run.name!r} has already trained; "
                              "continue it with --resume or choose another name")
        if self.resume:
            check_resumable(self.store, self.config)

    @property
    def checkpoints(self) -> Path:
        return Path(self.config.trainer.checkpoint_dir) / self.config.run.name

    def _set_status(self, status: str) -> None:
        def write() -> None:
            with self.store.engine.begin() as conn:
                set_status(conn, self.run_id, status)

        self.patience(write, f"run status {status}")

    def _finish(self) -> None:
        if self._stop.is_set() and self.summary.steps < self.config.trainer.steps:
            self.summary.stopped = True
            self._set_status("stopped")
            if not self.started:
                self.console.print("stopped during the warm-up; `--resume` starts it again")
                return
            self._checkpoint()
            self.console.print(f"stopped after step {self.summary.steps}; checkpoint saved, "
                               "resume with --resume")
        else:
            self._set_status("finished")

    # -- starting and resuming -------------------------------------------------------------

    def _start(self) -> int | None:
        """Measure the start policy, warm up, record step 0 and publish version 0 (both kept if
        an earlier attempt recorded them: the seeded warm-up makes the same weights); None if a
        stop came during the warm-up."""
        self.summary.accuracy.append(("start", self._evaluate()))
        metrics = {"eval/accuracy_start": self.summary.accuracy[-1][1]}
        location = str(self.config.model.path)
        if self.config.trainer.warmup_steps:
            warmed = warm_up_stage(self.store, self.run_id, self.config, self.policy,
                                   self.tokenizer, stop=self._stop.is_set,
                                   console=self.console)
            if warmed is None:
                return None
            metrics |= warmed
            self.summary.accuracy.append(("warm-up", self._evaluate()))
            location = str(save_weights(self.policy, self._weights_path(0)))
        with self.store.engine.begin() as conn:
            record_step(conn, self.run_id, 0, policy_version=0,
                        metrics=metrics | {"eval/accuracy": self.summary.accuracy[-1][1]})
        self.store.publish_version(self.config.run.name, 0, location=location, train_step=0)
        self.pool.load(self._checkpoint())  # the other ranks start from rank 0's weights
        self.started = True
        return 1

    def _resume(self) -> int | None:
        """Reload the last checkpoint (or, for a trainer killed before its first one, start
        again from the model folder), replay later committed steps, free lost leases."""
        checkpoint = latest_checkpoint(self.checkpoints)
        if checkpoint is None:
            if self._start() is None:
                return None
            resumed_step, origin = 0, "the start (no checkpoint yet)"
        else:
            resumed = load_checkpoint(checkpoint, self.policy, self.optimizer)
            self.pool.load(checkpoint)
            self.summary.steps, self.summary.version = resumed.step, resumed.version
            resumed_step, origin = resumed.step, f"{checkpoint.name} (step {resumed.step})"
            self.started = True
        with self.store.engine.connect() as conn:
            committed = last_step(conn, self.run_id) or 0
        for step in range(resumed_step + 1, committed + 1):
            self._replay(step)
        released = self.store.release_runs(self.config.run.name)
        self.console.print(f"resumed run {self.summary.run!r} from {origin}; replayed "
                           f"{committed - resumed_step} committed steps from the ledger; "
                           f"released {released} leased rows")
        return committed + 1

    def _replay(self, step: int) -> None:
        """Retrain a committed step on exactly its ledger rows (no new commit)."""
        with self.store.engine.connect() as conn:
            ids = step_experiences(conn, self.run_id, step)
        self._learn(step, self.store.fetch(ids))
        self.summary.steps = step
        if step % self.config.trainer.sync_interval == 0:
            self._publish(step)

    # -- the loop ----------------------------------------------------------------------------

    def _train(self, first: int) -> None:
        trainer = self.config.trainer
        for step in range(first, trainer.steps + 1):
            waited = time.monotonic()
            lease = self._lease()
            if lease is None:
                return
            waited = time.monotonic() - waited
            try:
                metrics = self._learn(step, sorted(lease.rows, key=lambda row: row.id))
            except BaseException:
                self.store.release(lease)
                raise
            partial = lease.partial_groups()
            metrics |= {"wait_s": waited, "partial_groups": len(partial),
                        "partial_group_rows": sum(got for got, _ in partial.values())}
            self._commit(lease, step, metrics)
            self.summary.steps = step
            if step % trainer.sync_interval == 0:
                self._publish(step)
            if step % trainer.eval_interval == 0 or step == trainer.steps:
                self._record_accuracy(step)
            if step % trainer.checkpoint_interval == 0 or step == trainer.steps:
                self._checkpoint()
            if self._stop.is_set():
                return

    def _lease(self):
        """Whole groups no staler than allowed; None if a stop came while waiting."""
        config, started = self.config, time.monotonic()
        floor = self.summary.version - config.staleness
        lease = lambda: self.store.lease(  # noqa: E731
            config.run.name, groups=config.trainer.batch_groups, min_policy_version=floor,
            timeout_s=LEASE_POLL_S)
        while not self._stop.is_set():
            try:  # a lease lost with the connection is handed back before the next try
                return self.patience(lease, "trainer lease", before_retry=lambda:
                                     self.store.release_runs(config.run.name))
            except FlowControlTimeout:
                if time.monotonic() - started > config.trainer.wait_timeout_s:
                    raise FlowControlTimeout(
                        f"trainer.wait_timeout_s: no batch of {config.trainer.batch_groups} "
                        f"groups (version >= {floor}) came in {config.trainer.wait_timeout_s:g}s;"
                        " is an explorer running (`reservoir explore CONFIG`)?") from None
        return None

    def _commit(self, lease, step: int, metrics: dict) -> None:
        """Commit the step through the ledger. If the connection dropped while committing, the
        commit may have gone through: the retry looks before it commits again."""
        retried = []

        def once() -> None:
            if retried and self.store.step_committed(self.config.run.name, step):
                return
            self.store.commit_step(lease, step=step, policy_version=self.summary.version,
                                   loss=metrics["loss"], metrics=metrics)

        self.patience(once, f"trainer step {step}", before_retry=lambda: retried.append(1))

    def _learn(self, step: int, rows) -> dict[str, float]:
        """One optimizer step on rows, on every rank of the pool; metrics include staleness
        and throughput."""
        started = time.monotonic()
        metrics, batch = self.pool.train(step, rows)
        staleness = [self.summary.version - row.policy_version for row in rows]
        seconds = time.monotonic() - started
        return metrics | {"staleness_mean": sum(staleness) / len(staleness),
                          "staleness_max": max(staleness), "train_s": seconds,
                          "train_tokens_per_s": metrics["train_tokens"] / seconds,
                          "response_len_mean": float(batch.mask.sum(1).mean()),
                          **_peak_memory(self.device)}

    def _publish(self, step: int) -> None:
        version = self.summary.version + 1
        path = save_weights(self.policy, self._weights_path(version))
        self.patience(lambda: self.store.publish_version(self.config.run.name, version,
                                                         location=str(path), train_step=step),
                      f"publishing version {version}")
        self.summary.version = version
        self._prune_weights(keep=self.config.staleness + 3)

    def _weights_path(self, version: int) -> Path:
        return self.checkpoints / "policy" / f"v{version:06d}.safetensors"

    def _prune_weights(self, keep: int) -> None:
        """Delete published weight files more than `keep` versions old (explorers are past
        them); version 0 stays, it is where the run's RL started."""
        for path in sorted((self.checkpoints / "policy").glob("v*.safetensors"))[1:-keep]:
            path.unlink(missing_ok=True)

    def _checkpoint(self) -> Path:
        return save_checkpoint(self.checkpoints, self.summary.steps, self.summary.version,
                               self.policy, self.optimizer)

    def _evaluate(self) -> float:
        if self.evaluate is None or not self.held_out:
            return float("nan")
        self.policy.eval()  # generate with the KV cache, not through checkpointed layers
        try:
            return self.evaluate(self.policy, self.tokenizer, self.held_out)
        finally:
            self.policy.train()

    def _record_accuracy(self, step: int) -> None:
        self.summary.accuracy.append((step, self._evaluate()))

        def record() -> None:
            with self.store.engine.begin() as conn:
                add_step_metrics(conn, self.run_id, step,
                                 {"eval/accuracy": self.summary.accuracy[-1][1]})

        self.patience(record, f"held-out accuracy of step {step}")


def _peak_memory(device: torch.device) -> dict[str, float]:
    """Peak GPU memory of the step in GiB (CUDA only), reset for the next step."""
    if device.type != "cuda":
        return {}
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    torch.cuda.reset_peak_memory_stats(device)
    return {"peak_memory_gib": peak}
