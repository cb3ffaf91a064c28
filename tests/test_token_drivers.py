"""Cui et al.'s per-token covariance and the KL shares of the data layer (dashboard/data.py), against numpy on a
synthetic run and against values worked by hand, and the Token statistics page's sections that show them."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from synthetic_runs import write_covariance_run, write_synthetic_run
from test_dashboard import array, open_page, plotly_spec

from dashboard import data, token_data


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("drivers")
    write_covariance_run(folder, "hand-cov")
    write_covariance_run(folder, "hand-critic", advantage_std=2.0)
    write_synthetic_run(folder, "synthetic", steps=3, groups=3, group_size=4, length=10, passes=3, seed=5)
    return folder


def numpy_covariance(reader, run: str) -> pd.DataFrame:
    """Every loss token x pass row of a run with its covariance, computed with pandas/numpy from the raw tables."""
    tokens = reader.sql("SELECT * FROM tokens WHERE run = ?", [run])
    passes = reader.sql("SELECT * FROM token_passes WHERE run = ?", [run])
    rollouts = reader.sql("SELECT * FROM rollouts WHERE run = ?", [run])
    trained = rollouts[(rollouts["kind"] == "train") & ~rollouts["filtered"].fillna(False).astype(bool)]
    passes = passes.drop(columns=["token_text", "entropy_decile"])  # the writer's copies of the token's own
    rows = passes.merge(tokens[["step", "rollout_id", "position", "token_text", "advantage", "entropy"]],
                        on=["step", "rollout_id", "position"])
    rows = rows.merge(trained[["step", "rollout_id"]], on=["step", "rollout_id"])
    rows = rows[rows["rejected"].fillna(0) == 0].copy()
    covariance = np.empty(len(rows))
    for _, index in rows.groupby(["step", "pass"]).groups.items():
        a = rows.loc[index, "advantage"].to_numpy()
        logp = rows.loc[index, "new_logp"].to_numpy()
        covariance[rows.index.get_indexer(index)] = (a - a.mean()) * (logp - logp.mean())
    rows["covariance"] = covariance
    return rows


def test_covariance_and_kl_sums_equal_numpy_on_a_synthetic_run(logs):
    reader = data.open_reader(str(logs))
    expected = numpy_covariance(reader, "synthetic")
    per_step = token_data.covariance_drivers(reader, "synthetic", 0, 2, 0, top=1000)  # every token text
    want = expected.groupby(["step", "token_text"]).agg(
        rows=("covariance", "size"), covariance_sum=("covariance", "sum"), kl_sum=("kl", "sum"),
        entropy_sum=("entropy", "sum")).reset_index()
    got = per_step.sort_values(["step", "token_text"]).reset_index(drop=True)
    want = want.sort_values(["step", "token_text"]).reset_index(drop=True)
    assert got["token_text"].tolist() == want["token_text"].tolist()
    assert got["rows"].tolist() == want["rows"].tolist()
    for column in ("covariance_sum", "kl_sum", "entropy_sum"):
        np.testing.assert_allclose(got[column], want[column], rtol=1e-9, atol=1e-12)
    assert got["kl_total"].iloc[0] == pytest.approx(expected["kl"].sum())

    steps = token_data.covariance_per_step(reader, "synthetic", 0, 2)
    passes_per_token = expected.groupby("step").apply(lambda rows: len(rows) / len(rows.groupby(["rollout_id",
                                                                                                 "position"])))
    by_step = expected.groupby("step")["covariance"]
    np.testing.assert_allclose(steps["covariance_mean"], by_step.mean().to_numpy(), rtol=1e-9)
    np.testing.assert_allclose(steps["covariance_sum"], (by_step.sum() / passes_per_token).to_numpy(), rtol=1e-9)


def test_top_texts_of_a_range(logs):
    """The ranking keeps the top texts of the chosen steps by summed covariance and by summed KL, nothing else."""
    reader = data.open_reader(str(logs))
    expected = numpy_covariance(reader, "synthetic")
    in_range = expected[expected["step"].between(1, 2)]
    per_step = token_data.covariance_drivers(reader, "synthetic", 1, 2, 0, top=3)
    by_cov = in_range.groupby("token_text")["covariance"].sum().nlargest(3).index
    by_kl = in_range.groupby("token_text")["kl"].sum().nlargest(3).index
    assert set(per_step.loc[per_step["top_covariance"], "token_text"]) == set(by_cov)
    assert set(per_step.loc[per_step["top_kl"], "token_text"]) == set(by_kl)
    assert set(per_step["token_text"]) == set(by_cov) | set(by_kl)
    assert token_data.driver_table(per_step, "covariance")["token_text"].tolist() == list(by_cov)


# Worked by hand from tests/synthetic_runs.py write_covariance_run (means over each pass's loss tokens):
# step 0: A = (1, 1, -1, -1), mean 0; log pi = (-0.1, -0.5, -1, -2), mean -0.9 -> cov a .8, b .4, a .1, c 1.1
# step 1 pass 0: A = (2, 2, 0, 0), mean 1; log pi = (-.2, -.6, -.3, -.9), mean -.5 -> a .3, c -.1, b -.2, d .4
# step 1 pass 1: log pi = (-.1, -.6, -.3, -1.1), mean -.525 -> a .425, c -.075, b -.225, d .575
HAND_COVARIANCE = {"a": 0.8 + 0.1 + 0.3 + 0.425, "b": 0.4 - 0.2 - 0.225, "c": 1.1 - 0.1 - 0.075, "d": 0.4 + 0.575}
# KL: a .01 + .02 + 0; b .03 + 0; c .14 + .1 (its pass 1 NaN: no KL); d 0 + 0; total .3 over 8 rows with a KL
HAND_KL_SHARE = {"a": 0.03 / 0.3, "b": 0.03 / 0.3, "c": 0.24 / 0.3, "d": 0.0}
HAND_KL_VS_MEAN = {"c": (0.24 / 2) / (0.3 / 8)}  # c: two rows with a KL
# per step: summed over rows / passes per token (step 1: passes .4 + .7, two epochs); entropy 0.5 -> 0.4
HAND_STEPS = {"covariance_sum": [2.4, (0.4 + 0.7) / 2], "covariance_mean": [0.6, 1.1 / 8],
              "entropy_change": [-0.1, np.nan]}


def test_hand_worked_covariance_kl_and_steps(logs):
    reader = data.open_reader(str(logs))
    per_step = token_data.covariance_drivers(reader, "hand-cov", 0, 1, 0)
    table = token_data.driver_table(per_step, "covariance").set_index("token_text")
    assert list(table.index) == ["a", "d", "c", "b"]  # the rejected e, the eval z: not loss tokens
    for text, value in HAND_COVARIANCE.items():
        assert table.loc[text, "covariance_sum"] == pytest.approx(value)
    assert table.loc["a", "rows"] == 4 and table.loc["a", "covariance_mean"] == pytest.approx(1.625 / 4)
    for text, value in HAND_KL_SHARE.items():
        assert table.loc[text, "kl_share"] == pytest.approx(value)
    assert table.loc["c", "kl_vs_mean"] == pytest.approx(HAND_KL_VS_MEAN["c"])
    assert table["cov_rate"].to_dict() == {"a": 0.0, "d": 0.0, "c": 0.0, "b": 1 / 3}  # b: 1 of its 3 rows selected
    # a: step 0 rows at entropy .2 and .6, step 1 at .1 (two passes)
    assert (table.loc["a", "entropy_first"], table.loc["a", "entropy_last"]) == pytest.approx((0.4, 0.1))
    assert token_data.driver_table(per_step, "kl")["token_text"].tolist() == ["c", "a", "b"]  # d carries no KL
    steps = token_data.covariance_per_step(reader, "hand-cov", 0, 1)
    for column, values in HAND_STEPS.items():
        np.testing.assert_allclose(steps[column], values, equal_nan=True)


def test_token_statistics_page_shows_the_hand_worked_drivers(logs, monkeypatch):
    at = open_page(logs, "token_stats", monkeypatch, run="hand-cov")
    shown = {}
    for frame in at.dataframe:
        if "covariance_sum" in frame.value.columns:
            shown[len(shown)] = frame.value.set_index("token_text")
    by_cov, by_kl = shown[0], shown[1]
    assert list(by_cov.index) == ["a", "d", "c", "b"] and list(by_kl.index) == ["c", "a", "b"]
    for text, value in HAND_COVARIANCE.items():
        assert by_cov.loc[text, "covariance_sum"] == pytest.approx(value)
    for text in by_kl.index:
        assert by_kl.loc[text, "kl_share"] == pytest.approx(HAND_KL_SHARE[text])
    assert by_cov.loc["b", "cov_rate"] == pytest.approx(1 / 3)
    # the run log stores the values as float32: hand values hold to its precision
    heat = plotly_spec(at, "stats_covariance_steps")["data"][0]
    assert heat["y"] == ["a", "d", "c", "b"]
    per_text = np.nansum(array(heat["z"]).reshape(4, -1), axis=1)
    np.testing.assert_allclose(per_text, [HAND_COVARIANCE[t] for t in "adcb"], rtol=1e-6)
    chart = plotly_spec(at, "stats_entropy_covariance")["data"]
    np.testing.assert_allclose(array(chart[0]["y"]), HAND_STEPS["covariance_sum"], rtol=1e-6)
    np.testing.assert_allclose(array(chart[1]["y"]), [0.5, 0.4], rtol=1e-6)
    np.testing.assert_allclose(array(chart[2]["x"]), [2.4], rtol=1e-6)
    np.testing.assert_allclose(array(chart[2]["y"]), [-0.1], rtol=1e-6)


def test_a_critic_runs_covariance_is_that_of_its_whitened_advantages(logs):
    """A critic run logs GAE advantages before whitening; its loss saw (A - mean) / std, whose covariance with
    log pi is the logged one over std."""
    reader = data.open_reader(str(logs))
    table = token_data.driver_table(token_data.covariance_drivers(reader, "hand-critic", 0, 1, 0), "covariance")
    for text, value in HAND_COVARIANCE.items():
        assert table.set_index("token_text").loc[text, "covariance_sum"] == pytest.approx(value / 2)
    steps = token_data.covariance_per_step(reader, "hand-critic", 0, 1)
    np.testing.assert_allclose(steps["covariance_sum"], np.array(HAND_STEPS["covariance_sum"]) / 2)
