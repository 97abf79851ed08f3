"""Checkpoints: model weights, optimizer state, RNG states and the step, so a run resumes exactly.

Layout of `DIR/step-000042/`: the model as `save_pretrained` writes it (safetensors; for a
LoRA run, peft's adapter files only),
`trainer.pt` (optimizer state and torch's CPU and CUDA RNG states: tensors and numbers only,
loaded with `weights_only=True`), `state.json` (step, policy version, Python and numpy RNG states).
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from peft import PeftModel

from reservoir.devices import rng_state, set_rng_state
from reservoir.errors import ConfigError
from reservoir.trainer.adapters import has_adapters, load_adapters


@dataclass(frozen=True)
class Resumed:
    step: int
    version: int


def save_checkpoint(root: Path, step: int, version: int, model, optimizer) -> Path:
    """Write a complete checkpoint atomically (a temporary folder renamed into place)."""
    final = Path(root) / f"step-{step:06d}"
    partial = final.with_name(final.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    torch.save({"optimizer": optimizer.state_dict(), **rng_state()}, partial / "trainer.pt")
    numpy_state = np.random.get_state()
    (partial / "state.json").write_text(json.dumps({
        "step": step, "version": version,
        "python_rng": _jsonable(random.getstate()),
        "numpy_rng": [numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]],
    }))
    shutil.rmtree(final, ignore_errors=True)
    partial.rename(final)
    return final


def latest_checkpoint(root: Path) -> Path | None:
    found = sorted(p for p in Path(root).glob("step-*") if not p.name.endswith(".partial"))
    return found[-1] if found else None


def load_checkpoint(path: Path, model, optimizer) -> Resumed:
    """Restore weights, optimizer and RNG states in place; return where the run stood."""
    if not (path / "state.json").is_file():
        raise ConfigError(f"{path} is not a complete checkpoint (no state.json)")
    state = json.loads((path / "state.json").read_text())
    load_weights_of(path, model)
    trainer = torch.load(path / "trainer.pt", weights_only=True, map_location="cpu")
    optimizer.load_state_dict(trainer["optimizer"])
    set_rng_state(trainer)
    random.setstate(_tupled(state["python_rng"]))
    kind, keys, *rest = state["numpy_rng"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    return Resumed(step=state["step"], version=state["version"])


def load_weights_of(path: Path, model) -> None:
    """A checkpoint's weights into `model` in place: whole weights, or a LoRA run's adapters
    into a model with adapters of the same shape."""
    lora = isinstance(model, PeftModel)
    if has_adapters(path) != lora:
        held = "LoRA adapters" if has_adapters(path) else "whole weights"
        raise ConfigError(f"trainer.lora: {path} holds {held}; this run trains "
                          f"{'adapters' if lora else 'every weight'} (a LoRA run continues "
                          "a LoRA run; `reservoir model export` makes any checkpoint a model "
                          "folder for model.path)")
    if lora:
        load_adapters(model, path)
    else:
        model.load_state_dict(type(model).from_pretrained(path, local_files_only=True)
                              .state_dict())


def _jsonable(value):
    return [_jsonable(v) for v in value] if isinstance(value, tuple) else value


def _tupled(value):
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value
