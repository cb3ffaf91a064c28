"""The Algorithm weighting page's pictures of the 2025-2026 rules (dashboard/recompute.py), against the rules'
published formulas, and the page drawing its pickers before torch is imported."""

from __future__ import annotations

import numpy as np
import pytest
from test_dashboard import array, open_page, page_without_torch, plotly_spec, table

from dashboard import recompute
from engine.algorithms import ALGORITHMS

RATIO_MAX = 3.5


def test_gpg_weighs_every_ratio_alike():
    curves = recompute.weight_curves("gpg", {}, RATIO_MAX, n_ratio=50)
    assert np.all(curves["positive"] == 1.0) and np.all(curves["negative"] == 1.0)
    region = recompute.clip_region("gpg", {}, RATIO_MAX, 2.0, n_ratio=20, n_adv=9)
    assert np.all(region["clip"] == 0)


def test_vespo_curve_is_its_gamma_weight_of_the_sequence_ratio():
    """phi(w) = e^lambda w^k e^(-lambda w), (k, lambda) = (2, 3) for A > 0 and (3, 2) for A < 0 (arXiv
    2602.10693, TRL 1.16 defaults), 1 at w = 1."""
    curves = recompute.weight_curves("vespo", {}, RATIO_MAX, n_ratio=60)
    w = curves["ratio"]
    np.testing.assert_allclose(curves["positive"], np.exp(3) * w**2 * np.exp(-3 * w), rtol=1e-9)
    np.testing.assert_allclose(curves["negative"], np.exp(2) * w**3 * np.exp(-2 * w), rtol=1e-9)
    changed = recompute.weight_curves("vespo", {"vespo_k_pos": 1.0, "vespo_lambda_pos": 1.0}, RATIO_MAX)
    np.testing.assert_allclose(changed["positive"], np.e * changed["ratio"] * np.exp(-changed["ratio"]), rtol=1e-9)


@pytest.mark.parametrize("old_prob", [0.3, 0.5, 0.9])
def test_dppo_tv_masks_by_the_probability_step_at_its_p_old(old_prob):
    """DPPO-TV (arXiv 2602.04879, verl 0.9.1 dppo_tv, bounds 0.2, cap 3): A > 0 keeps a token while
    p - p_old <= 0.2, A < 0 while p - p_old >= -0.2; a kept token weighs min(r, 3); r > 1 / p_old cannot happen."""
    curves = recompute.weight_curves("dppo_tv", {}, RATIO_MAX, n_ratio=80, old_prob=old_prob)
    r = curves["ratio"]
    step = r * old_prob - old_prob  # p - p_old
    reachable = r * old_prob <= 1
    want_positive = np.where(step <= 0.2, np.minimum(r, 3.0), 0.0)
    want_negative = np.where(step >= -0.2, np.minimum(r, 3.0), 0.0)
    np.testing.assert_allclose(curves["positive"][reachable], want_positive[reachable], rtol=1e-9)
    np.testing.assert_allclose(curves["negative"][reachable], want_negative[reachable], rtol=1e-9)
    assert np.isnan(curves["positive"][~reachable]).all() and np.isnan(curves["negative"][~reachable]).all()
    region = recompute.clip_region("dppo_tv", {}, RATIO_MAX, 2.0, n_ratio=80, n_adv=9, old_prob=old_prob)
    rr, aa = np.meshgrid(region["ratio"], region["advantage"])
    assert np.all((region["clip"] == recompute.IMPOSSIBLE) == (rr * old_prob > 1))
    inside = rr * old_prob <= 1
    masked_up = inside & (aa > 0) & (rr * old_prob - old_prob > 0.2)
    masked_down = inside & (aa < 0) & (rr * old_prob - old_prob < -0.2)
    assert np.all((region["clip"] == 2) == masked_up) and np.all((region["clip"] == 1) == masked_down)


def test_covariance_rules_are_drawn_as_their_surrogate():
    """A grid of single tokens has no covariance of its own to select by: Clip-Cov's picture is PPO's clip at its
    range (no random cells), KL-Cov's the linear -rA (no clip), the same at every call."""
    grpo = recompute.clip_region("grpo", {}, RATIO_MAX, 2.0, n_ratio=60, n_adv=21)
    for _ in range(2):
        clip_cov = recompute.clip_region("clip_cov", {}, RATIO_MAX, 2.0, n_ratio=60, n_adv=21)
        np.testing.assert_array_equal(clip_cov["clip"], grpo["clip"])
    kl_cov = recompute.clip_region("kl_cov", {}, RATIO_MAX, 2.0, n_ratio=60, n_adv=21)
    assert np.all(kl_cov["clip"] == 0)
    curves = recompute.weight_curves("kl_cov", {}, RATIO_MAX)
    np.testing.assert_allclose(curves["positive"], curves["ratio"], rtol=1e-9)


def test_dro_weight_per_advantage():
    """DRO (verl 0.9.1 dro): weight A - dro_beta log r, so weight / A = 1 - dro_beta log r / A."""
    curves = recompute.weight_curves("dro", {"dro_beta": 0.5}, RATIO_MAX)
    log_r = np.log(curves["ratio"])
    np.testing.assert_allclose(curves["positive"], 1 - 0.5 * log_r, rtol=1e-9)
    np.testing.assert_allclose(curves["negative"], 1 + 0.5 * log_r, rtol=1e-9)


def test_scatter_sample_is_the_same_tokens_for_every_algorithm():
    mask = np.zeros((30, 400))
    mask[:, :250] = 1.0  # 7,500 tokens, padding after
    sample = recompute.sample_positions(mask, 4000)
    assert len(sample) == 4000 == len(np.unique(sample)) and np.all(np.diff(sample) > 0)
    assert np.all(mask.reshape(-1)[sample] == 1.0)
    np.testing.assert_array_equal(sample, recompute.sample_positions(mask, 4000))
    np.testing.assert_array_equal(recompute.sample_positions(mask, 10_000), np.flatnonzero(mask))


def test_weighting_page_draws_the_new_rules(trained, monkeypatch):
    logs_dir, run = trained
    at = open_page(logs_dir, "algorithm_weighting", monkeypatch, run=run)
    rules = ["gpg", "dppo_tv", "dppo_kl", "dro", "clip_cov", "kl_cov", "luspo", "vespo"]
    at.multiselect(key="weigh_algorithms").set_value(rules).run()
    assert not at.exception, [e.message for e in at.exception]
    curves = plotly_spec(at, "weight_curves")
    assert len(curves["data"]) == 2 * len(rules)
    gpg = [t for t in curves["data"] if t["xaxis"] == "x"]
    assert all(np.allclose(array(t["y"]).astype(float), 1.0) for t in gpg)
    regions = plotly_spec(at, "clip_regions")
    grey = [s for s in regions["layout"]["shapes"] if s["fillcolor"] == "#bdbdbd"]
    assert {s["xref"] for s in grey} == {"x2", "x3"}  # dppo_tv and dppo_kl, the 2nd and 3rd panels
    assert all(s["x0"] >= 1 / 0.5 - 0.05 for s in grey)  # above 1 / p_old at the default p_old 0.5
    at.select_slider(key="weigh_old_prob").set_value(0.9).run()
    grey = [s for s in plotly_spec(at, "clip_regions")["layout"]["shapes"] if s["fillcolor"] == "#bdbdbd"]
    assert grey and all(s["x0"] >= 1 / 0.9 - 0.05 for s in grey)


def test_weighting_page_keeps_only_what_it_draws_and_draws_what_the_objectives_give(trained, monkeypatch):
    """The page reduces each algorithm's (B, T) answer as it is computed (a whole step of long completions would
    otherwise be kept and cached token by token): on a whole trained step, its clip fractions are those of the full
    per-token weighting from `recompute.weigh` at the last update, and every dot of its ratio x advantage scatter
    is one of the step's tokens with the ratio that algorithm gave it."""
    from dashboard import data
    from engine.runlog import RunReader

    logs_dir, run = trained
    at = open_page(logs_dir, "algorithm_weighting", monkeypatch, run=run, step=1)
    at.radio(key="weigh_scope").set_value("the whole step").run()
    assert not at.exception, [e.message for e in at.exception]
    reader = RunReader(logs_dir)
    ids = tuple(int(r) for r in reader.sql("SELECT rollout_id FROM rollouts WHERE run = ? AND step = 1 AND kind = "
                                           "'train' ORDER BY rollout_id", [run])["rollout_id"])
    updates = data.update_count(reader, run, 1, ids)
    tokens = data.tokens_at_update(reader, run, 1, ids, updates - 1)
    batch = recompute.batch_from_tokens(tokens, float32=True)  # as the page computes
    on = batch.mask.numpy() > 0
    shown = table(at, "algorithm", "zero-gradient tokens")  # the clip fractions, one row per algorithm, as shown
    regions = plotly_spec(at, "clip_regions")["data"]
    for panel, algo in enumerate(shown["algorithm"], start=1):
        full = recompute.weigh(batch, algo, {})
        expected = recompute.clip_fraction_row(algo, full)
        row = shown[shown["algorithm"] == algo].iloc[0]
        assert {c: row[c] for c in expected} == {c: v if c == "algorithm" else f"{v:.3f}" for c, v in expected.items()}
        axis = "x" if panel == 1 else f"x{panel}"
        dots = [t for t in regions if t.get("mode") == "markers" and t.get("xaxis", "x") == axis]
        assert len(dots) == 1, (algo, len(dots))
        pairs = {(round(r, 9), round(a, 9)) for r, a in zip(full.ratio[on].astype(float),
                                                              batch.advantages.numpy()[on].astype(float), strict=True)}
        drawn = list(zip(array(dots[0]["x"]).astype(float), array(dots[0]["y"]).astype(float), strict=True))
        assert drawn and all((round(r, 9), round(a, 9)) in pairs for r, a in drawn), algo
        assert len({r for r, _ in pairs}) > 10  # ratios other than 1 (GSPO: one per sequence), so a dot with a wrong
        # token's ratio would not match


@pytest.fixture(scope="module")
def trained(tiny_run):
    return str(tiny_run[0]), tiny_run[1]


def test_weighting_page_draws_its_pickers_before_torch(trained):
    """With torch unimportable, the page still draws its header, its algorithm picker and the knobs table (nothing
    before the first objective waits for torch), then says why it has no weights."""
    page = page_without_torch(*trained, "algorithm_weighting")
    assert page["exceptions"] == [] and page["headers"] == ["Algorithm weighting"] and not page["torch"], page
    assert "weigh_algorithms" in page["pickers"] and any(k.startswith("weigh_knobs") for k in page["editors"]), page
    assert len(page["errors"]) == 1 and "torch is not importable" in page["errors"][0], page


def _ragged_batch(seed: int = 0):
    """A LoggedBatch (engine.logrows) of 9 completions of 1-40 tokens, one with a masked hole (tool tokens), the
    log-probs moved by a pass, a reference and entropies: float64, as `batch_from_tokens` builds it."""
    import torch

    from engine.logrows import LoggedBatch

    g = torch.Generator().manual_seed(seed)
    lengths = [40, 3, 17, 1, 28, 9, 33, 12, 5]
    B, T = len(lengths), max(lengths)
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).double()  # (B, T)
    mask[4, 10:14] = 0.0  # a hole inside the 5th completion
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3  # (B, T)
    logp = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4
    advantages = (torch.randn(B, 1, generator=g, dtype=torch.float64) * mask).expand(B, T).contiguous()
    return LoggedBatch(rollout_ids=list(range(B)), logp=logp * mask, old_logp=old * mask,
                       ref_logp=logp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.1,
                       entropy=torch.rand(B, T, generator=g, dtype=torch.float64) * 2 * mask, advantages=advantages,
                       mask=mask, lengths=mask.sum(1).numpy().astype(int))


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_weighing_a_few_completions_at_a_time_gives_the_whole_batch_answer(algo):
    """`recompute.weigh` asks a row-local objective the completions of one length at a time (no padding allowed),
    each chunk cut to its own longest: every token's gradient weight, ratio and clip code and every completion's
    total are those of one `policy_loss` call on the whole padded batch (token-mean, seq-mean and
    seq-mean-token-sum-norm normalisers included: each algorithm's own aggregation is used, and dapo's is
    token-mean, Dr. GRPO's seq-mean-token-sum-norm)."""
    import torch

    from engine.objectives import policy_loss

    batch = _ragged_batch()
    overrides = {"beta": 0.04}  # the KL term's weight too
    torch.manual_seed(1)  # Clip-Cov's random choice: the same on both sides (it is weighed in one call)
    chunked = recompute.weigh(batch, algo, overrides, padding_cells=0, padding_share=0)
    torch.manual_seed(1)
    whole = policy_loss(algo, batch.logp, batch.old_logp, batch.advantages, batch.mask, ref_logp=batch.ref_logp,
                        entropy=batch.entropy, **overrides)
    on = batch.mask.numpy() > 0
    np.testing.assert_allclose(chunked.grad_weight[on], whole.grad_weight.numpy()[on], rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(chunked.ratio[on], whole.ratio.numpy()[on], rtol=1e-12)
    np.testing.assert_array_equal(chunked.clip[on], whole.clip.numpy()[on])
    np.testing.assert_allclose(chunked.total_weight, whole.grad_weight.numpy().sum(1), rtol=1e-12, atol=1e-15)
    assert np.isnan(chunked.grad_weight[~on]).all() and (chunked.clip[~on] == -1).all()
    assert np.abs(chunked.grad_weight[on]).max() > 0


def test_completions_are_chunked_shortest_first_while_the_padding_stays_within_the_allowance():
    lengths = np.array([10, 100, 12, 101, 11])
    # 10, 11, 12: padding 0, 1, 3 cells; with 100 it would be 4 x 100 - 133 = 267; 100, 101: 1
    chunks = recompute.length_chunks(lengths, padding_cells=5, padding_share=0)
    assert [c.tolist() for c in chunks] == [[0, 4, 2], [1, 3]]
    # 5% of the chunk's tokens: 10, 11 pad 1 cell (of 1.05 allowed), with 12 they would pad 3 (of 1.65); 12 and 100
    # would pad 88 (of 5.6); 100, 101 pad 1 (of 10.05)
    assert [c.tolist() for c in recompute.length_chunks(lengths, 0, 0.05)] == [[0, 4], [2], [1, 3]]
    assert [c.tolist() for c in recompute.length_chunks(lengths, 300, 0)] == [[0, 4, 2, 1, 3]]
    assert [c.tolist() for c in recompute.length_chunks(lengths, 0, 0)] == [[0], [4], [2], [1], [3]]
    assert [c.tolist() for c in recompute.length_chunks(np.array([7, 7, 7]), 0, 0)] == [[0, 1, 2]]
    assert recompute.length_chunks(np.array([], dtype=int)) == []


def test_only_the_rules_that_look_at_the_whole_batch_are_weighed_whole():
    assert not recompute.row_local("clip_cov", {}) and not recompute.row_local("kl_cov", {})
    assert not recompute.row_local("grpo", {"top_entropy_quantile": 0.2})  # the batch's entropy quantile
    assert recompute.row_local("grpo", {}) and recompute.row_local("gspo", {}) and recompute.row_local("aspo", {})
