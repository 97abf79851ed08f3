"""The rewards that need more than a regular expression (issue 32): math_verify against the
library itself, code_exec in its sandbox against programs that misbehave, llm_judge through a
live `reservoir serve`, reward_model on a classification model built here; a reward that fails
scores 0 with reward_failed and a log line, and the explorer goes on."""

from __future__ import annotations

import os
import time

import pytest

from reservoir.explorer.code_reward import program_of
from reservoir.explorer.rewards import REWARDS, Context, bound
from reservoir.explorer.workflow import Task, reward_of
from tests.test_recovery import wait_for
from tests.test_serve import counts, publish_start, published, served  # noqa: F401 (fixture)

# (gold answer, response): equal and not, in the notations math-verify reads
MATH = [
    ("0.5", r"The answer is $\frac{1}{2}$"), ("1/2", r"$\boxed{\frac{2}{4}}$"),
    ("3", r"$\boxed{3}$"), ("3", r"$\boxed{4}$"), ("12", "so the total is 12"),
    (r"\{1, 2\}", r"$\{2, 1\}$"), (r"\{1, 2\}", r"$\{1, 3\}$"), ("(0, 1]", r"$(0, 1]$"),
    ("(0, 1]", r"$[0, 1]$"), (r"\sqrt{2}", r"$\boxed{\sqrt{2}}$"), (r"\sqrt{2}", r"$\boxed{2}$"),
    ("2x + 1", r"$\boxed{1 + 2x}$"), ("2x + 1", r"$\boxed{2x - 1}$"), ("-7", r"$\boxed{-7}$"),
    ("-7", r"$\boxed{7}$"), (r"\pi", r"$\boxed{\pi}$"), (r"\frac{\pi}{2}", r"$\boxed{\pi/2}$"),
    ("1000", r"$\boxed{1,000}$"), ("0.25", r"$\boxed{25\%}$"), ("x^2", r"$\boxed{x \cdot x}$"),
    ("10", r"$\boxed{10.0}$"), ("10", r"$\boxed{10.5}$"), (r"\frac{3}{4}", r"$\boxed{0.75}$"),
    (r"\frac{3}{4}", r"$\boxed{0.7}$"), ("[1, 3]", r"$[1, 3]$"), ("5", "no answer here"),
    ("e", r"$\boxed{e}$"), ("2", r"$\boxed{\sqrt{4}}$"), ("2", r"$\boxed{\sqrt{5}}$"),
    (r"\infty", r"$\boxed{\infty}$"),
]


def test_math_verify_agrees_with_the_library_on_thirty_pairs():
    from math_verify import parse, verify

    reward = reward_of(Task(1, "q", None, {"reward": "math_verify"}), "exact_match")
    ours = [reward(response, gold)["accuracy"] for gold, response in MATH]
    library = [float(verify(parse(gold if "\\" in gold or "$" in gold else f"${gold}$"),
                            parse(response))) for gold, response in MATH]
    assert len(MATH) == 30 and ours == library
    assert 8 <= sum(ours) <= 22, ours  # the table holds both kinds


def code_task(tests, **options):
    return reward_of(Task(1, "write f", None, {"reward": "code_exec", "tests": tests}),
                     "exact_match", {"timeout_s": 3, "cpu_s": 2, **options})


ADD_TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(2, 2) == 5"]


def test_code_exec_gives_partial_credit_by_tests_passed():
    reward = code_task(ADD_TESTS)
    answer = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```"
    assert reward(answer, "")["accuracy"] == pytest.approx(2 / 3)
    io = code_task([{"input": "abc\n", "output": "cba\n"}, {"input": "xy", "output": "yx"}])
    assert io("print(input()[::-1])", "") == {"accuracy": 1.0}
    assert program_of("```py\nx = 1\n```\ntext\n```\ny = 2\n```") == "y = 2\n"


MISBEHAVING = {
    "an infinite loop": "while True:\n    pass",
    "a fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
                   "        pass",
    "a 10 GB allocation": "block = bytearray(10 * 2**30)",
    "writing outside its folder": "open(os.path.expanduser('~') + '/../../../../tmp/"
                                  "sandbox_escape', 'w').write('x')\n"
                                  "open('/work/sandbox_escape', 'w').write('x')",
    "opening a socket": "import socket\nsocket.create_connection(('127.0.0.1', 5432), 2)",
    "a socket from a child process": "import subprocess, sys\nsubprocess.run([sys.executable,"
                                     " '-c', 'import socket; socket.create_connection(("
                                     "\"127.0.0.1\", 5432), 2)'], check=True)",
    "reading the explorer's environment": "assert 'SANDBOX_SECRET' in os.environ or "
                                          "'SANDBOX_SECRET' in open(f'/proc/{os.getppid()}"
                                          "/environ').read()",
}


@pytest.mark.parametrize("what", MISBEHAVING)
def test_code_exec_refuses_a_misbehaving_program_as_a_scored_failure(what, monkeypatch):
    monkeypatch.setenv("SANDBOX_SECRET", "hunter2")
    reward = code_task(["def add(a, b):\n    return a + b\nassert add(1, 2) == 3"])
    program = "import os\n" + MISBEHAVING[what] + "\ndef add(a, b):\n    return a + b\n"
    started = time.monotonic()
    assert reward(program, "") == {"accuracy": 0.0}
    assert time.monotonic() - started < 10  # within its timeout (3 s wall, 2 s CPU)
    assert not os.path.exists("/tmp/sandbox_escape") and not os.path.exists("/work/sandbox_escape")
    assert reward("def add(a, b):\n    return a + b\n", "") == {"accuracy": 1.0}  # it goes on


def test_a_failing_reward_scores_zero_with_reward_failed_and_one_log_line(capsys):
    def broken(response: str, answer: str):
        raise RuntimeError("the judge is down\nsecond line")

    reward = bound("broken", broken, Context())
    assert reward("r", "a") == {"reward_failed": 0.0}
    assert capsys.readouterr().out.strip().splitlines() == [
        "reward broken: RuntimeError: the judge is down second line; the response scored 0 "
        "(reward_failed)"]
    no_tests = code_task([])
    assert no_tests("print(1)", "") == {"reward_failed": 0.0}
    judge_without_url = reward_of(Task(1, "q", "a", {"reward": "llm_judge"}), "exact_match")
    assert judge_without_url("r", "a") == {"reward_failed": 0.0}
    assert "llm_judge needs explorer.reward_options.url" in capsys.readouterr().out


def test_the_new_rewards_are_registered():
    assert {"math_verify", "code_exec", "llm_judge", "reward_model"} <= set(REWARDS.names())


@pytest.mark.slow
def test_reward_model_scores_prompt_and_response_with_a_local_classifier(tmp_path):
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    from reservoir.models import build_tiny_model

    causal = build_tiny_model(tmp_path / "tiny")
    config = AutoConfig.from_pretrained(causal, num_labels=1)
    model = AutoModelForSequenceClassification.from_config(config)
    tokenizer = AutoTokenizer.from_pretrained(causal)
    model.config.pad_token_id = tokenizer.pad_token_id or tokenizer.eos_token_id
    model.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    reward = reward_of(Task(1, "Reverse: abc", "cba", {"reward": "reward_model"}),
                       "exact_match", {"path": str(tmp_path / "rm")})
    first, second = reward("cba", "cba"), reward("abc abc abc", "cba")
    assert set(first) == {"reward_model"} and first != second
    assert reward("cba", "cba") == first  # the same pair scores the same

    encoded = tokenizer(["Reverse: abc"], ["cba"], return_tensors="pt")
    import torch
    with torch.no_grad():
        expected = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm")(
            **encoded).logits[0, 0].item()
    assert first["reward_model"] == pytest.approx(expected, abs=1e-4)


@pytest.mark.slow
@pytest.mark.process
def test_llm_judge_scores_through_a_live_reservoir_serve(served, db_url):
    """The judge is `reservoir serve` on the tiny model: each judgement is a call the server
    records, and its answer becomes a score in [0, 1] or, with no number in it, a
    reward_failed row (the tiny model writes what it likes)."""
    base = served.up(served())
    publish_start(db_url, served.config)
    wait_for(lambda: published(base, 0), timeout=120)
    reward = reward_of(Task(1, "Reverse: abc", "cba", {"reward": "llm_judge"}), "exact_match",
                       {"url": base, "model": "agent", "max_tokens": 8, "max_concurrency": 2,
                        "timeout_s": 60})
    outcomes = [reward(response, "cba") for response in ("cba", "abc", "c b a")]
    for outcome in outcomes:
        assert set(outcome) in ({"judge"}, {"reward_failed"}), outcome
        assert all(0.0 <= value <= 1.0 for value in outcome.values())
    assert counts(db_url)[1] == 3  # three judgements, each a recorded call
