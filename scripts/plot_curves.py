"""Draw the held-out accuracy of logged runs for the README, with the dashboard's own figure function.

    python scripts/plot_curves.py --logs-dir logs grpo=GRPO dapo=DAPO gspo=GSPO aspo=ASPO -o docs/curves.png
    python scripts/plot_curves.py --logs-dir logs grpo dapo --sampled --html docs/curves.html

The chart is `dashboard.charts.metric_curves`, the one the Runs and Replay pages draw, so the README looks like the
app. The PNG is exported by kaleido (in the dev extra) through the Chrome or Chromium installed on the machine; it
never downloads a browser. Without one on PATH, point BROWSER_PATH at it (e.g. BROWSER_PATH=/usr/bin/chromium).
Each run gives one line of greedy held-out accuracy at its evaluated steps (step 0 is the warm start); --sampled
adds a panel with the sampled accuracy.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WIDTH, HEIGHT = 1000, 560
METRICS = [("heldout_accuracy", "held-out accuracy (greedy)")]
SAMPLED = ("heldout_accuracy_sampled", "held-out accuracy (sampled)")


def load_steps(logs_dir: str, specs: list[str]):
    """The evaluated steps of each run as one frame (run renamed to its label for RUN=LABEL specs)."""
    import pandas as pd

    from engine.runlog import RunReader

    frames = []
    with RunReader(logs_dir) as reader:
        known = set(reader.run_names())
        for spec in specs:
            run, _, label = spec.partition("=")
            if run not in known:
                raise SystemExit(f"no run {run!r} in {logs_dir} (runs: {', '.join(sorted(known)) or 'none'})")
            frame = reader.sql(
                "SELECT step, heldout_accuracy, heldout_accuracy_sampled FROM steps "
                "WHERE run = ? AND heldout_accuracy IS NOT NULL ORDER BY step", [run])
            if frame.empty:
                raise SystemExit(f"run {run!r} has no held-out evaluation logged yet")
            frames.append(frame.assign(run=label or run))
    return pd.concat(frames, ignore_index=True)


def curves_figure(steps, title: str, sampled: bool = False):
    """The dashboard's metric curves of held-out accuracy, titled and sized for a README image."""
    from dashboard.charts import metric_curves

    figure = metric_curves(steps, METRICS + ([SAMPLED] if sampled else []))
    figure.update_layout(title={"text": title, "x": 0.5, "xanchor": "center", "y": 0.98},
                         width=WIDTH, height=HEIGHT, margin={"t": 110, "b": 60}, template="plotly_white")
    figure.update_yaxes(tickformat=".0%", rangemode="tozero")
    figure.update_xaxes(title={"text": "training step"})
    return figure


def export_png(figure, path: Path, width: int = WIDTH, height: int = HEIGHT) -> None:
    """Write the figure as a PNG (width x height pixels) with kaleido, offline: no MathJax (fetched from a CDN
    otherwise), plotly.js from the installed plotly package."""
    try:
        import kaleido
        from choreographer.errors import ChromeNotFoundError
    except ImportError:
        raise SystemExit("exporting a PNG needs kaleido: pip install -e '.[dev]'") from None
    try:
        png = kaleido.calc_fig_sync(figure, opts={"format": "png", "width": width, "height": height},
                                    kopts={"mathjax": False})
    except ChromeNotFoundError:
        raise SystemExit("kaleido found no Chrome or Chromium: install one (apt-get install chromium) or set "
                         "BROWSER_PATH to its executable") from None
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(png)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="run names, optionally RUN=LABEL to rename a run in the legend")
    ap.add_argument("--logs-dir", default="logs")
    ap.add_argument("-o", "--output", default="curves.png", help="PNG file to write")
    ap.add_argument("--html", help="also write the interactive chart here (plotly's JavaScript embedded)")
    ap.add_argument("--sampled", action="store_true", help="add a panel with the sampled accuracy")
    ap.add_argument("--title", default="Held-out accuracy on the default task (step 0 = warm start)")
    args = ap.parse_args(argv)

    figure = curves_figure(load_steps(args.logs_dir, args.runs), args.title, args.sampled)
    export_png(figure, Path(args.output))
    print(f"wrote {args.output}")
    if args.html:
        figure.write_html(args.html, include_plotlyjs=True)
        print(f"wrote {args.html}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
