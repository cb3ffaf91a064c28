"""Groups, Replay, Advantages and PRM steps on a group of long completions (5,000, 1,200 and 20 tokens), under AppTest.

The run is written through `RunWriter` with random values (a critic's value and KL reward, process-supervised
steps of 50 tokens); what the pages draw (binned lines and their min..max bands, previews of the completions, pages
of the reasoning text) is compared with pandas over the rows read back straight from the Parquet files
(`independent`), not with the app's queries.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest
from conftest import settle_run_logs
from test_dashboard import (
    array,
    dataframe,
    heatmap_cells,
    independent,
    open_page,
    plotly_spec,
    shown_groups,
    table,
)

from dashboard import advantage_charts, data, recompute
from dashboard.tokens import visible_text

LENGTHS = (5000, 1200, 20)  # tokens of rollouts 0, 1, 2: one group
STEP_TOKENS = 50  # tokens per reasoning step
RUN = "long"
WORDS = [" so", " x", " =", " 2", " then", "\n"]


def process_advantage(lengths, rewards) -> list[np.ndarray]:
    """Per-token process advantages by hand: step rewards normalized over the group (unbiased std + 1e-6), each
    token the sum of the normalized rewards from its step on."""
    flat = np.concatenate(rewards)
    normalized = (flat - flat.mean()) / (flat.std(ddof=1) + 1e-6)
    out, at = [], 0
    for n, r in zip(lengths, rewards, strict=True):
        own, at = normalized[at: at + len(r)], at + len(r)
        per_step = np.cumsum(own[::-1])[::-1]
        out.append(np.repeat(per_step, [min(STEP_TOKENS, n - s) for s in range(0, n, STEP_TOKENS)]))
    return out


def write_run(logs_dir) -> None:
    from engine.runlog import RunWriter

    rng = np.random.default_rng(11)
    lengths = np.array(LENGTHS)
    rollout = np.repeat(np.arange(3), lengths)
    position = np.concatenate([np.arange(n) for n in lengths])
    text = np.array(WORDS, dtype=object)[rng.integers(0, len(WORDS), len(rollout))]
    step_rewards = [rng.normal(size=-(-n // STEP_TOKENS)) for n in lengths]
    tokens = {"rollout_id": rollout, "position": position, "token_id": rng.integers(0, 50, len(rollout)),
              "token_text": text, "old_logp": -rng.gamma(1.0, 0.6, len(rollout)),
              "advantage": np.concatenate(process_advantage(lengths, step_rewards)),
              "value": rng.normal(size=len(rollout)), "kl_reward": -rng.gamma(1.0, 0.01, len(rollout)),
              "prm_step": position // STEP_TOKENS}
    completions = ["".join(text[rollout == r]) for r in range(3)]
    completions[0] += " needle-at-the-end"  # only past the preview
    rollouts = {"rollout_id": [0, 1, 2], "group_id": [0, 0, 0], "index_in_group": [0, 1, 2],
                "kind": ["train"] * 3, "prompt_id": [0] * 3, "prompt": ["Solve 2x = 4"] * 3,
                "completion": completions, "reward": [1.0, 0.0, 0.5], "advantage": [1.0, -1.0, 0.0],
                "length": lengths}
    prm_rollout = np.repeat(np.arange(3), [len(r) for r in step_rewards])
    index = np.concatenate([np.arange(len(r)) for r in step_rewards])
    prm_steps = {"rollout_id": prm_rollout, "step_index": index, "first_pos": index * STEP_TOKENS,
                 "last_pos": np.minimum((index + 1) * STEP_TOKENS, lengths[prm_rollout]) - 1,
                 "text": [f"step {i}" for i in index], "reward_raw": np.concatenate(step_rewards),
                 "reward_norm": np.concatenate(step_rewards)}
    with RunWriter.create(logs_dir, RUN, algorithm="ppo", task="t", config={}, model="m") as writer:
        for step in (0, 1):  # two identical steps: something for Replay's slider to move over
            writer.log_step(step, metrics={"reward_mean": 0.5}, rollouts=rollouts, tokens=tokens,
                            prm_steps=prm_steps)


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    logs_dir = tmp_path_factory.mktemp("long-pages") / "logs"
    write_run(logs_dir)
    settle_run_logs()  # the step folders the closing merge replaced are gone before a test lists the files
    return logs_dir


def logged_tokens(logs_dir) -> pd.DataFrame:
    return independent(logs_dir, "tokens", "WHERE run = ? AND step = 0 ORDER BY rollout_id, position", [RUN])


def by_bins(rows: pd.DataFrame, width: int):
    return rows.groupby([rows["rollout_id"], rows["position"] // width])


def test_critic_token_bins_are_the_logged_tokens_binned_with_one_width_for_the_group(logs):
    from engine.runlog import RunReader

    rows, reader = logged_tokens(logs), RunReader(logs)
    shown = data.critic_token_bins(reader, RUN, 0, (0, 1, 2), 1000)  # 5,000 tokens: width 5 for every completion
    expected = by_bins(rows, 5)
    assert (shown["width"] == 5).all() and len(shown) == 1000 + 240 + 4
    assert shown["first_pos"].tolist() == expected["position"].min().tolist()
    assert shown["last_pos"].tolist() == expected["position"].max().tolist()
    assert shown["tokens"].tolist() == expected.size().tolist()
    for column in data.CRITIC_CHANNELS:
        np.testing.assert_allclose(shown[column], expected[column].mean(), rtol=1e-9, err_msg=column)
        np.testing.assert_allclose(shown[f"{column}_low"], expected[column].min(), rtol=1e-12)
        np.testing.assert_allclose(shown[f"{column}_high"], expected[column].max(), rtol=1e-12)
    short = data.critic_token_bins(reader, RUN, 0, (2,), 1000)  # 20 tokens: one bin each, the values as logged
    assert (short["width"] == 1).all()
    np.testing.assert_allclose(short["value"], rows[rows["rollout_id"] == 2]["value"], rtol=1e-12)


def test_binned_gives_the_mean_min_and_max_of_each_run_of_positions():
    values = np.array([3.0, -1.0, 2.0, 5.0, 0.0, 4.0, 7.0])
    out = recompute.binned(values, 3)  # bins [0..2], [3..5], [6]
    assert out["first_pos"].tolist() == [0, 3, 6] and out["last_pos"].tolist() == [2, 5, 6]
    np.testing.assert_allclose(out["value"], [4 / 3, 3.0, 7.0])
    assert out["low"].tolist() == [-1.0, 0.0, 7.0] and out["high"].tolist() == [3.0, 5.0, 7.0]
    assert len(recompute.binned(np.zeros(0), 3)["value"]) == 0


def bold_traces(spec: dict) -> dict[str, dict]:
    """The highlighted completion's line on each panel, by the panel's title (before the colon)."""
    titles = [a["text"].split(":")[0] for a in spec["layout"]["annotations"]]
    out = {}
    for i, title in enumerate(titles):
        axis = "x" if i == 0 else f"x{i + 1}"
        (bold,) = [t for t in spec["data"] if t.get("xaxis") == axis and t.get("line", {}).get("width") == 3]
        out[title] = (bold, [t for t in spec["data"] if t.get("xaxis") == axis and t.get("fill")])
    return out


def test_advantages_of_a_long_group_are_drawn_in_bins_with_their_range(logs, monkeypatch):
    rows = logged_tokens(logs)
    at = open_page(logs, "advantages", monkeypatch, run=RUN, step=0, group=0, rollout=0)
    spec = plotly_spec(at, "advantage_schemes")
    assert all(len(array(t["x"])) <= 1000 for t in spec["data"])  # never more points than pixels
    own = by_bins(rows[rows["rollout_id"] == 0], 5)
    centres = ((own["position"].min() + own["position"].max()) / 2).to_numpy()
    lines = bold_traces(spec)
    for title, column in (("PPO critic's value V(token)", "value"), ("PPO KL part of the reward", "kl_reward"),
                          ("PPO GAE advantage (before whitening)", "advantage")):
        bold, band = lines[title]
        np.testing.assert_allclose(array(bold["x"]), centres)
        np.testing.assert_allclose(array(bold["y"]), own[column].mean(), rtol=1e-9, err_msg=title)
        low, high = band if band[0]["fill"] == "none" else band[::-1]
        np.testing.assert_allclose(array(low["y"]), own[column].min(), rtol=1e-12)
        np.testing.assert_allclose(array(high["y"]), own[column].max(), rtol=1e-12)
    # The recomputed process staircase, binned the same way: the logged one (this run trained on it).
    np.testing.assert_allclose(array(lines["GRPO process advantage"][0]["y"]), own["advantage"].mean(), atol=1e-5)
    # GRPO's outcome advantage of the group's rewards (1, 0, 0.5): +1 for the first completion, in every bin.
    np.testing.assert_allclose(array(lines["GRPO outcome advantage"][0]["y"]), 1.0, atol=1e-5)
    # 100 reasoning steps: no dotted boundaries (more than the panel has pixels for).
    assert not [s for s in spec["layout"].get("shapes", []) if s["type"] == "line"]


def test_advantages_of_a_short_completion_alone_keep_one_point_per_token(logs):
    """A group whose longest completion fits the bins: one point per token, its text on hover, step lines."""
    from engine.runlog import RunReader

    rows = logged_tokens(logs)
    bins = data.critic_token_bins(RunReader(logs), RUN, 0, (2,), 1000)
    short = rows[rows["rollout_id"] == 2]
    schemes = recompute.advantage_schemes(pd.DataFrame({"rollout_id": [2], "reward": [0.5], "length": [20]}),
                                          bins, pd.DataFrame(columns=["rollout_id", "step_index", "last_pos",
                                                                      "reward_raw"]))
    steps = pd.DataFrame({"step_index": [0], "first_pos": [0], "last_pos": [19], "reward_raw": [-1.0]})
    figure = advantage_charts.advantage_schemes(schemes, list(recompute.SCHEMES), {2: "#2"}, 2, steps, short)
    value = next(t for t in figure.data if t.xaxis == "x3" and t.line.width == 3)  # panels: outcome, GAE, value, KL
    assert list(value.x) == list(range(20))
    assert list(value.customdata) == [visible_text(t).replace("<br>", "") for t in short["token_text"]]
    np.testing.assert_allclose(value.y, short["value"], rtol=1e-12)
    assert not [t for t in figure.data if t.fill == "tonexty"]  # no band: a bin is one token
    # the one step: its boundary and (scored wrong) its shading on each of the 4 panels
    assert sorted(s.type for s in figure.layout.shapes) == ["line"] * 4 + ["rect"] * 4


def test_advantages_of_a_group_without_logged_rewards_are_the_logged_ones():
    """An imported dump without rewards (prime-rl's token exports): GRPO's outcome advantage cannot be recomputed
    (engine.advantages refuses NaN), so the page shows the advantage the trainer logged per token instead; a group
    whose rewards are all logged keeps the recomputed one only."""
    bins = pd.DataFrame({"rollout_id": [1, 1, 2], "bin": [0, 1, 0], "width": 1, "first_pos": [0, 1, 0],
                         "last_pos": [0, 1, 0], "tokens": 1, "advantage": [0.25, -0.5, 1.5],
                         "advantage_low": [0.25, -0.5, 1.5], "advantage_high": [0.25, -0.5, 1.5],
                         "value": np.nan, "value_low": np.nan, "value_high": np.nan, "kl_reward": np.nan,
                         "kl_reward_low": np.nan, "kl_reward_high": np.nan})
    no_steps = pd.DataFrame(columns=["rollout_id", "step_index", "last_pos", "reward_raw"])
    group = pd.DataFrame({"rollout_id": [1, 2], "reward": [1.0, None], "length": [2, 1]})
    schemes = recompute.advantage_schemes(group, bins, no_steps)
    assert set(schemes["scheme"]) == {"logged_advantage"}
    assert schemes.sort_values(["rollout_id", "first_pos"])["value"].tolist() == [0.25, -0.5, 1.5]
    rewarded = recompute.advantage_schemes(group.assign(reward=[1.0, 0.0]), bins, no_steps)
    assert set(rewarded["scheme"]) == {"grpo_outcome"}
    a = 0.5 / (1 / np.sqrt(2) + 1e-6)  # (r - mean) / (std + 1e-6), the unbiased std of [1, 0] being 1 / sqrt(2)
    assert rewarded.sort_values(["rollout_id", "first_pos"])["value"].tolist() == pytest.approx([a, a, -a])


STEP_BLOCKS = re.compile(r'class="pl-step"')


def test_prm_steps_of_a_long_completion_page_the_text_and_bin_the_line(logs, monkeypatch):
    rows = logged_tokens(logs)
    at = open_page(logs, "prm_steps", monkeypatch, run=RUN, step=0, rollout=0)
    body = at.get("html")[0].proto.body
    assert len(STEP_BLOCKS.findall(body)) == 40 and "step 40 ·" not in body  # 100 steps: the first 40
    spec = plotly_spec(at, "prm_advantage_line")
    own = by_bins(rows[rows["rollout_id"] == 0], 5)
    np.testing.assert_allclose(array(spec["data"][0]["y"]), own["advantage"].mean(), rtol=1e-9)
    assert not spec["layout"].get("annotations")  # 100 steps: no note per step, but in each bin's hover
    steps = independent(logs, "prm_steps", "WHERE run = ? AND step = 0 AND rollout_id = 0", [RUN])
    steps = steps.set_index("step_index")
    for first, _last, note in spec["data"][0]["customdata"]:
        index, raw, normalized = re.fullmatch(r"<br>step (\d+): r=(\S+) → (\S+)", note).groups()
        assert int(index) == first // STEP_TOKENS  # the synthetic steps tile the completion, STEP_TOKENS each
        assert float(raw) == pytest.approx(steps.loc[int(index), "reward_raw"], rel=1e-2, abs=1e-3)
        assert float(normalized) == pytest.approx(steps.loc[int(index), "reward_norm"], rel=1e-2, abs=1e-3)
    # The last page of the text: steps 80..99.
    page = next(n for n in at.number_input if n.key == "prm_text_page_0")
    page.set_value(3).run()
    assert not at.exception
    assert len(STEP_BLOCKS.findall(at.get("html")[0].proto.body)) == 20
    # The group's step table, 200 rows at a time (100 + 24 + 1 steps).
    assert len(dataframe(at, "completion", "step_index")) == 125


def test_prm_steps_of_a_short_completion_look_as_before(logs, monkeypatch):
    rows = logged_tokens(logs)
    at = open_page(logs, "prm_steps", monkeypatch, run=RUN, step=0, rollout=2)
    assert not [n for n in at.number_input if (n.key or "").startswith("prm_text_page")]
    spec = plotly_spec(at, "prm_advantage_line")
    short = rows[rows["rollout_id"] == 2]
    assert array(spec["data"][0]["x"]).tolist() == list(range(20))
    np.testing.assert_allclose(array(spec["data"][0]["y"]), short["advantage"], rtol=1e-12)
    assert len(spec["layout"]["annotations"]) == 1


def test_groups_and_replay_receive_previews_and_search_the_whole_text(logs, monkeypatch):
    completions = independent(logs, "rollouts", "WHERE run = ? AND step = 0 ORDER BY rollout_id", [RUN])["completion"]
    at = open_page(logs, "groups", monkeypatch, run=RUN, step=0)
    members = [m for group in shown_groups(at) for m in group["members"]]
    assert members[0]["text"] == completions[0][: data.COMPLETION_PREVIEW_CHARS]
    assert members[2]["text"] == completions[2] and members[2]["note"] == ""  # short enough: whole, no note
    assert members[0]["note"] == f"the first {data.COMPLETION_PREVIEW_CHARS:,} of {len(completions[0]):,} characters"
    at.text_input[0].set_value("NEEDLE-AT").run()  # past the preview, any case: found by DuckDB in the whole text
    assert dataframe(at, "group_id", "outcome")["group_id"].tolist() == [0]
    at.text_input[0].set_value("not in any text").run()
    assert dataframe(at, "group_id", "outcome").empty
    replay = open_page(logs, "replay", monkeypatch, run=RUN, step=0)
    replay.select_slider(key="replay_step").set_value(1).run()
    assert not replay.exception
    shown = next(t.value for t in replay.table if "completion" in t.value.columns)["completion"]
    assert len(shown) == 3 and not any("needle" in str(c) for c in shown)  # the group's previews only


def test_prm_step_rewards_of_a_long_group_arrive_in_bins_of_steps(logs, monkeypatch):
    """100 + 24 + 1 reasoning steps in a group of 3: 240 // 3 = 80 bars a completion at most, so bins of 2 steps."""
    steps = independent(logs, "prm_steps", "WHERE run = ? AND step = 0 ORDER BY rollout_id, step_index", [RUN])
    expected = steps.groupby([steps["rollout_id"], steps["step_index"] // 2])
    at = open_page(logs, "prm_steps", monkeypatch, run=RUN, step=0, rollout=0)
    spec = plotly_spec(at, "group_step_rewards")
    for axis, column in (("x", "reward_raw"), ("x2", "reward_norm")):
        bars = [t for t in spec["data"] if t.get("xaxis", "x") == axis]
        assert [t["name"] for t in bars] == ["#0", "#1", "#2"]
        assert sum(len(array(t["y"])) for t in bars) == 50 + 12 + 1  # not 125: never more bars than the panel holds
        np.testing.assert_allclose(np.concatenate([array(t["y"]) for t in bars]), expected[column].mean(), rtol=1e-9)
        np.testing.assert_allclose(np.concatenate([array(t["x"]) for t in bars]),
                                   (expected["step_index"].min() + expected["step_index"].max()) / 2)
        # first step, last step, min, max on hover
        edges = np.concatenate([array(t["customdata"]).reshape(-1, 4) for t in bars])
        np.testing.assert_allclose(edges[:, 2], expected[column].min(), rtol=1e-12)
        np.testing.assert_allclose(edges[:, 3], expected[column].max(), rtol=1e-12)


def test_prm_step_bins_of_completions_that_fit_are_the_steps_as_logged(logs):
    from engine.runlog import RunReader

    steps = independent(logs, "prm_steps", "WHERE run = ? AND step = 0 ORDER BY rollout_id, step_index", [RUN])
    shown = data.prm_step_bins(RunReader(logs), RUN, 0, (0, 1, 2), 100)  # 100 steps at most: one bin each
    assert (shown["width"] == 1).all() and (shown["first_step"] == shown["last_step"]).all()
    assert shown["first_step"].tolist() == steps["step_index"].tolist()
    np.testing.assert_allclose(shown["reward_raw"], steps["reward_raw"], rtol=1e-12)
    assert len(data.prm_step_bins(RunReader(logs), RUN, 0, (0,), 7)) == 7  # 100 steps in bins of 15


def test_binned_columns_average_the_tokens_of_each_bin_and_skip_padding():
    nan = np.nan
    weights = np.array([[1.0, 2.0, 3.0, 4.0, 5.0], [-1.0, 3.0, nan, nan, nan], [nan] * 5])
    means, centres, width = recompute.binned_columns(weights, 2)  # width 3: tokens 0-2 and 3-4
    assert width == 3 and centres.tolist() == [1.0, 3.5]
    np.testing.assert_array_equal(means, [[2.0, 4.5], [1.0, nan], [nan, nan]])
    same, centres, width = recompute.binned_columns(weights, 5)  # fits: the tokens as they are
    assert width == 1 and centres.tolist() == [0, 1, 2, 3, 4]
    np.testing.assert_array_equal(same, weights)


def test_weighting_heatmaps_of_a_long_group_are_binned_to_the_panel(logs, monkeypatch):
    """5,000 tokens in a third of the screen bins (333): bins of 16 tokens, 313 columns, each the mean weight of its
    tokens (the per-token weights from `recompute.weigh` in float64, binned here with pandas; the page computes in
    float32, as the trainer does, so they agree to float32 precision)."""
    from engine.runlog import RunReader

    at = open_page(logs, "algorithm_weighting", monkeypatch, run=RUN, step=0, group=0)
    assert not at.exception
    # the registry's first panel: GRPO
    shown, centres, widths = heatmap_cells([t for t in plotly_spec(at, "weight_heatmaps")["data"] if t["xaxis"] == "x"])
    tokens = data.tokens_at_update(RunReader(logs), RUN, 0, (0, 1, 2), -1)
    weights = recompute.weigh(recompute.batch_from_tokens(tokens), "grpo", {}).grad_weight  # (3, 5000), NaN padded
    rows, positions = np.nonzero(np.isfinite(weights))
    expected = pd.Series(weights[rows, positions]).groupby([rows, positions // 16]).mean()
    assert shown.shape == (3, 313)
    np.testing.assert_allclose(shown[np.isfinite(shown)], expected.to_numpy(), rtol=1e-5,
                               atol=1e-6 * np.abs(expected).max())
    assert np.isfinite(shown).sum(axis=1).tolist() == [313, 75, 2]  # 5,000, 1,200 and 20 tokens
    np.testing.assert_allclose(centres, [*(np.arange(312) * 16 + 7.5), (4992 + 4999) / 2])
    assert widths.tolist() == [16] * 312 + [8]  # each cell spans its bin's tokens, the last one's 8 included


def test_replay_step_move_reads_the_new_step_only_and_no_text_but_the_groups(logs, monkeypatch):
    """Moving the step asks DuckDB for that step's numbers, groups and the shown group's previews: no completion
    text of the other groups (a reasoning step holds ~15 MB of it), and nothing that does not depend on the step."""
    import streamlit as st

    st.cache_data.clear()  # other tests may have visited step 1 already
    at = open_page(logs, "replay", monkeypatch, run=RUN, step=0)
    asked = []
    for name in ("step_rollouts", "step_rollout_previews", "step_rollout_numbers", "rollout_previews",
                 "group_summary", "run_steps", "eval_prompts", "eval_prompt_history", "eval_prompt_across_runs"):
        original = getattr(data, name, None)
        if original is None:  # a query the data layer does not have is not watched
            continue
        monkeypatch.setattr(data, name, lambda *a, _f=original, _n=name, **k: asked.append((_n, a[2:])) or _f(*a, **k))
    at.select_slider(key="replay_step").set_value(1).run()
    assert not at.exception
    # (the run logged no eval rollouts: its eval section asks nothing more)
    assert sorted(asked) == [("group_summary", (1,)), ("rollout_previews", (1, (0, 1, 2))),
                             ("step_rollout_numbers", (1, "train"))]
    assert len(next(t.value for t in at.table if "completion" in t.value.columns)) == 3  # the group's table


def test_replay_tables_receive_a_glance_of_each_long_eval_answer(tmp_path, monkeypatch):
    """A reasoning run's eval answers are thousands of characters: the history of every step (sent again at each
    step of a replay) and the runs side by side receive each answer's first `data.EVAL_PREVIEW_CHARS` characters
    and its whole length, not the answer."""
    from engine.runlog import RunWriter

    answers = [f"step {s}: " + "reasoning " * 900 + f"answer {s}" for s in range(3)]  # ~9,000 characters each
    with RunWriter.create(tmp_path, RUN, algorithm="grpo", task="t", config={}, model="m") as writer:
        for step, answer in enumerate(answers):
            writer.log_step(step, metrics={"reward_mean": 0.5}, rollouts={
                "rollout_id": [0, 1], "group_id": [0, 1000], "index_in_group": [0, 0], "kind": ["train", "eval"],
                "prompt_id": [step + 10, 0], "prompt": ["Solve 2x = 4", "Solve 3x = 9"],
                "completion": ["x = 2", answer], "reward": [1.0, 0.0], "advantage": [0.0, 0.0], "length": [3, 2000]})
    settle_run_logs()
    at = open_page(tmp_path, "replay", monkeypatch, run=RUN, step=1)
    history = table(at, "step", "completion", "completion_chars", "at")
    assert history["completion"].tolist() == [a[: data.EVAL_PREVIEW_CHARS] for a in answers]
    assert history["completion_chars"].tolist() == [str(len(a)) for a in answers]
    across = table(at, "run", "completion", "completion_chars")
    assert across["completion"].tolist() == [answers[1][: data.EVAL_PREVIEW_CHARS]]  # its latest at step 1


def test_weighting_computes_the_next_step_ahead_so_moving_there_recomputes_nothing(logs, monkeypatch,
                                                                                 prefetching):
    """Once Algorithm weighting is drawn at step 0, the server's prefetch thread asks the page's queries and
    objectives for step 1 with the same choices (the whole step, every algorithm shown): moving the step slider
    then reads no token and asks no objective, and draws what a fresh computation of step 1 gives."""
    import streamlit as st

    from engine.runlog import RunReader

    st.cache_data.clear()
    st.cache_resource.clear()
    asked, weighed = [], []
    weighed_tokens, weigh = data.weighed_tokens, recompute.weigh
    monkeypatch.setattr(data, "weighed_tokens", lambda r, run, step, *a: asked.append(step) or
                        weighed_tokens(r, run, step, *a))
    monkeypatch.setattr(recompute, "weigh", lambda *a, **k: weighed.append(a[1]) or weigh(*a, **k))
    at = open_page(logs, "algorithm_weighting", monkeypatch, run=RUN, step=0)
    at.radio(key="weigh_scope").set_value("the whole step").run()
    assert not at.exception
    assert prefetching.settled(timeout=120)
    assert asked.count(1) == 1 and weighed.count("grpo") == 2  # step 1's tokens and objectives, once, in advance
    asked.clear()
    weighed.clear()
    at.select_slider(key="step").set_value(1).run()
    assert not at.exception
    assert asked == [] and weighed == []
    # the registry's first panel (GRPO), on step 1
    shown = heatmap_cells([t for t in plotly_spec(at, "weight_heatmaps")["data"] if t["xaxis"] == "x"])[0]
    tokens = data.tokens_at_update(RunReader(logs), RUN, 1, (0, 1, 2), -1)
    weights = recompute.weigh(recompute.batch_from_tokens(tokens), "grpo", {}).grad_weight
    binned_weights = recompute.binned_columns(weights, 333)[0]
    np.testing.assert_allclose(shown, binned_weights, rtol=1e-5,
                               atol=1e-6 * np.nanmax(np.abs(binned_weights)))
