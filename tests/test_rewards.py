"""Tests of engine/rewards.py: DAPO's soft overlong punishment (eq. 13) in its three regimes and at both edges."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.rewards import overlong_penalty, overlong_penalty_tensor

# L_max = 20, L_cache = 4: no penalty up to 16, a ramp (16 - |y|) / 4 up to 20, then -1
CASES = {
    "empty": (0, 0.0),
    "short": (10, 0.0),
    "last-free-length-boundary": (16, 0.0),
    "first-punished-length": (17, -0.25),
    "ramp-middle": (18, -0.5),
    "ramp": (19, -0.75),
    "max-len-boundary": (20, -1.0),
    "over-max-len": (21, -1.0),
    "far-over": (500, -1.0),
}


@pytest.mark.parametrize(("length", "expected"), list(CASES.values()), ids=list(CASES))
def test_overlong_penalty_small(length, expected):
    assert overlong_penalty(length, max_len=20, cache_len=4) == pytest.approx(expected, abs=1e-12)


def test_overlong_penalty_paper_numbers():
    # DAPO: L_max = 20480, L_cache = 4096 -> free up to 16384
    assert overlong_penalty(16384, 20480, 4096) == 0.0
    assert overlong_penalty(18432, 20480, 4096) == pytest.approx(-0.5)
    assert overlong_penalty(20480, 20480, 4096) == pytest.approx(-1.0)
    assert overlong_penalty(20481, 20480, 4096) == -1.0


def test_cache_equal_to_max_len_ramps_from_zero():
    assert overlong_penalty(0, 4, 4) == 0.0
    assert overlong_penalty(1, 4, 4) == pytest.approx(-0.25)


def test_tensor_version_matches_hand_values():
    lengths = torch.tensor([length for length, _ in CASES.values()])
    expected = torch.tensor([e for _, e in CASES.values()], dtype=torch.get_default_dtype())
    torch.testing.assert_close(overlong_penalty_tensor(lengths, 20, 4), expected)


def test_numpy_integers_are_accepted():
    assert overlong_penalty(np.int64(18), np.int64(20), 4) == pytest.approx(-0.5)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ((5, 0, 0), ["max_len", "int > 0"]),
        ((5, 10, 0), ["cache_len", "int > 0"]),
        ((5, 10, 11), ["cache_len", "exceeds", "cache_len <= max_len"]),
        ((-1, 10, 4), ["length", "int >= 0"]),
        ((5.5, 10, 4), ["length", "int >= 0"]),
    ],
    ids=["zero-max", "zero-cache", "cache-too-long", "negative-length", "float-length"],
)
def test_validation(args, words):
    with pytest.raises(ValueError) as err:
        overlong_penalty(*args)
    for w in words:
        assert w in str(err.value)


def test_tensor_validation():
    with pytest.raises(ValueError, match="integers"):
        overlong_penalty_tensor(torch.tensor([1.5]), 10, 4)
    with pytest.raises(ValueError, match="integers"):
        overlong_penalty_tensor(torch.tensor([-1]), 10, 4)
