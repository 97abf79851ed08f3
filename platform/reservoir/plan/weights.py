"""Where a run's weights come from: its model folder, the checkpoint a branched run starts
from, a checkpoint of a step (trainer.checkpoint_dir/RUN/step-NNNNNN). Paths only: no torch."""

from __future__ import annotations

from pathlib import Path

from reservoir.config import ReservoirConfig
from reservoir.errors import ConfigError


def check_model(config: ReservoirConfig) -> None:
    if not (Path(config.model.path) / "config.json").is_file():
        raise ConfigError(f"model.path: {config.model.path} is not a model folder (no "
                          "config.json); build one with `reservoir model tiny "
                          f"{config.model.path}`")


def branch_checkpoint(config: ReservoirConfig) -> Path:
    """The checkpoint a branched run starts from: trainer.checkpoint_dir/RUN/step-STEP."""
    name, step = config.branch
    return find_checkpoint(Path(config.trainer.checkpoint_dir) / name, step,
                           f"--from {name}@{step}")


def find_checkpoint(runs: Path, step: int | None, label: str) -> Path:
    """A run's checkpoint of `step` (None: its last) in its checkpoint folder `runs`; one line
    listing the steps there when there is none."""
    kept = sorted(int(p.name.removeprefix("step-")) for p in runs.glob("step-*")
                  if p.name.removeprefix("step-").isdigit() and (p / "state.json").is_file())
    if step is None and kept:
        step = kept[-1]
    if step not in kept:
        wanted = "no checkpoint" if step is None else f"no checkpoint of step {step}"
        raise ConfigError(f"{label}: {wanted} in {runs} (checkpoints there: "
                          f"{', '.join(map(str, kept)) or 'none'})")
    return runs / f"step-{step:06d}"
