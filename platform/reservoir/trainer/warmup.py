"""The supervised warm-up stage before RL: its data, its progress in the store, its stop.

It trains on the first `warmup_fraction` of the run's train tasks (which RL then claims last),
writes its progress to `runs.progress` about once a second (the live table and
`analytics.runs` show it, on every machine), and checks for a stop before every step, so
Ctrl-C ends it within a step. A stopped warm-up leaves no step 0 and no checkpoint; the
seeded warm-up runs again, to the same weights, on `--resume`.
"""

from __future__ import annotations

import time
from typing import Callable

from rich.console import Console

from reservoir.config import ReservoirConfig
from reservoir.store import Store
from reservoir.store.runs import set_progress
from reservoir.store.tasks import mark_explored, split_tasks
from reservoir.trainer.sft import warm_up

PROGRESS_EVERY_S = 1.0


def warm_up_stage(store: Store, run_id: int, config: ReservoirConfig, model, tokenizer, *,
                  stop: Callable[[], bool], console: Console) -> dict[str, float] | None:
    """Run the warm-up; its metrics, or None if `stop` said yes before it finished."""
    trainer = config.trainer
    with store.engine.begin() as conn:
        train = split_tasks(conn, run_id, "train")
        seen = train[:max(1, int(len(train) * trainer.warmup_fraction))]
        mark_explored(conn, [task_id for task_id, _, _ in seen])
    report = _Reporter(store, run_id, trainer.warmup_steps)
    losses = warm_up(model, tokenizer, [(prompt, answer or "") for _, prompt, answer in seen],
                     steps=trainer.warmup_steps, batch_size=trainer.warmup_batch,
                     lr=trainer.warmup_lr, seed=config.run.seed, stop=stop, progress=report)
    report.done()
    if len(losses) < trainer.warmup_steps:
        return None
    console.print(f"supervised warm-up: {trainer.warmup_steps} steps on {len(seen)} tasks, "
                  f"loss {losses[0]:.2f} -> {losses[-1]:.2f}")
    return {"warmup/steps": trainer.warmup_steps, "warmup/tasks": len(seen),
            "warmup/loss_first": losses[0], "warmup/loss_last": losses[-1]}


class _Reporter:
    """Writes {phase, step, of, loss} to runs.progress, at most once every PROGRESS_EVERY_S."""

    def __init__(self, store: Store, run_id: int, steps: int) -> None:
        self.store, self.run_id, self.steps = store, run_id, steps
        self.last = 0.0

    def __call__(self, step: int, loss: float) -> None:
        now = time.monotonic()
        if now - self.last < PROGRESS_EVERY_S and step < self.steps:
            return
        self.last = now
        with self.store.engine.begin() as conn:
            set_progress(conn, self.run_id, {"phase": "warm-up", "step": step,
                                             "of": self.steps, "loss": round(loss, 4)})

    def done(self) -> None:
        with self.store.engine.begin() as conn:
            set_progress(conn, self.run_id, {})
