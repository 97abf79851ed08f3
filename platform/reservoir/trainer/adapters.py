"""LoRA adapters on the policy (peft): what trains, what the reference is, what is published.

With `trainer.lora`, the policy is the base model wrapped by peft: only the adapters
(`lora_A`, `lora_B` of each target module) require gradients and sit in the optimizer. The
reference KL and DPO measure against is the base itself, the adapters disabled while it runs
(`AdaptersOff`), so no second copy of the model is held. A checkpoint holds the adapters and
their optimizer state (peft's `adapter_model.safetensors`, `adapter_config.json`); a published
policy version is the merged weights (base + alpha / r x B A, computed from the weights
without touching the model), so every engine takes it in place as it takes a fully trained
policy's.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig as PeftLoraConfig, PeftModel, get_peft_model
from peft import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file

from reservoir.config import LoraConfig
from reservoir.errors import ConfigError
from reservoir.trainer.sharding import is_sharded, load_full

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER = "default"  # peft's name of the one adapter


def with_adapters(model, lora: LoraConfig, *, seed: int) -> PeftModel:
    """The model wrapped with fresh adapters (B = 0: it computes what the base does); the
    adapters' A starts from `seed`, the same on every rank."""
    config = PeftLoraConfig(r=lora.rank, lora_alpha=lora.scale_alpha, lora_dropout=lora.dropout,
                            target_modules=list(lora.target_modules), bias="none")
    torch.manual_seed(seed)
    try:
        return get_peft_model(model, config)
    except ValueError as exc:  # peft: "Target modules {...} not found in the base model"
        raise ConfigError(f"trainer.lora.target_modules: {exc}".splitlines()[0]) from None


def has_adapters(folder: Path) -> bool:
    """Whether a checkpoint holds adapters (a LoRA run's) rather than whole weights."""
    return (Path(folder) / ADAPTER_FILE).is_file()


def load_adapters(model: PeftModel, folder: Path) -> None:
    """The adapters of a LoRA checkpoint into `model`, in place; adapters of another shape
    (rank, target modules) are one line."""
    state = load_file(str(Path(folder) / ADAPTER_FILE), device="cpu")
    expected = get_peft_model_state_dict(model)
    shapes = {name: tuple(t.shape) for name, t in expected.items()}
    found = {name: tuple(t.shape) for name, t in state.items()}
    if shapes != found:
        raise ConfigError(f"{folder}: its adapters ({_describe(found)}) are not of "
                          f"trainer.lora's shape ({_describe(shapes)})")
    if is_sharded(model):  # peft's names in the file, the model's own (adapter named)
        load_full(model, {name.replace(".weight", f".{ADAPTER}.weight"): tensor
                          for name, tensor in state.items()})
    else:
        set_peft_model_state_dict(model, state)


def _describe(shapes: dict[str, tuple]) -> str:
    ranks = {shape[0] for name, shape in shapes.items() if "lora_A" in name}
    return f"{len(shapes)} tensors, rank {', '.join(map(str, sorted(ranks))) or '-'}"


@torch.no_grad()
def merged_state(state: dict[str, torch.Tensor], lora: LoraConfig) -> dict[str, torch.Tensor]:
    """A LoRA policy's weights (peft's names: `base_model.model.` + `...base_layer.weight`,
    `...lora_A.default.weight`, `...lora_B.default.weight`) merged into the base model's
    names: W + alpha / r x B A for each adapted layer, every other tensor as it is."""
    scale, merged = lora.scale_alpha / lora.rank, {}
    for name, tensor in state.items():
        if ".lora_" in name:
            continue
        base = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        if name.endswith(".base_layer.weight"):
            layer = name.removesuffix(".base_layer.weight")
            down = state[f"{layer}.lora_A.{ADAPTER}.weight"]
            up = state[f"{layer}.lora_B.{ADAPTER}.weight"]
            tensor = tensor + scale * (up.to(tensor.dtype) @ down.to(tensor.dtype))
        merged[base] = tensor
    return merged


@dataclass(frozen=True)
class AdaptersOff:
    """A LoRA policy's base as the frozen reference: the same model, adapters disabled."""

    policy: PeftModel


@contextmanager
def running(reference):
    """The reference as a model to run: a frozen copy as it is, an `AdaptersOff` as its
    policy with the adapters disabled for as long as it runs."""
    if isinstance(reference, AdaptersOff):
        with reference.policy.disable_adapter():
            yield reference.policy
    else:
        yield reference
