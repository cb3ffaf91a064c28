"""Save a PNG of every dashboard page, for the README.

    python scripts/screenshots.py --logs-dir logs --out docs/screenshots [--run NAME] [--rollout ID]
    python scripts/screenshots.py --logs-dir logs --out docs --pages token_inspector --channel mismatch

Starts the dashboard on a free loopback port, opens each page in headless Chromium (Debian's /usr/bin/chromium,
driven by Playwright; set CHROMIUM to use another binary) and writes <out>/<page>.png. Uses the newest run unless
--run is given, and for the token inspector a rollout of a mixed group (one with both right and wrong answers).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
PAGES = {  # file name -> (url path, extra query parameters)
    "runs": ("", {}),  # the default page lives at the root URL
    "replay": ("replay", {}),
    "groups": ("groups", {}),
    "token_inspector": ("tokens", {"channel": "ratio"}),
    "prm_steps": ("prm", {}),
    "advantages": ("advantages", {}),
    "algorithm_weighting": ("weighting", {}),
    # every run on the same held-out prompt (by default one with a negative answer: the minus sign's story)
    "token_trajectories": ("trajectories", {}),
    "token_stats": ("token-stats", {}),
    "mismatch": ("mismatch", {}),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_dashboard(logs_dir: str | Path, port: int | None = None, timeout: float = 60.0):
    """Run `policylens dashboard` on 127.0.0.1 and yield its base URL; stop it afterwards."""
    from engine.cli import dashboard_command

    port = port or free_port()
    with serve(dashboard_command(str(logs_dir), "127.0.0.1", port), port, timeout) as url:
        yield url


@contextlib.contextmanager
def serve(command: list[str], port: int, timeout: float = 60.0):
    """Run a `streamlit run` command line that listens on 127.0.0.1:`port`, yield its base URL once it answers, and
    stop it afterwards."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"dashboard exited: {process.stderr.read().decode()[-2000:]}")
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).status == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"dashboard did not answer on {url} within {timeout} s")
            time.sleep(0.3)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()


def wait_until_rendered(page, timeout_ms: int = 60_000) -> None:
    """Streamlit renders in several passes: wait for the app, then until the 'running' indicator is gone."""
    page.wait_for_selector('[data-testid="stApp"]', timeout=timeout_ms)
    page.wait_for_selector('[data-testid="stMainBlockContainer"] h2, [data-testid="stMainBlockContainer"] h1',
                           timeout=timeout_ms)
    deadline = time.monotonic() + timeout_ms / 1000
    quiet_since = None
    while time.monotonic() < deadline:
        running = page.locator('[data-testid="stStatusWidget"]').count() > 0
        if running:
            quiet_since = None
        elif quiet_since is None:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since > 3.0:  # charts and code blocks draw after the script finishes
            return
        time.sleep(0.2)


def launch_browser(playwright):
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)


def pick_run_and_rollout(logs_dir: str, run: str | None) -> tuple[str, int | None]:
    from engine.runlog import RunReader

    reader = RunReader(logs_dir)
    if run is None:
        runs = reader.sql("SELECT run FROM runs ORDER BY last_step DESC NULLS LAST, created_at DESC LIMIT 1")
        if runs.empty:
            raise SystemExit(f"no runs in {logs_dir}")
        run = str(runs["run"].iloc[0])
    # A rollout of a mixed group (right and wrong answers, so non-zero advantages) at the last step, preferring
    # one with clip events to show.
    rollout = reader.sql(
        """WITH last AS (SELECT max(step) AS step FROM rollouts WHERE run = ? AND kind = 'train'),
                r AS (SELECT * FROM rollouts WHERE run = ? AND kind = 'train' AND step = (SELECT step FROM last)),
                mixed AS (SELECT group_id FROM r GROUP BY group_id HAVING min(reward) < max(reward)),
                clips AS (SELECT rollout_id, count(*) FILTER (WHERE clip > 0) AS clipped FROM token_passes
                          WHERE run = ? AND step = (SELECT step FROM last) GROUP BY rollout_id)
           SELECT r.rollout_id FROM r LEFT JOIN clips USING (rollout_id)
           WHERE r.group_id IN (SELECT group_id FROM mixed)
           ORDER BY coalesce(clips.clipped, 0) > 0 DESC, r.advantage DESC LIMIT 1""",
        [run, run, run],
    )
    return run, (int(rollout["rollout_id"].iloc[0]) if len(rollout) else None)


def process_supervised_run(logs_dir: str, preferred: str) -> str:
    """`preferred` if it was trained with process supervision, else the first run that was (the PRM page's
    advantages are made of step rewards only there), else `preferred`."""
    from engine.runlog import RunReader

    runs = RunReader(logs_dir).sql(
        "SELECT run FROM runs WHERE json_extract_string(config, '$.supervision') = 'process' ORDER BY run")["run"]
    return preferred if preferred in set(runs) or runs.empty else str(runs.iloc[0])


def mismatched_run(logs_dir: str, preferred: str) -> str:
    """`preferred` if its sampler differed from its trainer (a bfloat16 / float16 sampler or a lag), else the first
    run whose did (the demo's demo-grpo-bf16-lag2), else `preferred`."""
    from engine.runlog import RunReader

    runs = RunReader(logs_dir).sql(
        "SELECT run FROM runs WHERE coalesce(json_extract_string(config, '$.sampler_dtype'), 'float32') <> 'float32' "
        "OR coalesce(TRY_CAST(json_extract_string(config, '$.sampler_lag') AS INTEGER), 0) > 0 ORDER BY run")["run"]
    return preferred if preferred in set(runs) or runs.empty else str(runs.iloc[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logs-dir", default="logs")
    parser.add_argument("--out", default="docs/screenshots")
    parser.add_argument("--run", default=None)
    parser.add_argument("--rollout", type=int, default=None)
    parser.add_argument("--width", type=int, default=1500)
    parser.add_argument("--pages", nargs="+", choices=list(PAGES), default=list(PAGES), help="the pages to save")
    parser.add_argument("--channel", help="the token inspector's colour channel (default: the ratio)")
    args = parser.parse_args(argv)

    from playwright.sync_api import sync_playwright

    run, rollout = pick_run_and_rollout(args.logs_dir, args.run)
    rollout = args.rollout if args.rollout is not None else rollout
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with serve_dashboard(args.logs_dir) as url, sync_playwright() as playwright:
        browser = launch_browser(playwright)
        page = browser.new_page(viewport={"width": args.width, "height": 1100})
        for name in args.pages:
            path, extra = PAGES[name]
            params = {"run": run, **extra}
            if args.channel and name == "token_inspector":
                params["channel"] = args.channel
            if rollout is not None and name == "token_inspector":
                params["rollout"] = str(rollout)
            if name == "mismatch":
                params["run"] = mismatched_run(args.logs_dir, run)
            if name == "prm_steps":
                prm_run = process_supervised_run(args.logs_dir, run)
                params["run"] = prm_run
                prm_rollout = rollout if prm_run == run else pick_run_and_rollout(args.logs_dir, prm_run)[1]
                if prm_rollout is not None:
                    params["rollout"] = str(prm_rollout)
            query = "&".join(f"{k}={v}" for k, v in params.items())
            page.goto(f"{url}/{path}?{query}")
            wait_until_rendered(page)
            # Streamlit scrolls inside its main container, so a full-page shot needs a viewport as tall as it.
            height = page.evaluate(
                "() => document.querySelector('[data-testid=\"stMain\"]')?.scrollHeight || 1100"
            )
            page.set_viewport_size({"width": args.width, "height": min(int(height) + 40, 8000)})
            # Figures are drawn once in sight (dashboard/figure.js): now all of them are.
            page.wait_for_function("[...document.querySelectorAll('.policylens-figure')].every("
                                   "f => f._fullLayout || f.getBoundingClientRect().top > window.innerHeight)",
                                   timeout=180_000)
            time.sleep(1.0)
            target = out / f"{name}.png"
            page.screenshot(path=str(target), full_page=True, timeout=180_000)  # a busy machine draws slowly
            page.set_viewport_size({"width": args.width, "height": 1100})
            print(target)
        browser.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
