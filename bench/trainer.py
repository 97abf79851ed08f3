"""Trainer throughput: Reservoir's step against a bare torch loop, and a pool of 2 ranks against 1.

What is compared (trained response tokens/s, and the ratio; median of repeats):

(a) step: `Learner.train` (the trainer's own step, padded as the bare loop is: make_batch from leased rows, chunked token
    logprobs, GRPO advantages, clipped token-mean loss, micro-batches, gradient clipping, AdamW)
    against a bare torch loop that does the same forward, backward and optimizer step on the
    same batches with the model's full logits and log_softmax. Target >= 0.9.
(b) pool: the same step through a TrainerPool of 2 ranks (spawned processes, gloo, each rank
    fetching the rows by id and training half of them) against one worker (workers: 1).
(c) LoRA: the step with trainer.lora (rank 8 on the attention and MLP projections) against
    full fine-tuning: the trainer's state in bytes after a step (parameters, gradients and
    AdamW's moments) and tokens/s.
(d) PPO epochs: algorithm epochs 4 (x 2 mini-batches) against 1: tokens of the batch per
    second (each of the 4 passes trains them again, plus one no-grad pass for the logprobs
    the batch starts from).
(f) packing: trainer.packing (rows back to back, micro-batches of micro_batch_tokens) against
    padded micro-batches of --micro-batch rows, on groups whose response lengths are drawn
    from 4 to 256 tokens; the first step's losses side by side (equal to ~1e-6).
(e) sharding: trainer.sharding fsdp2 at 2 ranks against the unsharded 2-rank pool: what rank 0
    holds after a step (parameters, gradients, AdamW moments: its shards, or everything) and
    tokens/s. Each repeat starts both pools afresh (one process has one process group), the
    start untimed.

Why it is fair:
- Both sides start from the same weights with the same AdamW, train the same batches in the
  same order with the same micro-batch, and their first-step losses are printed side by side.
- The bare loop's tensors are built before timing (padding, and NaN-free old logprobs): its
  figure is the model's compute alone; Reservoir's batch building counts against Reservoir.
- The sides alternate which goes first in every repeat; one untimed step each warms them up.
- Threads are what a run gives each side: all the trainer's cores to one worker, half to each
  of two ranks. The pool's start (spawning, loading the model) is timed apart, not counted.

    python bench/trainer.py [--steps 4 --groups 8 --n 8 --prompt 32 --response 64 --layers 2]
    python bench/trainer.py --shape qwen0.5b --layers 2 ...   # Qwen2.5-0.5B's widths, 2 layers
    python bench/trainer.py --db-url postgresql://postgres@127.0.0.1:5432/bench   # (b)'s store
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: nothing from a hub

import argparse  # noqa: E402
import statistics  # noqa: E402
from functools import partial  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from reservoir.config import LoraConfig, parse_config  # noqa: E402
from reservoir.models import TinySpec, build_tiny_model, load_model  # noqa: E402
from reservoir.store import Experience, Store  # noqa: E402
from reservoir.store.runs import delete_run  # noqa: E402
from reservoir.trainer.batch import TrainBatch, make_batch  # noqa: E402
from reservoir.trainer.learner import Learner  # noqa: E402
from reservoir.trainer.ranks import TrainerPool, rank_threads  # noqa: E402
from reservoir.trainer.sharding import local  # noqa: E402

CPU = torch.device("cpu")
console = Console()
NOTE = ("note: both sides share this machine's {cores} cores, so the pool cannot add compute: "
        "its ranks run {threads} torch thread(s) each where the one worker runs {single}, and "
        "it adds a row fetch and a gradient all-reduce per step. A ratio above 1 here only "
        "says that, for a model this small, separate processes use the cores better than one "
        "process's intra-op threads; the pool is meant for one GPU (or one set of cores) per "
        "rank")


def widen_vocabulary(path: Path, vocab: int) -> None:
    """Give the saved model `vocab` embedding and output rows (the tokenizer uses the first)."""
    model, _ = load_model(path)
    model.resize_token_embeddings(vocab, mean_resizing=False)
    model.save_pretrained(path)


def synthetic_groups(run: str, args, vocab: int,
                     responses: tuple[int, int] | None = None) -> list[list[Experience]]:
    """Seeded groups of n rows with rewards that differ inside each group; responses of
    --response tokens, or of lengths drawn from `responses` (low, high) row by row."""
    rng = np.random.default_rng(0)
    groups = []
    for _ in range(args.groups * (args.steps + 1)):
        prompt = rng.integers(10, vocab, args.prompt)
        rewards = rng.permutation(np.arange(args.n) % 2).astype(float)
        lengths = (rng.integers(responses[0], responses[1] + 1, args.n) if responses
                   else [args.response] * args.n)
        groups.append([Experience(
            run=run, prompt_text="p", response_text="r", prompt_ids=prompt,
            response_ids=rng.integers(10, vocab, length), reward=float(reward),
            logprobs=-rng.random(length).astype(np.float32) - 1.0)
            for reward, length in zip(rewards, lengths)])
    return groups


def bare_tensors(batch: TrainBatch) -> TrainBatch:
    """The batch as a bare loop would hold it: old logprobs 0 where nothing trains."""
    return TrainBatch(batch.input_ids, batch.attention_mask, batch.mask,
                      torch.nan_to_num(batch.old_logprobs, nan=0.0), batch.rewards,
                      batch.group_index)


def bare_step(model, optimizer, batch: TrainBatch, n: int, micro: int, clip: float) -> float:
    """GRPO with full logits: group-normalised advantages, clipped token-mean loss, AdamW."""
    rewards = batch.rewards.view(-1, n)
    advantages = ((rewards - rewards.mean(1, keepdim=True))
                  / (rewards.std(1, unbiased=False, keepdim=True) + 1e-6)).view(-1)
    total, loss_sum = batch.mask.sum(), 0.0
    optimizer.zero_grad(set_to_none=True)
    for start in range(0, len(batch), micro):
        rows = slice(start, start + micro)
        ids, mask, advantage = batch.input_ids[rows], batch.mask[rows], advantages[rows, None]
        logits = model(input_ids=ids, attention_mask=batch.attention_mask[rows]).logits
        logprobs = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])
        ratio = torch.exp(logprobs[..., 0] - batch.old_logprobs[rows])
        surrogate = torch.minimum(ratio * advantage, ratio.clamp(1 - clip, 1 + clip) * advantage)
        loss = -(surrogate * mask).sum() / total
        loss.backward()
        loss_sum += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss_sum


def measured(metrics: dict[str, float]) -> tuple[float, float]:
    return metrics["train_tokens"], metrics["loss"]


def timed(steps) -> tuple[float, list[float]]:
    """Tokens/s over the steps (each returns (tokens, loss)) and their losses."""
    started, tokens, losses = time.perf_counter(), 0.0, []
    for step in steps:
        trained, loss = step()
        tokens += trained
        losses.append(loss)
    return tokens / (time.perf_counter() - started), losses


def alternate(sides: dict, repeat: int, threads: dict[str, int]) -> dict[str, list[float]]:
    """Each side's tokens/s per repeat, the side that goes first alternating."""
    rates = {name: [] for name in sides}
    for r in range(repeat):
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            torch.set_num_threads(threads[name])
            rates[name].append(timed(sides[name]())[0])
    return rates


def step_bench(config, rows: list, args) -> dict[str, list[float]]:
    """(a) the learner's step against the bare loop, from the same weights on the same
    batches."""
    ours, bare = _learner(config), _learner(config)
    bare_optimizer = bare.optimizer
    pad, clip = ours.tokenizer.pad_token_id, ours.stage.algorithm.clip_high
    bare = bare.model
    tensors = [bare_tensors(make_batch(batch, pad)) for batch in rows]

    def reservoir_step(batch) -> tuple[float, float]:
        return measured(ours.train(1, make_batch(batch, pad)))

    def bare_loop_step(batch: TrainBatch) -> tuple[float, float]:
        loss = bare_step(bare, bare_optimizer, batch, args.n, args.micro_batch, clip)
        return float(batch.mask.sum()), loss

    def reservoir(batches):
        return [partial(reservoir_step, batch) for batch in batches]

    def bare_loop(batches):
        return [partial(bare_loop_step, batch) for batch in batches]

    first = (timed(reservoir(rows[:1]))[1][0], timed(bare_loop(tensors[:1]))[1][0])
    console.print(f"first-step loss from the same weights: reservoir {first[0]:.6f}, bare "
                  f"{first[1]:.6f}", highlight=False)
    threads = config.torch_threads("trainer")
    return alternate({"reservoir train_step": lambda: reservoir(rows[1:]),
                      "bare torch loop": lambda: bare_loop(tensors[1:])}, args.repeat,
                     {"reservoir train_step": threads, "bare torch loop": threads})


def _learner(config) -> Learner:
    """A learner in the run's first stage (the trainer's algorithm on explorers' groups)."""
    learner = Learner(config)
    learner.begin(learner.plan[0])
    return learner


def pool_bench(config, rows: list, args) -> dict[str, list[float]]:
    """(b) two ranks against one worker on the same batches, from the same weights."""
    one = config.model_copy(update={"trainer": config.trainer.model_copy(update={"workers": 1})})
    sides, threads = {}, {}
    for name, cfg in (("1 worker", one), ("2-rank pool", config)):
        learner = _learner(cfg)
        model, pad = learner.model, learner.tokenizer.pad_token_id
        started = time.perf_counter()
        pool = TrainerPool(cfg, learner)
        pool.load(learner.save(Path(tempfile.mkdtemp()), 0, 0))  # every rank in its stage
        if cfg.trainer.workers > 1:
            console.print(f"pool start (spawn, load the model, join): "
                          f"{time.perf_counter() - started:.1f}s", highlight=False)
        sides[name] = (pool, model)
        threads[name] = rank_threads(cfg)

    def steps(name, batches):
        pool = sides[name][0]
        return [partial(lambda batch: measured(pool.train(1, batch, make_batch(batch, pad))),
                        batch) for batch in batches]

    try:
        for name in sides:  # warm-up, untimed
            torch.set_num_threads(threads[name])
            timed(steps(name, rows[:1]))
        rates = alternate({name: partial(steps, name, rows[1:]) for name in sides},
                          args.repeat, threads)
    finally:
        for pool, _ in sides.values():
            pool.close()
    params = [dict(model.named_parameters()) for _, model in sides.values()]
    drift = max(float((p.detach() - params[1][name].detach()).abs().max())
                for name, p in params[0].items())
    console.print(f"weights of the two sides after the same steps differ by at most "
                  f"{drift:.2e}", highlight=False)
    console.print(NOTE.format(cores=os.cpu_count(), threads=threads["2-rank pool"],
                              single=threads["1 worker"]), highlight=False)
    return {name: rates[name] for name in ("2-rank pool", "1 worker")}


def with_trainer(config, **changes):
    return config.model_copy(update={"trainer": config.trainer.model_copy(update=changes)})


def state_bytes(learner: Learner) -> int:
    """What this rank holds for the policy after a step: parameters, gradients and the
    optimizer's state (each tensor once; a sharded one's local shards)."""
    tensors = {}
    for param in learner.model.parameters():
        tensors[local(param).data_ptr()] = local(param)
        if param.grad is not None:
            tensors[local(param.grad).data_ptr()] = local(param.grad)
    for state in learner.optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                tensors[local(value).data_ptr()] = local(value)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def state_line(title: str, sizes: dict[str, int]) -> str:
    (a, size_a), (b, size_b) = sizes.items()
    return (f"{title}: {a} {size_a / 2**20:,.1f} MiB | {b} {size_b / 2**20:,.1f} MiB | "
            f"ratio {size_a / size_b:.3f} ({a} / {b})")


def sharded_bench(config, rows: list, args) -> tuple[dict[str, list[float]], dict[str, int]]:
    """(e) fsdp2 against the unsharded pool, 2 ranks each, on the same batches from the same
    weights; rank 0's state bytes after the first (untimed) step."""
    sides = {"fsdp2": with_trainer(config, sharding="fsdp2"), "unsharded pool": config}
    rates, sizes = {name: [] for name in sides}, {}
    pad = None
    for repeat in range(args.repeat):
        for name in (list(sides) if repeat % 2 == 0 else list(sides)[::-1]):
            cfg = sides[name]
            learner = Learner(cfg)
            pad = learner.tokenizer.pad_token_id
            with TrainerPool(cfg, learner) as pool:
                folder = Path(tempfile.mkdtemp())
                pool.begin_stage(learner.plan[0], lambda: pool.save(folder, 0, 0))
                torch.set_num_threads(rank_threads(cfg))
                steps = [partial(lambda batch: measured(pool.train(1, batch,
                                                                   make_batch(batch, pad))),
                                 batch) for batch in rows]
                timed(steps[:1])
                sizes[name] = state_bytes(learner)
                rates[name].append(timed(steps[1:])[0])
    return rates, sizes


def variants_bench(sides: dict, rows: list, args, threads: int) -> dict[str, list[float]]:
    """Learners of the given configs on the same batches, from the same weights, alternating;
    each one's state bytes after its untimed first step."""
    learners = {name: _learner(config) for name, config in sides.items()}
    pad = next(iter(learners.values())).tokenizer.pad_token_id

    def steps(name, batches):
        return [partial(lambda batch: measured(learners[name].train(1, make_batch(batch, pad))),
                        batch) for batch in batches]

    for name in learners:
        torch.set_num_threads(threads)
        loss = timed(steps(name, rows[:1]))[1][0]
        console.print(f"{name}: first-step loss {loss:.7f}; trainer state "
                      f"{state_bytes(learners[name]) / 2**20:,.1f} MiB (parameters + gradients "
                      "+ AdamW moments)", highlight=False)
    sizes = {name: state_bytes(learner) for name, learner in learners.items()}
    return alternate({name: partial(steps, name, rows[1:]) for name in learners}, args.repeat,
                     dict.fromkeys(learners, threads)), sizes


def report(title: str, rates: dict[str, list[float]], target: str) -> str:
    table = Table(title=title)
    for column in ("side", "median tokens/s", "per repeat"):
        table.add_column(column)
    for name, values in rates.items():
        table.add_row(name, f"{statistics.median(values):,.0f}",
                      " ".join(f"{v:,.0f}" for v in values))
    console.print(table)
    (a, first), (b, second) = ((name, statistics.median(v)) for name, v in rates.items())
    return (f"{a} {first:,.0f} tokens/s | {b} {second:,.0f} tokens/s | ratio "
            f"{first / second:.2f}{target}")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="timed steps per repeat")
    parser.add_argument("--groups", type=int, default=8, help="groups per step")
    parser.add_argument("--n", type=int, default=8, help="rows per group")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--response", type=int, default=64, help="response tokens")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2, help="tiny model layers")
    parser.add_argument("--hidden", type=int, default=128, help="tiny model width (64 x heads)")
    parser.add_argument("--vocab", type=int, default=0, help="output layer rows (default: the "
                        "character tokenizer's few hundred; a real tokenizer's: 32k-150k)")
    parser.add_argument("--shape", choices=["tiny", "qwen0.5b"], default="tiny",
                        help="qwen0.5b: Qwen2.5-0.5B's widths (896 wide, 14 heads of 64, 2 KV "
                        "heads, MLP 4864, vocabulary 151,936) with --layers layers")
    parser.add_argument("--only", default="abcdef", help="which comparisons to run, e.g. cde")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--db-url", default=None, help="default: the embedded server")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bench-trainer-"))
    if args.shape == "qwen0.5b":
        args.hidden, args.vocab = 896, args.vocab or 151_936
        spec = TinySpec(layers=args.layers, hidden_size=896, heads=14, kv_heads=2,
                        intermediate_size=4864)
    else:
        spec = TinySpec(layers=args.layers, hidden_size=args.hidden, heads=args.hidden // 64,
                        intermediate_size=3 * args.hidden)
    model = build_tiny_model(scratch / "tiny", spec=spec)
    if args.vocab:
        widen_vocabulary(model, args.vocab)
    run = f"bench-trainer-{int(time.time())}"
    config = parse_config({
        "run": {"name": run}, "model": {"path": str(model)}, "explorer": {"n": args.n},
        "trainer": {"batch_groups": args.groups, "micro_batch": args.micro_batch, "lr": 1e-4,
                    "workers": 2, "device": "cpu", "checkpoint_dir": str(scratch / "ck"),
                    "packing": False},
        "store": {"url": args.db_url}})
    store = Store.open(config, migrate=True, quiet=True)
    try:
        store.create_run(run, group_size=args.n)
        tiny, tokenizer = load_model(model)
        store.write_groups(synthetic_groups(run, args, tokenizer.vocab_size))
        rows = [sorted(store.lease(run, groups=args.groups).rows, key=lambda row: row.id)
                for _ in range(args.steps + 1)]
        tokens = sum(float(make_batch(b, 0).mask.sum()) for b in rows[1:])
        console.print(f"{args.steps} steps of {args.groups} x {args.n} rows, {args.prompt} + "
                      f"{args.response} tokens, tiny Qwen2 {args.layers} x {args.hidden}, "
                      f"vocabulary {tiny.config.vocab_size:,}; "
                      f"{tokens:,.0f} trained tokens per repeat; {os.cpu_count()} cores",
                      highlight=False)
        lines = []
        if "a" in args.only:
            lines.append(report("(a) trainer step, tokens/s", step_bench(config, rows, args),
                                " (target >= 0.9)"))
        if "b" in args.only:
            lines.append(report("(b) trainer pool, tokens/s", pool_bench(config, rows, args),
                                " (2 ranks / 1 worker)"))
        threads = config.torch_threads("trainer")
        if "c" in args.only:
            sides = {"lora rank 8": with_trainer(config, lora=LoraConfig(rank=8)),
                     "full": config}
            rates, sizes = variants_bench(sides, rows, args, threads)
            lines += [report("(c) LoRA against full fine-tuning, tokens/s", rates,
                             " (lora / full)"),
                      state_line("(c) trainer state after a step", sizes)]
        if "d" in args.only:
            algorithm = config.trainer.algorithm.model_copy(update={"epochs": 4,
                                                                    "mini_batches": 2})
            sides = {"epochs 4 x 2 mini-batches": with_trainer(config, algorithm=algorithm),
                     "epochs 1": config}
            lines.append(report("(d) PPO epochs, batch tokens/s",
                                variants_bench(sides, rows, args, threads)[0],
                                " (4 epochs / 1)"))
        if "e" in args.only:
            rates, sizes = sharded_bench(config, rows, args)
            lines += [report("(e) fsdp2 against the unsharded pool (2 ranks), tokens/s", rates,
                             " (fsdp2 / pool)"),
                      state_line("(e) rank 0's state after a step", sizes)]
        if "f" in args.only:
            mixed = f"{run}-mixed"
            store.create_run(mixed, group_size=args.n)
            store.write_groups(synthetic_groups(mixed, args, tokenizer.vocab_size, (4, 256)))
            rows = [sorted(store.lease(mixed, groups=args.groups).rows, key=lambda row: row.id)
                    for _ in range(args.steps + 1)]
            sides = {"packed": with_trainer(config, packing=True), "padded": config}
            lines.append(report("(f) packed against padded micro-batches, responses of 4-256 "
                                "tokens, tokens/s", variants_bench(sides, rows, args, threads)[0],
                                " (packed / padded, target >= 1.5)"))
    finally:
        with store.engine.begin() as conn:
            delete_run(conn, run)
            delete_run(conn, f"{run}-mixed")
        store.close()
    for line in lines:
        print(f"trainer: {line}")


if __name__ == "__main__":
    main()
