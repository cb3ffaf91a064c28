"""Token trajectories and token statistics: the engine's teacher-forced scoring of the held-out reference solutions
(`ref_tokens`), the dashboard's queries over the logged rows, and the two views under AppTest on engine-trained runs.

Expected values are computed here independently: a plain forward pass per problem for the scoring, pandas over the
raw Parquet rows for the queries.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from engine.tasks import get_task

# ---------------------------------------------------------------- engine: answer classes and reference scoring


def test_answer_classes_split_by_the_sign_of_the_answer():
    for name in ("linear", "chain"):
        task = get_task(name, seed=0)
        assert task.answer_classes == ("negative", "non-negative")
        for p in task.heldout:
            assert task.answer_class(p) == ("negative" if int(p.answer) < 0 else "non-negative")
        assert {task.answer_class(p) for p in task.heldout} == set(task.answer_classes)
    linear = get_task("linear", seed=0)
    zero = next(p for p in linear.heldout + linear.train if p.answer == "0")
    assert linear.answer_class(zero) == "non-negative"


@pytest.fixture(scope="module")
def random_policy():
    from engine.policy import ModelConfig, build_model, build_tokenizer

    tok = build_tokenizer()
    model = build_model(tok, ModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64), seed=3)
    return model.eval(), tok


def manual_scores(model, tok, prompt: str, completion: str, temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """Log-prob and entropy of each completion token (then EOS) from one unpadded forward of one sequence."""
    prompt_ids = tok(prompt).input_ids
    ids = prompt_ids + tok(completion, add_special_tokens=False).input_ids + [tok.eos_token_id]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double() / temperature  # (L, V)
    logp_all = torch.log_softmax(logits, -1)
    logp, entropy = [], []
    for t in range(len(prompt_ids), len(ids)):
        row = logp_all[t - 1]  # the distribution that predicts token t
        logp.append(float(row[ids[t]]))
        entropy.append(float(-(row.exp() * row).sum()))
    return np.array(logp), np.array(entropy)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_reference_scoring_equals_a_manual_forward_pass(random_policy, temperature):
    from engine.rollout import TokenText, score_references

    model, tok = random_policy
    task = get_task("linear", seed=0)
    # Different prompt and solution lengths, so both paddings matter.
    problems = sorted(task.heldout[:40], key=lambda p: (len(p.prompt), len(task.solution_text(p))))
    problems = [problems[0], problems[-1], problems[len(problems) // 2]]
    scores = score_references(model, tok, task, problems, temperature)
    rows = pd.DataFrame(scores.rows(task, TokenText(tok)))
    for problem in problems:
        solution = task.solution_text(problem)
        logp, entropy = manual_scores(model, tok, problem.prompt, solution, temperature)
        mine = rows[rows.prompt_id == problem.prompt_id].sort_values("position")
        assert mine.position.tolist() == list(range(len(solution) + 1))
        assert mine.token_text.tolist() == [*solution, "<eos>"]
        assert (mine.answer_class == task.answer_class(problem)).all()
        np.testing.assert_allclose(mine.logp.to_numpy(), logp, atol=2e-5)
        np.testing.assert_allclose(mine.entropy.to_numpy(), entropy, atol=2e-5)


def logged(logs_dir, table: str) -> pd.DataFrame:
    """Every row of a table straight from the run's Parquet files with pandas (not the run-log reader), float32
    columns as float64 (as the reader shows them: sums over them are then the reader's to rounding)."""
    files = sorted(p for p in Path(logs_dir).glob(f"*/data/**/{table}.parquet")
                   if not any(part.startswith(".") for part in p.relative_to(logs_dir).parts))
    frame = pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)
    frame = frame.astype({c: "float64" for c in frame.columns if frame[c].dtype == "float32"})
    return frame.drop_duplicates(subset=[c for c in frame.columns if frame[c].map(np.isscalar).all()])


def test_training_logs_the_reference_scores_of_every_evaluation(tiny_run, warm_cache):
    from engine.policy import SFTConfig, load_policy
    from engine.rollout import TokenText, score_references
    from engine.train import checkpoint_steps, model_config

    logs_dir, run = tiny_run
    cfg = json.loads((Path(logs_dir) / run / "run.json").read_text())["config"]
    task = get_task(cfg["task"], seed=cfg["task_seed"])
    ref = logged(logs_dir, "ref_tokens")
    steps = logged(logs_dir, "steps")
    eval_steps = sorted(steps.loc[steps.heldout_accuracy.notna(), "step"])
    assert sorted(ref.step.unique()) == eval_steps == [0, 2, 3]
    heldout = task.heldout[: cfg["eval_size"]]
    for _step, frame in ref.groupby("step"):
        assert sorted(frame.prompt_id.unique()) == [p.prompt_id for p in heldout]
        for p in heldout:
            mine = frame[frame.prompt_id == p.prompt_id].sort_values("position")
            assert "".join(mine.token_text) == task.solution_text(p) + "<eos>"
            assert set(mine.answer_class) == {task.answer_class(p)}
        assert (frame.logp <= 0).all() and (frame.entropy >= 0).all()

    # The last evaluation scored the final policy: the run's checkpoint gives the same numbers.
    model, tok, _ = load_policy(task, cache_dir=warm_cache, seed=cfg["task_seed"],
                                model_config=model_config(cfg["model_size"]),
                                sft=SFTConfig(steps=cfg["sft_steps"], warmup_steps=min(20, cfg["sft_steps"]),
                                              num_threads=1), device="cpu")
    tt = TokenText(tok)
    warm = pd.DataFrame(score_references(model.eval(), tok, task, heldout, cfg["temperature"]).rows(task, tt))
    first = ref[ref.step == 0].sort_values(["prompt_id", "position"])
    np.testing.assert_allclose(first.logp.to_numpy(), warm.sort_values(["prompt_id", "position"]).logp, atol=1e-5)
    assert list(checkpoint_steps(Path(logs_dir) / run)) == [3]  # a finished run keeps its newest checkpoint only
    ckpt = torch.load(checkpoint_steps(Path(logs_dir) / run)[3], weights_only=False)
    model.load_state_dict(ckpt["model"])
    final = pd.DataFrame(score_references(model.eval(), tok, task, heldout, cfg["temperature"]).rows(task, tt))
    last = ref[ref.step == 3].sort_values(["prompt_id", "position"])
    np.testing.assert_allclose(last.logp.to_numpy(), final.sort_values(["prompt_id", "position"]).logp, atol=1e-5)
    assert np.abs(last.logp.to_numpy() - first.logp.to_numpy()).max() > 1e-4  # training moved them


# ---------------------------------------------------------------- dashboard queries against the raw rows


def train_token_rows(logs_dir, run: str, first: int, last: int) -> pd.DataFrame:
    """Train tokens of steps first..last joined with every optimisation pass that used them, in pandas."""
    tokens, rollouts, passes = (logged(logs_dir, t) for t in ("tokens", "rollouts", "token_passes"))
    train = rollouts[(rollouts.run == run) & (rollouts.kind == "train") & rollouts.step.between(first, last)]
    tokens = tokens[tokens.run == run].merge(train[["step", "rollout_id"]], on=["step", "rollout_id"])
    return tokens, passes[passes.run == run]


def test_trajectory_queries_equal_the_logged_rows(tiny_run):
    from dashboard import data, queries

    logs_dir, run = tiny_run
    logs = str(logs_dir)
    ref = logged(logs_dir, "ref_tokens")
    prompt_id = int(ref.prompt_id.iloc[0])
    got = queries.ref_trajectories(logs, (run,), prompt_id, ("t",))
    want = ref[ref.prompt_id == prompt_id].sort_values(["step", "position"])
    assert got.step.tolist() == want.step.tolist() and got.token_text.tolist() == want.token_text.tolist()
    np.testing.assert_allclose(got.p, np.exp(want.logp), rtol=1e-12)

    curves = queries.ref_class_curves(logs, (run,), ("t",))
    per_solution = ref.groupby(["step", "prompt_id"]).agg(logp=("logp", "sum"), n=("logp", "size"),
                                                           cls=("answer_class", "first")).reset_index()
    for row in curves.itertuples(index=False):
        mine = per_solution[(per_solution.step == row.step) & (per_solution.cls == row.answer_class)]
        assert row.prompts == len(mine)
        assert row.solution_logp == pytest.approx(mine.logp.mean(), rel=1e-9)
        assert row.token_logp == pytest.approx(mine.logp.sum() / mine.n.sum(), rel=1e-9)
    assert len(curves) == len(per_solution.groupby(["step", "cls"]))

    # the most changed tokens: |p(last eval) - p(first eval)| ranked, by hand
    marked = data.most_changed_tokens(got.assign(run=run), upto_step=int(ref.step.max()), k=2)
    first = want[want.step == want.step.min()].set_index("position").logp
    latest = want[want.step == want.step.max()].set_index("position").logp
    change = np.exp(latest) - np.exp(first)
    expected = change.abs().sort_values(ascending=False, kind="stable").index[:2].tolist()
    assert marked.position.tolist() == expected
    np.testing.assert_allclose(marked.change, change.loc[expected], rtol=1e-9)
    # scrubbing back to the first evaluation: nothing has changed yet
    assert (data.most_changed_tokens(got.assign(run=run), upto_step=0, k=2).change == 0).all()


@pytest.mark.parametrize("bucket", [0, 4])
def test_token_statistics_equal_pandas_over_the_logged_rows(tiny_run, bucket):
    from dashboard import queries

    logs_dir, run = tiny_run
    first, last = 1, 3
    tokens, passes = train_token_rows(logs_dir, run, first, last)
    per_token = passes.assign(
        low=passes["clip"] == 1, high=passes["clip"] == 2, dual=passes["clip"] == 3,
        w=passes.grad_weight.abs(), dev=(passes.ratio - 1).abs(),
    ).groupby(["step", "rollout_id", "position"]).agg(
        n=("low", "size"), low=("low", "sum"), high=("high", "sum"), dual=("dual", "sum"), w=("w", "sum"),
        dev=("dev", "sum")).reset_index()
    rows = tokens.merge(per_token, on=["step", "rollout_id", "position"], how="left")
    rows["bucket"] = rows.position // bucket * bucket if bucket else -1
    want = rows.groupby(["token_text", "bucket"]).agg(
        count=("position", "size"), adv=("advantage", "mean"), ent=("entropy", "mean"), n=("n", "sum"),
        low=("low", "sum"), high=("high", "sum"), dual=("dual", "sum"), w=("w", "sum"), dev=("dev", "sum"))
    got = queries.token_stats(str(logs_dir), run, first, last, bucket, ("t",))
    assert len(got) == len(want) and got["count"].sum() == len(tokens)
    assert rows.low.sum() + rows.high.sum() > 0, "no clip event in the run: the clip columns test nothing"
    for row in got.itertuples(index=False):
        w = want.loc[(row.token_text, int(row.position_from) if bucket else -1)]
        assert row.count == w["count"]
        assert row.advantage_mean == pytest.approx(w.adv, abs=1e-9)
        assert row.entropy_mean == pytest.approx(w.ent, abs=1e-9)
        assert row.clip_low_rate == pytest.approx(w.low / w.n)
        assert row.clip_high_rate == pytest.approx(w.high / w.n)
        assert row.clip_dual_rate == pytest.approx(w.dual / w.n)
        assert row.abs_grad_weight_mean == pytest.approx(w.w / w.n, rel=1e-9, abs=1e-12)
        assert row.ratio_deviation_mean == pytest.approx(w.dev / w.n, rel=1e-9, abs=1e-12)

    # the rollouts holding the most frequent token (in the first position bucket when split)
    token = got.iloc[0]
    holders = queries.rollouts_with_token(str(logs_dir), run, first, last, token.token_text, bucket,
                                          int(token.position_from) if bucket else None)
    hits = rows[(rows.token_text == token.token_text) & (rows.bucket == (token.position_from if bucket else -1))]
    expected = hits.groupby(["step", "rollout_id"]).position.apply(list)
    assert list(zip(holders.step, holders.rollout_id, strict=True)) == expected.index.tolist()
    assert [list(p) for p in holders.positions] == expected.tolist()
    assert holders.occurrences.sum() == token["count"]


def test_entropy_bins_follow_aspo_percentile_split(tiny_run):
    from dashboard import queries

    logs_dir, run = tiny_run
    tokens, passes = train_token_rows(logs_dir, run, 0, 3)
    bins = 10
    # Bins from each response's linearly interpolated entropy quantiles, computed with numpy.
    assigned = []
    for (_step, _rid), frame in tokens.groupby(["step", "rollout_id"]):
        ent = frame.entropy.to_numpy()
        cuts = np.quantile(ent, np.arange(1, bins) / bins)
        k = (ent[:, None] > cuts[None, :]).sum(1)
        # ASPO's own rule (torch.nanquantile, linear): tokens strictly above the 80th percentile are bins 8 and 9
        high = torch.tensor(ent) > torch.nanquantile(torch.tensor(ent), 0.8)
        np.testing.assert_array_equal(k >= 8, high.numpy())
        assigned.append(frame.assign(bin=k))
    rows = pd.concat(assigned).merge(passes, on=["run", "step", "rollout_id", "position"])
    total = rows.grad_weight.abs().sum()
    got = queries.entropy_bins(str(logs_dir), (run,), 0, 3, bins, ("t",)).set_index("bin")
    for b, frame in rows.groupby("bin"):
        assert got.loc[b, "pass_rows"] == len(frame)
        assert got.loc[b, "clip_rate"] == pytest.approx((frame["clip"] > 0).mean())
        assert got.loc[b, "clip_high_rate"] == pytest.approx((frame["clip"] == 2).mean())
        assert got.loc[b, "weight_share"] == pytest.approx(frame.grad_weight.abs().sum() / total)
    assert sorted(got.index) == sorted(rows.bin.unique())
    assert got.weight_share.sum() == pytest.approx(1.0)


# ---------------------------------------------------------------- the views, under AppTest on an engine-trained run


def grid(field) -> np.ndarray:
    """A plotly 2-D array: nested lists, or a typed array with its shape."""
    from test_dashboard import array

    values = array(field)
    if isinstance(field, dict) and "shape" in field:
        values = values.reshape([int(s) for s in str(field["shape"]).split(",")])
    return values


def test_trajectories_page_draws_the_logged_probabilities(tiny_run, monkeypatch):
    from test_dashboard import open_page, plotly_spec

    from dashboard.tokens import visible_text

    logs_dir, run = tiny_run
    ref = logged(logs_dir, "ref_tokens")
    at = open_page(logs_dir, "token_trajectories", monkeypatch, run=run)
    prompt_id = at.selectbox(key="traj_prompt").value
    negative = sorted(ref.loc[ref.answer_class == "negative", "prompt_id"].unique())
    assert prompt_id == (negative[0] if negative else ref.prompt_id.min())  # the sign-slip story first

    def check(prompt_id: int, at_step: int) -> dict:
        spec = plotly_spec(at, "traj_heatmap")
        heat = spec["data"][0]
        want = ref[ref.prompt_id == prompt_id].pivot(index="step", columns="position", values="logp").sort_index()
        np.testing.assert_allclose(grid(heat["z"]), np.exp(want.to_numpy()), rtol=1e-9)
        assert heat["y"] == [str(s) for s in want.index]
        texts = ref[ref.prompt_id == prompt_id].drop_duplicates("position").sort_values("position").token_text
        # token text reaches plotly escaped: "<eos>" is drawn as the characters, never parsed as a tag
        assert spec["layout"]["xaxis"]["ticktext"] == [visible_text(t).replace("<br>", "") for t in texts]
        assert spec["layout"]["xaxis"]["ticktext"][-1] == "&lt;eos&gt;"
        row = next(s for s in spec["layout"]["shapes"] if s["line"]["color"] == "#ff7f0e")
        assert want.index[int(row["y0"] + 0.5)] == max(s for s in want.index if s <= at_step)
        return spec

    steps = sorted(ref.step.unique())
    check(prompt_id, steps[-1])
    other = int(next(p for p in sorted(ref.prompt_id.unique()) if p != prompt_id))
    at.selectbox(key="traj_prompt").set_value(other).run()
    assert not at.exception, [e.message for e in at.exception]
    at.select_slider(key="traj_step").set_value(steps[0]).run()
    assert not at.exception, [e.message for e in at.exception]
    check(other, steps[0])

    # A link from Replay at a step without evaluation (step 1) opens on the latest evaluation before it.
    at = open_page(logs_dir, "token_trajectories", monkeypatch, run=run, prompt=other, at=1)
    assert at.selectbox(key="traj_prompt").value == other and at.select_slider(key="traj_step").value == 0
    assert not at.warning
    check(other, 1)
    replay = open_page(logs_dir, "replay", monkeypatch, run=run)
    prompt = replay.selectbox(key="eval_prompt").value
    links = [e.proto for e in replay.get("page_link") if e.proto.page == "trajectories"]
    assert [link.query_string for link in links] == [f"run={run}&prompt={prompt}&at={steps[-1]}"]

    curves = plotly_spec(at, "traj_class_curves")["data"]
    per_solution = ref.groupby(["answer_class", "step", "prompt_id"]).logp.sum().groupby(["answer_class", "step"])
    for trace in curves:
        answer_class = trace["name"].split(" · ")[1]
        np.testing.assert_allclose(grid(trace["y"]), per_solution.mean().loc[answer_class].to_numpy(), rtol=1e-9)
    assert {t["name"] for t in curves} == {f"{run} · {c}" for c in ref.answer_class.unique()}


def test_token_statistics_page_lists_tokens_and_their_rollouts(tiny_run, monkeypatch):
    from test_dashboard import dataframe, open_page, plotly_spec

    from dashboard.charts import token_as_text

    logs_dir, run = tiny_run
    tokens, _passes = train_token_rows(logs_dir, run, 0, 10**9)
    at = open_page(logs_dir, "token_stats", monkeypatch, run=run)
    table = dataframe(at, "token_text", "clip_low_rate")
    counts = tokens.token_text.value_counts()
    # whitespace made visible: the newline token is listed as ↵
    assert dict(zip(table.token_text, table["count"], strict=True)) == {
        token_as_text(t): n for t, n in counts.items()}
    assert "↵" in set(table.token_text)

    # click the first row: its rollouts are listed, each holding the token
    at.session_state["stats_table"] = {"selection": {"rows": [0], "columns": [], "cells": []}}
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    token = next(t for t in counts.index if token_as_text(t) == table.token_text.iloc[0])
    holders = dataframe(at, "occurrences", "completion")
    expected = tokens[tokens.token_text == token].groupby(["step", "rollout_id"]).size()
    assert list(zip(holders.step, holders.rollout_id, strict=True)) == expected.index.tolist()
    assert holders.occurrences.tolist() == expected.tolist()
    assert all(link.startswith("tokens?run=") for link in holders.inspect)

    spec = plotly_spec(at, "stats_entropy")
    assert [s["x0"] for s in spec["layout"]["shapes"]] == [0.8, 0.8]
    shares = grid(spec["data"][1]["y"])
    assert shares.sum() == pytest.approx(1.0)


def test_logged_strings_reach_the_new_views_as_text_only(tmp_path, monkeypatch):
    """Token texts, answer classes and algorithm names with markup in them are drawn escaped and tabled as text."""
    from synthetic_runs import HOSTILE_TOKEN, synthetic_step
    from test_dashboard import dataframe, open_page, plotly_spec

    from dashboard.charts import token_as_text
    from dashboard.common import md
    from engine.runlog import RunWriter

    rng = np.random.default_rng(0)
    texts = [HOSTILE_TOKEN, "%{x}", "[a](http://example.com)", "\n"]
    writer = RunWriter.create(tmp_path, "hostile", algorithm="<b>grpo</b>", task="linear", config={"task_seed": 0},
                              model="m")
    for step in (0, 1):
        data = synthetic_step(step, 2, 4, 8, 2, rng, hostile=True)
        writer.log_step(step, **data, ref_tokens={
            "prompt_id": [0] * 4, "position": list(range(4)), "token_id": list(range(4)), "token_text": texts,
            "logp": [-0.1 * (step + 1)] * 4, "entropy": [0.5] * 4, "answer_class": ["<i>negative</i>"] * 4})
    writer.close()

    at = open_page(tmp_path, "token_trajectories", monkeypatch, run="hostile")
    for key in ("traj_heatmap", "traj_class_curves", "traj_marked_lines"):
        spec = json.dumps(plotly_spec(at, key))
        for raw in ("<img", "<i>", "<b>"):  # plotly renders a subset of HTML in labels, no markdown
            assert raw not in spec, (key, raw)
    heat = plotly_spec(at, "traj_heatmap")
    assert heat["layout"]["xaxis"]["ticktext"][0] == "&lt;img·src=x·onerror=alert(1)&gt;"
    assert heat["layout"]["xaxis"]["ticktext"][3] == "↵"
    names = [t["name"] for t in plotly_spec(at, "traj_class_curves")["data"]]
    assert names == ["hostile · &lt;i&gt;negative&lt;/i&gt;"]
    assert "%{fullData.name}" in plotly_spec(at, "traj_class_curves")["data"][0]["hovertemplate"]
    shown = token_as_text(HOSTILE_TOKEN)
    assert shown == "<img·src=x·onerror=alert(1)>"
    assert shown in set(dataframe(at, "token", "p now").token)  # a table cell: text

    at = open_page(tmp_path, "token_stats", monkeypatch, run="hostile")
    table = dataframe(at, "token_text", "clip_low_rate")
    row = list(table.token_text).index(shown)
    at.session_state["stats_table"] = {"selection": {"rows": [row], "columns": [], "cells": []}}
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    headers = [m.value for m in at.markdown if "Rollouts holding token" in m.value]
    assert len(headers) == 1 and md(shown) in headers[0]  # every markdown character of the token escaped
    assert len(dataframe(at, "occurrences", "completion")) >= 1
    spec = json.dumps(plotly_spec(at, "stats_entropy"))
    assert "<b>" not in spec and "&lt;b&gt;grpo&lt;/b&gt;" in spec


def test_token_statistics_page_follows_a_change_of_run(tiny_run, tmp_path, monkeypatch):
    """A step range chosen on one run is dropped, not an error, when the sidebar picks a run without those steps."""
    from synthetic_runs import write_synthetic_run
    from test_dashboard import dataframe, open_page

    logs_dir, run = tiny_run
    shutil.copytree(Path(logs_dir) / run, tmp_path / run)
    write_synthetic_run(str(tmp_path), "short", steps=2)  # steps 0 and 1 only
    at = open_page(tmp_path, "token_stats", monkeypatch, run=run)
    at.select_slider(key="stats_steps").set_value((2, 3)).run()
    assert not at.exception
    assert dataframe(at, "token_text", "clip_low_rate")["count"].sum() == len(
        train_token_rows(tmp_path, run, 2, 3)[0])
    at.selectbox(key="run").set_value("short").run()
    assert not at.exception, [e.message for e in at.exception]
    assert at.select_slider(key="stats_steps").value == (0, 1)


def test_token_statistics_page_sends_its_table_a_page_at_a_time_in_the_chosen_order(tmp_path, monkeypatch):
    """Split by position, a real vocabulary gives millions of (text, positions) rows; the page sends 2,000 at a time
    (all of them once failed: a 228 MB message), ordered on the server by the chosen column, highest first."""
    from test_dashboard import dataframe, open_page

    from engine.runlog import RunWriter

    n = 3_000  # distinct texts, one token each: 3,000 rows, two pages
    entropy = np.random.default_rng(0).permutation(n).astype(float) / n
    writer = RunWriter.create(tmp_path, "wide", algorithm="grpo", task="linear", config={}, model="m")
    writer.log_step(0, rollouts={"rollout_id": [0], "group_id": [0], "index_in_group": [0], "kind": ["train"],
                                 "prompt": ["p"], "completion": ["c"], "reward": [1.0], "length": [n]},
                    tokens={"rollout_id": [0] * n, "position": list(range(n)), "token_id": list(range(n)),
                            "token_text": [f"t{i}" for i in range(n)], "entropy": entropy, "advantage": [1.0] * n})
    writer.close()
    at = open_page(tmp_path, "token_stats", monkeypatch, run="wide")
    first = dataframe(at, "token_text", "count")
    assert len(first) == 2_000 and at.number_input(key="stats_page").max == 2
    at.number_input(key="stats_page").set_value(2).run()
    second = dataframe(at, "token_text", "count")
    assert len(second) == 1_000 and set(first.token_text).isdisjoint(second.token_text)
    at.selectbox(key="stats_order").set_value("mean entropy").run()
    at.number_input(key="stats_page").set_value(1).run()
    by_entropy = dataframe(at, "token_text", "entropy_mean")
    top = np.sort(entropy)[::-1][:2_000]
    np.testing.assert_allclose(by_entropy["entropy_mean"].to_numpy(dtype=float), top, rtol=1e-6)
