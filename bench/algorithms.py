"""Every preset on the reverse task, from the same warmed-up start: held-out accuracy before and
after, and minutes, in one table.

A base run trains the sft warm-up stage once; each preset then runs as a branch of it (`run.branch_from`), so all start from identical
weights with identical tasks. `sft` trains on the best response of each group the grpo branch
stored (rejection-sampling fine-tuning); `dpo` on best-vs-worst pairs of those groups
(`preference_pair_mapper`'s rule, margin 0.5), against the start weights.

    python bench/algorithms.py [--steps 40 --warmup-steps 1500 --presets grpo rloo ...]
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: nothing from a hub

import argparse  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from sqlalchemy import text  # noqa: E402

from reservoir import pool  # noqa: E402
from reservoir.config import parse_config  # noqa: E402
from reservoir.models import build_tiny_model  # noqa: E402
from reservoir.operators.preferences import PreferencePairMapper  # noqa: E402
from reservoir.store import Store  # noqa: E402
from reservoir.plan.presets import PRESETS  # noqa: E402

EXPLORER_PRESETS = [name for name in PRESETS if name not in ("sft", "dpo")]
console = Console()


def config(scratch: Path, args, name: str, stages: list, **run) -> dict:
    return {"run": {"name": name, "seed": 0, **run}, "model": {"path": str(scratch / "tiny")},
            "tasks": {"generate": "reverse", "count": 3000, "test_fraction": 0.1},
            "explorer": {"n": 8, "batch_tasks": 16, "max_tokens": 10, "reward": "exact_match"},
            "trainer": {"lr": args.lr, "batch_groups": 16, "micro_batch": 64,
                        "eval_interval": 10**6, "checkpoint_interval": 10**6,
                        "warmup_fraction": 0.3, "checkpoint_dir": str(scratch / "checkpoints")},
            "stages": stages, "store": {"url": args.db_url}}


def run(raw: dict) -> tuple[float, float, float]:
    """(accuracy at the start, at the end, minutes) of one run."""
    started = time.perf_counter()
    summary = pool.run(parse_config(raw), console=Console(quiet=True))
    return summary.accuracy[0][1], summary.accuracy[-1][1], (time.perf_counter() - started) / 60


def base(scratch: Path, args, tag: str) -> str:
    """RUN@STEP every preset branches from: the warm-up, trained once."""
    stages = [{"name": "warm-up", "algorithm": "sft", "steps": args.warmup_steps,
               "lr": 1e-3, "batch": 32, "data": "tasks"}]
    with console.status(f"warm-up: {args.warmup_steps} sft steps"):
        run(config(scratch, args, f"bench-base-{tag}", stages))
    return f"bench-base-{tag}@{args.warmup_steps}"


def stored_pairs(db_url: str | None, scratch: Path, args, run_name: str) -> int:
    """Best-vs-worst pairs (margin 0.5) of a run's groups, into `preferences`."""
    with Store.open(parse_config(config(scratch, args, run_name, [])), quiet=True) as store:
        with store.engine.connect() as conn:
            rows = conn.execute(text(
                "SELECT e.group_id, e.id, e.reward FROM experiences e JOIN runs r "
                "ON r.id = e.run_id WHERE r.name = :run"), {"run": run_name}).all()
        groups: dict = {}
        for group, row_id, reward in rows:
            groups.setdefault(group, {})[row_id] = reward
        mapper = PreferencePairMapper(min_margin=0.5)
        return store.add_pairs([(chosen, rejected, margin, "bench")
                                for scores in groups.values()
                                for chosen, rejected, margin in mapper.pairs(scores)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup-steps", type=int, default=1500)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--presets", nargs="*", default=[*EXPLORER_PRESETS, "sft", "dpo"])
    parser.add_argument("--db-url", default=None, help="default: the embedded server")
    args = parser.parse_args()
    table = Table(title=f"reverse task, {args.steps} steps from the same start")
    for column in ("algorithm", "held-out start", "held-out end", "change", "minutes"):
        table.add_column(column, justify="left" if column == "algorithm" else "right")
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        build_tiny_model(scratch / "tiny", seed=0)
        tag = time.strftime("%H%M%S")  # run names are new in a store that keeps old ones
        start = base(scratch, args, tag)
        for preset in args.presets:
            label = preset.replace("+", "p")  # run and stage names: letters, digits, . _ -
            stages = [{"name": label, "algorithm": preset, "steps": args.steps}]
            if preset == "sft":
                stages[0]["data"] = {"stored": {"runs": [f"bench-grpo-{tag}"],
                                                "status": ["consumed"], "select": "best",
                                                "where": "reward > 0.5"}}
            if preset == "dpo":
                pairs = stored_pairs(args.db_url, scratch, args, f"bench-grpo-{tag}")
                console.print(f"dpo: {pairs} pairs from the grpo branch's groups")
                stages[0] |= {"batch": 16, "lr": 1e-4,
                              "data": {"preferences": {"runs": [f"bench-grpo-{tag}"]}}}
            with console.status(f"{preset}: {args.steps} steps"):
                before, after, minutes = run(config(scratch, args, f"bench-{label}-{tag}",
                                                    stages, branch_from=start))
            table.add_row(preset, f"{before:.3f}", f"{after:.3f}", f"{after - before:+.3f}",
                          f"{minutes:.1f}")
            console.print(f"{preset}: held-out accuracy {before:.3f} -> {after:.3f} "
                          f"({after - before:+.3f}) in {minutes:.1f} min", highlight=False)
    console.print(table)


if __name__ == "__main__":
    main()
