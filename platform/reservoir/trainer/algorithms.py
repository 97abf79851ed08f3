"""Algorithm pieces as small registered functions over tensors, each returning (value, metrics).

Shapes: per-token tensors are [batch, tokens] with a 0/1 `mask` of response tokens that train
(model tokens; a multi-turn episode's tool tokens are 0); per-sequence tensors are [batch].
Advantages are computed when a batch is drawn, never stored.

- ADVANTAGES: (Episodes, **options) -> advantages [B] or [B, T]
- POLICY_LOSSES: (logprobs, old_logprobs, advantages, mask, **options) -> loss
- PREFERENCE_LOSSES: (chosen log-ratio, rejected log-ratio, **options) -> loss, over pairs
- KL_ESTIMATORS: (logprobs, ref_logprobs) -> per-token KL estimate

Each function declares the options it reads as keyword arguments; `call` passes only those.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from reservoir.registry import Registry

Tensor = torch.Tensor
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")

ADVANTAGES: Registry = Registry("advantage estimator")
POLICY_LOSSES: Registry = Registry("policy loss")
PREFERENCE_LOSSES: Registry = Registry("preference loss")
KL_ESTIMATORS: Registry = Registry("KL estimator")


def call(function, *args, **options):
    """`function(*args, **the options it declares)`: presets hold every option, pieces take
    the ones they use."""
    accepted = inspect.signature(function).parameters
    return function(*args, **{k: v for k, v in options.items() if k in accepted})


# -- reductions ------------------------------------------------------------------------------

def aggregate(values: Tensor, mask: Tensor, mode: Aggregation = "token-mean") -> Tensor:
    """Reduce per-token values to a scalar over the masked tokens.

    token-mean: every trained token weighs the same (DAPO, the default here);
    seq-mean-token-mean: mean per sequence, then over sequences (the original GRPO, GSPO);
    seq-mean-token-sum: sum per sequence, then mean over sequences (Dr. GRPO).
    """
    mask = mask.to(values.dtype)
    if mode == "token-mean":
        return (values * mask).sum() / mask.sum().clamp(min=1.0)
    per_sequence = (values * mask).sum(dim=-1)
    if mode == "seq-mean-token-mean":
        per_sequence = per_sequence / mask.sum(dim=-1).clamp(min=1.0)
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"unknown aggregation {mode!r}; valid: {', '.join(AGGREGATIONS)}")
    return per_sequence.mean()


def whiten(values: Tensor, mask: Tensor, eps: float = 1e-6) -> Tensor:
    """(values - mean) / (std + eps) over the masked entries (population std), 0 elsewhere."""
    mask = mask.to(values.dtype)
    count = mask.sum().clamp(min=1.0)
    mean = (values * mask).sum() / count
    std = ((((values - mean) * mask) ** 2).sum() / count).sqrt()
    return (values - mean) / (std + eps) * mask


# -- advantages ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Episodes:
    """What advantage estimators read about a batch."""

    rewards: Tensor                     # [B] outcome reward of each sequence
    group_ids: Tensor                   # [B] integer group of each sequence
    mask: Tensor                        # [B, T] tokens that train
    token_rewards: Tensor | None = None  # [B, T] per-token terms (-kl_coef * KL in the reward)
    values: Tensor | None = None        # [B, T] the critic's value of each position

    def sequence_rewards(self) -> Tensor:
        """Outcome reward plus the sequence's per-token terms."""
        if self.token_rewards is None:
            return self.rewards
        return self.rewards + (self.token_rewards * self.mask).sum(dim=-1)

    def dense_rewards(self) -> Tensor:
        """[B, T]: the per-token terms, with the outcome reward on each sequence's last
        trained token."""
        dense = torch.zeros_like(self.mask, dtype=self.rewards.dtype) \
            if self.token_rewards is None else self.token_rewards * self.mask
        positions = torch.arange(self.mask.shape[1], device=self.mask.device)
        last = torch.where(self.mask > 0, positions, -1).max(dim=-1).values
        rows = torch.nonzero(last >= 0)[:, 0]
        dense = dense.clone()
        dense[rows, last[rows]] += self.rewards[rows]
        return dense


def _group_stats(rewards: Tensor, group_ids: Tensor):
    """(index of each row's group, rows per group, group means, group population stds)."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    means = rewards.new_zeros(len(counts)).index_add_(0, inverse, rewards) / counts
    squares = rewards.new_zeros(len(counts)).index_add_(0, inverse,
                                                        (rewards - means[inverse]) ** 2)
    return inverse, counts, means, (squares / counts).sqrt()


def _group_metrics(advantages: Tensor, stds: Tensor, eps: float) -> dict[str, float]:
    return {"advantage/abs_mean": float(advantages.abs().mean()),
            "advantage/zero_variance_groups": float((stds <= eps).float().mean())}


@ADVANTAGES.register("grpo")
def grpo_advantages(episodes: Episodes, *, eps: float = 1e-6) -> tuple[Tensor, dict]:
    """(reward - group mean) / (group std + eps), population std; groups of one get 0."""
    rewards = episodes.sequence_rewards()
    inverse, counts, means, stds = _group_stats(rewards, episodes.group_ids)
    advantages = (rewards - means[inverse]) / (stds[inverse] + eps)
    advantages = torch.where(counts[inverse] > 1, advantages, torch.zeros_like(advantages))
    return advantages, _group_metrics(advantages, stds, eps)


@ADVANTAGES.register("dr-grpo")
def dr_grpo_advantages(episodes: Episodes, *, eps: float = 1e-6) -> tuple[Tensor, dict]:
    """reward - group mean, not divided by the std (Dr. GRPO: no difficulty bias)."""
    rewards = episodes.sequence_rewards()
    inverse, counts, means, stds = _group_stats(rewards, episodes.group_ids)
    advantages = torch.where(counts[inverse] > 1, rewards - means[inverse],
                             torch.zeros_like(rewards))
    return advantages, _group_metrics(advantages, stds, eps)


@ADVANTAGES.register("rloo")
def rloo_advantages(episodes: Episodes, *, eps: float = 1e-6) -> tuple[Tensor, dict]:
    """reward - mean of the other rewards of its group (REINFORCE leave-one-out)."""
    rewards = episodes.sequence_rewards()
    inverse, counts, means, stds = _group_stats(rewards, episodes.group_ids)
    n = counts[inverse].to(rewards.dtype)
    others = (means[inverse] * n - rewards) / (n - 1).clamp(min=1.0)
    advantages = torch.where(n > 1, rewards - others, torch.zeros_like(rewards))
    return advantages, _group_metrics(advantages, stds, eps)


@ADVANTAGES.register("opmd")
def opmd_advantages(episodes: Episodes, *, tau: float = 1.0,
                    opmd_baseline: Literal["mean", "logavgexp"] = "mean",
                    eps: float = 1e-6) -> tuple[Tensor, dict]:
    """reward - group baseline: the mean, or tau * log(mean(exp(reward / tau))) (online
    policy mirror descent, Trinity-RFT)."""
    rewards = episodes.sequence_rewards()
    inverse, counts, means, stds = _group_stats(rewards, episodes.group_ids)
    if opmd_baseline == "logavgexp":
        scaled = rewards / tau
        peak = scaled.new_full((len(counts),), -math.inf).scatter_reduce(
            0, inverse, scaled, reduce="amax")
        sums = scaled.new_zeros(len(counts)).index_add_(0, inverse, (scaled - peak[inverse]).exp())
        baselines = tau * (peak + (sums / counts).log())
    else:
        baselines = means
    advantages = torch.where(counts[inverse] > 1, rewards - baselines[inverse],
                             torch.zeros_like(rewards))
    return advantages, _group_metrics(advantages, stds, eps)


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_next over each row's trained tokens (untrained tokens are skipped:
    the next trained token is the next step); 0 where mask is 0."""
    returns = torch.zeros_like(rewards)
    running = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        on = mask[:, t] > 0
        running = torch.where(on, rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(on, running, torch.zeros_like(running))
    return returns


@ADVANTAGES.register("reinforce++")
def reinforce_pp_advantages(episodes: Episodes, *, gamma: float = 1.0,
                            eps: float = 1e-6) -> tuple[Tensor, dict]:
    """Per-token discounted returns of the dense reward (outcome on the last token, KL terms
    on every token), normalised over the whole batch's tokens (REINFORCE++)."""
    returns = discounted_returns(episodes.dense_rewards(), episodes.mask, gamma)
    advantages = whiten(returns, episodes.mask, eps)
    _, _, _, stds = _group_stats(episodes.sequence_rewards(), episodes.group_ids)
    return advantages, _group_metrics(advantages[episodes.mask > 0], stds, eps)


def gae(rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float,
        lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over each row's trained tokens: (advantages, returns).

    delta_t = r_t + gamma V_next - V_t, A_t = delta_t + gamma lam A_next, returns = A + V;
    after a row's last trained token V_next = 0. Untrained tokens are skipped.
    """
    advantages = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(rewards.shape[0])
    next_advantage = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        on = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        here = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(on, here, torch.zeros_like(here))
        next_advantage = torch.where(on, here, next_advantage)
        next_value = torch.where(on, values[:, t], next_value)
    return advantages, (advantages + values) * mask


@ADVANTAGES.register("gae")
def gae_advantages(episodes: Episodes, *, gamma: float = 1.0, lam: float = 0.95,
                   eps: float = 1e-6) -> tuple[Tensor, dict]:
    """PPO's advantages: GAE against the critic's values, whitened over the batch's tokens."""
    if episodes.values is None:
        raise ValueError("the gae advantage needs a critic's values (trainer.critic)")
    raw, _ = gae(episodes.dense_rewards(), episodes.values, episodes.mask, gamma=gamma, lam=lam)
    advantages = whiten(raw, episodes.mask, eps)
    _, _, _, stds = _group_stats(episodes.sequence_rewards(), episodes.group_ids)
    return advantages, {**_group_metrics(advantages[episodes.mask > 0], stds, eps),
                        "advantage/raw_mean": float(aggregate(raw, episodes.mask))}


@ADVANTAGES.register("none")
def no_advantages(episodes: Episodes) -> tuple[Tensor, dict]:
    """Zeros, for losses that read no advantage (SFT)."""
    return torch.zeros_like(episodes.rewards), {}


# -- policy losses ----------------------------------------------------------------------------

def _per_token(advantages: Tensor, like: Tensor) -> Tensor:
    return advantages[:, None].expand_as(like) if advantages.dim() == 1 else advantages


@POLICY_LOSSES.register("ppo")
def ppo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
             clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None,
             aggregation: Aggregation = "token-mean") -> tuple[Tensor, dict]:
    """PPO's clipped surrogate -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A), r = exp(lp -
    old); with dual_clip = c > 1, a negative-advantage token's loss is at most -c A."""
    advantages = _per_token(advantages, logprobs)
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    per_token = torch.maximum(unclipped, clipped)
    metrics = {"policy/clip_fraction": float(aggregate((clipped > unclipped).to(ratio.dtype),
                                                       mask)),
               "policy/ratio_mean": float(aggregate(ratio.detach(), mask))}
    if dual_clip is not None:
        bound = -dual_clip * advantages
        dual = (advantages < 0) & (per_token > bound)
        per_token = torch.where(advantages < 0, torch.minimum(per_token, bound), per_token)
        metrics["policy/dual_clip_fraction"] = float(aggregate(dual.to(ratio.dtype), mask))
    return aggregate(per_token, mask, aggregation), metrics


@POLICY_LOSSES.register("gspo")
def gspo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
              clip_low: float = 3e-4, clip_high: float = 4e-4,
              aggregation: Aggregation = "seq-mean-token-mean") -> tuple[Tensor, dict]:
    """GSPO: PPO's clip on the sequence-level ratio s = exp(mean_t(lp - old)), carried to each
    token as sg(s) * exp(lp - sg(lp)) (its value is s, its gradient the token's)."""
    advantages = _per_token(advantages, logprobs)
    maskf = mask.to(logprobs.dtype)
    log_s = ((logprobs - old_logprobs) * maskf).sum(-1) / maskf.sum(-1).clamp(min=1.0)
    ratio = torch.exp(log_s.detach()[:, None] + logprobs - logprobs.detach())
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = aggregate(torch.maximum(unclipped, clipped), mask, aggregation)
    return loss, {"policy/clip_fraction": float(aggregate((clipped > unclipped).to(ratio.dtype),
                                                          mask)),
                  "policy/ratio_mean": float(torch.exp(log_s.detach()).mean())}


@POLICY_LOSSES.register("cispo")
def cispo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
               clip_low: float = 1.0, clip_high: float = 4.0,
               aggregation: Aggregation = "token-mean") -> tuple[Tensor, dict]:
    """CISPO: -sg(clip(r, 1 - clip_low, 1 + clip_high)) A lp; every token keeps a gradient,
    only its importance weight is clipped (MiniMax-M1)."""
    advantages = _per_token(advantages, logprobs)
    ratio = torch.exp(logprobs - old_logprobs).detach()
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = aggregate(-weight * advantages * logprobs, mask, aggregation)
    return loss, {"policy/clip_fraction": float(aggregate((weight != ratio).to(ratio.dtype),
                                                          mask)),
                  "policy/ratio_mean": float(aggregate(ratio, mask))}


@POLICY_LOSSES.register("opmd")
def opmd_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
              tau: float = 1.0, aggregation: Aggregation = "token-mean") -> tuple[Tensor, dict]:
    """Online policy mirror descent: -A lp / (1 + tau), no importance ratio (off-policy
    tolerant; Trinity-RFT)."""
    advantages = _per_token(advantages, logprobs)
    return aggregate(-advantages * logprobs, mask, aggregation) / (1.0 + tau), {}


@POLICY_LOSSES.register("sft")
def sft_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
             aggregation: Aggregation = "token-mean") -> tuple[Tensor, dict]:
    """Negative log-likelihood of the trained tokens (advantages are not read)."""
    loss = aggregate(-logprobs, mask, aggregation)
    return loss, {"sft/nll": float(loss.detach())}


# -- preference losses (over chosen/rejected pairs) ---------------------------------------------

@PREFERENCE_LOSSES.register("dpo")
def dpo_loss(chosen: Tensor, rejected: Tensor, *, beta: float = 0.1) -> tuple[Tensor, dict]:
    """-log sigmoid(beta (chosen - rejected)), mean over pairs; `chosen` and `rejected` are
    each response's summed log-ratio log pi - log pi_ref over its trained tokens."""
    margin = beta * (chosen - rejected)
    loss = -F.logsigmoid(margin).mean()
    return loss, {"dpo/accuracy": float((margin > 0).float().mean()),
                  "dpo/margin": float(margin.detach().mean()),
                  "dpo/chosen_reward": float(beta * chosen.detach().mean()),
                  "dpo/rejected_reward": float(beta * rejected.detach().mean())}


# -- value loss and KL --------------------------------------------------------------------------

def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *,
               value_clip: float | None = 0.2,
               aggregation: Aggregation = "token-mean") -> tuple[Tensor, dict]:
    """0.5 max((V - R)^2, (V_clipped - R)^2), V_clipped = old + clip(V - old, +-value_clip)."""
    loss = (values - returns) ** 2
    if value_clip is not None:
        clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
        loss = torch.maximum(loss, (clipped - returns) ** 2)
    return 0.5 * aggregate(loss, mask, aggregation), {
        "critic/value_mean": float(aggregate(values.detach(), mask)),
        "critic/return_mean": float(aggregate(returns, mask))}


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


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the softmax over the last axis, in float32."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
