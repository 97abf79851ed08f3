"""Reward functions: functions of (response, answer) returning named components.

Packages add their own under the entry-point group `reservoir.rewards` (see
reservoir.registry); a task file's `reward` column names the one that scores each task. A
reward that needs more than the answer (the task's prompt and payload, the run's
`explorer.reward_options`) takes a keyword argument `context` (a `Context`). Built in besides
the ones below: math_verify (math_reward.py), code_exec (code_reward.py), llm_judge and
reward_model (judge_reward.py).

A reward that raises is logged in one line and scores 0 with the component `reward_failed`:
a bad response, a judge that is down or a broken test never stops an explorer.

The reward stored with an experience is the sum of its components; the components are stored
too (experiences.reward_components), so an analyst can see why a response scored what it did.
"""

from __future__ import annotations

import functools
import inspect
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from reservoir.registry import Registry

Components = dict[str, float]
RewardFunction = Callable[[str, str], Components]
REWARDS: Registry = Registry("reward function", group="reservoir.rewards")

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
FAILED = "reward_failed"  # the component of a response whose reward raised


@dataclass(frozen=True)
class Context:
    """What a reward may read besides the response and the answer."""

    prompt: str = ""
    payload: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)


@functools.lru_cache(maxsize=256)
def _takes_context(function: Callable) -> bool:
    try:
        return "context" in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


def bound(name: str, function: Callable, context: Context) -> RewardFunction:
    """`function` as a reward of (response, answer) for one task: given its context if it
    takes one, and a failure logged and scored 0 (component reward_failed) instead of raised."""
    wants = _takes_context(function)

    def reward(response: str, answer: str) -> Components:
        try:
            return function(response, answer, context=context) if wants else \
                function(response, answer)
        except Exception as exc:  # a reward's failure is the response's score, not a crash
            print(f"reward {name}: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}; "
                  f"the response scored 0 ({FAILED})", flush=True)
            return {FAILED: 0.0}
    return reward


def _normalise(text: str) -> str:
    return " ".join(text.strip().split()).lower()


def _as_number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


@REWARDS.register("exact_match")
def exact_match(response: str, answer: str) -> Components:
    """1 when the response equals the answer, ignoring case and surrounding/extra whitespace.

    >>> exact_match("  Olleh ", "olleh")
    {'accuracy': 1.0}
    >>> exact_match("hello", "olleh")
    {'accuracy': 0.0}
    """
    return {"accuracy": float(_normalise(response) == _normalise(answer))}


def last_number_in(text: str) -> str | None:
    """The last number written in the text (commas as thousands separators), or None.

    >>> last_number_in("3 + 4 is 7.")
    '7'
    >>> last_number_in("it costs 1,250 dollars") is None
    False
    >>> last_number_in("no digits here") is None
    True
    """
    found = _NUMBER.findall(text)
    return found[-1] if found else None


@REWARDS.register("last_number")
def last_number(response: str, answer: str) -> Components:
    """1 when the last number in the response equals the answer numerically (GSM8K style).

    >>> last_number("Adding them: 12 + 30 = 42", "42")
    {'accuracy': 1.0}
    >>> last_number("It is 42.0", "42")
    {'accuracy': 1.0}
    >>> last_number("It is 41", "42")
    {'accuracy': 0.0}
    """
    found = last_number_in(response)
    got, want = (_as_number(found) if found else None), _as_number(answer)
    return {"accuracy": float(got is not None and want is not None and got == want)}


def boxed_content(text: str) -> str | None:
    r"""The content of the last \boxed{...} in the text, braces balanced, or None.

    >>> boxed_content(r"so \boxed{\frac{1}{2}} is it")
    '\\frac{1}{2}'
    >>> boxed_content("no box") is None
    True
    """
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            if depth == 0:
                return text[begin:index]
            depth -= 1
    return None


@REWARDS.register("boxed")
def boxed(response: str, answer: str) -> Components:
    r"""1 when the last \boxed{} answer equals the answer (numerically when both are numbers).

    >>> boxed(r"The area is \boxed{12}", "12.0")
    {'accuracy': 1.0}
    >>> boxed(r"\boxed{x+1}", "x + 1")
    {'accuracy': 1.0}
    >>> boxed("12", "12")
    {'accuracy': 0.0}
    """
    content = boxed_content(response)
    if content is None:
        return {"accuracy": 0.0}
    got, want = _as_number(content), _as_number(answer)
    if got is not None and want is not None:
        return {"accuracy": float(got == want)}
    return {"accuracy": float(content.replace(" ", "") == answer.replace(" ", ""))}


def format_reward(pattern: str, weight: float = 0.1) -> RewardFunction:
    """A reward of `weight` when the whole response matches the regular expression.

    >>> format_reward(r"The answer is -?\\d+\\.")("The answer is 7.", "7")
    {'format': 0.1}
    >>> format_reward(r"\\d+")("seven", "7")
    {'format': 0.0}
    """
    compiled = re.compile(pattern, re.DOTALL)

    def reward(response: str, answer: str) -> Components:
        return {"format": weight if compiled.fullmatch(response.strip()) else 0.0}

    return reward


def score(response: str, answer: str, functions: list[RewardFunction]) -> tuple[float, Components]:
    """The total reward and the merged components of several reward functions.

    >>> score("The answer is 7.", "7", [last_number, format_reward(r"The answer is \\d+\\.")])
    (1.1, {'accuracy': 1.0, 'format': 0.1})
    """
    components: Components = {}
    for function in functions:
        for name, value in function(response, answer).items():
            if name in components:
                raise ValueError(f"two reward functions both produce the component {name!r}")
            components[name] = value
    return sum(components.values()), components


# Built in, imported when first named (they bring a sandbox, an HTTP client, a model).
REWARDS.register_lazy("math_verify", "reservoir.explorer.math_reward:math_verify")
REWARDS.register_lazy("code_exec", "reservoir.explorer.code_reward:code_exec")
REWARDS.register_lazy("llm_judge", "reservoir.explorer.judge_reward:llm_judge")
REWARDS.register_lazy("reward_model", "reservoir.explorer.judge_reward:reward_model")
