"""The Token inspector on a long completion (a reasoning run's 5k tokens) and on a short one, under AppTest.

The run is written through `RunWriter` with random values; what the page shows (the text window, its values, the
overview strip's bins and marks) is compared with pandas over the rows that were logged, read back straight from
the Parquet files (`independent`), not with the app's queries.
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
    drawn_figures,
    heatmap_cells,
    independent,
    open_page,
    open_token_values,
    plotly_spec,
    shown_tokens,
)
from test_token_views import grid

from dashboard import data
from dashboard.tokens import CHANNELS, MISMATCH_CHANNELS
from engine.clip_codes import CLIP_CAP, CLIP_HIGH, CLIP_LOW, CLIP_NAMES
from engine.correction_settings import REJECT_SEQUENCE, REJECT_TOKEN

LONG, SHORT = 5000, 20  # tokens of rollout 0 and rollout 1
MISMATCH_LABELS = [CHANNELS[name].label for name in MISMATCH_CHANNELS]


def write_run(logs_dir, name: str, sampler: bool) -> None:
    """One step of two train rollouts (5,000 and 20 tokens) with one optimisation pass; `sampler`: with the
    sampler's log-probs, IS weights and rejections (a run with a correction on), else without them."""
    from engine.runlog import RunWriter

    rng = np.random.default_rng(7)
    lengths = np.array([LONG, SHORT])
    rollout = np.repeat([0, 1], lengths)
    position = np.concatenate([np.arange(n) for n in lengths])
    n = len(rollout)
    old_logp = -rng.gamma(1.0, 0.6, n)
    tokens = {"rollout_id": rollout, "position": position, "token_id": rng.integers(0, 50, n),
              "token_text": np.array([f" w{i % 97}" if i % 13 else "\n" for i in range(n)], dtype=object),
              "old_logp": old_logp, "ref_logp": old_logp + rng.normal(0, 0.05, n), "entropy": rng.gamma(2, 0.4, n),
              "advantage": np.where(rollout == 0, 0.7, -0.7)}
    passes = {"pass": np.zeros(n, int), "rollout_id": rollout, "position": position,
              "new_logp": old_logp + rng.normal(0, 0.1, n), "ratio": np.exp(rng.normal(0, 0.15, n)),
              "clip": rng.choice([0, CLIP_LOW, CLIP_HIGH, CLIP_CAP], n, p=[0.97, 0.01, 0.01, 0.01]).astype(np.int8),
              "grad_weight": rng.normal(0, 1e-3, n), "token_loss": rng.normal(0, 1e-3, n), "kl": rng.random(n)}
    if sampler:
        tokens["sampler_logp"] = old_logp + rng.standard_t(3, n) * 0.05
        passes["is_weight"] = rng.uniform(0.5, 2.0, n)
        passes["rejected"] = rng.choice([0, REJECT_TOKEN, REJECT_SEQUENCE], n, p=[0.98, 0.01, 0.01]).astype(np.int8)
    rollouts = {"rollout_id": [0, 1], "group_id": [0, 0], "index_in_group": [0, 1], "kind": ["train", "train"],
                "prompt_id": [0, 0], "prompt": ["p", "p"], "completion": ["a", "b"], "reward": [1.0, 0.0],
                "advantage": [0.7, -0.7], "length": lengths}
    with RunWriter.create(logs_dir, name, algorithm="grpo", task="t", config={}, model="m") as writer:
        writer.log_step(0, metrics={"reward_mean": 0.5}, rollouts=rollouts, tokens=tokens, token_passes=passes)


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    logs_dir = tmp_path_factory.mktemp("long") / "logs"
    write_run(logs_dir, "sampled", sampler=True)
    write_run(logs_dir, "plain", sampler=False)
    settle_run_logs()  # the step folders the closing merges replaced are gone before a test lists the files
    return logs_dir


def logged(logs_dir, run: str, rollout: int) -> pd.DataFrame:
    """The rollout's tokens joined with its pass, as written, with the mismatch and the rejected share."""
    tokens = independent(logs_dir, "tokens", "WHERE run = ? AND rollout_id = ?", [run, rollout])
    passes = independent(logs_dir, "token_passes", "WHERE run = ? AND rollout_id = ?", [run, rollout])
    # what the writer copies from the token row into the pass row (its text, its entropy decile) is the token's
    passes = passes.drop(columns=["run", "step", "token_text", "entropy_decile"], errors="ignore")
    frame = tokens.merge(passes, on=["rollout_id", "position"], how="left")
    # stored as float32, read as DOUBLE by the dashboard: the expected values are computed in float64 too
    frame = frame.astype({c: "float64" for c in frame.select_dtypes("float32").columns})
    frame = frame.sort_values("position").reset_index(drop=True)
    return frame.assign(mismatch=frame["old_logp"] - frame["sampler_logp"],
                        rejected_share=(frame["rejected"] != 0).astype(float))


def spans(at) -> list[tuple[int, int, int]]:
    """(position, clip, rejected) of every token shown."""
    shown = shown_tokens(at)
    return list(zip(shown["position"], shown["clip"], shown["rejected"], strict=True))


def test_bins_are_the_means_and_counts_of_the_logged_tokens(logs):
    """5,000 tokens in at most 1,000 bins: 1,000 bins of 5 consecutive positions; at most 7 bins: width 715."""
    from engine.runlog import RunReader

    rows = logged(logs, "sampled", 0)
    reader = RunReader(logs)
    for bins, width in ((1000, 5), (7, 715)):
        shown = data.rollout_token_bins(reader, "sampled", 0, 0, 0, bins)
        expected = rows.groupby(rows["position"] // width)
        assert len(shown) == -(-LONG // width) <= bins
        assert shown["first_pos"].tolist() == expected["position"].min().tolist()
        assert shown["last_pos"].tolist() == expected["position"].max().tolist()
        assert shown["tokens"].tolist() == expected.size().tolist()
        for column, source in (("ratio", "ratio"), ("mismatch", "mismatch"), ("is_weight", "is_weight"),
                               ("rejected", "rejected_share"), ("entropy", "entropy")):
            np.testing.assert_allclose(shown[column], expected[source].mean(), rtol=1e-9, err_msg=column)
        for code in (CLIP_LOW, CLIP_HIGH, CLIP_CAP):
            counts = expected["clip"].apply(lambda c, code=code: int((c == code).sum()))
            assert shown[f"clip_{CLIP_NAMES[code]}"].tolist() == counts.tolist()
        assert shown["rejected_tokens"].tolist() == expected["rejected"].apply(lambda r: int((r != 0).sum())).tolist()
    short = data.rollout_token_bins(reader, "sampled", 0, 1, 0, 1000)  # one bin per token
    np.testing.assert_allclose(short["ratio"], logged(logs, "sampled", 1)["ratio"], rtol=1e-9)


def test_a_long_rollout_is_shown_by_windows_with_a_strip_of_the_whole(logs, monkeypatch):
    rows = logged(logs, "sampled", 0)
    at = open_page(logs, "token_inspector", monkeypatch, run="sampled", step=0, rollout=0, channel="mismatch")
    # The text: the first 512 tokens only, with their clip and rejection marks; their values in the table.
    assert spans(at) == list(zip(range(512), rows["clip"][:512], rows["rejected"][:512], strict=True))
    values = dataframe(open_token_values(at), "token_text", "mismatch", "is_weight", "rejected")
    assert values["position"].tolist() == list(range(512))
    np.testing.assert_allclose(values["mismatch"], rows["mismatch"][:512], rtol=1e-9)
    np.testing.assert_allclose(values["is_weight"], rows["is_weight"][:512], rtol=1e-9)
    # The strip: 1,000 cells of 5 tokens each, coloured by their mean mismatch; under them a mark in every bin
    # with a clip event or a rejected token, on that event's line; the window outlined.
    strip = plotly_spec(at, "token_strip")
    cells, windows, marks = strip["data"]
    by_bin = rows.groupby(rows["position"] // 5)
    np.testing.assert_allclose(grid(cells["z"])[0], by_bin["mismatch"].mean(), rtol=1e-6)  # sent as float32
    _, centres, widths = heatmap_cells([cells])
    np.testing.assert_allclose(centres, (by_bin["position"].min() + by_bin["position"].max()) / 2)
    assert set(widths) == {5}
    for label, hit in (("clip low", rows["clip"] == CLIP_LOW), ("rejected", rows["rejected"] != 0)):
        line = grid(marks["z"])[marks["y"].index(label)]
        marked = np.flatnonzero(~np.isnan(line))
        assert marked.tolist() == np.unique(rows["position"][hit] // 5).tolist()
        np.testing.assert_allclose(grid(marks["customdata"])[marks["y"].index(label)][marked],
                                   by_bin.apply(lambda b, hit=hit: int(hit[b.index].sum()))[marked])
    starts = np.arange(0, LONG, 512)  # a click lands on the invisible point of a window: the page jumps there
    np.testing.assert_allclose(array(windows["x"]), (starts + np.minimum(starts + 511, LONG - 1)) / 2)
    outline = strip["layout"]["shapes"][0]
    assert (outline["x0"], outline["x1"]) == (-0.5, 511.5)
    # The heatmap: the whole completion binned, never one column per token; drawn outside the window's fragment,
    # so it does not mark the window (moving the window neither rebuilds nor redraws it).
    heatmap = plotly_spec(at, "token_channel_heatmap")
    for trace in heatmap["data"]:  # a row per channel, on one pair of axes
        values, centres, widths = heatmap_cells([trace])
        assert values.shape == (1, 1000) and set(widths) == {5}
        np.testing.assert_allclose(centres, (by_bin["position"].min() + by_bin["position"].max()) / 2)
    assert len({trace["y"][0] for trace in heatmap["data"]}) == len(heatmap["data"])
    assert not heatmap["layout"].get("shapes")

    # Moving the window: the next tokens, and the URL follows (a link opens the same window); the table of values,
    # once opened, follows too. The completion was read once: a move reads no token.
    open_token_values(at)
    read = []
    monkeypatch.setattr(data, "rollout_tokens", lambda *args, **kwargs: read.append(args[1:]))
    at.select_slider(key="window").set_value(2048).run()
    assert read == []
    assert not at.exception
    assert [p for p, _, _ in spans(at)] == list(range(2048, 2560)) and at.query_params["window"] == "2048"
    at.selectbox(key="window_size").set_value(1024).run()
    assert [p for p, _, _ in spans(at)] == list(range(2048, 3072))
    shown = dataframe(at, "token_text", "ratio")
    np.testing.assert_allclose(shown["ratio"], rows["ratio"][2048:3072], rtol=1e-9)
    assert shown["token_text"].tolist() == rows["token_text"][2048:3072].tolist()

    # A link to a position opens the window holding it; the last window is cut at the last token.
    at = open_page(logs, "token_inspector", monkeypatch, run="sampled", step=0, rollout=0, window=4700)
    assert [p for p, _, _ in spans(at)] == list(range(4608, LONG))


def test_a_short_rollout_is_shown_whole_one_cell_per_token(logs, monkeypatch):
    rows = logged(logs, "sampled", 1)
    at = open_page(logs, "token_inspector", monkeypatch, run="sampled", step=0, rollout=1, channel="ratio")
    assert [p for p, _, _ in spans(at)] == list(range(SHORT))
    assert not at.get("select_slider")  # no window control, no strip
    assert drawn_figures(at) and all("token_strip" not in element for element in drawn_figures(at))
    heatmap = plotly_spec(at, "token_channel_heatmap")
    assert all(heatmap_cells([trace])[1].tolist() == list(range(SHORT)) for trace in heatmap["data"])
    bottom = max((k for k in heatmap["layout"] if k.startswith("xaxis")), key=lambda k: int(k[5:] or 1))
    assert heatmap["layout"][bottom]["dtick"] == 1  # one tick per token, centred on its cell
    row_names = heatmap["layout"]["yaxis"]["ticktext"]
    ratio = next(t for t in heatmap["data"] if row_names[t["y"][0]] == "ratio π/π_old")
    np.testing.assert_allclose(grid(ratio["z"])[0], rows["ratio"], rtol=1e-6)  # sent as float32


def test_the_mismatch_channels_are_offered_only_where_they_were_logged(logs, monkeypatch):
    at = open_page(logs, "token_inspector", monkeypatch, run="sampled", step=0, rollout=0, channel="rejected")
    assert set(MISMATCH_LABELS) <= set(at.selectbox(key="channel").options)  # AppTest lists the labels
    assert at.selectbox(key="channel").value == "rejected"
    shown = shown_tokens(at)
    struck = [code for code in shown["rejected"] if code]
    assert struck and "line-through" in shown["styles"]["rejected"]  # drawn struck through
    assert {shown["reject_names"][str(code)] for code in struck} <= {"token", "sequence"}  # named in the hover

    at = open_page(logs, "token_inspector", monkeypatch, run="plain", step=0, rollout=0, channel="mismatch")
    options = at.selectbox(key="channel").options
    assert not set(MISMATCH_LABELS) & set(options) and CHANNELS["ratio"].label in options
    assert at.selectbox(key="channel").value == "advantage"  # the link's channel is not there: the default
    assert any("not logged for this rollout" in c.value and "mismatch" in c.value for c in at.caption)
    assert {r for _, _, r in spans(at)} == {0}


def test_the_report_of_a_long_rollout_writes_each_token_once_and_bins_its_heatmap(logs):
    """The report draws the rollout's tokens in the reader's browser (`token_spans.js`) from data written once:
    its texts and hover texts once, a colour per token and channel. Written out as spans for each of its channels,
    a 16,384-token completion made a 105 MB report; its token x channel heatmap is binned as the page's."""
    import json

    from dashboard import plotly_bundle
    from dashboard.report import build_report
    from dashboard.tokens import OVERVIEW_BINS, visible_whitespace

    expected = logged(logs, "sampled", 0)
    text = build_report(str(logs), "sampled", 0, 0, "ratio")
    marks, colours = re.search(r"drawChannelBlocks\((\{.*?\}), (\{.*?\})\);</script>", text).groups()
    marks, colours = json.loads(marks), json.loads(colours)
    assert marks["text"] == [visible_whitespace(t) for t in expected["token_text"]]
    assert marks["position"] == list(range(LONG))
    assert marks["clip"] == expected["clip"].astype(int).tolist()
    assert next(iter(colours)) == "ratio"  # the channel asked for first, drawn open
    for name, drawn in colours.items():  # every channel logged for this rollout, a colour per token
        assert expected[CHANNELS[name].column].notna().any() and len(drawn["colour"]) == LONG
    assert text.count('class="pl-channel"') == len(colours) >= 10
    figures = [json.loads(f)["data"] for f in re.findall(r"var f = (\{.*?\}); Plotly.newPlot", text)]
    heatmap = [traces for traces in figures if "mean of the" in traces[0].get("hovertemplate", "")]
    assert len(heatmap) == 1 and len(heatmap[0]) == len(colours)  # a row per channel
    assert {heatmap_cells([trace])[0].shape[1] for trace in heatmap[0]} == {min(OVERVIEW_BINS, LONG)}
    # the whole report, plotly.js aside: about 0.5 kB a token (written out per channel it was about 4 kB)
    assert len(text) - len(plotly_bundle.served_script()) < 1000 * LONG
