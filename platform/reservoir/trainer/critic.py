"""PPO's critic: a value model (a causal LM's decoder with a scalar head) and its optimizer.

The decoder comes from `trainer.critic.path` (a Hugging Face folder) or, unset, from a copy of
the policy's start weights; the head starts at zero, so the first values are 0. Values are
aligned with token logprobs: position t holds V(prefix up to token t), the state in which
token t + 1 was chosen. The critic's weights and optimizer state travel in every checkpoint
(`critic.safetensors`, `critic.pt`) and are restored on resume.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from reservoir.devices import autocast
from reservoir.models import load_model, load_weights, save_weights
from reservoir.trainer.algorithms import value_loss
from reservoir.trainer.batch import TrainBatch
from reservoir.trainer.optimizer import adamw


class ValueModel(torch.nn.Module):
    def __init__(self, decoder: torch.nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.decoder = decoder
        self.head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, batch: TrainBatch) -> torch.Tensor:
        """Values [B, L - 1] in float32."""
        hidden = self.decoder(input_ids=batch.input_ids,
                              attention_mask=batch.attention_mask).last_hidden_state
        return self.head(hidden[:, :-1]).float()[..., 0]


@dataclass
class Critic:
    model: ValueModel
    optimizer: torch.optim.Optimizer
    value_clip: float | None = 0.2

    def values(self, batch: TrainBatch, micro_batch: int, dtype: str = "float32") -> torch.Tensor:
        """The values of a whole batch without gradients, micro-batch by micro-batch."""
        device = batch.input_ids.device
        with torch.no_grad(), autocast(device, dtype):
            return torch.cat([self.model(batch.rows(slice(start, start + micro_batch)))
                              for start in range(0, len(batch), micro_batch)])

    def loss(self, part: TrainBatch, old_values: torch.Tensor, returns: torch.Tensor,
             aggregation: str, dtype: str = "float32") -> tuple[torch.Tensor, dict]:
        with autocast(part.input_ids.device, dtype):
            values = self.model(part)
        return value_loss(values, old_values, returns, part.mask, value_clip=self.value_clip,
                          aggregation=aggregation)

    def save(self, folder: Path) -> None:
        save_weights(self.model, folder / "critic.safetensors")
        torch.save({"optimizer": self.optimizer.state_dict()}, folder / "critic.pt")

    def load(self, folder: Path) -> None:
        load_weights(self.model, folder / "critic.safetensors")
        state = torch.load(folder / "critic.pt", weights_only=True, map_location="cpu")
        self.optimizer.load_state_dict(state["optimizer"])


def build_critic(path: Path, device: torch.device, *, lr: float, value_clip: float | None,
                 weight_decay: float = 0.0) -> Critic:
    """A value model from the causal LM at `path` (its decoder; the LM head is dropped)."""
    lm, _ = load_model(path)
    model = ValueModel(lm.get_decoder(), lm.config.hidden_size).to(device)
    model.train()
    return Critic(model, adamw(model, lr, weight_decay), value_clip)
