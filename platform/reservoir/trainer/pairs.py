"""A preference step (DPO): chosen and rejected responses against a frozen reference.

The batch holds the chosen responses first and the rejected ones after them, pair i being
rows i and i + N. Each response's log-ratio is the sum over its trained tokens of
log pi - log pi_ref; the preference loss (trainer.algorithms.PREFERENCE_LOSSES) compares them.
Micro-batches take whole pairs; in a pool each rank trains its share of the pairs
(`Ranks.micro_batches`).
"""

from __future__ import annotations

import torch

from reservoir.devices import autocast
from reservoir.trainer.algorithms import PREFERENCE_LOSSES, call
from reservoir.trainer.adapters import running
from reservoir.trainer.batch import TrainBatch, token_logprobs
from reservoir.plan.presets import Algorithm
from reservoir.trainer.sharding import is_sharded
from reservoir.trainer.step import (ONE, Precision, Ranks, optimizer_step, sum_gradients,
                                    sum_metrics)


def pair_rows(batch: TrainBatch, pairs: slice) -> TrainBatch:
    """The chosen and rejected rows of `pairs`, chosen first."""
    half = len(batch) // 2
    index = torch.cat([torch.arange(half)[pairs], torch.arange(half)[pairs] + half])
    return TrainBatch(*(tensor[index.to(tensor.device)] for tensor in batch._tensors()))


def log_ratios(model, reference, part: TrainBatch, precision: Precision) -> torch.Tensor:
    """Per row: sum over trained tokens of log pi - log pi_ref."""
    device = part.input_ids.device
    with autocast(device, precision.dtype):
        logprobs = token_logprobs(model, part, chunk=precision.chunk, packed=precision.packed)
    with torch.no_grad(), autocast(device, precision.dtype), running(reference) as frozen:
        ref = token_logprobs(frozen, part, chunk=precision.chunk, packed=precision.packed)
    return ((logprobs - ref) * part.mask).sum(-1)


def preference_step(model, optimizer, batch: TrainBatch, algorithm: Algorithm, *, reference,
                    micro_batch: int, precision: Precision = Precision(),
                    max_grad_norm: float | None = 1.0, ranks: Ranks = ONE) -> dict[str, float]:
    if reference is None:
        raise ValueError("a preference loss needs the frozen reference model")
    if len(batch) % 2:
        raise ValueError(f"a preference batch holds pairs: {len(batch)} rows")
    pairs = len(batch) // 2
    per_micro = max(1, micro_batch // 2)
    optimizer.zero_grad(set_to_none=True)
    sums: dict[str, float] = {"loss": 0.0}
    for chunk, counts in ranks.micro_batches(pairs, per_micro, is_sharded(model)):
        part = pair_rows(batch, chunk)
        ratios = log_ratios(model, reference, part, precision)
        half = len(part) // 2
        loss, metrics = call(PREFERENCE_LOSSES.get(algorithm.preference_loss), ratios[:half],
                             ratios[half:], **algorithm.options())
        weight = half / pairs if counts else 0.0
        (loss * weight).backward()
        sums["loss"] += float(loss.detach()) * weight
        for name, value in metrics.items():
            sums[name] = sums.get(name, 0.0) + value * weight
    if ranks.world > 1:
        if not is_sharded(model):  # a sharded model summed its own
            sum_gradients(model, ranks)
        sums = sum_metrics(sums, ranks, model)
    stepped = optimizer_step([(model, optimizer, "grad_norm")], sums["loss"], max_grad_norm)
    return {**stepped, **sums,
            "pairs": float(pairs), "train_tokens": float(batch.mask.sum())}
