"""`code_exec`: the response's program run against the task's tests in the sandbox
(sandbox.py); the reward is the share of tests it passes (partial credit).

The program is the last fenced code block of the response (```python, ```py or ```), else the
whole response. `payload.tests` (a task file's `tests` column) is a list of tests, each either
`{"input": "...", "output": "..."}` (the program reads the input on stdin and must print the
output, compared line by line without trailing whitespace) or a string of Python run after the
program (e.g. `assert add(2, 3) == 5`: passes when it exits cleanly). Each test is a sandboxed
process of its own. Options (`explorer.reward_options`): timeout_s (wall seconds a test,
default 10), cpu_s (5), memory_mb (512).
"""

from __future__ import annotations

import re

from reservoir.explorer.rewards import Components, Context
from reservoir.explorer.sandbox import Limits, run_python

FENCED = re.compile(r"```(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL)


def program_of(response: str) -> str:
    """The last fenced code block of a response, else the response itself.

    >>> program_of("Here:\\n```python\\nprint(1)\\n```\\ndone")
    'print(1)\\n'
    >>> program_of("print(2)")
    'print(2)'
    """
    blocks = FENCED.findall(response)
    return blocks[-1] if blocks else response


def _limits(options: dict) -> Limits:
    return Limits(cpu_s=int(options.get("cpu_s", 5)),
                  memory_mb=int(options.get("memory_mb", 512)),
                  wall_s=float(options.get("timeout_s", 10.0)))


def passes(program: str, test, limits: Limits) -> bool:
    """Whether one test passes (see the module's rules); ValueError for a malformed test."""
    if isinstance(test, str):
        return run_python(program + "\n\n" + test + "\n", "", limits).ok
    if isinstance(test, dict) and isinstance(test.get("output"), str):
        outcome = run_python(program, str(test.get("input", "")), limits)
        return outcome.ok and _lines(outcome.stdout) == _lines(test["output"])
    raise ValueError(f"a test is a string of Python or {{input, output}} (got {test!r:.80})")


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip().splitlines()]


def code_exec(response: str, answer: str, *, context: Context = Context()) -> Components:
    """The share of the task's tests (payload.tests) the response's program passes."""
    tests = context.payload.get("tests")
    if not isinstance(tests, list) or not tests:
        raise ValueError("code_exec needs the task's tests (a non-empty list in payload.tests)")
    program, limits = program_of(response), _limits(context.options)
    passed = sum(passes(program, test, limits) for test in tests)
    return {"accuracy": passed / len(tests)}
