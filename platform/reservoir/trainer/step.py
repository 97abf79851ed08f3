"""One step of a policy-gradient algorithm on a leased batch: one optimizer update, or PPO's
epochs x mini-batches of them.

An algorithm is a named preset of registered pieces (advantage, policy loss, KL estimator,
aggregation); the step only wires them together, so a new algorithm touches no loop code.

In a pool of data-parallel ranks every rank holds the whole batch (advantages need whole
groups), trains its own slice of rows and sums its gradients with the others' through
`Ranks.reduce`, so each rank steps with the full batch's gradient and the weights stay equal.
A sharded policy (fsdp2) sums its gradient shards itself, in each backward pass; since every
forward pass gathers weights from every rank, its ranks run equally many micro-batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from reservoir.devices import autocast
from reservoir.errors import ConfigError, StepNotFinite
from reservoir.trainer.adapters import running
from reservoir.trainer.algorithms import (ADVANTAGES, KL_ESTIMATORS, POLICY_LOSSES, Episodes,
                                          aggregate, call, gae)
from reservoir.trainer.batch import TrainBatch, token_logprobs
from reservoir.plan.presets import PRESETS, Algorithm
from reservoir.trainer.sharding import is_sharded, whole_norm

__all__ = ["Algorithm", "PRESETS", "Precision", "Ranks", "ONE", "StepNotFinite", "train_step",
           "update_rows", "optimizer_step", "sum_gradients", "sum_metrics"]


@dataclass(frozen=True)
class Ranks:
    """This process's place in a trainer pool; `reduce` sums a tensor over ranks in place."""

    rank: int = 0
    world: int = 1
    reduce: Callable[[torch.Tensor], object] = lambda tensor: None

    def share(self, rows: int) -> slice:
        return slice(rows * self.rank // self.world, rows * (self.rank + 1) // self.world)

    def micro_batches(self, rows: int, micro_batch: int, lockstep: bool,
                      lengths: list[int] | None = None, tokens: int | None = None
                      ) -> list[tuple[slice, bool]]:
        """This rank's micro-batches of its share of `rows`, each with whether it counts. In
        lockstep (a sharded policy) every rank runs as many as the largest share needs, its
        share cut into that many nearly equal parts; a part left empty runs row 0 and does
        not count (weight 0). With `tokens` (packed micro-batches, not in lockstep) each is
        as many consecutive rows as fit in `tokens` of their `lengths` (one at least)."""
        share = self.share(rows)
        if tokens is not None and not lockstep:
            return [(part, True) for part in token_slices(lengths, share, tokens)]
        if not lockstep:
            return [(slice(start, min(start + micro_batch, share.stop)), True)
                    for start in range(share.start, share.stop, micro_batch)]
        count = math.ceil(math.ceil(rows / self.world) / micro_batch)
        size = share.stop - share.start
        cuts = [share.start + size * part // count for part in range(count + 1)]
        return [(slice(low, high), True) if high > low else (slice(0, 1), False)
                for low, high in zip(cuts, cuts[1:])]


ONE = Ranks()


def token_slices(lengths: list[int], rows: slice, tokens: int) -> list[slice]:
    """`rows` cut into runs of consecutive rows whose lengths sum to at most `tokens` (a row
    longer than that alone)."""
    parts, start, total = [], rows.start, 0
    for row in range(rows.start, rows.stop):
        if row > start and total + lengths[row] > tokens:
            parts.append(slice(start, row))
            start, total = row, 0
        total += lengths[row]
    if rows.stop > start:
        parts.append(slice(start, rows.stop))
    return parts


@dataclass(frozen=True)
class Precision:
    """How a step computes: its dtype, the output layer's chunk, and packing."""

    dtype: str = "float32"       # compute dtype (autocast); weights stay float32
    chunk: int = 1024            # positions per chunk of the output layer
    packed_tokens: int | None = None  # packed micro-batches of at most this many tokens;
                                      # None: padded micro-batches of micro_batch rows

    @property
    def packed(self) -> bool:
        return self.packed_tokens is not None

    def micro_slices(self, batch: TrainBatch, micro_batch: int) -> list[slice]:
        """The batch's micro-batches for a pass without gradients."""
        if self.packed_tokens is None:
            return [slice(start, start + micro_batch) for start in range(0, len(batch),
                                                                         micro_batch)]
        return token_slices(batch.lengths(), slice(0, len(batch)), self.packed_tokens)


@dataclass
class _Prepared:
    """What the step computes over the whole batch before its updates."""

    advantages: torch.Tensor
    metrics: dict[str, float]
    old_values: torch.Tensor | None = None     # the critic's, before the step
    returns: torch.Tensor | None = None        # the critic's targets
    start: torch.Tensor | None = None          # the policy's logprobs before the first update


def train_step(model, optimizer, batch: TrainBatch, algorithm: Algorithm, *,
               micro_batch: int, temperature: float = 1.0, reference=None, critic=None,
               max_grad_norm: float | None = 1.0, precision: Precision = Precision(),
               ranks: Ranks = ONE, seed: int = 0) -> dict[str, float]:
    """Compute advantages for the batch, then take `algorithm.updates` optimizer updates:
    `epochs` passes over the batch, each shuffled by `seed` and cut into `mini_batches`;
    each update accumulates gradients over micro-batches and steps.

    `reference` is the frozen model KL is measured against (needed when kl_coef > 0);
    `critic` the value model the gae advantage reads (trainer/critic.py), stepped with its own
    optimizer over the same mini-batches. Micro-batch losses are weighted by their share of
    the mini-batch's tokens (token-mean) or sequences (the per-sequence aggregations), so the
    gradient equals the whole mini-batch's. Ratios are taken against the logprobs the batch
    started from: the engine's (`old_logprobs: engine`, the policy's own where the engine
    gave none) or the policy's, recomputed before the first update (`recompute`).
    """
    _check_models(algorithm, reference, critic)
    prepared = _prepare(batch, algorithm, reference, critic, temperature, precision,
                        micro_batch)
    if algorithm.updates > 1 or algorithm.old_logprobs == "recompute":
        prepared.start = _no_grad_logprobs(model, batch, temperature, precision, micro_batch)
    stepped = [(model, optimizer, "grad_norm")]
    if critic is not None:
        stepped.append((critic.model, critic.optimizer, "critic/grad_norm"))
    updates = [_update(stepped, batch, rows, prepared, algorithm, micro_batch=micro_batch,
                       temperature=temperature, reference=reference, critic=critic,
                       max_grad_norm=max_grad_norm, precision=precision, ranks=ranks)
               for rows in update_rows(len(batch), algorithm, seed)]
    return {**prepared.metrics, **_summary(updates), "reward_mean": float(batch.rewards.mean()),
            "train_tokens": float(batch.mask.sum())}


def update_rows(rows: int, algorithm: Algorithm, seed: int) -> list[torch.Tensor]:
    """The rows of each update: one update over the batch in order, or each epoch a
    permutation drawn from `seed` cut into `mini_batches` nearly equal parts."""
    if algorithm.updates == 1:
        return [torch.arange(rows)]
    if algorithm.mini_batches > rows:
        raise ConfigError(f"trainer.algorithm.mini_batches: {algorithm.mini_batches} "
                          f"mini-batches of a {rows}-row batch leave some without rows; "
                          "lower it")
    generator = torch.Generator().manual_seed(seed)
    parts = []
    for _ in range(algorithm.epochs):
        order = torch.randperm(rows, generator=generator)
        cuts = [rows * m // algorithm.mini_batches for m in range(algorithm.mini_batches + 1)]
        parts += [order[low:high] for low, high in zip(cuts, cuts[1:])]
    return parts


def _update(stepped: list[tuple], batch: TrainBatch, index: torch.Tensor, prepared: _Prepared,
            algorithm: Algorithm, *, micro_batch: int, temperature: float, reference, critic,
            max_grad_norm: float | None, precision: Precision,
            ranks: Ranks) -> dict[str, float]:
    """One optimizer update on the rows `index` of the batch; its loss and metrics."""
    model = stepped[0][0]
    mini = batch if algorithm.updates == 1 else batch.rows(index.to(batch.input_ids.device))
    total_tokens, total_rows = float(mini.mask.sum()), len(mini)
    for _, optimizer, _ in stepped:
        optimizer.zero_grad(set_to_none=True)
    sums: dict[str, float] = {"loss": 0.0}
    if _flat_rows_add_nothing(algorithm, critic):  # every rank holds the update's advantages
        signal = _with_signal(prepared.advantages[index.to(prepared.advantages.device)])
        if not len(signal) and algorithm.flat_updates == "skip":
            return sums | {"rows_without_signal": float(total_rows), "skipped_update": 1.0} | {
                name: 0.0 for _, _, name in stepped if max_grad_norm is not None}
        if ranks.world == 1:  # several ranks run every row: each rank's share is fixed
            sums["rows_without_signal"] = float(total_rows - len(signal))
            mini, index = mini.rows(signal.to(mini.input_ids.device)), index[signal.cpu()]
            if not len(mini):  # flat_updates: step: AdamW steps on zero gradients, as TRL
                return sums | _zero_gradient_step(stepped, max_grad_norm)
    share = ranks.share(len(mini))
    if share.stop == share.start:
        raise ConfigError(f"an update of {total_rows} rows leaves trainer rank {ranks.rank} of "
                          f"{ranks.world} without rows: fewer trainer.workers or "
                          "trainer.algorithm.mini_batches, or larger batches")
    lengths = mini.lengths() if precision.packed_tokens is not None else None
    covered = 0.0  # the weight of the rows run (all of them unless some were skipped)
    for rows, counts in ranks.micro_batches(len(mini), micro_batch, is_sharded(model),
                                            lengths, precision.packed_tokens):
        part, at = mini.rows(rows), index[rows].to(prepared.advantages.device)
        weight = (float(part.mask.sum()) / total_tokens if algorithm.aggregation == "token-mean"
                  else len(part) / total_rows) if counts else 0.0
        loss, parts = _micro_batch_loss(model, part, at, prepared, algorithm, temperature,
                                        reference, precision)
        if critic is not None:
            critic_loss, critic_parts = critic.loss(part, prepared.old_values[at],
                                                    prepared.returns[at],
                                                    algorithm.aggregation, precision.dtype)
            (critic_loss * weight).backward()
            parts |= critic_parts | {"critic/loss": float(critic_loss.detach())}
        (loss * weight).backward()
        sums["loss"] += float(loss.detach()) * weight
        covered += weight
        for name, value in parts.items():  # weighted as the loss is: the batch's own mean
            sums[name] = sums.get(name, 0.0) + value * weight
    if sums.get("rows_without_signal") and covered > 0:  # the metrics: the trained rows' mean
        sums = {name: value if name in ("loss", "rows_without_signal") else value / covered
                for name, value in sums.items()}
    if ranks.world > 1:
        for stepped_model, _, _ in stepped:
            if not is_sharded(stepped_model):  # a sharded one summed its own
                sum_gradients(stepped_model, ranks)
        sums = sum_metrics(sums, ranks, model)
    return sums | optimizer_step(stepped, sums["loss"], max_grad_norm)


# policy losses proportional to the advantage: a row whose advantages are 0 has gradient 0
ZERO_AT_ZERO_ADVANTAGE = ("ppo", "gspo", "cispo", "opmd")


def _flat_rows_add_nothing(algorithm: Algorithm, critic) -> bool:
    """Whether rows without signal (advantage 0 at every token) add exactly nothing to the
    update: a loss proportional to the advantage and no term that is not (entropy, KL in
    the loss, a critic's value loss). On one rank they then skip the forward and backward
    passes; the loss is still normalised over every row's tokens, so the gradient is the
    same. An update with no such row at all is skipped whole (`flat_updates: skip`)."""
    return (algorithm.policy_loss in ZERO_AT_ZERO_ADVANTAGE and algorithm.entropy_coef == 0
            and not (algorithm.kl_coef > 0 and algorithm.kl_in == "loss") and critic is None)


def _with_signal(advantages: torch.Tensor) -> torch.Tensor:
    """Positions (in `advantages`' rows) of the rows with a non-zero advantage."""
    flat = advantages == 0 if advantages.dim() == 1 else (advantages == 0).all(dim=1)
    return torch.nonzero(~flat).flatten()


def _zero_gradient_step(stepped: list[tuple], max_grad_norm: float | None) -> dict[str, float]:
    """The optimizer step of an update whose every row was without signal (`flat_updates:
    step`): zero gradients (AdamW still moves the weights by its moments and decay, as the
    full pass would)."""
    for model, _, _ in stepped:
        for param in model.parameters():
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
    return optimizer_step(stepped, 0.0, max_grad_norm)


def _summary(updates: list[dict[str, float]]) -> dict[str, float]:
    """One update's metrics as they are; of several, their mean under the same names, the
    last update's under `last/`, and how many there were."""
    if len(updates) == 1:
        return updates[0]
    names = dict.fromkeys(name for update in updates for name in update)
    mean = {name: sum(update.get(name, 0.0) for update in updates) / len(updates)
            for name in names}
    return mean | {f"last/{name}": value for name, value in updates[-1].items()} | {
        "updates": float(len(updates))}


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
    norms, whole = {}, {}  # a sharded model's norm is a DTensor; whole: its value everywhere
    for model, _, name in stepped:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norms[name] = torch.nn.utils.get_total_norm(grads) if grads else torch.tensor(0.0)
        whole[name] = whole_norm(norms[name])
    if not math.isfinite(loss) or not all(torch.isfinite(norm) for norm in whole.values()):
        for model, optimizer, _ in stepped:
            optimizer.zero_grad(set_to_none=True)
        shown = ", ".join(f"{name} {float(norm):g}" for name, norm in whole.items())
        raise StepNotFinite(f"the loss is not finite ({loss:g}; {shown}): no weight was changed")
    metrics = {}
    for model, optimizer, name in stepped:
        if max_grad_norm is not None:
            params = [p for p in model.parameters() if p.grad is not None]
            torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, norms[name])
            metrics[name] = float(whole[name])
        optimizer.step()
    return metrics


def _prepare(batch: TrainBatch, algorithm: Algorithm, reference, critic, temperature: float,
             precision: Precision, micro_batch: int) -> _Prepared:
    """Advantages of the whole batch (groups and whitening span it), with the KL folded into
    the reward and the critic's values and targets where the algorithm asks for them."""
    token_rewards = ref_logprobs = values = returns = None
    metrics: dict[str, float] = {}
    if algorithm.kl_coef > 0 and algorithm.kl_in == "reward":
        with running(reference) as frozen:
            ref_logprobs = _no_grad_logprobs(frozen, batch, temperature, precision, micro_batch)
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
        return torch.cat([token_logprobs(model, batch.rows(rows), temperature,
                                         chunk=precision.chunk, packed=precision.packed)
                          for rows in precision.micro_slices(batch, micro_batch)])


def _micro_batch_loss(model, part: TrainBatch, rows: torch.Tensor | slice,
                      prepared: _Prepared, algorithm: Algorithm, temperature: float, reference,
                      precision: Precision) -> tuple[torch.Tensor, dict[str, float]]:
    """The micro-batch's loss and its metrics (policy, importance weights, KL, entropy);
    `rows` are its rows in the whole batch."""
    device = part.input_ids.device
    with autocast(device, precision.dtype):
        out = token_logprobs(model, part, temperature, chunk=precision.chunk,
                             entropy=algorithm.entropy_coef > 0, packed=precision.packed)
    logprobs, entropy = out if algorithm.entropy_coef > 0 else (out, None)
    advantages = prepared.advantages[rows]
    own = logprobs.detach() if prepared.start is None else prepared.start[rows]
    engine = torch.where(part.old_logprobs.isnan(), own, part.old_logprobs)
    old, parts = (own if algorithm.old_logprobs == "recompute" else engine), {}
    if algorithm.tis_cap is not None:  # ratio against the trainer's own old policy, and each
        weight = torch.exp(own - engine).clamp(max=algorithm.tis_cap)  # token weighted
        per_token = advantages[:, None] if advantages.dim() == 1 else advantages
        advantages = per_token * weight  # by min(p_train / p_engine, C)
        old = own
        parts = {"tis/weight_mean": float(aggregate(weight, part.mask)),
                 "tis/truncated": float(aggregate((weight >= algorithm.tis_cap).float(),
                                                  part.mask))}
    loss, policy = call(POLICY_LOSSES.get(algorithm.policy_loss), logprobs, old, advantages,
                        part.mask, **algorithm.options())
    parts |= policy
    if algorithm.kl_coef > 0 and algorithm.kl_in == "loss":
        with torch.no_grad(), autocast(device, precision.dtype), running(reference) as frozen:
            ref_logprobs = token_logprobs(frozen, part, temperature, chunk=precision.chunk,
                                          packed=precision.packed)
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
