"""The trainer worker: train a run's stages in order, commit every step, publish weights.

It runs in any process (a Ray actor under `reservoir run`, the CLI's own under `reservoir
train`) and meets explorers only in the store. A fresh run measures the start policy and
records step 0; then each stage (trainer/stages.py) trains its steps on its data
(trainer/feeds.py): explorers' groups, the tasks' answers, stored experiences or preference
pairs. Each step commits through the ledger with its stage's name. A stage that trains on
explorers publishes a policy version when it starts and every `sync_interval` of its steps
(a file, a policy_versions row, a NOTIFY); explorers pace themselves by the same plan.
With `trainer.workers: N > 1` the steps are data-parallel: this worker is rank 0 of a pool
whose other ranks train their share of each step in processes of their own
(trainer/ranks.py); only rank 0 talks to the store's ledger, publishes, evaluates and
checkpoints, and the other ranks load each checkpoint it starts a stage or resumes from.

Resuming reloads the last checkpoint (and the stage state that goes with it: the stage's
reference, its critic) and then replays, from the ledger, every step committed after it (the
same rows, in the same order; the same task draws), so the model continues exactly; leases
the dead trainer held go back to ready.
"""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from reservoir.config import ReservoirConfig
from reservoir.errors import Abandoned, ConfigError, ReservoirError, StepNotFinite
from reservoir.logs import relayed, say, warn
from reservoir.tracking import follow
from reservoir.plan.weights import branch_checkpoint, check_model
from reservoir.store import Patience, Store
from reservoir.trainer.checkpoint import latest_checkpoint
from reservoir.trainer.feeds import Context, Feed, feed_for
from reservoir.trainer.learner import Learner
from reservoir.trainer.ranks import TrainerPool, rank_threads
from reservoir.trainer.seed import seed_everything
from reservoir.plan.stages import Stage, total_steps

PROGRESS_EVERY_S = 1.0  # runs.progress is written at most this often
NO_SIGNAL_WARN = 0.5    # warn when more groups than this carried no reward variance
WORKER = "trainer"      # its log lines' worker
# held-out accuracy of (model, tokenizer) on (id, prompt, answer) tasks; the coordinator
# supplies it (the trainer does not import the explorer, which owns engines and rewards)
Evaluate = Callable[[object, object, list], float]
# a colocated run's explorer, made from (config, learner, store, run id); the coordinator
# supplies it too (reservoir.colocated.Colocated): a context manager with `refill()`
Colocate = Callable[..., object]


@dataclass
class RunSummary:
    run: str
    steps: int = 0
    version: int = 0
    accuracy: list[tuple[int | str, float]] = field(default_factory=list)
    stopped: bool = False


class TrainerWorker:
    def __init__(self, config: ReservoirConfig, *, resume: bool = False,
                 evaluate: Evaluate | None = None, colocate: Colocate | None = None,
                 report: Callable | None = None, relay: str | None = None) -> None:
        """`report(store, run, folder)`: the run's plots, which its trackers take at the end;
        `relay`: the name of the Ray actor its log lines go to (reservoir.logs)."""
        self.config, self.resume, self.evaluate = config, resume, evaluate
        self.colocate, self.here, self.report, self.relay = colocate, None, report, relay
        self.summary = RunSummary(config.run.name)
        self.patience = Patience(config.store.outage_patience_s,
                                 say=lambda line: say(WORKER, line))
        self._stop = threading.Event()
        self._progress_at = 0.0
        self._no_signal: list[float] = []  # zero-variance shares since the last warning check

    def request_stop(self) -> None:
        self._stop.set()

    def run(self) -> RunSummary:
        """Train every stage (or until stopped); the run ends finished or stopped."""
        with relayed(self.relay, WORKER):
            return self._run()

    def _run(self) -> RunSummary:
        check_model(self.config)
        torch.set_num_threads(rank_threads(self.config))
        seed_everything(self.config.run.seed)
        self.learner = Learner(self.config)
        self.plan, self.version = self.learner.plan, None  # the last version published
        with Store.open(self.config, quiet=True) as store:
            self.store = store
            self.run_id = store.run_id(self.config.run.name)
            self.held_out = store.tasks.split_tasks(self.run_id, "test")
            self._check_can_start()
            try:
                self._set_status("running")
                with TrainerPool(self.config, self.learner) as self.pool, \
                        self._colocated() as self.here, \
                        follow(self.config, store, self.report):
                    first, committed = self._resume() if self.resume else self._start()
                    self._train(first, committed)
            except Abandoned:  # a second Ctrl-C: no status, no checkpoint, at once
                raise
            except KeyboardInterrupt:
                self._stop.set()
            except BaseException:
                self._set_status("failed")  # explorers see it and stop
                raise
            self._finish()
        return self.summary

    def _colocated(self):
        """A colocated run's explorer in this process (closed with the run), else nothing."""
        if self.colocate is None:
            return nullcontext()
        return self.colocate(self.config, self.learner, self.store, self.run_id)

    def _check_can_start(self) -> None:
        trained = self.store.ledger.last_step(self.run_id) is not None
        if trained and not self.resume:
            raise ConfigError(f"run.name: run {self.config.run.name!r} has already trained; "
                              "continue it with --resume or choose another name")
        if self.resume:
            self.store.runs.check_resumable(self.config.run.name, total_steps(self.config))

    @property
    def checkpoints(self) -> Path:
        return Path(self.config.trainer.checkpoint_dir) / self.config.run.name

    @property
    def last(self) -> int:
        return self.plan[-1].last_step

    def _set_status(self, status: str) -> None:
        self.patience(lambda: self.store.runs.set_status(self.run_id, status),
                      f"run status {status}")

    def _finish(self) -> None:
        self._progress(None)
        if self._stop.is_set() and self.summary.steps < self.last:
            self.summary.stopped = True
            self._set_status("stopped")
            self._checkpoint()
            say(WORKER, f"stopped after step {self.summary.steps}; checkpoint saved, "
                               "resume with --resume")
        else:
            self._set_status("finished")

    # -- starting and resuming -------------------------------------------------------------

    def _start(self) -> tuple[int, int]:
        """Measure the start policy and record step 0 (kept if an earlier attempt recorded
        it); (first step to train, last committed step)."""
        if self.config.branch is not None:  # the parent's weights at the branch step
            self.pool.start_from(branch_checkpoint(self.config))
        self.summary.accuracy.append(("start", self._evaluate()))
        accuracy = self.summary.accuracy[-1][1]
        self.store.ledger.record_step(
            self.run_id, 0, policy_version=0,
            metrics={"eval/accuracy_start": accuracy, "eval/accuracy": accuracy})
        return 1, self.store.ledger.last_step(self.run_id) or 0

    def _resume(self) -> tuple[int, int]:
        """Reload the last checkpoint (none: start again), free lost leases; (first step to
        train or replay, last committed step)."""
        checkpoint = latest_checkpoint(self.checkpoints)
        if checkpoint is None:
            first, committed = self._start()
            origin = "the start (no checkpoint yet)"
        else:
            resumed = self.pool.resume(checkpoint)
            self.summary.steps, self.summary.version = resumed.step, resumed.version
            published = self.store.runs.version_by(self.run_id, resumed.step)
            committed = self.store.ledger.last_step(self.run_id) or 0
            self.version = None if published is None else published[0]
            first, origin = resumed.step + 1, f"{checkpoint.name} (step {resumed.step})"
        released = self.store.release_runs(self.config.run.name)
        say(WORKER, f"resumed run {self.summary.run!r} from {origin}; replayed "
                    f"{max(0, committed - first + 1)} committed steps from the ledger; "
                    f"released {released} leased rows")
        return first, committed

    # -- the stages ------------------------------------------------------------------------

    def _train(self, first: int, committed: int) -> None:
        context = Context(self.config, self.store, self.run_id, self.learner.tokenizer,
                          self.learner.device, self.patience, self._stop,
                          lambda: self.summary.version,
                          self.here.refill if self.here is not None else None)
        for stage in self.plan:
            if stage.last_step < first:
                continue
            if first <= stage.first_step:
                self._begin(stage)
            feed = feed_for(context, stage)
            for step in range(max(first, stage.first_step), stage.last_step + 1):
                if step <= committed:
                    self._replay(feed, stage, step)
                elif not self._step(feed, stage, step):
                    return
                if self._stop.is_set() and step < self.last:
                    return
            self._end(stage)

    def _begin(self, stage: Stage) -> None:
        """Enter a stage: fresh optimizer, critic, reference (the weights now, saved as the
        checkpoint of the step before its first); explorer stages publish these weights."""
        self.pool.begin_stage(stage, self._checkpoint)  # every rank begins it from the same state
        if stage.explores:
            self._publish(stage.first_step - 1, first=True)
        say(WORKER, f"stage {stage.name!r}: {stage.steps} steps of {_describe(stage)} "
                    f"(steps {stage.first_step}..{stage.last_step})")

    def _end(self, stage: Stage) -> None:
        step = stage.last_step
        if not self.summary.accuracy or self.summary.accuracy[-1][0] != step:
            self._record_accuracy(step)
        if self.summary.steps == step:
            self._checkpoint()

    def _step(self, feed: Feed, stage: Stage, step: int) -> bool:
        """Draw, train and commit one step; False if a stop came while waiting for data."""
        draw = feed.draw(step)
        if draw is None:
            return False
        try:
            metrics = draw.metrics | self._learn(step, stage, draw.rows, draw.batch)
        except BaseException as exc:
            draw.release()
            if isinstance(exc, StepNotFinite):
                ids = ", ".join(str(row.id) for row in draw.rows[:20])
                more = f" and {len(draw.rows) - 20} more" if len(draw.rows) > 20 else ""
                raise ReservoirError(
                    f"step {step}: {exc}; nothing of the step was committed and its rows went "
                    f"back (experiences {ids or 'none: a batch of tasks'}{more}); mend or retire "
                    "them, then continue with --resume") from None
            raise
        draw.commit(step, metrics)
        self._after(stage, step, metrics)
        return True

    def _replay(self, feed: Feed, stage: Stage, step: int) -> None:
        """Retrain a committed step on exactly its ledger rows (no new commit)."""
        rows, batch = feed.replay(step)
        self._learn(step, stage, rows, batch)
        self.summary.steps = step
        self._publish_if_due(stage, step)

    def _after(self, stage: Stage, step: int, metrics: dict) -> None:
        """A committed step's publication, evaluation, checkpoint and progress."""
        trainer, in_stage = self.config.trainer, step - stage.first_step + 1
        self.summary.steps = step
        self._publish_if_due(stage, step)
        if stage.data.tasks is None and in_stage % trainer.eval_interval == 0:
            self._record_accuracy(step)
        if step % trainer.checkpoint_interval == 0:
            self._checkpoint()
        self._warn_without_signal(stage, step, metrics)
        self._progress({"stage": stage.name, "step": in_stage, "of": stage.steps,
                        "loss": round(metrics["loss"], 4)}, final=in_stage == stage.steps)

    def _warn_without_signal(self, stage: Stage, step: int, metrics: dict) -> None:
        """Say so when most groups of the last eval_interval steps had one reward for all
        their responses (their advantages, so their loss, are 0: nothing to learn from)."""
        share = metrics.get("advantage/zero_variance_groups")
        if share is None or not stage.explores:
            return
        self._no_signal.append(share)
        window = self.config.trainer.eval_interval
        if len(self._no_signal) >= window:
            mean = sum(self._no_signal[-window:]) / window
            if mean > NO_SIGNAL_WARN:
                warn(WORKER, f"steps {step - window + 1}..{step}: {mean:.0%} of "
                             "groups had identical rewards and taught nothing; raise "
                             "explorer.n or temperature, make tasks harder or easier, or drop "
                             "them (the drop_zero_variance pipeline)")
            self._no_signal.clear()

    def _learn(self, step: int, stage: Stage, rows, batch) -> dict[str, float]:
        """One optimizer step on every rank of the pool; metrics include staleness (of
        explorers' rows) and throughput."""
        started = time.monotonic()
        metrics = self.pool.train(step, rows, batch)
        seconds = time.monotonic() - started
        metrics |= {"train_s": seconds, "train_tokens_per_s": metrics["train_tokens"] / seconds,
                    "response_len_mean": float(batch.mask.sum(1).mean()),
                    **_peak_memory(self.learner.device)}
        if stage.explores:
            staleness = [self.summary.version - row.policy_version for row in rows]
            metrics |= {"staleness_mean": sum(staleness) / len(staleness),
                        "staleness_max": max(staleness)}
        return metrics

    # -- publishing, checkpoints, evaluation, progress ------------------------------------

    def _publish_if_due(self, stage: Stage, step: int) -> None:
        """Explorer stages publish every sync_interval of their steps."""
        in_stage = step - stage.first_step + 1
        if stage.explores and in_stage % self.config.trainer.sync_interval == 0:
            self._publish(step)

    def _publish(self, step: int, first: bool = False) -> None:
        """Publish the weights as the next version (version 0 is the model folder's weights
        when nothing trained them yet). A stage's first publication is skipped when a version
        was published after that very step (the previous stage's last, or, on resume, the
        one this stage published before)."""
        if first:
            published = self.store.runs.version_by(self.run_id, step)
            if published is not None and published[1] == step:
                self.summary.version = self.version = published[0]
                return
        version = 0 if self.version is None else self.summary.version + 1
        untouched = version == 0 and step == 0 and self.config.branch is None
        if untouched:
            location = str(self.config.model.path)
        elif self.here is not None:  # its explorer generates with these very weights
            location = None
        else:
            location = str(self.pool.publish(self._weights_path(version)))
        self.patience(lambda: self.store.publish_version(self.config.run.name, version,
                                                         location=location, train_step=step),
                      f"publishing version {version}")
        self.summary.version = self.version = version
        self._prune_weights(keep=self.config.staleness + 3)

    def _weights_path(self, version: int) -> Path:
        return self.checkpoints / "policy" / f"v{version:06d}.safetensors"

    def _prune_weights(self, keep: int) -> None:
        """Delete published weight files more than `keep` versions old (explorers are past
        them); version 0 stays, it is where the run's RL started."""
        for path in sorted((self.checkpoints / "policy").glob("v*.safetensors"))[1:-keep]:
            path.unlink(missing_ok=True)

    def _checkpoint(self) -> Path:
        return self.pool.save(self.checkpoints, self.summary.steps, self.summary.version)

    def _progress(self, progress: dict | None, final: bool = False) -> None:
        """runs.progress (the live table's stage line), at most once every PROGRESS_EVERY_S."""
        now = time.monotonic()
        if progress is not None and not final and now - self._progress_at < PROGRESS_EVERY_S:
            return
        self._progress_at = now
        self.store.runs.set_progress(self.run_id, progress or {})

    def _evaluate(self) -> float:
        if self.evaluate is None or not self.held_out:
            return float("nan")
        return self.pool.evaluate(self.evaluate, self.held_out)

    def _record_accuracy(self, step: int) -> None:
        self.summary.accuracy.append((step, self._evaluate()))

        self.patience(lambda: self.store.ledger.add_step_metrics(
            self.run_id, step, {"eval/accuracy": self.summary.accuracy[-1][1]}),
            f"held-out accuracy of step {step}")


def _describe(stage: Stage) -> str:
    algorithm = stage.algorithm
    return (f"{algorithm.preference_loss or algorithm.policy_loss} loss, "
            f"{algorithm.advantage} advantages, on {stage.data.kind}")


def _peak_memory(device: torch.device) -> dict[str, float]:
    """Peak GPU memory of the step in GiB (CUDA only), reset for the next step."""
    if device.type != "cuda":
        return {}
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    torch.cuda.reset_peak_memory_stats(device)
    return {"peak_memory_gib": peak}
