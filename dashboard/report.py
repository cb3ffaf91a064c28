"""A run as one self-contained HTML file, for a reader without Python: `policylens report RUN -o run.html`.

The file holds the run's config, its metric curves, one step's groups, one rollout token by token (hover a token
for its values), the step's clipping and gradient-weight summary and, for a run with sampler log-probs, the step's
sampler/trainer mismatch. It needs no server and makes no request:
plotly's JavaScript (the one the dashboard serves, `dashboard.plotly_bundle`) is embedded once and every figure's
data is inline.

Nothing here draws by itself: the figures are the dashboard's (`dashboard.charts`), the tokens are drawn by the
token inspector's own script (`token_spans.js`, from `dashboard.tokens.token_spans`' data), and the data come from
the dashboard's data layer (`dashboard.data`, the same queries the pages call through their caches), so the report
shows what the app shows, and making one needs no Streamlit. Every logged string is escaped (`html.escape`) before
it touches markup or written as a JSON string that a script makes a text node of, and the page's Content Security
Policy runs only the report's own scripts (each carries a per-file nonce) and allows no network access, so a
completion such as `<script>...</script>` is shown as those characters and could not run or call out even if an
escape were missed.
"""

from __future__ import annotations

import html
import json
import os
import secrets
from pathlib import Path

import pandas as pd
import plotly.io as pio

from dashboard import charts, data, mismatch, plotly_bundle
from dashboard.tokens import (
    CHANNELS,
    DEFAULT_WINDOW,
    OVERVIEW_BINS,
    TOKEN_STYLE,
    TOKENS_STYLE,
    colour_legend_html,
    is_missing,
    number,
    plain,
    token_colours,
    token_marks,
)
from engine.clip_codes import CLIP_EVENTS, CLIP_NAMES
from engine.correction_settings import RATIO_BAND

# Numbers of the chosen step shown at the top: (column of the `steps` view, label).
KEY_METRICS = [
    ("reward_mean", "reward (mean)"), ("accuracy", "train accuracy"), ("entropy", "entropy"),
    ("kl", "KL to reference"), ("clip_low_frac", "clip low fraction"), ("clip_high_frac", "clip high fraction"),
    ("response_len_mean", "response length (mean)"), ("groups_filtered", "filtered groups"), ("loss", "loss"),
]
GROUP_COLUMNS = ["group_id", "prompt", "answer", "size", "reward_mean", "reward_std", "accuracy", "length_mean",
                 "outcome", "filtered", "filter_reason"]
COMPLETION_COLUMNS = ["rollout_id", "index_in_group", "completion", "reward", "advantage", "length", "truncated",
                      "filtered"]
PLOT_CONFIG = {"displaylogo": False, "responsive": True}
TOKENS_JS = "".join((Path(__file__).parent / name).read_text() for name in ("token_spans.js", "report_tokens.js"))
STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px auto; max-width: 1200px;
       padding: 0 16px; color: #222; }
h1 { font-size: 24px; } h2 { font-size: 19px; margin-top: 32px; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0; }
th, td { border: 1px solid #ddd; padding: 3px 7px; text-align: left; vertical-align: top; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.text { white-space: pre-wrap; font-family: ui-monospace, Menlo, Consolas, monospace; }
.meta { color: #555; } details { margin: 6px 0; } summary { cursor: pointer; }
"""


class ReportError(ValueError):
    """The report cannot be made as asked (unknown run, step not logged, ...): the message says what is accepted."""


def _cell(value) -> tuple[str, str]:
    """(css class, escaped text) of one table cell."""
    if isinstance(value, str):
        return "text", html.escape(value)
    if hasattr(value, "item"):  # numpy scalars
        value = value.item()
    if is_missing(value):
        return "num", "–"
    if isinstance(value, bool):
        return "", "yes" if value else "no"
    if isinstance(value, float):
        return "num", f"{value:.4g}"
    if isinstance(value, int):
        return "num", str(value)
    return "text", html.escape(str(value))


def html_table(frame: pd.DataFrame) -> str:
    """A DataFrame as an HTML table; every cell escaped, numbers to 4 significant digits."""
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in frame.columns)
    rows = []
    for record in frame.itertuples(index=False):
        cells = (_cell(v) for v in record)
        rows.append("<tr>" + "".join(f'<td class="{cls}">{text}</td>' for cls, text in cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _script_json(value) -> str:
    """`value` as a JavaScript literal inside a <script> element: JSON with every '<' escaped, so that no logged
    text can close the element (or open a comment), and every character past ASCII escaped (U+2028 and U+2029 end
    a line in older JavaScript)."""
    return json.dumps(value, ensure_ascii=True).replace("<", "\\u003c")


class _Page:
    """The report being assembled: HTML pieces, and figures turned into nonce-carrying scripts."""

    def __init__(self) -> None:
        self.nonce = secrets.token_urlsafe(16)
        self.parts: list[str] = []
        self.figures = 0

    def add(self, markup: str) -> None:
        self.parts.append(markup)

    def figure(self, figure) -> None:
        """A plotly figure drawn from inline data. plotly's JSON writer escapes '<', '>' and '/', so no text in
        the data can close the script element. The figure is drawn with plotly's own template: a figure built
        inside the dashboard's server gets Streamlit's placeholder theme as its default, which only
        `st.plotly_chart` fills in, and the downloaded report must equal `policylens report`'s."""
        figure.layout.template = pio.templates["plotly"]
        self.figures += 1
        div = f"pl-figure-{self.figures}"
        data = pio.to_json(figure, validate=False)
        self.add(f'<div id="{div}" class="pl-figure"></div><script nonce="{self.nonce}">(function () {{'
                 f"var f = {data}; Plotly.newPlot({json.dumps(div)}, f.data, f.layout, {json.dumps(PLOT_CONFIG)});"
                 "})();</script>")

    def tokens(self, tokens: pd.DataFrame, channels: list[str]) -> None:
        """A rollout's tokens in one folded block per channel (the first one open), drawn by `token_spans.js` in the
        reader's browser when a block is opened: the texts and hover texts are written once, and a colour per token
        and channel (a 16,384-token completion's 13 channels written out as spans made a 105 MB file)."""
        marks = token_marks(tokens) | {"block_style": TOKENS_STYLE, "token_style": TOKEN_STYLE}
        colours = {}
        for name in channels:
            colours[name] = token_colours(tokens, name)
            self.add(f'<details class="pl-channel" data-channel="{html.escape(name)}"'
                     f'{" open" if name == channels[0] else ""}><summary>coloured by '
                     f'{html.escape(CHANNELS[name].label)}</summary><div class="pl-tokens"></div>'
                     f'{colour_legend_html(CHANNELS[name], colours[name]["low"], colours[name]["high"])}</details>')
        self.add(f'<script nonce="{self.nonce}">{TOKENS_JS}\n'
                 f"drawChannelBlocks({_script_json(marks)}, {_script_json(colours)});</script>")

    def html(self, title: str) -> str:
        policy = (f"default-src 'none'; script-src 'nonce-{self.nonce}'; style-src 'unsafe-inline'; "
                  "img-src data: blob:; font-src data:")
        return (
            "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f'<meta http-equiv="Content-Security-Policy" content="{policy}">'
            f"<title>{html.escape(title)}</title><style>{STYLE}</style>"
            f'<script nonce="{self.nonce}">{plotly_bundle.served_script()}</script></head><body>'
            + "".join(self.parts) + "</body></html>\n"
        )


def _run_row(reader, logs_dir: str, run: str) -> pd.Series:
    runs = data.runs_table(reader)
    found = runs[runs["run"] == run]
    if found.empty:
        known = ", ".join(runs["run"]) or "none"
        raise ReportError(f"no run {run!r} in {logs_dir} (runs: {known})")
    return found.iloc[0]


def _choose_step(reader, run: str, step: int | None) -> int:
    steps = data.step_numbers(reader, run)
    if not steps:
        raise ReportError(f"run {run!r} has not logged any step yet")
    if step is None:
        return steps[-1]
    if step not in steps:
        listed = f"{steps[0]}..{steps[-1]}" if steps == list(range(steps[0], steps[-1] + 1)) else str(steps)
        raise ReportError(f"run {run!r} has no step {step}; logged steps: {listed}")
    return step


def _choose_rollout(rollouts: pd.DataFrame, rollout_id: int | None, step: int) -> pd.Series:
    """The asked rollout, or by default the trained one with the largest |advantage| (it moved the policy most)."""
    if rollout_id is not None:
        found = rollouts[rollouts["rollout_id"] == rollout_id]
        if found.empty:
            raise ReportError(f"step {step} has no rollout {rollout_id}; its rollouts are "
                              f"{int(rollouts['rollout_id'].min())}..{int(rollouts['rollout_id'].max())}")
        return found.iloc[0]
    rollouts = rollouts[rollouts["rollout_id"].notna()]  # without an id a rollout's tokens cannot be found
    if rollouts.empty:
        raise ReportError(f"step {step} has no rollout logged with a rollout_id")
    train = rollouts[(rollouts["kind"] == "train") & ~rollouts["filtered"].fillna(False).astype(bool)]
    pool = train if len(train) else rollouts
    return pool.loc[pool["advantage"].abs().fillna(0).idxmax()]


def _config_table(run: str, config) -> pd.DataFrame:
    """Every config field of the run (nested keys joined with dots) and its value."""
    flat = data.config_diff(pd.DataFrame({"run": [run], "config": [config]}))  # one run: nothing to diff away
    values = flat[run] if run in flat.columns else pd.Series(dtype=object)
    return pd.DataFrame({"field": values.index, "value": values.to_numpy()})


def build_report(logs_dir: str, run: str, step: int | None = None, rollout_id: int | None = None,
                 channel: str = "advantage", reader=None) -> str:
    """The report of `run` at `step` (default: its last step) as one HTML document.

    `rollout_id` picks the rollout shown token by token (default: the step's trained rollout with the largest
    |advantage|); `channel` colours it first (the other channels follow, folded); `reader`: an open reader of
    `logs_dir` (the dashboard's shared one), else one is opened for this report. Raises ReportError.
    """
    if channel not in CHANNELS:
        raise ReportError(f"unknown channel {channel!r}; channels: {', '.join(CHANNELS)}")
    if reader is None:
        with data.open_reader(logs_dir) as own:
            return build_report(logs_dir, run, step, rollout_id, channel, reader=own)
    info = _run_row(reader, logs_dir, run)
    step = _choose_step(reader, run, step)
    steps = data.run_steps(reader, (run,))
    rollouts = data.step_rollouts(reader, run, step)
    if rollouts.empty and rollout_id is not None:
        raise ReportError(f"step {step} of run {run!r} logged no rollouts")
    rollout = None if rollouts.empty else _choose_rollout(rollouts, rollout_id, step)

    page = _Page()
    page.add(f"<h1>PolicyLens run {html.escape(run)}</h1>")
    last = int(steps["step"].max())
    page.add(f'<p class="meta">{html.escape(plain(info["algorithm"]))} · task {html.escape(plain(info["task"]))} · '
             f'{html.escape(plain(info["status"]))} · steps {int(steps["step"].min())}..{last} · '
             f"this report looks at step {step} · model: {html.escape(plain(info['model']))}</p>")
    _key_numbers(page, steps, step)
    page.add("<h2>Curves</h2>")
    page.figure(charts.metric_curves(steps))
    if rollout is None:
        page.add(f"<h2>Groups of step {step}</h2><p>No rollouts were logged at this step.</p>")
    else:
        _groups(page, reader, run, step, rollouts)
        _rollout(page, reader, run, step, rollout, channel)
        _clipping(page, reader, run, step, str(info["algorithm"]))
        _mismatch(page, reader, run, step)
    page.add("<h2>Config</h2>")
    page.add(html_table(_config_table(run, info["config"])))
    return page.html(f"PolicyLens · {run} · step {step}")


def _key_numbers(page: _Page, steps: pd.DataFrame, step: int) -> None:
    row = steps[steps["step"] == step].iloc[0]
    numbers = [(label, row[col]) for col, label in KEY_METRICS if col in row.index and pd.notna(row[col])]
    evaluated = steps[(steps["step"] <= step) & steps["heldout_accuracy"].notna()]
    if len(evaluated):
        latest = evaluated.iloc[-1]
        numbers.insert(0, (f"held-out accuracy (greedy, step {int(latest['step'])})", latest["heldout_accuracy"]))
    page.add(f"<h2>Step {step}</h2>")
    page.add(html_table(pd.DataFrame(numbers, columns=["metric", "value"])))


def _groups(page: _Page, reader, run: str, step: int, rollouts: pd.DataFrame) -> None:
    train = rollouts[rollouts["kind"] == "train"]
    groups = data.group_summary(reader, run, step)
    page.add(f"<h2>Groups of step {step}</h2>")
    page.figure(charts.step_distributions(train, f" at step {step}"))
    if groups.empty:
        page.add("<p>No train groups at this step.</p>")
        return
    page.add(html_table(groups[[c for c in GROUP_COLUMNS if c in groups.columns]]))
    for group in groups.itertuples(index=False):
        members = data.group_members(train, group.group_id)
        page.add(f"<details><summary>group {number(group.group_id, '.0f')} · {html.escape(str(group.outcome))} · "
                 f"reward mean {group.reward_mean:.3f}: {html.escape(str(group.prompt))}</summary>"
                 f"{html_table(members[COMPLETION_COLUMNS])}</details>")


def _rollout(page: _Page, reader, run: str, step: int, rollout: pd.Series, channel: str) -> None:
    rollout_id = int(rollout["rollout_id"])
    passes = data.rollout_passes(reader, run, step, rollout_id)
    pass_ = passes[-1] if passes else None
    whitening = data.step_whitening(reader, run, step)
    tokens = data.as_loss_used(data.rollout_tokens(reader, run, step, (rollout_id,), pass_), whitening)
    where = (f"group {number(rollout['group_id'], '.0f')} #{number(rollout['index_in_group'], '.0f')}"
             if rollout["kind"] == "train" else f"eval prompt {number(rollout['prompt_id'], '.0f')}")
    page.add(f"<h2>Rollout {rollout_id}, token by token</h2>")
    page.add(f'<p class="meta">{where} · reward {number(rollout["reward"], ".4g")} · advantage '
             f'{number(rollout["advantage"], "+.4g")} · {number(rollout["length"], ".0f")} tokens · '
             + (f"values of optimisation pass {pass_}" if pass_ is not None else "no optimisation pass used it")
             + " · hover a token for all its values</p>")
    page.add(f'<p>Prompt</p><pre class="pl-prompt">{html.escape(plain(rollout["prompt"]))}</pre>'
             f'<p class="meta">Reference answer: {html.escape(plain(rollout["answer"]))}</p>')
    if tokens.empty:
        page.add("<p>No tokens logged for this rollout.</p>")
        return
    logged = [name for name, c in CHANNELS.items() if c.column in tokens.columns and tokens[c.column].notna().any()]
    page.tokens(tokens, [channel] + [name for name in logged if name != channel])
    if "clip" in tokens.columns and tokens["clip"].notna().any():
        counts = tokens["clip"].fillna(0).astype(int).value_counts()
        page.add("<p>Clip events in this pass: "
                 + ", ".join(f"{CLIP_NAMES[c]} {counts.get(c, 0)}" for c in CLIP_EVENTS) + "</p>")
    if len(tokens) <= DEFAULT_WINDOW:
        page.figure(charts.token_channel_heatmap(tokens, logged))
        return
    # As the Token inspector: a long completion's heatmap at screen resolution (token by token, a 16k-token one's
    # was 5.8 MB of the report)
    bins = data.as_loss_used(data.rollout_token_bins(reader, run, step, rollout_id, pass_, OVERVIEW_BINS), whitening)
    page.add(f'<p class="meta">Token × channel: the whole completion, each column the mean of '
             f"{int(bins['tokens'].max())} tokens or fewer (each token's own values: hover it above).</p>")
    page.figure(charts.token_channel_bins(bins, logged))


def _clipping(page: _Page, reader, run: str, step: int, algorithm: str) -> None:
    page.add(f"<h2>Clipping and gradient weight at step {step}</h2>")
    passes = data.step_pass_summary(reader, run, step)
    if passes.empty:
        page.add("<p>No optimisation pass was logged at this step.</p>")
        return
    page.add("<p>Per optimisation pass, over the tokens it trained on: the fraction clipped low, high and by a dual "
             "clip or cap, and the mean |gradient weight| (−∂loss/∂log π per token).</p>")
    page.add(html_table(passes))
    page.figure(charts.clip_fractions(passes.assign(algorithm=[f"pass {p}" for p in passes["pass"]])))
    totals = data.rollout_total_weights(reader, run, step)
    page.add("<p>Each trained completion's summed gradient weight (its last pass) against its length.</p>")
    page.figure(charts.total_weight_vs_length(
        totals.assign(algorithm=algorithm, completion=[f"rollout {r}" for r in totals["rollout_id"]])))


def _mismatch(page: _Page, reader, run: str, step: int) -> None:
    """The step's sampler/trainer mismatch, as the Mismatch page shows it (nothing for a run without sampler
    log-probs)."""
    tokens = data.sampler_tokens(reader, run, step)
    if tokens.empty:
        return
    # What the report shows of the page's view (`mismatch.step_mismatch`), without the scatter's points and the
    # per-rollout table it leaves out (0.03-0.05 s of the report of a step of long completions).
    numbers, worst = mismatch.summary(tokens), mismatch.by_text(tokens)
    low, high = RATIO_BAND
    page.add(f"<h2>Sampler/trainer mismatch at step {step}</h2>")
    page.add(f"<p>log-ratio = old_logp − sampler_logp = log(π_trainer / π_sampler) of each trained token; a token is "
             f"outside the band when its ratio leaves [{low:g}, {high:g}].</p>")
    labels = {"tokens": "tokens", "sequences": "sequences", "mean_log_ratio": "mean log-ratio",
              "mean_abs_log_ratio": "mean |log-ratio|", "max_abs_log_ratio": "max |log-ratio|",
              "out_of_band": f"share outside [{low:g}, {high:g}]",
              "truncation_share": "share of mean |log-ratio| from top-p / top-k truncation"}
    page.add(html_table(pd.DataFrame([(labels[k], v) for k, v in numbers.items()], columns=["metric", "value"])))
    page.figure(charts.mismatch_histogram(mismatch.histogram(tokens["log_ratio"].to_numpy(dtype=float)), RATIO_BAND))
    page.figure(charts.mismatch_buckets(mismatch.buckets(tokens)))
    page.add("<p>Token texts with the most tokens outside the band (their worst occurrence: rollout, position).</p>")
    page.add(html_table(worst.assign(token_text=worst["token_text"].map(charts.token_as_text))))


def write_report(text: str, path: str | os.PathLike) -> int:
    """Write the report atomically (a failure leaves any previous file whole); returns its size in bytes."""
    path = Path(path)
    if path.is_dir():
        raise ReportError(f"{path} is a folder; give a file name such as {path / 'report.html'}")
    if not path.parent.is_dir():
        raise ReportError(f"no folder {path.parent} to write {path.name} into")
    data = text.encode("utf-8")
    # Not tempfile.mkstemp: its file is private (0600), and a report is made to be shared.
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(temporary, "xb") as out:
            out.write(data)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return len(data)
