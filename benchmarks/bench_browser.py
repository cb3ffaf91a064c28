"""What a user feels: the dashboard in headless chromium, from an action to the page drawn and idle.

    python benchmarks/bench_browser.py                        # the runs benchmarks/bench_dashboard.py built
    python benchmarks/bench_browser.py --run bench-40x64x8x650 --repeat 5

Serves the dashboard (`policylens dashboard` on a free loopback port) over `--logs-dir` and drives Debian's chromium
with Playwright (set CHROMIUM for another binary), through the widget driver of the browser tests
(scripts/browser_widgets.py): an action is done once the server reported its script run finished, no run is under
way, nothing is shown as loading, and the document did not change for a moment; its time is the document's last
change minus the moment of the action. A page load that shows an exception or an error box stops the benchmark (its
figures would be those of the error page); a widget change that shows one, or a widget that cannot be changed (a
click that times out), ends that page's repetition, is reported at the end, and the benchmark goes on. Measured,
medians of `--repeat` (browser, server and DuckDB share the machine, as they would on a laptop):
- first load: a page opened in a new tab (new browser context) of a server started for it (nothing imported or
  cached yet, as on a user's first visit), from navigation start; with `--returning-browser`, in a new tab of a
  browser that opened every measured page twice before on the same address (as a user's browser the next time:
  Streamlit's scripts and plotly.js come from its cache, compiled);
- reload: the same tab reloaded (server and browser warm);
- interactions: every widget of every page changed in turn (another option, a key press on a slider, a click, a
  new cell value), as the browser test does; the sidebar's run excepted; on the Token inspector first the text's
  window moved three times (on a completion longer than one window; also timed from the key press itself, without
  the driver finding and focusing the slider first); Replay's player, once its Play is measured, is turned off
  again, untimed, so that no tick of it lands in the next changes;
- the step after a look: the sidebar's step slider moved by one key press `LOOK_S` seconds after the last change
  (a user reading the page; the pages that compute the neighbouring steps meanwhile, dashboard.prefetch, use it).
The run's middle step is used (a step inside the largest compacted chunk, not the small newest folder); the Token
inspector opens on the run's longest completion, at its step.
For the loads, the window moves and every interaction, the part until the server's last message is reported too
(the server's script run and the transfer of what it drew, for a load after the browser loaded the app and
connected): the rest is the browser drawing.
Targets (issue 12): interaction < 0.5 s, first page < 3 s, reload < 1.5 s.

    python benchmarks/bench_browser.py --floor --repeat 5

measures instead what Streamlit itself costs on this machine, with no PolicyLens code: the first load and the
reload of a page holding only a header and a line of text, and of one holding one small plotly chart, each on a
server started for it, in the same browser and by the same clock as the pages above.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))  # the widget driver and the server of the browser tests
import browser_widgets as widgets  # noqa: E402  (found through the path above)
import screenshots  # noqa: E402

PAGES = {"runs": "", "replay": "replay", "groups": "groups", "tokens": "tokens", "prm steps": "prm",
         "weighting": "weighting", "trajectories": "trajectories", "token stats": "token-stats",
         "advantages": "advantages", "mismatch": "mismatch"}
PAGE_FILES = {"runs": "runs.py", "replay": "replay.py", "groups": "groups.py", "tokens": "token_inspector.py",
              "prm steps": "prm_steps.py", "weighting": "algorithm_weighting.py",
              "trajectories": "token_trajectories.py", "token stats": "token_stats.py",
              "advantages": "advantages.py", "mismatch": "mismatch.py"}
"""The file of each page in dashboard/app_pages/ (for `--figures`, which runs a page in Streamlit's AppTest)."""



LOAD_TIMEOUT_S = 300  # a page load waits this long before failing (the first one imports torch on a busy machine)


class PageError(RuntimeError):
    """The page showed an exception or an error box: its timings would be those of the error."""


def checked(page, watch, what: str) -> None:
    problems = watch.take_problems() + widgets.page_problems(page)
    if problems:
        raise PageError(f"{what}: {problems}")


def load(page, watch, url: str) -> tuple[float, float]:
    """(seconds from the navigation start to the page's last change once idle, seconds to the server's last
    message: its script run and the transfer of what it drew, after the browser loaded the app and connected)."""
    before, started = watch.count(), time.monotonic()
    page.goto(url, wait_until="commit")
    widgets.wait_idle(page, watch, before, timeout_s=LOAD_TIMEOUT_S, quiet_ms=widgets.LOAD_QUIET_MS)
    checked(page, watch, url)
    # performance.now() counts from the navigation start
    return page.evaluate("window.__lastChange") / 1000, watch.last_message - started


def reload(page, watch) -> tuple[float, float]:
    """As `load`, for the same tab reloaded."""
    before, started = watch.count(), time.monotonic()
    page.reload(wait_until="commit")
    widgets.wait_idle(page, watch, before, timeout_s=LOAD_TIMEOUT_S, quiet_ms=widgets.LOAD_QUIET_MS)
    checked(page, watch, f"reload of {page.url}")
    return page.evaluate("window.__lastChange") / 1000, watch.last_message - started


def move_the_window(page, watch, times: int) -> list[tuple[float, float, float]]:
    """Seconds to show the next window of a long completion's text in the Token inspector (a key press on its
    window slider), to the server's last message, and to show it from the key press itself (without the 70-90 ms
    the driver takes to find and focus the slider first), `times` in a row; none when the completion fits in one
    window."""
    seconds = []
    for _ in range(times):
        slider = next((w for w in widgets.find_widgets(page) if w["name"] == 'main: stSlider "Tokens shown"'), None)
        if slider is None:
            break
        before, started, clock = watch.count(), page.evaluate("performance.now()"), time.monotonic()
        widgets.change(page, slider)
        widgets.wait_idle(page, watch, before)
        checked(page, watch, "moving the Token inspector's window")
        last, key = page.evaluate("[window.__lastChange, window.__lastKey]")
        seconds.append((max(last - started, 0.0) / 1000, watch.last_message - clock, max(last - key, 0.0) / 1000))
    return seconds


def server_memory_mb(port: int) -> float | None:
    """Peak resident memory (VmHWM) of the streamlit process serving `port`."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"streamlit" in b" ".join(args) and str(port).encode() in args:
            for line in (cmdline.parent / "status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    return None


RUN_PICKER = 'sidebar: stSelectbox "Run"'
STEP_SLIDER = 'sidebar: stSlider "Step"'
LOOK_S = 5.0
"""How long a user looks at a page before moving the step by one, in `step_after_a_look`."""


def step_after_a_look(page, watch) -> tuple[float, float]:
    """The step slider moved by one key press `LOOK_S` seconds after the page came to rest (the interactions
    above press at once): the time the server had meanwhile to compute the neighbouring steps (dashboard.prefetch)
    is what a user reading the page gives it. (seconds to idle, seconds to the server's last message)"""
    time.sleep(LOOK_S)
    slider = next(w for w in widgets.find_widgets(page) if w["name"] == STEP_SLIDER)
    before, started, clock = watch.count(), page.evaluate("performance.now()"), time.monotonic()
    widgets.change(page, slider)
    widgets.wait_idle(page, watch, before)
    checked(page, watch, "moving the step after a look")
    return max(page.evaluate("window.__lastChange") - started, 0.0) / 1000, watch.last_message - clock


PLAY = 'main: stCheckbox "Play"'


def stop_playing(page, watch) -> None:
    """Turn Replay's player off (the widget driver turned it on; on a long run it would still be playing)."""
    toggle = next((w for w in widgets.find_widgets(page) if w["name"] == PLAY), None)
    if toggle is not None:
        before = watch.count()
        widgets.change(page, toggle)
        widgets.wait_idle(page, watch, before)


def record(results: dict[str, list[float]], name: str, seconds: float) -> None:
    results.setdefault(name, []).append(seconds)
    print(f"    {name:<34} {seconds:6.2f} s", flush=True)


def record_split(results: dict[str, list[float]], name: str, seconds: tuple[float, float]) -> None:
    """The whole action, and its server part (until the server's last message; the rest: the browser)."""
    record(results, name, seconds[0])
    record(results, f"{name}, server part", seconds[1])


FLOOR_APPS = {  # name -> the whole app
    "a header and a line of text": 'import streamlit as st\nst.header("Floor")\nst.write("One line of text.")\n',
    "one plotly chart (100 points)": 'import plotly.graph_objects as go\nimport streamlit as st\nst.header("Floor")\n'
                                     "st.plotly_chart(go.Figure(go.Scatter(y=list(range(100)))))\n",
}


def streamlit_alone(app: Path, port: int) -> list[str]:
    """The command line serving `app` with the dashboard's server options, by Streamlit alone (no PolicyLens
    warm-up, no logs folder)."""
    from engine.cli import dashboard_command

    command = dashboard_command(str(app.parent), "127.0.0.1", port)
    command[command.index("run") + 1] = str(app)
    command[1:command.index("run")] = ["-m", "streamlit"]
    return command[:command.index("--")]


def measure_floor(repeat: int) -> dict[str, list[float]]:
    """First load and reload of each FLOOR_APPS app, `repeat` times, each time on a server started for it with the
    dashboard's server options."""
    import tempfile

    from playwright.sync_api import sync_playwright

    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as folder, sync_playwright() as playwright:
        browser = screenshots.launch_browser(playwright)
        for _ in range(repeat):
            for name, source in FLOOR_APPS.items():
                app = Path(folder) / "app.py"
                app.write_text(source)
                port = screenshots.free_port()
                with screenshots.serve(streamlit_alone(app, port), port, LOAD_TIMEOUT_S) as url:
                    context = browser.new_context(viewport={"width": 1400, "height": 1000})
                    page = context.new_page()
                    watch = widgets.ServerWatch().attach(page)
                    record_split(results, f"first load (fresh server): {name}", load(page, watch, url))
                    record_split(results, f"reload: {name}", reload(page, watch))
                    context.close()
        browser.close()
    return results


FIGURES_APP = """import os, pathlib
import plotly.io as pio
import streamlit as st
from dashboard import figures
st.header("Figures")
theme = {"streamlit": "streamlit", "none": None}.get(st.query_params.get("theme", "streamlit"), "streamlit")
for path in sorted(pathlib.Path(os.environ["FIGURES_DIR"]).glob("*.json"), key=lambda p: int(p.stem)):
    if st.query_params.get("figures", "all") in ("all", path.stem):
        if st.query_params.get("element") == "dashboard":
            figures.show(st, pio.from_json(path.read_text()), key=path.stem)
        else:
            st.plotly_chart(pio.from_json(path.read_text()), key=path.stem, theme=theme)
"""
"""The app of `--figures`: the figures (Plotly JSON files) of a folder, all of them or one (?figures=K), each drawn
by Streamlit's chart element (`st.plotly_chart`, with Streamlit's theme or without it: ?theme=none) or as the
dashboard draws it (?element=dashboard: `dashboard.figures.show`, plotly.js served by this app)."""

BARE_PLOTLY_DRAW = """async (spec) => { const f = JSON.parse(spec); const t = performance.now();
    Plotly.purge('g'); await Plotly.newPlot('g', f.data, f.layout, {});
    await new Promise(r => requestAnimationFrame(() => setTimeout(r, 0))); return performance.now() - t; }"""


def page_figures(logs_dir: Path, run: str, step: int, longest: tuple[int, int], page_name: str) -> list[str]:
    """The Plotly JSON of every figure a page draws on its first visit (run in Streamlit's AppTest)."""
    import os

    from streamlit.testing.v1 import AppTest

    os.environ["POLICYLENS_LOGS_DIR"] = str(logs_dir)
    app = AppTest.from_file(str(ROOT / "dashboard" / "streamlit_app.py"), default_timeout=LOAD_TIMEOUT_S)
    app.query_params["run"] = run
    app.query_params["step"] = str(longest[0] if page_name == "tokens" else step)
    if page_name == "tokens":
        app.query_params["rollout"] = str(longest[1])
    app.run()
    app.switch_page(f"app_pages/{PAGE_FILES[page_name]}").run()
    if app.exception:
        raise PageError(f"{page_name}: {[e.message for e in app.exception]}")
    return [chart.proto.spec for chart in app.get("plotly_chart")]


def measure_figures(logs_dir: Path, run: str, step: int, longest: tuple[int, int], page_name: str,
                    repeat: int) -> dict[str, list[float]]:
    """Where a page's browser time goes: its figures (`page_figures`) reloaded in an app of nothing else
    (`FIGURES_APP`: all of them by Streamlit's chart element with its theme, without it, as the dashboard draws them
    (`dashboard.figures`), each alone both ways, and none: the header only), and each drawn by bare Plotly
    (`Plotly.newPlot` of plotly.py's own plotly.min.js in an empty page), in the same browser, `repeat` times."""
    import os
    import shutil
    import tempfile

    import plotly
    from playwright.sync_api import sync_playwright

    from dashboard import figures

    figures.publish_plotly_js()
    specs = page_figures(logs_dir, run, step, longest, page_name)
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as folder, sync_playwright() as playwright:
        for k, spec in enumerate(specs):
            (Path(folder) / f"{k}.json").write_text(spec)
            print(f"    figure {k}: {len(spec) / 1e3:.0f} kB of JSON", flush=True)
        app = Path(folder) / "app.py"
        app.write_text(FIGURES_APP)
        (Path(folder) / "static").mkdir()  # what `dashboard.figures.show` loads plotly.js from, as the dashboard
        shutil.copy(figures.STATIC_DIR / figures.PLOTLY_JS, Path(folder) / "static")
        port = screenshots.free_port()
        os.environ["FIGURES_DIR"] = folder
        browser = screenshots.launch_browser(playwright)
        variants = {"no figure (the header only)": "figures=none", f"all {len(specs)} figures": "figures=all",
                    f"all {len(specs)} figures, theme=None": "figures=all&theme=none",
                    f"all {len(specs)} figures, as the dashboard draws them": "figures=all&element=dashboard",
                    **{f"figure {k} alone": f"figures={k}" for k in range(len(specs))},
                    **{f"figure {k} alone, as the dashboard": f"figures={k}&element=dashboard"
                       for k in range(len(specs))}}
        command = [*streamlit_alone(app, port), "--server.enableStaticServing", "true"]
        with screenshots.serve(command, port, LOAD_TIMEOUT_S) as url:
            context = browser.new_context(viewport={"width": 1400, "height": 1000})
            page = context.new_page()
            watch = widgets.ServerWatch().attach(page)
            load(page, watch, f"{url}/?figures=all")  # Streamlit's and plotly's scripts fetched once, untimed
            for _ in range(repeat):
                for name, query in variants.items():
                    load(page, watch, f"{url}/?{query}")  # the first visit of this variant, untimed
                    record(results, f"reload: {name}", reload(page, watch)[0])
            context.close()
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_content("<div id=g style='width:1300px'></div>")
        page.add_script_tag(path=str(Path(plotly.__file__).parent / "package_data" / "plotly.min.js"))
        for _ in range(repeat):
            for k, spec in enumerate(specs):
                record(results, f"bare Plotly.newPlot: figure {k}", page.evaluate(BARE_PLOTLY_DRAW, spec) / 1000)
        browser.close()
    return results


def returning_browser(playwright, profile: str, logs_dir: Path, port: int, targets: list[str]):
    """A browser context on a profile folder (its caches on disk, as a user's browser) that has opened each of
    `targets` twice on a server at `port`: chromium keeps a script's compiled code from its second run on, so the
    pages' next loads find Streamlit's scripts and plotly.js compiled (plotly.js alone: 1.5-2 s to run the first
    times on this machine, about 0.25 s with its compiled code)."""
    context = playwright.chromium.launch_persistent_context(
        profile, executable_path=screenshots.CHROMIUM, args=screenshots.CHROMIUM_ARGS, headless=True,
        viewport={"width": 1400, "height": 1000})
    with screenshots.serve_dashboard(logs_dir, port=port, timeout=LOAD_TIMEOUT_S) as url:
        for _ in range(2):
            for target in targets:
                page = context.new_page()
                load(page, widgets.ServerWatch().attach(page), f"{url}/{target}")
                page.close()
    return context


def measure(logs_dir: Path, run: str, step: int, longest: tuple[int, int], repeat: int,
            pages: list[str], returning: bool = False) -> dict[str, list[float]]:
    import tempfile

    from playwright.sync_api import sync_playwright

    results: dict[str, list[float]] = {}

    query, peak_memory, failures = f"run={run}&step={step}", [], []
    token_query = f"run={run}&step={longest[0]}&rollout={longest[1]}"
    targets = {name: f"{path}?{token_query if name == 'tokens' else query}" for name, path in PAGES.items()
               if name in pages}
    # A returning user's browser comes back to the same address (its caches are per origin): one port for all.
    port = screenshots.free_port()
    with sync_playwright() as playwright, tempfile.TemporaryDirectory() as profile:
        if returning:
            returned = returning_browser(playwright, profile, logs_dir, port, list(targets.values()))
        else:
            browser = screenshots.launch_browser(playwright)
        for _ in range(repeat):
            for name, target in targets.items():
                # A fresh server per page: nothing imported or cached in it yet
                with screenshots.serve_dashboard(logs_dir, port=port, timeout=LOAD_TIMEOUT_S) as url:
                    context = returned if returning else browser.new_context(viewport={"width": 1400, "height": 1000})
                    page = context.new_page()
                    watch = widgets.ServerWatch().attach(page)
                    target = f"{url}/{target}"
                    record_split(results, f"first load (fresh server): {name}", load(page, watch, target))
                    record_split(results, f"reload: {name}", reload(page, watch))
                    if name == "tokens":
                        for *seconds, from_the_key in move_the_window(page, watch, times=3):
                            record_split(results, "tokens: move the window", seconds)
                            record(results, "tokens: move the window, from the key press", from_the_key)
                    # every widget of the page, changed in turn (not the run: that leaves the benchmark's run)
                    for widget, seconds, problems in widgets.change_every_widget(page, watch, {RUN_PICKER}):
                        if problems:  # the rest of this page is not measured this time; the other pages are
                            failures.append(f"{name} / {widget}: {problems}")
                            print(f"    FAILED {failures[-1]}", flush=True)
                            break
                        if "not changed" not in widget:  # nothing else to choose: not an interaction
                            record(results, f"{name}: {widget}", seconds)
                            if not widget.endswith(widgets.PARTS):  # a part of a change: timed in the browser only
                                record(results, f"{name}: {widget}, server part",
                                       max(watch.last_message - watch.action_started, 0.0))
                        if widget == PLAY:  # stopped again, untimed: the next changes are measured without a tick
                            stop_playing(page, watch)  # of the player landing in them
                    else:  # every change went through
                        record_split(results, f"{name}: the step after a {LOOK_S:g} s look",
                                     step_after_a_look(page, watch))
                    (page if returning else context).close()  # a returning browser keeps its profile open
                    peak_memory.append(server_memory_mb(port))
        (returned if returning else browser).close()
    if any(m is not None for m in peak_memory):
        print(f"  dashboard server peak resident memory: {max(m for m in peak_memory if m is not None):.0f} MB")
    for failure in failures:
        print(f"  not measured after a failure: {failure}")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logs-dir", default=str(ROOT / "bench_logs"))
    parser.add_argument("--run", action="append", help="run(s) to measure (default: every bench-* run)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--pages", nargs="+", choices=list(PAGES), default=list(PAGES), help="only these pages")
    parser.add_argument("--returning-browser", action="store_true",
                        help="load the pages in a browser that opened them before (its caches and compiled scripts "
                             "warm), instead of a first visit ever")
    parser.add_argument("--floor", action="store_true", help="what Streamlit alone costs (FLOOR_APPS), no run")
    parser.add_argument("--figures", choices=list(PAGES), help="where this page's browser time goes: its figures "
                                                               "alone, in Streamlit and in bare Plotly")
    args = parser.parse_args(argv)
    if args.floor:
        print_medians(measure_floor(args.repeat), args.repeat)
        return 0
    from engine.runlog import RunReader, list_runs

    logs_dir = Path(args.logs_dir).resolve()
    runs = args.run or [r["run"] for r in list_runs(logs_dir) if r["run"].startswith("bench-")]
    for run in runs:
        reader = RunReader(logs_dir, run)
        step = int(reader.sql("SELECT max(step) // 2 AS s FROM steps")["s"][0])
        tokens = int(reader.sql("SELECT count(*) AS n FROM tokens")["n"][0])
        # The Token inspector opens on the run's longest completion (its heaviest case: 16k tokens in the long shape).
        longest = reader.sql("SELECT step, rollout_id, length FROM rollouts WHERE kind = 'train' "
                             "ORDER BY length DESC, step LIMIT 1")
        token_step, rollout = int(longest["step"][0]), int(longest["rollout_id"][0])
        print(f"\n{run}: {tokens:,} token rows, step {step}; Token inspector: step {token_step}, rollout {rollout} "
              f"({int(longest['length'][0]):,} tokens)")
        if args.figures:
            results = measure_figures(logs_dir, run, step, (token_step, rollout), args.figures, args.repeat)
        else:
            results = measure(logs_dir, run, step, (token_step, rollout), args.repeat, args.pages,
                              args.returning_browser)
        print_medians(results, args.repeat)
    return 0


def print_medians(results: dict[str, list[float]], repeat: int) -> None:
    print(f"  medians of {repeat}:")
    for name, values in results.items():
        print(f"    {name:<34} {statistics.median(values):6.2f} s")


if __name__ == "__main__":
    sys.exit(main())
