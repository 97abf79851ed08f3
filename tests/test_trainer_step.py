"""The trainer step on real leased rows from a tiny model: alignment, micro-batches, learning."""

import copy

import pytest
import torch
from sqlalchemy import text

from reservoir.explorer.engine import TransformersEngine
from reservoir.explorer.workflow import Task
from tests.factories import rollouts
from reservoir.models import build_tiny_model
from reservoir.trainer.batch import make_batch, token_logprobs
from reservoir.trainer.step import PRESETS, train_step


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return TransformersEngine(build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", seed=0))


@pytest.fixture
def leased(engine, store):
    store.create_run("r", group_size=4)
    tasks = [Task(None, f"Say {c}", c) for c in "ab"]
    rollouts(engine, store, "r", tasks, n=4, max_tokens=6)
    with store.engine.begin() as conn:  # give each group a spread of rewards to learn from
        conn.execute(text("UPDATE experiences SET reward = (id % 2)::float8"))
    lease = store.lease("r", groups=2)
    return lease, make_batch(lease.rows, engine.tokenizer.pad_token_id)


def test_batch_alignment_reproduces_the_sampling_logprobs(engine, leased):
    _, batch = leased
    with torch.no_grad():
        now = token_logprobs(engine.model, batch)
    on = batch.mask.bool()
    assert on.sum() > 0
    torch.testing.assert_close(now[on], batch.old_logprobs[on], atol=1e-4, rtol=0)


@pytest.mark.parametrize("preset", ["grpo", "dr-grpo"])
def test_micro_batches_give_the_full_batch_step(engine, leased, preset):
    _, batch = leased
    whole, parts = copy.deepcopy(engine.model), copy.deepcopy(engine.model)
    for model, micro in ((whole, len(batch)), (parts, 3)):
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        train_step(model, optimizer, batch, PRESETS[preset], micro_batch=micro,
                   max_grad_norm=None)
    for (name, a), (_, b) in zip(whole.named_parameters(), parts.named_parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)


def test_steps_raise_the_logprob_of_rewarded_responses(engine, leased, store):
    lease, batch = leased
    model = copy.deepcopy(engine.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def rewarded_margin():
        with torch.no_grad():
            per_row = (token_logprobs(model, batch) * batch.mask).sum(1) / batch.mask.sum(1)
        good = batch.rewards > 0.5
        return float(per_row[good].mean() - per_row[~good].mean())

    before = rewarded_margin()
    for _ in range(5):
        metrics = train_step(model, optimizer, batch, PRESETS["grpo"], micro_batch=4)
    assert rewarded_margin() > before + 0.5
    assert metrics["train_tokens"] == float(batch.mask.sum())
    store.commit_step(lease, step=1, policy_version=0, loss=metrics["loss"], metrics=metrics)


def test_a_step_whose_loss_is_not_finite_steps_no_weight(engine, leased):
    """Issue 28: a reward past float32 (1e39, stored before the writer checked it) became inf
    in the batch, every advantage NaN, and the step wrote NaN into every weight."""
    from reservoir.trainer.step import StepNotFinite

    _, batch = leased
    batch.rewards[0] = float("inf")
    model = copy.deepcopy(engine.model)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(StepNotFinite, match="not finite"):
        train_step(model, optimizer, batch, PRESETS["grpo"], micro_batch=4)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0, msg=name)
    assert not optimizer.state  # AdamW took no step
