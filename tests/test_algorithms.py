"""Algorithm pieces against values computed independently with numpy, to 1e-6."""

import numpy as np
import pytest
import torch

from reservoir.errors import ConfigError
from reservoir.trainer.algorithms import (ADVANTAGES, KL_ESTIMATORS, POLICY_LOSSES, aggregate,
                                          clipped_policy_loss, grpo_advantages)
from reservoir.registry import Registry

RNG = np.random.default_rng(7)
REWARDS = np.array([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 2.0, -1.0, 3.0])
GROUPS = np.array([4, 4, 4, 4, 9, 9, 9, 2, 2, 5])
LP = RNG.normal(-1.0, 0.3, size=(4, 6))
OLD = LP + RNG.normal(0.0, 0.3, size=(4, 6))
MASK = np.array([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]])
ADV = np.array([1.5, -0.5, 0.25, -2.0])


def t(array):
    return torch.tensor(array, dtype=torch.float64)


def reference_grpo(rewards, groups, eps=1e-6, normalize_std=True):
    out = np.zeros_like(rewards)
    for g in np.unique(groups):
        members = groups == g
        if members.sum() == 1:
            continue
        r = rewards[members]
        centred = r - r.mean()
        out[members] = centred / (r.std() + eps) if normalize_std else centred
    return out


@pytest.mark.parametrize("normalize_std", [True, False])
def test_grpo_advantages_match_a_loop_over_groups(normalize_std):
    got, metrics = grpo_advantages(t(REWARDS), torch.tensor(GROUPS), normalize_std=normalize_std)
    np.testing.assert_allclose(got.numpy(), reference_grpo(REWARDS, GROUPS,
                                                           normalize_std=normalize_std), atol=1e-6)
    assert metrics["advantage/zero_variance_groups"] == pytest.approx(2 / 4)  # groups 9 and 5


def reference_aggregate(values, mask, mode):
    if mode == "token-mean":
        return (values * mask).sum() / mask.sum()
    sums = (values * mask).sum(axis=1)
    return (sums / mask.sum(axis=1)).mean() if mode == "seq-mean-token-mean" else sums.mean()


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_aggregations(mode):
    values = RNG.normal(size=(4, 6))
    got = aggregate(t(values), t(MASK), mode)
    assert float(got) == pytest.approx(reference_aggregate(values, MASK, mode), abs=1e-6)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_clipped_loss_by_hand(mode):
    ratio = np.exp(LP - OLD)
    adv = ADV[:, None] * np.ones_like(LP)
    per_token = -np.minimum(ratio * adv, np.clip(ratio, 0.8, 1.28) * adv)
    expected = reference_aggregate(per_token, MASK, mode)
    loss, metrics = clipped_policy_loss(t(LP), t(OLD), t(ADV), t(MASK), clip_low=0.2,
                                        clip_high=0.28, aggregation=mode)
    assert float(loss) == pytest.approx(expected, abs=1e-6)
    clipped = (np.clip(ratio, 0.8, 1.28) * adv < ratio * adv)
    assert metrics["policy/clip_fraction"] == pytest.approx((clipped * MASK).sum() / MASK.sum())


def test_clipped_loss_gradient_is_zero_where_clipped():
    lp = t(LP).requires_grad_(True)
    loss, _ = clipped_policy_loss(lp, t(OLD), t(ADV), t(MASK))
    loss.backward()
    ratio = np.exp(LP - OLD)
    adv = ADV[:, None] * np.ones_like(LP)
    active = ~((adv > 0) & (ratio > 1.2) | (adv < 0) & (ratio < 0.8)) & (MASK == 1)
    assert np.all((lp.grad.numpy() != 0) == active)


@pytest.mark.parametrize("name, formula", [
    ("k1", lambda lp, ref: lp - ref),
    ("k2", lambda lp, ref: 0.5 * (lp - ref) ** 2),
    ("k3", lambda lp, ref: np.exp(ref - lp) - (ref - lp) - 1),
])
def test_kl_estimators(name, formula):
    got = KL_ESTIMATORS.get(name)(t(LP), t(OLD))
    np.testing.assert_allclose(got.numpy(), formula(LP, OLD), atol=1e-6)


def test_k3_is_non_negative_and_zero_on_equal_policies():
    assert (KL_ESTIMATORS.get("k3")(t(LP), t(OLD)) >= 0).all()
    assert float(KL_ESTIMATORS.get("k3")(t(LP), t(LP)).abs().max()) == 0.0


def test_registries_reject_duplicates_and_name_the_valid_choices():
    registry = Registry("thing")
    registry.register("a")(len)
    with pytest.raises(ValueError, match="already registered"):
        registry.register("a")(len)
    with pytest.raises(ConfigError, match="unknown policy loss 'clipt'; valid: clipped"):
        POLICY_LOSSES.get("clipt")
    assert "grpo" in ADVANTAGES.names()
