"""Plot held-out accuracy curves of logged runs into a PNG (and optionally an interactive HTML page).

    python scripts/plot_curves.py --logs-dir logs grpo dapo gspo aspo -o docs/curves.png
    python scripts/plot_curves.py --logs-dir logs grpo dapo --x wall_time --sampled --html docs/curves.html

The PNG is drawn with Pillow (installed with streamlit), so no browser, kaleido or matplotlib is needed; the
optional HTML uses plotly. Each run gives one line: greedy held-out accuracy at every evaluated step (step 0 is
the warm start), plus the sampled accuracy as a dashed line with --sampled.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#7f7f7f"]
WIDTH, HEIGHT = 1000, 620
MARGIN = dict(left=70, right=200, top=80, bottom=70)


def load_curves(logs_dir: str, runs: list[str], x: str) -> dict[str, dict[str, list[float]]]:
    """run -> {"x": [...], "greedy": [...], "sampled": [...]} for the evaluated steps, in step order."""
    from engine.runlog import RunReader

    curves = {}
    with RunReader(logs_dir) as reader:
        known = set(reader.run_names())
        for spec in runs:
            run, _, label = spec.partition("=")
            if run not in known:
                raise SystemExit(f"no run {run!r} in {logs_dir} (runs: {', '.join(sorted(known)) or 'none'})")
            df = reader.sql(
                f"SELECT {x} AS x, heldout_accuracy AS greedy, heldout_accuracy_sampled AS sampled FROM steps "
                "WHERE run = ? AND heldout_accuracy IS NOT NULL ORDER BY step",
                [run],
            )
            curves[label or run] = {k: df[k].astype(float).tolist() for k in ("x", "greedy", "sampled")}
    return curves


def _font(size: int):
    from PIL import ImageFont

    for name in ("DejaVuSans.ttf", "Arial.ttf", "LiberationSans-Regular.ttf"):
        try:
            return ImageFont.truetype(name, size)
        except OSError:
            continue
    try:
        return ImageFont.load_default(size=size)  # Pillow >= 10.1
    except TypeError:
        return ImageFont.load_default()


def _nice_ticks(lo: float, hi: float, n: int = 6) -> list[float]:
    span = (hi - lo) or 1.0
    raw = span / n
    mag = 10 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw), default=10 * mag)
    start = math.ceil(lo / step) * step
    return [start + i * step for i in range(int((hi - start) / step) + 1)]


def draw_png(curves, path: Path, title: str, x_label: str, sampled: bool) -> None:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (WIDTH, HEIGHT), "white")
    d = ImageDraw.Draw(img)
    f_small, f_mid, f_big = _font(14), _font(16), _font(20)
    x0, x1 = MARGIN["left"], WIDTH - MARGIN["right"]
    y0, y1 = HEIGHT - MARGIN["bottom"], MARGIN["top"]
    xs = [v for c in curves.values() for v in c["x"]]
    x_lo, x_hi = 0.0, max(xs) if xs else 1.0
    values = [v for c in curves.values() for k in ("greedy", "sampled") for v in c[k] if not math.isnan(v)]
    y_lo, y_hi = 0.0, min(1.0, max(0.1, math.ceil((max(values) if values else 1.0) * 10 + 0.5) / 10))

    def px(x):
        return x0 + (x - x_lo) / ((x_hi - x_lo) or 1) * (x1 - x0)

    def py(y):
        return y0 - (y - y_lo) / ((y_hi - y_lo) or 1) * (y0 - y1)

    for t in _nice_ticks(y_lo, y_hi, 5):
        d.line([(x0, py(t)), (x1, py(t))], fill="#e5e5e5")
        d.text((x0 - 8, py(t)), f"{t:.0%}", fill="black", font=f_small, anchor="rm")
    for t in _nice_ticks(x_lo, x_hi, 8):
        d.line([(px(t), y0), (px(t), y1)], fill="#f0f0f0")
        d.text((px(t), y0 + 8), f"{t:g}", fill="black", font=f_small, anchor="mt")
    d.rectangle([x0, y1, x1, y0], outline="black")
    d.text(((x0 + x1) / 2, 20), title, fill="black", font=f_big, anchor="mt")
    d.text(((x0 + x1) / 2, HEIGHT - 25), x_label, fill="black", font=f_mid, anchor="mm")
    d.text((x0, y1 - 8), "held-out accuracy", fill="black", font=f_mid, anchor="ld")

    legend_y = y1 + 10
    for i, (run, c) in enumerate(curves.items()):
        color = COLORS[i % len(COLORS)]
        pts = [(px(x), py(y)) for x, y in zip(c["x"], c["greedy"], strict=True) if not math.isnan(y)]
        if len(pts) > 1:
            d.line(pts, fill=color, width=3, joint="curve")
        for p in pts:
            d.ellipse([p[0] - 3, p[1] - 3, p[0] + 3, p[1] + 3], fill=color)
        if sampled:
            spts = [(px(x), py(y)) for x, y in zip(c["x"], c["sampled"], strict=True) if not math.isnan(y)]
            for a, b in itertools.pairwise(spts):  # dashed: draw every other sixth of a segment
                for k in range(0, 6, 2):
                    d.line([(a[0] + (b[0] - a[0]) * k / 6, a[1] + (b[1] - a[1]) * k / 6),
                            (a[0] + (b[0] - a[0]) * (k + 1) / 6, a[1] + (b[1] - a[1]) * (k + 1) / 6)],
                           fill=color, width=2)
        if not c["greedy"]:
            raise SystemExit(f"run {run!r} has no held-out evaluation logged yet")
        start, end = c["greedy"][0], c["greedy"][-1]
        d.line([(x1 + 15, legend_y + 8), (x1 + 45, legend_y + 8)], fill=color, width=3)
        d.text((x1 + 52, legend_y), run, fill="black", font=f_mid)
        d.text((x1 + 52, legend_y + 19), f"{start:.0%} -> {end:.0%}", fill="#555555", font=f_small)
        legend_y += 46
    if sampled:
        d.text((x1 + 15, legend_y + 4), "solid: greedy\ndashed: sampled", fill="#555555", font=f_small)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)


def write_html(curves, path: Path, title: str, x_label: str, sampled: bool) -> None:
    import plotly.graph_objects as go

    fig = go.Figure()
    for i, (run, c) in enumerate(curves.items()):
        color = COLORS[i % len(COLORS)]
        fig.add_scatter(x=c["x"], y=c["greedy"], name=f"{run} (greedy)", mode="lines+markers", line_color=color)
        if sampled:
            fig.add_scatter(x=c["x"], y=c["sampled"], name=f"{run} (sampled)", mode="lines",
                            line=dict(color=color, dash="dash"))
    fig.update_layout(title=title, xaxis_title=x_label, yaxis_title="held-out accuracy", yaxis_tickformat=".0%",
                      template="plotly_white")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.write_html(path, include_plotlyjs="cdn")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="run names, optionally RUN=LABEL to rename a run in the legend")
    ap.add_argument("--logs-dir", default="logs")
    ap.add_argument("-o", "--output", default="curves.png", help="PNG file to write")
    ap.add_argument("--html", help="also write an interactive plotly HTML page here")
    ap.add_argument("--x", choices=("step", "wall_time"), default="step", help="x axis (default: step)")
    ap.add_argument("--sampled", action="store_true", help="also draw the sampled accuracy (dashed)")
    ap.add_argument("--title", default="Held-out accuracy on the default task (step 0 = warm start)")
    args = ap.parse_args(argv)

    curves = load_curves(args.logs_dir, args.runs, args.x)
    x_label = "training step" if args.x == "step" else "wall time (s)"
    draw_png(curves, Path(args.output), args.title, x_label, args.sampled)
    print(f"wrote {args.output}")
    if args.html:
        write_html(curves, Path(args.html), args.title, x_label, args.sampled)
        print(f"wrote {args.html}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
