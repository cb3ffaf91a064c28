"""Small, fast checks of the dashboard's pure parts: token HTML escaping, colour scales, charts, the CLI command."""

from __future__ import annotations

import html
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from markdown_it import MarkdownIt
from synthetic_runs import AUTOLINK_OR_SHORTCODE, HOSTILE_TEXTS

from dashboard import advantage_charts, charts
from dashboard.common import WORD_JOINER, flag, latest_steps_within, md, number, plain
from dashboard.tokens import (
    CHANNELS,
    _colour,
    channel_range,
    reasoning_steps_html,
    token_marks,
    token_spans,
    visible_text,
    visible_whitespace,
)
from engine.cli import build_parser, dashboard_command

HOSTILE = "<img src=x onerror=alert(1)>"


@pytest.mark.parametrize(
    ("token", "shown"),
    [
        ("x", "x"),
        (" =", "·="),  # a leading space is part of the token and must be seen
        ("\n", "↵<br>"),  # a newline is shown and still breaks the line
        ("\t1", "→1"),
        ('"&', "&quot;&amp;"),
        (HOSTILE, "&lt;img·src=x·onerror=alert(1)&gt;"),
    ],
)
def test_visible_text_escapes_and_shows_whitespace(token, shown):
    assert visible_text(token) == shown


def test_token_data_written_into_a_report_script_cannot_close_it():
    """The report writes its tokens as a JavaScript literal inside a <script> element (`token_spans.js` makes text
    nodes of them): no logged text may end that element, open a comment or hide a line break from the parser."""
    import json

    from dashboard.report import _script_json

    texts = ["a", HOSTILE, "</script><script>alert(1)</script>", "<!--", "x\u2028y", '" onmouseover="x']
    tokens = pd.DataFrame({"position": range(len(texts)), "token_text": texts, "advantage": 0.5, "clip": [0, 1, 2] * 2})
    written = _script_json(token_marks(tokens))
    assert "<" not in written and "\u2028" not in written and written.isascii()
    marks = json.loads(written)
    assert marks["text"] == [visible_whitespace(t) for t in texts]  # the same characters, read back
    # Low and high clip events are marked differently (and machine-readably).
    assert marks["clip"] == [0, 1, 2] * 2 and "border-bottom:4px" in marks["styles"]["1"]
    assert "border-top:4px" in marks["styles"]["2"]


def test_each_token_gets_the_colour_of_its_value_on_the_channel_scale():
    """`token_spans` colours whole columns at once; each token's colour is the one its own value gets one at a time
    (the palette's nearest colour between the scale's ends), none where it is missing or not finite."""
    values = [-0.5, 2.0, 0.0, np.nan, np.inf, 1.0, -2.0, 0.3]
    tokens = pd.DataFrame({"position": range(len(values)), "token_text": list("abcdefgh"), "advantage": values})
    drawn = token_spans(tokens, "advantage")
    assert (drawn["low"], drawn["high"]) == (-2.0, 2.0)
    palette = [tuple(pair) for pair in drawn["palette"]]
    shown = [palette[c] if c >= 0 else ("transparent", "inherit") for c in drawn["colour"]]
    assert shown == [_colour(v, -2.0, 2.0, "RdBu") for v in values]
    assert drawn["colour"][:3] == [round(1.5 / 4 * 255), 255, round(2 / 4 * 255)]  # 95.6 -> 96, 255, 127.5 -> 128
    # a channel this window did not log: nothing coloured, every token still there
    assert token_spans(tokens, "ratio")["colour"] == [-1] * len(values)


@pytest.mark.parametrize(
    ("channel", "values", "expected"),
    [
        ("advantage", [-0.5, 2.0], (-2.0, 2.0)),  # diverging around 0, symmetric
        ("ratio", [0.9, 1.3], (0.7, 1.3)),  # diverging around 1
        ("new_logp", [-3.0, -0.1], (-3.0, -0.1)),  # sequential: min to max
        ("kl", [np.nan, np.nan], (-1.0, 1.0)),  # nothing logged: a harmless default
    ],
)
def test_channel_range_is_centred_where_the_quantity_is_neutral(channel, values, expected):
    low, high = channel_range(pd.Series(values), CHANNELS[channel])
    assert (low, high) == pytest.approx(expected)


def test_metric_curves_draw_each_run_and_skip_missing_values():
    steps = pd.DataFrame({"run": ["a", "a", "b"], "step": [0, 1, 0], "reward_mean": [0.1, np.nan, 0.3],
                          "kl": [np.nan] * 3})
    figure = charts.metric_curves(steps, [("reward_mean", "reward"), ("kl", "KL")])
    assert [t.name for t in figure.data] == ["a", "b"]  # the all-missing KL panel is left out
    assert list(figure.data[0].y) == [0.1]
    figure = charts.metric_curves(steps, [("reward_mean", "reward")], upto_step=0, x_range=(0, 1))
    assert list(figure.data[0].x) == [0]


def test_dashboard_command_serves_on_loopback_with_an_absolute_logs_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(["dashboard", "--logs-dir", "some/logs"])
    assert args.host == "127.0.0.1" and args.port == 8501
    command = dashboard_command(args.logs_dir, args.host, args.port)
    assert command[1:4] == ["-m", "dashboard.serve", "run"]  # streamlit's command line, warming up meanwhile
    assert Path(command[4]).name == "streamlit_app.py" and Path(command[4]).is_file()
    assert command[command.index("--server.address") + 1] == "127.0.0.1"
    assert command[command.index("--server.headless") + 1] == "true"
    assert command[command.index("--browser.gatherUsageStats") + 1] == "false"
    assert command[-3:] == ["--", "--logs-dir", str(tmp_path / "some" / "logs")]


@pytest.mark.parametrize(
    ("environ", "platform", "desktop"),
    [({}, "linux", False), ({"DISPLAY": ":0"}, "linux", True), ({"WAYLAND_DISPLAY": "wayland-0"}, "linux", True),
     ({}, "darwin", True), ({}, "win32", True)],
)
def test_the_demo_opens_a_browser_only_on_a_desktop(environ, platform, desktop):
    from engine.cli import has_desktop

    assert has_desktop(environ, platform) is desktop


def test_browser_opens_the_dashboard_once_the_server_answers(monkeypatch):
    import http.server
    import threading
    import time
    import webbrowser

    from engine.cli import local_url, open_browser_when_up

    assert local_url("0.0.0.0", 8501) == "http://127.0.0.1:8501" and local_url("::1", 80) == "http://[::1]:80"
    opened = []
    monkeypatch.setattr(webbrowser, "open", opened.append)
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    url = local_url("127.0.0.1", server.server_port)
    server.socket.close()  # the port is known but nothing answers yet
    waiter = open_browser_when_up(url, timeout=20)
    time.sleep(1.0)
    assert opened == []  # not before the server is up
    server = http.server.HTTPServer(("127.0.0.1", int(url.rsplit(":", 1)[1])), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        waiter.join(20)
    finally:
        server.shutdown()
    assert opened == [url]


def test_heatmaps_send_explicit_colour_stops_in_the_direction_of_the_token_view():
    # plotly.js's own "RdBu" runs blue -> red, the opposite of plotly.py's (used by the token view): a name must
    # not reach the browser, or a positive advantage would be red in one view and blue in the other.
    tokens = pd.DataFrame({"position": [0, 1], "token_text": ["a", "b"], "advantage": [-1.0, 1.0]})
    figure = charts.token_channel_heatmap(tokens, ["advantage"])
    stops = figure.data[0].colorscale
    assert not isinstance(stops, str)
    assert stops[0][1] == "rgb(103,0,31)" and stops[-1][1] == "rgb(5,48,97)"  # red for -, blue for +
    weights = charts.weight_heatmaps({"grpo": np.array([[0.1, -0.1]])}, ["r0"])
    assert not isinstance(weights.data[0].colorscale, str)
    stacked = charts.stacked_weight_heatmap({"tis": np.array([[1.5, 0.0]])}, ["r0"])
    assert not isinstance(stacked.data[0].colorscale, str)


def test_stacked_weight_heatmap_keeps_each_correction_s_rows_in_its_band():
    weights = {"TIS": np.array([[1.5, np.nan], [0.5, 2.0]]), "reject": np.array([[1.0, 0.0], [np.nan, 1.0]]),
               "mask": np.array([[0.0, 1.0], [1.0, 1.0]])}
    figure = charts.stacked_weight_heatmap(weights, ["#0", "#1"], positions=np.array([3.0, 8.0]), bin_width=5)
    (trace,) = figure.data
    z = np.asarray(trace.z)
    assert z.dtype == np.float32 and z.shape == (6, 2)
    np.testing.assert_array_equal(z, np.concatenate(list(weights.values())))  # NaN padding stays NaN
    assert list(trace.y) == ["TIS · #0", "TIS · #1", "reject · #0", "reject · #1", "mask · #0", "mask · #1"]
    assert list(figure.layout.yaxis.ticktext) == list(weights)
    assert [shape.y0 for shape in figure.layout.shapes] == [1.5, 3.5]  # between the bands
    assert (trace.zmin, trace.zmid, trace.zmax) == (0.0, 1.0, 2.0)  # centred at 1, as far as the farthest weight
    assert "± 2" in trace.hovertemplate


def test_weighting_and_sandbox_take_their_lists_and_numbers_from_the_engine():
    from dashboard import recompute
    from engine.advantages import normalized_step_rewards, process_advantages
    from engine.objectives import ALGORITHMS, CLIP_EVENTS, CLIP_NAMES

    assert recompute.author_knobs()["algorithm"].tolist() == list(ALGORITHMS)
    weighting = recompute.Weighting(grad_weight=np.zeros((1, 4)), clip=np.array([[0, 1, 2, 3]]),
                                    ratio=np.ones((1, 4)), total_weight=np.zeros(1), params={})
    row = recompute.clip_fraction_row("grpo", weighting)
    assert [row[CLIP_NAMES[c]] for c in CLIP_EVENTS] == [0.25, 0.25, 0.25]
    rewards, lengths = [[0.9, 0.95, 0.8], [0.9, -0.8, -0.9]], [[4, 4, 2], [3, 3, 3]]
    advantages, normalized = recompute.process_sandbox(rewards, lengths)
    assert normalized == normalized_step_rewards(rewards)
    np.testing.assert_array_equal(advantages, process_advantages(rewards, [[3, 7, 9], [2, 5, 8]], [10, 9]).numpy())


# ---------------------------------------------------------------- logged text in markdown

MARKDOWN = MarkdownIt("commonmark").enable(["table", "strikethrough"])  # GFM autolinks are checked by regex


@pytest.mark.parametrize("text", [*HOSTILE_TEXTS, "plain", "a\\b", "\\$5", "tab\there"])
def test_md_shows_logged_text_as_its_characters_and_nothing_else(text):
    source = md(text)
    rendered = MARKDOWN.render(source)
    # One paragraph of text: no link, image, HTML, heading, table, emphasis or code span.
    assert rendered.startswith("<p>") and rendered.endswith("</p>\n") and rendered.count("<p>") == 1, rendered
    inner = rendered[len("<p>"):-len("</p>\n")]
    assert "<" not in inner, inner  # the renderer escapes text, so any '<' left is an element
    assert html.unescape(inner).replace(WORD_JOINER, "") == text
    assert not AUTOLINK_OR_SHORTCODE.search(html.unescape(inner)), inner
    assert not re.search(r"(?<!\\)\$", source)  # an unescaped $ starts a formula (KaTeX)


@pytest.mark.parametrize("missing", [None, np.nan, pd.NA, pd.NaT])
def test_values_left_out_of_the_log_read_as_a_dash(missing):
    assert md(missing) == plain(missing) == number(missing) == "–"
    assert flag(missing) is False


def test_logged_values_are_formatted_as_given():
    assert number(0.123456) == "0.123" and number(-1.5, "+.2f") == "-1.50" and number(7.0, ".0f") == "7"
    assert flag(True) and flag(np.bool_(True)) and not flag(False)
    assert plain("x < y") == "x < y"


def test_tokens_logged_without_position_or_text_still_render():
    tokens = pd.DataFrame({"position": pd.array([0, None], dtype="Int64"),
                           "token_text": pd.array(["a", None], dtype="string"),
                           "advantage": [0.5, np.nan], "clip": pd.array([None, 2], dtype="Int8")})
    marks = token_marks(tokens)
    assert marks["position"] == [0, None] and marks["text"] == ["a", ""]
    hover = [*marks["heading"], *(value for values in marks["hover"]["values"] for value in values)]
    assert not any("None" in text or "<NA>" in text for text in hover)
    assert marks["hover"] == {"names": ["advantage"], "values": [["0.5", "–"]]}


def test_reasoning_steps_of_an_outcome_supervised_run_show_raw_rewards_without_nan():
    tokens = pd.DataFrame({"position": [0, 1, 2], "token_text": ["2x", " =", " 4"]})
    steps = pd.DataFrame({"step_index": [1, 0], "first_pos": [2, 0], "last_pos": [2, 1], "reward_raw": [0.0, 1.0],
                          "reward_norm": [np.nan, np.nan]})
    body = reasoning_steps_html(tokens, steps)
    assert "nan" not in body.lower()
    assert body.index("step 0 · raw 1") < body.index("step 1 · raw 0")
    assert body.count("not used by the advantages") == 2
    # the figure takes `data.prm_step_bins` rows: here one step per bin
    bins = steps.assign(completion="#0", first_step=steps["step_index"], last_step=steps["step_index"])
    figure = advantage_charts.group_step_rewards(bins)
    assert {trace.xaxis for trace in figure.data} == {"x"}  # the raw panel only: no empty "normalized" panel
    with_norm = reasoning_steps_html(tokens, steps.assign(reward_norm=[-0.7071, 0.7071]))
    assert "step 0 · raw 1 · norm +0.707" in with_norm and "step 1 · raw 0 · norm -0.707" in with_norm
    both = advantage_charts.group_step_rewards(bins.assign(reward_norm=[1.0, 2.0]))
    assert {trace.xaxis for trace in both.data} == {"x", "x2"}


def test_sandbox_labels_typed_by_the_user_reach_plotly_escaped():
    figure = advantage_charts.sandbox_advantages(np.zeros((1, 2)), ['<a href="https://example.com">x</a>'], [2])
    assert figure.data[0].name == "&lt;a href=&quot;https://example.com&quot;&gt;x&lt;/a&gt;"


def test_metric_curves_tick_every_step_only_when_the_steps_span_few():
    # 9 evaluated steps spread over 0..80 (a 10-minute run evaluated every 10): one tick per step would print 80
    # overlapping labels; 6 consecutive steps still get one tick each.
    spread = pd.DataFrame({"run": "a", "step": np.arange(0, 90, 10), "heldout_accuracy": np.linspace(0.2, 0.4, 9)})
    figure = charts.metric_curves(spread, [("heldout_accuracy", "acc")])
    assert figure.layout.xaxis.dtick is None
    dense = pd.DataFrame({"run": "a", "step": np.arange(6), "heldout_accuracy": np.linspace(0.2, 0.4, 6)})
    assert charts.metric_curves(dense, [("heldout_accuracy", "acc")]).layout.xaxis.dtick == 1


@pytest.mark.parametrize("seed", range(5))
def test_code_rectangles_cover_each_grid_cell_once_with_its_code(seed):
    rng = np.random.default_rng(seed)
    x = np.sort(rng.uniform(0, 4, 23))
    y = np.sort(rng.uniform(-2, 2, 9))
    codes = rng.integers(0, 3, (len(y), len(x)))
    codes[3:6] = codes[2]  # equal rows, merged into one band
    rects = charts.code_rectangles(x, y, codes)
    # each grid point, moved off the grid's outer edge by a hair, is strictly inside one rectangle, of its code
    probe_x, probe_y = np.clip(x, x[0] + 1e-9, x[-1] - 1e-9), np.clip(y, y[0] + 1e-9, y[-1] - 1e-9)
    for j, yc in enumerate(probe_y):
        for i, xc in enumerate(probe_x):
            holding = [r for r in rects if r[0] < xc < r[1] and r[2] < yc < r[3]]
            assert len(holding) == 1 and holding[0][4] == codes[j, i], (i, j, holding)
    area = sum((x1 - x0) * (y1 - y0) for x0, x1, y0, y1, _ in rects)
    assert area == pytest.approx((x[-1] - x[0]) * (y[-1] - y[0]))


def test_clip_regions_of_the_objectives_are_a_few_rectangles():
    # PPO-clip's decisions split the plane at A = 0 and at 1 -/+ eps: six rectangles, four of them clipped or not
    x, y = np.linspace(0.0, 3.0, 121), np.linspace(-1.0, 1.0, 41)
    rr, aa = np.meshgrid(x, y)
    codes = np.where((aa > 0) & (rr > 1.2), 2, np.where((aa < 0) & (rr < 0.8), 1, 0))
    rects = charts.code_rectangles(x, y, codes)
    assert len(rects) == 5  # A < 0: low, none; A = 0: none; A > 0: none, high
    assert {r[4] for r in rects} == {0, 1, 2}


def test_scatter_keeps_one_token_per_pixel():
    x = np.array([1.0, 1.0001, 1.5, np.nan, 2.0])
    y = np.array([0.41, 0.4101, 0.41, 0.1, -0.5])
    kept_x, kept_y = charts._one_per_pixel(x, y, [0.0, 3.0], [-1.0, 1.0])
    assert kept_x.tolist() == [1.0, 1.5, 2.0] and kept_y.tolist() == [0.41, 0.41, -0.5]


def test_latest_steps_within_a_token_budget():
    steps, tokens = [0, 2, 4, 6], {0: 50, 2: 30, 4: 20, 6: 10}
    assert latest_steps_within(steps, tokens, 30) == 4  # 10 + 20 fit, + 30 does not
    assert latest_steps_within(steps, tokens, 60) == 2  # exactly 60
    assert latest_steps_within(steps, tokens, 1000) == 0  # the whole run
    assert latest_steps_within(steps, tokens, 5) == 6  # the last step even when it alone is over the budget
    assert latest_steps_within(steps, {}, 5) == 0  # no lengths logged: nothing to bound by


def test_the_selected_runs_row_is_parsed_once_with_its_config():
    """The sidebar's selection carries the run's row of the runs table, config parsed (pages read
    `selection.config`, none parses run.json or the runs table again); a missing task or algorithm reads as "",
    a config that is not a JSON object as {} with `config_readable` False."""
    from dashboard.common import Selection
    from dashboard.data import run_overview

    table = pd.DataFrame({
        "run": ["a", "b"], "status": ["finished", "running"], "algorithm": ["ppo", None], "task": ["linear", None],
        "model": ["tiny", None], "last_step": [7, None], "updated_at": ["t1", "t2"],
        "config": ['{"scale_adv_by_std": false, "critic": {"lr": 0.001}}', "[1, 2]"],
    })
    a = run_overview(table, "a")
    selection = Selection(logs_dir="logs", info=a, step=7, steps=tuple(range(8)))
    assert (selection.run, selection.status, selection.algorithm, selection.task) == ("a", "finished", "ppo", "linear")
    assert selection.config == {"scale_adv_by_std": False, "critic": {"lr": 0.001}} and a.config_readable
    assert selection.version == ("a", "finished", 7, "t1")
    b = run_overview(table, "b")
    assert (b.algorithm, b.task, b.model, b.last_step) == ("", "", "", -1)
    assert b.config == {} and not b.config_readable
    assert run_overview(table, "c") is None



@pytest.mark.parametrize("length", [1, 3, 12, 40, 41, 650])
def test_token_heatmap_ticks_whole_positions_centred_on_their_cells(length):
    """A short rollout gets one tick per token position; a long one whole-position ticks at most 40 of them. A
    heatmap cell at x = i spans i ± 0.5, so a tick at a whole number is centred on its cell."""
    tokens = pd.DataFrame({"position": range(length), "token_text": [f"t{i}" for i in range(length)],
                           "advantage": np.linspace(-1, 1, length), "entropy": np.linspace(0, 2, length)})
    heatmap = charts.token_channel_heatmap(tokens, ["advantage", "entropy"])
    layout = heatmap.to_plotly_json()["layout"]
    bottom = max((k for k in layout if k.startswith("xaxis")), key=lambda k: int(k[5:] or 1))
    axis = layout[bottom]
    assert axis["tickmode"] == "linear" and axis["tick0"] == 0
    step = axis["dtick"]
    assert isinstance(step, int) and step >= 1
    ticks = list(range(0, length, step))
    cells = [(trace.x0 + trace.dx * np.arange(np.asarray(trace.z).shape[1])).tolist() for trace in heatmap.data]
    assert all(c == list(range(length)) for c in cells)  # cell centres on whole positions
    if length <= 40:
        assert ticks == list(range(length))  # one tick per token position
    else:
        assert len(ticks) <= 40 and step in (2, 5, 10, 20, 50)


def test_ema_smoothing_is_tensorboards_debiased_average():
    """Worked by hand with weight 0.5 on 1, 0, 0: m = 0.5, 0.25, 0.125; debiased by 1 - 0.5^n = 0.5, 0.75, 0.875."""
    np.testing.assert_allclose(charts.ema_smoothed(np.array([1.0, 0.0, 0.0]), 0.5), [1.0, 1 / 3, 0.125 / 0.875])
    values = np.array([0.3, -1.0, 2.5])
    np.testing.assert_array_equal(charts.ema_smoothed(values, 0.0), values)  # weight 0: no smoothing
    np.testing.assert_allclose(charts.ema_smoothed(np.full(5, 0.7), 0.9), 0.7)  # a constant stays itself
    with pytest.raises(ValueError, match="0 <= weight < 1"):
        charts.ema_smoothed(values, 1.0)


def test_metric_curves_smooth_on_request_and_keep_accuracy_on_zero_to_one():
    steps = pd.DataFrame({"run": ["a"] * 3, "step": [0, 1, 2], "reward_mean": [1.0, 0.0, 0.0],
                          "heldout_accuracy": [np.nan, 0.5, np.nan]})
    metrics = [("reward_mean", "reward"), ("heldout_accuracy", "acc")]
    plain = charts.metric_curves(steps, metrics)
    assert len(plain.data) == 2 and list(plain.data[0].y) == [1.0, 0.0, 0.0]  # off: the raw curves only
    smoothed = charts.metric_curves(steps, metrics, smoothing=0.5)
    raw, line = smoothed.data[0], smoothed.data[1]
    assert list(raw.y) == [1.0, 0.0, 0.0] and raw.opacity < 1 and not raw.showlegend
    np.testing.assert_allclose(line.y, [1.0, 1 / 3, 0.125 / 0.875])
    # One evaluated step: the accuracy axis spans 0..1 (plotly alone pads a lone point to ±1 around it).
    low, high = plain.layout.yaxis2.range
    assert -0.1 < low < 0 and 1 < high < 1.1


_HEAP_PROBE = """
import sys
import numpy as np

def resident_mb():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024

if sys.argv[1] == "release":
    from dashboard.common import release_large_blocks
    assert release_large_blocks()
big = np.ones(30 << 17)  # 30 MB, freed: glibc's default raises its mmap threshold to 30 MB
del big
before = resident_mb()
block = np.ones(20 << 17)  # 20 MB, below the raised threshold: from the heap unless the threshold is fixed
del block
print(resident_mb() - before)
"""


def test_the_server_gives_freed_large_blocks_back_to_the_system():
    """A 20 MB array freed after a 30 MB one: with glibc's default the server keeps its memory (the control), after
    `release_large_blocks` it is given back at once."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent

    def kept_mb(mode: str) -> float:
        out = subprocess.run([sys.executable, "-c", _HEAP_PROBE, mode], capture_output=True, text=True, cwd=root,
                             check=True)
        return float(out.stdout.split()[-1])

    assert kept_mb("default") > 15
    assert kept_mb("release") < 2


@pytest.mark.parametrize("tokens, width", [(5000, 5), (4997, 5), (3, 1), (7, 7)])
def test_binned_heatmap_cells_span_exactly_their_tokens(tokens, width):
    """Bins of `width` consecutive tokens (the last may be shorter) go as evenly spaced columns (x0 + dx: plotly.js
    draws those as one image pixel per cell) and, when the last bin is shorter, a column of its own width: every
    cell spans exactly its tokens (position ± 0.5 at both ends)."""
    first = np.arange(0, tokens, width)
    last = np.minimum(first + width, tokens) - 1
    runs = charts.column_runs((first + last) / 2, width)
    assert all("x" not in at for _, at in runs)
    edges = []
    for columns, at in runs:
        count = len(first[columns])
        left = at["x0"] - at["dx"] / 2 + at["dx"] * np.arange(count)
        edges += list(zip(left, left + at["dx"], strict=True))
    np.testing.assert_allclose(edges, np.stack([first - 0.5, last + 0.5], axis=1))
    assert len(runs) == (1 if tokens % width == 0 or len(first) == 1 else 2)


def test_heatmap_columns_not_evenly_spaced_keep_their_positions():
    # a gap (an imported run without some positions): the x array, drawn cell by cell
    ((columns, at),) = charts.column_runs(np.array([0.0, 1.0, 3.0]))
    assert columns == slice(None) and at["x"].tolist() == [0.0, 1.0, 3.0]
