"""Held-out accuracy: the run's workflow on test tasks, greedily, one sample each, scored by
each task's reward (the mean of its `accuracy` component, or of the reward where it has none)."""

from __future__ import annotations

import numpy as np

from reservoir.config import ReservoirConfig
from reservoir.explorer.batcher import Batcher
from reservoir.explorer.engine import Engine, TransformersEngine
from reservoir.explorer.policy import Sampling
from reservoir.explorer.workflow import Task, explore, make_workflow


def accuracy(engine: Engine, tasks: list[tuple], config: ReservoirConfig) -> float:
    """Mean accuracy over (id, prompt, answer, payload) tasks; NaN if there are none."""
    if not tasks:
        return float("nan")
    explorer = config.explorer
    workflow = make_workflow(explorer.workflow, explorer.workflow_options)
    with Batcher(engine, inline=True) as batcher:
        groups = explore(workflow, [Task.of(row) for row in tasks], batcher,
                         Sampling(n=1, temperature=0, max_tokens=explorer.max_tokens),
                         run=config.run.name, version=0, reward=explorer.reward,
                         reward_options=explorer.reward_options)
    return float(np.mean([row.reward_components.get("accuracy", row.reward)
                          for group in groups for row in group]))


def held_out_accuracy(config: ReservoirConfig, model, tokenizer, tasks: list[tuple]) -> float:
    """`accuracy` of a model in memory (the trainer's policy)."""
    return accuracy(TransformersEngine.of(model, tokenizer), tasks, config)
