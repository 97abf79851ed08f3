"""A LoRA policy's new versions in vLLM: merged into the base and reloaded in place (what the
explorer does) against vLLM's own LoRA support (a new adapter per version).

For each of --versions versions of rank-8 adapters (random, seeded; the same on both sides):
- merge + reload: the trainer's published file (base + alpha / r x B A, `Learner.publish`) into
  `VLLMEngine.load_weights`, then the generation;
- vLLM LoRA: an engine built with `enable_lora`, the version's peft adapter folder as a new
  `LoRARequest`, then the same generation (its first call loads the adapter).
Printed: seconds to take a version (the reload; the adapter's load, measured as its first
generation less a second one), generated tokens/s, and the ratios. Both sides sample the same
prompts with the same seeds; the engines run one after the other (one at a time fits the cores).

    .venv-vllm/bin/python bench/vllm_lora.py [--versions 4 --prompts 32 --n 4 --tokens 32 --heads 2]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import argparse  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from reservoir.config import parse_config  # noqa: E402
from reservoir.explorer.engine import Request, chat_ids  # noqa: E402
from reservoir.explorer.vllm_engine import MAX_SEQUENCES, VLLMEngine, kv_cache_bytes  # noqa: E402
from reservoir.models import TinySpec, build_tiny_model  # noqa: E402
from reservoir.trainer.learner import Learner  # noqa: E402


def versions(base: Path, scratch: Path, count: int, rank: int) -> list[tuple[Path, Path]]:
    """(merged weights file, adapter folder) of each version: the adapters' B drawn anew."""
    config = parse_config({"model": {"path": str(base)},
                           "trainer": {"lora": {"rank": rank}, "device": "cpu"}})
    learner, made = Learner(config), []
    generator = torch.Generator().manual_seed(0)
    for version in range(count):
        with torch.no_grad():
            for name, param in learner.model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
        adapter = scratch / f"adapter-v{version}"
        learner.model.save_pretrained(adapter)
        made.append((learner.publish(scratch / f"v{version}.safetensors"), adapter))
    return made


def requests(base: Path, args) -> list[Request]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base, local_files_only=True)
    return [Request(chat_ids(tokenizer, f"Reverse: {'abcdefghij'[:3 + i % 7]}{i}"), args.n,
                    1.0, args.tokens) for i in range(args.prompts)]


def tokens_of(outputs) -> int:
    return sum(len(sample.response_ids) for group in outputs for sample in group)


def merged_side(base: Path, made, batch, args) -> tuple[list[float], list[float]]:
    engine = VLLMEngine(base, device="cpu", gpu_memory_utilization=0.1, seed=0)
    updates, rates = [], []
    try:
        engine.generate(batch, seed=0)  # warm-up
        for version, (weights, _) in enumerate(made):
            started = time.perf_counter()
            engine.load_weights(weights)
            updates.append(time.perf_counter() - started)
            started = time.perf_counter()
            found = tokens_of(engine.generate(batch, seed=version))
            rates.append(found / (time.perf_counter() - started))
    finally:
        engine.close()
    return updates, rates


def lora_side(base: Path, made, batch, args) -> tuple[list[float], list[float]]:
    from transformers import AutoConfig
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.lora.request import LoRARequest

    config = AutoConfig.from_pretrained(base, local_files_only=True)
    llm = LLM(str(base), dtype="float32", seed=0, max_num_seqs=MAX_SEQUENCES,
              enforce_eager=True, distributed_executor_backend="mp", generation_config="vllm",
              kv_cache_memory_bytes=kv_cache_bytes(config, "float32", 0.1, MAX_SEQUENCES),
              logprobs_mode="processed_logprobs", disable_log_stats=True, enable_lora=True,
              max_lora_rank=args.rank, max_loras=1)
    prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in batch]

    def generate(adapter, seed: int) -> tuple[int, float]:
        params = SamplingParams(n=args.n, temperature=1.0, top_p=1.0, top_k=0,
                                max_tokens=args.tokens, logprobs=0, seed=seed,
                                detokenize=False)
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, lora_request=adapter, use_tqdm=False)
        return (sum(len(c.token_ids) for o in outputs for c in o.outputs),
                time.perf_counter() - started)

    updates, rates = [], []
    try:
        generate(None, 0)  # warm-up
        for version, (_, folder) in enumerate(made):
            adapter = LoRARequest(f"v{version}", version + 1, str(folder))
            _, first = generate(adapter, version)      # loads the adapter, then generates
            tokens, seconds = generate(adapter, version)
            updates.append(max(0.0, first - seconds))
            rates.append(tokens / seconds)
    finally:
        llm.llm_engine.engine_core.shutdown()
    return updates, rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--heads", type=int, default=2, help="tiny model width: 64 x heads")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bench-vllm-lora-"))
    spec = TinySpec(hidden_size=64 * args.heads, heads=args.heads,
                    intermediate_size=3 * 64 * args.heads)
    base = build_tiny_model(scratch / "tiny", spec=spec)
    made = versions(base, scratch, args.versions, args.rank)
    batch = requests(base, args)
    merged = merged_side(base, made, batch, args)
    lora = lora_side(base, made, batch, args)
    (merge_s, merge_rate), (lora_s, lora_rate) = map(
        lambda side: (statistics.median(side[0]), statistics.median(side[1])), (merged, lora))
    print(f"vllm lora: tiny model {spec.hidden_size} wide, rank {args.rank}, {args.versions} "
          f"versions, {args.prompts} prompts x {args.n} samples x {args.tokens} tokens; medians")
    print(f"vllm lora: taking a version: merge + reload {merge_s:.3f} s | LoRA adapter "
          f"{lora_s:.3f} s | ratio {lora_s / merge_s:.2f} (lora / reload)")
    print(f"vllm lora: generation: merged {merge_rate:,.0f} tokens/s | LoRA {lora_rate:,.0f} "
          f"tokens/s | ratio {lora_rate / merge_rate:.2f} (lora / merged)")


if __name__ == "__main__":
    main()
