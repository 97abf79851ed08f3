"""TRL's side of the GRPO comparison: the same tiny model, tasks and reward under TRL's GRPOTrainer.

`run_trl` trains with `trl.GRPOTrainer` (trl==1.16.0, the `bench` extra) configured to match
Reservoir's `grpo` preset: one optimizer step per generation batch of batch_groups prompts × n
completions, no KL term (beta 0, no reference model), PPO clip 0.2, group-normalised advantages,
token-mean loss over the whole batch (loss_type "dapo": with one process, no gradient accumulation
and steps_per_generation 1 it divides by the batch's completion-token count), AdamW on torch's fused
kernel (transformers' default with torch >= 2.8, as Reservoir's optimizer) at a constant
learning rate without weight decay (TRL's default and Reservoir's `trainer.weight_decay`),
gradient norm clipped to 1.0, float32 on the CPU. Prompts are conversational, so TRL renders them
with the model's chat template as Reservoir's explorer does (the same token ids); the reward is
Reservoir's exact_match on the completion's text without special tokens, cut at end-of-turn.

Known differences TRL does not let us remove, none of which changes a step by more than noise
here: TRL's group std has Bessel's correction and eps 1e-4 (Reservoir: population std, eps
1e-6; for one group size a constant factor on every advantage, which AdamW cancels); with
one step per generation TRL's importance ratio is exactly 1 (old logprobs = the current ones,
detached), Reservoir's is against the engine's sampling logprobs (1 up to rounding in sync
mode); TRL shuffles prompts with its own seeded sampler, every epoch.

    python bench/trl_grpo.py [--steps 3 --n 4 --batch-groups 4 --max-tokens 10]
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: nothing from a hub

import argparse
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from datasets import Dataset
from transformers import PrinterCallback, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from reservoir.explorer.rewards import REWARDS
from reservoir.models import load_model

REWARD_LOG_KEY = "reward"  # GRPOTrainer's log key for the batch's mean total reward
ZERO_STD_LOG_KEY = "frac_reward_zero_std"  # its share of groups whose rewards are all equal


@dataclass
class TrlResult:
    """(seconds since training start, step, mean batch reward) per optimizer step."""

    curve: list[tuple[float, int, float]] = field(default_factory=list)
    zero_std: list[float] = field(default_factory=list)  # per step: share of zero-std groups
    samples: int = 0
    wall_s: float = 0.0
    model: object = None  # the trained policy


class RewardCurve(TrainerCallback):
    """Records the mean training reward TRL logs after each optimizer step, with its time."""

    def __init__(self) -> None:
        self.curve: list[tuple[float, int, float]] = []
        self.zero_std: list[float] = []
        self.start = time.perf_counter()

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and logs.get(REWARD_LOG_KEY) is not None:
            self.curve.append((time.perf_counter() - self.start, state.global_step,
                               float(logs[REWARD_LOG_KEY])))
            if logs.get(ZERO_STD_LOG_KEY) is not None:
                self.zero_std.append(float(logs[ZERO_STD_LOG_KEY]))


def exact_match(completions: list[list[dict[str, str]]], answer: list[str], **_) -> list[float]:
    """Reservoir's exact_match accuracy of each completion's assistant text against its answer."""
    reward = REWARDS.get("exact_match")
    return [reward(completion[-1]["content"], want)["accuracy"]
            for completion, want in zip(completions, answer, strict=True)]


def grpo_config(*, n: int, batch_groups: int, lr: float, temperature: float, max_tokens: int,
                steps: int, seed: int, out_dir: Path) -> GRPOConfig:
    """GRPOConfig equal to Reservoir's `grpo` preset on one CPU process."""
    return GRPOConfig(
        output_dir=str(out_dir), report_to="none", use_cpu=True, bf16=False, fp16=False,
        seed=seed, max_steps=steps, logging_steps=1, save_strategy="no", disable_tqdm=True,
        per_device_train_batch_size=batch_groups * n, gradient_accumulation_steps=1,
        steps_per_generation=1, num_iterations=1, num_generations=n,
        beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group",
        learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0,
        optim="adamw_torch_fused",
        weight_decay=0.0, max_grad_norm=1.0, gradient_checkpointing=False,
        temperature=temperature, top_p=1.0, top_k=0, max_completion_length=max_tokens,
        use_vllm=False, log_completions=False)


def run_trl(model_dir: Path, train_prompts: list[str], train_answers: list[str], *, n: int,
            batch_groups: int, lr: float, temperature: float, max_tokens: int, steps: int,
            seed: int, out_dir: Path) -> TrlResult:
    """Train with TRL's GRPOTrainer for `steps` optimizer steps; the reward curve and timing."""
    model, tokenizer = load_model(model_dir)
    dataset = Dataset.from_dict({
        "prompt": [[{"role": "user", "content": prompt}] for prompt in train_prompts],
        "answer": list(train_answers)})
    recorder = RewardCurve()
    trainer = GRPOTrainer(
        model=model, processing_class=tokenizer, reward_funcs=[exact_match], train_dataset=dataset,
        args=grpo_config(n=n, batch_groups=batch_groups, lr=lr, temperature=temperature,
                         max_tokens=max_tokens, steps=steps, seed=seed, out_dir=out_dir),
        callbacks=[recorder])
    trainer.remove_callback(PrinterCallback)  # with tqdm off it prints every log dict
    started = time.perf_counter()
    trainer.train()
    wall_s = time.perf_counter() - started
    return TrlResult(curve=recorder.curve, zero_std=recorder.zero_std,
                     samples=trainer.state.global_step * batch_groups * n, wall_s=wall_s,
                     model=trainer.model)


def main() -> None:
    """Smoke test: a fresh tiny model, reverse tasks, a few steps; prints the curve."""
    from reservoir.plan.tasks import GENERATORS
    from reservoir.models import build_tiny_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--batch-groups", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=10)
    parser.add_argument("--lr", type=float, default=2e-4)
    args = parser.parse_args()
    tasks = [row for row in GENERATORS["reverse"](200, seed=0, test_fraction=0.1)
             if row["split"] == "train"]
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = build_tiny_model(Path(scratch) / "tiny")
        result = run_trl(model_dir, [row["prompt"] for row in tasks],
                         [row["answer"] for row in tasks], n=args.n,
                         batch_groups=args.batch_groups, lr=args.lr, temperature=1.0,
                         max_tokens=args.max_tokens, steps=args.steps, seed=0,
                         out_dir=Path(scratch) / "out")
    for seconds, step, reward in result.curve:
        print(f"step {step}: reward {reward:.3f} at {seconds:.2f} s")
    print(f"{result.samples} completions in {result.wall_s:.2f} s "
          f"({result.wall_s / max(1, len(result.curve)):.2f} s/step)")


if __name__ == "__main__":
    main()
