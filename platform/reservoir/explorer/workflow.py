"""Workflows: how a task becomes a group of experiences.

A workflow is a registered function `workflow(task, policy, **options) -> list[Experience]`
(or a class whose instances, built once with the options, are called so): it receives one task
and a `Policy` bound to the explorer's engine (reservoir.explorer.policy) and returns the task's
group. `explorer.workflow` names it, `explorer.workflow_options` are its keyword options.

Built in: `single_turn` (n samples of the prompt, scored by the reward function),
`calculator` (the model calls a calculator tool; reservoir.explorer.tools.Calculator) and
`guess_number` (a multi-turn game with feedback each turn; reservoir.explorer.guess). Packages add their own
under the entry-point group `reservoir.workflows`, as reward functions do under
`reservoir.rewards`.

`explore` runs a workflow over a batch of tasks: one thread per task (at most MAX_THREADS at
a time), all generation batched through one `Batcher`, and checks that every group belongs to
its run, task and version.
"""

from __future__ import annotations

import functools
import inspect
from concurrent.futures import wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from reservoir.errors import ConfigError, ReservoirError, WorkflowError
from reservoir.explorer.rewards import REWARDS, Context, RewardFunction, bound
from reservoir.registry import Registry
from reservoir.store import Experience

if TYPE_CHECKING:  # the runner's parts need torch; the registry and Task do not (the config
    from reservoir.explorer.batcher import Batcher  # checks names against it)
    from reservoir.explorer.policy import Policy, Sampling

WORKFLOWS: Registry = Registry("workflow", group="reservoir.workflows")
WORKFLOWS.register_lazy("calculator", "reservoir.explorer.tools:Calculator")
WORKFLOWS.register_lazy("guess_number", "reservoir.explorer.guess:GuessNumber")
Workflow = Callable[..., list[Experience]]
MAX_THREADS = 256  # tasks run side by side; more wait for the next round of threads


@dataclass(frozen=True)
class Task:
    id: int | None
    prompt: str
    answer: str | None = None
    payload: dict[str, Any] = field(default_factory=dict)

    @property
    def messages(self) -> list[dict[str, str]]:
        """The conversation a single-turn sample answers: the task's system prompt (a data
        set's tasks.system_prompt) if any, then its prompt."""
        system = self.payload.get("system_prompt")
        return ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": self.prompt}]

    @classmethod
    def of(cls, row) -> "Task":
        """From a (id, prompt, answer, payload) row of the tasks table."""
        task_id, prompt, answer, payload = row
        return cls(task_id, prompt, answer, payload or {})


@WORKFLOWS.register("single_turn")
def single_turn(task: Task, policy: Policy) -> list[Experience]:
    """n samples of the prompt, each scored by the task's reward function."""
    return [policy.experience(task.prompt, sample, *policy.score(sample.text, task.answer))
            for sample in policy.sample(task.messages)]


@dataclass(frozen=True)
class Named:
    """A workflow with its options bound, under its registered name (for messages)."""

    name: str
    function: Workflow

    def __call__(self, task: Task, policy: Policy) -> list[Experience]:
        return self.function(task, policy)


def make_workflow(name: str, options: dict[str, Any] | None = None) -> Named:
    """The named workflow with its options bound; a bad option is a ConfigError naming it."""
    found = WORKFLOWS.get(name)
    options = dict(options or {})
    try:
        if inspect.isclass(found):
            inspect.signature(found).bind(**options)
        else:
            inspect.signature(found).bind(None, None, **options)
    except TypeError as exc:
        raise ConfigError(f"explorer.workflow_options: workflow {name!r} does not take them: "
                          f"{exc}") from None
    if not inspect.isclass(found):
        return Named(name, functools.partial(found, **options))
    try:  # a class checks its options as it is made
        return Named(name, found(**options))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"explorer.workflow_options: workflow {name!r}: {exc}") from None


def whole_number(name: str, value: Any, low: int, high: int) -> int:
    """A workflow option that is a count (not true/false, not 1.5), in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} = {value!r}: a whole number from {low} to {high}")
    return value


def reward_of(task: Task, default: str,
              options: dict[str, Any] | None = None) -> RewardFunction:
    """The reward function a task names (its file's `reward` column), else the run's, bound
    to the task (its prompt and payload) and the run's reward options."""
    name = task.payload.get("reward") or default
    return bound(name, REWARDS.get(name), Context(task.prompt, task.payload, options or {}))


def explore(workflow: Workflow, tasks: Sequence[Task], batcher: Batcher,
            sampling: Sampling, *, run: str, version: int,
            reward: str, reward_options: dict[str, Any] | None = None) -> list[list[Experience]]:
    """Each task's group, the tasks run side by side (their generation batched)."""
    from reservoir.explorer.policy import Policy

    name = getattr(workflow, "name", None) or getattr(workflow, "__name__", "workflow")

    def one(index: int, task: Task) -> list[Experience]:
        try:
            policy = Policy(batcher, sampling, reward_of(task, reward, reward_options), run,
                            task.id, version, order=(index,))
            try:
                group = workflow(task, policy)
            except ReservoirError:
                raise
            except Exception as exc:
                raise WorkflowError(f"workflow {name!r} failed on task {task.id}: "
                                    f"{type(exc).__name__}: {exc}") from exc
            return _checked(name, group, task, policy)
        finally:
            batcher.leave()

    groups: list[list[Experience]] = []
    pool = batcher.callers(min(len(tasks), MAX_THREADS))
    for start in range(0, len(tasks), MAX_THREADS):
        chunk = tasks[start:start + MAX_THREADS]
        batcher.join(len(chunk))  # all of them before any starts: the first batch waits
        futures = [pool.submit(one, start + i, task) for i, task in enumerate(chunk)]
        if batcher.inline:  # this thread runs the engine until every workflow has ended
            batcher.serve_inline(futures)
        wait(futures)  # every one ends (and leaves the batcher) before the next chunk
        groups.extend(future.result() for future in futures)
    return groups


def _checked(name: str, group, task: Task, policy: Policy) -> list[Experience]:
    """A workflow's group: a non-empty list of experiences of this run, task and version."""
    if not isinstance(group, list) or not group or \
            not all(isinstance(row, Experience) for row in group):
        raise WorkflowError(f"workflow {name!r} returned {type(group).__name__} for task "
                            f"{task.id}: a "
                          "workflow returns a non-empty list of Experience rows (one group)")
    for row in group:
        if (row.run, row.task_id, row.policy_version) != (policy.run, task.id, policy.version):
            raise WorkflowError(
                f"workflow {name!r}: an experience of task {task.id} names run {row.run!r}, task "
                f"{row.task_id}, version {row.policy_version}; build it with the policy's "
                f"(run {policy.run!r}, task {task.id}, version {policy.version})")
    return group
