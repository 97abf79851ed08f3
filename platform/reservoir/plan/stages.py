"""A run's stages: which algorithm trains which steps on which data (no torch here: explorers
read the plan to pace themselves).

Steps are numbered through the whole run (step 0 is the start); stage k covers
`first_step .. last_step`. Without `stages:` in the config the plan is the classic one: an
optional supervised warm-up (`trainer.warmup_steps` of sft on the train tasks' answers), then
`trainer.steps` of `trainer.algorithm` on the explorers' rollouts.
"""

from __future__ import annotations

from dataclasses import dataclass

from reservoir.config import ReservoirConfig, StageData, TaskData
from reservoir.plan.presets import PRESETS, Algorithm


@dataclass(frozen=True)
class Stage:
    index: int
    name: str
    algorithm: Algorithm
    first_step: int
    steps: int
    lr: float
    batch: int          # groups, pairs or tasks per step
    data: StageData

    @property
    def last_step(self) -> int:
        return self.first_step + self.steps - 1

    @property
    def explores(self) -> bool:
        return self.data.kind == "explorers"


def plan(config: ReservoirConfig) -> tuple[Stage, ...]:
    trainer, tis = config.trainer, {"tis_cap": config.trainer.tis_cap}
    stages, first = [], 1
    if config.stages:
        for index, stage in enumerate(config.stages):
            stages.append(Stage(index, stage.name, stage.algorithm.resolve(**tis), first,
                                stage.steps, stage.lr or trainer.lr,
                                stage.batch or trainer.batch_groups, _data(config, stage.data)))
            first += stage.steps
        return tuple(stages)
    if trainer.warmup_steps:
        stages.append(Stage(0, "warm-up", PRESETS["sft"], 1, trainer.warmup_steps,
                            trainer.warmup_lr, trainer.warmup_batch,
                            StageData(tasks=TaskData(fraction=trainer.warmup_fraction))))
        first += trainer.warmup_steps
    stages.append(Stage(len(stages), "rl", trainer.algorithm.resolve(**tis), first,
                        trainer.steps, trainer.lr, trainer.batch_groups,
                        StageData(explorers=True)))
    return tuple(stages)


def _data(config: ReservoirConfig, data: StageData) -> StageData:
    """The stage's data; a `data: tasks` stage that sets no fraction takes the deprecated
    trainer.warmup_fraction where the config still sets it (ReservoirConfig.deprecations)."""
    if data.tasks is None or "fraction" in data.tasks.model_fields_set or \
            "warmup_fraction" not in config.trainer.model_fields_set:
        return data
    return StageData(tasks=TaskData(fraction=config.trainer.warmup_fraction))


def stage_at(stages: tuple[Stage, ...], step: int) -> Stage | None:
    """The stage that trains `step` (None past the last, or for step 0)."""
    for stage in stages:
        if stage.first_step <= step <= stage.last_step:
            return stage
    return None


def last_step(stages: tuple[Stage, ...]) -> int:
    return stages[-1].last_step


def total_steps(config: ReservoirConfig) -> int:
    """The run's last step, over all its stages."""
    return last_step(plan(config))


def step_seed(seed: int, step: int) -> int:
    """The seed of a step's own draws (its mini-batches' order): the same on every rank and
    when the step is replayed on resume, different from step to step."""
    return (seed * 1_000_003 + step) % 2**63
