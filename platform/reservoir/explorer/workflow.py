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
its run, task and version. A workflow with a `round(tasks, policies)` (single_turn has one)
runs each chunk of MAX_THREADS tasks in one call on the exploring thread instead: the same
samples, without a thread per task or their hand-offs (~0.1 s of a 2 s round on a CPU).
"""

from __future__ import annotations

import functools
import inspect
from concurrent.futures import Future, ThreadPoolExecutor, wait
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
    return _scored(task, policy, policy.sample(task.messages))


def _single_turn_round(tasks: Sequence[Task], policies: Sequence[Policy]
                       ) -> list[list[Experience]]:
    """single_turn over a whole round: one engine call, no thread per task (the same samples
    as a thread per task: the same requests in the same order). Each task is scored on a
    thread of its own as soon as its samples are done, while the engine generates the next
    ones: a slow reward (a verifier, a sandbox, a judge) does not idle the engine."""
    from reservoir.explorer.policy import Policy

    with ThreadPoolExecutor(1, thread_name_prefix="scoring") as scoring:
        scored: dict[int, Future] = {}

        def done(index: int, samples) -> None:
            scored[index] = scoring.submit(_scored, tasks[index], policies[index], samples)

        Policy.sample_round(policies, [task.messages for task in tasks], done)
        return [scored[index].result() for index in range(len(tasks))]


def _scored(task: Task, policy: Policy, samples) -> list[Experience]:
    return [policy.experience(task.prompt, sample, *policy.score(sample.text, task.answer))
            for sample in samples]


single_turn.round = _single_turn_round


@dataclass(frozen=True)
class Named:
    """A workflow with its options bound, under its registered name (for messages). `round`,
    where the workflow has one (`workflow.round(tasks, policies)`, options bound too), runs a
    whole round of tasks at once on the exploring thread instead of a thread per task."""

    name: str
    function: Workflow
    round: Callable[..., list[list[Experience]]] | None = None

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
        whole = getattr(found, "round", None)
        return Named(name, functools.partial(found, **options),
                     whole and functools.partial(whole, **options))
    try:  # a class checks its options as it is made
        made = found(**options)
        return Named(name, made, getattr(made, "round", None))
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
    if getattr(workflow, "round", None) is not None:
        return [group for start in range(0, len(tasks), MAX_THREADS)
                for group in _round(workflow, name, tasks[start:start + MAX_THREADS], start,
                                    batcher, sampling, run, version, reward, reward_options)]

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


def _round(workflow: Named, name: str, tasks: Sequence[Task], start: int, batcher: Batcher,
           sampling: Sampling, run: str, version: int, reward: str,
           reward_options: dict[str, Any] | None) -> list[list[Experience]]:
    """A chunk of tasks through the workflow's `round`: the groups a thread per task would
    make (each task's policy has its place in the batch), checked the same way."""
    from reservoir.explorer.policy import Policy

    policies = [Policy(batcher, sampling, reward_of(task, reward, reward_options), run, task.id,
                       version, order=(start + i,)) for i, task in enumerate(tasks)]
    try:
        groups = workflow.round(tasks, policies)
    except ReservoirError:
        raise
    except Exception as exc:
        raise WorkflowError(f"workflow {name!r} failed on a round of {len(tasks)} tasks "
                            f"(from task {tasks[0].id}): {type(exc).__name__}: {exc}") from exc
    if not isinstance(groups, list) or len(groups) != len(tasks):
        raise WorkflowError(f"workflow {name!r}: its round returned "
                            f"{len(groups) if isinstance(groups, list) else type(groups).__name__}"
                            f" groups for {len(tasks)} tasks: one group a task, in order")
    return [_checked(name, group, task, policy)
            for group, task, policy in zip(groups, tasks, policies)]


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
