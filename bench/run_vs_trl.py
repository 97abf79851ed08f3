"""Reservoir's GRPO run (sync and async) against TRL's GRPOTrainer, in one run, on the CPU.

The same start model (the tiny Qwen2 after the same supervised warm-up), the same reverse-word
tasks, group size, batch, learning rate, temperature and reward. Prints, for each, the wall time
until the training reward (mean of the last 10 steps) first reaches the target, samples/s, and the
ratio Reservoir / TRL (target <= 0.7). Needs the bench extra: pip install -e '.[bench]'.

    python bench/run_vs_trl.py [--steps 60 --target 0.5 --db-url postgresql://...]
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: nothing from a hub

import argparse
import json
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from sqlalchemy import text

sys.path.insert(0, str(Path(__file__).parent))

from trl_grpo import run_trl  # noqa: E402

from reservoir import pool  # noqa: E402
from reservoir.config import parse_config  # noqa: E402
from reservoir.explorer.tasks import GENERATORS  # noqa: E402
from reservoir.models import build_tiny_model, load_model  # noqa: E402
from reservoir.store import Store  # noqa: E402
from reservoir.trainer.sft import supervised  # noqa: E402

WINDOW = 10  # steps in the trailing reward mean compared with the target


@dataclass
class Outcome:
    name: str
    curve: list[tuple[float, float]]  # (seconds since training start, batch reward mean)
    samples: int
    wall_s: float  # the whole call, set-up included

    def time_to(self, target: float) -> float | None:
        rewards = [reward for _, reward in self.curve]
        for i in range(WINDOW - 1, len(rewards)):
            if np.mean(rewards[i - WINDOW + 1:i + 1]) >= target:
                return self.curve[i][0]
        return None

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.curve[-1][0]


def start_model(scratch: Path, tasks: list[dict], args) -> Path:
    """The tiny model after a supervised warm-up on the first 30 % of the train tasks."""
    model_dir = build_tiny_model(scratch / "tiny", seed=0)
    model, tokenizer = load_model(model_dir)
    seen = tasks[:int(len(tasks) * 0.3)]
    supervised(model, tokenizer, [(t["prompt"], t["answer"]) for t in seen],
               steps=args.warmup_steps, batch_size=32, lr=1e-3, seed=0)
    model.save_pretrained(scratch / "start")
    tokenizer.save_pretrained(scratch / "start")
    return scratch / "start"


def run_reservoir(mode: str, model: Path, task_file: Path, scratch: Path, args) -> Outcome:
    name = f"bench-{mode}-{uuid.uuid4().hex[:6]}"
    config = parse_config({
        "run": {"name": name, "mode": mode, "seed": 0}, "model": {"path": str(model)},
        "tasks": {"file": str(task_file)},
        "explorer": {"n": args.n, "batch_tasks": args.batch_groups, "max_tokens": args.max_tokens,
                     "temperature": 1.0, "workers": 1},
        "trainer": {"lr": args.lr, "batch_groups": args.batch_groups,
                    "micro_batch": args.n * args.batch_groups, "steps": args.steps,
                    "eval_interval": 10 * args.steps, "checkpoint_interval": 10 * args.steps,
                    "checkpoint_dir": str(scratch / "checkpoints")},
        "sampler": {"max_staleness": 1 if mode == "async" else None},
        "store": {"url": args.db_url}})
    started = time.perf_counter()
    pool.run(config, console=Console(quiet=True))
    wall_s = time.perf_counter() - started
    with Store.open(config, quiet=True, migrate=True) as store, store.engine.connect() as conn:
        rows = conn.execute(text(
            "SELECT extract(epoch FROM t.created_at - s.created_at), t.metrics ->> 'reward_mean' "
            "FROM train_steps t JOIN runs r ON r.id = t.run_id JOIN train_steps s "
            "ON s.run_id = r.id AND s.step = 0 WHERE r.name = :run AND t.step > 0 "
            "ORDER BY t.step"), {"run": name}).all()
    curve = [(float(seconds), float(reward)) for seconds, reward in rows]
    return Outcome(f"reservoir {mode}", curve, args.steps * args.batch_groups * args.n, wall_s)


def run_trl_side(model: Path, train: list[dict], scratch: Path, args) -> Outcome:
    started = time.perf_counter()
    result = run_trl(model, [t["prompt"] for t in train], [t["answer"] for t in train],
                     n=args.n, batch_groups=args.batch_groups, lr=args.lr, temperature=1.0,
                     max_tokens=args.max_tokens, steps=args.steps, seed=0,
                     out_dir=scratch / "trl")
    return Outcome("trl GRPOTrainer", [(s, r) for s, _, r in result.curve], result.samples,
                   time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--target", type=float, default=0.45)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--batch-groups", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=10)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--warmup-steps", type=int, default=1500)
    parser.add_argument("--db-url", default=None, help="default: the embedded server")
    args = parser.parse_args()
    console = Console()
    rows = GENERATORS["reverse"](3000, seed=0, test_fraction=0.1)
    train = [row for row in rows if row["split"] == "train"]
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        with console.status(f"supervised warm-up ({args.warmup_steps} steps)"):
            model = start_model(scratch, train, args)
        rl_tasks = train[int(len(train) * 0.3):]  # what the warm-up did not see
        task_file = scratch / "tasks.jsonl"
        task_file.write_text("".join(json.dumps(row) + "\n" for row in
                                     rl_tasks + [r for r in rows if r["split"] == "test"]))
        outcomes = []
        for label, run in (("trl", lambda: run_trl_side(model, rl_tasks, scratch, args)),
                           ("sync", lambda: run_reservoir("sync", model, task_file, scratch, args)),
                           ("async", lambda: run_reservoir("async", model, task_file, scratch,
                                                           args))):
            with console.status(f"{label}: {args.steps} steps"):
                outcomes.append(run())
    report(console, outcomes, args)


def report(console: Console, outcomes: list[Outcome], args) -> None:
    console.print(f"# {args.steps} steps, batch {args.batch_groups} groups x {args.n}, "
                  f"max_tokens {args.max_tokens}, lr {args.lr}; target: mean reward of "
                  f"{WINDOW} steps >= {args.target}")
    trl = outcomes[0]
    for outcome in outcomes:
        reached = outcome.time_to(args.target)
        rewards = [reward for _, reward in outcome.curve]
        blocks = " ".join(f"{np.mean(rewards[i:i + WINDOW]):.2f}"
                          for i in range(0, len(rewards), WINDOW))
        console.print(f"{outcome.name}: reward per {WINDOW} steps: {blocks}", highlight=False)
        console.print(
            f"{outcome.name}: time to target "
            f"{'not reached' if reached is None else f'{reached:.1f} s'} | "
            f"{outcome.samples_per_s:.0f} samples/s | reward first {WINDOW} steps "
            f"{np.mean(rewards[:WINDOW]):.3f} -> last {WINDOW} {np.mean(rewards[-WINDOW:]):.3f} "
            f"| training {outcome.curve[-1][0]:.1f} s, whole call {outcome.wall_s:.1f} s",
            highlight=False)
    for outcome in outcomes[1:]:
        mine, theirs = outcome.time_to(args.target), trl.time_to(args.target)
        ratio = f"{mine / theirs:.2f}" if mine and theirs else "n/a (target not reached)"
        console.print(f"ratio {outcome.name} / trl, time to target: {ratio} (target <= 0.7); "
                      f"samples/s ratio trl / {outcome.name}: "
                      f"{trl.samples_per_s / outcome.samples_per_s:.2f}", highlight=False)


if __name__ == "__main__":
    main()
