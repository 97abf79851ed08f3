"""Devices and precision: a config's `auto | cpu | cuda | cuda:N` made a torch device, the GPUs a
worker asks Ray for, and the random generators a checkpoint must keep on each device.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from reservoir.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_device(name: str, *, key: str = "device", rank: int = 0) -> torch.device:
    """The torch device a config value names; auto is CUDA when one is available. A pool's rank
    r takes the r-th GPU counted from the one named (cuda = cuda:0)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"{key}: {name} but torch sees no CUDA device (torch "
                          f"{torch.__version__}); use cpu or auto")
    index = (int(name.split(":")[1]) if ":" in name else 0) + rank
    if index >= torch.cuda.device_count():
        raise ConfigError(f"{key}: {name} (rank {rank}) needs GPU {index}, but only "
                          f"{torch.cuda.device_count()} are visible")
    return torch.device("cuda", index)


def gpus_wanted(name: str, ranks: int = 1) -> int:
    """GPUs a Ray actor running `ranks` ranks on `name` must declare (Ray hides the others)."""
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return 0
    return ranks


def autocast(device: torch.device, dtype: str):
    """bf16 compute with float32 weights (and so float32 optimizer state); float32 as is."""
    if dtype == "float32":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[dtype])


def rng_state() -> dict[str, torch.Tensor | list[torch.Tensor]]:
    """torch's generators: the CPU one, and every CUDA device's when CUDA is in use."""
    state: dict = {"torch_rng": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda_rng"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` saved; CUDA states only where CUDA is present (a checkpoint
    moved to a CPU resumes with the CPU generator alone)."""
    torch.set_rng_state(state["torch_rng"])
    cuda = state.get("cuda_rng")
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[:torch.cuda.device_count()])
