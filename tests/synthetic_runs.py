"""Synthetic runs for the dashboard's tests and benchmark (test data, not part of the app), written through the
real `RunWriter`.

The numbers are made up but shaped like the engine's (groups of G completions of an equation task, log-probs,
ratios that drift from 1 across passes, clip codes that follow the GRPO rule, PRM steps), so queries and charts
do the same work as on a trained run. The dashboard's functional tests use runs trained by the engine instead.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd

from engine.clip_codes import CLIP_COV, clip_fractions, count_clip_events, fraction_column
from engine.objectives import CLIP_CAP, CLIP_HIGH, CLIP_LOW, CLIP_NONE

HOSTILE_TOKEN = "<img src=x onerror=alert(1)>"
# Logged strings that would become something other than text if they reached markdown or HTML as they are: an
# image the browser fetches, a javascript: link, a formula, markup, bare links (GFM turns them into <a>), Streamlit's
# :shortcodes:, a heading, a table.
HOSTILE_TEXTS = [
    "![x](http://127.0.0.1:9/x.png)",
    "[a](javascript:alert(1))",
    "$x^2$ and $$y$$",
    "<script>alert(1)</script>",
    HOSTILE_TOKEN,
    "see http://example.com, www.example.com or a@example.com",
    ":red[red] :material/visibility: :smile:",
    "heading\n===",
    "&lt;b&gt; | a | b |\n|---|---|",
    "*em* **strong** `code` # h > q ~~s~~",
]
# What GitHub-flavoured markdown turns into a link without any markup (its "autolink literal" extension, which
# Streamlit uses), and Streamlit's `:emoji:` / `:material/icon:` codes: both are found in the text after escapes are
# resolved, so text shown through markdown must hold none of them.
AUTOLINK_OR_SHORTCODE = re.compile(r"https?://|www\.|[\w.+-]@[\w-]|:[\w+/-]+:", flags=re.I)
# Pieces of an equation solution; spaces and newlines are part of the tokens on purpose.
VOCAB = ["2", "x", " +", " 3", " =", " 7", "\n", " -", " 4", "x =", " 2", "Step", " 1", ":", " so", " subtract",
         " divide", " by", "<eos>"]


def synthetic_step(step: int, groups: int, group_size: int, length: int, passes: int, rng: np.random.Generator,
                   hostile: bool = False, eval_prompts: int = 2) -> dict:
    """One step's tables as dict-of-columns / DataFrames, in the run-log schema."""
    rows, token_rows, pass_rows, prm_rows = [], [], [], []
    rollout_id = 0
    kinds = [("train", g) for g in range(groups)] + [("eval", g) for g in range(eval_prompts)]
    for kind, group in kinds:
        size = group_size if kind == "train" else 1
        correct = rng.random(size) < (0.3 + 0.5 * step / (step + 10))
        reward = correct.astype(float)
        std = reward.std(ddof=1) if size > 1 else 0.0
        advantage = (reward - reward.mean()) / (std + 1e-6) if kind == "train" else np.zeros(size)
        for i in range(size):
            n = int(rng.integers(max(2, length // 2), length + 1))
            ids = rng.integers(0, len(VOCAB), n)
            texts = [VOCAB[j] for j in ids]
            if hostile and rollout_id == 0:
                texts[min(1, n - 1)] = HOSTILE_TOKEN
            old_logp = -rng.gamma(1.0, 0.6, n)
            ref_logp = old_logp + rng.normal(0, 0.05, n)
            entropy = rng.gamma(2.0, 0.4, n)
            steps_idx = np.minimum(np.arange(n) * 3 // n, 2)
            rows.append({
                "rollout_id": rollout_id, "group_id": group if kind == "train" else 1000 + group,
                "index_in_group": i, "kind": kind, "prompt_id": group + step * groups if kind == "train" else group,
                "prompt": f"Solve for x: {group + 2}x + 3 = {2 * group + 7}", "completion": "".join(texts),
                "answer": str(group + 2), "reward": float(reward[i]), "reward_correct": float(reward[i]),
                "reward_process": float(rng.normal()), "reward_length": 0.0, "advantage": float(advantage[i]),
                "length": n, "truncated": bool(n == length), "filtered": bool(std == 0 and kind == "train"),
                "filter_reason": ("all_correct" if reward.mean() == 1 else "all_wrong")
                if std == 0 and kind == "train" else None,
                "seq_ratio": None,
            })
            for t in range(n):
                token_rows.append((rollout_id, t, int(ids[t]), texts[t], old_logp[t], ref_logp[t], entropy[t],
                                   float(advantage[i]), int(steps_idx[t])))
            for j in range(3):
                positions = np.flatnonzero(steps_idx == j)
                if positions.size:
                    prm_rows.append((rollout_id, j, int(positions[0]), int(positions[-1]),
                                     "".join(texts[positions[0]: positions[-1] + 1]), float(rng.random()),
                                     float(rng.normal())))
            if kind == "train":
                for p in range(passes):
                    new_logp = old_logp + rng.normal(0, 0.08 * p, n)
                    ratio = np.exp(new_logp - old_logp)
                    a = advantage[i]
                    clip = np.where((a < 0) & (ratio < 0.8), CLIP_LOW,
                                    np.where((a > 0) & (ratio > 1.2), CLIP_HIGH, CLIP_NONE))
                    clip = np.where((a < 0) & (ratio > 3), CLIP_CAP, clip)
                    weight = np.where(clip == CLIP_NONE, ratio * a / n, 0.0)
                    kl = np.exp(ref_logp - new_logp) - (ref_logp - new_logp) - 1
                    for t in range(n):
                        pass_rows.append((p, rollout_id, t, new_logp[t], ratio[t], int(clip[t]), weight[t],
                                          -ratio[t] * a / n, kl[t]))
            rollout_id += 1
    rollouts = pd.DataFrame(rows)
    tokens = pd.DataFrame(token_rows, columns=["rollout_id", "position", "token_id", "token_text", "old_logp",
                                               "ref_logp", "entropy", "advantage", "prm_step"])
    token_passes = pd.DataFrame(pass_rows, columns=["pass", "rollout_id", "position", "new_logp", "ratio", "clip",
                                                    "grad_weight", "token_loss", "kl"])
    token_passes["clip"] = token_passes["clip"].astype("int8")
    prm = pd.DataFrame(prm_rows, columns=["rollout_id", "step_index", "first_pos", "last_pos", "text", "reward_raw",
                                          "reward_norm"])
    train = rollouts[rollouts["kind"] == "train"]
    metrics = {
        "wall_time": float(step * 2.0), "reward_mean": float(train["reward"].mean()),
        "reward_std": float(train["reward"].std()), "accuracy": float(train["reward_correct"].mean()),
        "heldout_accuracy": float(rng.random()) if step % 2 == 0 else None, "heldout_accuracy_sampled": None,
        "entropy": float(tokens["entropy"].mean()), "kl": float(token_passes["kl"].mean()) if passes else 0.0,
        **{fraction_column(c): share for c, share in clip_fractions(
            count_clip_events(token_passes["clip"].to_numpy()), len(token_passes)).items()},
        "response_len_mean": float(train["length"].mean()), "response_len_max": float(train["length"].max()),
        "truncated_frac": float(train["truncated"].mean()),
        "groups_kept": int(groups - train["filtered"].sum() // max(1, group_size)),
        "groups_filtered": int(train["filtered"].sum() // max(1, group_size)), "gen_batches": 1,
        "loss": float(rng.normal()), "grad_norm": float(rng.random()), "lr": 1e-5, "step_seconds": 2.0,
    }
    return {"metrics": metrics, "rollouts": rollouts, "tokens": tokens, "token_passes": token_passes,
            "prm_steps": prm}


def write_hostile_run(logs_dir: str, name: str) -> None:
    """A two-step run whose every logged string (prompt, completion, answer, filter reason, reasoning-step text,
    token text, task, model, config values, extra metrics) holds markup from HOSTILE_TEXTS; group 0 is filtered."""
    from engine.runlog import RunWriter

    rng = np.random.default_rng(0)
    hostile = " ".join(HOSTILE_TEXTS)
    with RunWriter.create(logs_dir, name, algorithm="grpo", task=HOSTILE_TEXTS[0], model=hostile,
                          config={"note": HOSTILE_TEXTS[1], "supervision": "outcome"}) as writer:
        for step in range(2):
            data = synthetic_step(step, 2, 2, 10, 1, rng, hostile=True)
            rollouts = data["rollouts"]
            n = len(rollouts)
            rollouts["prompt"] = [f"Solve {hostile} #{i % 2}" for i in range(n)]
            rollouts["completion"] = [HOSTILE_TEXTS[i % len(HOSTILE_TEXTS)] for i in range(n)]
            rollouts["answer"] = hostile
            in_group_0 = (rollouts["group_id"] == 0) & (rollouts["kind"] == "train")
            rollouts["filtered"] = in_group_0
            rollouts["filter_reason"] = np.where(in_group_0, hostile, None)
            data["prm_steps"]["text"] = hostile
            data["metrics"]["note"] = hostile  # a metric outside the contract: the JSON `extra` column
            writer.log_step(step, **data)


def write_synthetic_run(logs_dir: str, name: str, steps: int = 3, groups: int = 4, group_size: int = 4,
                        length: int = 24, passes: int = 2, hostile: bool = False, seed: int = 0,
                        algorithm: str = "grpo", status: str = "finished") -> None:
    """Write a synthetic run through the engine's RunWriter."""
    from engine.runlog import RunWriter

    rng = np.random.default_rng(seed)
    config = {"algorithm": algorithm, "group_size": group_size, "groups": groups, "max_len": length,
              "passes": passes, "synthetic": True}
    writer = RunWriter.create(logs_dir, name, algorithm=algorithm, task="linear_equation", config=config,
                              model="synthetic")
    for step in range(steps):
        data = synthetic_step(step, groups, group_size, length, passes, rng, hostile=hostile)
        writer.log_step(step, **data)
    if status != "running":
        writer.set_status(status)
    else:
        writer.flush()  # every step on disk when this returns, the run still running


if __name__ == "__main__":  # handy for trying the dashboard: python tests/synthetic_runs.py LOGS_DIR NAME [STEPS]
    import sys

    write_synthetic_run(sys.argv[1], sys.argv[2], steps=int(sys.argv[3]) if len(sys.argv) > 3 else 5)
    print(json.dumps({"written": sys.argv[2]}))


def write_run_before_columns(logs_dir, name: str, table: str, rows: dict, dropped: list[str]) -> None:
    """A one-step run whose `table` file lacks the columns `dropped`, as a release before they were added wrote it
    (the run-log reads them as NULL: engine.runlog.schema ADDED_COLUMNS)."""
    import pyarrow.parquet as pq

    from engine.runlog import RunWriter, data_dir_of

    writer = RunWriter.create(logs_dir, name, background=False, compact_every=1000)
    writer.log_step(1, **{table: rows})
    writer.close()
    (path,) = data_dir_of(logs_dir / name).glob(f"step-*/{table}.parquet")
    pq.write_table(pq.read_table(path).drop_columns(dropped), path)


def write_covariance_run(logs_dir, name: str = "hand-cov", advantage_std: float | None = None) -> None:
    """A two-step run small enough to work Cui et al.'s covariance (A - mean A)(log pi - mean log pi) out by hand,
    means over each pass's loss tokens (tests/test_token_drivers.py holds the worked values).

    Step 0, one pass: rollout 0 (A = +1, tokens a b; b selected by a covariance rule, code 4), rollout 1 (A = -1,
    tokens a c, and e, which a mismatch correction rejected: out of the means), an eval rollout (z, never trained).
    Step 1, two passes (two epochs) over rollout 0 (A = +2, tokens a c) and rollout 1 (A = 0, tokens b d), plus an
    overlong-filtered rollout 2 (A = 5, token c) whose logged passes are not in the loss; its second pass logged no
    KL (NaN). `advantage_std`: logged as a critic run's step whitening (its loss saw A / std, as mean 0)."""
    from engine.runlog import RunWriter

    steps = {
        0: {"rollouts": [(0, "train", 1.0, False, "ab"), (1, "train", -1.0, False, "ace"), (2, "eval", 0.0, False,
                                                                                               "z")],
            "entropy": {0: [0.2, 0.4], 1: [0.6, 0.8, 1.0], 2: [0.9]},
            "passes": [{0: ([-0.1, -0.5], [0.01, 0.03]), 1: ([-1.0, -2.0, -9.0], [0.02, 0.14, 5.0])}],
            "rejected": {(0, 1, 2)}, "selected": {(0, 0, 1)}, "step_entropy": 0.5},
        1: {"rollouts": [(0, "train", 2.0, False, "ac"), (1, "train", 0.0, False, "bd"), (2, "train", 5.0, True,
                                                                                           "c")],
            "entropy": {0: [0.1, 0.3], 1: [0.5, 0.7], 2: [0.9]},
            "passes": [{0: ([-0.2, -0.6], [0.0, 0.1]), 1: ([-0.3, -0.9], [0.0, 0.0]), 2: ([-3.0], [7.0])},
                       {0: ([-0.1, -0.6], [np.nan] * 2), 1: ([-0.3, -1.1], [np.nan] * 2), 2: ([-3.0], [np.nan])}],
            "rejected": set(), "selected": set(), "step_entropy": 0.4},
    }
    with RunWriter.create(logs_dir, name, algorithm="grpo", task="linear", config={"supervision": "outcome"},
                          background=False) as writer:
        for step, spec in steps.items():
            rollouts = pd.DataFrame([
                {"rollout_id": rid, "group_id": 0 if kind == "train" else 1000, "index_in_group": rid, "kind": kind,
                 "prompt_id": 0, "advantage": adv, "length": len(text), "reward": adv, "filtered": filtered,
                 "filter_reason": "overlong" if filtered else None, "completion": text}
                for rid, kind, adv, filtered, text in spec["rollouts"]])
            tokens = pd.DataFrame([
                {"rollout_id": rid, "position": pos, "token_text": ch, "advantage": adv, "old_logp": -1.0,
                 "entropy": spec["entropy"][rid][pos]}
                for rid, _, adv, _, text in spec["rollouts"] for pos, ch in enumerate(text)])
            passes = pd.DataFrame([
                {"pass": p, "rollout_id": rid, "position": pos, "new_logp": logp, "kl": kl, "ratio": 1.0,
                 "clip": CLIP_COV if (p, rid, pos) in spec["selected"] else CLIP_NONE, "grad_weight": 0.0,
                 "rejected": int((p, rid, pos) in spec["rejected"])}
                for p, by_rollout in enumerate(spec["passes"]) for rid, (logps, kls) in by_rollout.items()
                for pos, (logp, kl) in enumerate(zip(logps, kls, strict=True))])
            whitening = {} if advantage_std is None else {"advantage_mean": 0.0, "advantage_std": advantage_std}
            writer.log_step(step, metrics={"entropy": spec["step_entropy"], **whitening}, rollouts=rollouts,
                            tokens=tokens, token_passes=passes)
