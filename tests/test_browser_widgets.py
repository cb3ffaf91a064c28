"""Every widget of every page, changed in a real browser: no exception, no error box, the app finishes each run.

A `policylens dashboard` server over two runs: one trained by the engine with process supervision, and one imported
from TRL-shaped completion files (no correctness column, no log-probs). Each
page is opened on each run and every widget the page shows is changed in turn, as a person would (another option,
a key press on a slider, a click, a new cell value), widgets that appear after a change included; the sidebar's run
and step too. The widgets are found in the page (scripts/browser_widgets.py), not listed here, so a widget added to
a page is tested the day it is added. AppTest cannot catch what this catches: it reruns the whole script where a
browser reruns a fragment.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"no chromium at {CHROMIUM} (apt-get install chromium)"),
]


def write_trl_completions(folder: Path, steps: int = 2, groups: int = 4, group_size: int = 4) -> None:
    """TRL-shaped completions files (GRPOConfig(log_completions=True)): step, prompt, completion, one float column
    per reward function, advantage; no correctness column. Groups all right, all wrong and mixed."""
    import pandas as pd

    (folder / "completions").mkdir(parents=True)
    for step in range(1, steps + 1):
        rows = []
        for group in range(groups):
            rewards = [[1.0] * group_size, [0.0] * group_size][group] if group < 2 else \
                [float((i + group + step) % 2) for i in range(group_size)]
            mean = sum(rewards) / group_size
            for i, reward in enumerate(rewards):
                rows.append({"step": step, "prompt": f"Solve {group + 2}x + 1 = {2 * group + 5}.",
                             "completion": f"x = {group + i % 2 + 2}", "accuracy_reward": reward,
                             "format_reward": 0.5, "advantage": reward - mean})
        pd.DataFrame(rows).to_parquet(folder / "completions" / f"completions_{step:05d}.parquet")


@pytest.fixture(scope="module")
def widget_logs(tmp_path_factory, tiny_process_run):
    from engine.importers import import_trl
    from engine.policy import build_tokenizer

    logs = tmp_path_factory.mktemp("widget-logs")
    shutil.copytree(Path(tiny_process_run[0]) / tiny_process_run[1], logs / tiny_process_run[1])
    source = tmp_path_factory.mktemp("trl-output")
    write_trl_completions(source)
    tokenizer = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer().save_pretrained(tokenizer)
    report = import_trl(source, logs, "trl-imported", tokenizer_dir=tokenizer)
    assert report.imported and not report.problems
    return logs, [tiny_process_run[1], "trl-imported"]


def test_every_widget_of_every_page_can_be_changed(widget_logs):
    import browser_widgets as widgets  # scripts/ (pytest's pythonpath)
    import screenshots
    from playwright.sync_api import sync_playwright

    logs, runs = widget_logs
    changed, failures = [], []
    with screenshots.serve_dashboard(logs) as url, sync_playwright() as playwright:
        browser = screenshots.launch_browser(playwright)
        for run in runs:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            watch = widgets.ServerWatch().attach(page)
            page.goto(f"{url}/?run={run}")
            # (a generous deadline: a fresh server's first page imports everything, on a busy machine)
            widgets.wait_idle(page, watch, 0, timeout_s=300, quiet_ms=widgets.LOAD_QUIET_MS)
            links = page.locator('[data-testid="stSidebarNavLink"]')
            titles = [text.splitlines()[-1] for text in links.all_inner_texts()]  # (after the icon's name)
            for i, title in enumerate(titles):  # every page, found in the navigation
                before = watch.count()
                links.nth(i).click(timeout=120_000)  # (a generous deadline: a busy machine)
                widgets.wait_idle(page, watch, before)
                # Changing the run leaves this run's pages: done once per run, on its last page.
                skip = set() if title == titles[-1] else {'sidebar: stSelectbox "Run"'}
                for where, seconds, problems in widgets.change_every_widget(page, watch, skip):
                    print(f"{run} / {title} / {where}: {seconds:.2f} s", problems or "", flush=True)
                    changed.append(f"{run} / {title} / {where}")
                    if problems:
                        failures.append(f"{run} / {title} / {where}: {problems}")
            page.close()
        browser.close()
    assert not failures, "\n".join(failures)
    # Every page had widgets to change on the trained run (a discovery that found nothing would pass otherwise).
    for title in titles:
        assert any(c.startswith(f"{runs[0]} / {title} / main:") for c in changed), title
