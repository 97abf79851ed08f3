"""A curriculum explorers follow against least-explored-first, from the same warm start.

The tiny Qwen2 is warmed up (supervised) on short words to reverse (2-4 letters); then two GRPO
runs on the same store, from that same start model, explore a task set where most tasks are
too easy or too hard for it (words of 2-12 letters):

- least_explored: explorer.task_order least_explored (today's default);
- difficulty_band: explorer.task_order difficulty_band (pass rates in [0.1, 0.9] first,
  unmeasured tasks next, the rest last) with a stream pipeline over the run's tasks
  (task_difficulty_mapper, the shipped curriculum.yaml in mode: stream) writing each explored
  task's difficulty as rows arrive: a closed loop.

Both take the same number of steps of the same batch, so the same number of samples. Printed
per side: the share of groups with signal (rewards not all equal: what GRPO learns from),
rollout reward per sample, and held-out accuracy (greedy, on words of 2-12 letters) at the end;
then the ratio band / least-explored of the share of groups with signal (issue 32 asks >= 1.5).

    python bench/curriculum.py [--steps 40 --batch-groups 16 --n 8 --seeds 0 1]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table
from sqlalchemy import text

sys.path.insert(0, str(Path(__file__).parent))

from reservoir import pool  # noqa: E402
from reservoir.config import parse_config  # noqa: E402
from reservoir.explorer.tasks import write_task_file  # noqa: E402
from reservoir.models import build_tiny_model, load_model  # noqa: E402
from reservoir.plan.tasks import reverse  # noqa: E402
from reservoir.store import Store  # noqa: E402
from reservoir.trainer.sft import supervised  # noqa: E402

# one row per group: were its rewards all equal, their sum, its size
GROUPS = text("SELECT min(e.reward) = max(e.reward), sum(e.reward), count(*) "
              "FROM experiences e JOIN runs r ON r.id = e.run_id WHERE r.name = :run "
              "GROUP BY e.group_id")
BANDED = text("SELECT count(*) FILTER (WHERE difficulty IS NOT NULL), count(*) FROM tasks t "
              "JOIN runs r ON r.id = t.run_id WHERE r.name = :run AND t.split = 'train'")


def start_model(scratch: Path, steps: int) -> Path:
    """The tiny model after a supervised warm-up on 2-4 letter words."""
    model_dir = build_tiny_model(scratch / "tiny", seed=0)
    model, tokenizer = load_model(model_dir)
    short = reverse(3000, seed=1, min_length=2, max_length=4, test_fraction=0.0)
    supervised(model, tokenizer, [(t["prompt"], t["answer"]) for t in short], steps=steps,
               batch_size=32, lr=1e-3, seed=0)
    model.save_pretrained(scratch / "start")
    tokenizer.save_pretrained(scratch / "start")
    return scratch / "start"


def stream_pipeline(scratch: Path) -> Path:
    path = scratch / "curriculum_stream.yaml"
    path.write_text("# the shipped curriculum.yaml as a stream over the run's explored tasks\n"
                    "mode: stream\n"
                    "source: {table: tasks, where: 'times_explored > 0'}\n"
                    "process:\n"
                    "  - task_difficulty_mapper: {component: accuracy, threshold: 1.0}\n")
    return path


def run_side(order: str, model: Path, tasks: Path, scratch: Path, args, seed: int) -> dict:
    name = f"curriculum-{order}-{uuid.uuid4().hex[:6]}"
    config = parse_config({
        "run": {"name": name, "seed": seed, "placement": "colocated"},
        "model": {"path": str(model)}, "tasks": {"file": str(tasks)},
        "explorer": {"n": args.n, "batch_tasks": args.batch_groups, "max_tokens": 14,
                     "temperature": 1.0, "task_order": order, "pass_rate_band": [0.1, 0.9]},
        "trainer": {"lr": 2e-4, "batch_groups": args.batch_groups,
                    "micro_batch": args.n * args.batch_groups, "steps": args.steps,
                    "eval_interval": args.steps, "checkpoint_interval": 10 * args.steps,
                    "checkpoint_dir": str(scratch / "checkpoints" / name)},
        "pipelines": [str(stream_pipeline(scratch))] if order == "difficulty_band" else [],
        "store": {"url": args.db_url}})
    started = time.perf_counter()
    summary = pool.run(config, console=Console(quiet=True))
    wall_s = time.perf_counter() - started
    with Store.open(config, quiet=True, migrate=True) as store, store.engine.connect() as conn:
        groups = conn.execute(GROUPS, {"run": name}).all()
        measured, train = conn.execute(BANDED, {"run": name}).one()
    samples = sum(size for *_, size in groups)
    return {"signal": float(np.mean([not flat for flat, *_ in groups])),
            "reward": sum(float(total) for _, total, _ in groups) / samples,
            "accuracy": summary.accuracy[-1][1], "samples": samples, "seconds": wall_s,
            "measured": f"{measured}/{train}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-groups", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--warmup-steps", type=int, default=600)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--db-url", default=None, help="PostgreSQL URL (default: embedded)")
    args = parser.parse_args()
    console = Console(width=130)
    scratch = Path(tempfile.mkdtemp(prefix="bench-curriculum-"))
    with console.status(f"supervised warm-up on 2-4 letter words ({args.warmup_steps} steps)"):
        model = start_model(scratch, args.warmup_steps)
    tasks = scratch / "words_2_12.jsonl"
    write_task_file(reverse(2200, seed=2, min_length=2, max_length=12, test_fraction=0.1),
                    tasks)
    results: dict[str, list[dict]] = {"least_explored": [], "difficulty_band": []}
    for seed in args.seeds:
        for order in results:
            with console.status(f"seed {seed}: {order} ({args.steps} steps)"):
                results[order].append(run_side(order, model, tasks, scratch, args, seed))
            outcome = results[order][-1]
            console.print(f"seed {seed} {order}: " + json.dumps(
                {k: round(v, 3) if isinstance(v, float) else v for k, v in outcome.items()}))
    show(console, results, args)


def show(console: Console, results: dict[str, list[dict]], args) -> None:
    table = Table(title=f"reverse 2-12 letters after a 2-4 letter warm-up; {args.steps} steps of "
                        f"{args.batch_groups} groups of {args.n}; seeds {args.seeds}; means")
    for column in ("task_order", "groups with signal", "reward / sample",
                   "held-out accuracy", "samples", "seconds"):
        table.add_column(column, justify="left" if column == "task_order" else "right")
    mean = {order: {key: float(np.mean([r[key] for r in rows]))
                    for key in ("signal", "reward", "accuracy", "samples", "seconds")}
            for order, rows in results.items()}
    for order, m in mean.items():
        table.add_row(order, f"{m['signal']:.3f}", f"{m['reward']:.3f}", f"{m['accuracy']:.3f}",
                      f"{m['samples']:.0f}", f"{m['seconds']:.0f}")
    console.print(table)
    base, band = mean["least_explored"], mean["difficulty_band"]
    per_seed = [b["signal"] / a["signal"] if a["signal"] else float("inf")
                for a, b in zip(results["least_explored"], results["difficulty_band"])]
    console.print(
        f"groups with signal: difficulty_band {band['signal']:.3f} | least_explored "
        f"{base['signal']:.3f} | ratio {band['signal'] / base['signal']:.2f} (seeds "
        f"{' '.join(f'{r:.2f}' for r in per_seed)}; target >= 1.5)")
    console.print(
        f"held-out accuracy at equal samples: difficulty_band {band['accuracy']:.3f} | "
        f"least_explored {base['accuracy']:.3f} | reward per sample {band['reward']:.3f} vs "
        f"{base['reward']:.3f}")


if __name__ == "__main__":
    main()
