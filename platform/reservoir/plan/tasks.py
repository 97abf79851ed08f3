"""The task generators a config may name (`tasks.generate`): CPU example tasks with a held-out
`test` split, seeded. Plain Python (no torch, no store), so config, explorer, trainer and pool
all read them from below. Task files are read by `reservoir.explorer.tasks`."""

from __future__ import annotations

import random
from typing import Any, Callable


def _split(rng: random.Random, test_fraction: float) -> str:
    return "test" if rng.random() < test_fraction else "train"


def addition(n: int, *, seed: int = 0, max_operand: int = 99,
             test_fraction: float = 0.1) -> list[dict[str, Any]]:
    """'What is a + b?' with the sum as answer."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append({"prompt": f"What is {a} + {b}?", "answer": str(a + b),
                     "split": _split(rng, test_fraction), "source": "addition",
                     "payload": {"a": a, "b": b}})
    return rows


def _word(rng: random.Random, low: int, high: int) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(low, high)))


def _word_tasks(n: int, *, seed: int, min_length: int, max_length: int, test_fraction: float,
                verb: str, solve: Callable[[str], str], source: str) -> list[dict[str, Any]]:
    """'<verb>: <random word>' tasks whose answer is solve(word)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        word = _word(rng, min_length, max_length)
        rows.append({"prompt": f"{verb}: {word}", "answer": solve(word),
                     "split": _split(rng, test_fraction), "source": source,
                     "payload": {"word": word}})
    return rows


def reverse(n: int, *, seed: int = 0, min_length: int = 3, max_length: int = 6,
            test_fraction: float = 0.1) -> list[dict[str, Any]]:
    """'Reverse: abc' with 'cba' as answer: a rule to generalise, not facts to memorise."""
    return _word_tasks(n, seed=seed, min_length=min_length, max_length=max_length,
                       test_fraction=test_fraction, verb="Reverse", solve=lambda w: w[::-1],
                       source="reverse")


def sort_letters(n: int, *, seed: int = 0, min_length: int = 3, max_length: int = 6,
                 test_fraction: float = 0.1) -> list[dict[str, Any]]:
    """'Sort: dcab' with 'abcd' as answer."""
    return _word_tasks(n, seed=seed, min_length=min_length, max_length=max_length,
                       test_fraction=test_fraction, verb="Sort",
                       solve=lambda w: "".join(sorted(w)), source="sort")


def calculator_tasks(n: int, *, seed: int = 0, test_fraction: float = 0.1,
                     low: int = 10, high: int = 99) -> list[dict[str, Any]]:
    """'Compute a*b' (or + or -) over two numbers in [low, high], with a demonstration: the
    calculator tool's call (`CALC a*b`), its result, the answer (the explorer's calculator
    gives the same result: tests/test_workflows.py checks)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b, op = rng.randint(low, high), rng.randint(low, high), rng.choice("+-*")
        expression = f"{a}{op}{b}"
        result = str({"+": a + b, "-": a - b, "*": a * b}[op])
        prompt = f"Compute {expression}"
        rows.append({"prompt": prompt, "answer": result, "split": _split(rng, test_fraction),
                     "source": "calculator",
                     "payload": {"messages": [
                         {"role": "user", "content": prompt},
                         {"role": "assistant", "content": f"CALC {expression}"},
                         {"role": "tool", "content": result},
                         {"role": "assistant", "content": result}]}})
    return rows


def binary_search(secret: int, low: int, high: int) -> list[dict[str, str]]:
    """The guesses of a binary search for the secret and the guessing game's answers to them
    ("higher", "lower", "correct": as the explorer's guess_number environment says them,
    tests/test_workflows.py checks), as messages."""
    messages = []
    while True:
        guess = (low + high) // 2
        messages.append({"role": "assistant", "content": str(guess)})
        if guess == secret:
            return messages
        said = "higher" if guess < secret else "lower"
        messages.append({"role": "user", "content": said})
        low, high = (guess + 1, high) if said == "higher" else (low, guess - 1)


def guess_number_tasks(n: int, *, seed: int = 0, test_fraction: float = 0.1, low: int = 1,
                       high: int = 16) -> list[dict[str, Any]]:
    """'Guess my number from low to high' with the secret and a binary-search demonstration."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        secret = rng.randint(low, high)
        prompt = f"Guess my number from {low} to {high}"
        rows.append({"prompt": prompt, "answer": str(secret),
                     "split": _split(rng, test_fraction), "source": "guess_number",
                     "payload": {"secret": secret, "messages": [
                         {"role": "user", "content": prompt},
                         *binary_search(secret, low, high)]}})
    return rows


GENERATORS: dict[str, Callable[..., list[dict[str, Any]]]] = {
    "addition": addition, "reverse": reverse, "sort": sort_letters,
    "calculator": calculator_tasks, "guess_number": guess_number_tasks,
}
