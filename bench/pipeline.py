"""A pipeline through the store against Data-Juicer alone, on the same rows, in one run.

10,000+ experience rows (groups of 4, with duplicates, zero-variance groups, empty and
repetitive responses) go through clean (whitespace normalisation, length and repetition
filters) + dedup + group variance:

- reservoir: `run_pipeline`: select from the store, the operators one at a time with every
  decision attributed, validation-free write-back of statuses and operator events, one
  transaction;
- data-juicer alone: the same operators, same arguments, on the same rows already in memory,
  one `NestedDataset.process` call.

Prints rows/s for each and the ratio (target >= 0.7).

    python bench/pipeline.py [--rows 10000 --repeat 3 --db-url postgresql://...]
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

import numpy as np
from rich.console import Console
from sqlalchemy import text

from reservoir.config import ReservoirConfig, StoreConfig
from reservoir.pipeline.bridge import build_steps
from reservoir.pipeline.runner import _to_dataset_row, run_pipeline
from reservoir.pipeline.spec import parse_pipeline
from reservoir.store import Experience, Store
from reservoir.store.source import Source, select_rows

PROCESS = [
    {"whitespace_normalization_mapper": {}},
    {"text_length_filter": {"min_len": 2, "max_len": 400}},
    {"character_repetition_filter": {"rep_len": 10, "max_ratio": 0.5}},
    {"document_deduplicator": {"lowercase": True}},
    {"group_variance_filter": {}},
]
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def groups(run: str, n_rows: int, seed: int = 0) -> list[list[Experience]]:
    rng = np.random.default_rng(seed)
    out = []
    for g in range(n_rows // 4):
        rewards = [1.0] * 4 if g % 10 == 0 else [float(x) for x in rng.integers(0, 2, 4)]
        if len(set(rewards)) == 1 and g % 10:
            rewards[0] = 1.0 - rewards[0]
        group = []
        for i in range(4):
            words = rng.choice(WORDS, size=int(rng.integers(3, 30)))
            body = "x" * 200 if (g * 4 + i) % 97 == 0 else " ".join(words)  # repetitive
            if (g * 4 + i) % 50 == 0:
                body = "the same answer"  # duplicates across groups
            group.append(Experience(
                run=run, policy_version=0, prompt_text=f"task {g}", response_text=body,
                prompt_ids=rng.integers(0, 100, 8), response_ids=rng.integers(0, 100, 16),
                logprobs=-rng.random(16).astype(np.float32), reward=rewards[i],
                reward_components={"accuracy": rewards[i]}))
        out.append(group)
    return out


def reset(store: Store, run_id: int) -> None:
    with store.engine.begin() as conn:
        conn.execute(text("DELETE FROM operator_events WHERE experience_id IN "
                          "(SELECT id FROM experiences WHERE run_id = :r)"), {"r": run_id})
        conn.execute(text("UPDATE experiences SET status = 'raw', priority = 0 "
                          "WHERE run_id = :r"), {"r": run_id})


def data_juicer_alone(rows: list[dict]) -> float:
    from data_juicer.core.data import NestedDataset

    steps = build_steps([next(iter(step.items())) for step in PROCESS], "response_text")
    dataset = NestedDataset.from_list(rows)
    started = time.perf_counter()
    dataset.process([step.op for step in steps], open_monitor=False).to_list()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--db-url", default=None, help="default: the embedded server")
    args = parser.parse_args()
    console = Console()
    run = f"bench-pipeline-{uuid.uuid4().hex[:6]}"
    spec = parse_pipeline({"name": "bench", "source": {"runs": [run], "status": ["raw"]},
                           "process": PROCESS})
    with Store.open(ReservoirConfig(store=StoreConfig(url=args.db_url)), quiet=True,
                    migrate=True) as store:
        run_id = store.create_run(run, group_size=4)
        with console.status(f"writing {args.rows:,} rows"):
            store.write_groups(groups(run, args.rows), status="raw")
        rows = [_to_dataset_row(r) for r in select_rows(
            store.url, Source(run_ids=[run_id], statuses=["raw"]))]
        ours, theirs, kept = [], [], None
        for repeat in range(args.repeat):
            with console.status(f"repeat {repeat + 1}/{args.repeat}"):
                reset(store, run_id)
                started = time.perf_counter()
                result = run_pipeline(store, spec)
                ours.append(time.perf_counter() - started)
                theirs.append(data_juicer_alone(rows))
                kept = result.rows_out
        with store.engine.begin() as conn:
            conn.execute(text("DELETE FROM runs WHERE id = :r"), {"r": run_id})
    mine, alone = statistics.median(ours), statistics.median(theirs)
    console.print(f"# {len(rows):,} rows, {kept:,} kept; clean + dedup + group variance; "
                  f"medians of {args.repeat}", highlight=False)
    console.print(f"pipeline: reservoir {len(rows) / mine:,.0f} rows/s (store -> data-juicer -> "
                  f"store, every decision recorded) | data-juicer alone {len(rows) / alone:,.0f} "
                  f"rows/s (in memory) | ratio {alone / mine:.2f} (target >= 0.7)", highlight=False)


if __name__ == "__main__":
    main()
