"""Sharded training (`trainer.sharding: fsdp2`): torch's `fully_shard` on every decoder layer
and the whole model, so each of the pool's N ranks holds 1/N of the parameters, gradients and
optimizer state.

Parameters stay float32 shards; with `trainer.dtype: bfloat16` each layer's weights are gathered
in bf16 for compute and gradients reduced in float32 (`MixedPrecisionPolicy`). Gradients are
summed over ranks (not averaged: each rank's loss is already weighted by its share of the
batch), reduce-scattered after each micro-batch's backward. Everything that touches whole
weights is a collective every rank enters together, which the pool arranges:

- a checkpoint is `torch.distributed.checkpoint` (DCP) files, one per rank plus metadata, under
  `step-N/sharded/`; DCP re-shards on load, so it loads at any world size, and unsharded into a
  plain model (`reservoir model export`, an unsharded run's resume or branch); an unsharded
  checkpoint loads into a sharded run too (whole weights and optimizer state, then sharded);
- publishing gathers the full weights once to rank 0's CPU (`full_state`), which writes the one
  file every engine loads in place (see README, "Train a real model", for why not per-shard);
- evaluation unshards every layer on every rank (`whole`) while rank 0 generates alone.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict, set_state_dict)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

SHARDS = "sharded"  # a sharded checkpoint's DCP folder


def shard(model, dtype: str):
    """`fully_shard` on each decoder layer (the model's `_no_split_modules`) and on the model,
    in place; gradients summed over ranks."""
    compute = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    layer_types = set(base_of(model)._no_split_modules or ())
    for module in list(model.modules()):
        if type(module).__name__ in layer_types:
            fully_shard(module, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    for module in _sharded(model):
        module.set_gradient_divide_factor(1.0)          # a sum, as the unsharded pool's
        module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
    return model


def is_sharded(model) -> bool:
    return isinstance(model, FSDPModule)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor as this rank holds it (a DTensor's shard)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def whole_norm(norm: torch.Tensor) -> torch.Tensor:
    """A norm over sharded gradients as one number every rank holds (a collective)."""
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def frozen_copy(model, dtype: str):
    """A sharded, frozen copy of a sharded policy (a stage's reference): built on the meta
    device, sharded alike, then each rank's shards and the buffers copied; no full copy."""
    with torch.device("meta"):
        copy = AutoModelForCausalLM.from_config(base_of(model).config)
    shard(copy, dtype)
    copy.to_empty(device=next(local(p) for p in model.parameters()).device)
    with torch.no_grad():
        for mine, theirs in zip(copy.parameters(), base_of(model).parameters(), strict=True):
            local(mine).copy_(local(theirs))
        for mine, theirs in zip(copy.buffers(), base_of(model).buffers(), strict=True):
            mine.copy_(theirs)
    for param in copy.parameters():
        param.requires_grad_(False)
    return copy.eval()


def full_state(model) -> dict[str, torch.Tensor]:
    """The whole weights on rank 0's CPU under the model's own names (every rank calls it; the
    others get {})."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                  cpu_offload=True))


@contextmanager
def whole(model):
    """Every layer gathered on every rank until the block ends (all ranks enter it), so one
    rank may run the model alone (evaluation)."""
    modules = list(_sharded(model))
    for module in modules:
        module.unshard()
        module.set_reshard_after_forward(False)
    try:
        yield model
    finally:
        for module in modules:
            module.reshard()
            module.set_reshard_after_forward(True)


def is_sharded_checkpoint(folder: Path) -> bool:
    return (Path(folder) / SHARDS / ".metadata").is_file()


def sharded_names(folder: Path) -> list[str]:
    """The names of the tensors a sharded checkpoint holds (from its metadata)."""
    reader = dcp.FileSystemReader(Path(folder) / SHARDS)
    return list(reader.read_metadata().state_dict_metadata)


def save_shards(folder: Path, model, optimizer) -> None:
    """This rank's shards of the weights and optimizer state into `folder/sharded` (every
    rank calls it). A fresh optimizer (a stage's start) has no state to save: asking DCP for
    it would make one by a zero step, which counts as AdamW's first."""
    if not optimizer.state:
        state = {"model": get_model_state_dict(model)}
    else:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
    dcp.save(state, checkpoint_id=Path(folder) / SHARDS)


def load_shards(folder: Path, model, optimizer=None) -> None:
    """A sharded checkpoint into `model` (and `optimizer`, left fresh where the checkpoint
    holds no optimizer state), sharded at any world size or not sharded at all (then read by
    this process alone)."""
    alone, folder = not is_sharded(model), Path(folder)
    if optimizer is None or not any(name.startswith("optimizer.")
                                    for name in sharded_names(folder)):
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=folder / SHARDS, no_dist=alone)
        set_model_state_dict(model, state["model"])
        return
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=folder / SHARDS, no_dist=alone)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])


def load_full(model, state: dict[str, torch.Tensor]) -> None:
    """Whole weights (every rank holds them) into a sharded model; names the model lacks are
    refused by the caller's shape check, missing ones (a LoRA model's base) are kept."""
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True,
                                                                strict=False))


def load_full_optimizer(model, optimizer, saved: dict) -> None:
    """An unsharded optimizer's state (`optimizer.state_dict()`: parameters by position, in
    the order of the trainable parameters) into a sharded model's optimizer."""
    if not saved["state"]:
        return  # a fresh optimizer: as the one `optimizer` is
    names = [name for name, param in model.named_parameters() if param.requires_grad]
    by_name = {"state": {names[index]: state for index, state in saved["state"].items()},
               "param_groups": [{**group, "params": [names[i] for i in group["params"]]}
                                for group in saved["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, by_name,
                             options=StateDictOptions(full_state_dict=True))


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _sharded(model):
    return (module for module in model.modules() if isinstance(module, FSDPModule))


def base_of(model):
    """The model under a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model
