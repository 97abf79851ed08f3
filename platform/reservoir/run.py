"""`reservoir run` in sync mode, in one process: explore, write, lease, train, commit, publish.

Everything meets in the store: explored groups are written through the writer, the trainer
leases them back through the sampler, and each step commits through the ledger. After every
`sync_interval` steps the new weights go to the explorer's engine in place and a policy version
is published. (Worker pools on Ray and the async mode come next.)
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from reservoir.config import ReservoirConfig
from reservoir.errors import ConfigError
from reservoir.explorer.engine import TransformersEngine
from reservoir.explorer.rewards import REWARDS
from reservoir.explorer.tasks import GENERATORS, read_task_file
from reservoir.explorer.workflow import Task, single_turn
from reservoir.models import load_model
from reservoir.store import Store
from reservoir.store.ledger import add_step_metrics, record_step
from reservoir.store.runs import run_exists, run_id_of, set_status
from reservoir.store.tasks import add_tasks, claim_train_tasks, mark_explored, split_tasks
from reservoir.trainer.batch import make_batch
from reservoir.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from reservoir.trainer.sft import warm_up
from reservoir.trainer.step import PRESETS, train_step


@dataclass
class RunSummary:
    run: str
    steps: int = 0
    version: int = 0
    accuracy: list[tuple[int | str, float]] = field(default_factory=list)


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _load_tasks(store: Store, run_id: int, config: ReservoirConfig) -> None:
    tasks = config.tasks
    if tasks.file is not None:
        rows = read_task_file(tasks.file)
    elif tasks.generate is not None:
        rows = GENERATORS[tasks.generate](tasks.count, seed=config.run.seed,
                                          test_fraction=tasks.test_fraction)
    else:
        raise ConfigError("tasks: set tasks.file or tasks.generate")
    with store.engine.begin() as conn:
        add_tasks(conn, run_id, rows)


def evaluate(engine: TransformersEngine, tasks: list[tuple], reward, max_tokens: int) -> float:
    """Greedy accuracy on held-out tasks (the mean of the reward's accuracy component)."""
    if not tasks:
        return float("nan")
    samples = engine.sample([prompt for _, prompt, _ in tasks], 1, temperature=0,
                            max_tokens=max_tokens)
    return float(np.mean([reward(group[0].text, answer or "")["accuracy"]
                          for (_, _, answer), group in zip(tasks, samples)]))


@dataclass
class _Session:
    """What one run keeps alive: the store, the explorer's engine and the trainer's policy."""

    config: ReservoirConfig
    store: Store
    engine: TransformersEngine
    policy: object
    tokenizer: object
    optimizer: torch.optim.Optimizer
    run_id: int = 0
    held_out: list = field(default_factory=list)

    @property
    def checkpoints(self) -> Path:
        return self.config.trainer.checkpoint_dir / self.config.run.name


def run_sync(config: ReservoirConfig, console: Console | None = None, *,
             resume: bool = False) -> RunSummary:
    """Run (or, with resume, continue from the last checkpoint) a sync RFT run."""
    console = console or Console()
    if not (Path(config.model.path) / "config.json").is_file():
        raise ConfigError(f"model.path: {config.model.path} is not a model folder (no "
                          "config.json); build one with `reservoir model tiny "
                          f"{config.model.path}`")
    _seed(config.run.seed)
    policy, tokenizer = load_model(config.model.path)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=config.trainer.lr)
    summary = RunSummary(config.run.name)
    with Store.open(config) as store:
        session = _Session(config, store, TransformersEngine(config.model.path), policy,
                           tokenizer, optimizer)
        first = _resume(session, summary, console) if resume else _start(session, summary,
                                                                           console)
        with store.engine.begin() as conn:
            set_status(conn, session.run_id, "running")
        try:
            _train(session, summary, first, console)
        except KeyboardInterrupt:
            save_checkpoint(session.checkpoints, summary.steps, summary.version, policy, optimizer)
            with store.engine.begin() as conn:
                set_status(conn, session.run_id, "stopped")
            console.print(f"stopped after step {summary.steps}; checkpoint saved, resume with "
                          "`reservoir run CONFIG --resume`")
            raise
        with store.engine.begin() as conn:
            set_status(conn, session.run_id, "finished")
    return summary


def _start(session: _Session, summary: RunSummary, console: Console) -> int:
    """Create the run, load its tasks, measure and warm up the start policy; first step: 1."""
    config, store = session.config, session.store
    with store.engine.begin() as conn:
        if run_exists(conn, config.run.name):
            raise ConfigError(f"run.name: a run {config.run.name!r} already exists; choose "
                              "another name or continue it with --resume")
    session.run_id = store.create_run(config.run.name, group_size=config.explorer.n,
                                      model=str(config.model.path),
                                      config=config.model_dump(mode="json"))
    _load_tasks(store, session.run_id, config)
    session.held_out = _held_out(session)
    summary.accuracy.append(("start", _evaluate(session)))
    before_rl = {"eval/accuracy_start": summary.accuracy[-1][1]}
    if config.trainer.warmup_steps:
        before_rl |= _warm_up(session, console)
        session.engine.load_state_dict(session.policy.state_dict())
        summary.accuracy.append(("warm-up", _evaluate(session)))
    with store.engine.begin() as conn:  # step 0: the policy RL starts from
        record_step(conn, session.run_id, 0, policy_version=0,
                    metrics=before_rl | {"eval/accuracy": summary.accuracy[-1][1]})
    store.publish_version(config.run.name, 0, location=str(config.model.path), train_step=0)
    return 1


def _resume(session: _Session, summary: RunSummary, console: Console) -> int:
    """Reload the last checkpoint (weights, optimizer, RNG); first step: the one after it."""
    checkpoint = latest_checkpoint(session.checkpoints)
    if checkpoint is None:
        raise ConfigError(f"--resume: no checkpoint under {session.checkpoints}")
    resumed = load_checkpoint(checkpoint, session.policy, session.optimizer)
    session.engine.load_state_dict(session.policy.state_dict())
    with session.store.engine.connect() as conn:
        session.run_id = run_id_of(conn, session.config.run.name)
    session.held_out = _held_out(session)
    summary.steps, summary.version = resumed.step, resumed.version
    console.print(f"resumed run {summary.run!r} from {checkpoint} (step {resumed.step}, "
                  f"policy version {resumed.version})")
    return resumed.step + 1


def _held_out(session: _Session) -> list[tuple]:
    with session.store.engine.connect() as conn:
        return split_tasks(conn, session.run_id, "test")


def _evaluate(session: _Session) -> float:
    explorer = session.config.explorer
    return evaluate(session.engine, session.held_out, REWARDS.get(explorer.reward),
                    explorer.max_tokens)


def _train(session: _Session, summary: RunSummary, first: int, console: Console) -> None:
    trainer = session.config.trainer
    columns = (TextColumn("step {task.completed}/{task.total}"), BarColumn(),
               TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        bar = progress.add_task("", total=trainer.steps, completed=first - 1)
        for step in range(first, trainer.steps + 1):
            metrics = _one_step(session, step, summary)
            if step % trainer.eval_interval == 0 or step == trainer.steps:
                summary.accuracy.append((step, _evaluate(session)))
                with session.store.engine.begin() as conn:
                    add_step_metrics(conn, session.run_id, step,
                                     {"eval/accuracy": summary.accuracy[-1][1]})
            if step % trainer.checkpoint_interval == 0 or step == trainer.steps:
                save_checkpoint(session.checkpoints, step, summary.version, session.policy,
                                session.optimizer)
            accuracy = summary.accuracy[-1][1] if summary.accuracy else float("nan")
            progress.update(bar, advance=1, description=(
                f"reward {metrics['reward_mean']:.2f}  accuracy {accuracy:.2f}  "
                f"version {summary.version}"))


def _warm_up(session: _Session, console: Console) -> dict[str, float]:
    """Supervised warm-up on the first warmup_fraction of the train tasks, which RL then skips."""
    config, trainer = session.config, session.config.trainer
    with session.store.engine.begin() as conn:
        train = split_tasks(conn, session.run_id, "train")
        seen = train[:max(1, int(len(train) * trainer.warmup_fraction))]
        mark_explored(conn, [task_id for task_id, _, _ in seen])
    losses = warm_up(session.policy, session.tokenizer,
                     [(prompt, answer or "") for _, prompt, answer in seen],
                     steps=trainer.warmup_steps, batch_size=trainer.warmup_batch,
                     lr=trainer.warmup_lr, seed=config.run.seed)
    console.print(f"supervised warm-up: {trainer.warmup_steps} steps on {len(seen)} tasks, "
                  f"loss {losses[0]:.2f} -> {losses[-1]:.2f}")
    return {"warmup/steps": trainer.warmup_steps, "warmup/tasks": len(seen),
            "warmup/loss_first": losses[0], "warmup/loss_last": losses[-1]}


def _one_step(session: _Session, step: int, summary: RunSummary) -> dict[str, float]:
    """Explore one batch of tasks, train on a leased batch, commit; publish every sync_interval."""
    config, store, engine = session.config, session.store, session.engine
    explorer, trainer = config.explorer, config.trainer
    with store.engine.begin() as conn:
        claimed = claim_train_tasks(conn, session.run_id, explorer.tasks_per_step)
    single_turn(engine, store, config.run.name,
                [Task(task_id, prompt, answer or "") for task_id, prompt, answer in claimed],
                n=explorer.n, rewards=[REWARDS.get(explorer.reward)],
                policy_version=summary.version, temperature=explorer.temperature,
                max_tokens=explorer.max_tokens)
    lease = store.lease(config.run.name, groups=trainer.batch_groups, allow_partial=True)
    batch = make_batch(lease.rows, session.tokenizer.pad_token_id)
    metrics = train_step(session.policy, session.optimizer, batch, PRESETS[trainer.algorithm],
                         micro_batch=trainer.micro_batch, temperature=explorer.temperature)
    store.commit_step(lease, step=step, policy_version=summary.version, loss=metrics["loss"],
                      metrics=metrics)
    summary.steps = step
    if step % trainer.sync_interval == 0:
        summary.version += 1
        engine.load_state_dict(session.policy.state_dict())
        store.publish_version(config.run.name, summary.version, location=None, train_step=step)
    return metrics
