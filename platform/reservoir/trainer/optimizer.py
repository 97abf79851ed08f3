"""The optimizer every trainer side uses: AdamW, weight decay on matrices only."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

FUSED_DEVICES = ("cpu", "cuda")  # where torch's fused AdamW kernel runs


def adamw(model: torch.nn.Module, lr: float, weight_decay: float = 0.0) -> torch.optim.AdamW:
    """AdamW over `model`'s trainable parameters. `weight_decay` shrinks matrices (projections,
    embeddings) but never biases or norms' scales, as transformers' Trainer does; 0 (the
    default, as TRL's and transformers') keeps one parameter group, as checkpoints of earlier
    versions hold. Plain tensors on a CPU or GPU take torch's fused kernel (one call for every
    parameter: 0.33 ms a step against 1.5 for the per-tensor loop on the tiny model, this
    CPU; the same weights to 1e-8); sharded ones (DTensor) the default implementation."""
    trained = [p for p in model.parameters() if p.requires_grad]
    fused = bool(trained) and all(not isinstance(p, DTensor) and p.device.type in FUSED_DEVICES
                                  for p in trained)
    options = {"lr": lr, "fused": True} if fused else {"lr": lr}
    if not weight_decay:
        return torch.optim.AdamW(trained, weight_decay=0.0, **options)
    return torch.optim.AdamW(
        [{"params": [p for p in trained if p.dim() >= 2], "weight_decay": weight_decay},
         {"params": [p for p in trained if p.dim() < 2], "weight_decay": 0.0}], **options)
