"""One optimizer step of a policy-gradient algorithm on a leased batch.

An algorithm is a named preset of registered pieces (advantage, policy loss, KL estimator,
aggregation); the step only wires them together, so a new algorithm touches no loop code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reservoir.trainer.algorithms import ADVANTAGES, KL_ESTIMATORS, POLICY_LOSSES, aggregate
from reservoir.trainer.batch import TrainBatch, token_logprobs


@dataclass(frozen=True)
class Algorithm:
    advantage: str = "grpo"
    policy_loss: str = "clipped"
    kl_estimator: str = "k3"
    kl_coef: float = 0.0
    clip_low: float = 0.2
    clip_high: float = 0.2
    aggregation: str = "token-mean"


PRESETS = {
    "grpo": Algorithm(),
    "grpo-kl": Algorithm(kl_coef=0.01, kl_estimator="k3"),
    "dr-grpo": Algorithm(aggregation="seq-mean-token-sum"),
}


def train_step(model, optimizer, batch: TrainBatch, algorithm: Algorithm, *,
               micro_batch: int, temperature: float = 1.0, reference=None,
               max_grad_norm: float | None = 1.0) -> dict[str, float]:
    """Compute advantages for the batch, accumulate gradients over micro-batches, step.

    Micro-batch losses are weighted by their share of the batch's tokens (token-mean) or
    sequences (the per-sequence aggregations), so the gradient equals the full batch's.
    """
    advantages, metrics = ADVANTAGES.get(algorithm.advantage)(batch.rewards, batch.group_index)
    policy_loss = POLICY_LOSSES.get(algorithm.policy_loss)
    total_tokens, total_rows = float(batch.mask.sum()), len(batch)
    optimizer.zero_grad(set_to_none=True)
    sums = {"loss": 0.0, "kl": 0.0}
    for start in range(0, total_rows, micro_batch):
        part = batch.rows(slice(start, start + micro_batch))
        logprobs = token_logprobs(model, part, temperature)
        old = torch.where(part.old_logprobs.isnan(), logprobs.detach(), part.old_logprobs)
        loss, parts = policy_loss(logprobs, old, advantages[start:start + micro_batch],
                                  part.mask, clip_low=algorithm.clip_low,
                                  clip_high=algorithm.clip_high, aggregation=algorithm.aggregation)
        if reference is not None and algorithm.kl_coef > 0:
            with torch.no_grad():
                ref_logprobs = token_logprobs(reference, part, temperature)
            kl = aggregate(KL_ESTIMATORS.get(algorithm.kl_estimator)(logprobs, ref_logprobs),
                           part.mask, algorithm.aggregation)
            loss = loss + algorithm.kl_coef * kl
            sums["kl"] += float(kl.detach()) * len(part) / total_rows
        share = (float(part.mask.sum()) / total_tokens if algorithm.aggregation == "token-mean"
                 else len(part) / total_rows)
        (loss * share).backward()
        sums["loss"] += float(loss.detach()) * share
        for name, value in parts.items():
            metrics[name] = metrics.get(name, 0.0) + value * len(part) / total_rows
    if max_grad_norm is not None:
        metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                                    max_grad_norm))
    optimizer.step()
    return {**metrics, **sums, "reward_mean": float(batch.rewards.mean()),
            "train_tokens": total_tokens}
