"""Reward functions: their doctests, plus the edge cases that decide an RL signal."""

import doctest

import pytest

from reservoir.explorer import rewards
from reservoir.explorer.rewards import REWARDS, boxed, last_number, score


def test_doctests():
    result = doctest.testmod(rewards)
    assert result.attempted > 10 and result.failed == 0


@pytest.mark.parametrize("response, answer, expected", [
    ("the sum is -3", "-3", 1.0),
    ("1,000 apples", "1000", 1.0),
    ("7 then 8", "7", 0.0),          # only the last number counts
    ("", "0", 0.0),
    ("0", "0", 1.0),                 # zero is an answer, not a missing one
])
def test_last_number(response, answer, expected):
    assert last_number(response, answer) == {"accuracy": expected}


def test_boxed_takes_the_last_box_and_balances_braces():
    assert boxed(r"\boxed{1} no wait \boxed{{2}}", "{2}") == {"accuracy": 1.0}
    assert boxed(r"\boxed{unclosed", "unclosed") == {"accuracy": 0.0}


def test_score_rejects_two_functions_writing_one_component():
    with pytest.raises(ValueError, match="accuracy"):
        score("7", "7", [last_number, boxed])


def test_registered_by_name():
    assert {"exact_match", "last_number", "boxed"} <= set(REWARDS.names())
