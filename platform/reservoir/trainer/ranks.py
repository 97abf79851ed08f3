"""The trainer pool: rank 0 is the trainer worker itself; ranks 1..N-1 are processes it starts.

With `trainer.workers: N > 1` rank 0 starts N-1 followers ("spawn" processes, handed the config
as plain data) and joins them with torch.distributed (a TCPStore rendezvous on 127.0.0.1 at a
port the OS picks; gradients over gloo on CPU, NCCL on GPU; commands always over gloo). Rank r
takes the r-th GPU, and the trainer's torch threads are shared by its ranks. Every rank builds
its `Learner` (policy, optimizer, the stage's reference and critic) the same way and steps
with the same settings. Rank 0 alone leases, commits, publishes, evaluates and checkpoints; followers
open the store only to fetch rows, and obey commands rank 0 broadcasts as int64 tensors (no
pickle):

- TRAIN [step, n] + n row ids: fetch the rows from the store (waiting out an outage as rank 0
  does: store.outage_patience_s), put them in rank 0's order, train this rank's share of them
  (`Ranks.share`); `train_step` sums the gradients over all ranks.
- DO [0, n] + n bytes of JSON naming what to do, then a barrier: `load` a checkpoint (so
  every rank holds what rank 0 holds before the next step); with a sharded policy (fsdp2) also
  `begin` a stage, `save` a checkpoint, `publish` (gather the weights to rank 0), `start_from`
  another run's weights and `evaluate` (hold the layers gathered while rank 0 generates):
  those touch every rank's shards, so rank 0 does them together with the followers.
- STOP: exit.

With `trainer.sharding: fsdp2` even one worker joins a process group (of one), and every rank
shards its policy (`Learner.shard`) once joined.

Failures: a rank that dies closes its connections, so the others' next collective raises at
once (gloo; on NCCL a dead peer surfaces when the collective times out, after STEP_TIMEOUT). On
rank 0 that is a ReservoirError naming the rank, raised inside the step, which is therefore not
committed. A follower's own error ends it with one line on stderr, and rank 0 names it the same
way. Followers exit when rank 0 is gone: their collective fails, and a watcher thread ends them
if their parent process disappears while they compute. Ctrl-C is rank 0's to handle: followers
ignore SIGINT and stop when told (or are terminated, when rank 0 stops in the middle of a step).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from reservoir.config import ReservoirConfig
from reservoir.devices import resolve_device
from reservoir.errors import RankLost, ReservoirError, StepNotFinite
from reservoir.store import Patience, Store
from reservoir.trainer.batch import TrainBatch, make_batch
from reservoir.trainer.checkpoint import Resumed
from reservoir.trainer.learner import Learner
from reservoir.trainer.seed import seed_everything
from reservoir.trainer.sft import conversation, demonstrations, task_batch
from reservoir.plan.stages import Stage, stage_at
from reservoir.trainer.step import ONE, Ranks

TRAIN, DO, STOP = 1, 2, 3
PAYLOAD = {TRAIN: torch.int64, DO: torch.uint8}  # what follows each command's header
START_TIMEOUT = timedelta(minutes=10)   # a follower loads its model and joins within this
STEP_TIMEOUT = timedelta(minutes=5)     # ranks wait this long for each other inside a step
COMMAND_TIMEOUT = timedelta(days=31)    # followers wait for rank 0 between steps (leases,
                                        # evaluation): longer than trainer.wait_timeout_s
STOP_WAIT_S = 30.0                      # a stopped follower exits within this, or is killed


def _collective(operation, *args, **kwargs):
    """A torch.distributed call whose failure is a RankLost with gloo's reason, in a line."""
    try:
        return operation(*args, **kwargs)
    except RuntimeError as exc:  # gloo: "Connection closed by peer", "Read error", timeouts
        reason = re.sub(r"^\[[^\]]*\]\s*", "", str(exc).strip().splitlines()[0])
        raise RankLost(f"a collective failed: {reason.split('. ')[0]}") from exc


def _reduce(tensor: torch.Tensor) -> None:
    _collective(dist.all_reduce, tensor)


def rank_threads(config: ReservoirConfig) -> int:
    """Torch threads of one rank: the trainer's threads shared by its ranks."""
    return max(1, config.torch_threads("trainer") // config.trainer.workers)


class TrainerPool:
    """Rank 0's side of the pool; with one worker, simply the step on this process's model."""

    def __init__(self, config: ReservoirConfig, learner: Learner) -> None:
        self.config, self.learner, self.device = config, learner, learner.device
        self.world, self.ranks = config.trainer.workers, ONE
        self.followers: list = []
        self.commands = None  # the gloo group of commands, once the followers joined
        self.busy = False  # inside a collective: a STOP now would not match the followers'
        if self.world > 1 or config.trainer.sharding == "fsdp2":
            try:
                self._start()
            except BaseException:
                self.close()
                raise

    def __enter__(self) -> "TrainerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def train(self, step: int, rows, batch: TrainBatch) -> dict[str, float]:
        """Train the step on `batch`, made of `rows` (rank 0's order; none for a batch of
        tasks, which every rank makes from the step) across all ranks."""
        with _Busy(self, f"step {step}, which was not committed; continue the run with "
                         "--resume"):
            self._send(TRAIN, step, torch.tensor([row.id for row in rows], dtype=torch.int64))
            return self.learner.train(step, batch, self.ranks)

    def load(self, checkpoint: Path) -> None:
        """Every follower loads the checkpoint rank 0 holds (weights and optimizer state)."""
        if self.followers:
            self._do("load", path=str(checkpoint))

    def resume(self, checkpoint: Path) -> Resumed:
        """Every rank, rank 0 too, restores the checkpoint and the stage state after it."""
        resumed = self._everywhere(lambda: self.learner.load(checkpoint), "load",
                                   path=str(checkpoint))
        if not self.learner.sharded:
            self.load(checkpoint)
        return resumed

    def begin_stage(self, stage: Stage, save) -> Path:
        """Every rank enters `stage` from the same state, saved as the checkpoint `save()`
        writes (a sharded policy's ranks enter it together; otherwise rank 0 does, and the
        followers load its checkpoint)."""
        self._everywhere(lambda: self.learner.begin(stage), "begin", step=stage.first_step)
        checkpoint = save()
        if not self.learner.sharded:
            self.load(checkpoint)
        return checkpoint

    def save(self, root: Path, step: int, version: int) -> Path:
        return self._everywhere(lambda: self.learner.save(root, step, version), "save",
                                root=str(root), step=step, version=version)

    def publish(self, path: Path) -> Path:
        return self._everywhere(lambda: self.learner.publish(path), "publish", path=str(path))

    def start_from(self, checkpoint: Path) -> None:
        self._everywhere(lambda: self.learner.start_from(checkpoint), "start_from",
                         path=str(checkpoint))

    def evaluate(self, evaluate, *args):
        return self._everywhere(lambda: self.learner.evaluate(evaluate, *args), "evaluate")

    def close(self) -> None:
        """STOP the followers (terminate them if that cannot be said now) and leave the group."""
        if not self.followers:
            if self.commands is not None and dist.is_initialized():  # a sharded one alone
                dist.destroy_process_group()
            self.commands = None
            return
        stopped = False
        if self.commands is not None and not self.busy:
            try:
                self._send(STOP, 0)
                stopped = True
            except RankLost:
                pass  # a follower is gone: the others are ended below
        _end(self.followers, wait_s=STOP_WAIT_S if stopped else 0.0)
        if dist.is_initialized():
            dist.destroy_process_group()
        self.followers = []

    # -- rank 0's side of starting and talking ------------------------------------------------

    def _start(self) -> None:
        """Spawn ranks 1..N-1, wait until each has loaded its model, join them."""
        for rank in range(self.world):  # every rank's GPU exists, before anything starts
            resolve_device(self.config.trainer.device, key="trainer.device", rank=rank)
        rendezvous = dist.TCPStore("127.0.0.1", 0, self.world, is_master=True,
                                   wait_for_workers=False, timeout=START_TIMEOUT)
        spawn = multiprocessing.get_context("spawn")
        raw = self.config.model_dump(mode="json")
        self.followers = [spawn.Process(target=_follow, name=f"reservoir-trainer-rank-{rank}",
                                        args=(raw, rank, rendezvous.port, os.getpid()),
                                        daemon=True) for rank in range(1, self.world)]
        for process in self.followers:
            process.start()
        self._await_ready(rendezvous)
        self.commands = _join(rendezvous, 0, self.world, self.device)
        self.rendezvous = rendezvous  # the store's server lives as long as the group
        self.ranks = Ranks(0, self.world, _reduce) if self.world > 1 else ONE
        if self.config.trainer.sharding == "fsdp2":
            self.learner.shard()

    def _await_ready(self, rendezvous) -> None:
        keys = [f"ready/{rank}" for rank in range(1, self.world)]
        deadline = time.monotonic() + START_TIMEOUT.total_seconds()
        while not rendezvous.check(keys):
            self._raise_if_a_rank_died(None, "its start", wait_s=0.0)
            if time.monotonic() > deadline:
                raise ReservoirError(f"trainer.workers: the trainer's {self.world - 1} other "
                                     f"ranks did not start within {START_TIMEOUT}")
            time.sleep(0.1)

    def _everywhere(self, here, what: str, **order):
        """`here()` on rank 0; with a sharded policy and followers, they `what` meanwhile."""
        if not (self.followers and self.learner.sharded):
            return here()
        return self._do(what, here, **order)

    def _do(self, what: str, here=lambda: None, **order):
        """The followers do `what` while rank 0 does `here()` (nothing: it already has);
        then every rank waits for the others."""
        doing = f"{what} ({', '.join(f'{k} {v}' for k, v in order.items())})"
        with _Busy(self, f"{doing}; continue the run with --resume"):
            self._send(DO, 0, _encoded({"do": what, **order}))
            result = here()
            _collective(dist.barrier, group=self.commands)
        return result

    def _send(self, command: int, step: int, payload: torch.Tensor | None = None) -> None:
        if not self.followers:
            return
        size = 0 if payload is None else payload.numel()
        _collective(dist.broadcast, torch.tensor([command, step, size], dtype=torch.int64), 0,
                    group=self.commands)
        if size:
            _collective(dist.broadcast, payload, 0, group=self.commands)

    def _raise_if_a_rank_died(self, error: BaseException | None, doing: str,
                              wait_s: float = 3.0) -> None:
        """A ReservoirError naming the first follower that ended, if one did (a failed
        collective is seen a moment before the dead process's exit code)."""
        deadline = time.monotonic() + wait_s
        while True:
            ended = [p for p in self.followers if p.exitcode is not None]
            if ended or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if ended:
            rank, process = self.followers.index(ended[0]) + 1, ended[0]
            raise ReservoirError(f"trainer rank {rank} (pid {process.pid}) "
                                 f"{_how_it_ended(process.exitcode)} during {doing}") from error


class _Busy:
    """Marks the pool busy while rank 0 is inside collectives (it stays so if one fails); a
    RankLost caused by a follower that ended becomes a ReservoirError that names it."""

    def __init__(self, pool: TrainerPool, doing: str) -> None:
        self.pool, self.doing = pool, doing

    def __enter__(self) -> None:
        self.pool.busy = bool(self.pool.followers)

    def __exit__(self, kind, error, traceback) -> None:
        if kind is None or issubclass(kind, StepNotFinite):  # every rank refused it alike
            self.pool.busy = False
        elif issubclass(kind, RankLost):
            self.pool._raise_if_a_rank_died(error, self.doing)


def _encoded(order: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(order).encode()), dtype=torch.uint8)


def _how_it_ended(exitcode: int) -> str:
    if exitcode < 0:
        return f"was killed by {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode} (its error is above)"


def _end(processes: list, wait_s: float) -> None:
    """Wait for processes to exit, then terminate, then kill what is left."""
    deadline = time.monotonic() + wait_s
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for ender in ("terminate", "kill"):
        for process in (p for p in processes if p.is_alive()):
            getattr(process, ender)()
        for process in processes:
            process.join(timeout=5)


def _join(rendezvous, rank: int, world: int, device: torch.device):
    """Join the default group (gradients: NCCL on CUDA, gloo on CPU); the gloo group of
    commands."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=rendezvous,
                            rank=rank, world_size=world, timeout=STEP_TIMEOUT)
    return dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)


# -- a follower -------------------------------------------------------------------------------

def _follow(raw: dict, rank: int, port: int, parent: int) -> None:
    """A follower process: obey rank 0 until STOP; a failure ends it with one line."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for rank 0, which says STOP
    threading.Thread(target=_exit_without, args=(parent,), daemon=True).start()
    config = ReservoirConfig.model_validate(raw)
    torch.set_num_threads(rank_threads(config))
    seed_everything(config.run.seed)
    try:
        with Store.open(config, quiet=True) as store:
            follower = _Follower(config, rank, store)
            follower.join(port)
            follower.serve()
    except ReservoirError as exc:  # RankLost: rank 0 is gone, nothing is left to report to
        sys.stderr.write(f"error: trainer rank {rank}: {' '.join(str(exc).split())}\n")
        sys.exit(1)
    dist.destroy_process_group()


class _Follower:
    """Rank r's model, optimizer and store connection, and what it does for each command."""

    def __init__(self, config: ReservoirConfig, rank: int, store: Store) -> None:
        self.config, self.store, self.world = config, store, config.trainer.workers
        self.patience = Patience(config.store.outage_patience_s, say=lambda line: print(
            f"trainer rank {rank}: {line}", file=sys.stderr, flush=True))
        self.learner = Learner(config, rank)
        self.device, self.ranks = self.learner.device, Ranks(rank, self.world, _reduce)
        self.tasks: dict[str, list] = {}  # each tasks stage's demonstrations, read once

    def join(self, port: int) -> None:
        rendezvous = dist.TCPStore("127.0.0.1", port, self.world, is_master=False,
                                   timeout=START_TIMEOUT)
        rendezvous.set(f"ready/{self.ranks.rank}", "1")
        self.commands = _join(rendezvous, self.ranks.rank, self.world, self.device)
        if self.config.trainer.sharding == "fsdp2":
            self.learner.shard()

    def serve(self) -> None:
        while (order := _receive(self.commands))[0] != STOP:
            command, step, payload = order
            if command == DO:
                self.do(json.loads(bytes(payload.tolist()).decode()))
            elif command == TRAIN:
                try:
                    self.train(step, [] if payload is None else payload.tolist())
                except StepNotFinite:
                    pass  # every rank refused the step alike: rank 0 says so and decides
            else:
                raise ReservoirError(f"unknown command {command} from rank 0")

    def do(self, order: dict) -> None:
        """What rank 0 does at the same time (or did: a load of its checkpoint), then the
        barrier rank 0 waits at."""
        learner, what = self.learner, order["do"]
        if what == "load":
            learner.load(Path(order["path"]))
        elif what == "begin":
            learner.begin(stage_at(learner.plan, order["step"]))
        elif what == "save":
            learner.save(Path(order["root"]), order["step"], order["version"])
        elif what == "publish":
            learner.publish(Path(order["path"]))
        elif what == "start_from":
            learner.start_from(Path(order["path"]))
        elif what == "evaluate":
            learner.evaluate(None)
        else:
            raise ReservoirError(f"unknown order {what!r} from rank 0")
        _collective(dist.barrier, group=self.commands)

    def train(self, step: int, ids: list[int]) -> None:
        """The step's rows in rank 0's order (the store returns them by id), or the step's
        tasks; this rank's share trained."""
        learner = self.learner
        if ids:
            fetched = self.patience(lambda: self.store.fetch(ids), f"step {step}'s rows")
            by_id = {row.id: row for row in fetched}
            if len(by_id) != len(set(ids)):
                raise ReservoirError(f"step {step}: {len(set(ids)) - len(by_id)} of its "
                                     f"{len(ids)} rows are not in the store")
            batch = make_batch([by_id[i] for i in ids], learner.tokenizer.pad_token_id,
                               self.device)
        else:
            stage = stage_at(learner.plan, step)
            if stage.name not in self.tasks:
                self.tasks[stage.name] = self.patience(
                    lambda: self._demonstrations(stage.data.tasks.fraction), "the run's tasks")
            batch = task_batch(learner.tokenizer.pad_token_id, self.tasks[stage.name],
                               stage.batch,
                               seed=self.config.run.seed, step=step).to(self.device)
        learner.train(step, batch, self.ranks)


    def _demonstrations(self, fraction: float) -> list:
        run_id = self.store.run_id(self.config.run.name)
        tasks = self.store.tasks.sft_tasks(run_id, fraction)
        return demonstrations(self.learner.tokenizer, [conversation(*row[1:]) for row in tasks])


def _receive(commands) -> tuple[int, int, torch.Tensor | None]:
    """The next command from rank 0: (command, step, payload or None)."""
    header = torch.zeros(3, dtype=torch.int64)
    _collective(dist.broadcast, header, 0, group=commands)
    command, step, size = header.tolist()
    if not size:
        return command, step, None
    payload = torch.empty(size, dtype=PAYLOAD[command])
    _collective(dist.broadcast, payload, 0, group=commands)
    return command, step, payload


def _exit_without(parent: int) -> None:
    """End this follower when rank 0's process is gone (it may be computing, not waiting)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)
