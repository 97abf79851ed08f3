"""Partial credit: the share of the answer's characters the response has in the right place."""


def char_match(response: str, answer: str) -> dict[str, float]:
    """Characters right, position by position, over the longer of the two lengths (without an
    `accuracy` component, held-out evaluation averages this reward itself).

    >>> char_match("olleh", "olleh")
    {'chars': 1.0}
    >>> char_match("ollxh", "olleh")
    {'chars': 0.8}
    >>> char_match("oll", "olleh")
    {'chars': 0.6}
    """
    got, want = response.strip(), answer.strip()
    right = sum(a == b for a, b in zip(got, want))
    return {"chars": round(right / max(len(got), len(want), 1), 6)}
