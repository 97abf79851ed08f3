"""Reservoir's GRPO run against TRL's GRPOTrainer from the same start, per step and per second.

The same start model (the tiny Qwen2 after the same supervised warm-up), the same tasks, group
size, batch, learning rate, temperature and reward. For TRL, Reservoir sync, Reservoir sync with
dynamic sampling (`sampler: {dynamic_sampling: true}`) and Reservoir async it prints the first
step, and the seconds, at which the trailing mean reward (`--window` steps) reaches each of
`--levels`, and the ratios Reservoir / TRL (steps and seconds) measured in this same run.

The levels read the rollout reward: the mean reward of every response sampled with the policy
after s - 1 updates (TRL: the generation batch of step s; Reservoir: the experiences of policy
version s - 1, from the store, set-aside groups included). Without dynamic sampling that is the
batch reward each step trains on; with it, the batch holds only the groups whose rewards differ,
so its reward is printed too but not compared. Needs the bench extra: pip install -e '.[bench]'.

    python bench/run_vs_trl.py [--tasks reverse|addition-facts --warmup-steps N --steps N]

Warm-up and RL steps default per task (TASK_DEFAULTS).

Each side's line ends with the CPU the whole call took per step, this process's (TRL; a
colocated Reservoir run's trainer and explorer) and every other process's (the store's server,
a split run's explorers), beside its wall time per step: on a machine whose cores the steps
keep busy, the store's work is time no overlap gives back.

`--tasks sparse` measures that sparse signal does not erode what the model knows: the warm-up
teaches only single-digit addition (the known family), the RL tasks mix it (a quarter) with
two-digit multiplication the tiny model never gets right (the unknown family), so nearly every
group is flat. Each side then also prints each family's rollout reward per 25 steps.

    python bench/run_vs_trl.py --tasks sparse --steps 200 --sides sync --seeds 0 1 2
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: nothing from a hub

import argparse
import functools
import json
import math
import random
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from rich.console import Console
from sqlalchemy import text

sys.path.insert(0, str(Path(__file__).parent))

import trl_grpo  # noqa: E402
from trl_grpo import run_trl  # noqa: E402

from reservoir import pool  # noqa: E402
from reservoir.config import parse_config  # noqa: E402
from reservoir.explorer.engine import TransformersEngine  # noqa: E402
from reservoir.explorer.evaluate import accuracy  # noqa: E402
from reservoir.plan.tasks import GENERATORS  # noqa: E402
from reservoir.models import build_tiny_model, load_model  # noqa: E402
from reservoir.store import Store  # noqa: E402
from reservoir.trainer.sft import supervised  # noqa: E402

SIDES = ("trl", "sync", "dynamic", "async")
# per task (warm-up steps, RL steps): a start model whose groups mostly carry signal and RL
# steps over which the rollout reward climbs (reverse: 0.16 to ~0.35; addition facts: sampled
# reward ~0.57, 96 % of groups with signal); sparse: the known family's sampled reward ~0.96,
# so a few of its groups carry signal. A 1,500-step warm-up left reversal flat within noise
# over 60 steps and addition facts without signal (every group's rewards equal).
TASK_DEFAULTS = {"reverse": (300, 150), "addition-facts": (150, 60), "sparse": (700, 200)}
FAMILY_WINDOW = 25  # steps per mean of each task source's rollout reward


@dataclass
class Outcome:
    name: str
    seconds: list[float]        # per step: seconds since training start when it was done
    rollout: list[float]        # per step s: mean reward of the policy after s - 1 updates
    batch: list[float]          # per step: mean reward of the rows the step trained on
    wall_s: float               # the whole call, set-up included
    samples: int                # responses sampled (set-aside groups included)
    zero_variance: float        # share of sampled groups whose rewards were all equal
    extra: dict = field(default_factory=dict)  # means of a few step metrics, for the notes
    families: dict = field(default_factory=dict)  # task source -> per-step rollout reward
    accuracy: float = float("nan")  # held-out accuracy at the end (greedy)
    cpu: tuple[float, float] = (float("nan"), float("nan"))  # whole call: (this process,
                                                             # other processes) CPU seconds

    def reached(self, level: float, window: int, series: list[float] | None = None) -> int | None:
        """The first step (1-based) whose trailing `window`-step mean is >= level (a side run
        for fewer steps than `window`, the dynamic one, uses all of its steps)."""
        values = np.asarray(self.rollout if series is None else series, dtype=float)
        window = min(window, len(values))
        for i in range(window - 1, len(values)):
            chunk = values[i - window + 1:i + 1]
            if np.isfinite(chunk).any() and np.nanmean(chunk) >= level:
                return i + 1
        return None


def addition_facts(repeats: int, *, seed: int = 0, test_fraction: float = 0.1) -> list[dict]:
    """Every single-digit fact 'a+b' -> a+b: the train facts, each `repeats` times, in seeded
    shuffled order, then the held-out facts (a seeded tenth) once each. The warm-up reads the
    first 30 % of the train rows, which hold nearly every train fact a few times: the start
    model half knows them (sampled reward ~0.57 after 150 warm-up steps), and RL sharpens it.
    In systematic order (0+0, 0+1, ...) the warm-up saw only a < 3 and every group of the
    facts after it was flat: the model answered them wrong every time."""
    rng = random.Random(seed)
    facts = [(a, b) for a in range(10) for b in range(10)]
    held_out = set(rng.sample(facts, round(len(facts) * test_fraction)))

    def row(a: int, b: int, split: str) -> dict:
        return {"prompt": f"{a}+{b}", "answer": str(a + b), "split": split,
                "source": "addition-facts"}

    train = [row(a, b, "train") for a, b in facts if (a, b) not in held_out
             for _ in range(repeats)]
    rng.shuffle(train)
    return train + [row(a, b, "test") for a, b in sorted(held_out)]


def sparse_split(rl_rows: int, *, known_share: float = 0.25, seed: int = 0) -> list[dict]:
    """A known family the warm-up teaches and an unknown one it never sees. Train rows: first
    the warm-up's (3/7 of `rl_rows`: the 100 single-digit facts 'a+b' in shuffled rounds, the
    first 30 % of the train rows, which is what the bench's warm-up reads), then `rl_rows` RL
    tasks in shuffled order, `known_share` of them those facts again (source 'known'), the
    rest 'a*b' of two-digit numbers (source 'unknown': answered wrong, so flat groups); then
    a few test rows of each."""
    rng = random.Random(seed)
    facts = [(a, b) for a in range(10) for b in range(10)]

    def known(a: int, b: int, split: str = "train") -> dict:
        return {"prompt": f"{a}+{b}", "answer": str(a + b), "split": split, "source": "known"}

    def unknown(a: int, b: int, split: str = "train") -> dict:
        return {"prompt": f"{a}*{b}", "answer": str(a * b), "split": split, "source": "unknown"}

    warm_rows = rl_rows * 3 // 7
    warm = []
    while len(warm) < warm_rows:
        warm += [known(a, b) for a, b in rng.sample(facts, len(facts))]
    n_known = round(rl_rows * known_share)
    products = rng.sample([(a, b) for a in range(10, 100) for b in range(10, 100)],
                          rl_rows - n_known + 20)
    rl = ([known(*rng.choice(facts)) for _ in range(n_known)]
          + [unknown(a, b) for a, b in products[:rl_rows - n_known]])
    rng.shuffle(rl)
    test = [known(a, b, "test") for a, b in rng.sample(facts, 20)] + \
        [unknown(a, b, "test") for a, b in products[rl_rows - n_known:]]
    return warm[:warm_rows] + rl + test


def task_set(args) -> list[dict]:
    if args.tasks == "reverse":
        return GENERATORS["reverse"](3000, seed=0, test_fraction=0.1)
    if args.tasks == "sparse":
        return sparse_split(3500)
    return addition_facts(max(8, math.ceil(args.steps * args.batch_groups / 63)))


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


STEPS = text("SELECT t.step, extract(epoch FROM t.created_at - s.created_at), t.metrics "
             "FROM train_steps t JOIN runs r ON r.id = t.run_id JOIN train_steps s "
             "ON s.run_id = r.id AND s.step = 0 WHERE r.name = :run AND t.step > 0 "
             "ORDER BY t.step")
# one row per sampled group: its policy version, reward sum, responses, all rewards equal
GROUPS = text("SELECT e.policy_version, sum(e.reward), count(*), min(e.reward) = max(e.reward) "
              "FROM experiences e JOIN runs r ON r.id = e.run_id WHERE r.name = :run "
              "GROUP BY e.policy_version, e.group_id")
# per policy version and task source: the mean reward of its responses
FAMILIES = text("SELECT e.policy_version, coalesce(t.source, ''), avg(e.reward) "
                "FROM experiences e JOIN runs r ON r.id = e.run_id "
                "JOIN tasks t ON t.id = e.task_id WHERE r.name = :run "
                "GROUP BY e.policy_version, t.source")


def run_reservoir(side: str, model: Path, task_file: Path, scratch: Path, args) -> Outcome:
    mode = "async" if side == "async" else "sync"
    steps = args.dynamic_steps if side == "dynamic" and args.dynamic_steps else args.steps
    name = f"bench-{side}-{uuid.uuid4().hex[:6]}"
    config = parse_config({
        "run": {"name": name, "mode": mode, "seed": args.seed, "placement": args.placement},
        "model": {"path": str(model)},
        "tasks": {"file": str(task_file)},
        "explorer": {"n": args.n, "batch_tasks": args.batch_groups, "max_tokens": args.max_tokens,
                     "temperature": 1.0, "workers": 1},
        "trainer": {"lr": args.lr, "batch_groups": args.batch_groups,
                    "micro_batch": args.n * args.batch_groups, "steps": steps,
                    "eval_interval": 10 * args.steps, "checkpoint_interval": 10 * args.steps,
                    "checkpoint_dir": str(scratch / "checkpoints")},
        "sampler": {"max_staleness": 1 if mode == "async" else None,
                    "dynamic_sampling": side == "dynamic"},
        "store": {"url": args.db_url}})
    started = time.perf_counter()
    summary = pool.run(config, console=Console(quiet=True))
    wall_s = time.perf_counter() - started
    with Store.open(config, quiet=True, migrate=True) as store, store.engine.connect() as conn:
        step_rows = conn.execute(STEPS, {"run": name}).all()
        groups = conn.execute(GROUPS, {"run": name}).all()
        by_family = conn.execute(FAMILIES, {"run": name}).all()
    families: dict[str, list[float]] = {}
    for version, source, reward in by_family:
        if version < steps:
            families.setdefault(source, [float("nan")] * steps)[version] = float(reward)
    metrics = [row[2] if isinstance(row[2], dict) else json.loads(row[2]) for row in step_rows]
    totals: dict[int, float] = {}
    counts: dict[int, int] = {}
    for version, total, count, _ in groups:
        totals[version] = totals.get(version, 0.0) + float(total)
        counts[version] = counts.get(version, 0) + count
    rollout = [totals[v] / counts[v] if v in counts else float("nan") for v in range(steps)]
    # over the steps that report them (a step whose rows all lacked signal trains none)
    extra = {key: float(np.mean([m[key] for m in metrics if key in m])) for key in
             ("policy/clip_fraction", "policy/ratio_mean", "dynamic/set_aside_groups",
              "rows_without_signal") if any(key in m for m in metrics)}
    label = {"dynamic": "sync+dynamic"}.get(side, side)
    return Outcome(f"reservoir {label} {args.placement}", [float(row[1]) for row in step_rows], rollout,
                   [float(m["reward_mean"]) for m in metrics], wall_s,
                   sum(count for _, _, count, _ in groups),
                   float(np.mean([flat for *_, flat in groups])), extra, families,
                   summary.accuracy[-1][1])


def run_trl_side(model: Path, train: list[dict], test: list[dict], scratch: Path,
                 args) -> Outcome:
    # each call of the reward (one per step: one generation a step) records each task
    # source's mean reward, the prompt's source read from its text
    source_of = {t["prompt"]: t.get("source") or "" for t in train}
    calls: list[dict[str, float]] = []
    scored = trl_grpo.exact_match

    @functools.wraps(scored)
    def recording(completions, answer, prompts=None, **kwargs):
        rewards = scored(completions, answer, **kwargs)
        per: dict[str, list[float]] = {}
        for prompt, reward in zip(prompts, rewards):
            per.setdefault(source_of.get(prompt[-1]["content"], ""), []).append(reward)
        calls.append({source: float(np.mean(values)) for source, values in per.items()})
        return rewards

    started = time.perf_counter()
    trl_grpo.exact_match = recording
    try:
        result = run_trl(model, [t["prompt"] for t in train], [t["answer"] for t in train],
                         n=args.n, batch_groups=args.batch_groups, lr=args.lr,
                         temperature=1.0, max_tokens=args.max_tokens, steps=args.steps,
                         seed=args.seed, out_dir=scratch / "trl")
    finally:
        trl_grpo.exact_match = scored
    wall_s = time.perf_counter() - started
    rewards = [reward for _, _, reward in result.curve]
    families = {source: [call.get(source, float("nan")) for call in calls]
                for source in dict.fromkeys(s for call in calls for s in call)}
    tokenizer = load_model(model)[1]
    scoring = parse_config({"tasks": {"generate": "reverse"},
                            "explorer": {"max_tokens": args.max_tokens}})
    held_out = accuracy(TransformersEngine.of(result.model.eval(), tokenizer),
                        [(None, t["prompt"], t["answer"], {}) for t in test], scoring)
    return Outcome("trl GRPOTrainer", [s for s, _, _ in result.curve], rewards, rewards,
                   wall_s, result.samples,
                   float(np.mean(result.zero_std)) if result.zero_std else float("nan"),
                   families=families, accuracy=held_out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", choices=("reverse", "addition-facts", "sparse"),
                        default="reverse")
    parser.add_argument("--steps", type=int, default=None,
                        help="RL steps; default per task (TASK_DEFAULTS)")
    parser.add_argument("--levels", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.4, 0.5])
    parser.add_argument("--window", type=int, default=10, help="steps in the trailing mean")
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    parser.add_argument("--dynamic-steps", type=int, default=None,
                        help="RL steps of the dynamic-sampling side (default --steps): with most "
                        "groups flat each of its steps samples many groups")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--batch-groups", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=10)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--warmup-steps", type=int, default=None,
                        help="supervised warm-up steps; default per task (TASK_DEFAULTS)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="seeds of the RL runs, each side once per seed (the start model "
                        "is the same for every seed); the means follow")
    parser.add_argument("--placement", choices=("split", "colocated"), default="colocated",
                        help="run.placement of Reservoir's sides")
    parser.add_argument("--db-url", default=None, help="default: the embedded server")
    args = parser.parse_args()
    warmup_steps, steps = TASK_DEFAULTS[args.tasks]
    args.warmup_steps = warmup_steps if args.warmup_steps is None else args.warmup_steps
    args.steps = steps if args.steps is None else args.steps
    sides = ["trl"] + [side for side in SIDES[1:] if side in args.sides]  # TRL: the baseline
    console = Console()
    rows = task_set(args)
    train = [row for row in rows if row["split"] == "train"]
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        with console.status(f"supervised warm-up ({args.warmup_steps} steps)"):
            model = start_model(scratch, train, args)
        rl_tasks = train[int(len(train) * 0.3):]  # after what the warm-up drew from
        task_file = scratch / "tasks.jsonl"
        task_file.write_text("".join(json.dumps(row) + "\n" for row in
                                     rl_tasks + [r for r in rows if r["split"] == "test"]))
        test = [row for row in rows if row["split"] == "test"]
        outcomes: dict[str, list[tuple[Outcome, Outcome]]] = {}
        for seed in args.seeds:
            args.seed = seed
            header(console, args)
            trl = None
            for side in sides:
                with console.status(f"seed {seed}, {side}: {args.steps} steps"):
                    outcome = measured(
                        lambda: run_trl_side(model, rl_tasks, test, scratch, args)
                        if side == "trl" else run_reservoir(side, model, task_file, scratch, args))
                trl = trl or outcome
                report(console, outcome, trl, args)  # each side as it ends: none is lost
                outcomes.setdefault(outcome.name, []).append((outcome, trl))
        means(console, outcomes, args)


def cpu_seconds() -> tuple[float, float]:
    """(this process's CPU seconds, every process's busy CPU seconds: /proc/stat's user, nice,
    system, irq, softirq and steal; NaN where there is no /proc)."""
    mine = sum(os.times()[:2])
    try:
        with open("/proc/stat") as stat:
            ticks = [int(value) for value in stat.readline().split()[1:9]]
    except OSError:
        return mine, float("nan")
    return mine, sum(ticks[i] for i in (0, 1, 2, 5, 6, 7)) / os.sysconf("SC_CLK_TCK")


def measured(call) -> Outcome:
    """The side's outcome with the CPU its whole call took: (this process, the others)."""
    mine, busy = cpu_seconds()
    outcome = call()
    mine_after, busy_after = cpu_seconds()
    outcome.cpu = (mine_after - mine, (busy_after - busy) - (mine_after - mine))
    return outcome


def _say(console: Console, line: str) -> None:
    console.print(line, highlight=False, markup=False, soft_wrap=True)


def header(console: Console, args) -> None:
    _say(console, f"# {args.tasks}, warm-up {args.warmup_steps} steps, {args.steps} RL steps of "
         f"{args.batch_groups} groups x {args.n}, max_tokens {args.max_tokens}, lr {args.lr}, "
         f"seed {args.seed}")
    _say(console, f"# levels {' '.join(map(str, args.levels))}: the first step (and its seconds) at "
         f"which the trailing {args.window}-step mean ROLLOUT reward (every response of the "
         "policy after s-1 updates) reaches each; '-': never")


def final_level(trl: Outcome, window: int) -> float:
    """TRL's rollout reward at its end: the mean of its last `window` steps."""
    return float(np.nanmean(trl.rollout[-window:]))


def to_final_level(outcome: Outcome, trl: Outcome, window: int) -> tuple[float | None, float]:
    """(seconds this side took to reach TRL's final rollout-reward level, None: never; the
    seconds TRL took)."""
    level = final_level(trl, window)
    mine, theirs = outcome.reached(level, window), trl.reached(level, window)
    return (None if mine is None else outcome.seconds[mine - 1]), trl.seconds[theirs - 1]


def means(console: Console, outcomes: dict[str, list[tuple[Outcome, Outcome]]], args) -> None:
    """Per side, over the seeds: samples/s, seconds to TRL's final rollout-reward level and
    their ratio to TRL's, held-out accuracy at the end."""
    window = args.window
    _say(console, f"# means over seeds {' '.join(map(str, args.seeds))} ({args.tasks}; "
         f"Reservoir {args.placement}): samples/s | seconds to TRL's final rollout-reward level "
         f"(trailing {window}-step mean), ratio to TRL's | held-out accuracy at the end")
    for name, pairs in outcomes.items():
        rates = [o.samples / o.seconds[-1] for o, _ in pairs]
        reached = [to_final_level(o, trl, window) for o, trl in pairs]
        ratios = [mine / theirs for mine, theirs in reached if mine is not None]
        seconds = [mine for mine, _ in reached if mine is not None]
        late = len(reached) - len(ratios)
        _say(console, f"{name:24} samples/s {np.mean(rates):7.0f} | to TRL's final level "
             f"{np.mean(seconds) if seconds else float('nan'):6.1f} s, ratio "
             f"{np.mean(ratios) if ratios else float('nan'):.2f} "
             f"(per seed {' '.join(f'{r:.2f}' for r in ratios)}"
             f"{f'; never in {late}' if late else ''}) | held-out accuracy "
             f"{np.mean([o.accuracy for o, _ in pairs]):.3f} "
             f"(per seed {' '.join(f'{o.accuracy:.2f}' for o, _ in pairs)})")
        if args.tasks == "sparse" and pairs[0][0] is not pairs[0][1]:
            _say(console, f"{name:24} {known_family_gaps(pairs)}")


def known_family_gaps(pairs: list[tuple[Outcome, Outcome]], limit: float = 0.05) -> str:
    """The known family's rollout reward against TRL's, window by window (FAMILY_WINDOW steps)
    over every seed: the worst difference and how many windows fall more than `limit` below."""
    gaps = []
    for outcome, trl in pairs:
        mine, theirs = outcome.families.get("known", []), trl.families.get("known", [])
        for i in range(0, min(len(mine), len(theirs)), FAMILY_WINDOW):
            gaps.append(np.nanmean(mine[i:i + FAMILY_WINDOW]) -
                        np.nanmean(theirs[i:i + FAMILY_WINDOW]))
    below = sum(gap < -limit for gap in gaps)
    return (f"known family against TRL per {FAMILY_WINDOW} steps: worst {min(gaps):+.2f}, "
            f"mean {np.mean(gaps):+.2f}; {below} of {len(gaps)} windows more than {limit} below")


def _cells(values) -> str:
    return " ".join(f"{'-' if value is None else value:>6}" for value in values)


def report(console: Console, outcome: Outcome, trl: Outcome, args) -> None:
    """One side's lines: steps and seconds to each level, its curve, and its ratios to TRL."""
    window, levels = args.window, args.levels
    at = [outcome.reached(level, window) for level in levels]
    _say(console, f"{outcome.name + ' steps':42} {_cells(at)}")
    _say(console, f"{outcome.name + ' seconds':42} "
         f"{_cells(None if s is None else f'{outcome.seconds[s - 1]:.1f}' for s in at)}")
    if outcome.batch != outcome.rollout:  # dynamic sampling: the trained groups' reward
        _say(console, f"{outcome.name + ' batch-reward steps':42} "
             f"{_cells(outcome.reached(level, window, outcome.batch) for level in levels)}"
             "  (the trained groups only: not compared)")
    blocks = " ".join(f"{np.nanmean(outcome.rollout[i:i + window]):.2f}"
                      for i in range(0, len(outcome.rollout), window))
    notes = " ".join(f"{key} {value:.3f}" for key, value in outcome.extra.items())
    _say(console, f"{outcome.name}: {len(outcome.rollout)} steps, rollout reward per {window}: "
         f"{blocks} | zero-variance "
         f"groups {outcome.zero_variance:.0%} | {outcome.samples} samples, "
         f"{outcome.samples / outcome.seconds[-1]:.0f}/s | training {outcome.seconds[-1]:.1f} s, "
         f"whole call {outcome.wall_s:.1f} s{' | ' + notes if notes else ''}")
    steps = len(outcome.rollout)
    _say(console, f"{outcome.name + ' CPU per step':42} this process "
         f"{1000 * outcome.cpu[0] / steps:.0f} ms, other processes "
         f"{1000 * outcome.cpu[1] / steps:.0f} ms, wall {1000 * outcome.wall_s / steps:.0f} ms "
         f"(whole call, {os.cpu_count()} cores)")
    shown = outcome.families if len(outcome.families) > 1 else {}
    for source, series in sorted(shown.items()):
        per = " ".join(f"{np.nanmean(series[i:i + FAMILY_WINDOW]):.2f}"
                       for i in range(0, len(series), FAMILY_WINDOW))
        _say(console, f"{outcome.name + ' ' + (source or '-') + ' per ' + str(FAMILY_WINDOW):42} "
             f"{per}")
    if outcome is trl:
        return
    if len(outcome.rollout) < window:
        _say(console, f"{'ratio ' + outcome.name + ' / trl':42} n/a: fewer steps than the window")
        return
    theirs = [trl.reached(level, window) for level in levels]
    steps = [f"{mine / their:.2f}" if mine and their else None
             for mine, their in zip(at, theirs)]
    seconds = [f"{outcome.seconds[mine - 1] / trl.seconds[their - 1]:.2f}" if mine and their
               else None for mine, their in zip(at, theirs)]
    _say(console, f"{'ratio ' + outcome.name + ' / trl':42} {_cells(steps)}  steps | seconds: "
         f"{_cells(seconds)}")


if __name__ == "__main__":
    main()
