"""Checkpoints: model weights, optimizer state, RNG states and the step, so a run resumes exactly.

Layout of `DIR/step-000042/`: the model as `save_pretrained` writes it (safetensors; for a
LoRA run, peft's adapter files only), or for a sharded run (trainer.sharding: fsdp2) every
rank's shards of the weights and optimizer state under `sharded/` (trainer/sharding.py);
`trainer.pt` (optimizer state unless sharded, and torch's CPU and CUDA RNG states: tensors and
numbers only, loaded with `weights_only=True`), `state.json` (step, policy version, Python and
numpy RNG states). Rank 0 writes all but the shards, and renames the folder into place once
every rank has written.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from peft import PeftModel
from transformers import AutoModelForCausalLM

from reservoir.devices import rng_state, set_rng_state
from reservoir.errors import ConfigError
from reservoir.trainer.adapters import has_adapters, load_adapters
from reservoir.trainer.sharding import (barrier, is_sharded, is_sharded_checkpoint, load_full,
                                        load_full_optimizer, load_shards, save_shards,
                                        sharded_names)


@dataclass(frozen=True)
class Resumed:
    step: int
    version: int


def save_checkpoint(root: Path, step: int, version: int, model, optimizer) -> Path:
    """Write a complete checkpoint atomically (a temporary folder renamed into place); a
    sharded model's ranks all call it: each writes its shards, rank 0 the rest."""
    final = Path(root) / f"step-{step:06d}"
    partial = final.with_name(final.name + ".partial")
    if not is_sharded(model):
        shutil.rmtree(partial, ignore_errors=True)
        model.save_pretrained(partial)
        _finish(partial, final, {"optimizer": optimizer.state_dict()}, step, version)
        return final
    first = _rank() == 0
    if first:
        shutil.rmtree(partial, ignore_errors=True)
    barrier()
    save_shards(partial, model, optimizer)
    barrier()
    if first:
        _finish(partial, final, {}, step, version)
    barrier()  # no rank goes on before the checkpoint is in place
    return final


def _finish(partial: Path, final: Path, held: dict, step: int, version: int) -> None:
    """The RNG states and the step beside the weights; the folder renamed into place."""
    torch.save({**held, **rng_state()}, partial / "trainer.pt")
    numpy_state = np.random.get_state()
    (partial / "state.json").write_text(json.dumps({
        "step": step, "version": version,
        "python_rng": _jsonable(random.getstate()),
        "numpy_rng": [numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]],
    }))
    shutil.rmtree(final, ignore_errors=True)
    partial.rename(final)


def latest_checkpoint(root: Path) -> Path | None:
    found = sorted(p for p in Path(root).glob("step-*") if not p.name.endswith(".partial"))
    return found[-1] if found else None


def load_checkpoint(path: Path, model, optimizer) -> Resumed:
    """Restore weights, optimizer and RNG states in place; return where the run stood."""
    if not (path / "state.json").is_file():
        raise ConfigError(f"{path} is not a complete checkpoint (no state.json)")
    state = json.loads((path / "state.json").read_text())
    trainer = torch.load(path / "trainer.pt", weights_only=True, map_location="cpu")
    if is_sharded_checkpoint(path):
        _check_kind(path, model)
        load_shards(path, model, optimizer)
    else:
        load_weights_of(path, model)
        if is_sharded(model):  # an unsharded run's checkpoint, resumed sharded
            load_full_optimizer(model, optimizer, trainer["optimizer"])
        else:
            optimizer.load_state_dict(trainer["optimizer"])
    set_rng_state(trainer)
    random.setstate(_tupled(state["python_rng"]))
    kind, keys, *rest = state["numpy_rng"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    return Resumed(step=state["step"], version=state["version"])


def load_weights_of(path: Path, model) -> None:
    """A checkpoint's weights into `model` in place: whole weights, or a LoRA run's adapters
    into a model with adapters of the same shape."""
    _check_kind(path, model)
    if is_sharded_checkpoint(path):
        load_shards(path, model)
    elif isinstance(model, PeftModel):
        load_adapters(model, path)
    else:
        weights = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).state_dict()
        if is_sharded(model):
            load_full(model, weights)
        else:
            model.load_state_dict(weights)


def _check_kind(path: Path, model) -> None:
    """Adapters load into a LoRA policy and whole weights into a fully trained one; the other
    way round is one line."""
    lora, held = isinstance(model, PeftModel), holds_adapters(path)
    if held != lora:
        what = "LoRA adapters" if held else "whole weights"
        raise ConfigError(f"trainer.lora: {path} holds {what}; this run trains "
                          f"{'adapters' if lora else 'every weight'} (a LoRA run continues "
                          "a LoRA run; `reservoir model export` makes any checkpoint a model "
                          "folder for model.path)")


def holds_adapters(path: Path) -> bool:
    """Whether a checkpoint (whole or sharded) holds a LoRA run's adapters."""
    if is_sharded_checkpoint(path):
        return any(".lora_" in name for name in sharded_names(path))
    return has_adapters(path)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _jsonable(value):
    return [_jsonable(v) for v in value] if isinstance(value, tuple) else value


def _tupled(value):
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value
