"""The calculator tool workflow: the model calls a calculator, reads its answer, then answers.

A model turn that is exactly `CALC <expression>` is a tool call: the calculator's result comes
back as a `tool` message (mask 0: the model did not write it) and the model takes another turn.
Any other turn is the final answer, scored by the task's reward function; an episode with more
than `max_calls` calls, or a turn cut by max_tokens, ends with no answer (reward as for "").

The calculator evaluates + - * / // % ** and parentheses over numbers, nothing else (it walks
Python's syntax tree; names, calls and attributes are refused), with bounded sizes.

Its tasks (`reservoir.plan.tasks.calculator_tasks`, `tasks.generate: calculator`): "Compute
47*83" with the answer, and a demonstration (the call, the result, the answer) that sft on tasks
trains on.
"""

from __future__ import annotations

import ast
import math
import operator
import re

from reservoir.explorer.workflow import whole_number

CALL = re.compile(r"CALC\s+(.{1,100})")
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
             ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
             ast.Pow: operator.pow}
LARGEST = 1e15   # results (and intermediate values) beyond this are refused
MAX_EXPONENT = 64


def calculate(expression: str) -> str:
    """The value of an arithmetic expression as text, or "error: ..." (what the model reads).

    >>> calculate("47*83")
    '3901'
    >>> calculate("(1 + 2) / 4")
    '0.75'
    >>> calculate("__import__('os')")
    'error: only numbers and + - * / // % ** ( )'
    """
    try:
        value = _value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as exc:
        return f"error: {exc}" if not isinstance(exc, SyntaxError) else "error: not an expression"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def _value(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent over {MAX_EXPONENT}")
        return _bounded(OPERATORS[type(node.op)](left, right))
    raise ValueError("only numbers and + - * / // % ** ( )")


def _bounded(value) -> float:
    if isinstance(value, complex) or not math.isfinite(value) or abs(value) > LARGEST:
        raise ValueError("the number is too large")
    return value


class Calculator:
    """The workflow: n episodes of a task, stepped together (call, result, ..., answer)."""

    def __init__(self, max_calls: int = 2) -> None:
        self.max_calls = whole_number("max_calls", max_calls, 0, 16)

    def __call__(self, task, policy) -> list:
        episodes = [policy.episode(task.messages) for _ in range(policy.n)]
        calls, answers = [0] * len(episodes), [""] * len(episodes)
        live = list(range(len(episodes)))
        while live:
            texts = policy.reply([episodes[i] for i in live])
            still = []
            for i, text in zip(live, texts):
                call = CALL.fullmatch(text.strip())
                if call and not episodes[i].truncated and calls[i] < self.max_calls:
                    calls[i] += 1
                    episodes[i].add("tool", calculate(call.group(1)))
                    still.append(i)
                elif not call and not episodes[i].truncated:
                    answers[i] = text
            live = still
        return [episode.experience(*policy.score(answer, task.answer),
                                   metadata={"tool_calls": n_calls})
                for episode, answer, n_calls in zip(episodes, answers, calls)]
