"""Every preset does what its name says: the first step's loss on real rows of a tiny model,
computed independently with numpy from the batch (on-policy, so every importance ratio is 1),
and the KL and critic presets' models behave as promised."""

import copy

import numpy as np
import pytest
import torch
from sqlalchemy import text

from reservoir.explorer.engine import TransformersEngine
from reservoir.explorer.workflow import Task
from tests.factories import rollouts
from reservoir.models import build_tiny_model
from reservoir.trainer.batch import make_batch, token_logprobs
from reservoir.trainer.critic import build_critic
from reservoir.trainer.step import PRESETS, train_step

pytestmark = pytest.mark.store_agnostic  # the same on any server: CI runs it once


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", seed=0)


@pytest.fixture
def batch(model_path, store):
    engine = TransformersEngine(model_path)
    store.create_run("r", group_size=4)
    rollouts(engine, store, "r", [Task(None, f"Say {c}", c) for c in "abc"], n=4,
             max_tokens=6)
    with store.engine.begin() as conn:  # a spread of rewards in two groups, none in the third
        conn.execute(text("UPDATE experiences SET reward = CASE WHEN group_row < 2 "
                          "THEN (id % 3)::float8 ELSE (id % 2)::float8 END"))
        conn.execute(text("UPDATE experiences SET reward = 1 WHERE group_id = "
                          "(SELECT max(group_id::text)::uuid FROM experiences)"))
    rows = sorted(store.lease("r", groups=3).rows, key=lambda row: row.id)
    return make_batch(rows, engine.tokenizer.pad_token_id)


def _aggregate(values, mask, mode):
    if mode == "token-mean":
        return (values * mask).sum() / mask.sum()
    sums = (values * mask).sum(1)
    return (sums / mask.sum(1)).mean() if mode == "seq-mean-token-mean" else sums.mean()


def _groups(rewards, groups):
    return [np.flatnonzero(groups == g) for g in np.unique(groups)]


def _whiten(values, mask):
    on = mask > 0
    return (values - values[on].mean()) / (values[on].std() + 1e-6) * mask


def _dense_returns(rewards, mask):
    """Outcome reward on each row's last trained token, summed backwards (gamma 1)."""
    dense = np.zeros_like(mask)
    for i, row in enumerate(mask):
        dense[i, np.flatnonzero(row)[-1]] = rewards[i]
    return np.flip(np.cumsum(np.flip(dense * mask, 1), 1), 1) * mask


def expected_advantages(name, rewards, groups, mask):
    out = np.zeros_like(rewards)
    for members in _groups(rewards, groups):
        r = rewards[members]
        if name == "grpo":
            out[members] = (r - r.mean()) / (r.std() + 1e-6)
        elif name in ("dr-grpo", "opmd"):
            out[members] = r - r.mean()
        elif name == "rloo":
            out[members] = r - (r.sum() - r) / (len(r) - 1)
    if name in ("reinforce++", "gae"):  # KL 0 (reference = policy), values 0 (zero head)
        return _whiten(_dense_returns(rewards, mask), mask)
    return out[:, None] * np.ones_like(mask)


@pytest.mark.parametrize("preset", sorted(set(PRESETS) - {"dpo"}))
def test_each_preset_computes_the_loss_its_name_promises(model_path, batch, preset):
    algorithm = PRESETS[preset]
    model, _ = TransformersEngine(model_path).model, None
    model = copy.deepcopy(model).train()
    with torch.no_grad():
        lp = token_logprobs(model, batch).double().numpy()
    on_policy = copy.copy(batch)
    on_policy.old_logprobs = torch.tensor(lp, dtype=torch.float32)
    mask, rewards = batch.mask.double().numpy(), batch.rewards.double().numpy()
    advantages = expected_advantages(algorithm.advantage, rewards, batch.group_index.numpy(),
                                     mask)
    per_token = {"ppo": -advantages, "gspo": -advantages, "cispo": -advantages * lp,
                 "opmd": -advantages * lp / (1 + algorithm.tau), "sft": -lp}
    expected = _aggregate(per_token[algorithm.policy_loss], mask, algorithm.aggregation)
    reference = copy.deepcopy(model).eval() if algorithm.needs_reference else None
    critic = (build_critic(model_path, torch.device("cpu"), lr=1e-3, value_clip=0.2)
              if algorithm.needs_critic else None)
    metrics = train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), on_policy,
                         algorithm, micro_batch=5, reference=reference, critic=critic)
    assert metrics["loss"] == pytest.approx(expected, abs=2e-5)


def test_dr_grpo_does_not_normalise_and_sums_tokens():
    dr = PRESETS["dr-grpo"]
    assert (dr.advantage, dr.aggregation) == ("dr-grpo", "seq-mean-token-sum")


def test_grpo_kl_loss_changes_with_kl_coef_and_the_reference_stays_frozen(model_path, batch):
    start = TransformersEngine(model_path).model
    reference = copy.deepcopy(start).eval()
    for param in reference.parameters():
        param.requires_grad_(False)
    frozen = {name: p.clone() for name, p in reference.named_parameters()}
    model = copy.deepcopy(start).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):  # the policy moves away from the reference: KL > 0
        train_step(model, optimizer, batch, PRESETS["grpo-kl"], micro_batch=6,
                   reference=reference)
    losses, kls = {}, {}
    for coef in (0.0, 0.04, 1.0):  # the same weights, no update: loss = policy + coef * KL
        metrics = train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), batch,
                             PRESETS["grpo-kl"].replace(kl_coef=coef), micro_batch=6,
                             reference=reference if coef else None, max_grad_norm=None)
        losses[coef], kls[coef] = metrics["loss"], metrics.get("kl")
    assert kls[0.04] > 0 and kls[0.04] == pytest.approx(kls[1.0])
    assert losses[0.04] == pytest.approx(losses[0.0] + 0.04 * kls[0.04], abs=1e-6)
    assert losses[1.0] == pytest.approx(losses[0.0] + kls[1.0], abs=1e-6)
    for name, param in reference.named_parameters():
        assert torch.equal(param, frozen[name]), name
    with pytest.raises(ValueError, match="reference"):
        train_step(copy.deepcopy(start), torch.optim.SGD(start.parameters(), lr=0.0), batch,
                   PRESETS["grpo-kl"], micro_batch=6)


@pytest.mark.slow
def test_ppo_trains_its_critic_towards_the_returns(model_path, batch):
    model = copy.deepcopy(TransformersEngine(model_path).model).train()
    critic = build_critic(model_path, torch.device("cpu"), lr=1e-2, value_clip=None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses = [train_step(model, optimizer, batch, PRESETS["ppo"], micro_batch=6,
                         critic=critic)["critic/loss"] for _ in range(15)]
    assert losses[-1] < 0.5 * losses[0]


def test_step_metrics_are_the_whole_batch_s_whatever_the_micro_batch(model_path, batch):
    """Per-micro-batch metrics are weighted as the loss is (tokens for token-mean), so KL,
    entropy and clip fraction are the batch's own, not a mean of micro-batch means."""
    start = TransformersEngine(model_path).model
    reference = copy.deepcopy(start).eval()
    moved = copy.deepcopy(start).train()
    train_step(moved, torch.optim.AdamW(moved.parameters(), lr=1e-2), batch,
               PRESETS["grpo"], micro_batch=12)
    uneven = copy.copy(batch)  # responses of different lengths: rows and tokens weigh apart
    uneven.mask = batch.mask.clone()
    for row in range(0, len(batch), 2):
        trained = torch.nonzero(uneven.mask[row])[:, 0]
        uneven.mask[row, trained[-(1 + row % 4):]] = 0
    algorithm = PRESETS["grpo-kl"].replace(entropy_coef=0.01)
    seen = [train_step(copy.deepcopy(moved), torch.optim.SGD(moved.parameters(), lr=0.0), uneven,
                       algorithm, micro_batch=micro, reference=reference, max_grad_norm=None)
            for micro in (len(batch), 5, 1)]
    for name in ("loss", "kl", "entropy", "policy/clip_fraction", "policy/ratio_mean"):
        assert seen[1][name] == pytest.approx(seen[0][name], abs=1e-6), name
        assert seen[2][name] == pytest.approx(seen[0][name], abs=1e-6), name
