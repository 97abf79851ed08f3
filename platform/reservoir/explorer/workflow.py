"""Workflows: how a task becomes a group of experiences. Single-turn: prompt -> n samples ->
rewards -> one group, written whole."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from reservoir.explorer.engine import Engine, Sample
from reservoir.explorer.rewards import RewardFunction, score
from reservoir.store import Experience
from reservoir.store.writer import WriteResult


@dataclass(frozen=True)
class Task:
    id: int
    prompt: str
    answer: str


def group_of(run: str, task: Task, samples: Sequence[Sample], rewards: list[RewardFunction],
             policy_version: int) -> list[Experience]:
    group = []
    for sample in samples:
        total, components = score(sample.text, task.answer, rewards)
        group.append(Experience(
            run=run, task_id=task.id, policy_version=policy_version, prompt_text=task.prompt,
            response_text=sample.raw_text, prompt_ids=sample.prompt_ids,
            response_ids=sample.response_ids, logprobs=sample.logprobs,
            action_mask=[1] * len(sample.response_ids), reward=total,
            reward_components=components,
            metadata={"finished": sample.finished}))
    return group


def single_turn(engine: Engine, store, run: str, tasks: Sequence[Task], *, n: int,
                rewards: list[RewardFunction], policy_version: int, temperature: float = 1.0,
                max_tokens: int = 32, seed: int | None = None,
                status: str = "ready") -> WriteResult:
    """Sample n responses per task, score them, and write one group per task (`raw` when
    pipelines decide what becomes ready)."""
    samples = engine.sample([task.prompt for task in tasks], n, temperature=temperature,
                            max_tokens=max_tokens, seed=seed)
    groups = [group_of(run, task, group, rewards, policy_version)
              for task, group in zip(tasks, samples)]
    return store.write_groups(groups, status=status)
