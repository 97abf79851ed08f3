"""What following a run with every tracker costs it: the same colocated GRPO run with tracking
on (TensorBoard, MLflow on a file store and W&B offline, all at once) and off.

Both sides run the same config from the same tiny model and seed; they alternate which goes
first in each repeat. Two figures per run, read from the store:
- run tokens/s: response tokens trained over the seconds from the first step's commit to the
  last's (what the trackers' thread could slow: generation, training and the store's round
  trips, with evaluations every --eval-interval steps, whose samples the trackers log too);
- step tokens/s: the median of the steps' own `train_tokens_per_s` (the training step alone).
The ratio on / off of the medians over repeats is the figure; the target is >= 0.97.

    python bench/tracking.py [--steps 40 --repeats 3 --db-url postgresql://...]
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: nothing from a hub

import argparse  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from sqlalchemy import text  # noqa: E402

from reservoir import pool  # noqa: E402
from reservoir.config import parse_config  # noqa: E402
from reservoir.models import build_tiny_model  # noqa: E402
from reservoir.store import Store  # noqa: E402

TARGET = 0.97
STEPS = text("SELECT extract(epoch FROM max(t.created_at) - min(t.created_at)), "
             "sum((t.metrics ->> 'train_tokens')::float8) FILTER (WHERE t.step > "
             "(SELECT min(step) FROM train_steps WHERE run_id = r.id)), "
             "percentile_cont(0.5) WITHIN GROUP "
             "(ORDER BY (t.metrics ->> 'train_tokens_per_s')::float8) "
             "FROM train_steps t JOIN runs r ON r.id = t.run_id "
             "WHERE r.name = :run AND t.metrics ? 'train_tokens'")


def one_run(tracked: bool, model: Path, scratch: Path, args) -> tuple[float, float]:
    """(run tokens/s, median step tokens/s) of one run."""
    name = f"bench-tracking-{'on' if tracked else 'off'}-{uuid.uuid4().hex[:6]}"
    raw = {"run": {"name": name, "placement": "colocated", "seed": 0},
           "model": {"path": str(model)},
           "tasks": {"generate": "reverse", "count": 400},
           "explorer": {"n": 8, "batch_tasks": 8, "max_tokens": 12, "temperature": 1.0},
           "trainer": {"steps": args.steps, "batch_groups": 8, "micro_batch": 64,
                       "eval_interval": args.eval_interval,
                       "checkpoint_interval": 10 * args.steps,
                       "checkpoint_dir": str(scratch / "checkpoints")},
           "store": {"url": args.db_url}}
    if tracked:
        raw["tracking"] = {"tensorboard": {"dir": str(scratch / "tb")},
                           "mlflow": {"tracking_uri": f"file://{scratch / 'mlruns'}"},
                           "wandb": {"project": "bench", "mode": "offline",
                                     "dir": str(scratch)}}
    config = parse_config(raw)
    pool.run(config, console=Console(quiet=True), view=False)
    with Store.open(config, quiet=True) as store, store.engine.connect() as conn:
        seconds, tokens, step_rate = conn.execute(STEPS, {"run": name}).one()
    return float(tokens) / float(seconds), float(step_rate)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--eval-interval", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--db-url", default=None, help="default: the embedded server")
    args = parser.parse_args()
    console = Console()
    results: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    with tempfile.TemporaryDirectory(prefix="bench-tracking-") as folder:
        scratch = Path(folder)
        model = build_tiny_model(scratch / "tiny", seed=0)
        one_run(False, model, scratch, args)  # untimed: the first run pays for the imports
        for repeat in range(args.repeats):
            for tracked in ((True, False) if repeat % 2 == 0 else (False, True)):
                results[tracked].append(one_run(tracked, model, scratch, args))
                console.print(f"repeat {repeat + 1}, tracking {'on' if tracked else 'off'}: "
                              f"{results[tracked][-1][0]:,.0f} run tokens/s, "
                              f"{results[tracked][-1][1]:,.0f} step tokens/s")
    table = Table(title=f"tracking on (TensorBoard + MLflow + W&B offline) / off, "
                        f"{args.steps} steps, median of {args.repeats}")
    for column in ("figure", "off", "on", "on / off", f"target >= {TARGET}"):
        table.add_column(column, justify="right" if column != "figure" else "left")
    for index, figure in enumerate(("run tokens/s", "step tokens/s")):
        off = statistics.median(result[index] for result in results[False])
        on = statistics.median(result[index] for result in results[True])
        table.add_row(figure, f"{off:,.0f}", f"{on:,.0f}", f"{on / off:.3f}",
                      "met" if on / off >= TARGET else "NOT met")
    console.print(table)


if __name__ == "__main__":
    main()
