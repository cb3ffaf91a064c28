"""Tests of engine/advantages.py: group (outcome) advantages, the worked process-supervision example (two
solutions of 2x + 3 = 7, one right, one wrong from step 2), GAE."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch

from engine.advantages import gae_advantages, group_advantages, masked_whiten, process_advantages

# ----------------------------------------------------------------------------------------------------------------
# group_advantages

# rewards (1, 0, 0, 1): mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3)
HALF_OVER_STD = 0.5 / (math.sqrt(1 / 3) + 1e-6)


@pytest.mark.parametrize(
    ("rewards", "group_size", "scale", "expected"),
    [
        ([1, 0, 0, 1], 4, True, [HALF_OVER_STD, -HALF_OVER_STD, -HALF_OVER_STD, HALF_OVER_STD]),
        ([1, 0, 0, 1], 4, False, [0.5, -0.5, -0.5, 0.5]),
        # two groups of 2: (3, 1) -> mean 2, unbiased std sqrt(2); (0.2, 0.2) has no signal
        ([3, 1, 0.2, 0.2], 2, True, [1 / (math.sqrt(2) + 1e-6), -1 / (math.sqrt(2) + 1e-6), 0.0, 0.0]),
        # (0.1, 0.1, 0.1): float rounding must not leak a tiny non-zero through / 1e-6
        ([0.1, 0.1, 0.1], 3, True, [0.0, 0.0, 0.0]),
        ([0.1, 0.1, 0.1], 3, False, [0.0, 0.0, 0.0]),
        # a group of one has no peers: 0
        ([5.0, -2.0], 1, True, [0.0, 0.0]),
        # Dr. GRPO keeps the scale: (2, 0, 1) - 1
        ([2, 0, 1], 3, False, [1.0, -1.0, 0.0]),
    ],
    ids=["std", "dr-grpo", "two-groups-one-flat", "all-equal", "all-equal-dr", "group-of-one", "dr-grpo-scale"],
)
def test_group_advantages(rewards, group_size, scale, expected):
    out = group_advantages(torch.tensor(rewards, dtype=torch.float64), group_size, scale_by_std=scale)
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-9)


def test_group_advantages_accepts_lists_and_returns_float():
    out = group_advantages([1, 0], 2)
    assert out.is_floating_point() and out.shape == (2,)
    assert out[0] > 0 > out[1]


@pytest.mark.parametrize(
    ("rewards", "group_size", "words"),
    [
        ([1.0, 0.0, 1.0], 2, ["3 rewards", "groups of 2", "divisible"]),
        ([1.0, 0.0], 0, ["group_size", "int >= 1"]),
        ([1.0, 0.0], 1.5, ["group_size", "int >= 1"]),
        ([[1.0, 0.0]], 2, ["shape", "1-d"]),
        ([1.0, float("nan")], 2, ["NaN", "finite"]),
    ],
    ids=["not-divisible", "zero-group", "float-group", "2d", "nan"],
)
def test_group_advantages_validation(rewards, group_size, words):
    with pytest.raises(ValueError) as err:
        group_advantages(rewards, group_size)
    for w in words:
        assert w in str(err.value)


# ----------------------------------------------------------------------------------------------------------------
# process_advantages: the worked PRM example (2x + 3 = 7, one solution right, one wrong from step 2)

WORKED_REWARDS = [[0.9, 0.95, 0.8], [0.9, -0.8, -0.9]]
WORKED_ENDS = [[3, 7, 9], [2, 5, 8]]  # last token of each step
WORKED_LENGTHS = [10, 9]


def test_process_advantages_on_the_worked_example_by_hand():
    # all six step rewards: mean 1.85 / 6 = 0.308333, unbiased std sqrt(4.042083 / 5) = 0.899120
    # normalized: 0.658050, 0.713660, 0.546830 | 0.658050, -1.232685, -1.343905 (they sum to 0, so the two
    # answers' first-token advantages are opposite)
    out = process_advantages(WORKED_REWARDS, WORKED_ENDS, WORKED_LENGTHS)
    assert out.shape == (2, 10)
    first = [1.918541] * 4 + [1.260490] * 4 + [0.546830] * 2  # steps 1+2+3, steps 2+3, step 3
    second = [-1.918541] * 3 + [-2.576591] * 3 + [-1.343905] * 3 + [0.0]  # last column is padding
    torch.testing.assert_close(out, torch.tensor([first, second], dtype=out.dtype), rtol=0, atol=5e-6)


def test_normalized_step_rewards_by_hand_and_as_the_advantages_use_them():
    from engine.advantages import normalized_step_rewards

    normed = normalized_step_rewards(WORKED_REWARDS)  # the hand values of the test above
    np.testing.assert_allclose(normed[0], [0.658050, 0.713660, 0.546830], atol=5e-6)
    np.testing.assert_allclose(normed[1], [0.658050, -1.232685, -1.343905], atol=5e-6)
    # a step's own term is what its last token has more than the next token
    out = torch.nn.functional.pad(process_advantages(WORKED_REWARDS, WORKED_ENDS, WORKED_LENGTHS), (0, 1))
    for i, ends in enumerate(WORKED_ENDS):
        np.testing.assert_allclose([float(out[i, e] - out[i, e + 1]) for e in ends], normed[i], atol=1e-6)
    # no signal: exactly 0 (not a rounding residue divided by 1e-6), nesting kept, empty completions allowed
    assert normalized_step_rewards([[0.1, 0.1], [0.1], []]) == [[0.0, 0.0], [0.0], []]
    assert normalized_step_rewards([[0.7]]) == [[0.0]]
    with pytest.raises(ValueError, match="NaN or inf"):
        normalized_step_rewards([[0.1, float("nan")]])


def test_process_advantages_matches_the_formula_with_stdlib_statistics():
    flat = [x for rs in WORKED_REWARDS for x in rs]
    mu, sd = statistics.mean(flat), statistics.stdev(flat)  # stdev is the unbiased (n - 1) estimate
    normed = [[(x - mu) / (sd + 1e-6) for x in rs] for rs in WORKED_REWARDS]
    expected = np.zeros((2, 10))
    for i, (ends, n) in enumerate(zip(WORKED_ENDS, WORKED_LENGTHS, strict=True)):
        for t in range(n):
            expected[i, t] = sum(rt for rt, end in zip(normed[i], ends, strict=True) if end >= t)
    out = process_advantages(WORKED_REWARDS, WORKED_ENDS, WORKED_LENGTHS)
    np.testing.assert_allclose(out.double().numpy(), expected, rtol=0, atol=1e-6)
    # what the example shows: the second answer goes wrong at step 2, so its early tokens are pushed down
    assert bool((out[1, :9] < 0).all()) and bool((out[0] > 0).all())


def test_process_advantages_tokens_after_last_step_get_zero():
    out = process_advantages([[1.0], [0.0]], [[1], [0]], [4, 3])
    # normalized: +-0.5 / (std(1, 0) + 1e-6) = +-0.5 / (0.707107 + 1e-6)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(out, torch.tensor([[a, a, 0, 0], [-a, 0, 0, 0]], dtype=out.dtype), rtol=0, atol=1e-6)


def test_process_advantages_all_equal_steps_and_empty_completion():
    out = process_advantages([[0.5, 0.5], []], [[0, 2], []], [3, 0])
    assert out.shape == (2, 3) and bool((out == 0).all())


def test_process_advantages_accepts_numpy_integers():
    ends = [list(np.array([3, 7, 9])), list(np.array([2, 5, 8]))]
    out = process_advantages(WORKED_REWARDS, ends, [np.int64(10), np.int64(9)])
    torch.testing.assert_close(out, process_advantages(WORKED_REWARDS, WORKED_ENDS, WORKED_LENGTHS))


@pytest.mark.parametrize(
    ("rewards", "ends", "lengths", "words"),
    [
        ([[1.0]], [[0]], [1, 2], ["1 step_rewards", "2 lengths", "same number"]),
        ([[1.0, 2.0]], [[0]], [3], ["2 step rewards", "1 step ends"]),
        ([[1.0, 2.0]], [[2, 1]], [3], ["step_ends[0]", "strictly increasing"]),
        ([[1.0]], [[3]], [3], ["step_ends[0]", "[0, 2]"]),
        ([[1.0]], [[0]], [-1], ["lengths[0]", "int >= 0"]),
        ([[float("inf")]], [[0]], [1], ["inf", "finite"]),
    ],
    ids=["count-mismatch", "ends-vs-rewards", "not-increasing", "end-past-length", "negative-length", "inf"],
)
def test_process_advantages_validation(rewards, ends, lengths, words):
    with pytest.raises(ValueError) as err:
        process_advantages(rewards, ends, lengths)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


# ----------------------------------------------------------------------------------------------------------------
# GAE (PPO baseline)


def test_gae_gamma_lambda_one_is_monte_carlo_return_minus_value():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    adv, ret = gae_advantages(rewards, values, torch.ones(1, 3))
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.4, 0.3]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0]]))


def test_gae_discounted_by_hand_and_padding_ignored():
    # gamma 0.9, lam 0.5: deltas t2 = 1 - 0.7 = 0.3; t1 = 0.9 * 0.7 - 0.6 = 0.03; t0 = 0.9 * 0.6 - 0.5 = 0.04
    # A2 = 0.3; A1 = 0.03 + 0.45 * 0.3 = 0.165; A0 = 0.04 + 0.45 * 0.165 = 0.11425
    rewards = torch.tensor([[0.0, 0.0, 1.0, 9.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.11425, 0.165, 0.3, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor([[0.61425, 0.765, 1.0, 0.0]], dtype=torch.float64))


def test_masked_whiten_uses_only_masked_entries():
    x = torch.tensor([[1.0, 3.0, 100.0]])
    out = masked_whiten(x, torch.tensor([[1, 1, 0]]))
    torch.testing.assert_close(out, torch.tensor([[-1.0, 1.0, 0.0]]), rtol=0, atol=1e-6)


def test_gae_shape_validation():
    with pytest.raises(ValueError, match="same"):
        gae_advantages(torch.zeros(2, 3), torch.zeros(2, 2), torch.ones(2, 3))


def test_gae_lambda_zero_is_the_one_step_td_error():
    # lam 0: A_t = r_t + gamma V_{t+1} - V_t, returns = the TD(0) targets r_t + gamma V_{t+1}
    # gamma 1: A = [0 + 0.2 - 0.5, 0 + 0.4 - 0.2, 1 + 0 - 0.4] = [-0.3, 0.2, 0.6]; returns [0.2, 0.4, 1.0]
    # gamma 0.5: A = [0.1 - 0.5, 0.2 - 0.2, 1 - 0.4] = [-0.4, 0.0, 0.6]; returns [0.1, 0.2, 1.0]
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.2, 0.4]], dtype=torch.float64)
    mask = torch.ones(1, 3)
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=0.0)
    torch.testing.assert_close(adv, torch.tensor([[-0.3, 0.2, 0.6]], dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor([[0.2, 0.4, 1.0]], dtype=torch.float64))
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.5, lam=0.0)
    torch.testing.assert_close(adv, torch.tensor([[-0.4, 0.0, 0.6]], dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor([[0.1, 0.2, 1.0]], dtype=torch.float64))


def test_gae_lambda_one_is_the_discounted_monte_carlo_return_with_per_token_rewards():
    # lam 1, gamma 0.5, rewards [0.1, -0.2, 1.0] (a KL part on every token, the score on the last):
    # G_2 = 1.0; G_1 = -0.2 + 0.5 * 1.0 = 0.3; G_0 = 0.1 + 0.5 * 0.3 = 0.25; A = G - V; the second row stops
    # after two tokens (G_1 = 2.0, G_0 = 0.5 * 2.0 = 1.0), its padded third column is ignored.
    rewards = torch.tensor([[0.1, -0.2, 1.0], [0.0, 2.0, 7.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.2, 0.4], [0.3, 0.6, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.5, lam=1.0)
    torch.testing.assert_close(ret, torch.tensor([[0.25, 0.3, 1.0], [1.0, 2.0, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(adv, torch.tensor([[-0.25, 0.1, 0.6], [0.7, 1.4, 0.0]], dtype=torch.float64))
