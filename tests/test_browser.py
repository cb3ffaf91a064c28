"""The dashboard in a real browser: Debian's chromium driven by Playwright, the app served by `policylens
dashboard` on a free loopback port.

Checks what only a browser can: the token inspector opened from a URL renders the logged tokens, a hostile token
is shown as text (no element, no script), a running run's new step appears without a reload, and no page makes a
request anywhere but the app itself or turns logged text into a link, an image or a formula.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pytest
import screenshots  # scripts/screenshots.py (pytest's pythonpath)
from synthetic_runs import HOSTILE_TEXTS, HOSTILE_TOKEN, synthetic_step, write_hostile_run

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
GENEROUS_MS = 300_000
"""Every browser wait's deadline: these tests check what is drawn, not how fast; on a busy 2-core machine running the
suite on two workers a page can take minutes (Playwright's own defaults of 30 s failed there)."""

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"no chromium at {CHROMIUM} (apt-get install chromium)"),
]


def new_page(browser):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(GENEROUS_MS)  # (navigation and every wait without a timeout of its own)
    return page


def as_displayed(token: str) -> str:
    """What a reader sees for a token: its characters, with whitespace shown as symbols."""
    return token.replace(" ", "·").replace("\t", "→").replace("\r", "␍").replace("\n", "↵\n")


def test_token_inspector_in_a_browser_escapes_tokens_and_updates_live(tmp_path):
    from playwright.sync_api import sync_playwright

    from engine.runlog import RunReader, RunWriter

    rng = np.random.default_rng(0)
    writer = RunWriter.create(tmp_path, "hostile", algorithm="grpo", task="linear", config={"g": 2}, model="m")
    writer.log_step(0, **synthetic_step(0, 2, 2, 10, 1, rng, hostile=True))
    writer.flush()  # log_step returns before the writer thread has written the step
    tokens = RunReader(tmp_path).sql(
        "SELECT position, token_text, advantage FROM tokens WHERE run = 'hostile' AND step = 0 AND rollout_id = 0 "
        "ORDER BY position"
    )
    assert HOSTILE_TOKEN in tokens["token_text"].tolist()
    dialogs = []
    try:
        with screenshots.serve_dashboard(tmp_path) as url, sync_playwright() as playwright:
            assert url.startswith("http://127.0.0.1:")
            browser = screenshots.launch_browser(playwright)
            page = new_page(browser)
            page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
            page.goto(f"{url}/tokens?run=hostile&step=0&rollout=0&channel=advantage")
            page.wait_for_selector("span.pl-token")

            # The tokens, in order, as logged (whitespace made visible), and nothing else.
            shown = page.locator("span.pl-token").all_inner_texts()
            expected = [as_displayed(t) for t in tokens["token_text"]]
            assert [s.strip("\n") for s in shown] == [e.strip("\n") for e in expected]
            # The hostile token is text: its characters are on the page, no <img> was created, no alert ran.
            assert as_displayed(HOSTILE_TOKEN) in shown
            assert page.locator(".pl-tokens img").count() == 0
            hostile = page.locator("span.pl-token", has_text="onerror").first
            # Its hover text, written by the page from the position, the text and a value per column
            position, _, advantage = tokens[tokens["token_text"] == HOSTILE_TOKEN].iloc[0]
            hover = hostile.get_attribute("title").split("\n")
            assert hover[0] == f"#{position}  {HOSTILE_TOKEN!r}"
            assert f"advantage: {advantage:.4g}" in hover[1:]

            # Live: a new step of the running run shows up by itself (the page follows the newest step).
            writer.log_step(1, **synthetic_step(1, 2, 2, 10, 1, rng))
            # (the page's generous deadline: this checks that it appears, not how fast)
            page.wait_for_function("() => location.search.includes('step=1')")
            page.wait_for_function("() => document.querySelectorAll('span.pl-token').length > 0")
            browser.close()
    finally:
        writer.close()
    assert dialogs == []


def test_every_page_shows_logged_text_as_text_and_nothing_leaves_the_app(tmp_path):
    """Offline and safe: on the empty page and on every page of a run whose logged strings are all hostile, the
    browser asks nothing of any address but the app's own (no font, icon or image from elsewhere, not even another
    port on 127.0.0.1), no link, image or formula is made from logged text, no script runs, and the text is shown."""
    from playwright.sync_api import sync_playwright

    from engine.runlog import RunReader

    dialogs, requests = [], []
    with screenshots.serve_dashboard(tmp_path) as url, sync_playwright() as playwright:
        app = urlparse(url)
        browser = screenshots.launch_browser(playwright)
        page = new_page(browser)
        page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
        page.on("request", lambda request: requests.append(request.url))

        page.goto(url)  # nothing logged yet: the page that offers the demo
        screenshots.wait_until_rendered(page, GENEROUS_MS)
        page.get_by_role("button", name="Start the demo").wait_for()
        assert outside(requests, app) == []

        write_hostile_run(str(tmp_path), "hostile")
        rollouts = RunReader(tmp_path).sql("SELECT rollout_id FROM rollouts WHERE step = 1 AND filtered")
        filtered = int(rollouts["rollout_id"].iloc[0])
        for name, (path, query) in screenshots.PAGES.items():
            query = {"run": "hostile", "step": 1, **query}
            if name == "token_inspector":  # a rollout of the dropped group: its filter reason is shown
                query["rollout"] = filtered
            page.goto(f"{url}/{path}?" + "&".join(f"{k}={v}" for k, v in query.items()))
            screenshots.wait_until_rendered(page, GENEROUS_MS)
            shown = HOSTILE_TEXTS[0] if name != "groups" else " ".join(HOSTILE_TEXTS[:3])  # the task; a filter reason
            wait_for_text(page, shown)
            assert outside(requests, app) == [], name
            # Every link stays in the app (page navigation); no image comes from anywhere else; no formula.
            hrefs = page.eval_on_selector_all("a[href]", "links => links.map(a => a.href)")
            assert [h for h in hrefs if urlparse(h).netloc != app.netloc] == [], name
            sources = page.eval_on_selector_all("img", "images => images.map(i => i.src)")
            assert [s for s in sources if urlparse(s).scheme not in ("data", "blob")
                    and urlparse(s).netloc != app.netloc] == [], name
            assert page.locator(".katex, [data-testid='stMainBlockContainer'] script").count() == 0, name
        browser.close()
    assert dialogs == []


def wait_for_text(page, text: str) -> None:
    """Wait until the app shows `text` as its characters (word joiners, which break autolinks, left aside)."""
    page.wait_for_function(
        "text => document.querySelector('[data-testid=\"stApp\"]').innerText.replaceAll('\\u2060', '').includes(text)",
        arg=text,
    )


def outside(requests: list[str], app) -> list[str]:
    """The requests that went anywhere but the app's own address (data: and blob: URLs are not requests out)."""
    return [r for r in requests if urlparse(r).scheme not in ("data", "blob") and urlparse(r).netloc != app.netloc]


def test_advantages_page_in_a_browser_draws_every_scheme_and_keeps_logged_text_inert(tmp_path):
    """The Advantages page served for real: its chart is drawn (one panel per scheme the run has) and a hostile
    token or step text stays text (no element created, no dialog)."""
    from playwright.sync_api import sync_playwright
    from synthetic_runs import write_synthetic_run

    assert "advantages" in screenshots.PAGES  # the page list the screenshots (and README images) go through
    write_synthetic_run(str(tmp_path), "hostile", steps=1, hostile=True)
    dialogs = []
    with screenshots.serve_dashboard(tmp_path) as url, sync_playwright() as playwright:
        browser = screenshots.launch_browser(playwright)
        page = new_page(browser)
        page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
        page.goto(f"{url}/{screenshots.PAGES['advantages'][0]}?run=hostile&step=0")
        screenshots.wait_until_rendered(page, GENEROUS_MS)
        page.wait_for_selector(".js-plotly-plot")
        titles = page.locator(".js-plotly-plot .annotation-text").all_text_contents()  # SVG text
        assert any(t.startswith("GRPO outcome advantage") for t in titles), titles
        assert any(t.startswith("GRPO process advantage") for t in titles), titles
        assert page.locator('[data-testid="stMain"] img').count() == 0
        browser.close()
    assert dialogs == []
