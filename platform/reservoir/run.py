"""`reservoir run` in sync mode, in one process: explore, write, lease, train, commit, publish.

Everything meets in the store: explored groups are written through the writer, the trainer
leases them back through the sampler, and each step commits through the ledger. After every
`sync_interval` steps the new weights go to the explorer's engine in place and a policy version
is published. (Worker pools on Ray and the async mode come next.)
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

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
from reservoir.store.tasks import add_tasks, claim_train_tasks, mark_explored, split_tasks
from reservoir.trainer.batch import make_batch
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


def run_sync(config: ReservoirConfig, console: Console | None = None) -> RunSummary:
    console = console or Console()
    _seed(config.run.seed)
    explorer, trainer = config.explorer, config.trainer
    policy, tokenizer = load_model(config.model.path)
    engine = TransformersEngine(config.model.path)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=trainer.lr)
    reward = REWARDS.get(explorer.reward)
    summary = RunSummary(config.run.name)
    with Store.open(config) as store:
        run_id = store.create_run(config.run.name, group_size=explorer.n,
                                  model=str(config.model.path), config=config.model_dump(mode="json"))
        _load_tasks(store, run_id, config)
        with store.engine.connect() as conn:
            held_out = split_tasks(conn, run_id, "test")
        summary.accuracy.append(("start", evaluate(engine, held_out, reward, explorer.max_tokens)))
        before_rl = {"eval/accuracy_start": summary.accuracy[-1][1]}
        if trainer.warmup_steps:
            before_rl |= _warm_up(store, run_id, policy, tokenizer, config, console)
            engine.load_state_dict(policy.state_dict())
            summary.accuracy.append(("warm-up", evaluate(engine, held_out, reward,
                                                         explorer.max_tokens)))
        with store.engine.begin() as conn:  # step 0: the policy RL starts from
            record_step(conn, run_id, 0, policy_version=0,
                        metrics=before_rl | {"eval/accuracy": summary.accuracy[-1][1]})
        store.publish_version(config.run.name, 0, location=str(config.model.path), train_step=0)
        columns = (TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                   TextColumn("{task.description}"), TimeElapsedColumn())
        with Progress(*columns, console=console) as progress:
            bar = progress.add_task(f"accuracy {summary.accuracy[-1][1]:.2f}", total=trainer.steps)
            for step in range(1, trainer.steps + 1):
                metrics = _one_step(store, engine, policy, optimizer, tokenizer, config, run_id,
                                    step, summary)
                if step % trainer.eval_interval == 0 or step == trainer.steps:
                    accuracy = evaluate(engine, held_out, reward, explorer.max_tokens)
                    summary.accuracy.append((step, accuracy))
                    with store.engine.begin() as conn:
                        add_step_metrics(conn, run_id, step, {"eval/accuracy": accuracy})
                progress.update(bar, advance=1, description=(
                    f"reward {metrics['reward_mean']:.2f}  accuracy "
                    f"{summary.accuracy[-1][1]:.2f}  version {summary.version}"))
    return summary


def _warm_up(store, run_id, policy, tokenizer, config, console) -> dict[str, float]:
    """Supervised warm-up on the first warmup_fraction of the train tasks, which RL then skips."""
    trainer = config.trainer
    with store.engine.begin() as conn:
        train = split_tasks(conn, run_id, "train")
        seen = train[:max(1, int(len(train) * trainer.warmup_fraction))]
        mark_explored(conn, [task_id for task_id, _, _ in seen])
    losses = warm_up(policy, tokenizer, [(prompt, answer or "") for _, prompt, answer in seen],
                     steps=trainer.warmup_steps, batch_size=trainer.warmup_batch,
                     lr=trainer.warmup_lr, seed=config.run.seed)
    console.print(f"supervised warm-up: {trainer.warmup_steps} steps on {len(seen)} tasks, "
                  f"loss {losses[0]:.2f} -> {losses[-1]:.2f}")
    return {"warmup/steps": trainer.warmup_steps, "warmup/tasks": len(seen),
            "warmup/loss_first": losses[0], "warmup/loss_last": losses[-1]}


def _one_step(store, engine, policy, optimizer, tokenizer, config, run_id, step, summary):
    explorer, trainer = config.explorer, config.trainer
    with store.engine.begin() as conn:
        claimed = claim_train_tasks(conn, run_id, explorer.tasks_per_step)
    single_turn(engine, store, config.run.name,
                [Task(task_id, prompt, answer or "") for task_id, prompt, answer in claimed],
                n=explorer.n, rewards=[REWARDS.get(explorer.reward)],
                policy_version=summary.version, temperature=explorer.temperature,
                max_tokens=explorer.max_tokens)
    lease = store.lease(config.run.name, groups=trainer.batch_groups, allow_partial=True)
    batch = make_batch(lease.rows, tokenizer.pad_token_id)
    metrics = train_step(policy, optimizer, batch, PRESETS[trainer.algorithm],
                         micro_batch=trainer.micro_batch, temperature=explorer.temperature)
    store.commit_step(lease, step=step, policy_version=summary.version, loss=metrics["loss"],
                      metrics=metrics)
    summary.steps = step
    if step % trainer.sync_interval == 0:
        summary.version += 1
        engine.load_state_dict(policy.state_dict())
        store.publish_version(config.run.name, summary.version, location=None, train_step=step)
    return metrics
