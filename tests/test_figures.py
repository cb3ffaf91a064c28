"""`dashboard.figures`: the pages' plotly figures drawn by plotly.js in the page (a Streamlit component), with
plotly.js served by the dashboard itself; Streamlit's chart element when the server does not serve it.

Under AppTest: what each way sends (the figure's JSON, plotly.js's URL). In chromium (slow): every figure of a page
drawn by the served plotly.js (one further down once scrolled to), a click on the Token inspector's strip moving its
window, a figure shown full screen and back, the figures following the theme (light or dark, as the browser asks),
and a Groups completion's link to its tokens."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import plotly
import plotly.graph_objects as go
import pytest
from streamlit import config
from streamlit.testing.v1 import AppTest

from dashboard import figures, plotly_bundle

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
GENEROUS_MS = 300_000  # as tests/test_browser.py: what is drawn is checked, not how fast


def test_plotly_js_is_published_under_its_version_and_older_copies_go(tmp_path, monkeypatch):
    monkeypatch.setattr(figures, "STATIC_DIR", tmp_path / "static")
    (tmp_path / "static").mkdir()
    (tmp_path / "static" / "plotly-0.0.1.min.js").write_text("an older plotly")
    assert figures.publish_plotly_js()
    assert [p.name for p in (tmp_path / "static").iterdir()] == [figures.PLOTLY_JS]
    assert (tmp_path / "static" / figures.PLOTLY_JS).read_text() == plotly_bundle.served_script()
    version = plotly.offline.get_plotlyjs_version()
    assert figures.PLOTLY_JS.removeprefix("plotly-").removeprefix("cartesian-").removesuffix(".min.js") == version


def test_a_folder_that_cannot_be_made_is_reported_not_raised(tmp_path, monkeypatch):
    (tmp_path / "a file").write_text("")
    monkeypatch.setattr(figures, "STATIC_DIR", tmp_path / "a file" / "static")  # (even root cannot make this one)
    assert not figures.publish_plotly_js()


def draw_two(static: bool, base_url: str = "") -> AppTest:
    def app():
        import plotly.graph_objects as go
        import streamlit as st

        from dashboard import figures

        figures.show(st, go.Figure(go.Scatter(x=[1, 2, 3], y=[4, 5, 6], name="<b>a</b>")), key="line")
        _, right = st.columns(2)
        figures.show(right, go.Figure(go.Bar(y=[1, 2])), key="bars", on_click=lambda x: None,
                     config={"displayModeBar": False})

    previous = (config.get_option("server.enableStaticServing"), config.get_option("server.baseUrlPath"))
    config.set_option("server.enableStaticServing", static)
    config.set_option("server.baseUrlPath", base_url)
    try:
        at = AppTest.from_function(app).run()
    finally:
        config.set_option("server.enableStaticServing", previous[0])
        config.set_option("server.baseUrlPath", previous[1])
    assert not at.exception, [e.message for e in at.exception]
    return at


def test_a_served_figure_is_its_json_without_plotly_py_template_and_the_script_url():
    figures.publish_plotly_js()
    at = draw_two(static=True)
    assert not at.get("plotly_chart")
    drawn = {e.proto.id.rsplit("-", 1)[-1]: json.loads(e.proto.json) for e in at.get("bidi_component")}
    assert set(drawn) == {"line", "bars"}
    expected = go.Figure(go.Scatter(x=[1, 2, 3], y=[4, 5, 6], name="<b>a</b>")).to_dict()
    expected["layout"].pop("template")  # the page's theme replaces it (figure.js)
    assert json.loads(drawn["line"]["figure"]) == json.loads(json.dumps(expected))
    assert drawn["line"]["script"] == f"/app/static/{figures.PLOTLY_JS}"
    assert (drawn["line"]["clickable"], drawn["bars"]["clickable"]) == (False, True)
    assert drawn["bars"]["config"] == {"displayModeBar": False}
    # Under a base URL the script is found under it too.
    at = draw_two(static=True, base_url="/policylens/")
    assert json.loads(at.get("bidi_component")[0].proto.json)["script"] == f"/policylens/app/static/{figures.PLOTLY_JS}"


def test_without_static_serving_streamlit_draws_the_same_figures():
    at = draw_two(static=False)
    assert not at.get("bidi_component")
    charts = {c.proto.id.rsplit("-", 1)[-1]: c.proto for c in at.get("plotly_chart")}
    assert set(charts) == {"line", "bars"}
    assert json.loads(charts["line"].spec)["data"][0]["y"] == [4, 5, 6]
    assert list(charts["bars"].selection_mode)  # the click callback, through Streamlit's point selection


@pytest.mark.slow
@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"no chromium at {CHROMIUM} (apt-get install chromium)")
def test_in_a_browser_the_served_plotly_draws_figures_once_in_sight_a_click_moves_the_window_the_theme_follows(
        tmp_path):
    import screenshots  # scripts/screenshots.py (pytest's pythonpath)
    from playwright.sync_api import sync_playwright
    from test_token_inspector_long import write_run

    write_run(str(tmp_path), "long", sampler=True)  # rollout 0: 5,000 tokens, shown 512 at a time
    with screenshots.serve_dashboard(tmp_path) as url, sync_playwright() as playwright:
        browser = screenshots.launch_browser(playwright)
        # A screen low enough that the heatmap is out of sight whether or not the text above it is drawn yet: the
        # text's component may mount after the heatmap's on a busy machine, and a figure in sight is drawn at once.
        page = browser.new_page(viewport={"width": 1400, "height": 600})
        page.set_default_timeout(GENEROUS_MS)
        page.goto(f"{url}/tokens?run=long&step=0&rollout=0")
        screenshots.wait_until_rendered(page, GENEROUS_MS)
        # The strip is drawn; the whole completion's heatmap, further down, only once it is scrolled to.
        page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length >= 1")
        page.wait_for_selector("span.pl-token")
        # Each token's hover text is written in the page (token_spans.js): a rejected token's names its rejection,
        # no other's does.
        hovers = page.eval_on_selector_all("span.pl-token", "s => s.map(e => [e.dataset.rejected, e.title])")
        struck = [title for code, title in hovers if code != "0"]
        assert struck and all(re.search(r"^rejected: (token|sequence)$", t, re.M) for t in struck)
        assert not any("rejected:" in title for code, title in hovers if code == "0")
        heatmap = page.locator(".policylens-figure").last
        assert heatmap.evaluate("gd => !gd._fullLayout && gd.getBoundingClientRect().top > window.innerHeight + 200")
        assert heatmap.evaluate("gd => gd.getBoundingClientRect().height") >= 300  # its place kept meanwhile
        heatmap.scroll_into_view_if_needed()
        page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length >= 2")
        scripts = page.eval_on_selector_all("script[src]", "s => s.map(e => new URL(e.src).pathname)")
        assert f"/app/static/{figures.PLOTLY_JS}" in scripts
        assert set(plotly_bundle.TRACE_TYPES) <= set(page.evaluate("Object.keys(Plotly.PlotSchema.get().traces)"))
        assert page.locator("[data-testid='stPlotlyChart']").count() == 0  # not Streamlit's chart element
        assert page.locator(".policylens-figure.js-plotly-plot").count() == page.locator(".js-plotly-plot").count()

        # A click on the strip where tokens 2048-2559 are: the window moves there, the text shows them.
        assert page.locator("span.pl-token").first.get_attribute("data-position") == "0"
        strip = page.locator(".policylens-figure.js-plotly-plot").first
        strip.scroll_into_view_if_needed()  # back up to it
        x, y = strip.evaluate("""gd => {  // token 2300 on the strip's upper line (the cells), in the page's pixels
            const {xaxis, yaxis} = gd._fullLayout, box = gd.getBoundingClientRect();
            return [box.left + xaxis._offset + xaxis.l2p(2300), box.top + yaxis._offset + yaxis._length / 2];
        }""")
        strip.evaluate("gd => { window.stripDrawn = gd.calcdata; }")
        page.mouse.move(x, y)
        page.mouse.click(x, y)
        page.wait_for_function(
            "document.querySelector('span.pl-token')?.getAttribute('data-position') === '2048'")
        assert "window=2048" in page.url
        # The strip's outline follows the window, moved alone: the strip itself is not drawn again.
        page.wait_for_function("document.querySelector('.policylens-figure')._fullLayout.shapes[0].x0 === 2047.5")
        assert strip.evaluate("gd => gd.calcdata === window.stripDrawn")
        # The window's table of values is sent once its expander is opened.
        assert page.locator("[data-testid='stDataFrame']").count() == 0
        page.get_by_text("Values of the tokens shown").click()
        page.wait_for_selector("[data-testid='stDataFrame']")

        # Full screen, as Streamlit's chart element offered: the figure takes the screen's height, then its own.
        height = heatmap.evaluate("gd => gd._fullLayout.height")
        heatmap.hover()
        heatmap.locator("[data-title='Full screen (Esc to leave)']").click()
        page.wait_for_function("document.fullscreenElement?._fullLayout?.height === window.innerHeight")
        page.evaluate("document.exitFullscreen()")
        page.wait_for_function("h => !document.fullscreenElement && "
                               "[...document.querySelectorAll('.policylens-figure')].pop()._fullLayout.height === h",
                               arg=height)

        # The theme: the figures' text takes the dark theme's colour when the browser asks for dark.
        strip.scroll_into_view_if_needed()  # (a figure out of sight is redrawn when it comes back)
        light = strip.evaluate("gd => gd._fullLayout.font.color")
        page.emulate_media(color_scheme="dark")
        page.wait_for_function("c => document.querySelector('.policylens-figure')._fullLayout.font.color !== c",
                               arg=light)
        brightness = """gd => {  // the sum of the red, green and blue of the figure's text colour
            const probe = document.createElement("div");
            probe.style.color = gd._fullLayout.font.color;
            document.body.appendChild(probe);
            const rgb = getComputedStyle(probe).color.match(/[0-9.]+/g).slice(0, 3).map(Number);
            probe.remove();
            return rgb[0] + rgb[1] + rgb[2];
        }"""
        assert strip.evaluate(brightness) > 3 * 160  # light text on the dark background
        page.emulate_media(color_scheme="light")
        page.wait_for_function("c => document.querySelector('.policylens-figure')._fullLayout.font.color === c",
                               arg=light)
        assert strip.evaluate(brightness) < 3 * 100

        # Groups' completions (dashboard.group_view): a "tokens" link opens that completion in the Token inspector,
        # in the same document (a page switch of the session, not a new load of the app).
        page.goto(f"{url}/groups?run=long&step=0")
        screenshots.wait_until_rendered(page, GENEROUS_MS)
        link = page.locator("a.pl-completion-link").last
        rollout = parse_qs(urlparse(link.get_attribute("href")).query)["rollout"][0]
        page.evaluate("window.sameDocument = true")
        link.click()
        page.wait_for_function("r => location.pathname.endsWith('/tokens') && "
                               "new URLSearchParams(location.search).get('rollout') === r", arg=rollout)
        page.get_by_role("heading", name="Token inspector").wait_for()
        assert page.evaluate("window.sameDocument === true")

        # A page whose figures are all out of sight (PRM steps' sandbox, under its table, on a low screen) still
        # fetches and runs plotly.js once idle: the first figure scrolled to does not wait for it.
        low = browser.new_page(viewport={"width": 1400, "height": 300})
        low.set_default_timeout(GENEROUS_MS)
        low.goto(f"{url}/prm?run=long&step=0")
        low.locator(".policylens-figure").last.wait_for(state="attached")
        low.wait_for_function("window.Plotly !== undefined")
        assert low.locator(".js-plotly-plot").count() == 0  # none drawn
        browser.close()


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"no chromium at {CHROMIUM} (apt-get install chromium)")
def test_a_trace_type_the_served_plotly_lacks_is_a_problem_of_the_page():
    """plotly.js draws a trace of a type it was built without as an empty scatter and says nothing: the browser
    tests' `page_problems` says it (the cartesian bundle has no 3D)."""
    import screenshots
    from browser_widgets import page_problems
    from playwright.sync_api import sync_playwright

    assert plotly_bundle.served_name().startswith("plotly-cartesian-")
    with sync_playwright() as playwright:
        browser = screenshots.launch_browser(playwright)
        page = browser.new_page()
        page.set_content("<div id='g' style='width:400px;height:300px'></div>")
        page.add_script_tag(content=plotly_bundle.served_script())
        page.evaluate("""() => Plotly.newPlot('g', [{type: 'heatmap', z: [[1, 2]]}, {y: [1, 3]},
                                                    {type: 'scatter3d', x: [1], y: [1], z: [1]}])""")
        assert page_problems(page) == ["a scatter3d trace drawn as scatter: the served plotly.js lacks the type"]
        browser.close()
