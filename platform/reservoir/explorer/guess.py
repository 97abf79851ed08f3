"""Guess the number: a multi-turn environment with feedback after every turn.

The task's prompt asks for a number in [low, high]; each model turn is a guess, and the
environment answers as the user: "higher", "lower", or "correct" (a turn without a number
counts as a wrong guess: "a number, please"). The episode ends when the number is found or
after `max_turns` guesses. Reward components: `accuracy` (1 when found) and `speed` (up to 0.5,
less for every extra guess), so fewer guesses score more.

Its tasks (`reservoir.plan.tasks.guess_number_tasks`, `tasks.generate: guess_number`) hold the
secret in their payload, with a binary-search demonstration for sft on tasks.
"""

from __future__ import annotations

import re

from reservoir.explorer.workflow import whole_number

NUMBER = re.compile(r"-?\d{1,9}")


def feedback(guess_text: str, secret: int) -> str:
    """What the environment says to a guess.

    >>> feedback("8", 11), feedback("I say 12", 11), feedback("11", 11), feedback("no", 11)
    ('higher', 'lower', 'correct', 'a number, please')
    """
    found = NUMBER.search(guess_text)
    if found is None:
        return "a number, please"
    guess = int(found.group())
    return "correct" if guess == secret else "higher" if guess < secret else "lower"


class GuessNumber:
    """The workflow: n games of a task, stepped together, each until found or max_turns
    guesses."""

    def __init__(self, max_turns: int = 6) -> None:
        self.max_turns = whole_number("max_turns", max_turns, 1, 32)

    def __call__(self, task, policy) -> list:
        secret = int(task.payload["secret"])
        episodes = [policy.episode(task.messages) for _ in range(policy.n)]
        solved = [False] * len(episodes)
        live = list(range(len(episodes)))
        while live:
            texts = policy.reply([episodes[i] for i in live])
            still = []
            for i, text in zip(live, texts):
                said = feedback(text, secret)
                solved[i] = said == "correct" and not episodes[i].truncated
                if not solved[i] and not episodes[i].truncated \
                        and episodes[i].turns < self.max_turns:
                    episodes[i].add("user", said)
                    still.append(i)
            live = still
        return [episode.experience(*_reward(found, episode.turns, self.max_turns),
                                   metadata={"secret": secret})
                for episode, found in zip(episodes, solved)]


def _reward(found: bool, turns: int, max_turns: int) -> tuple[float, dict[str, float]]:
    speed = 0.5 * (max_turns - turns) / max(1, max_turns - 1) if found else 0.0
    components = {"accuracy": float(found), "speed": speed}
    return sum(components.values()), components
