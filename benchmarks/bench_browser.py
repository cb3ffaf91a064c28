"""What a user feels: the dashboard in headless chromium, from an action to the page drawn and idle.

    python benchmarks/bench_browser.py                        # the runs benchmarks/bench_dashboard.py built
    python benchmarks/bench_browser.py --run bench-40x64x8x650 --repeat 5

Serves the dashboard (`policylens dashboard` on a free loopback port) over `--logs-dir` and drives Debian's chromium
with Playwright (set CHROMIUM for another binary). "Idle" is measured in the page: a MutationObserver records the
time of the last change to the document; an action is done once Streamlit's running indicator is gone and nothing
changed for `QUIET_MS`; its time is the last change minus the moment of the action. Measured, medians of
`--repeat` (browser, server and DuckDB share the machine, as they would on a laptop):
- first load: a page opened in a new tab (new browser context), from navigation start; the very first one after
  the server started (imports) is reported on its own;
- reload: the same tab reloaded;
- interactions: choosing another rollout in the Token inspector, moving the Replay step by one.
The run's middle step is used (a step inside the largest compacted chunk, not the small newest folder).
Targets (issue 12): interaction < 0.5 s, first page < 3 s, reload < 1.5 s.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

QUIET_MS = 1000
PAGES = {"runs": "", "replay": "replay", "groups": "groups", "tokens": "tokens", "prm steps": "prm",
         "weighting": "weighting"}
# Installed before any script of the page runs: the time of the latest change to the document.
WATCH_MUTATIONS = """
window.__lastChange = performance.now();
new MutationObserver(() => { window.__lastChange = performance.now(); })
    .observe(document, {subtree: true, childList: true, attributes: true, characterData: true});
"""


def _screenshots():
    spec = importlib.util.spec_from_file_location("screenshots", ROOT / "scripts" / "screenshots.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def settle(page, since_ms: float, timeout_s: float = 120.0) -> float:
    """Seconds from `since_ms` (page clock) to the last change, once the app is idle."""
    deadline = time.monotonic() + timeout_s
    page.wait_for_selector('[data-testid="stMainBlockContainer"] h1, [data-testid="stMainBlockContainer"] h2',
                           timeout=timeout_s * 1000)
    while time.monotonic() < deadline:
        now, last, running = page.evaluate(
            "() => [performance.now(), window.__lastChange,"
            " document.querySelectorAll('[data-testid=\"stStatusWidget\"]').length > 0]")
        if not running and now - last > QUIET_MS:
            return (last - since_ms) / 1000
        time.sleep(0.05)
    raise TimeoutError("the page never became idle")


def load(page, url: str) -> float:
    page.goto(url, wait_until="commit")
    return settle(page, 0.0)  # performance.now() counts from the navigation start


def reload(page) -> float:
    page.reload(wait_until="commit")
    return settle(page, 0.0)


def act(page, action) -> float:
    """Do `action` (e.g. a key press) and return the seconds until the page is drawn and idle."""
    settle(page, 0.0)
    started = page.evaluate("performance.now()")
    action()
    return settle(page, started)


def choose_next_rollout(page) -> None:
    box = page.locator('[data-testid="stMainBlockContainer"] [data-testid="stSelectbox"] input').first
    box.click()
    page.keyboard.press("ArrowDown")
    page.keyboard.press("Enter")


def move_replay_step(page, key: str) -> None:
    page.locator('[data-testid="stMainBlockContainer"] [data-testid="stSlider"] input[type="range"]').first.press(key)


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


def measure(logs_dir: Path, run: str, step: int, rollout: int, repeat: int,
            pages: list[str]) -> dict[str, list[float]]:
    from playwright.sync_api import sync_playwright

    screenshots = _screenshots()
    results: dict[str, list[float]] = {}

    def record(name: str, seconds: float) -> None:
        results.setdefault(name, []).append(seconds)
        print(f"    {name:<34} {seconds:6.2f} s", flush=True)

    with screenshots.serve_dashboard(logs_dir, timeout=300) as url, sync_playwright() as playwright:
        browser = screenshots.launch_browser(playwright)
        query = f"run={run}&step={step}&rollout={rollout}"
        for round_ in range(repeat):
            for name, path in PAGES.items():
                if name not in pages:
                    continue
                context = browser.new_context(viewport={"width": 1400, "height": 1000})
                context.add_init_script(WATCH_MUTATIONS)
                page = context.new_page()
                seconds = load(page, f"{url}/{path}?{query}")
                record("first load, server just started" if not results else f"first load: {name}", seconds)
                record(f"reload: {name}", reload(page))
                if name == "tokens":
                    record("choose another rollout", act(page, lambda page=page: choose_next_rollout(page)))
                if name == "replay":
                    key = "ArrowRight" if round_ % 2 == 0 else "ArrowLeft"
                    record("move the replay step", act(page, lambda page=page, key=key: move_replay_step(page, key)))
                context.close()
        browser.close()
        port = int(url.rsplit(":", 1)[1])
        memory = server_memory_mb(port)
        if memory is not None:
            print(f"  dashboard server peak resident memory: {memory:.0f} MB")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logs-dir", default=str(ROOT / "bench_logs"))
    parser.add_argument("--run", action="append", help="run(s) to measure (default: every bench-* run)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--pages", nargs="+", choices=list(PAGES), default=list(PAGES), help="only these pages")
    args = parser.parse_args(argv)
    from engine.runlog import RunReader, list_runs

    logs_dir = Path(args.logs_dir).resolve()
    runs = args.run or [r["run"] for r in list_runs(logs_dir) if r["run"].startswith("bench-")]
    for run in runs:
        reader = RunReader(logs_dir, run)
        step = int(reader.sql("SELECT max(step) // 2 AS s FROM steps")["s"][0])
        tokens = int(reader.sql("SELECT count(*) AS n FROM tokens")["n"][0])
        rollout = int(reader.sql("SELECT min(rollout_id) AS r FROM rollouts WHERE step = ? AND kind = 'train'",
                                 [step])["r"][0])
        print(f"\n{run}: {tokens:,} token rows, step {step}, rollout {rollout}")
        results = measure(logs_dir, run, step, rollout, args.repeat, args.pages)
        print(f"  medians of {args.repeat}:")
        for name, values in results.items():
            print(f"    {name:<34} {statistics.median(values):6.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
