"""How long the browser takes to draw the dashboard's heatmaps of long completions, figure by figure.

    python benchmarks/bench_heatmaps.py                # median of 10 draws of each figure
    python benchmarks/bench_heatmaps.py --repeat 20

Each figure is built by its `dashboard.charts` function from made-up inputs shaped like a reasoning run's (a
16,384-token completion in the Token inspector's 1,000 bins; Algorithm weighting's five panels of one group, 8
completions, and of a whole step's first 48, binned to a third of the screen; Mismatch's 20 corrections stacked), then
drawn in headless Chromium by the plotly.js the dashboard serves, with the axes the dashboard's template gives every
figure (`automargin` on: dashboard/figure.js), two ways:
- newPlot: a first draw into an empty element (a page's first load, a reload);
- react: the same element given the figure of other inputs (a rerun: another rollout, step or scope).
Run it from two checkouts to compare versions. Browser time only; `bench_browser.py` times whole pages.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

# What dashboard/figure.js's template sets on every axis that bears on drawing time (its colours aside).
DASHBOARD_AXES = {"layout": {"xaxis": {"automargin": True}, "yaxis": {"automargin": True}}}
DRAW = """async ([spec, template, react]) => {
    const figure = JSON.parse(spec);
    figure.layout.template = template;
    const plot = document.getElementById('g');
    if (!react) Plotly.purge(plot);
    const started = performance.now();
    await (react ? Plotly.react : Plotly.newPlot)(plot, figure.data, figure.layout, {responsive: true});
    await new Promise((done) => requestAnimationFrame(() => setTimeout(done, 0)));  // painted
    return performance.now() - started; }"""


def long_completion_bins(seed: int, tokens: int = 16_384, bins: int = 1000):
    """`dashboard.data.rollout_token_bins`' frame of a made-up completion: every channel's bin means, clip counts."""
    import numpy as np
    import pandas as pd

    from dashboard.tokens import CHANNELS

    rng = np.random.default_rng(seed)
    width = -(-tokens // bins)
    first = np.arange(0, tokens, width)
    frame = pd.DataFrame({"first_pos": first, "last_pos": np.minimum(first + width, tokens) - 1})
    frame["tokens"] = frame["last_pos"] - frame["first_pos"] + 1
    for channel in CHANNELS.values():
        frame[channel.column] = rng.normal(size=len(frame))
    frame["rejected"] = rng.uniform(size=len(frame)) * (rng.uniform(size=len(frame)) < 0.05)
    for name in ("clip_low", "clip_high", "clip_dual", "rejected_tokens"):
        frame[name] = rng.poisson(0.05, len(frame))
    return frame


def binned_weights(seed: int, rows: int, names: list[str], longest: int):
    """(name -> (rows, bins) binned weights, row labels, bin centres, bin width) of made-up completions of
    log-normal lengths (about 2k tokens, up to `longest`) in a third of the screen's bins, as the pages bin them."""
    import numpy as np

    from dashboard import common, recompute

    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.lognormal(np.log(2000), 0.8, rows).astype(int) + 50, longest)
    lengths[0] = longest
    beyond = np.arange(longest)[None, :] >= lengths[:, None]
    weights = {}
    for name in names:
        weight = rng.normal(0, 1e-4, (rows, longest))
        weight[beyond] = np.nan
        weights[name], centres, width = recompute.binned_columns(weight, common.PANEL_BINS)
    labels = [f"r{i + seed} g{i // 8}#{i % 8} A=+0.{i:02d}" for i in range(rows)]
    return weights, labels, centres, width


def figures(seed: int) -> dict:
    """Every heatmap timed here, as plotly JSON, from inputs of `seed`."""
    import plotly.io as pio

    from dashboard import charts
    from dashboard.tokens import CHANNELS

    bins = long_completion_bins(seed)
    made = {"Token inspector, strip": charts.token_overview_strip(bins, "advantage", (0, 511), 512),
            "Token inspector, token x channel": charts.token_channel_bins(bins, list(CHANNELS))}
    algorithms = ["grpo", "dapo", "gspo", "aspo", "ppo"]
    for rows, longest in ((8, 6000), (48, 16_384)):
        weights, labels, centres, width = binned_weights(seed, rows, algorithms, longest)
        made[f"Algorithm weighting, {rows} completions"] = charts.weight_heatmaps(
            weights, labels, positions=centres, bin_width=width)
    weights, labels, centres, width = binned_weights(seed, 8, [f"correction {k}" for k in range(20)], 16_384)
    made["Mismatch, 20 corrections x 8"] = charts.stacked_weight_heatmap(weights, labels, positions=centres,
                                                                         bin_width=width)
    specs = {}
    for name, figure in made.items():
        spec = figure.to_dict()
        spec["layout"].pop("template", None)  # the page's own, as dashboard.figures sends them
        specs[name] = pio.json.to_json_plotly(spec)
    return specs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args(argv)

    import screenshots
    from playwright.sync_api import sync_playwright

    from dashboard import plotly_bundle

    first, other = figures(0), figures(1)
    with sync_playwright() as playwright:
        browser = screenshots.launch_browser(playwright)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_content("<div id=g style='width:1300px'></div>")
        page.add_script_tag(content=plotly_bundle.served_script())
        print(f"  median of {args.repeat} (milliseconds): newPlot, react")
        for name in first:
            new_plots, reacts = [], []
            for _ in range(args.repeat + 1):  # the first draw compiles plotly's code paths: not counted
                new_plots.append(page.evaluate(DRAW, [first[name], DASHBOARD_AXES, False]))
                reacts.append(page.evaluate(DRAW, [other[name], DASHBOARD_AXES, True]))
            print(f"    {name:<40} {statistics.median(new_plots[1:]):6.0f} {statistics.median(reacts[1:]):6.0f}"
                  f"   ({len(first[name]) / 1e3:.0f} kB)", flush=True)
        browser.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
