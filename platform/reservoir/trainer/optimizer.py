"""The optimizer every trainer side uses: AdamW, weight decay on matrices only."""

from __future__ import annotations

import torch


def adamw(model: torch.nn.Module, lr: float, weight_decay: float = 0.0) -> torch.optim.AdamW:
    """AdamW over `model`'s trainable parameters. `weight_decay` shrinks matrices (projections,
    embeddings) but never biases or norms' scales, as transformers' Trainer does; 0 (the
    default, as TRL's and transformers') keeps one parameter group, as checkpoints of earlier
    versions hold."""
    trained = [p for p in model.parameters() if p.requires_grad]
    if not weight_decay:
        return torch.optim.AdamW(trained, lr=lr, weight_decay=0.0)
    return torch.optim.AdamW(
        [{"params": [p for p in trained if p.dim() >= 2], "weight_decay": weight_decay},
         {"params": [p for p in trained if p.dim() < 2], "weight_decay": 0.0}], lr=lr)
