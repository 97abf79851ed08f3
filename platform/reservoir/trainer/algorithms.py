"""Algorithm pieces as small registered functions over tensors, each returning (value, metrics).

Shapes: per-token tensors are [batch, tokens] with a 0/1 `mask` of response tokens that train;
per-sequence tensors are [batch]. Advantages are computed when a batch is drawn, never stored.
"""

from __future__ import annotations

from typing import Literal

import torch

from reservoir.registry import Registry

Tensor = torch.Tensor
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]

ADVANTAGES: Registry = Registry("advantage estimator")
POLICY_LOSSES: Registry = Registry("policy loss")
KL_ESTIMATORS: Registry = Registry("KL estimator")


def aggregate(values: Tensor, mask: Tensor, mode: Aggregation = "token-mean") -> Tensor:
    """Reduce per-token values to a scalar over the masked tokens.

    token-mean: every trained token weighs the same (DAPO, the default here);
    seq-mean-token-mean: mean per sequence, then over sequences (the original GRPO);
    seq-mean-token-sum: sum per sequence, then mean over sequences (Dr. GRPO style).
    """
    mask = mask.to(values.dtype)
    if mode == "token-mean":
        return (values * mask).sum() / mask.sum().clamp(min=1.0)
    per_sequence = (values * mask).sum(dim=-1)
    if mode == "seq-mean-token-mean":
        per_sequence = per_sequence / mask.sum(dim=-1).clamp(min=1.0)
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"unknown aggregation {mode!r}; valid: token-mean, "
                         "seq-mean-token-mean, seq-mean-token-sum")
    return per_sequence.mean()


@ADVANTAGES.register("grpo")
def grpo_advantages(rewards: Tensor, group_ids: Tensor, *, normalize_std: bool = True,
                    eps: float = 1e-6) -> tuple[Tensor, dict[str, float]]:
    """Group-relative advantage: (reward - group mean) / (group std + eps).

    `group_ids` holds one integer per sequence; groups of one get advantage 0. The standard
    deviation is the population one (as in the GRPO paper's reference code). With
    normalize_std=False the result is the Dr. GRPO advantage (mean-centred only).
    """
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = rewards.new_zeros(len(counts)).index_add_(0, inverse, rewards)
    means = sums / counts
    centred = rewards - means[inverse]
    squares = rewards.new_zeros(len(counts)).index_add_(0, inverse, centred ** 2)
    stds = (squares / counts).sqrt()
    advantages = centred / (stds[inverse] + eps) if normalize_std else centred
    advantages = torch.where(counts[inverse] > 1, advantages, torch.zeros_like(advantages))
    zero_groups = float((stds <= eps).float().mean())
    return advantages, {"advantage/abs_mean": float(advantages.abs().mean()),
                        "advantage/zero_variance_groups": zero_groups}


@POLICY_LOSSES.register("clipped")
def clipped_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                        *, clip_low: float = 0.2, clip_high: float = 0.2,
                        aggregation: Aggregation = "token-mean") -> tuple[Tensor, dict[str, float]]:
    """PPO's clipped surrogate: -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A), r = exp(lp - old).

    `advantages` is per sequence ([batch]) or per token ([batch, tokens]).
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logprobs)
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = aggregate(-torch.minimum(unclipped, clipped), mask, aggregation)
    was_clipped = (clipped < unclipped).to(logprobs.dtype)
    return loss, {"policy/clip_fraction": float(aggregate(was_clipped, mask, "token-mean")),
                  "policy/ratio_mean": float(aggregate(ratio.detach(), mask, "token-mean"))}


@KL_ESTIMATORS.register("k1")
def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """log p - log p_ref per token: unbiased, high variance, can be negative (Schulman 2020)."""
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("k2")
def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """(log p - log p_ref)^2 / 2 per token: biased, low variance, non-negative."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """exp(ref - lp) - (ref - lp) - 1 per token: unbiased and non-negative (Schulman 2020)."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1.0
