"""The GPU check: the CUDA paths the CPU tests cannot reach, with figures, in under 8 minutes.

1. An RFT run on CUDA in bf16: `reservoir train` and `reservoir explore` (transformers engine) as
   two processes on the embedded store, the tiny model, a short warm-up, then --steps GRPO steps.
   Prints seconds per step, trainer tokens/s, peak GPU memory, held-out accuracy and the
   explorer's in-place weight updates; then the same run with `run.placement: colocated` (one
   process, one model: issue 30).
2. Trainer steps on a Qwen2.5-0.5B-shaped model built locally (random weights; vocabulary
   151,936): bf16 with chunked logprobs, the same with gradient checkpointing, and the old path
   (a vocabulary-wide float32 log_softmax) for comparison: tokens/s, seconds per step, peak memory.
   Packed against padded micro-batches on rows of 4-256 response tokens (issue 30).
3. A checkpoint restores the CUDA generator (exact resume on a GPU).
4. LoRA and PPO epochs on CUDA (issue 29): a LoRA policy (rank 8) trains grpo with 2 epochs x 2
   mini-batches in bf16 (tokens/s, peak memory, state bytes against full fine-tuning), its
   merged weights are published, and `export` writes a folder whose logits in transformers
   match the trainer's; the 0.5B-shaped step with LoRA beside the full one.
5. trainer.sharding fsdp2 on one CUDA rank (NCCL, a group of one) against the unsharded
   learner: first-step loss, tokens/s, peak memory, a sharded checkpoint, a gathered publish.

    bash bench/gpu_check.sh            # installs the carried wheels, then runs this
    python bench/gpu_check.py [--steps 30 --big-steps 4 --batch 64 --seq 320]
    python bench/gpu_check.py --device cpu --steps 3 --warmup 20 --big-steps 1 --batch 2 \
        --seq 32 --big-layers 1     # the script itself, tried on a CPU
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from reservoir.models import TinySpec, build_tiny_model, load_model
from reservoir.trainer.batch import TrainBatch, full_logprobs
from reservoir.trainer.checkpoint import load_checkpoint, save_checkpoint
from reservoir.trainer.step import PRESETS, Precision, train_step

QWEN_05B = dict(vocab_size=151_936, hidden_size=896, num_hidden_layers=24,
                num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
                max_position_embeddings=32_768, tie_word_embeddings=True)


def reservoir(*args: str, cwd: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "reservoir", *args], cwd=cwd, env=env,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def rft_run(work: Path, steps: int, warmup: int, device: str,
            placement: str = "split") -> None:
    """`reservoir train` and `reservoir explore` as two processes (split), or `reservoir run`
    of a colocated run: one process, one model."""
    model = build_tiny_model(work / "tiny", spec=TinySpec())
    config = work / f"gpu-{placement}.yaml"
    config.write_text(yaml.safe_dump({
        "run": {"name": f"gpu-{placement}", "seed": 0, "placement": placement},
        "model": {"path": str(model)},
        "tasks": {"generate": "reverse", "count": 3000, "test_fraction": 0.1},
        "explorer": {"n": 8, "batch_tasks": 32, "max_tokens": 10, "device": device,
                     "engine": "transformers"},
        "trainer": {"device": device, "dtype": "bfloat16", "lr": 2e-4, "batch_groups": 32,
                    "micro_batch": 256, "steps": steps, "eval_interval": 10,
                    "warmup_steps": warmup, "warmup_fraction": 0.3, "warmup_lr": 1e-3,
                    "checkpoint_interval": steps, "checkpoint_dir": str(work / "checkpoints")},
        "store": {"data_dir": str(work / "pg")}}))
    env = {**os.environ, "COLUMNS": "160"}
    started = time.monotonic()
    if placement == "colocated":
        processes = {"run": reservoir("run", str(config), cwd=work, env=env)}
    else:
        processes = {"train": reservoir("train", str(config), cwd=work, env=env)}
        time.sleep(5)  # the trainer creates the run and migrates the store first
        processes["explore"] = reservoir("explore", str(config), "--workers", "1", cwd=work,
                                         env=env)
    outputs = [p.communicate(timeout=330)[0] for p in processes.values()]
    wall = time.monotonic() - started
    for (name, process), output in zip(processes.items(), outputs):
        if process.returncode != 0:
            print(f"reservoir {name} failed:\n{output[-3000:]}")
            raise SystemExit(1)
    rows = query(work, config, "SELECT step, metrics FROM analytics.run_steps "
                 f"WHERE run = 'gpu-{placement}' AND step > 0 ORDER BY step")
    metrics = [json.loads(m) if isinstance(m, str) else m for _, m in rows]
    train_s = [m["train_s"] for m in metrics]
    rates = [m["train_tokens_per_s"] for m in metrics]
    peaks = [m.get("peak_memory_gib", float("nan")) for m in metrics]
    accuracy = [m["eval/accuracy"] for m in metrics if "eval/accuracy" in m]
    (per_step,), = query(work, config, "SELECT extract(epoch FROM max(created_at) - "
                         "min(created_at)) / greatest(count(*) - 1, 1) FROM analytics.run_steps "
                         f"WHERE run = 'gpu-{placement}' AND step > {warmup}")
    update = re.search(r"in-place updates: mean ([\d.]+) s, max ([\d.]+) s", outputs[-1])
    print(f"rft {placement} on {device} bf16 (tiny model): {len(metrics)} GRPO steps in "
          f"{wall:.0f} s wall (warm-up and start-up included), {float(per_step):.3f} s per GRPO "
          f"step (generation, store and training); train {sum(train_s) / len(train_s):.3f} s/step, "
          f"{sum(rates) / len(rates):,.0f} trainer tokens/s, peak {max(peaks):.2f} GiB; "
          f"held-out accuracy {accuracy[0] if accuracy else float('nan'):.2f} -> "
          f"{accuracy[-1] if accuracy else float('nan'):.2f}; explorer in-place updates "
          f"{update.group(1) + ' s mean' if update else 'none'}")


def query(work: Path, config: Path, sql: str) -> list[tuple]:
    out = subprocess.run([sys.executable, "-m", "reservoir", "sql", "--config", str(config),
                          "--format", "json", sql], cwd=work, text=True, capture_output=True)
    if out.returncode != 0:
        raise SystemExit(f"reservoir sql failed: {out.stdout}{out.stderr}")
    return [tuple(row.values()) for row in json.loads(out.stdout)]


def synthetic_batch(vocab: int, rows: int, width: int, device: torch.device) -> TrainBatch:
    ids = torch.randint(10, vocab, (rows, width), device=device)
    attention = torch.ones_like(ids)
    mask = torch.zeros(rows, width - 1, device=device)
    mask[:, width // 5:] = 1  # a fifth prompt, the rest response
    return TrainBatch(ids, attention, mask, torch.full_like(mask, float("nan")),
                      torch.rand(rows, device=device), torch.arange(rows, device=device) // 8)


def mixed_batch(vocab: int, rows: int, device: torch.device, seed: int = 0) -> TrainBatch:
    """Rows of a 32-token prompt and a response of 4-256 tokens, right-padded (issue 30)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = 32 + torch.randint(4, 257, (rows,), generator=generator)
    width = int(lengths.max())
    ids = torch.randint(10, vocab, (rows, width), generator=generator)
    attention = (torch.arange(width)[None] < lengths[:, None]).long()
    mask = torch.zeros(rows, width - 1)
    for row, length in enumerate(lengths.tolist()):
        mask[row, 31:length - 1] = 1
    return TrainBatch(ids * attention, attention, mask, torch.full_like(mask, float("nan")),
                      torch.rand(rows), torch.arange(rows) // 8).to(device)


def big_steps(steps: int, rows: int, width: int, device: torch.device, layers: int) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    shape = QWEN_05B | {"num_hidden_layers": layers}
    base = Qwen2ForCausalLM(Qwen2Config(**shape)).to(device)
    batch = synthetic_batch(QWEN_05B["vocab_size"], rows, width, device)
    tokens = float(batch.mask.sum())
    for label, options in (("bf16, chunked logprobs", dict(dtype="bfloat16")),
                           ("bf16, chunked logprobs, gradient checkpointing",
                            dict(dtype="bfloat16", checkpointing=True)),
                           ("float32, full log_softmax (before issue 9)",
                            dict(dtype="float32", full=True))):
        seconds, peak = timed_steps(base, batch, steps, **options)
        print(f"0.5B-shaped trainer ({layers} layers, {rows} x {width} tokens, {label}): "
              f"{tokens / seconds:,.0f} trained tokens/s, {seconds:.3f} s/step, "
              f"peak {peak:.1f} GiB")
    from reservoir.config import LoraConfig
    from reservoir.trainer.adapters import with_adapters

    mixed = mixed_batch(QWEN_05B["vocab_size"], rows, device)
    mixed_tokens = float(mixed.mask.sum())
    for label, packed in (("packed", 16_384), ("padded", None)):
        seconds, peak = timed_steps(base, mixed, steps, dtype="bfloat16", packed=packed)
        print(f"0.5B-shaped trainer ({layers} layers, {rows} rows, responses of 4-256 tokens, "
              f"bf16, {label}): {mixed_tokens / seconds:,.0f} trained tokens/s, "
              f"{seconds:.3f} s/step, peak {peak:.1f} GiB")
    lora = with_adapters(base, LoraConfig(rank=8), seed=0)
    seconds, peak = timed_steps(lora, batch, steps, dtype="bfloat16")
    print(f"0.5B-shaped trainer ({layers} layers, {rows} x {width} tokens, bf16, LoRA rank 8): "
          f"{tokens / seconds:,.0f} trained tokens/s, {seconds:.3f} s/step, peak {peak:.1f} GiB")


def timed_steps(model, batch: TrainBatch, steps: int, *, dtype: str, checkpointing: bool = False,
                full: bool = False, packed: int | None = None) -> tuple[float, float]:
    import reservoir.trainer.step as step_module

    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    else:
        model.gradient_checkpointing_disable()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    device = next(model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    original = step_module.token_logprobs
    if full:  # the pre-issue-9 path, for the memory comparison
        step_module.token_logprobs = (lambda m, b, t, chunk, entropy=False, packed=False:
                                      full_logprobs(m, b, t, entropy=entropy))
    try:
        times = []
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for _ in range(steps + 1):  # the first step warms up kernels and the allocator
            sync()
            started = time.perf_counter()
            train_step(model, optimizer, batch, PRESETS["grpo"], micro_batch=len(batch),
                       precision=Precision(dtype=dtype, packed_tokens=packed))
            sync()
            times.append(time.perf_counter() - started)
    finally:
        step_module.token_logprobs = original
    del optimizer
    if device.type != "cuda":
        return sum(times[1:]) / steps, float("nan")
    peak = torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.empty_cache()
    return sum(times[1:]) / steps, peak


def lora_epochs_export(work: Path, device: str, steps: int) -> None:
    """Issue 29 on the device: a LoRA learner with PPO epochs, a published version, an export."""
    from transformers import AutoModelForCausalLM

    from reservoir.config import parse_config
    from reservoir.export import export
    from reservoir.models import load_weights
    from reservoir.trainer.learner import Learner

    tiny = build_tiny_model(work / "lora-tiny")
    sides = {}
    for name, lora in (("lora rank 8", {"rank": 8}), ("full", None)):
        trainer = {"device": device, "dtype": "bfloat16", "micro_batch": 64,
                   "checkpoint_dir": str(work / "lora-ck"),
                   "algorithm": {"preset": "grpo", "epochs": 2, "mini_batches": 2}}
        config = parse_config({"run": {"name": "lora-check"}, "model": {"path": str(tiny)},
                               "trainer": trainer | ({"lora": lora} if lora else {})})
        learner = Learner(config)
        learner.begin(learner.plan[0])
        batch = synthetic_batch(len(learner.tokenizer), 64, 96, learner.device)
        batch.old_logprobs[batch.mask.bool()] = -5.0
        sync = torch.cuda.synchronize if learner.device.type == "cuda" else (lambda: None)
        if learner.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        learner.train(1, batch)
        sync()
        started = time.perf_counter()
        for step in range(steps):
            metrics = learner.train(1, batch)
        sync()
        rate = float(batch.mask.sum()) * steps / (time.perf_counter() - started)
        peak = (torch.cuda.max_memory_allocated() / 2**30 if learner.device.type == "cuda"
                else float("nan"))
        sides[name] = (learner, config, batch)
        print(f"{name} (tiny, bf16, epochs 2 x 2 mini-batches: {metrics['updates']:.0f} "
              f"updates a step): {rate:,.0f} batch tokens/s, peak {peak:.2f} GiB, clip "
              f"fraction {metrics['policy/clip_fraction']:.3f}")
    learner, config, batch = sides["lora rank 8"]
    published = learner.publish(work / "lora-v1.safetensors")
    engine, _ = load_model(tiny)
    load_weights(engine.to(learner.device), published)
    folder = export(config, learner.save(work / "lora-ck" / "lora-check", 1, 0), work / "out")
    exported = AutoModelForCausalLM.from_pretrained(folder).to(learner.device).eval()
    learner.model.eval()
    with torch.no_grad():
        ours = learner.model(input_ids=batch.input_ids).logits.float()
        gaps = [float((model(input_ids=batch.input_ids).logits.float() - ours).abs().max())
                for model in (engine.eval(), exported)]
    print(f"lora: published merged weights and the export give the trainer's logits within "
          f"{gaps[0]:.2e} / {gaps[1]:.2e}")


def fsdp2_one_rank(work: Path, device: str, steps: int) -> None:
    """trainer.sharding fsdp2 on one rank of the device (a process group of one): the first
    step's loss against the unsharded learner's, tokens/s, peak memory, a sharded checkpoint
    and a published version gathered from the shards."""
    from reservoir.config import parse_config
    from reservoir.trainer.learner import Learner
    from reservoir.trainer.ranks import TrainerPool
    from reservoir.trainer.sharding import is_sharded_checkpoint

    tiny = build_tiny_model(work / "fsdp-tiny")
    losses = {}
    for sharding in ("none", "fsdp2"):
        config = parse_config({"run": {"name": "fsdp-check"}, "model": {"path": str(tiny)},
                               "trainer": {"device": device, "dtype": "bfloat16",
                                           "micro_batch": 64, "sharding": sharding,
                                           "checkpoint_dir": str(work / f"fsdp-{sharding}")}})
        learner = Learner(config)
        with TrainerPool(config, learner) as pool:
            pool.begin_stage(learner.plan[0], lambda: pool.save(work / f"fsdp-{sharding}", 0, 0))
            batch = synthetic_batch(len(learner.tokenizer), 64, 96, learner.device)
            sync = torch.cuda.synchronize if learner.device.type == "cuda" else (lambda: None)
            if learner.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            losses[sharding] = pool.train(1, [], batch)["loss"]
            sync()
            started = time.perf_counter()
            for _ in range(steps):
                pool.train(1, [], batch)
            sync()
            rate = float(batch.mask.sum()) * steps / (time.perf_counter() - started)
            peak = (torch.cuda.max_memory_allocated() / 2**30 if learner.device.type == "cuda"
                    else float("nan"))
            checkpoint = pool.save(work / f"fsdp-{sharding}", 1 + steps, 0)
            published = pool.publish(work / f"fsdp-{sharding}.safetensors")
        print(f"sharding {sharding} (tiny, bf16, one rank): {rate:,.0f} tokens/s, peak "
              f"{peak:.2f} GiB, checkpoint sharded: {is_sharded_checkpoint(checkpoint)}, "
              f"published {published.stat().st_size:,} bytes")
    print(f"fsdp2 on one rank: first-step loss {losses['fsdp2']:.6f} against unsharded "
          f"{losses['none']:.6f} (difference {abs(losses['fsdp2'] - losses['none']):.1e})")


def cuda_rng_resumes(work: Path) -> None:
    model, _ = load_model(build_tiny_model(work / "rng-tiny"))
    model.cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    torch.cuda.manual_seed_all(5)
    torch.rand(1, device="cuda")
    path = save_checkpoint(work / "rng", 1, 0, model, optimizer)
    expected = torch.rand(4, device="cuda")
    torch.cuda.manual_seed_all(99)
    load_checkpoint(path, model, optimizer)
    same = torch.equal(torch.rand(4, device="cuda"), expected)
    print(f"checkpoint restores the CUDA generator: {'yes' if same else 'NO'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--big-steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=320)
    parser.add_argument("--warmup", type=int, default=600, help="supervised warm-up steps")
    parser.add_argument("--big-layers", type=int, default=QWEN_05B["num_hidden_layers"])
    parser.add_argument("--device", default="cuda", help="cpu tries the script itself")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: torch sees no CUDA device")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}")
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    if device.type == "cuda":
        cuda_rng_resumes(work)
    rft_run(work, args.steps, args.warmup, args.device)
    rft_run(work, args.steps, args.warmup, args.device, placement="colocated")
    lora_epochs_export(work, args.device, args.big_steps)
    fsdp2_one_rank(work, args.device, args.big_steps)
    big_steps(args.big_steps, args.batch, args.seq, device, args.big_layers)


if __name__ == "__main__":
    main()
