"""Dashboard pages under streamlit's AppTest, on a run trained by the engine (fixtures in conftest.py).

Each test renders a page of the real app (dashboard/streamlit_app.py with st.navigation) and checks that it raises
nothing and that what it shows equals what an independent DuckDB query over the run's Parquet files returns.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import time
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import pytest
import streamlit as st
import torch
from streamlit.testing.v1 import AppTest
from synthetic_runs import AUTOLINK_OR_SHORTCODE, HOSTILE_TEXTS, write_hostile_run
from test_readme import readme_logging_example

from dashboard import queries, recompute
from dashboard.common import WORD_JOINER
from engine.objectives import ALGORITHMS, CLIP_HIGH, CLIP_LOW, OBJECTIVES, policy_loss

APP = str(Path(__file__).resolve().parent.parent / "dashboard" / "streamlit_app.py")
TIMEOUT = 120  # the first page that imports torch takes a few seconds on a busy machine


# ---------------------------------------------------------------- helpers


def independent(logs_dir, table: str, where: str = "", params: list | None = None) -> pd.DataFrame:
    """Read a table straight from the run's Parquet files with a fresh DuckDB connection (not the app's reader)."""
    # Every Parquet file of that table under the runs' data folders, skipping in-progress (dot) folders.
    files = sorted(str(p) for p in Path(logs_dir).glob(f"*/data/**/{table}.parquet")
                   if not any(part.startswith(".") for part in p.relative_to(logs_dir).parts))
    con = duckdb.connect()
    # Compaction may leave both step folders and the chunk that merged them for a moment: keep unique rows.
    query = f"SELECT DISTINCT * FROM read_parquet(?, union_by_name=true, hive_partitioning=false) {where}"
    frame = con.execute(query, [files, *(params or [])]).df()
    con.close()
    return frame


def open_page(logs_dir, page: str | None, monkeypatch, **query) -> AppTest:
    monkeypatch.setenv("POLICYLENS_LOGS_DIR", str(logs_dir))
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    for key, value in query.items():
        at.query_params[key] = str(value)
    at.run()
    if page is not None:
        at.switch_page(f"app_pages/{page}.py").run()
    assert not at.exception, [e.message for e in at.exception]
    return at


def dataframe(at: AppTest, *columns: str) -> pd.DataFrame:
    """The first table on the page that has all these columns (read-only tables carry no key in AppTest)."""
    for frame in at.dataframe:
        value = frame.value
        if all(c in value.columns for c in columns):
            return value
    raise AssertionError(f"no table with columns {columns}")


def open_token_values(at: AppTest) -> AppTest:
    """Open the Token inspector's table of values (filled only while open), as a click on its expander does."""
    at.session_state["token_values_open"] = True
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    return at


def table(at: AppTest, *columns: str) -> pd.DataFrame:
    """The first static table (`common.static_table`) that has all these columns, as the reader sees its cells
    (markdown escapes resolved): strings, numbers as formatted."""
    for element in at.table:
        value = element.value
        value = pd.DataFrame({shown(str(c)): [shown(str(v)) for v in value[c]] for c in value.columns})
        if all(c in value.columns for c in columns):
            return value
    raise AssertionError(f"no static table with columns {columns}")


def array(field) -> np.ndarray:
    """A plotly JSON array: a list, or plotly 6's typed array {"dtype": ..., "bdata": base64}."""
    if isinstance(field, dict) and "bdata" in field:
        return np.frombuffer(base64.b64decode(field["bdata"]), dtype=np.dtype(field["dtype"]))
    return np.asarray(field)


def heatmap_cells(traces: list[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The cells of one heatmap drawn as traces side by side (`dashboard.charts.column_runs`): its z (rows,
    columns), each column's centre and width (NaN for columns given as an x array, whose widths plotly infers)."""
    zs, centres, widths = [], [], []
    for trace in traces:
        z = array(trace["z"]).astype(float)
        if isinstance(trace["z"], dict) and "shape" in trace["z"]:
            z = z.reshape([int(n) for n in str(trace["z"]["shape"]).split(",")])
        z = z.reshape(1, -1) if z.ndim == 1 else z
        columns = z.shape[1]
        if "x" in trace:
            centres.append(array(trace["x"]).astype(float))
            widths.append(np.full(columns, np.nan))
        else:
            centres.append(trace["x0"] + trace["dx"] * np.arange(columns))
            widths.append(np.full(columns, float(trace["dx"])))
        zs.append(z)
    return np.concatenate(zs, axis=1), np.concatenate(centres), np.concatenate(widths)


def drawn_figures(at: AppTest) -> dict[str, dict]:
    """Every plotly figure of the page, as plotly JSON by element id (which ends with its key): the components of
    `dashboard.figures.show`, and Streamlit's charts (its fallback)."""
    figures = {}
    for element in at.get("bidi_component"):
        if not element.proto.component_name.endswith("policylens_figure"):
            continue
        data = json.loads(element.proto.json)
        figure = json.loads(data["figure"])
        shapes = json.loads(data["shapes"])  # sent apart (figure.js moves them alone when nothing else changed)
        figures[element.proto.id] = figure | {"layout": figure["layout"] | {"shapes": shapes}} if shapes else figure
    return figures | {chart.proto.id: json.loads(chart.proto.spec) for chart in at.get("plotly_chart")}


def shown_tokens(at: AppTest) -> dict:
    """What the Token inspector's token component (dashboard.token_view) was given: by token its `position`,
    `text` (whitespace made visible), `colour`, `clip`, `rejected` and hover `heading`; the hover values by column
    (`hover`: names and values)."""
    [element] = [e for e in at.get("bidi_component") if e.proto.component_name.endswith("policylens_tokens")]
    return json.loads(element.proto.json)


def shown_groups(at: AppTest) -> list[dict]:
    """What the Groups page's component (dashboard.group_view) was given: by group its `head` line ([text, bold]
    pieces), `prompt` and `members`, each with its `head`, `reward`, `text`, `note`, `rollout` and `link`."""
    [element] = [e for e in at.get("bidi_component") if e.proto.component_name.endswith("policylens_groups")]
    return json.loads(element.proto.json)["groups"]


def groups_text(at: AppTest) -> str:
    """Every string the Groups page's component shows, one line each."""
    def line(pieces):
        return "".join(text for text, _ in pieces)

    return "\n".join(
        "\n".join([line(group["head"]), group["prompt"]] + [
            "\n".join([line(m["head"]), m["reward"], m["text"], m["note"]]) for m in group["members"]])
        for group in shown_groups(at))


def plotly_spec(at: AppTest, key: str) -> dict:
    for element_id, spec in drawn_figures(at).items():
        if key in element_id:
            return spec
    raise AssertionError(f"no plotly figure with key {key!r}")


# ---------------------------------------------------------------- the runs used


@pytest.fixture(scope="module")
def trained(tiny_run):
    """(logs_dir, run) of a tiny GRPO run trained by the engine (tests/conftest.py)."""
    return str(tiny_run[0]), tiny_run[1]


@pytest.fixture(scope="module")
def trained_prm(tiny_process_run):
    """(logs_dir, run) of a tiny process-supervised run trained by the engine."""
    return str(tiny_process_run[0]), tiny_process_run[1]


def last_step(logs_dir, run) -> int:
    return int(independent(logs_dir, "steps", "WHERE run = ?", [run])["step"].max())


def a_mixed_rollout(logs_dir, run, step) -> int:
    """A train rollout of a group with both good and bad answers (non-zero advantages), highest advantage."""
    rollouts = independent(logs_dir, "rollouts", "WHERE run = ? AND step = ? AND kind = 'train'", [run, step])
    spread = rollouts.groupby("group_id")["reward"].transform(lambda r: r.max() - r.min())
    candidates = rollouts[spread > 0] if (spread > 0).any() else rollouts
    return int(candidates.sort_values("advantage", ascending=False)["rollout_id"].iloc[0])


# ---------------------------------------------------------------- pages


def test_runs_page_lists_the_run_with_its_logged_values(trained, monkeypatch):
    logs_dir, run = trained
    at = open_page(logs_dir, None, monkeypatch)
    assert [h.value for h in at.header] == ["Runs"]
    table = dataframe(at, "run", "last_step", "steps_logged")
    row = table[table["run"] == run].iloc[0]
    steps = independent(logs_dir, "steps", "WHERE run = ?", [run])
    assert int(row["last_step"]) == int(steps["step"].max())
    assert int(row["steps_logged"]) == len(steps)
    meta = json.loads((Path(logs_dir) / run / "run.json").read_text())
    assert row["algorithm"] == meta["algorithm"]
    # The curves plot exactly the logged reward means.
    spec = plotly_spec(at, "run_curves")
    reward = next(t for t in spec["data"] if t["name"] == run and t.get("xaxis", "x") == "x")
    logged = steps.sort_values("step").dropna(subset=["reward_mean"])  # steps without a reward are not drawn
    np.testing.assert_allclose(array(reward["x"]), logged["step"].to_numpy())
    np.testing.assert_allclose(array(reward["y"]), logged["reward_mean"].to_numpy(), rtol=1e-9)
    assert at.query_params["run"] == run


def test_token_inspector_shows_the_logged_tokens_escaped_with_clip_marks(trained, monkeypatch):
    logs_dir, run = trained
    step = last_step(logs_dir, run)
    rollout = a_mixed_rollout(logs_dir, run, step)
    at = open_page(logs_dir, "token_inspector", monkeypatch, run=run, step=step, rollout=rollout, channel="ratio")
    assert at.query_params["rollout"] == str(rollout)
    tokens = independent(logs_dir, "tokens", "WHERE run = ? AND step = ? AND rollout_id = ? ORDER BY position",
                         [run, step, rollout])
    passes = independent(logs_dir, "token_passes", "WHERE run = ? AND step = ? AND rollout_id = ?",
                         [run, step, rollout])
    spans = shown_tokens(at)
    with pytest.raises(AssertionError, match="no table"):  # the table of values is sent only once opened
        dataframe(at, "token_text", "old_logp")
    open_token_values(at)
    assert spans["position"] == tokens["position"].tolist()
    for shown, text in zip(spans["text"], tokens["token_text"], strict=True):
        expected = text.replace(" ", "·").replace("\t", "→").replace("\r", "␍")
        assert shown == expected.replace("\n", "↵\n")
    if len(passes):
        last = passes[passes["pass"] == passes["pass"].max()].sort_values("position")
        assert spans["clip"] == last["clip"].astype(int).tolist()
        values = dataframe(at, "token_text", "ratio", "old_logp")
        np.testing.assert_allclose(values["ratio"].to_numpy(), last["ratio"].to_numpy(), rtol=1e-9)
    shown = dataframe(at, "token_text", "ratio", "old_logp")
    assert shown["token_text"].tolist() == tokens["token_text"].tolist()
    np.testing.assert_allclose(shown["old_logp"].to_numpy(), tokens["old_logp"].to_numpy(), rtol=1e-9)
    # The rollout picker names every rollout of the step by its group (or eval prompt), reward, advantage, length.
    rows = independent(logs_dir, "rollouts", "WHERE run = ? AND step = ?", [run, step])
    assert sorted(at.selectbox(key="rollout").options) == sorted(
        f"{r.rollout_id}: " + (f"eval prompt {r.prompt_id}" if r.kind == "eval" else
                               f"group {r.group_id} #{r.index_in_group}")
        + f" · reward {r.reward:.3g} · A {r.advantage:+.3g} · {r.length:.0f} tok" for r in rows.itertuples())


def test_groups_page_matches_the_group_statistics(trained, monkeypatch):
    logs_dir, run = trained
    step = last_step(logs_dir, run)
    at = open_page(logs_dir, "groups", monkeypatch, run=run, step=step)
    shown = dataframe(at, "group_id", "reward_mean", "outcome").set_index("group_id")
    rollouts = independent(logs_dir, "rollouts", "WHERE run = ? AND step = ? AND kind = 'train'", [run, step])
    expected = rollouts.groupby("group_id")["reward"].agg(["mean", "std", "size"]).fillna(0.0)
    assert sorted(shown.index) == sorted(expected.index)
    np.testing.assert_allclose(shown.loc[expected.index, "reward_mean"], expected["mean"], rtol=1e-9)
    np.testing.assert_allclose(shown.loc[expected.index, "reward_std"], expected["std"], rtol=1e-9, atol=1e-12)
    assert (shown.loc[expected.index, "size"] == expected["size"]).all()
    # Every completion of the shown groups is on the page, with its link to its tokens.
    members = [m for group in shown_groups(at) for m in group["members"]]
    first_group = rollouts[rollouts["group_id"] == shown.index[0]]
    assert all(c in [m["text"] for m in members] for c in first_group["completion"])
    member = members[0]
    assert member["link"] == f"tokens?run={run}&step={step}&rollout={member['rollout']}"
    # The text search keeps the groups with a matching prompt or completion.
    needle = first_group["completion"].iloc[0][:3]
    at.text_input[0].set_value(needle).run()
    assert not at.exception
    found = dataframe(at, "group_id", "reward_mean", "outcome")
    matching = rollouts[rollouts["prompt"].str.contains(needle, regex=False)
                        | rollouts["completion"].str.contains(needle, regex=False)]["group_id"].unique()
    assert sorted(found["group_id"]) == sorted(matching)
    at.text_input[0].set_value("").run()
    # The outcome filter keeps only what it says.
    at.multiselect[0].set_value(["all wrong"]).run()
    assert not at.exception
    filtered = dataframe(at, "group_id", "reward_mean", "outcome")
    assert set(filtered["outcome"]) <= {"all wrong"}


def test_replay_follows_an_eval_prompt_across_steps(trained, monkeypatch):
    logs_dir, run = trained
    at = open_page(logs_dir, "replay", monkeypatch, run=run)
    assert [h.value for h in at.header] == ["Replay"]
    evals = independent(logs_dir, "rollouts", "WHERE run = ? AND kind = 'eval'", [run])
    if evals.empty:
        pytest.skip("the tiny run logged no eval rollouts")
    prompt_id = int(evals["prompt_id"].min())
    history = table(at, "step", "sample", "completion", "at")
    expected = evals[evals["prompt_id"] == prompt_id].sort_values(["step", "index_in_group"])
    assert history["completion"].tolist() == expected["completion"].tolist()
    np.testing.assert_allclose(history["reward"].astype(float), expected["reward"], rtol=1e-3)  # 4 digits shown
    # Moving the replay slider redraws the distributions of that step.
    steps = sorted(independent(logs_dir, "steps", "WHERE run = ?", [run])["step"].unique())
    if len(steps) > 1:
        at.select_slider(key="replay_step").set_value(int(steps[0])).run()
        assert not at.exception
        spec = plotly_spec(at, "replay_distributions")
        train = independent(logs_dir, "rollouts", "WHERE run = ? AND step = ? AND kind = 'train'",
                            [run, int(steps[0])])
        drawn = array(spec["data"][0]["x"]).tolist() if spec["data"] else []  # a step may have no train rollouts
        assert sorted(drawn) == sorted(train["reward"].tolist())
        # Play: each tick of the replay fragment moves one step on (AppTest runs the fragment once per run).
        at.toggle(key="replay_playing").set_value(True).run()
        assert not at.exception
        assert at.session_state["replay_step"] == int(steps[1])
        # Playing on the last step stops the play (its toggle was set after being drawn: an exception).
        at.select_slider(key="replay_step").set_value(int(steps[-1])).run()
        assert not at.exception, [e.message for e in at.exception]
        assert at.session_state["replay_playing"] is False and at.session_state["replay_step"] == int(steps[-1])


def test_prm_page_shows_logged_step_rewards_and_the_worked_example_sandbox(trained_prm, monkeypatch):
    logs_dir, run = trained_prm
    step = last_step(logs_dir, run)
    at = open_page(logs_dir, "prm_steps", monkeypatch, run=run, step=step)
    rollout = int(at.selectbox(key="prm_rollout").value)
    group = independent(logs_dir, "rollouts", "WHERE run = ? AND step = ? AND rollout_id = ?",
                        [run, step, rollout])["group_id"].iloc[0].item()
    members = independent(logs_dir, "rollouts", "WHERE run = ? AND step = ? AND group_id = ? AND kind = 'train'",
                          [run, step, group])["rollout_id"].tolist()
    steps = independent(logs_dir, "prm_steps", "WHERE run = ? AND step = ?", [run, step])
    steps = steps[steps["rollout_id"].isin(members)].sort_values(["rollout_id", "step_index"])
    shown = dataframe(at, "completion", "step_index", "reward_norm")
    np.testing.assert_allclose(shown["reward_raw"], steps["reward_raw"], rtol=1e-9)
    np.testing.assert_allclose(shown["reward_norm"], steps["reward_norm"], rtol=1e-9)
    # The sandbox, prefilled with the worked PRM example: normalized over all six step rewards (unbiased std).
    rewards = np.array([0.9, 0.95, 0.8, 0.9, -0.8, -0.9])
    normalized = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6)
    table = dataframe(at, "step 1 normalized")
    np.testing.assert_allclose(table.iloc[:, 1:].to_numpy().ravel(), normalized, rtol=1e-5)


def test_weighting_page_reports_what_policy_loss_computes(trained, monkeypatch):
    logs_dir, run = trained
    step = last_step(logs_dir, run)
    st.cache_data.clear()  # what the page reads and asks below is counted
    at = open_page(logs_dir, "algorithm_weighting", monkeypatch, run=run, step=step)
    group = int(at.query_params["group"])
    update = int(at.query_params["update"]) if "update" in at.query_params else None
    fractions = table(at, "algorithm", "low", "high").set_index("algorithm")
    # GRPO, DAPO, GSPO and ASPO to start with, in the registry's order; every other one but PPO (no critic) offered
    assert list(fractions.index) == ["grpo", "dapo", "gspo", "aspo"]
    assert at.multiselect(key="weigh_algorithms").options == [a for a in ALGORITHMS if not OBJECTIVES[a].critic]
    # Independently: build the (B, T) tensors from the files and ask policy_loss for GRPO's clip fractions.
    ids = independent(logs_dir, "rollouts", "WHERE run = ? AND step = ? AND group_id = ? AND kind = 'train'",
                      [run, step, group]).sort_values("rollout_id")["rollout_id"].tolist()
    tokens = independent(logs_dir, "tokens", "WHERE run = ? AND step = ?", [run, step])
    tokens = tokens[tokens["rollout_id"].isin(ids)]
    if update is not None:
        # Each completion's log-probs at its `update`-th pass (mini-batches: one pass per epoch per completion).
        passes = independent(logs_dir, "token_passes", "WHERE run = ? AND step = ?", [run, step])
        passes = passes[passes["rollout_id"].isin(ids)]
        nth = passes.groupby("rollout_id")["pass"].apply(lambda p: sorted(p.unique())[update])
        passes = passes[passes["pass"] == passes["rollout_id"].map(nth)]
        tokens = tokens.merge(passes[["rollout_id", "position", "new_logp"]], on=["rollout_id", "position"],
                              how="left")
    else:
        tokens = tokens.assign(new_logp=tokens["old_logp"])
    B, T = len(ids), int(tokens["position"].max()) + 1
    grids = {c: np.zeros((B, T)) for c in ("new_logp", "old_logp", "ref_logp", "advantage", "entropy", "mask")}
    for row in tokens.itertuples(index=False):
        i = ids.index(row.rollout_id)
        for c in ("new_logp", "old_logp", "ref_logp", "advantage", "entropy"):
            value = getattr(row, c)
            grids[c][i, row.position] = value if value == value else (row.old_logp if c == "new_logp" else 0.0)
        grids["mask"][i, row.position] = 1.0
    has_ref = tokens["ref_logp"].notna().any()
    out = policy_loss("grpo", torch.tensor(grids["new_logp"]), torch.tensor(grids["old_logp"]),
                      torch.tensor(grids["advantage"]), torch.tensor(grids["mask"]),
                      ref_logp=torch.tensor(np.where(grids["mask"] > 0, grids["ref_logp"], grids["new_logp"]))
                      if has_ref else None, entropy=torch.tensor(grids["entropy"]))
    codes = out.clip.numpy()[grids["mask"] > 0]
    # shown to 3 decimals
    assert float(fractions.loc["grpo", "low"]) == pytest.approx((codes == CLIP_LOW).mean(), abs=5e-4)
    assert float(fractions.loc["grpo", "high"]) == pytest.approx((codes == CLIP_HIGH).mean(), abs=5e-4)
    # Choosing more algorithms (in any order) lists them in the registry's order, and asks only the new ones; the
    # tokens are read at most once (none if the first view read them: `held_inputs` keeps the last ones), and not
    # again for one more algorithm; going back to the four asks nothing.
    asked, reads = [], []
    weigh, read = recompute.weigh, queries.weighed_tokens
    monkeypatch.setattr(recompute, "weigh", lambda batch, algo, knobs: asked.append(algo) or weigh(batch, algo, knobs))
    monkeypatch.setattr(queries, "weighed_tokens", lambda *key: reads.append(key) or read(*key))
    at.multiselect(key="weigh_algorithms").set_value(["gmpo", *reversed(fractions.index), "cispo"]).run()
    assert not at.exception
    chosen = ["grpo", "dapo", "gspo", "aspo", "cispo", "gmpo"]
    assert table(at, "algorithm", "low", "high")["algorithm"].tolist() == [a for a in ALGORITHMS if a in chosen]
    assert len({trace["xaxis"] for trace in plotly_spec(at, "weight_heatmaps")["data"]}) == len(chosen)  # panels
    assert sorted(asked) == ["cispo", "gmpo"] and len(reads) <= 1
    read_before = len(reads)
    at.multiselect(key="weigh_algorithms").set_value([*chosen, "sapo"]).run()
    assert not at.exception and sorted(asked) == ["cispo", "gmpo", "sapo"] and len(reads) == read_before
    at.multiselect(key="weigh_algorithms").set_value(list(fractions.index)).run()
    assert not at.exception and table(at, "algorithm", "low", "high")["algorithm"].tolist() == list(fractions.index)
    assert sorted(asked) == ["cispo", "gmpo", "sapo"] and len(reads) == read_before


# ---------------------------------------------------------------- behaviour


def test_unknown_run_in_the_url_is_explained_and_the_app_still_works(trained, monkeypatch):
    logs_dir, _ = trained
    # The unknown name also tries to smuggle a markdown image (fetched from anywhere) into the message.
    hostile = "no-such-run![x](http://127.0.0.1:9/x.png)"
    at = open_page(logs_dir, None, monkeypatch, run=hostile, step=999999, rollout=-5)
    warnings = " ".join(w.value for w in at.sidebar.warning)
    assert "![x](" not in warnings  # escaped: shown as text, not rendered
    assert hostile in shown(warnings) and "not in the logs folder" in warnings
    assert at.query_params["run"] in {r.name for r in Path(logs_dir).iterdir() if (r / "run.json").exists()}
    at.switch_page("app_pages/groups.py").run()
    assert not at.exception
    assert [h.value for h in at.header] == ["Groups"]
    # A rollout that does not exist in the link: said so, and the inspector shows an existing one.
    at.query_params["rollout"] = "123456789"
    at.switch_page("app_pages/token_inspector.py").run()
    assert not at.exception
    assert any("123456789" in w.value for w in at.warning)


def test_empty_logs_folder_offers_the_demo(tmp_path, monkeypatch):
    import engine.demo

    started = []
    monkeypatch.setattr(engine.demo, "start_demo", lambda logs_dir, **kw: started.append(logs_dir) or 1)
    monkeypatch.setattr(engine.demo, "running_supervisor", lambda logs_dir: None)
    monkeypatch.setattr(engine.demo, "demo_progress",
                        lambda logs_dir: {"running": True, "fraction": 0.0, "runs": [{"run": "x", "steps_done": 0}],
                                          "warm_start": {"step": 250, "steps": 1000, "loss": 0.8125}})
    at = open_page(tmp_path, None, monkeypatch)
    text = " ".join(m.value for m in at.markdown)
    assert "No runs in" in text and "policylens demo" in " ".join(c.value for c in at.code)
    at.button[0].click().run()
    assert not at.exception
    assert started == [str(tmp_path.resolve())]
    bars = {bar.proto.text: bar.proto.value for bar in at.get("progress")}
    assert bars == {"warm start (supervised fine-tuning, shared by every demo run): step 250 of 1000, loss 0.812": 25,
                    "demo training: 0%": 0}


def test_damaged_and_crashed_runs_are_reported_and_the_rest_works(trained, tmp_path, monkeypatch):
    logs_dir, run = trained
    copy = tmp_path / "logs"
    shutil.copytree(logs_dir, copy)
    # Damage one tokens file, and leave run.json saying "running" with no live writer holding the lock: a crash.
    victim = sorted((copy / run / "data").glob("**/tokens.parquet"))[0]
    victim.write_bytes(b"not parquet at all")
    meta = json.loads((copy / run / "run.json").read_text())
    meta["status"] = "running"
    (copy / run / "run.json").write_text(json.dumps(meta))
    at = open_page(copy, "token_inspector", monkeypatch, run=run)
    assert any("crashed" in e.value for e in at.sidebar.error)
    assert any("left out" in e.label for e in at.sidebar.expander)
    for page in ("groups", "runs"):  # the rest still works
        at.switch_page(f"app_pages/{page}.py").run()
        assert not at.exception, [e.message for e in at.exception]


def test_a_running_run_shows_new_steps_on_the_next_rerun(tmp_path, monkeypatch):
    from synthetic_runs import synthetic_step

    from dashboard.queries import LIVE_TTL
    from engine.runlog import RunWriter

    writer = RunWriter.create(tmp_path, "live", algorithm="grpo", task="linear", config={}, model="m")
    rng = np.random.default_rng(0)
    # Just created, nothing logged yet: listed and marked running, step pages say they wait for a step.
    at = open_page(tmp_path, "groups", monkeypatch)
    assert any("training" in s.value for s in at.sidebar.success)  # a running run is marked
    assert any("has not logged any step yet" in i.value for i in at.info)
    writer.log_step(0, **synthetic_step(0, 2, 2, 8, 1, rng))
    writer.flush()  # on disk: what the page waits for is its cache, not the writer thread
    # The run list is cached for LIVE_TTL seconds; clearing st.cache_data from the test did not reliably reach the
    # app's caches under AppTest (the page then still showed no step, about one run in three): wait, as the app does.
    time.sleep(LIVE_TTL + 0.2)
    at.run()
    assert not at.exception and at.query_params["step"] == "0"
    assert [h.value for h in at.header] == ["Groups"]
    writer.log_step(1, **synthetic_step(1, 2, 2, 8, 1, rng))
    writer.flush()  # on disk: what the page waits for is its cache, not the writer thread
    time.sleep(LIVE_TTL + 0.2)
    at.run()
    assert not at.exception
    assert at.query_params["step"] == "1"  # following the newest step
    writer.close()


# ---------------------------------------------------------------- hostile and incomplete runs

PAGES = {"runs": "Runs", "replay": "Replay", "groups": "Groups", "token_inspector": "Token inspector",
         "prm_steps": "PRM steps", "advantages": "Advantages", "algorithm_weighting": "Algorithm weighting",
         "token_stats": "Token statistics", "token_trajectories": "Token trajectories", "mismatch": "Mismatch"}


def markdown_bodies(at: AppTest) -> list[str]:
    """Every text of the page (main area and sidebar) that Streamlit renders as markdown."""
    bodies = [e.value for kind in ("title", "header", "subheader", "markdown", "caption", "info", "warning", "error",
                                   "success") for e in getattr(at, kind)]
    bodies += [e.label for e in at.expander] + [e.label for e in at.metric]
    bodies += [e.proto.label for e in at.get("page_link")]
    for element in at.table:  # static tables render markdown in every header and cell
        bodies += [str(c) for c in element.value.columns] + [str(v) for v in element.value.to_numpy().ravel()]
    return bodies


def shown(body: str) -> str:
    """The characters a reader sees for a markdown body: backslash escapes resolved, word joiners dropped."""
    return re.sub(r"\\([!-/:-@\[-`{-~])", r"\1", body).replace(WORD_JOINER, "")


def assert_no_markup_from_logged_text(at: AppTest) -> str:
    """No markdown body can start a link, an image, HTML, a formula, an autolink or a shortcode; returns all the
    shown text of the page, to check that the logged text is there."""
    for body in markdown_bodies(at):
        assert "![" not in body and "](" not in body, body
        assert not re.search(r"(?<!\\)[$<]", body), body
        assert not AUTOLINK_OR_SHORTCODE.search(re.sub(r"\\(.)", r"\1", body)), body
    return "\n".join(shown(body) for body in markdown_bodies(at))


@pytest.fixture(scope="module")
def hostile_logs(tmp_path_factory):
    logs = tmp_path_factory.mktemp("hostile")
    write_hostile_run(str(logs), "hostile")
    return str(logs)


def test_logged_text_is_shown_as_text_on_every_page(hostile_logs, monkeypatch):
    hostile = " ".join(HOSTILE_TEXTS)
    rollouts = independent(hostile_logs, "rollouts", "WHERE step = 1 ORDER BY rollout_id")
    filtered = int(rollouts[rollouts["filtered"]]["rollout_id"].iloc[0])
    for page, query in [("runs", {}), ("replay", {}), ("groups", {}), ("prm_steps", {}),
                        ("token_inspector", {"rollout": filtered}), ("algorithm_weighting", {}),
                        ("advantages", {}), ("token_stats", {}), ("token_trajectories", {}), ("mismatch", {})]:
        at = open_page(hostile_logs, page, monkeypatch, run="hostile", step=1, **query)
        assert [h.value for h in at.header] == [PAGES[page]]
        text = assert_no_markup_from_logged_text(at)
        assert HOSTILE_TEXTS[0] in text  # the task, in the sidebar
        if page == "groups":  # the filter reason: in the step's summary line and on the dropped group's box
            assert hostile in text and f"dropped ({hostile})" in groups_text(at), (text, groups_text(at))
        if page == "token_inspector":
            assert f"Reference answer: {hostile}" in text and f"Filtered from the update: {hostile}" in text
        if page == "replay":
            assert f"Solve {hostile}" in text
            completions = table(at, "completion", "reward")["completion"].tolist()  # a static table: markdown
            assert completions and all(c in HOSTILE_TEXTS for c in completions), completions


@pytest.fixture(scope="module")
def minimal_logs(tmp_path_factory):
    """Runs the public API accepts with most columns left out (stored as NULL): the README's logging example run
    as written, a run that logs only step metrics, and one whose rollouts and tokens carry nothing but text."""
    from engine.runlog import RunWriter

    folder = tmp_path_factory.mktemp("minimal")
    cwd = Path.cwd()
    os.chdir(folder)
    try:
        exec(compile(readme_logging_example(), "README.md", "exec"), {})
    finally:
        os.chdir(cwd)
    logs = folder / "logs"
    with RunWriter.create(logs, "metrics-only", config={}) as writer:
        for step in range(3):
            writer.log_step(step, metrics={"loss": 1.0 / (step + 1)})
    with RunWriter.create(logs, "text-only", config={}) as writer:
        writer.log_step(0, rollouts={"completion": ["x = 2", "x = 5"]}, tokens={"token_text": ["x", " ="]},
                        prm_steps={"text": ["x = 2"]})
        writer.log_step(1, rollouts={"rollout_id": [3, None], "kind": ["train", "train"], "completion": ["x = 2", "x"]},
                        tokens={"rollout_id": [3, 3], "token_text": ["x", " = 2"]})
    return str(logs)


@pytest.mark.parametrize("run", ["my-run", "metrics-only", "text-only"])
@pytest.mark.parametrize("page", list(PAGES))
def test_every_page_works_on_a_minimal_run(minimal_logs, run, page, monkeypatch):
    at = open_page(minimal_logs, page, monkeypatch, run=run)
    assert [h.value for h in at.header] == [PAGES[page]]
    assert not at.error, [e.value for e in at.error]
    if run == "my-run" and page == "groups":  # the README's two completions, as logged
        assert sorted(m["text"] for group in shown_groups(at) for m in group["members"]) == ["5", "6"]
    if run == "my-run" and page == "token_inspector":
        assert shown_tokens(at)["text"]
    if run == "my-run" and page == "algorithm_weighting":
        assert "grpo" in table(at, "algorithm", "low", "high")["algorithm"].tolist()
    if page == "mismatch" and run != "metrics-only":  # a run without sampler columns: said plainly, no error
        assert any("logged no sampler log-probs" in i.value for i in at.info), [i.value for i in at.info]


def test_prm_page_on_an_outcome_supervised_run_shows_raw_step_rewards(trained, trained_prm, tmp_path, monkeypatch):
    (outcome_logs, run), (process_logs, process_run) = trained, trained_prm
    logs = tmp_path / "logs"
    shutil.copytree(Path(outcome_logs) / run, logs / run)
    shutil.copytree(Path(process_logs) / process_run, logs / process_run)
    step = last_step(logs, run)
    steps = independent(logs, "prm_steps", "WHERE run = ? AND step = ?", [run, step])
    assert len(steps) and steps["reward_norm"].isna().all()  # the verifier scored the steps; nothing normalized
    at = open_page(logs, "prm_steps", monkeypatch, run=run, step=step)
    assert any("outcome supervision" in i.value and "do not use these step rewards" in i.value for i in at.info)
    assert "nan" not in at.get("html")[0].proto.body.lower()
    # The group's raw step rewards, as logged, in the only panel.
    spec = plotly_spec(at, "group_step_rewards")
    assert {t.get("xaxis", "x") for t in spec["data"]} == {"x"}
    rollout = int(at.selectbox(key="prm_rollout").value)
    rollouts = independent(logs, "rollouts", "WHERE run = ? AND step = ? AND kind = 'train'", [run, step])
    group = rollouts.loc[rollouts["rollout_id"] == rollout, "group_id"].iloc[0]
    members = rollouts[rollouts["group_id"] == group]["rollout_id"]
    expected = steps[steps["rollout_id"].isin(members)]["reward_raw"]
    np.testing.assert_allclose(sorted(np.concatenate([array(t["y"]) for t in spec["data"]])), sorted(expected))
    # And a way to the run whose advantages do come from step rewards.
    links = at.get("page_link")
    assert [link.proto.query_string for link in links] == [f"run={process_run}"]


def test_runs_table_keeps_the_key_columns_in_view(trained, tmp_path, monkeypatch):
    logs_dir, run = trained
    logs = tmp_path / "logs"
    shutil.copytree(Path(logs_dir) / run, logs / run)
    meta = json.loads((logs / run / "run.json").read_text())
    meta["model"] = "a transformer policy " * 30  # a long description, as a user may log
    (logs / run / "run.json").write_text(json.dumps(meta))
    at = open_page(logs, None, monkeypatch)
    table = next(frame.proto for frame in at.dataframe if "heldout_accuracy" in frame.value.columns)
    order = list(table.column_order)
    assert order[:5] == ["run", "status", "algorithm", "task", "heldout_accuracy"] and order[-1] == "model"
    columns = json.loads(table.columns)
    assert columns["run"]["pinned"] is True and columns["model"]["width"] == "medium"


def test_while_the_demo_runs_the_empty_page_says_so_and_how_far_it_is(tmp_path, monkeypatch):
    import engine.demo

    monkeypatch.setattr(engine.demo, "running_supervisor", lambda logs_dir: 4242)
    monkeypatch.setattr(engine.demo, "demo_progress",
                        lambda logs_dir: {"running": True, "fraction": 0.0, "runs": [],
                                          "warm_start": {"step": 125, "steps": 1000, "loss": 1.5}})
    at = open_page(tmp_path, None, monkeypatch)
    assert not at.button  # nothing to start: it is running
    assert any(info.value.startswith("The demo is running") for info in at.info)
    assert "No runs in" not in " ".join(m.value for m in at.markdown)
    bars = {bar.proto.text: bar.proto.value for bar in at.get("progress")}
    assert bars["warm start (supervised fine-tuning, shared by every demo run): step 125 of 1000, loss 1.500"] == 12


# ---------------------------------------------------------------- the Advantages page and PPO runs


@pytest.fixture(scope="module")
def trained_ppo(tiny_ppo_run):
    return str(tiny_ppo_run[0]), tiny_ppo_run[1]


def scheme_lines(spec: dict) -> dict[str, dict]:
    """Panel title -> the highlighted completion's trace (the bold one) on that panel of the Advantages chart."""
    titles = [a["text"] for a in spec["layout"]["annotations"]]
    out = {}
    for i, title in enumerate(titles):
        axis = "x" if i == 0 else f"x{i + 1}"
        bold = [t for t in spec["data"] if t.get("xaxis") == axis and t["line"]["width"] == 3]
        assert len(bold) == 1, title
        out[title] = bold[0]
    return out


def unbiased_z(rewards: np.ndarray) -> np.ndarray:
    """GRPO's outcome advantage by hand: (r - mean) / (unbiased std + 1e-6); 0 for a group of equal rewards."""
    if rewards.max() == rewards.min():
        return np.zeros_like(rewards)
    return (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6)


def test_advantages_page_on_a_ppo_run_draws_the_logged_critic_and_the_recomputed_grpo_schemes(trained_ppo, monkeypatch):
    logs_dir, run = trained_ppo
    step = last_step(logs_dir, run)
    at = open_page(logs_dir, "advantages", monkeypatch, run=run, step=step)
    group, rollout = int(at.selectbox(key="adv_group").value), int(at.selectbox(key="adv_rollout").value)
    lines = scheme_lines(plotly_spec(at, "advantage_schemes"))
    assert {t.split(":")[0] for t in lines} >= {"GRPO outcome advantage", "PPO GAE advantage (before whitening)",
                                                "PPO critic's value V(token)", "PPO KL part of the reward"}
    tokens = independent(logs_dir, "tokens", "WHERE run = ? AND step = ? AND rollout_id = ? ORDER BY position",
                         [run, step, rollout])
    by_title = {t.split(":")[0]: line for t, line in lines.items()}
    np.testing.assert_allclose(array(by_title["PPO GAE advantage (before whitening)"]["y"]), tokens["advantage"])
    np.testing.assert_allclose(array(by_title["PPO critic's value V(token)"]["y"]), tokens["value"])
    np.testing.assert_allclose(array(by_title["PPO KL part of the reward"]["y"]), tokens["kl_reward"])
    # GRPO's outcome advantage of the same completion, from the logged rewards of its group: constant over it
    roll = independent(logs_dir, "rollouts", "WHERE run = ? AND step = ? AND group_id = ? AND kind = 'train' "
                       "ORDER BY rollout_id", [run, step, group])
    expected = unbiased_z(roll["reward"].to_numpy())[roll["rollout_id"].tolist().index(rollout)]
    np.testing.assert_allclose(array(by_title["GRPO outcome advantage"]["y"]), expected, atol=1e-6)
    assert len(array(by_title["GRPO outcome advantage"]["y"])) == len(tokens)


def test_advantages_page_on_a_grpo_process_run_shows_the_staircase_and_says_there_is_no_critic(trained_prm,
                                                                                               monkeypatch):
    logs_dir, run = trained_prm
    step = last_step(logs_dir, run)
    at = open_page(logs_dir, "advantages", monkeypatch, run=run, step=step)
    rollout = int(at.selectbox(key="adv_rollout").value)
    spec = plotly_spec(at, "advantage_schemes")
    lines = {t.split(":")[0]: line for t, line in scheme_lines(spec).items()}
    assert set(lines) == {"GRPO outcome advantage", "GRPO process advantage"}
    # The run trained on process advantages: the recomputed staircase is the logged one, token for token.
    tokens = independent(logs_dir, "tokens", "WHERE run = ? AND step = ? AND rollout_id = ? ORDER BY position",
                         [run, step, rollout])
    np.testing.assert_allclose(array(lines["GRPO process advantage"]["y"]), tokens["advantage"], atol=1e-5)
    # Step boundaries: one dotted line per logged step of the highlighted completion on each of the two panels
    steps = independent(logs_dir, "prm_steps", "WHERE run = ? AND step = ? AND rollout_id = ?", [run, step, rollout])
    dotted = [s for s in spec["layout"]["shapes"] if s["type"] == "line"]
    assert sorted({s["x0"] for s in dotted}) == sorted(steps["first_pos"] - 0.5)
    assert len(dotted) == 2 * len(steps)
    assert any("has no critic" in c.value for c in at.caption)


def test_weighting_page_adds_ppo_for_a_run_with_a_critic(trained_ppo, monkeypatch):
    logs_dir, run = trained_ppo
    step = last_step(logs_dir, run)
    at = open_page(logs_dir, "algorithm_weighting", monkeypatch, run=run, step=step)
    assert table(at, "algorithm", "low", "high")["algorithm"].tolist() == ["grpo", "dapo", "gspo", "aspo", "ppo"]
    assert at.multiselect(key="weigh_algorithms").options == list(ALGORITHMS)


def test_runs_page_shows_the_critics_curves_for_a_ppo_run(trained_ppo, monkeypatch):
    logs_dir, run = trained_ppo
    at = open_page(logs_dir, None, monkeypatch, run=run)
    titles = [a["text"] for a in plotly_spec(at, "run_curves")["layout"]["annotations"]]
    assert "value loss (critic)" in titles and "explained variance (critic)" in titles


def test_pages_that_only_read_the_log_start_without_torch(trained):
    """torch takes seconds to import: only the pages that recompute objectives (PRM steps, Algorithm weighting)
    may load it, so the first view of the other pages in a fresh server does not wait for it."""
    import subprocess
    import sys
    import textwrap

    logs_dir, run = trained
    script = textwrap.dedent(f"""
        import os, sys
        from streamlit.testing.v1 import AppTest
        os.environ["POLICYLENS_LOGS_DIR"] = {logs_dir!r}
        at = AppTest.from_file({str(Path(__file__).resolve().parent.parent / "dashboard" / "streamlit_app.py")!r},
                               default_timeout={TIMEOUT})
        at.query_params["run"] = {run!r}
        at.run()
        for page in ("runs", "replay", "groups", "token_inspector"):
            at.switch_page(f"app_pages/{{page}}.py").run()
            assert not at.exception, (page, [e.message for e in at.exception])
            assert at.header, page
        print("torch" in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=10 * TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "False"


def test_step_queries_on_hand_made_passes(tmp_path):
    """Rollouts used by different passes (mini-batches), one pass logging no gradient weight: the one-rollout and
    per-rollout queries (bounded by a rollout-id range for row-group pruning) return exactly these rows."""
    from dashboard import data, queries
    from engine.runlog import RunWriter

    # rollout 0: passes 0 and 2; rollout 1: pass 1; rollout 2: passes 0 and 1 (no grad_weight in pass 1)
    used = {0: [0, 2], 1: [1], 2: [0, 1]}
    passes = {"pass": [], "rollout_id": [], "position": [], "ratio": [], "grad_weight": []}
    for rollout, numbers in used.items():
        for p in numbers:
            for position in range(2):
                passes["pass"].append(p)
                passes["rollout_id"].append(rollout)
                passes["position"].append(position)
                passes["ratio"].append(1 + p / 10 + rollout / 100)
                passes["grad_weight"].append(None if (rollout, p) == (2, 1) else 10 * rollout + p + position / 2)
    with RunWriter.create(tmp_path, "hand", background=False) as writer:
        writer.log_step(0, rollouts={"rollout_id": [0, 1, 2], "length": [2, 2, 2], "advantage": [1.0, -1.0, 0.5],
                                     "kind": ["train"] * 3},
                        tokens={"rollout_id": [0, 0, 1, 1, 2, 2], "position": [0, 1] * 3,
                                "token_text": list("abcdef"), "old_logp": [-1.0, -1.0, -2.0, -2.0, None, None]},
                        token_passes=passes)
    logs = str(tmp_path)
    totals = queries.rollout_total_weights(logs, "hand", 0)
    assert totals["rollout_id"].tolist() == [0, 1, 2]
    assert totals["total_weight"].tolist()[:2] == [2 + 2.5, 11 + 11.5]  # the last pass that used each rollout
    assert pd.isna(totals["total_weight"].iloc[2])  # its last pass logged no weight: not the earlier pass's
    reader = queries.get_reader(logs)
    last = data.tokens_at_update(reader, "hand", 0, (0, 2), -1)
    assert last["token_text"].tolist() == list("abef") and last["pass"].tolist() == [2, 2, 1, 1]
    first = data.tokens_at_update(reader, "hand", 0, (1,), 0)
    assert first["token_text"].tolist() == list("cd") and first["pass"].tolist() == [1, 1]
    in_pass_0 = queries.rollout_tokens(logs, "hand", 0, (0, 2), 0)
    np.testing.assert_allclose(in_pass_0["ratio"], [1.0, 1.0, 1.02, 1.02], rtol=1e-7)  # stored as float32
    not_in_pass = queries.rollout_tokens(logs, "hand", 0, (1,), 0)  # rollout 1 was not in pass 0: NULL values
    assert not_in_pass["token_text"].tolist() == ["c", "d"] and not_in_pass["ratio"].isna().all()
    assert queries.update_count(logs, "hand", 0, (0, 1)) == 2
    assert queries.rollout_passes(logs, "hand", 0, 2) == [0, 1]
    # What Algorithm weighting reads once for every update: each token's new log-prob is its old one + ln(ratio) of
    # its rollout's k-th pass, the old one for a rollout without a k-th pass; rollout 2 logged no old log-prob, so
    # neither is known (0, as the one-update query reads it).
    import torch

    from dashboard import recompute

    inputs = recompute.StepInputs(data.weighed_tokens(reader, "hand", 0, (0, 1, 2)))
    by_hand = {0: [-1 + np.log(1.0), -2 + np.log(1.11), 0.0], 1: [-1 + np.log(1.2), -2.0, 0.0],
               -1: [-1 + np.log(1.2), -2 + np.log(1.11), 0.0]}  # rollouts 0, 1, 2
    for update, logp in by_hand.items():
        batch = inputs.at_update(update, lambda k: data.weighed_passes(reader, "hand", 0, (0, 1, 2), k))
        np.testing.assert_allclose(batch.logp.numpy(), np.repeat([logp], 2, axis=0).T, rtol=0, atol=1e-6)
        read = recompute.batch_from_tokens(data.tokens_at_update(reader, "hand", 0, (0, 1, 2), update))
        torch.testing.assert_close(batch.logp, read.logp, rtol=0, atol=0)
    assert batch.mask.tolist() == [[1.0, 1.0]] * 3 and batch.rollout_ids == [0, 1, 2]


def test_token_inspector_shows_a_critic_runs_advantage_as_its_loss_used_it(trained_ppo, trained, monkeypatch):
    """A PPO run logs GAE advantages before whitening, but its loss (and every clip decision) used them whitened
    with the step's statistics: the default "advantage" is the whitened one, the logged one is beside it, and the
    legend says which. A run without a critic keeps its logged advantage and has no second channel."""
    logs_dir, run = trained_ppo
    step = last_step(logs_dir, run)
    rollout = a_mixed_rollout(logs_dir, run, step)
    at = open_page(logs_dir, "token_inspector", monkeypatch, run=run, step=step, rollout=rollout)
    assert at.selectbox(key="channel").value == "advantage"
    assert "GAE advantage before whitening" in at.selectbox(key="channel").options  # the options' labels
    tokens = independent(logs_dir, "tokens", "WHERE run = ? AND step = ? AND rollout_id = ? ORDER BY position",
                         [run, step, rollout])
    stats = independent(logs_dir, "steps", "WHERE run = ? AND step = ?", [run, step]).iloc[0]
    whitened = (tokens["advantage"] - stats["advantage_mean"]) / stats["advantage_std"]
    values = dataframe(open_token_values(at), "token_text", "advantage", "gae_advantage")
    # the file's float32 advantages whitened in float32 here, in float64 by the page
    np.testing.assert_allclose(values["advantage"].to_numpy(), whitened.to_numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(values["gae_advantage"].to_numpy(), tokens["advantage"].to_numpy(), rtol=1e-9)
    body = at.get("html")[0].proto.body
    assert "advantage (as the loss used it)" in body
    assert any("whitened" in c.value and "as the PPO loss used it" in c.value for c in at.caption)
    spans = shown_tokens(at)
    shown = [float(v) for v in spans["hover"]["values"][spans["hover"]["names"].index("advantage")]]
    np.testing.assert_allclose(shown, whitened.to_numpy(), rtol=1e-3, atol=1e-6)  # hover values are 4 digits
    # PPO-clip clips low only a token whose (whitened) advantage is negative, high only a positive one.
    clips = spans["clip"]
    assert all(a < 0 for a, c in zip(whitened, clips, strict=True) if c == CLIP_LOW)
    assert all(a > 0 for a, c in zip(whitened, clips, strict=True) if c == CLIP_HIGH)

    grpo_logs, grpo_run = trained
    at = open_page(grpo_logs, "token_inspector", monkeypatch, run=grpo_run, step=last_step(grpo_logs, grpo_run))
    assert "GAE advantage before whitening" not in at.selectbox(key="channel").options
    assert "gae_advantage" not in dataframe(open_token_values(at), "token_text", "advantage").columns


@pytest.fixture(scope="module")
def uncorrected_logs(tmp_path_factory):
    """A run logged without a correctness column and without a task (as a TRL run or an import is): group 0's
    rewards all 0, group 1's all 1, group 2's mixed; no answer, no filter reason."""
    from engine.runlog import RunWriter

    logs = tmp_path_factory.mktemp("uncorrected") / "logs"
    rewards = {0: [0.0, 0.0, 0.0], 1: [1.0, 1.0, 1.0], 2: [0.0, 1.0, 0.5]}
    ids = [(g, i) for g in rewards for i in range(3)]
    with RunWriter.create(logs, "trl-like", algorithm="grpo", config={}, background=False) as writer:
        writer.log_step(0, rollouts={
            "rollout_id": list(range(len(ids))), "group_id": [g for g, _ in ids], "index_in_group": [i for _, i in ids],
            "kind": ["train"] * len(ids), "prompt": [f"prompt {g}" for g, _ in ids],
            "completion": [f"completion {g}.{i}" for g, i in ids], "reward": [rewards[g][i] for g, i in ids],
            "advantage": [0.0] * 6 + [-1.0, 1.0, 0.0], "length": [2] * len(ids)},
            tokens={"rollout_id": list(range(len(ids))), "position": [0] * len(ids),
                    "token_text": ["x"] * len(ids), "old_logp": [-1.0] * len(ids), "advantage": [0.0] * len(ids)})
    return str(logs)


def test_groups_without_correctness_take_their_outcome_from_the_rewards(uncorrected_logs, monkeypatch):
    at = open_page(uncorrected_logs, "groups", monkeypatch, run="trl-like", step=0)
    shown = dataframe(at, "group_id", "reward_mean", "outcome").set_index("group_id")
    assert shown["outcome"].to_dict() == {0: "no signal", 1: "no signal", 2: "mixed"}
    assert any("no signal" in c.value and "no correctness" in c.value for c in at.caption)
    # Left-out values read as the README promises, not "None".
    for column in ("answer", "accuracy", "filter_reason"):
        assert shown[column].tolist() == ["–"] * 3, (column, shown[column].tolist())
    at.multiselect[0].set_value(["no signal"]).run()
    assert sorted(dataframe(at, "group_id", "outcome")["group_id"]) == [0, 1]
    # The same outcome labels the Algorithm weighting page's group picker, which opens on the group with signal.
    at = open_page(uncorrected_logs, "algorithm_weighting", monkeypatch, run="trl-like", step=0)
    picker = at.selectbox(key="weigh_group")
    assert picker.options == ["group 0 · no signal", "group 1 · no signal", "group 2 · mixed"]
    assert picker.value == 2


def test_sidebar_names_only_what_a_run_has(uncorrected_logs, trained, monkeypatch):
    """A run without a task reads "grpo · logs: ...", not "grpo ·  · logs"."""
    at = open_page(uncorrected_logs, None, monkeypatch, run="trl-like")
    captions = [c.value for c in at.sidebar.caption if "logs:" in c.value]
    assert len(captions) == 1 and captions[0].startswith("grpo · logs: "), captions
    logs_dir, run = trained
    at = open_page(logs_dir, None, monkeypatch, run=run)
    captions = [c.value for c in at.sidebar.caption if "logs:" in c.value]
    assert len(captions) == 1 and captions[0].count(" · ") == 2, captions  # algorithm · task · logs


def page_without_torch(logs_dir, run: str, page: str) -> dict:
    """A page rendered in a fresh process where torch cannot be imported: what it drew, and its errors."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import json, os, sys

        class NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch is not importable in this test")

        sys.meta_path.insert(0, NoTorch())
        from streamlit import config
        from streamlit.testing.v1 import AppTest
        config.set_option("server.enableStaticServing", True)  # as tests/conftest.py does for this process
        os.environ["POLICYLENS_LOGS_DIR"] = {str(logs_dir)!r}
        at = AppTest.from_file({APP!r}, default_timeout={TIMEOUT})
        at.query_params["run"] = {run!r}
        at.run()
        at.switch_page("app_pages/{page}.py").run()
        print(json.dumps({{
            "exceptions": [e.message for e in at.exception], "headers": [h.value for h in at.header],
            "subheaders": [h.value for h in at.subheader], "html": len(at.get("html")),
            "charts": [c.proto.id for c in [*at.get("plotly_chart"), *at.get("bidi_component")]],
            "errors": [e.value for e in at.error],
            "pickers": [m.key for m in at.multiselect], "editors": [d.key for d in at.dataframe],
            "torch": "torch" in sys.modules}}))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=10 * TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_prm_steps_page_is_drawn_before_torch_is_needed(trained_prm):
    """The first visit of PRM steps in a fresh server waited seconds for torch before anything was drawn. With
    torch made unimportable, everything but the sandbox's numbers is still drawn (the logged view and the
    sandbox's table), so nothing before the sandbox waits for it; the sandbox says why it has no numbers."""
    page = page_without_torch(*trained_prm, "prm_steps")
    assert page["exceptions"] == [] and page["headers"] == ["PRM steps"] and not page["torch"], page
    assert page["html"] >= 1 and any("group_step_rewards" in c for c in page["charts"]), page  # the logged view
    assert any(s.startswith("Sandbox") for s in page["subheaders"]), page
    assert len(page["errors"]) == 1 and "torch is not importable" in page["errors"][0], page


def test_mismatch_page_is_drawn_before_torch_is_needed(trained_prm):
    """Only the corrections need torch (engine.corrections): every chart above them is drawn without it."""
    page = page_without_torch(*trained_prm, "mismatch")
    assert page["exceptions"] == [] and page["headers"] == ["Mismatch"] and not page["torch"], page
    drawn = {c.rsplit("-", 1)[-1] for c in page["charts"]}
    assert {"mismatch_curves", "mismatch_histogram", "probability_scatter", "mismatch_buckets",
            "sequence_mismatch"} <= drawn and "correction_heatmaps" not in drawn, page
    assert len(page["errors"]) == 1 and "torch is not importable" in page["errors"][0], page


def test_runs_page_smooths_the_curves_only_when_asked(trained, monkeypatch):
    logs_dir, run = trained
    at = open_page(logs_dir, None, monkeypatch)
    assert at.slider(key="run_smoothing").value == 0.0  # off by default
    steps = independent(logs_dir, "steps", "WHERE run = ? ORDER BY step", [run]).dropna(subset=["reward_mean"])

    def reward_lines(at):
        spec = plotly_spec(at, "run_curves")
        return [t for t in spec["data"] if t["name"] == run and t.get("xaxis", "x") == "x"]

    (line,) = reward_lines(at)
    np.testing.assert_allclose(array(line["y"]), steps["reward_mean"], rtol=1e-9)
    at.slider(key="run_smoothing").set_value(0.6).run()
    assert not at.exception
    raw, smooth = reward_lines(at)
    np.testing.assert_allclose(array(raw["y"]), steps["reward_mean"], rtol=1e-9)
    expected, last = [], 0.0
    for n, value in enumerate(steps["reward_mean"], start=1):  # TensorBoard's debiased moving average, by hand
        last = 0.6 * last + 0.4 * value
        expected.append(last / (1 - 0.6**n))
    np.testing.assert_allclose(array(smooth["y"]), expected, rtol=1e-9)


def test_mismatch_page_shows_the_logged_gap_and_what_each_correction_does(trained_prm, monkeypatch):
    """On a run sampled by a bfloat16 copy of the policy: the step's numbers, curves, worst token texts and the
    corrections' table against independent computations over the Parquet files."""
    logs_dir, run = trained_prm
    step = last_step(logs_dir, run)
    at = open_page(logs_dir, "mismatch", monkeypatch, run=run, step=step)
    assert not at.error, [e.value for e in at.error]
    trained = independent(logs_dir, "rollouts", "WHERE run = ? AND step = ? AND kind = 'train' AND NOT filtered",
                          [run, step])
    tokens = independent(logs_dir, "tokens", "WHERE run = ? AND step = ? AND sampler_logp IS NOT NULL", [run, step])
    tokens = tokens[tokens["rollout_id"].isin(trained["rollout_id"])]
    ratio = np.exp(tokens["old_logp"] - tokens["sampler_logp"]).to_numpy()
    outside = (ratio < 0.9) | (ratio > 1.1)
    assert 0 < outside.mean() < 1, "the bfloat16 sampler should put some tokens outside the band"
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["outside [0.9, 1.1]"] == f"{outside.mean():.2%}"
    assert metrics["tokens (sequences)"] == f"{len(tokens)} ({tokens['rollout_id'].nunique()})"

    steps = independent(logs_dir, "steps", "WHERE run = ? ORDER BY step", [run])
    logged = {int(s): json.loads(e)["mismatch_kl"] for s, e in zip(steps["step"], steps["extra"], strict=True)
              if isinstance(e, str) and "mismatch_kl" in e}
    kl_line = plotly_spec(at, "mismatch_curves")["data"][0]  # the first panel (KL), the only run
    assert dict(zip(array(kl_line["x"]).tolist(), array(kl_line["y"]).tolist(), strict=True)) == pytest.approx(logged)

    per_text = pd.DataFrame({"text": tokens["token_text"].to_numpy(), "outside": outside}).groupby("text")["outside"]
    worst = table(at, "token_text", "outside", "worst_rollout_id")
    assert int(worst["outside"].iloc[0]) == int(per_text.sum().max())
    links = [link.proto for link in at.get("page_link") if link.proto.page == "tokens"]  # the Token inspector
    linked = [int(re.search(r"rollout=(\d+)", link.query_string).group(1)) for link in links]
    assert links and all(f"rollout {r}" in link.label and f"step={step}" in link.query_string
                         for link, r in zip(links, linked, strict=True))
    assert sorted(linked) == sorted(int(r) for r in worst["worst_rollout_id"].head(len(links)))

    corrections = table(at, "correction", "tokens dropped", "weight mean").set_index("correction")
    assert corrections.loc["TIS token (≤ 2)", "weight mean"] == f"{np.minimum(ratio, 2.0).mean():.3f}"
    out_of_tis_band = (ratio < 0.5) | (ratio > 2)
    assert corrections.loc["reject token_k1 (0.5_2.0)", "tokens dropped"] == f"{out_of_tis_band.mean():.3f}"
    assert plotly_spec(at, "correction_heatmaps")["data"], "one group's weights, a band per correction"


def test_weighting_of_one_group_computes_the_whole_step_ahead(trained, monkeypatch, prefetching):
    """Showing one group, Algorithm weighting also guesses "the whole step" of the same step: once the guesses are
    done, choosing it asks no objective, and shows the totals a fresh visit computes."""
    import streamlit as st

    from dashboard import recompute

    logs_dir, run = trained
    step = last_step(logs_dir, run)
    st.cache_data.clear()
    st.cache_resource.clear()
    weighed = []
    weigh = recompute.weigh
    monkeypatch.setattr(recompute, "weigh", lambda *a, **k: weighed.append(a[0].mask.shape[0]) or weigh(*a, **k))
    at = open_page(logs_dir, "algorithm_weighting", monkeypatch, run=run, step=step)
    assert at.radio(key="weigh_scope").value == "one group"
    assert prefetching.settled(timeout=120)
    rollouts = independent(logs_dir, "rollouts", "WHERE run = ? AND step = ? AND kind = 'train'", [run, step])
    assert len(rollouts) in weighed  # the whole step's completions, weighed in advance
    weighed.clear()
    at.radio(key="weigh_scope").set_value("the whole step").run()
    assert not at.exception
    assert weighed == []
    shown = plotly_spec(at, "total_weight_vs_length")
    st.cache_data.clear()
    st.cache_resource.clear()
    fresh = open_page(logs_dir, "algorithm_weighting", monkeypatch, run=run, step=step)
    fresh.radio(key="weigh_scope").set_value("the whole step").run()
    assert weighed, "the fresh visit weighed the whole step"
    totals = [array(trace["y"]).tolist() for trace in plotly_spec(fresh, "total_weight_vs_length")["data"]]
    assert [array(trace["y"]).tolist() for trace in shown["data"]] == totals


def test_token_statistics_computes_the_other_position_splits_ahead_so_choosing_one_reads_nothing(
        trained, monkeypatch, prefetching):
    """Once Token statistics is drawn (no position split), its server computes the page's two position queries for
    the other splits, the picker's neighbour first: choosing one then runs no query and shows what a fresh visit
    computes."""
    import streamlit as st

    from dashboard import token_data

    logs_dir, run = trained
    st.cache_data.clear()
    asked = []

    def recorded(name):
        real = getattr(token_data, name)
        return lambda *a: asked.append((name, a[4])) or real(*a)  # a[4]: the position split

    for name in ("token_stats", "covariance_drivers"):
        monkeypatch.setattr(token_data, name, recorded(name))
    at = open_page(logs_dir, "token_stats", monkeypatch, run=run)
    assert at.selectbox(key="stats_bucket").value == "no position split"
    assert prefetching.settled(timeout=120)
    assert asked[2:4] == [("token_stats", 4), ("covariance_drivers", 4)]  # after the page's own, the neighbour
    assert {bucket for _, bucket in asked} == {0, 4, 8, 16, 32}
    asked.clear()
    at.selectbox(key="stats_bucket").set_value("8 positions").run()
    assert not at.exception
    assert asked == []
    shown = [dataframe(at, "token_text", "position_to"), plotly_spec(at, "stats_covariance_steps")["data"]]
    st.cache_data.clear()
    fresh = open_page(logs_dir, "token_stats", monkeypatch, run=run)
    fresh.selectbox(key="stats_bucket").set_value("8 positions").run()
    assert asked, "the fresh visit ran the queries"
    pd.testing.assert_frame_equal(dataframe(fresh, "token_text", "position_to"), shown[0])
    assert plotly_spec(fresh, "stats_covariance_steps")["data"] == shown[1]


def test_weighting_computes_the_other_update_ahead_so_choosing_it_reads_nothing(trained, monkeypatch, prefetching):
    """Algorithm weighting opens on the last update of a run that made two (two epochs): its server also reads the
    first update's log-probs and weighs the same tokens with them, so that choosing it in the picker reads nothing,
    asks no objective, and shows what a fresh visit computes."""
    import streamlit as st

    from dashboard import data, recompute

    logs_dir, run = trained
    step = last_step(logs_dir, run)
    st.cache_data.clear()
    st.cache_resource.clear()
    tokens_read, updates_read, weighed = [], [], []
    weighed_tokens, weighed_passes, weigh = data.weighed_tokens, data.weighed_passes, recompute.weigh
    monkeypatch.setattr(data, "weighed_tokens", lambda *a: tokens_read.append(a[2]) or weighed_tokens(*a))
    monkeypatch.setattr(data, "weighed_passes", lambda *a: updates_read.append(a[4]) or weighed_passes(*a))
    monkeypatch.setattr(recompute, "weigh", lambda *a, **k: weighed.append(a[1]) or weigh(*a, **k))
    at = open_page(logs_dir, "algorithm_weighting", monkeypatch, run=run, step=step)
    assert at.selectbox(key="weigh_update").options == ["epoch 1 of 2", "epoch 2 of 2"]
    assert at.selectbox(key="weigh_update").value == 1
    assert prefetching.settled(timeout=120)
    assert 0 in updates_read  # the first update's log-probs, read in advance
    tokens_read.clear()
    updates_read.clear()
    weighed.clear()
    at.selectbox(key="weigh_update").set_value(0).run()
    assert not at.exception
    assert tokens_read == [] and updates_read == [] and weighed == []
    shown = plotly_spec(at, "total_weight_vs_length")
    st.cache_data.clear()
    st.cache_resource.clear()
    fresh = open_page(logs_dir, "algorithm_weighting", monkeypatch, run=run, step=step)
    fresh.selectbox(key="weigh_update").set_value(0).run()
    assert updates_read, "the fresh visit read the first update's log-probs"
    assert plotly_spec(fresh, "total_weight_vs_length")["data"] == shown["data"]


def test_mismatch_computes_the_previous_step_ahead_so_moving_there_recomputes_nothing(trained_prm, monkeypatch,
                                                                                    prefetching):
    """Once Mismatch is drawn at the last step, the server's prefetch thread reads the step before it and computes
    its corrections: moving the step slider back reads no sampler log-prob and computes no correction, and shows
    the table a fresh visit computes."""
    import streamlit as st

    from dashboard import data, recompute

    logs_dir, run = trained_prm
    step = last_step(logs_dir, run)
    st.cache_data.clear()
    st.cache_resource.clear()
    read, computed = [], []
    sampler_tokens, correction_table = data.sampler_tokens, recompute.correction_table
    monkeypatch.setattr(data, "sampler_tokens", lambda r, run, s, *a, **k: read.append(s) or
                        sampler_tokens(r, run, s, *a, **k))
    monkeypatch.setattr(recompute, "correction_table", lambda *a: computed.append(a) or correction_table(*a))
    at = open_page(logs_dir, "mismatch", monkeypatch, run=run, step=step)
    assert prefetching.settled(timeout=120)
    assert step - 1 in read and len(computed) == 2  # the shown step's and, in advance, the previous one's
    read.clear()
    computed.clear()
    at.select_slider(key="step").set_value(step - 1).run()
    assert not at.exception
    assert read == [] and computed == []
    shown = table(at, "correction", "tokens dropped", "weight mean")
    st.cache_data.clear()
    st.cache_resource.clear()
    fresh = open_page(logs_dir, "mismatch", monkeypatch, run=run, step=step - 1)
    pd.testing.assert_frame_equal(shown, table(fresh, "correction", "tokens dropped", "weight mean"))
    assert computed, "the fresh visit computed its table"


def test_mismatch_correction_heatmaps_are_binned_to_the_panel(trained_prm, monkeypatch):
    """With 5 columns a panel each TIS-token cell is the mean of min(exp(old - sampler), 2) over
    its bin's tokens of that completion, computed here from the Parquet files: a long group is never sent token by
    token."""
    import math

    from dashboard import common

    logs_dir, run = trained_prm
    step = last_step(logs_dir, run)
    monkeypatch.setattr(common, "PANEL_BINS", 5)
    at = open_page(logs_dir, "mismatch", monkeypatch, run=run, step=step)
    traces = plotly_spec(at, "correction_heatmaps")["data"]  # every correction's band in one heatmap
    heatmap = traces[0]
    assert all(trace["y"] == heatmap["y"] for trace in traces)  # its columns in one trace or two
    rows = [i for i, label in enumerate(heatmap["y"]) if label.startswith("TIS token (≤ 2) · ")]
    tokens = independent(logs_dir, "tokens", "WHERE run = ? AND step = ? AND sampler_logp IS NOT NULL", [run, step])
    rollouts = [int(re.search(r"rollout (\d+)", heatmap["y"][i]).group(1)) for i in rows]
    tokens = tokens[tokens["rollout_id"].isin(rollouts)]
    width = math.ceil((int(tokens["position"].max()) + 1) / 5)
    weight = np.minimum(np.exp(tokens["old_logp"] - tokens["sampler_logp"]), 2.0)
    means = weight.groupby([tokens["rollout_id"].to_numpy(), (tokens["position"] // width).to_numpy()]).mean()
    z, _, widths = heatmap_cells(traces)
    shown = z.reshape(len(heatmap["y"]), -1)[rows]
    assert widths[:-1].tolist() == [width] * (len(widths) - 1) and 0 < widths[-1] <= width
    assert shown.shape[1] == math.ceil((int(tokens["position"].max()) + 1) / width) <= 5
    for (rollout, column), value in means.items():
        assert shown[rollouts.index(rollout), column] == pytest.approx(value, rel=1e-5), (rollout, column)
    assert np.isfinite(shown).sum() == len(means)  # the other cells: padding past a completion's end
