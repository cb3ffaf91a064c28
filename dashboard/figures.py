"""The dashboard's plotly figures, drawn by plotly.js in the page itself rather than by Streamlit's chart element.

Why: Streamlit's chart element round-trips a figure through JSON to apply its theme, then applies it again once
mounted, which makes plotly draw every figure twice. Measured in chromium on this project's 2-core machine
(docs/benchmarks.md, "Figures drawn by plotly.js itself"): a change that redraws Algorithm weighting's five figures
spent about 1.0 s in the browser through it, 0.35 s this way (2.14 -> 1.46 s in all). Here each figure
is a Streamlit component (`st.components.v2`, in the page's own document, no iframe) that draws it once with
`Plotly.react` (so a rerun with new data updates the plot in place), with a template made from the theme Streamlit
gives components (its text colour, font and chart colours), redrawn when the theme changes. A figure is drawn once
it comes near the visible part of the page (figure.js): a page's figures further down cost the browser nothing until
the user scrolls to them.

plotly.js is the one `dashboard.plotly_bundle` names (its cartesian bundle when fetched at install, else the whole
one shipped inside the installed plotly package), served by Streamlit's static file serving from
`dashboard/static/` (`publish_plotly_js`, called by `dashboard.serve` before the server starts; `policylens
dashboard` turns the serving on). The page loads it once, from this server: nothing is fetched from the internet.
A server without it (static serving off, or a folder it could not write) draws with `st.plotly_chart` instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import plotly.io as pio
import streamlit as st

from dashboard import plotly_bundle

STATIC_DIR = Path(__file__).resolve().parent / "static"
"""Served at <server>/app/static/ when `server.enableStaticServing` is on (Streamlit serves the folder `static`
next to the app's main script)."""
PLOTLY_JS = plotly_bundle.served_name()
"""The name of the served copy: the version in it, so a browser never runs a cached script of another plotly."""

_draw = st.components.v2.component(
    "policylens_figure", js=(Path(__file__).parent / "figure.js").read_text(), isolate_styles=False)
# isolate_styles=False: plotly.js puts its style rules (hover labels, mode bar) in the document's head, which a
# shadow root would not see.


def publish_plotly_js() -> bool:
    """Put `plotly_bundle.served_script()` in `STATIC_DIR` under `PLOTLY_JS` (written to a temporary file, then
    renamed: a server never serves half of it), removing copies of other versions. False when the folder cannot be
    written (a read-only install): figures are then drawn by `st.plotly_chart`."""
    target = STATIC_DIR / PLOTLY_JS
    try:
        STATIC_DIR.mkdir(exist_ok=True)
        for old in STATIC_DIR.glob("plotly-*.min.js"):
            if old.name != PLOTLY_JS:
                old.unlink(missing_ok=True)
        if not target.is_file():
            plotly_bundle.write_whole(target, plotly_bundle.served_script().encode("utf-8"))
    except OSError:
        return False
    return True


def _served_script() -> str | None:
    """plotly.js's URL on this server (absolute path, under the server's base URL), or None when it does not serve
    it."""
    if not (st.get_option("server.enableStaticServing") and (STATIC_DIR / PLOTLY_JS).is_file()):
        return None
    base = (st.get_option("server.baseUrlPath") or "").strip("/")
    return "/" + "/".join(part for part in (base, "app", "static", PLOTLY_JS) if part)


def show(container, figure, key: str, on_click: Callable[[float], None] | None = None,
         config: dict | None = None) -> None:
    """Draw a plotly figure in `container` (st, a column, ...), under a key that stays the same across reruns (so
    the next rerun updates the same plot). `on_click(x)`: called (as a widget callback, before the rerun) with the
    x of a clicked point. `config`: plotly's config (e.g. {"displayModeBar": False})."""
    script = _served_script()
    if script is None:
        def selected() -> None:
            points = st.session_state[key].selection.points
            if points:
                on_click(points[0]["x"])

        container.plotly_chart(figure, key=key, config=config or {},
                               **({"on_select": selected, "selection_mode": "points"} if on_click else {}))
        return
    spec = figure.to_dict()
    spec["layout"].pop("template", None)  # replaced by the theme's in the page (figure.js)
    # The shapes apart: a rerun that moves only a shape (the Token inspector's window on its strip) sends the same
    # figure, which figure.js then leaves drawn and moves the shapes alone (1 ms instead of a 40-80 ms redraw).
    shapes = spec["layout"].pop("shapes", [])
    with contextlib.nullcontext() if container is st else container:
        _draw(data={"figure": pio.json.to_json_plotly(spec), "shapes": pio.json.to_json_plotly(shapes),
                    "config": config or {}, "script": script, "clickable": on_click is not None},
              key=key, **({"on_click_change": lambda: on_click(st.session_state[key].click["x"])} if on_click else {}))
