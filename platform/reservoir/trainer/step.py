"""One optimizer step of a policy-gradient algorithm on a leased batch.

An algorithm is a named preset of registered pieces (advantage, policy loss, KL estimator,
aggregation); the step only wires them together, so a new algorithm touches no loop code.

In a pool of data-parallel ranks every rank holds the whole batch (advantages need whole
groups), trains its own slice of rows and sums its gradients with the others' through
`Ranks.reduce`, so each rank steps with the full batch's gradient and the weights stay equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from reservoir.devices import autocast
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
    tis_cap: float | None = None  # truncated importance sampling of the engine's samples


PRESETS = {
    "grpo": Algorithm(),
    "grpo-kl": Algorithm(kl_coef=0.01, kl_estimator="k3"),
    "dr-grpo": Algorithm(aggregation="seq-mean-token-sum"),
}


@dataclass(frozen=True)
class Ranks:
    """This process's place in a trainer pool; `reduce` sums a tensor over ranks in place."""

    rank: int = 0
    world: int = 1
    reduce: Callable[[torch.Tensor], object] = lambda tensor: None

    def share(self, rows: int) -> slice:
        return slice(rows * self.rank // self.world, rows * (self.rank + 1) // self.world)


ONE = Ranks()


@dataclass(frozen=True)
class Precision:
    dtype: str = "float32"       # compute dtype (autocast); weights stay float32
    chunk: int = 1024            # positions per chunk of the output layer


def train_step(model, optimizer, batch: TrainBatch, algorithm: Algorithm, *,
               micro_batch: int, temperature: float = 1.0, reference=None,
               max_grad_norm: float | None = 1.0, precision: Precision = Precision(),
               ranks: Ranks = ONE) -> dict[str, float]:
    """Compute advantages for the batch, accumulate gradients over micro-batches, step.

    Micro-batch losses are weighted by their share of the batch's tokens (token-mean) or
    sequences (the per-sequence aggregations), so the gradient equals the full batch's.
    """
    advantages, metrics = ADVANTAGES.get(algorithm.advantage)(batch.rewards, batch.group_index)
    total_tokens, total_rows = float(batch.mask.sum()), len(batch)
    optimizer.zero_grad(set_to_none=True)
    sums: dict[str, float] = {"loss": 0.0}
    share = ranks.share(total_rows)
    for start in range(share.start, share.stop, micro_batch):
        rows = slice(start, min(start + micro_batch, share.stop))
        part = batch.rows(rows)
        loss, parts = _micro_batch_loss(model, part, advantages[rows], algorithm, temperature,
                                        reference, precision)
        weight = (float(part.mask.sum()) / total_tokens if algorithm.aggregation == "token-mean"
                  else len(part) / total_rows)
        (loss * weight).backward()
        sums["loss"] += float(loss.detach()) * weight
        for name, value in parts.items():
            sums[name] = sums.get(name, 0.0) + value * len(part) / total_rows
    if ranks.world > 1:
        _sum_gradients(model, ranks)
        sums = _sum_metrics(sums, ranks, model)
    if max_grad_norm is not None:
        metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                                    max_grad_norm))
    optimizer.step()
    return {**metrics, **sums, "reward_mean": float(batch.rewards.mean()),
            "train_tokens": total_tokens}


def _micro_batch_loss(model, part: TrainBatch, advantages: torch.Tensor, algorithm: Algorithm,
                      temperature: float, reference,
                      precision: Precision) -> tuple[torch.Tensor, dict[str, float]]:
    """The micro-batch's loss and its metrics (policy, importance weights, KL)."""
    device = part.input_ids.device
    with autocast(device, precision.dtype):
        logprobs = token_logprobs(model, part, temperature, chunk=precision.chunk)
    engine = torch.where(part.old_logprobs.isnan(), logprobs.detach(), part.old_logprobs)
    old, parts = engine, {}
    if algorithm.tis_cap is not None:  # ratio against the trainer's own old policy, and each
        weight = torch.exp(logprobs.detach() - engine).clamp(max=algorithm.tis_cap)  # token
        advantages = advantages[:, None] * weight  # weighted by min(p_train / p_engine, C)
        old = logprobs.detach()
        parts = {"tis/weight_mean": float(aggregate(weight, part.mask)),
                 "tis/truncated": float(aggregate((weight >= algorithm.tis_cap).float(),
                                                  part.mask))}
    loss, policy = POLICY_LOSSES.get(algorithm.policy_loss)(
        logprobs, old, advantages, part.mask, clip_low=algorithm.clip_low,
        clip_high=algorithm.clip_high, aggregation=algorithm.aggregation)
    parts |= policy
    if reference is not None and algorithm.kl_coef > 0:
        with torch.no_grad(), autocast(device, precision.dtype):
            ref_logprobs = token_logprobs(reference, part, temperature, chunk=precision.chunk)
        kl = aggregate(KL_ESTIMATORS.get(algorithm.kl_estimator)(logprobs, ref_logprobs),
                       part.mask, algorithm.aggregation)
        loss = loss + algorithm.kl_coef * kl
        parts["kl"] = float(kl.detach())
    return loss, parts


def _sum_gradients(model, ranks: Ranks) -> None:
    """Every rank's gradients summed into every rank, as one flat buffer (one collective)."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    ranks.reduce(flat)
    offset = 0
    for param, grad in zip(params, grads):
        param.grad = flat[offset:offset + grad.numel()].view_as(grad).clone()
        offset += grad.numel()


def _sum_metrics(sums: dict[str, float], ranks: Ranks, model) -> dict[str, float]:
    """Each rank's share-weighted metric sums added up (every rank has rows, so every rank
    holds the same names)."""
    names = sorted(sums)
    device = next(model.parameters()).device
    values = torch.tensor([sums.get(name, 0.0) for name in names], dtype=torch.float64,
                          device=device)
    ranks.reduce(values)
    return dict(zip(names, values.tolist()))
