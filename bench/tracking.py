"""What following a run with every tracker costs it: the same GRPO run with tracking on
(TensorBoard, MLflow on a file store and W&B offline, all at once) and off.

The run has the main job's shape (examples/reverse_grpo: 16 tasks of 16 responses a step,
10 tokens each, an evaluation every 25 steps, the trainer and an explorer in Ray actors; no
warm-up). Both sides run the same config from the same tiny model and seed; they alternate
which goes first in each repeat. Three figures per run, read from the store:
- run tokens/s: response tokens trained over the seconds from the first step's commit to the
  last's (what the trackers' process could slow: generation, training and the store's round
  trips, with evaluations every --eval-interval steps, whose samples the trackers log too);
- settled tokens/s: the same from step --settle on, past the trackers' start-up (their
  libraries' imports and opening their runs: a few CPU seconds once a run, which a 30-second
  run on two cores feels and a real run does not);
- step tokens/s: the median of the steps' own `train_tokens_per_s` (the training step alone).
The figure is the median over repeats of the ratio on / off within each repeat (its two runs
back to back: this machine's speed drifts by tens of percent between minutes); the target is
>= 0.97. The ratio of the medians is printed beside it.

    python bench/tracking.py [--steps 100 --repeats 3 --settle 10 --placement split|colocated]
                             [--trackers tensorboard mlflow wandb] [--db-url postgresql://...]
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
TRACKERS = ("tensorboard", "mlflow", "wandb")
STEPS = text("SELECT t.step, extract(epoch FROM t.created_at), "
             "(t.metrics ->> 'train_tokens')::float8, "
             "(t.metrics ->> 'train_tokens_per_s')::float8 "
             "FROM train_steps t JOIN runs r ON r.id = t.run_id "
             "WHERE r.name = :run AND t.metrics ? 'train_tokens' ORDER BY t.step")
FIGURES = ("run tokens/s", "settled tokens/s", "step tokens/s")


def rates(steps: list[tuple], settle: int) -> tuple[float, float, float]:
    """Response tokens trained per second from the first step's commit to the last's, the
    same from step `settle` on, and the median step's own tokens/s."""
    def between(first: int) -> float:
        window = steps[first:]
        return sum(row[2] for row in window[1:]) / (window[-1][1] - window[0][1])
    return between(0), between(settle), statistics.median(row[3] for row in steps)


def one_run(tracked: bool, model: Path, scratch: Path, args) -> tuple[float, float, float]:
    """The run's FIGURES."""
    name = f"bench-tracking-{'on' if tracked else 'off'}-{uuid.uuid4().hex[:6]}"
    raw = {"run": {"name": name, "placement": args.placement, "seed": 0},
           "model": {"path": str(model)},
           "tasks": {"generate": "reverse", "count": 3000},
           "explorer": {"n": 16, "batch_tasks": 16, "max_tokens": 10, "temperature": 1.5},
           "trainer": {"steps": args.steps, "batch_groups": 16, "micro_batch": 64,
                       "lr": 2e-4, "eval_interval": args.eval_interval,
                       "checkpoint_interval": 10 * args.steps,
                       "checkpoint_dir": str(scratch / "checkpoints")},
           "store": {"url": args.db_url}}
    if tracked:
        every = {"tensorboard": {"dir": str(scratch / "tb")},
                 "mlflow": {"tracking_uri": f"file://{scratch / 'mlruns'}"},
                 "wandb": {"project": "bench", "mode": "offline", "dir": str(scratch)}}
        raw["tracking"] = {kind: every[kind] for kind in args.trackers}
    config = parse_config(raw)
    pool.run(config, console=Console(quiet=True), view=False)
    with Store.open(config, quiet=True) as store, store.engine.connect() as conn:
        steps = [tuple(map(float, row)) for row in conn.execute(STEPS, {"run": name})]
    return rates(steps, args.settle)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--eval-interval", type=int, default=25)
    parser.add_argument("--placement", choices=("split", "colocated"), default="split")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--settle", type=int, default=10,
                        help="steps left out of `settled tokens/s` (the trackers' start-up)")
    parser.add_argument("--trackers", nargs="+", default=list(TRACKERS), choices=TRACKERS)
    parser.add_argument("--db-url", default=None, help="default: the embedded server")
    args = parser.parse_args()
    console = Console()
    results: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
    with tempfile.TemporaryDirectory(prefix="bench-tracking-") as folder:
        scratch = Path(folder)
        model = build_tiny_model(scratch / "tiny", seed=0)
        one_run(False, model, scratch, args)  # untimed: the first run pays for the imports
        for repeat in range(args.repeats):
            for tracked in ((True, False) if repeat % 2 == 0 else (False, True)):
                results[tracked].append(one_run(tracked, model, scratch, args))
                figures = ", ".join(f"{value:,.0f} {name}" for name, value
                                    in zip(FIGURES, results[tracked][-1]))
                console.print(f"repeat {repeat + 1}, tracking {'on' if tracked else 'off'}: "
                              f"{figures}")
    table = Table(title=f"tracking on ({' + '.join(args.trackers)}) / off, {args.steps} "
                        f"steps, median of {args.repeats}")
    for column in ("figure", "off", "on", "on / off", "paired", f"paired >= {TARGET}"):
        table.add_column(column, justify="right" if column != "figure" else "left")
    for index, figure in enumerate(FIGURES):
        off = statistics.median(result[index] for result in results[False])
        on = statistics.median(result[index] for result in results[True])
        paired = statistics.median(on_run[index] / off_run[index] for on_run, off_run
                                   in zip(results[True], results[False]))
        table.add_row(figure, f"{off:,.0f}", f"{on:,.0f}", f"{on / off:.3f}",
                      f"{paired:.3f}", "met" if paired >= TARGET else "NOT met")
    console.print(table)
    console.print("paired: the median over repeats of on / off within a repeat (the two runs "
                  "back to back), which a machine's drift between repeats moves least; "
                  f"settled: from step {args.settle} on, after the trackers' start-up (their "
                  "libraries' imports and opening their runs, once a run)")


if __name__ == "__main__":
    main()
