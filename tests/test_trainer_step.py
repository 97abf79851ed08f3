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

pytestmark = pytest.mark.store_agnostic  # the same on any server: CI runs it once


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


def reference_ppo_updates(model, optimizer, batch, *, epochs: int, mini_batches: int,
                          seed: int, clip: float = 0.2) -> None:
    """PPO's epochs and mini-batches in plain torch, written apart from the trainer: GRPO
    advantages, the clipped surrogate (token mean), gradients clipped at norm 1."""
    advantages = torch.zeros_like(batch.rewards)
    for group in batch.group_index.unique():
        rows = batch.group_index == group
        rewards = batch.rewards[rows]
        advantages[rows] = (rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-6)
    old = torch.nan_to_num(batch.old_logprobs, nan=0.0)  # NaN only where mask is 0
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(len(batch), generator=generator)
        cuts = [len(batch) * m // mini_batches for m in range(mini_batches + 1)]
        for low, high in zip(cuts, cuts[1:]):
            rows = order[low:high]
            ids, mask = batch.input_ids[rows], batch.mask[rows]
            logits = model(input_ids=ids, attention_mask=batch.attention_mask[rows]).logits
            logprobs = torch.log_softmax(logits[:, :-1].float(), -1).gather(
                -1, ids[:, 1:, None])[..., 0]
            ratio = torch.exp(logprobs - old[rows])
            advantage = advantages[rows][:, None]
            per_token = torch.maximum(-ratio * advantage,
                                      -ratio.clamp(1 - clip, 1 + clip) * advantage)
            loss = (per_token * mask).sum() / mask.sum()
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()


@pytest.mark.parametrize("micro_batch, optimizer, atol", [
    (16, torch.optim.AdamW, 1e-6), (1, torch.optim.SGD, 1e-6)])
def test_ppo_epochs_and_mini_batches_equal_a_plain_torch_loop(engine, leased, micro_batch,
                                                               optimizer, atol):
    """Issue 29: a step takes epochs x mini_batches updates over its one batch, each on a
    shuffled share of it, ratios against the logprobs the batch started from. Accumulated
    over one-row micro-batches the sums' order differs, and AdamW's normalisation lifts that
    float noise where a gradient is ~0 (a key bias: 4e-4 after 16 updates), so that case is
    checked with SGD."""
    _, batch = leased
    algorithm = PRESETS["grpo"].replace(epochs=4, mini_batches=4)
    ours, theirs = copy.deepcopy(engine.model), copy.deepcopy(engine.model)
    metrics = train_step(ours, optimizer(ours.parameters(), lr=1e-2), batch, algorithm,
                         micro_batch=micro_batch, seed=7)
    reference_ppo_updates(theirs, optimizer(theirs.parameters(), lr=1e-2), batch, epochs=4,
                          mini_batches=4, seed=7)
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
        torch.testing.assert_close(a, b, atol=atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    assert metrics["updates"] == 16
    assert metrics["policy/clip_fraction"] > 0 and metrics["last/policy/clip_fraction"] > 0
    assert {"loss", "last/loss", "grad_norm", "last/grad_norm"} <= set(metrics)


def test_old_logprobs_recompute_takes_ratios_against_the_policy_itself(engine, leased):
    """With old_logprobs: recompute the first update's ratios are exactly 1 (the engine's
    sampled logprobs differ from the trainer's by float noise, so theirs are not)."""
    _, batch = leased
    step = {}
    for source in ("engine", "recompute"):
        model = copy.deepcopy(engine.model)
        step[source] = train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), batch,
                                  PRESETS["grpo"].replace(old_logprobs=source), micro_batch=16)
    assert step["recompute"]["policy/ratio_mean"] == 1.0
    assert step["engine"]["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-3)


def test_more_mini_batches_than_rows_is_one_line(engine, leased):
    from reservoir.errors import ConfigError

    _, batch = leased
    model = copy.deepcopy(engine.model)
    with pytest.raises(ConfigError, match="mini_batches: 9 mini-batches of a 8-row batch"):
        train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), batch,
                   PRESETS["grpo"].replace(epochs=2, mini_batches=9), micro_batch=4)


def test_weight_decay_shrinks_matrices_only_and_is_off_by_default(engine):
    """Issue 30: every parameter decayed at torch's AdamW default (0.01) where TRL and
    transformers decay none; trainer.weight_decay (default 0) decays matrices, never biases or
    norms' scales, as transformers' Trainer does."""
    from reservoir.config import TrainerConfig
    from reservoir.trainer.optimizer import adamw

    assert TrainerConfig().weight_decay == 0.0
    assert [group["weight_decay"] for group in adamw(engine.model, 1e-3).param_groups] == [0.0]
    model = copy.deepcopy(engine.model)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = adamw(model, 0.1, 0.5)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for name, p in model.named_parameters():
        shrink = 1 - 0.1 * 0.5 if p.dim() >= 2 else 1.0
        torch.testing.assert_close(p.detach(), before[name] * shrink, msg=name)
    assert any(p.dim() < 2 for p in model.parameters())  # biases and norms were checked
