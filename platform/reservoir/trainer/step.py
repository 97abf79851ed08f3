"""One optimizer step of a policy-gradient algorithm on a leased batch.

An algorithm is a named preset of registered pieces (advantage, policy loss, KL estimator,
aggregation); the step only wires them together, so a new algorithm touches no loop code.

In a pool of data-parallel ranks every rank holds the whole batch (advantages need whole
groups), trains its own slice of rows and sums its gradients with the others' through
`Ranks.reduce`, so each rank steps with the full batch's gradient and the weights stay equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from reservoir.devices import autocast
from reservoir.errors import StepNotFinite
from reservoir.trainer.algorithms import (ADVANTAGES, KL_ESTIMATORS, POLICY_LOSSES, Episodes,
                                          aggregate, call, gae)
from reservoir.trainer.batch import TrainBatch, token_logprobs
from reservoir.trainer.presets import PRESETS, Algorithm

__all__ = ["Algorithm", "PRESETS", "Precision", "Ranks", "ONE", "StepNotFinite", "train_step",
           "optimizer_step", "sum_gradients", "sum_metrics"]


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


@dataclass
class _Prepared:
    """What the step computes over the whole batch before its micro-batches."""

    advantages: torch.Tensor
    metrics: dict[str, float]
    old_values: torch.Tensor | None = None     # the critic's, before the step
    returns: torch.Tensor | None = None        # the critic's targets


def train_step(model, optimizer, batch: TrainBatch, algorithm: Algorithm, *,
               micro_batch: int, temperature: float = 1.0, reference=None, critic=None,
               max_grad_norm: float | None = 1.0, precision: Precision = Precision(),
               ranks: Ranks = ONE) -> dict[str, float]:
    """Compute advantages for the batch, accumulate gradients over micro-batches, step.

    `reference` is the frozen model KL is measured against (needed when kl_coef > 0);
    `critic` the value model the gae advantage reads (trainer/critic.py), stepped with its own
    optimizer. Micro-batch losses are weighted by their share of the batch's tokens
    (token-mean) or sequences (the per-sequence aggregations), so the gradient equals the full
    batch's.
    """
    _check_models(algorithm, reference, critic)
    prepared = _prepare(batch, algorithm, reference, critic, temperature, precision,
                        micro_batch)
    total_tokens, total_rows = float(batch.mask.sum()), len(batch)
    optimizer.zero_grad(set_to_none=True)
    if critic is not None:
        critic.optimizer.zero_grad(set_to_none=True)
    sums: dict[str, float] = {"loss": 0.0}
    share = ranks.share(total_rows)
    for start in range(share.start, share.stop, micro_batch):
        rows = slice(start, min(start + micro_batch, share.stop))
        part = batch.rows(rows)
        weight = (float(part.mask.sum()) / total_tokens if algorithm.aggregation == "token-mean"
                  else len(part) / total_rows)
        loss, parts = _micro_batch_loss(model, part, rows, prepared, algorithm, temperature,
                                        reference, precision)
        if critic is not None:
            critic_loss, critic_parts = critic.loss(part, prepared.old_values[rows],
                                                    prepared.returns[rows],
                                                    algorithm.aggregation, precision.dtype)
            (critic_loss * weight).backward()
            parts |= critic_parts | {"critic/loss": float(critic_loss.detach())}
        (loss * weight).backward()
        sums["loss"] += float(loss.detach()) * weight
        for name, value in parts.items():  # weighted as the loss is: the batch's own mean
            sums[name] = sums.get(name, 0.0) + value * weight
    metrics = prepared.metrics
    if ranks.world > 1:
        sum_gradients(model, ranks)
        if critic is not None:
            sum_gradients(critic.model, ranks)
        sums = sum_metrics(sums, ranks, model)
    stepped = [(model, optimizer, "grad_norm")]
    if critic is not None:
        stepped.append((critic.model, critic.optimizer, "critic/grad_norm"))
    metrics |= optimizer_step(stepped, sums["loss"], max_grad_norm)
    return {**metrics, **sums, "reward_mean": float(batch.rewards.mean()),
            "train_tokens": total_tokens}


def _check_models(algorithm: Algorithm, reference, critic) -> None:
    if algorithm.needs_reference and reference is None:
        raise ValueError("this algorithm measures KL: pass the frozen reference model")
    if algorithm.needs_critic and critic is None:
        raise ValueError("the gae advantage needs a critic (trainer.critic)")


def optimizer_step(stepped: list[tuple], loss: float,
                   max_grad_norm: float | None) -> dict[str, float]:
    """Clip and step each (model, optimizer, norm metric's name); none steps when the loss or
    a gradient is not finite (StepNotFinite: the weights and optimizer state stay as they
    were). Every rank holds the same loss and summed gradients, so every rank decides alike."""
    norms = {}
    for model, _, name in stepped:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norms[name] = torch.nn.utils.get_total_norm(grads) if grads else torch.tensor(0.0)
    if not math.isfinite(loss) or not all(torch.isfinite(norm) for norm in norms.values()):
        for model, optimizer, _ in stepped:
            optimizer.zero_grad(set_to_none=True)
        shown = ", ".join(f"{name} {float(norm):g}" for name, norm in norms.items())
        raise StepNotFinite(f"the loss is not finite ({loss:g}; {shown}): no weight was changed")
    metrics = {}
    for model, optimizer, name in stepped:
        if max_grad_norm is not None:
            params = [p for p in model.parameters() if p.grad is not None]
            torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, norms[name])
            metrics[name] = float(norms[name])
        optimizer.step()
    return metrics


def _prepare(batch: TrainBatch, algorithm: Algorithm, reference, critic, temperature: float,
             precision: Precision, micro_batch: int) -> _Prepared:
    """Advantages of the whole batch (groups and whitening span it), with the KL folded into
    the reward and the critic's values and targets where the algorithm asks for them."""
    token_rewards = ref_logprobs = values = returns = None
    metrics: dict[str, float] = {}
    if algorithm.kl_coef > 0 and algorithm.kl_in == "reward":
        ref_logprobs = _no_grad_logprobs(reference, batch, temperature, precision, micro_batch)
        sampled = torch.where(batch.old_logprobs.isnan(), ref_logprobs, batch.old_logprobs)
        kl = KL_ESTIMATORS.get(algorithm.kl_estimator)(sampled, ref_logprobs)
        token_rewards = -algorithm.kl_coef * kl * batch.mask
        metrics["kl"] = float(aggregate(kl, batch.mask))
    if critic is not None:
        values = critic.values(batch, micro_batch, precision.dtype) * batch.mask
    episodes = Episodes(batch.rewards, batch.group_index, batch.mask, token_rewards, values)
    advantages, found = call(ADVANTAGES.get(algorithm.advantage), episodes,
                             **algorithm.options())
    if critic is not None:
        _, returns = gae(episodes.dense_rewards(), values, batch.mask, gamma=algorithm.gamma,
                         lam=algorithm.lam)
    return _Prepared(advantages, metrics | found, values, returns)


def _no_grad_logprobs(model, batch: TrainBatch, temperature: float, precision: Precision,
                      micro_batch: int) -> torch.Tensor:
    with torch.no_grad(), autocast(batch.input_ids.device, precision.dtype):
        return torch.cat([token_logprobs(model, batch.rows(slice(start, start + micro_batch)),
                                         temperature, chunk=precision.chunk)
                          for start in range(0, len(batch), micro_batch)])


def _micro_batch_loss(model, part: TrainBatch, rows: slice, prepared: _Prepared,
                      algorithm: Algorithm, temperature: float, reference,
                      precision: Precision) -> tuple[torch.Tensor, dict[str, float]]:
    """The micro-batch's loss and its metrics (policy, importance weights, KL, entropy)."""
    device = part.input_ids.device
    with autocast(device, precision.dtype):
        out = token_logprobs(model, part, temperature, chunk=precision.chunk,
                             entropy=algorithm.entropy_coef > 0)
    logprobs, entropy = out if algorithm.entropy_coef > 0 else (out, None)
    advantages = prepared.advantages[rows]
    engine = torch.where(part.old_logprobs.isnan(), logprobs.detach(), part.old_logprobs)
    old, parts = engine, {}
    if algorithm.tis_cap is not None:  # ratio against the trainer's own old policy, and each
        weight = torch.exp(logprobs.detach() - engine).clamp(max=algorithm.tis_cap)  # token
        per_token = advantages[:, None] if advantages.dim() == 1 else advantages
        advantages = per_token * weight  # weighted by min(p_train / p_engine, C)
        old = logprobs.detach()
        parts = {"tis/weight_mean": float(aggregate(weight, part.mask)),
                 "tis/truncated": float(aggregate((weight >= algorithm.tis_cap).float(),
                                                  part.mask))}
    loss, policy = call(POLICY_LOSSES.get(algorithm.policy_loss), logprobs, old, advantages,
                        part.mask, **algorithm.options())
    parts |= policy
    if algorithm.kl_coef > 0 and algorithm.kl_in == "loss":
        with torch.no_grad(), autocast(device, precision.dtype):
            ref_logprobs = token_logprobs(reference, part, temperature, chunk=precision.chunk)
        kl = aggregate(KL_ESTIMATORS.get(algorithm.kl_estimator)(logprobs, ref_logprobs),
                       part.mask, algorithm.aggregation)
        loss = loss + algorithm.kl_coef * kl
        parts["kl"] = float(kl.detach())
    if entropy is not None:
        mean_entropy = aggregate(entropy, part.mask, algorithm.aggregation)
        loss = loss - algorithm.entropy_coef * mean_entropy
        parts["entropy"] = float(mean_entropy.detach())
    return loss, parts


def sum_gradients(model, ranks: Ranks) -> None:
    """Every rank's gradients summed into every rank, as one flat buffer (one collective)."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    ranks.reduce(flat)
    offset = 0
    for param, grad in zip(params, grads):
        param.grad = flat[offset:offset + grad.numel()].view_as(grad).clone()
        offset += grad.numel()


def sum_metrics(sums: dict[str, float], ranks: Ranks, model) -> dict[str, float]:
    """Each rank's share-weighted metric sums added up (every rank has rows, so every rank
    holds the same names)."""
    names = sorted(sums)
    device = next(model.parameters()).device
    values = torch.tensor([sums.get(name, 0.0) for name in names], dtype=torch.float64,
                          device=device)
    ranks.reduce(values)
    return dict(zip(names, values.tolist()))
