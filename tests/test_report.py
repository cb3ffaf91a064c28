"""`policylens report`: one self-contained HTML file of a run, checked in a real browser (Debian's chromium).

- Opened from disk, the report makes no request at all and runs nothing from logged text: prompts, completions,
  tokens, the config and the model name holding `<script>` and `<img onerror>` are shown as those characters.
- It shows the run's numbers: curves, key numbers, groups, the rollout's tokens and the clipping summary are compared
  with values computed here from the run log's rows, on a run trained by the engine.
- Bad input (unknown run, step or rollout, a missing folder) is one clear line, and an existing file stays whole.
- The Token inspector's download button gives the same file as the command.
- scripts/plot_curves.py draws the dashboard's figure and exports it through the installed chromium.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import plot_curves  # scripts/plot_curves.py and scripts/screenshots.py (pytest's pythonpath)
import pytest
import screenshots

from dashboard import plotly_bundle
from engine.cli import main

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
SCRIPT = "<script>window.__pwned=1</script>"
IMAGE = '<img src=x onerror="window.__pwned=2">'

needs_chromium = pytest.mark.skipif(not Path(CHROMIUM).exists(),
                                    reason=f"no chromium at {CHROMIUM} (apt-get install chromium)")


def as_displayed(token: str) -> str:
    """What a reader sees for a token: its characters, with whitespace shown as symbols."""
    return token.replace(" ", "·").replace("\t", "→").replace("\r", "␍").replace("\n", "↵\n")


def write_hostile_run(logs_dir: Path, steps: int = 1) -> None:
    """A synthetic run whose prompt, completion, answer, tokens, config and model name carry markup."""
    from synthetic_runs import synthetic_step

    from engine.runlog import RunWriter

    rng = np.random.default_rng(0)
    writer = RunWriter.create(logs_dir, "hostile", algorithm="grpo", task="linear", model=IMAGE,
                              config={"group_size": 3, "note": SCRIPT})
    for step in range(steps):
        data = synthetic_step(step, 2, 3, 10, 2, rng)
        rollouts, tokens = data["rollouts"], data["tokens"]
        group = (rollouts["group_id"] == 0) & (rollouts["kind"] == "train")
        rollouts.loc[group, "prompt"] = f"Solve {SCRIPT} for x"
        rollouts.loc[group, "answer"] = SCRIPT
        rollouts.loc[rollouts["rollout_id"] == 0, "completion"] = f"x = {IMAGE}\n"
        first = tokens.index[tokens["rollout_id"] == 0]
        tokens.loc[first[0], "token_text"] = SCRIPT
        tokens.loc[first[1], "token_text"] = IMAGE
        writer.log_step(step, **data)
    writer.close()


def open_report(playwright, path: Path):
    """Open a report file with every request recorded and refused unless it is the file itself; wait until plotly
    has drawn every figure. Returns (browser, page, requests, dialogs); CSP violations go to `window.__violations`."""
    browser = screenshots.launch_browser(playwright)
    page = browser.new_page(viewport={"width": 1300, "height": 900})
    # A generous deadline for every wait: a 5 MB file on a busy machine can take minutes (the default 30 s failed).
    page.set_default_timeout(300_000)
    requests, dialogs = [], []
    own = path.resolve().as_uri()

    def route(r):
        requests.append(r.request.url)
        if r.request.url == own:
            r.continue_()
        else:
            r.abort()

    page.route("**/*", route)
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    page.add_init_script("window.__violations = []; document.addEventListener('securitypolicyviolation', "
                         "e => window.__violations.push(e.violatedDirective + ' ' + e.blockedURI));")
    page.goto(own)
    # Every figure drawn by plotly from the inline data.
    page.wait_for_function("() => { const f = document.querySelectorAll('.pl-figure'); return f.length > 0 && "
                           "[...f].every(d => d.querySelector('.main-svg')); }")
    return browser, page, requests, dialogs


@pytest.mark.slow
@needs_chromium
def test_report_in_a_browser_makes_no_request_and_shows_markup_as_text(tmp_path):
    from playwright.sync_api import sync_playwright

    write_hostile_run(tmp_path / "logs")
    out = tmp_path / "hostile.html"
    assert main(["report", "hostile", "--logs-dir", str(tmp_path / "logs"), "-o", str(out), "--rollout", "0"]) == 0

    with sync_playwright() as playwright:
        browser, page, requests, dialogs = open_report(playwright, out)
        page.wait_for_timeout(500)  # let anything that would fire (onerror, timers) fire
        assert requests == [out.resolve().as_uri()]
        assert page.evaluate("() => window.__pwned") is None
        assert page.evaluate("() => window.__violations") == []
        assert page.locator("img, iframe, object, embed, [onerror]").count() == 0
        # The only scripts are the report's own: plotly's once, one per figure and the tokens' one.
        figures = page.locator(".pl-figure").count()
        scripts = page.evaluate("() => [...document.scripts].map(s => s.nonce ? 'own' : s.outerHTML)")
        assert scripts == ["own"] * (figures + 2)
        assert page.evaluate("() => document.scripts[0].text") == plotly_bundle.served_script()  # the dashboard's

        # The markup is on the page as characters.
        assert page.locator("pre.pl-prompt").text_content() == f"Solve {SCRIPT} for x"
        shown = page.locator("details[open] span.pl-token").all_inner_texts()
        assert as_displayed(SCRIPT) in shown and as_displayed(IMAGE) in shown
        text = page.evaluate("() => document.body.textContent")
        assert f"x = {IMAGE}\n" in text  # the completion, in its group's table
        assert f"model: {IMAGE}" in text and f"Reference answer: {SCRIPT}" in text
        assert page.locator("td", has_text="note").locator("xpath=following-sibling::td").text_content() == SCRIPT
        browser.close()
    assert dialogs == []


@pytest.mark.slow
@needs_chromium
def test_report_shows_the_numbers_of_an_engine_trained_run(tiny_run, tmp_path):
    from playwright.sync_api import sync_playwright

    from engine.runlog import RunReader

    logs_dir, run = tiny_run
    with RunReader(logs_dir, runs=[run]) as reader:
        steps = reader.sql("SELECT * FROM steps ORDER BY step")
        step = int(steps["step"].iloc[1])
        rollouts = reader.sql("SELECT * FROM rollouts WHERE step = ?", [step])
        tokens = reader.sql("SELECT * FROM tokens WHERE step = ? ORDER BY rollout_id, position", [step])
        passes = reader.sql("SELECT * FROM token_passes WHERE step = ?", [step])
    out = tmp_path / "run.html"
    assert main(["report", run, "--logs-dir", str(logs_dir), "-o", str(out), "--step", str(step)]) == 0

    with sync_playwright() as playwright:
        browser, page, requests, _ = open_report(playwright, out)
        assert requests == [out.resolve().as_uri()]

        # Curves: every plotted line is the run's logged metric, step for step.
        # (_fullData: the traces as plotly.js decoded them; `data` keeps the inline base64 arrays as written.)
        lines = page.evaluate("() => document.getElementById('pl-figure-1')._fullData.map("
                              "t => [t.hovertemplate, Array.from(t.x), Array.from(t.y)])")
        assert len(lines) >= 5
        for template, x, y in lines:
            column = re.search(r"<br>(\w+) %\{y", template).group(1)
            logged = steps[steps[column].notna()]
            assert x == logged["step"].tolist()
            np.testing.assert_allclose(y, logged[column].to_numpy(dtype=float), rtol=1e-12)

        def table(index: int) -> list[dict[str, str]]:
            return page.evaluate(
                "i => { const t = document.querySelectorAll('table')[i]; const h = [...t.tHead.rows[0].cells]"
                ".map(c => c.textContent); return [...t.tBodies[0].rows].map(r => Object.fromEntries("
                "[...r.cells].map((c, j) => [h[j], c.textContent]))); }", index)

        # Key numbers of the step.
        row = steps[steps["step"] == step].iloc[0]
        numbers = {r["metric"]: r["value"] for r in table(0)}
        for column, label in (("reward_mean", "reward (mean)"), ("entropy", "entropy"), ("kl", "KL to reference")):
            assert numbers[label] == f"{row[column]:.4g}"
        evaluated = steps[(steps["step"] <= step) & steps["heldout_accuracy"].notna()].iloc[-1]
        held_out = f"held-out accuracy (greedy, step {int(evaluated['step'])})"
        assert numbers[held_out] == f"{evaluated['heldout_accuracy']:.4g}"

        # Groups: one row per train group with its mean reward and size.
        train = rollouts[rollouts["kind"] == "train"]
        expected = train.groupby("group_id")["reward"].agg(["mean", "size"])
        groups = table(1)
        assert [int(g["group_id"]) for g in groups] == expected.index.tolist()
        for g in groups:
            assert g["reward_mean"] == f"{expected.loc[int(g['group_id']), 'mean']:.4g}"
            assert int(g["size"]) == expected.loc[int(g["group_id"]), "size"]

        # The rollout shown: a trained one with the largest |advantage|, its tokens in order.
        shown = int(re.search(r"Rollout (\d+), token by token", page.locator("h2").all_text_contents()[3]).group(1))
        kept = train[~train["filtered"].fillna(False)]
        assert abs(train.set_index("rollout_id").loc[shown, "advantage"]) == kept["advantage"].abs().max()
        texts = tokens[tokens["rollout_id"] == shown]["token_text"].tolist()
        spans = page.locator("details[open] span.pl-token").all_inner_texts()
        assert [s.strip("\n") for s in spans] == [as_displayed(t).strip("\n") for t in texts]

        # Clipping per pass: tokens trained on and the fraction clipped low / high.
        summary = table(2 + len(expected))
        for p, frame in passes.groupby("pass"):
            (logged,) = [r for r in summary if int(r["pass"]) == p]
            assert int(logged["tokens"]) == len(frame)
            assert logged["low"] == f"{(frame['clip'] == 1).mean():.4g}"
            assert logged["high"] == f"{(frame['clip'] == 2).mean():.4g}"
        browser.close()


def test_report_errors_are_one_clear_line_and_keep_an_existing_file(tmp_path, capsys):
    from synthetic_runs import write_synthetic_run

    logs = tmp_path / "logs"
    write_synthetic_run(str(logs), "tiny", steps=2, groups=2, group_size=2, length=6, passes=1)
    out = tmp_path / "run.html"
    out.write_text("an earlier report")
    cases = [
        (["report", "nope"], "no run 'nope' in", "runs: tiny"),
        (["report", "tiny", "--step", "7"], "run 'tiny' has no step 7", "logged steps: 0..1"),
        (["report", "tiny", "--step", "1", "--rollout", "999"], "step 1 has no rollout 999", "its rollouts are 0.."),
        (["report", "../tiny"], "invalid run name '../tiny'", "a run name is"),
    ]
    for argv, what, accepted in cases:
        assert main([*argv, "--logs-dir", str(logs), "-o", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("policylens report: error: "), err
        assert what in err and accepted in err, err
    assert out.read_text() == "an earlier report"

    assert main(["report", "tiny", "--logs-dir", str(logs), "-o", str(tmp_path / "missing" / "r.html")]) == 2
    assert "no folder" in capsys.readouterr().err
    assert main(["report", "tiny", "--logs-dir", str(tmp_path / "elsewhere"), "-o", str(out)]) == 2
    assert "no logs folder" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs", "run.html"]  # no temporary file left behind


@pytest.mark.slow
@needs_chromium
def test_token_inspector_button_downloads_the_same_report(tmp_path):
    from playwright.sync_api import sync_playwright

    logs = tmp_path / "logs"
    write_hostile_run(logs)
    out = tmp_path / "cli.html"
    assert main(["report", "hostile", "--logs-dir", str(logs), "-o", str(out), "--step", "0", "--rollout", "0"]) == 0

    with screenshots.serve_dashboard(logs) as url, sync_playwright() as playwright:
        browser = screenshots.launch_browser(playwright)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"{url}/tokens?run=hostile&step=0&rollout=0&channel=advantage")
        button = page.get_by_role("button", name="Download a report of this step")
        button.wait_for(timeout=60_000)
        with page.expect_download(timeout=120_000) as download:
            button.click()
        assert download.value.suggested_filename == "hostile-step0.html"
        downloaded = Path(download.value.path()).read_text(encoding="utf-8")
        browser.close()

    def without_nonce(text: str) -> str:
        nonce = re.search(r"script-src 'nonce-([^']+)'", text).group(1)
        return text.replace(nonce, "NONCE")

    assert without_nonce(downloaded) == without_nonce(out.read_text(encoding="utf-8"))


@pytest.mark.slow
@needs_chromium
def test_plot_curves_exports_the_dashboard_figure(tmp_path):
    from PIL import Image
    from synthetic_runs import write_synthetic_run

    from engine.runlog import RunReader

    logs = tmp_path / "logs"
    for seed, name in enumerate(("grpo", "dapo")):
        write_synthetic_run(str(logs), name, steps=6, groups=2, group_size=2, length=6, passes=1, seed=seed)
    figure = plot_curves.curves_figure(plot_curves.load_steps(str(logs), ["grpo=GRPO", "dapo"]), "title")
    with RunReader(logs) as reader:
        logged = reader.sql("SELECT run, step, heldout_accuracy FROM steps WHERE heldout_accuracy IS NOT NULL")
    lines = {trace.name: trace for trace in figure.data}
    assert sorted(lines) == ["GRPO", "dapo"]
    for name, run in (("GRPO", "grpo"), ("dapo", "dapo")):
        rows = logged[logged["run"] == run].sort_values("step")
        assert list(lines[name].x) == rows["step"].tolist()
        np.testing.assert_allclose(lines[name].y, rows["heldout_accuracy"].to_numpy(dtype=float))
        assert "heldout_accuracy" in lines[name].hovertemplate  # the dashboard's metric_curves drew it

    png = tmp_path / "curves.png"
    assert plot_curves.main(["--logs-dir", str(logs), "grpo=GRPO", "dapo", "-o", str(png)]) == 0
    with Image.open(png) as image:
        assert image.size == (plot_curves.WIDTH, plot_curves.HEIGHT)
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
        assert len(colours) > 50  # text, axes and two coloured lines, not a blank page


def test_report_command_runs_without_streamlit(tmp_path):
    """`policylens report` reads the run through the Streamlit-free data layer: neither the report module nor the
    command imports Streamlit (so there is no Streamlit logger to silence), and nothing is printed about a missing
    Streamlit runtime."""
    import subprocess
    import sys
    import textwrap

    from synthetic_runs import write_synthetic_run

    logs = tmp_path / "logs"
    write_synthetic_run(str(logs), "tiny", steps=2, groups=2, group_size=2, length=6, passes=1)
    out = tmp_path / "run.html"
    script = textwrap.dedent(f"""
        import sys
        import dashboard.report
        assert "streamlit" not in sys.modules, "importing dashboard.report imported streamlit"
        from engine.cli import main
        assert main(["report", "tiny", "--logs-dir", {str(logs)!r}, "-o", {str(out)!r}]) == 0
        print("streamlit" in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "False", done.stdout
    assert "runtime" not in done.stderr.lower(), done.stderr[-3000:]
    assert out.stat().st_size > 0


def test_report_includes_the_steps_sampler_mismatch(tiny_process_run):
    """A run sampled by a bfloat16 copy of the policy one update behind: the report's mismatch table holds the
    step's numbers computed here from the tokens; a run without sampler log-probs has no such section."""
    import html

    from dashboard.report import build_report
    from engine.runlog import RunReader, RunWriter

    logs_dir, run = tiny_process_run
    with RunReader(logs_dir, runs=[run]) as reader:
        step = int(reader.sql("SELECT max(step) AS s FROM steps")["s"].iloc[0])
        tokens = reader.sql(
            "SELECT t.old_logp - t.sampler_logp AS lr FROM tokens t JOIN rollouts r USING (run, step, rollout_id) "
            "WHERE t.step = ? AND r.kind = 'train' AND NOT r.filtered AND t.sampler_logp IS NOT NULL", [step])
    text = build_report(str(logs_dir), run, step)
    assert f"Sampler/trainer mismatch at step {step}" in text
    section = text[text.index(f"Sampler/trainer mismatch at step {step}"):]
    rows = dict(re.findall(r"<tr><td class=\"text\">([^<]+)</td><td class=\"num\">([^<]+)</td></tr>", section))
    rows = {html.unescape(k): v for k, v in rows.items()}
    ratio = np.exp(tokens["lr"].to_numpy())
    assert rows["tokens"] == str(len(tokens))
    assert rows["share outside [0.9, 1.1]"] == f"{((ratio < 0.9) | (ratio > 1.1)).mean():.4g}"
    assert rows["mean |log-ratio|"] == f"{np.abs(tokens['lr']).mean():.4g}"

    with RunWriter.create(Path(logs_dir).parent / "no-sampler", "plain", config={}) as writer:
        writer.log_step(0, rollouts={"rollout_id": [0], "group_id": [0], "kind": ["train"], "completion": ["x"]},
                        tokens={"rollout_id": [0], "position": [0], "token_text": ["x"], "old_logp": [-0.1]})
    assert "Sampler/trainer mismatch" not in build_report(str(Path(logs_dir).parent / "no-sampler"), "plain", 0)


def test_train_rollouts_without_a_group_are_shown_as_one_ungrouped_set(tmp_path, monkeypatch):
    """A run logged through RunWriter by hand may leave `group_id` empty: the report and the Groups page list those
    rollouts under one "no group" row with their completions instead of failing or dropping them."""
    from streamlit.testing.v1 import AppTest
    from test_dashboard import shown_groups

    from dashboard.report import build_report
    from engine.runlog import RunWriter

    with RunWriter.create(tmp_path, "ungrouped", config={}) as writer:
        writer.log_step(0, rollouts={"rollout_id": [0, 1, 2], "group_id": [None, None, 0], "index_in_group": [0, 1, 0],
                                     "kind": ["train"] * 3, "completion": ["alpha", "beta", "gamma"],
                                     "reward": [1.0, 0.0, 1.0]})
    text = build_report(str(tmp_path), "ungrouped", 0)
    ungrouped = text[text.index("group – ·"):]
    assert "alpha" in ungrouped[:ungrouped.index("</details>")] and "beta" in ungrouped[:ungrouped.index("</details>")]

    monkeypatch.setenv("POLICYLENS_LOGS_DIR", str(tmp_path))
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "dashboard" / "streamlit_app.py"),
                           default_timeout=120)
    at.query_params["run"], at.query_params["step"] = "ungrouped", "0"
    at.run()
    at.switch_page("app_pages/groups.py").run()
    assert not at.exception, [e.message for e in at.exception]
    assert {"alpha", "beta", "gamma"} <= {m["text"] for group in shown_groups(at) for m in group["members"]}
