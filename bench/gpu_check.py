"""The GPU check: the CUDA paths the CPU tests cannot reach, with figures, in under 8 minutes.

1. An RFT run on CUDA in bf16: `reservoir train` and `reservoir explore` (transformers engine) as
   two processes on the embedded store, the tiny model, a short warm-up, then --steps GRPO steps.
   Prints seconds per step, trainer tokens/s, peak GPU memory, held-out accuracy and the
   explorer's in-place weight updates.
2. Trainer steps on a Qwen2.5-0.5B-shaped model built locally (random weights; vocabulary
   151,936): bf16 with chunked logprobs, the same with gradient checkpointing, and the old path
   (a vocabulary-wide float32 log_softmax) for comparison: tokens/s, seconds per step, peak memory.
3. A checkpoint restores the CUDA generator (exact resume on a GPU).

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


def rft_run(work: Path, steps: int, warmup: int, device: str) -> None:
    model = build_tiny_model(work / "tiny", spec=TinySpec())
    config = work / "gpu.yaml"
    config.write_text(yaml.safe_dump({
        "run": {"name": "gpu-check", "seed": 0}, "model": {"path": str(model)},
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
    trainer = reservoir("train", str(config), cwd=work, env=env)
    time.sleep(5)  # the trainer creates the run and migrates the store first
    explorer = reservoir("explore", str(config), "--workers", "1", cwd=work, env=env)
    outputs = [p.communicate(timeout=330)[0] for p in (trainer, explorer)]
    wall = time.monotonic() - started
    for name, process, output in zip(("train", "explore"), (trainer, explorer), outputs):
        if process.returncode != 0:
            print(f"reservoir {name} failed:\n{output[-3000:]}")
            raise SystemExit(1)
    rows = query(work, config, "SELECT step, metrics FROM analytics.run_steps "
                 "WHERE run = 'gpu-check' AND step > 0 ORDER BY step")
    metrics = [json.loads(m) if isinstance(m, str) else m for _, m in rows]
    train_s = [m["train_s"] for m in metrics]
    rates = [m["train_tokens_per_s"] for m in metrics]
    peaks = [m.get("peak_memory_gib", float("nan")) for m in metrics]
    accuracy = [m["eval/accuracy"] for m in metrics if "eval/accuracy" in m]
    update = re.search(r"in-place updates: mean ([\d.]+) s, max ([\d.]+) s", outputs[1])
    print(f"rft on {device} bf16 (tiny model): {len(metrics)} GRPO steps in {wall:.0f} s wall "
          f"(warm-up and start-up included); train {sum(train_s) / len(train_s):.3f} s/step, "
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
        print(f"0.5B-shaped trainer ({layers} layers, {rows} x {width} tokens, {label}): {tokens / seconds:,.0f} "
              f"trained tokens/s, {seconds:.3f} s/step, peak {peak:.1f} GiB")


def timed_steps(model, batch: TrainBatch, steps: int, *, dtype: str,
                checkpointing: bool = False, full: bool = False) -> tuple[float, float]:
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
        step_module.token_logprobs = lambda m, b, t, chunk: full_logprobs(m, b, t)
    try:
        times = []
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for _ in range(steps + 1):  # the first step warms up kernels and the allocator
            sync()
            started = time.perf_counter()
            train_step(model, optimizer, batch, PRESETS["grpo"], micro_batch=len(batch),
                       precision=Precision(dtype=dtype))
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
    big_steps(args.big_steps, args.batch, args.seq, device, args.big_layers)


if __name__ == "__main__":
    main()
