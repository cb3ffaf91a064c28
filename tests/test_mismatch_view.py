"""The Mismatch page's numbers (dashboard.mismatch, dashboard.recompute's corrections) on hand-made tokens whose
values are worked out here by hand."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from dashboard import charts, mismatch


def tokens_of(rows: list[tuple]) -> pd.DataFrame:
    """(rollout_id, position, token_text, old_logp, sampler_logp) rows -> `data.sampler_tokens` columns."""
    frame = pd.DataFrame(rows, columns=["rollout_id", "position", "token_text", "old_logp", "sampler_logp"])
    return frame.assign(sampler_logp_full=frame["sampler_logp"], log_ratio=frame["old_logp"] - frame["sampler_logp"],
                        entropy=0.3, advantage=0.0)


# Two rollouts. Ratios pi_trainer / pi_sampler: rollout 0: 1, 1.2 (outside), 0.5 (outside); rollout 1: 1.05, 2.9.
LOG = math.log
HAND = tokens_of([
    (0, 0, "x", LOG(0.5), LOG(0.5)),
    (0, 1, "=", LOG(0.6), LOG(0.5)),
    (0, 2, "x", LOG(0.2), LOG(0.4)),
    (1, 0, "x", LOG(0.42), LOG(0.4)),
    (1, 1, "2", LOG(0.87), LOG(0.3)),
])
RATIOS = np.array([1.0, 1.2, 0.5, 1.05, 2.9])


def test_summary_counts_tokens_outside_the_band_and_the_truncations_share():
    numbers = mismatch.summary(HAND)
    assert numbers["tokens"] == 5 and numbers["sequences"] == 2
    assert numbers["out_of_band"] == pytest.approx(3 / 5)
    assert numbers["mean_abs_log_ratio"] == pytest.approx(np.abs(np.log(RATIOS)).mean())
    assert numbers["truncation_share"] == pytest.approx(0.0)  # sampler_logp_full = sampler_logp: no truncation
    # The untruncated log-prob of the last token equals the trainer's: that token's whole gap was truncation.
    truncated = HAND.assign(sampler_logp_full=HAND["sampler_logp"].where(HAND.index != 4, HAND["old_logp"]))
    gap = np.abs(np.log(RATIOS))
    assert mismatch.summary(truncated)["truncation_share"] == pytest.approx(gap[4] / gap.sum())


def test_band_edges_are_inside():
    assert not mismatch.outside_band([math.log(0.9), math.log(1.1), 0.0]).any()
    assert mismatch.outside_band([math.log(0.9) - 1e-9, math.log(1.1) + 1e-9]).all()


def test_histogram_counts_every_token_the_tails_in_the_outermost_bins():
    lr = np.r_[np.zeros(998), -50.0, 50.0]
    hist = mismatch.histogram(lr, bins=11)
    assert hist["tokens"].sum() == 1000
    assert hist["tokens"].iloc[0] == 1 and hist["tokens"].iloc[-1] == 1 and hist["tokens"].iloc[5] == 998
    assert hist["left"].iloc[0] == pytest.approx(-hist["right"].iloc[-1])


def test_probability_scatter_bins_past_the_point_limit_and_keeps_the_count():
    points, binned = mismatch.probability_points(HAND)
    assert not binned and len(points) == 5
    assert points["trainer_p"].tolist() == pytest.approx([0.5, 0.6, 0.2, 0.42, 0.87])
    rng = np.random.default_rng(0)
    many = tokens_of([(i, 0, "x", LOG(p), LOG(q)) for i, (p, q) in enumerate(rng.uniform(0.01, 1, (5000, 2)))])
    points, binned = mismatch.probability_points(many, max_points=2000, cells=10)
    assert binned and len(points) <= 100 and points["tokens"].sum() == 5000
    same = tokens_of([(i, 0, "x", LOG(0.33), LOG(0.71)) for i in range(3000)] + [(0, 1, "x", 0.0, 0.0)])
    points, _ = mismatch.probability_points(same, max_points=2000, cells=10)  # cells of 0.1, probability 1 last
    assert points.to_dict("list") == {"trainer_p": pytest.approx([0.35, 0.95]),
                                      "sampler_p": pytest.approx([0.75, 0.95]), "tokens": [3000, 1]}
    # drawn as a 10 x 10 heatmap: rows are the sampler's cells, columns the trainer's, empty cells blank
    (cells, _diagonal) = charts.probability_scatter(points, 10).data
    assert cells.type == "heatmap" and not cells.hoverongaps
    counts, shade = np.asarray(cells.customdata), np.asarray(cells.z)
    assert counts[7, 3] == 3000 and counts[9, 9] == 1 and counts.sum() == 3001
    assert shade[7, 3] == pytest.approx(np.log10(3000)) and shade[9, 9] == 0 and np.isnan(shade).sum() == 98
    np.testing.assert_allclose(cells.x, np.arange(10) / 10 + 0.05)
    (dots, _diagonal) = charts.probability_scatter(mismatch.probability_points(HAND)[0]).data
    assert dots.type == "scatter" and len(dots.x) == 5


def test_buckets_by_probability_entropy_and_position():
    table = mismatch.buckets(HAND)
    by_probability = table[table["by"] == "probability"].set_index("bucket")
    # trainer probabilities 0.5, 0.6, 0.2, 0.42, 0.87: buckets 0.1–0.5 (0.5, 0.2, 0.42), 0.5–0.9 (0.6, 0.87)
    assert by_probability.loc["0.1–0.5", "tokens"] == 3 and by_probability.loc["0.5–0.9", "tokens"] == 2
    assert by_probability.loc["0.1–0.5", "out_of_band"] == pytest.approx(1 / 3)  # ratio 0.5
    assert by_probability.loc["0.5–0.9", "out_of_band"] == pytest.approx(1.0)  # ratios 1.2 and 2.9
    by_position = table[table["by"] == "position"].set_index("bucket")
    assert by_position.loc["0–3", "tokens"] == 5
    assert table[table["by"] == "entropy"]["tokens"].sum() == 5


def test_worst_texts_come_first_with_their_worst_occurrence():
    table = mismatch.by_text(HAND)
    # one token outside the band each; ties go to the larger mean |log-ratio|: log 2.9, then x's, then log 1.2
    assert table["token_text"].tolist() == ["2", "x", "="]
    row = table.set_index("token_text")
    assert row.loc["x", "outside"] == 1 and row.loc["=", "outside"] == 1 and row.loc["2", "outside"] == 1
    assert row.loc["x", "worst_rollout_id"] == 0 and row.loc["x", "worst_position"] == 2  # |log 0.5| the largest
    assert row.loc["2", "worst_log_ratio"] == pytest.approx(math.log(2.9))


def test_worst_texts_do_not_depend_on_the_order_of_the_rows():
    """data.sampler_tokens returns the step's rows in no particular order: ties (equal |log-ratio|, equal counts)
    go to the first occurrence by rollout and position, and to the text, whatever order the rows came in."""
    tied = tokens_of([(r, p, text, -1.0, -1.0 - d) for r, p, text, d in [  # log-ratios d, exact in binary
        (0, 0, "b", 0.0), (0, 1, "a", 0.25), (1, 0, "a", -0.25), (1, 1, "b", 0.0), (2, 4, "a", 0.25),
        (2, 5, "c", 0.0)]])
    for seed in range(5):
        table = mismatch.by_text(tied.sample(frac=1, random_state=seed)).set_index("token_text")
        # "a": three tokens at |log-ratio| 0.25, the first by (rollout, position) is rollout 0, position 1
        assert (table.loc["a", "worst_rollout_id"], table.loc["a", "worst_position"]) == (0, 1)
        assert (table.loc["b", "worst_rollout_id"], table.loc["b", "worst_position"]) == (0, 0)
        assert table.index.tolist() == ["a", "b", "c"]  # b and c tie on everything but their text


def test_sequences_carry_their_reward_and_advantage():
    rollouts = pd.DataFrame({"rollout_id": [0, 1], "group_id": [0, 0], "reward": [1.0, 0.0],
                             "advantage": [0.7, -0.7]})
    table = mismatch.sequences(HAND, rollouts).set_index("rollout_id")
    assert table.loc[1, "sum_log_ratio"] == pytest.approx(math.log(1.05 * 2.9))
    assert table.loc[0, "out_of_band"] == pytest.approx(2 / 3) and table.loc[1, "reward"] == 0.0
    figure = charts.sequence_mismatch(table.reset_index())
    assert len(figure.data) == 2


def test_each_correction_on_hand_worked_tokens():
    from dashboard import recompute

    ids, effects = recompute.correction_effects(HAND.assign(advantage=[1.0, 1.0, 1.0, -1.0, -1.0]))
    effects = list(effects)  # computed one by one as asked for; used twice here
    assert ids == [0, 1]
    by_name = {e.name: e for e in effects}
    table = recompute.correction_table(effects).set_index("correction")
    tis = by_name["TIS token (≤ 2)"].weight
    assert tis.shape == (2, 3)
    assert tis[0].tolist() == pytest.approx([1.0, 1.2, 0.5]) and tis[1, :2].tolist() == pytest.approx([1.05, 2.0])
    assert np.isnan(tis[1, 2])  # padding
    sequence = by_name["TIS sequence (≤ 2)"].weight  # rollout 0: 1 * 1.2 * 0.5 = 0.6; rollout 1: 3.045 -> 2
    assert sequence[0].tolist() == pytest.approx([0.6] * 3) and sequence[1, :2].tolist() == pytest.approx([2, 2])
    # token_k1 with [0.5, 2] on pi_sampler / pi_trainer = 1 / ratio: drops ratio 2.9 only; 0.5 (-> 2) is kept
    assert table.loc["reject token_k1 (0.5_2.0)", "tokens dropped"] == pytest.approx(1 / 5)
    # TRL token_mask zeroes ratios above C_max 3: none; sequence_mask: rollout 1's 1.05 * 2.9 = 3.045 -> 0
    assert table.loc["TRL token_mask (C_max 3)", "tokens dropped"] == 0
    assert table.loc["TRL sequence_mask (C_max 3)", "tokens dropped"] == pytest.approx(2 / 5)
    # off-policy mask: rollout 1 has A < 0 and mean(sampler - trainer) = -(log 1.05 + log 2.9) / 2 < 0.5: kept
    assert table.loc["off-policy mask (δ 0.5)", "tokens dropped"] == 0
    assert table.loc["TIS token (≤ 2)", "weight mean"] == pytest.approx(np.minimum(RATIOS, 2).mean())
    assert table.loc["TIS token (≤ 2)", "sequences touched"] == 2
    assert table.loc["TIS token (≤ 2)", "tokens reweighted"] == pytest.approx(4 / 5)  # every ratio but the 1


def test_the_corrections_table_of_a_step_taken_a_few_rows_at_a_time_is_the_whole_steps():
    """Every correction works row by row: rollouts of 3 to 40 tokens taken one length at a time (each chunk padded
    to its own longest row), give the table of the whole step at once."""
    from dashboard import recompute

    rng = np.random.default_rng(0)
    lengths = [40, 3, 17, 25, 9, 33, 12]
    tokens = pd.DataFrame([{"rollout_id": r, "position": p, "log_ratio": rng.normal(0, 0.4),
                            "advantage": [1.0, -1.0][r % 2]} for r, n in enumerate(lengths) for p in range(n)])
    whole = recompute.correction_table(recompute.correction_effects(tokens)[1])
    chunked = recompute.correction_table(recompute.chunked_effects(tokens, padding_cells=0, padding_share=0))
    assert (whole["tokens dropped"] > 0).any() and (whole["sequences touched"] > 0).sum() >= 15  # they act
    # float32 tensors, as the trainer's: a row's sum over a shorter padding adds in another order
    pd.testing.assert_frame_equal(chunked, whole, rtol=1e-6)
