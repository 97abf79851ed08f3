"""Algorithm pieces against references written independently in plain numpy (loops over groups
and tokens, from the math), on fixed float64 tensors, to 1e-6."""

import numpy as np
import pytest
import torch

from reservoir.errors import ConfigError
from reservoir.registry import Registry
from reservoir.trainer.algorithms import (ADVANTAGES, KL_ESTIMATORS, POLICY_LOSSES,
                                          PREFERENCE_LOSSES, Episodes, aggregate, call,
                                          discounted_returns, entropy_from_logits, gae,
                                          grpo_advantages, ppo_loss, value_loss, whiten)

pytestmark = pytest.mark.store_agnostic  # the same on any server: CI runs it once

# -- fixtures: a batch of 10 sequences x 6 tokens ----------------------------------------------

RNG = np.random.default_rng(7)
ATOL = 1e-6
MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
REWARDS = np.array([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 2.0, -1.0, 3.0])
GROUPS = np.array([4, 4, 4, 4, 9, 9, 9, 2, 2, 5])  # 9: zero variance, 5: a group of one
MASK = np.array([[1, 1, 1, 0, 0, 0],
                 [1, 1, 1, 1, 1, 1],
                 [1, 0, 0, 0, 0, 0],
                 [1, 1, 1, 1, 0, 0],
                 [1, 1, 0, 0, 1, 1],   # multi-turn: the tool's tokens in the middle are masked
                 [0, 1, 1, 1, 1, 0],
                 [1, 0, 1, 0, 1, 0],
                 [1, 1, 1, 1, 1, 0],
                 [1, 1, 0, 1, 1, 1],
                 [0, 0, 1, 1, 1, 1]], dtype=float)
TOKEN_REWARDS = RNG.normal(0.0, 0.1, size=MASK.shape)
VALUES = RNG.normal(0.5, 0.5, size=MASK.shape)
OLD_VALUES = VALUES + RNG.normal(0.0, 0.3, size=MASK.shape)
RETURNS = RNG.normal(0.5, 0.5, size=MASK.shape)
LP = RNG.normal(-1.0, 0.3, size=MASK.shape)
LOG_RATIO = RNG.normal(0.0, 0.3, size=MASK.shape)
LOG_RATIO[1, :3] = np.log(5.0)  # large ratios on negative advantages: the dual clip bites
LOG_RATIO[3, 1] = 1.5
OLD = LP - LOG_RATIO
ADV = np.array([1.5, -0.5, 0.25, -2.0, 0.8, -1.2, 2.0, -0.3, 1.0, -0.8])
TOKEN_ADV = RNG.normal(0.0, 1.0, size=MASK.shape)
GAMMA, LAM, TAU = 0.9, 0.8, 0.7


def t(array):
    return torch.tensor(array, dtype=torch.float64)


def episodes(token_rewards=None, values=None):
    return Episodes(t(REWARDS), torch.tensor(GROUPS), t(MASK),
                    None if token_rewards is None else t(token_rewards),
                    None if values is None else t(values))


def per_token(advantages):
    return advantages[:, None] * np.ones(MASK.shape) if advantages.ndim == 1 else advantages


def elementwise(function, *arrays):
    """function(scalars...) at every [i, t]."""
    rows, cols = arrays[0].shape
    return np.array([[function(*(a[i, j] for a in arrays)) for j in range(cols)]
                     for i in range(rows)])


# -- numpy references -------------------------------------------------------------------------

def reference_weights(mask, mode):
    """d aggregate / d value of each token."""
    weights = np.zeros(mask.shape)
    for i in range(mask.shape[0]):
        for j in range(mask.shape[1]):
            if mask[i, j]:
                weights[i, j] = {"token-mean": 1 / mask.sum(),
                                 "seq-mean-token-mean": 1 / (mask[i].sum() * mask.shape[0]),
                                 "seq-mean-token-sum": 1 / mask.shape[0]}[mode]
    return weights


def reference_aggregate(values, mask, mode):
    return float((values * reference_weights(mask, mode)).sum())


def reference_sequence_rewards(rewards, token_rewards, mask):
    out = rewards.copy()
    for i in range(len(rewards)):
        for j in range(mask.shape[1]):
            out[i] += token_rewards[i, j] if mask[i, j] else 0.0
    return out


def reference_dense_rewards(rewards, token_rewards, mask):
    dense = np.zeros(mask.shape) if token_rewards is None else token_rewards * mask
    for i in range(len(rewards)):
        dense[i, np.flatnonzero(mask[i])[-1]] += rewards[i]
    return dense


def reference_by_group(rewards, groups, advantage_of):
    """advantage_of(the group's rewards) per group; groups of one get 0."""
    out = np.zeros_like(rewards)
    for g in np.unique(groups):
        members = np.flatnonzero(groups == g)
        if len(members) > 1:
            out[members] = advantage_of(rewards[members])
    return out


def leave_one_out(r):
    return np.array([r[k] - np.delete(r, k).mean() for k in range(len(r))])


GROUP_ADVANTAGES = [  # (registered name, options, the advantages of one group's rewards)
    pytest.param("grpo", {}, lambda r: (r - r.mean()) / (r.std() + 1e-6), id="grpo"),
    pytest.param("dr-grpo", {}, lambda r: r - r.mean(), id="dr-grpo"),
    pytest.param("rloo", {}, leave_one_out, id="rloo"),
    pytest.param("opmd", {"tau": TAU, "opmd_baseline": "mean"}, lambda r: r - r.mean(),
                 id="opmd-mean"),
    pytest.param("opmd", {"tau": TAU, "opmd_baseline": "logavgexp"},
                 lambda r: r - TAU * np.log(np.mean(np.exp(r / TAU))), id="opmd-logavgexp"),
]


def reference_whiten(values, mask, eps=1e-6):
    on = mask > 0
    out = np.zeros_like(values)
    out[on] = (values[on] - values[on].mean()) / (values[on].std() + eps)
    return out


def reference_discounted_returns(rewards, mask, gamma):
    out = np.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        running = 0.0
        for j in reversed(np.flatnonzero(mask[i])):
            running = out[i, j] = rewards[i, j] + gamma * running
    return out


def reference_gae(rewards, values, mask, gamma, lam):
    advantages = np.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        next_value = next_advantage = 0.0
        for j in reversed(np.flatnonzero(mask[i])):
            delta = rewards[i, j] + gamma * next_value - values[i, j]
            next_advantage = advantages[i, j] = delta + gamma * lam * next_advantage
            next_value = values[i, j]
    return advantages, (advantages + values) * mask


def clip(x, low, high):
    return min(max(x, 1 - low), 1 + high)


def reference_ppo_token(ratio, advantage, low, high, dual_clip):
    loss = max(-ratio * advantage, -clip(ratio, low, high) * advantage)
    return min(loss, -dual_clip * advantage) if dual_clip and advantage < 0 else loss


def reference_ppo_gradient(ratio, advantage, low, high, dual_clip):
    """d per-token loss / d logprob (the ratio's gradient is the ratio)."""
    clipped = (advantage > 0 and ratio > 1 + high) or (advantage < 0 and ratio < 1 - low)
    dual = bool(dual_clip) and advantage < 0 and ratio > dual_clip
    return 0.0 if clipped or dual else -ratio * advantage


def sequence_ratios(log_ratio, mask):
    return np.array([np.exp(log_ratio[i][mask[i] > 0].mean()) for i in range(len(mask))])


def backward(loss_fn, logprobs, *args, **options):
    lp = t(logprobs).requires_grad_(True)
    loss, metrics = loss_fn(lp, *args, **options)
    loss.backward()
    return float(loss.detach()), lp.grad.numpy(), metrics


# -- reductions -------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_aggregations(mode):
    got = aggregate(t(VALUES), t(MASK), mode)
    assert float(got) == pytest.approx(reference_aggregate(VALUES, MASK, mode), abs=ATOL)


def test_whiten_over_masked_entries_only():
    got = whiten(t(RETURNS), t(MASK), 1e-6)
    np.testing.assert_allclose(got.numpy(), reference_whiten(RETURNS, MASK), atol=ATOL)


def test_discounted_returns():
    got = discounted_returns(t(TOKEN_REWARDS), t(MASK), GAMMA)
    expected = reference_discounted_returns(TOKEN_REWARDS, MASK, GAMMA)
    np.testing.assert_allclose(got.numpy(), expected, atol=ATOL)


def test_discounted_returns_skip_the_tool_tokens_of_a_multi_turn_episode():
    rewards = np.array([[0.1, 0.2, 50.0, -50.0, 0.3, 1.0]])  # the hole's rewards do not count
    got = discounted_returns(t(rewards), t([[1, 1, 0, 0, 1, 1]]), GAMMA).numpy()
    compact = reference_discounted_returns(np.array([[0.1, 0.2, 0.3, 1.0]]), np.ones((1, 4)), GAMMA)
    np.testing.assert_allclose(got[:, [0, 1, 4, 5]], compact, atol=ATOL)
    assert np.all(got[:, 2:4] == 0)


# -- episodes and advantages ------------------------------------------------------------------

def test_episode_sequence_and_dense_rewards():
    batch = episodes(TOKEN_REWARDS)
    np.testing.assert_allclose(batch.sequence_rewards().numpy(),
                               reference_sequence_rewards(REWARDS, TOKEN_REWARDS, MASK), atol=ATOL)
    np.testing.assert_allclose(batch.dense_rewards().numpy(),
                               reference_dense_rewards(REWARDS, TOKEN_REWARDS, MASK), atol=ATOL)


def test_dense_rewards_without_token_rewards_put_the_outcome_on_the_last_trained_token():
    np.testing.assert_allclose(episodes().dense_rewards().numpy(),
                               reference_dense_rewards(REWARDS, None, MASK), atol=ATOL)


@pytest.mark.parametrize("token_rewards", [None, TOKEN_REWARDS], ids=["outcome", "with-tokens"])
@pytest.mark.parametrize("name, options, advantage_of", GROUP_ADVANTAGES)
def test_group_advantages_match_a_loop_over_groups(name, options, advantage_of, token_rewards):
    got, _ = ADVANTAGES.get(name)(episodes(token_rewards), **options)
    rewards = REWARDS if token_rewards is None else \
        reference_sequence_rewards(REWARDS, token_rewards, MASK)
    np.testing.assert_allclose(got.numpy(), reference_by_group(rewards, GROUPS, advantage_of),
                               atol=ATOL)


def test_grpo_counts_zero_variance_groups():
    _, metrics = grpo_advantages(episodes())
    assert metrics["advantage/zero_variance_groups"] == pytest.approx(2 / 4)  # groups 9 and 5


def test_reinforce_pp_whitens_discounted_dense_returns_over_the_batch():
    got, _ = ADVANTAGES.get("reinforce++")(episodes(TOKEN_REWARDS), gamma=GAMMA)
    dense = reference_dense_rewards(REWARDS, TOKEN_REWARDS, MASK)
    expected = reference_whiten(reference_discounted_returns(dense, MASK, GAMMA), MASK)
    np.testing.assert_allclose(got.numpy(), expected, atol=ATOL)


def test_gae_advantages_and_returns():
    advantages, returns = gae(t(TOKEN_REWARDS), t(VALUES), t(MASK), gamma=GAMMA, lam=LAM)
    expected_advantages, expected_returns = reference_gae(TOKEN_REWARDS, VALUES, MASK, GAMMA, LAM)
    np.testing.assert_allclose(advantages.numpy(), expected_advantages, atol=ATOL)
    np.testing.assert_allclose(returns.numpy(), expected_returns, atol=ATOL)


def test_gae_skips_the_tool_tokens_of_a_multi_turn_episode():
    rewards = np.array([[0.1, 0.2, 50.0, -50.0, 0.3, 1.0]])
    values = np.array([[0.4, 0.5, 99.0, -99.0, 0.6, 0.7]])  # the hole's values do not count
    got, _ = gae(t(rewards), t(values), t([[1, 1, 0, 0, 1, 1]]), gamma=GAMMA, lam=LAM)
    kept = [0, 1, 4, 5]
    compact, _ = reference_gae(rewards[:, kept], values[:, kept], np.ones((1, 4)), GAMMA, LAM)
    np.testing.assert_allclose(got.numpy()[:, kept], compact, atol=ATOL)
    assert np.all(got.numpy()[:, 2:4] == 0)


def test_registered_gae_whitens_gae_of_the_dense_rewards():
    got, _ = ADVANTAGES.get("gae")(episodes(TOKEN_REWARDS, VALUES), gamma=GAMMA, lam=LAM)
    dense = reference_dense_rewards(REWARDS, TOKEN_REWARDS, MASK)
    raw, _ = reference_gae(dense, VALUES, MASK, GAMMA, LAM)
    np.testing.assert_allclose(got.numpy(), reference_whiten(raw, MASK), atol=ATOL)


def test_gae_needs_values():
    with pytest.raises(ValueError, match="critic"):
        ADVANTAGES.get("gae")(episodes(TOKEN_REWARDS))


def test_no_advantages_are_zeros():
    got, _ = ADVANTAGES.get("none")(episodes())
    assert got.shape == REWARDS.shape and float(got.abs().max()) == 0.0


# -- policy losses ----------------------------------------------------------------------------

@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("advantages", [ADV, TOKEN_ADV], ids=["sequence", "token"])
@pytest.mark.parametrize("mode", MODES)
def test_ppo_loss_and_gradient(mode, advantages, dual_clip):
    options = dict(clip_low=0.2, clip_high=0.28, dual_clip=dual_clip, aggregation=mode)
    loss, grad, metrics = backward(ppo_loss, LP, t(OLD), t(advantages), t(MASK), **options)
    ratio, adv = np.exp(LP - OLD), per_token(advantages)
    args = (0.2, 0.28, dual_clip)
    expected = elementwise(lambda r, a: reference_ppo_token(r, a, *args), ratio, adv)
    assert loss == pytest.approx(reference_aggregate(expected, MASK, mode), abs=ATOL)
    expected_grad = elementwise(lambda r, a: reference_ppo_gradient(r, a, *args), ratio, adv)
    np.testing.assert_allclose(grad, expected_grad * reference_weights(MASK, mode), atol=ATOL)
    clipped = np.clip(ratio, 0.8, 1.28) * adv < ratio * adv
    assert metrics["policy/clip_fraction"] == pytest.approx((clipped * MASK).sum() / MASK.sum())


def test_ppo_dual_clip_bites_and_stops_the_gradient():
    on = MASK > 0
    _, grad, metrics = backward(ppo_loss, LP, t(OLD), t(ADV), t(MASK), dual_clip=3.0)
    dual = on & (per_token(ADV) < 0) & (np.exp(LP - OLD) > 3.0)
    assert dual.sum() == 4  # row 1's first three tokens, row 3's second
    assert np.all(grad[dual] == 0)
    assert metrics["policy/dual_clip_fraction"] == pytest.approx(dual.sum() / on.sum())
    plain, _ = ppo_loss(t(LP), t(OLD), t(ADV), t(MASK))
    dual_loss, _ = ppo_loss(t(LP), t(OLD), t(ADV), t(MASK), dual_clip=3.0)
    assert float(dual_loss) < float(plain)


def test_ppo_gradient_is_zero_where_clipped():
    _, grad, _ = backward(ppo_loss, LP, t(OLD), t(ADV), t(MASK))
    ratio, adv = np.exp(LP - OLD), per_token(ADV)
    active = ~((adv > 0) & (ratio > 1.2) | (adv < 0) & (ratio < 0.8)) & (MASK == 1)
    assert np.all((grad != 0) == active)


@pytest.mark.parametrize("mode", MODES)
def test_gspo_loss_and_gradient_use_the_sequence_ratio(mode):
    low, high = 0.05, 0.1
    loss, grad, _ = backward(POLICY_LOSSES.get("gspo"), LP, t(OLD), t(ADV), t(MASK),
                             clip_low=low, clip_high=high, aggregation=mode)
    s = sequence_ratios(LP - OLD, MASK)
    per_sequence = [max(-s[i] * ADV[i], -clip(s[i], low, high) * ADV[i]) for i in range(len(s))]
    assert loss == pytest.approx(reference_aggregate(per_token(np.array(per_sequence)), MASK, mode),
                                 abs=ATOL)
    clipped = np.array([(a > 0 and r > 1 + high) or (a < 0 and r < 1 - low)
                        for r, a in zip(s, ADV)])
    assert clipped.any() and not clipped.all()
    expected_grad = per_token(np.where(clipped, 0.0, -s * ADV)) * reference_weights(MASK, mode)
    np.testing.assert_allclose(grad, expected_grad, atol=ATOL)


@pytest.mark.parametrize("mode", MODES)
def test_cispo_loss_and_gradient_keep_every_token(mode):
    loss, grad, _ = backward(POLICY_LOSSES.get("cispo"), LP, t(OLD), t(ADV), t(MASK),
                             clip_low=0.2, clip_high=0.28, aggregation=mode)
    weight = elementwise(lambda r: clip(r, 0.2, 0.28), np.exp(LP - OLD))
    assert (weight != np.exp(LP - OLD))[MASK > 0].any()
    adv = per_token(ADV)
    assert loss == pytest.approx(reference_aggregate(-weight * adv * LP, MASK, mode), abs=ATOL)
    expected_grad = -weight * adv * reference_weights(MASK, mode)
    np.testing.assert_allclose(grad, expected_grad, atol=ATOL)
    assert np.all(grad[MASK > 0] != 0)


@pytest.mark.parametrize("mode", MODES)
def test_opmd_loss(mode):
    loss, _ = POLICY_LOSSES.get("opmd")(t(LP), t(OLD), t(ADV), t(MASK), tau=TAU, aggregation=mode)
    expected = reference_aggregate(-per_token(ADV) * LP, MASK, mode) / (1 + TAU)
    assert float(loss) == pytest.approx(expected, abs=ATOL)


@pytest.mark.parametrize("mode", MODES)
def test_sft_loss(mode):
    loss, _ = POLICY_LOSSES.get("sft")(t(LP), t(OLD), t(ADV), t(MASK), aggregation=mode)
    assert float(loss) == pytest.approx(reference_aggregate(-LP, MASK, mode), abs=ATOL)


# -- preference, value, KL, entropy -----------------------------------------------------------

CHOSEN = np.array([0.5, -1.0, 2.0, 0.1, -0.3])
REJECTED = np.array([-0.5, 0.2, 1.0, 0.4, -2.0])


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_loss_and_gradient(beta):
    chosen, rejected = t(CHOSEN).requires_grad_(True), t(REJECTED).requires_grad_(True)
    loss, metrics = PREFERENCE_LOSSES.get("dpo")(chosen, rejected, beta=beta)
    loss.backward()
    margin = beta * (CHOSEN - REJECTED)
    assert float(loss.detach()) == pytest.approx(np.mean(np.log1p(np.exp(-margin))), abs=ATOL)
    d_margin = -1 / (1 + np.exp(margin)) / len(margin)  # d/dm of -log sigmoid(m), averaged
    np.testing.assert_allclose(chosen.grad.numpy(), beta * d_margin, atol=ATOL)
    np.testing.assert_allclose(rejected.grad.numpy(), -beta * d_margin, atol=ATOL)
    assert metrics["dpo/accuracy"] == pytest.approx(3 / 5)


def test_dpo_beta_changes_the_loss():
    dpo = PREFERENCE_LOSSES.get("dpo")
    assert float(dpo(t(CHOSEN), t(REJECTED), beta=0.1)[0]) != \
        pytest.approx(float(dpo(t(CHOSEN), t(REJECTED), beta=0.5)[0]), abs=1e-3)


@pytest.mark.parametrize("value_clip", [None, 0.2])
@pytest.mark.parametrize("mode", MODES)
def test_value_loss(mode, value_clip):
    loss, _ = value_loss(t(VALUES), t(OLD_VALUES), t(RETURNS), t(MASK), value_clip=value_clip,
                         aggregation=mode)

    def per_token_loss(v, old, ret):
        if value_clip is None:
            return (v - ret) ** 2
        return max((v - ret) ** 2, (old + min(max(v - old, -value_clip), value_clip) - ret) ** 2)

    expected = 0.5 * reference_aggregate(elementwise(per_token_loss, VALUES, OLD_VALUES, RETURNS),
                                         MASK, mode)
    assert float(loss) == pytest.approx(expected, abs=ATOL)


def test_value_clip_changes_the_loss():
    plain, _ = value_loss(t(VALUES), t(OLD_VALUES), t(RETURNS), t(MASK), value_clip=None)
    clipped, _ = value_loss(t(VALUES), t(OLD_VALUES), t(RETURNS), t(MASK), value_clip=0.2)
    assert float(clipped) > float(plain)


@pytest.mark.parametrize("name, formula", [
    ("k1", lambda lp, ref: lp - ref),
    ("k2", lambda lp, ref: 0.5 * (lp - ref) ** 2),
    ("k3", lambda lp, ref: np.exp(ref - lp) - (ref - lp) - 1),
])
def test_kl_estimators(name, formula):
    got = KL_ESTIMATORS.get(name)(t(LP), t(OLD))
    np.testing.assert_allclose(got.numpy(), formula(LP, OLD), atol=ATOL)


def test_k3_is_non_negative_and_zero_on_equal_policies():
    assert (KL_ESTIMATORS.get("k3")(t(LP), t(OLD)) >= 0).all()
    assert float(KL_ESTIMATORS.get("k3")(t(LP), t(LP)).abs().max()) == 0.0


def test_entropy_from_logits():
    logits = RNG.normal(0.0, 2.0, size=(3, 4, 7))
    expected = np.zeros(logits.shape[:-1])
    for index in np.ndindex(*logits.shape[:-1]):
        p = np.exp(logits[index]) / np.exp(logits[index]).sum()
        expected[index] = -sum(q * np.log(q) for q in p)
    np.testing.assert_allclose(entropy_from_logits(t(logits)).numpy(), expected, atol=ATOL)


# -- options and registries -------------------------------------------------------------------

def test_call_passes_the_declared_options_and_ignores_the_others():
    sft = POLICY_LOSSES.get("sft")
    got, _ = call(sft, t(LP), t(OLD), t(ADV), t(MASK), aggregation="seq-mean-token-sum",
                  tau=3.0, no_such_option=1)
    assert float(got) == pytest.approx(reference_aggregate(-LP, MASK, "seq-mean-token-sum"),
                                       abs=ATOL)


def test_registries_reject_duplicates_and_name_the_valid_choices():
    registry = Registry("thing")
    registry.register("a")(len)
    with pytest.raises(ValueError, match="already registered"):
        registry.register("a")(len)
    with pytest.raises(ConfigError,
                       match="unknown policy loss 'clipt'; valid: cispo, gspo, opmd, ppo, sft"):
        POLICY_LOSSES.get("clipt")


def test_every_registered_piece_is_tested_here():
    assert ADVANTAGES.names() == sorted(["dr-grpo", "gae", "grpo", "none", "opmd", "reinforce++",
                                         "rloo"])
    assert POLICY_LOSSES.names() == ["cispo", "gspo", "opmd", "ppo", "sft"]
    assert PREFERENCE_LOSSES.names() == ["dpo"]
    assert KL_ESTIMATORS.names() == ["k1", "k2", "k3"]
