"""The transformers engine and the single-turn workflow, on a tiny local model and a real store."""

import numpy as np
import pytest
import torch
from sqlalchemy import text

from reservoir.explorer.engine import InverseCdfSampling, TransformersEngine
from reservoir.explorer.rewards import REWARDS, exact_match, format_reward, score
from reservoir.explorer.workflow import Task
from tests.factories import rollouts
from reservoir.models import build_tiny_model, save_weights
from reservoir.store import codec


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return TransformersEngine(build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", seed=0))


@REWARDS.register("test_exact_match_and_format")
def exact_match_and_format(response: str, answer: str):
    return score(response, answer, [exact_match, format_reward(r"\w+")])[1]


def forward_logprobs(engine, sample, temperature):
    ids = torch.tensor(np.concatenate([sample.prompt_ids, sample.response_ids]))[None]
    with torch.no_grad():
        logits = engine.model(ids).logits[0].float() / temperature
    start = len(sample.prompt_ids) - 1
    chosen = torch.tensor(sample.response_ids, dtype=torch.long)[:, None]
    return torch.log_softmax(logits[start:-1], dim=-1).gather(-1, chosen)[:, 0].numpy()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_a_separate_forward_pass(engine, temperature):
    prompts = ["What is 2 + 3?", "Reverse: abcdef"]  # different lengths: left padding
    groups = engine.sample(prompts, 3, temperature=temperature, max_tokens=10, seed=1)
    assert [len(group) for group in groups] == [3, 3]
    for group in groups:
        for sample in group:
            assert len(sample.logprobs) == len(sample.response_ids) > 0
            np.testing.assert_allclose(sample.logprobs,
                                       forward_logprobs(engine, sample, temperature), atol=1e-4)


def test_sampling_is_seeded(engine):
    first = engine.sample(["hi"], 2, max_tokens=6, seed=5)
    again = engine.sample(["hi"], 2, max_tokens=6, seed=5)
    assert [s.response_ids.tolist() for s in first[0]] == [s.response_ids.tolist() for s in again[0]]


def test_sampling_draws_each_token_at_its_probability(engine):
    """4,000 one-token samples at temperature 0.7: each token's share is its probability under
    softmax(logits / 0.7) within five standard errors."""
    draws, temperature = 4000, 0.7
    samples = engine.sample(["Reverse: abc"], draws, temperature=temperature, max_tokens=1,
                            seed=3)[0]
    prompt = torch.tensor(samples[0].prompt_ids, dtype=torch.long)[None]
    with torch.no_grad():
        logits = engine.model(prompt).logits[0, -1].float()
    expected = torch.softmax(logits / temperature, dim=-1)
    counts = torch.bincount(torch.tensor([int(s.response_ids[0]) for s in samples]),
                            minlength=len(expected)).double()
    share = counts / draws
    bound = 5 * torch.sqrt(expected * (1 - expected) / draws) + 1e-3
    assert ((share - expected).abs() <= bound).all()


def test_sampling_never_draws_a_token_of_probability_zero():
    logits = torch.randn(20_000, 50)
    logits[:, ::2] = float("-inf")  # every even token impossible
    logits[:, -1] = float("-inf")   # the last one too: the cumulative sum's end is flat
    picks = InverseCdfSampling(1.0)(None, logits).argmax(dim=-1)
    assert bool((picks % 2 == 1).all()) and bool((picks != 49).all())
    assert len(picks.unique()) == 24  # every possible token drawn


def test_new_weights_load_in_place(engine, tmp_path):
    before = engine.model
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    with torch.no_grad():
        for tensor in engine.model.parameters():
            tensor.zero_()
    zeros = save_weights(engine.model, tmp_path / "zeros.safetensors")
    engine.model.load_state_dict(original)
    engine.load_weights(zeros)
    assert engine.model is before and float(engine.model.lm_head.weight.detach().abs().sum()) == 0.0
    engine.model.load_state_dict(original)


def test_single_turn_writes_one_group_per_task(engine, store):
    run_id = store.create_run("r", group_size=4)
    with store.engine.begin() as conn:
        ids = [conn.execute(text("INSERT INTO tasks (run_id, prompt, answer) VALUES (:r, :p, :a) "
                                 "RETURNING id"), {"r": run_id, "p": p, "a": a}).scalar()
               for p, a in (("Reverse: abc", "cba"), ("What is 1 + 1?", "2"))]
    tasks = [Task(ids[0], "Reverse: abc", "cba"), Task(ids[1], "What is 1 + 1?", "2")]
    store.publish_version("r", 3)  # rows are made by published weights
    result = rollouts(engine, store, "r", tasks, n=4, version=3, max_tokens=8,
                      reward="test_exact_match_and_format")
    assert (result.groups, result.rows) == (2, 8)
    with store.engine.connect() as conn:
        rows = conn.execute(text("SELECT task_id, policy_version, logprobs, response_len, "
                                 "reward_components FROM experiences ORDER BY id")).all()
    assert [row.task_id for row in rows] == [ids[0]] * 4 + [ids[1]] * 4
    assert {row.policy_version for row in rows} == {3}
    assert all(len(codec.decode(row.logprobs, codec.LOGPROB)) == row.response_len for row in rows)
    assert all(set(row.reward_components) == {"accuracy", "format"} for row in rows)
