"""How long each dashboard page takes (server time), at up to 100M token rows.

    python benchmarks/bench_dashboard.py                      # 400 steps x 512 completions of 325-650 tokens:
                                                              # 100M token rows, 200M token-pass rows
    python benchmarks/bench_dashboard.py --steps 40           # 10M token rows
    python benchmarks/bench_dashboard.py --runs 200           # + `policylens runs` and a refresh over 200 runs
    python benchmarks/bench_dashboard.py --shape long         # a reasoning run: 15 steps x 256 completions of
                                                              # ~2k tokens (up to 16k): 10M token rows
    python benchmarks/bench_dashboard.py --shape long --steps 150   # 100M token rows

The run is written once into `--logs-dir` (default `bench_logs/`, git-ignored) and reused by later invocations.
It goes through `RunWriter.log_many`, which writes each step straight into the chunk compaction would finally put
it in (the same files as `log_step` step by step, each row encoded once). Then:
- functions: the main queries and figures on their own, caches bypassed;
- pages: every page rendered with streamlit's AppTest, median of `--repeat`:
  cold = the page's query results not cached (first look at a step: `st.cache_data` cleared), new reader = also a
  new DuckDB connection (Parquet footers read again), warm = the same page again (a widget interaction);
  sent = the kilobytes of the page's elements as the server sends them to the browser;
- the benchmark process's peak resident memory (it is the dashboard server here);
- with `--runs N`: N small runs in a second logs folder, `policylens runs` timed as a command, and the reader's
  refresh when nothing changed (what the live view pays every poll).
Server time only; what a browser adds is `benchmarks/bench_browser.py`.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy is imported where it is used, so `--help` starts fast
    import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PAGES = ["runs", "replay", "groups", "token_inspector", "prm_steps", "advantages", "algorithm_weighting", "token_stats",
         "token_trajectories", "mismatch"]
RUN_PREFIX = "bench-s"  # "-s": runs written with the sampler columns (an older "bench-..." run lacks them)
VOCAB = ["2", "x", " +", " 3", " =", " 7", "\n", " -", " 4", "x =", " 2", "Step", " 1", ":", " so", " subtract",
         " divide", " by", "<eos>"]


@dataclass(frozen=True)
class Shape:
    """How the benchmark run's steps look: the sizes of a step's groups, the completion lengths, the reasoning steps.

    short: groups of `group_size` equal-size groups, lengths uniform in [max_len/2, max_len], three reasoning steps
    per completion (the engine's own tasks, scaled up).
    long: a reasoning run (the runs the TRL adapter and the importers bring in): 256 rollouts a step in groups of 8
    and 16, lengths log-normal around 2k tokens with a tail cut at 16k (a longer one is truncated there, as a
    `max_completion_length` does), a process-supervised step every ~50 tokens."""

    name: str
    group_sizes: tuple[int, ...]
    max_len: int
    median_len: float | None = None  # None: uniform lengths in [max_len/2, max_len]; else log-normal around it
    tokens_per_prm_step: int | None = None  # None: three reasoning steps per completion
    zipf_vocabulary: int = 0  # 0: the texts of VOCAB, drawn alike; else ids of this many, drawn by Zipf's law

    def lengths(self, rng, n: int):
        import numpy as np

        if self.median_len is None:
            return rng.integers(max(2, self.max_len // 2), self.max_len + 1, n)
        # sigma 0.8: ~0.5% of completions reach 16k from a 2k median, one or two per 256-rollout step.
        drawn = rng.lognormal(np.log(self.median_len), 0.8, n)
        return np.clip(np.round(drawn), 32, self.max_len).astype(np.int64)

    def prm_steps_of(self, rng, lengths):
        """The number of reasoning steps of each completion, (N,)."""
        import numpy as np

        if self.tokens_per_prm_step is None:
            return np.full(len(lengths), 3)
        spacing = rng.integers(self.tokens_per_prm_step * 4 // 5, self.tokens_per_prm_step * 6 // 5 + 1, len(lengths))
        return np.maximum(1, -(-lengths // spacing))  # ceil(length / spacing)


REAL_VOCABULARY = 151_936
"""`--vocabulary zipf`: token ids of a vocabulary of this size (Qwen2's), the id of frequency rank r drawn with
probability ~ 1/r (a text's words; the ranks mapped to ids in a fixed random order), each its own text: a long step
of 0.77M tokens holds ~90k distinct texts, where VOCAB's equation pieces are 19."""


@functools.cache
def _zipf_table(size: int):
    """(cumulative weights by rank (size,), the id of each rank (size,), the text of each id (size,))."""
    import numpy as np

    cumulative = np.cumsum(1.0 / np.arange(1, size + 1))
    id_of_rank = np.random.default_rng(0).permutation(size)
    return cumulative, id_of_rank, np.array([f" w{i}" for i in range(size)], dtype=object)


def zipf_tokens(rng, size: int, n: int):
    """(token ids (n,), their texts (n,)) drawn by Zipf's law over `size` ids (see REAL_VOCABULARY)."""
    import numpy as np

    cumulative, id_of_rank, texts = _zipf_table(size)
    ids = id_of_rank[np.minimum(np.searchsorted(cumulative, rng.random(n) * cumulative[-1]), size - 1)]
    return ids, texts[ids]


def short_shape(groups: int, group_size: int, length: int) -> Shape:
    return Shape(f"{groups}x{group_size}x{length}", (group_size,) * groups, length)


LONG_SHAPE = Shape("long-256x16384", (8,) * 16 + (16,) * 8, 16384, median_len=2000, tokens_per_prm_step=50)


def run_name(steps: int, shape: Shape) -> str:
    return f"{RUN_PREFIX}-{steps}x{shape.name}" if shape.median_len is None else f"{RUN_PREFIX}-{shape.name}-{steps}"


def synthetic_step(step: int, shape: Shape, passes: int, rng) -> dict:
    """One step's tables (the keyword arguments of `RunWriter.log_step`), built with numpy in bulk.

    Shaped like the engine's: groups of completions of an equation task (plus 2 eval prompts), log-probs, ratios
    that drift from 1 across passes, clip codes by the GRPO rule, reasoning steps over each completion, and a
    sampler/trainer mismatch: sampler log-probs off the trainer's by N(0, 0.03) with a 5% tail of N(0, 0.3), token
    TIS weights (truncated at 2) and seq_mean_k3 rejections in every pass, the step's `mismatch_*` metrics.
    The helpers draw from `rng` in this order (rewards and lengths, tokens, passes, rollouts, reasoning steps,
    metrics): another order gives another run for the same seed."""
    completions = _completions(step, shape, rng)
    tokens, log_ratio, prm_count = _token_rows(shape, completions, rng)
    trained = tokens["rollout_id"] < completions.n_train  # (T_total,)
    rejected, is_weight = _corrections(log_ratio, completions.lengths, tokens["rollout_id"], trained)
    token_passes = _pass_rows(tokens, completions.lengths, trained, rejected, is_weight, passes, rng)
    rollouts = _rollout_rows(step, shape, completions, tokens["token_text"], rng)
    prm_steps = _prm_step_rows(prm_count, completions.lengths, tokens["token_text"], rng)
    metrics = _step_metrics(step, shape, completions, tokens, token_passes, log_ratio[trained], rejected, is_weight,
                            rng)
    return {"metrics": metrics, "rollouts": rollouts, "tokens": tokens, "token_passes": token_passes,
            "prm_steps": prm_steps}


@dataclass(frozen=True)
class _Completions:
    """A step's completions: the train groups' (N_train of them), then one per eval prompt (N in all)."""

    sizes: np.ndarray  # (G,) the groups' sizes
    group_of: np.ndarray  # (N_train,) each train completion's group
    reward: np.ndarray  # (N,)
    advantage: np.ndarray  # (N,) GRPO's, zero for the evals
    mean: np.ndarray  # (G,) each group's reward mean
    std: np.ndarray  # (G,) and its sample std
    lengths: np.ndarray  # (N,) in tokens
    evals: int

    @property
    def n_train(self) -> int:
        return len(self.group_of)


def _completions(step: int, shape: Shape, rng, evals: int = 2) -> _Completions:
    """Rewards with a success rate that climbs over the steps, their GRPO advantages, the lengths drawn by the
    shape."""
    import numpy as np

    sizes = np.array(shape.group_sizes)
    groups = len(sizes)
    group_of = np.repeat(np.arange(groups), sizes)  # (N_train,)
    n_train = len(group_of)
    reward = (rng.random(n_train + evals) < 0.3 + 0.5 * step / (step + 10)).astype(float)
    train_reward = reward[:n_train]
    count = np.bincount(group_of, minlength=groups)
    mean = np.bincount(group_of, train_reward, groups) / count
    std = np.sqrt(np.bincount(group_of, (train_reward - mean[group_of]) ** 2, groups) / np.maximum(count - 1, 1))
    advantage = np.concatenate([(train_reward - mean[group_of]) / (std[group_of] + 1e-6), np.zeros(evals)])
    lengths = shape.lengths(rng, n_train + evals)
    return _Completions(sizes, group_of, reward, advantage, mean, std, lengths, evals)


def _token_rows(shape: Shape, completions: _Completions, rng):
    """The tokens table of these completions, the sampler's log-ratio per token (T_total,) (old_logp -
    sampler_logp) and each completion's number of reasoning steps (N,)."""
    import numpy as np

    lengths = completions.lengths

    rollout = np.repeat(np.arange(len(lengths)), lengths)  # (T_total,)
    position = np.arange(len(rollout)) - (np.cumsum(lengths) - lengths)[rollout]
    if shape.zipf_vocabulary:
        token_id, token_text = zipf_tokens(rng, shape.zipf_vocabulary, len(rollout))
    else:
        token_id = rng.integers(0, len(VOCAB), len(rollout))
        token_text = np.array(VOCAB, dtype=object)[token_id]
    old_logp = -rng.gamma(1.0, 0.6, len(rollout))
    ref_logp = old_logp + rng.normal(0, 0.05, len(rollout))
    prm_count = shape.prm_steps_of(rng, lengths)  # (N,)
    log_ratio = np.where(rng.random(len(rollout)) < 0.05, rng.normal(0, 0.3, len(rollout)),
                         rng.normal(0, 0.03, len(rollout)))
    sampler_logp = old_logp - log_ratio
    tokens = {"rollout_id": rollout, "position": position, "token_id": token_id,
              "token_text": token_text, "old_logp": old_logp, "ref_logp": ref_logp,
              "entropy": rng.gamma(2.0, 0.4, len(rollout)), "advantage": completions.advantage[rollout],
              "prm_step": position * prm_count[rollout] // lengths[rollout], "sampler_logp": sampler_logp,
              "sampler_logp_full": sampler_logp - rng.exponential(0.01, len(rollout))}
    return tokens, log_ratio, prm_count


def _corrections(log_ratio, lengths, rollout, trained):
    """verl's seq_mean_k3 rejection at 0.01 and token TIS at 2 over the trained tokens, the same in every pass:
    (rejected code, IS weight), each (T_trained,)."""
    import numpy as np

    from engine.correction_settings import REJECT_NONE, REJECT_SEQUENCE

    k3 = np.exp(log_ratio) - 1 - log_ratio
    seq_k3 = np.bincount(rollout, k3) / lengths  # (N,) per-rollout mean
    rejected = np.where(seq_k3[rollout] > 0.01, REJECT_SEQUENCE, REJECT_NONE).astype(np.int8)[trained]
    return rejected, np.minimum(np.exp(log_ratio), 2.0)[trained]


def _pass_rows(tokens: dict, lengths, trained, rejected, is_weight, passes: int, rng) -> dict | None:
    """The token_passes table: `passes` optimisation passes over the trained tokens, the ratio drifting from 1 by
    N(0, 0.08 * pass) in log space, clip codes by the GRPO rule (0.8/1.2, the dual cap at 3); None for no pass."""
    import numpy as np

    from engine.clip_codes import CLIP_CAP, CLIP_HIGH, CLIP_LOW, CLIP_NONE
    from engine.correction_settings import REJECT_NONE

    old_logp, a = tokens["old_logp"][trained], tokens["advantage"][trained]
    rollout = tokens["rollout_id"][trained]
    size = lengths[rollout]
    per_pass = []
    for p in range(passes):
        new_logp = old_logp + rng.normal(0, 0.08 * p, len(old_logp))
        ratio = np.exp(new_logp - old_logp)
        clip = np.where((a < 0) & (ratio < 0.8), CLIP_LOW, np.where((a > 0) & (ratio > 1.2), CLIP_HIGH, CLIP_NONE))
        clip = np.where((a < 0) & (ratio > 3), CLIP_CAP, clip).astype(np.int8)
        log_ratio_ref = tokens["ref_logp"][trained] - new_logp
        kept = (clip == CLIP_NONE) & (rejected == REJECT_NONE)
        per_pass.append({"pass": np.full(len(ratio), p), "rollout_id": rollout,
                         "position": tokens["position"][trained], "new_logp": new_logp, "ratio": ratio, "clip": clip,
                         "grad_weight": np.where(kept, is_weight * ratio * a / size, 0.0),
                         "token_loss": -is_weight * ratio * a / size, "kl": np.exp(log_ratio_ref) - log_ratio_ref - 1,
                         "is_weight": is_weight, "rejected": rejected})
    return {k: np.concatenate([p[k] for p in per_pass]) for k in per_pass[0]} if per_pass else None


def _rollout_rows(step: int, shape: Shape, completions: _Completions, text, rng) -> dict:
    """The rollouts table: the train groups' completions (groups of zero reward spread filtered), then the evals."""
    import numpy as np

    sizes, group_of, evals, lengths = completions.sizes, completions.group_of, completions.evals, completions.lengths
    n_train, n = completions.n_train, len(completions.reward)
    kind = np.array(["train"] * n_train + ["eval"] * evals, dtype=object)
    prompt_index = np.concatenate([group_of, np.arange(evals)])  # (N,)
    prompts = np.array([f"Solve for x: {g + 2}x + 3 = {2 * g + 7}" for g in range(max(len(sizes), evals))],
                       dtype=object)
    filtered = np.concatenate([(completions.std == 0)[group_of], np.zeros(evals, bool)])
    all_correct = np.where(completions.mean == 1, "all_correct", "all_wrong")[group_of]
    starts = np.cumsum(lengths) - lengths
    return {
        "rollout_id": np.arange(n), "group_id": np.where(kind == "train", prompt_index, 1000 + prompt_index),
        "index_in_group": np.concatenate([np.arange(n_train) - (np.cumsum(sizes) - sizes)[group_of],
                                          np.zeros(evals, int)]),
        "kind": kind, "prompt_id": np.where(kind == "train", prompt_index + step * len(sizes), prompt_index),
        "prompt": prompts[prompt_index],
        "completion": ["".join(text[s:s + k]) for s, k in zip(starts, lengths, strict=True)],
        "answer": (prompt_index + 2).astype(str).astype(object), "reward": completions.reward,
        "reward_correct": completions.reward,
        "reward_process": rng.normal(size=n), "reward_length": np.zeros(n), "advantage": completions.advantage,
        "length": lengths, "truncated": lengths == shape.max_len, "filtered": filtered,
        "filter_reason": np.where(filtered, np.concatenate([all_correct, [""] * evals]), None),
    }


def _prm_step_rows(prm_count, lengths, text, rng) -> dict:
    """The prm_steps table: each completion's reasoning steps spread evenly over its tokens (a token at position
    `pos` of a completion of `size` tokens and `k` steps is in step pos * k // size, as the tokens' `prm_step`)."""
    import numpy as np

    starts = np.cumsum(lengths) - lengths
    prm_rollout = np.repeat(np.arange(len(lengths)), prm_count)  # (S,)
    index = np.arange(len(prm_rollout)) - (np.cumsum(prm_count) - prm_count)[prm_rollout]
    k, size = prm_count[prm_rollout], lengths[prm_rollout]
    first, last = (index * size + k - 1) // k, ((index + 1) * size + k - 1) // k - 1  # tokens with pos*k//size == i
    return {"rollout_id": prm_rollout, "step_index": index, "first_pos": first, "last_pos": last,
            "text": np.array(["".join(text[starts[r] + f: starts[r] + f + 4])
                              for r, f in zip(prm_rollout, first, strict=True)], dtype=object),
            "reward_raw": rng.random(len(prm_rollout)), "reward_norm": rng.normal(size=len(prm_rollout))}


def _step_metrics(step: int, shape: Shape, completions: _Completions, tokens: dict, token_passes, log_ratio, rejected,
                  is_weight, rng) -> dict:
    """The steps row; its `mismatch_*` values as `engine.logrows.mismatch_metrics` computes them, over the trained
    tokens' sampler log-ratios (`log_ratio`, (T_trained,))."""
    import numpy as np

    from engine.clip_codes import clip_fractions, count_clip_events, fraction_column

    n_train, std = completions.n_train, completions.std
    train_reward, lengths = completions.reward[:n_train], completions.lengths[:n_train]  # (N_train,)
    clip_all = token_passes["clip"] if token_passes else np.zeros(0, np.int8)
    k3 = np.exp(log_ratio) - 1 - log_ratio
    return {
        "wall_time": 30.0 * step, "step_seconds": 30.0, "reward_mean": float(train_reward.mean()),
        "reward_std": float(train_reward.std()), "accuracy": float(train_reward.mean()),
        "heldout_accuracy": float(completions.reward[n_train:].mean()) if step % 10 == 0 else None,
        "entropy": float(tokens["entropy"].mean()),
        "kl": float(token_passes["kl"].mean()) if token_passes else 0.0,
        **{fraction_column(c): share
           for c, share in clip_fractions(count_clip_events(np.asarray(clip_all)), len(clip_all)).items()},
        "response_len_mean": float(lengths.mean()), "response_len_max": float(lengths.max()),
        "truncated_frac": float((lengths == shape.max_len).mean()),
        "groups_kept": int(len(std) - (std == 0).sum()), "groups_filtered": int((std == 0).sum()), "gen_batches": 1,
        "loss": float(rng.normal()), "grad_norm": float(rng.random()), "lr": 1e-6,
        "mismatch_kl": float(-log_ratio.mean()), "mismatch_k3_kl": float(k3.mean()),
        "mismatch_chi2_token": float(np.exp(2 * log_ratio).mean() - 1),
        "mismatch_out_of_band": float(((log_ratio < np.log(0.9)) | (log_ratio > np.log(1.1))).mean()),
        "mismatch_mean_abs_log_ratio": float(np.abs(log_ratio).mean()),
        "mismatch_rejected_token_share": float((rejected > 0).mean()),
        "mismatch_is_weight_ess": float(is_weight.mean() ** 2 / (is_weight ** 2).mean()),
    }


def ensure_run(logs_dir, steps: int, shape: Shape, passes: int = 2) -> str:
    """Write the benchmark run once (reused by later invocations); return its name.

    `RunWriter.log_many` puts each step straight into its final chunk: the same files as logging the steps one
    by one with compaction, each row encoded once. A run left unfinished (interrupted build) is rebuilt."""
    import numpy as np

    from engine.runlog import RunWriter, list_runs

    name = run_name(steps, shape)
    existing = {r["run"]: r for r in list_runs(logs_dir)}
    if name in existing and existing[name]["status"] == "finished" and existing[name]["last_step"] == steps - 1:
        return name
    if name in existing:
        print(f"{name}: incomplete ({existing[name]['status']}), rebuilding")
        shutil.rmtree(Path(logs_dir) / name)
    started = time.perf_counter()
    config = {"algorithm": "grpo", "group_sizes": sorted(set(shape.group_sizes)), "rollouts": sum(shape.group_sizes),
              "max_len": shape.max_len, "passes": passes, "synthetic": True}
    rng = np.random.default_rng(0)
    with RunWriter.create(logs_dir, name, algorithm="grpo", task="linear_equation", config=config,
                          model="synthetic") as writer:
        def tables_of(step: int) -> dict:
            if step % 25 == 0:
                print(f"  step {step}/{steps} ({time.perf_counter() - started:.0f} s)", flush=True)
            return synthetic_step(step, shape, passes, rng)

        writer.log_many(range(steps), tables_of)
    print(f"wrote {name} in {time.perf_counter() - started:.0f} s")
    return name


def describe(logs_dir: Path, run: str) -> None:
    """Rows (from the Parquet footers: a count through DuckDB would inflate this process's peak memory) and bytes."""
    import pyarrow.parquet as pq

    from engine.runlog import data_dir_of
    from engine.runlog.layout import scan_segments

    sizes: dict[str, int] = {}
    rows: dict[str, int] = {}
    # The live folders only: right after writing, the folders a merge replaced are still being deleted by a thread
    # (counting them counted rows twice, and listing one as it vanished failed).
    segments = scan_segments(data_dir_of(logs_dir / run))
    for path in (p for segment in segments for p in Path(segment.path).glob("*.parquet")):
        sizes[path.stem] = sizes.get(path.stem, 0) + path.stat().st_size
        rows[path.stem] = rows.get(path.stem, 0) + pq.ParquetFile(path).metadata.num_rows
    tokens, passes = rows.get("tokens", 0), rows.get("token_passes", 0)
    print(f"{run}: {tokens:,} token rows ({sizes.get('tokens', 0) / max(tokens, 1):.1f} B/row), {passes:,} "
          f"token-pass rows ({sizes.get('token_passes', 0) / max(passes, 1):.1f} B/row), "
          f"{rows.get('rollouts', 0):,} rollouts, {sum(sizes.values()) / 1e9:.2f} GB, "
          f"{len(segments)} folders")


def cpu_seconds() -> float:
    """CPU time of this process so far, every thread's (DuckDB's and the script runner's included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def time_reruns(at, repeat: int) -> dict[str, float]:
    """Median server time of re-running the current page with no cached query results (cold), with a new reader
    too (new reader), and right after (warm); the CPU seconds of the cold and warm runs too (the honest figure on a
    busy machine, where wall time counts the waits for a core)."""
    import streamlit as st

    times: dict[str, list[float]] = {"new reader": [], "cold": [], "warm": [], "cold cpu": [], "warm cpu": []}
    for _ in range(repeat):
        for label in ("new reader", "cold", "warm"):
            if label == "new reader":
                st.cache_resource.clear()
            if label != "warm":
                st.cache_data.clear()
            started, cpu = time.perf_counter(), cpu_seconds()
            at.run()
            times[label].append(time.perf_counter() - started)
            if label != "new reader":
                times[f"{label} cpu"].append(cpu_seconds() - cpu)
            assert not at.exception, [e.message for e in at.exception]
    return {**{label: statistics.median(values) for label, values in times.items()}, "sent": sent_kb(at)}


def sent_kb(at) -> float:
    """Kilobytes of the page's elements as the server sends them to the browser (their protobuf messages: figures,
    tables, text), what the transfer and the browser's drawing grow with."""
    def size(node) -> int:
        proto = getattr(node, "proto", None)
        own = len(proto.SerializeToString()) if hasattr(proto, "SerializeToString") else 0
        return own + sum(size(child) for child in getattr(node, "children", {}).values())

    return size(at._tree) / 1000


def longest_rollout(logs_dir: Path, run: str) -> tuple[int, int, int]:
    """(step, rollout id, length) of the run's longest train completion (the first such step)."""
    from engine.runlog import RunReader

    row = RunReader(logs_dir, run).sql("SELECT step, rollout_id, length FROM rollouts WHERE kind = 'train' "
                                       "ORDER BY length DESC, step LIMIT 1").iloc[0]
    return int(row["step"]), int(row["rollout_id"]), int(row["length"])


def time_pages(logs_dir: Path, run: str, step: int, repeat: int, pages: list[str] = PAGES) -> list[dict]:
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    from engine.runlog import RunReader

    os.environ["POLICYLENS_LOGS_DIR"] = str(logs_dir)
    at = AppTest.from_file(str(ROOT / "dashboard" / "streamlit_app.py"), default_timeout=600)
    at.query_params["run"] = run
    at.query_params["step"] = step  # inside the largest chunk, not the small newest step folder
    at.run()
    rows = []
    for page in pages:
        at.switch_page(f"app_pages/{page}.py").run()  # warm-up: imports (torch for the weighting page)
        assert not at.exception, [e.message for e in at.exception]
        rows.append({"page": page, **time_reruns(at, repeat)})
    if "algorithm_weighting" not in pages:
        return rows
    # The heaviest view: every completion of the step through the six objectives at once.
    at.switch_page("app_pages/algorithm_weighting.py").run()
    at.radio(key="weigh_scope").set_value("the whole step")
    rows.append({"page": "weighting, whole step", **time_reruns(at, repeat)})
    # The pages of one group and one completion on the run's longest completion (its group for Advantages).
    token_step, rollout, length = longest_rollout(logs_dir, run)
    group = int(RunReader(logs_dir, run).sql("SELECT group_id FROM rollouts WHERE step = ? AND rollout_id = ?",
                                             [token_step, rollout])["group_id"].iloc[0])
    at.query_params["step"], at.query_params["rollout"], at.query_params["group"] = token_step, rollout, group
    for page in ("advantages", "prm_steps"):
        at.switch_page(f"app_pages/{page}.py").run()
        rows.append({"page": f"{page}, {length} tok", **time_reruns(at, repeat)})
    # Replay's step move: from a step to a step not seen yet, then back.
    at.switch_page("app_pages/replay.py").run()
    st.cache_data.clear()
    at.select_slider(key="replay_step").set_value(step).run()
    for label, target in (("replay, new step", step + 1), ("replay, seen step", step)):
        started, cpu = time.perf_counter(), cpu_seconds()
        at.select_slider(key="replay_step").set_value(target).run()
        assert not at.exception, [e.message for e in at.exception]
        rows.append({"page": label, "new reader": math.nan, "cold": time.perf_counter() - started, "warm": math.nan,
                     "cold cpu": cpu_seconds() - cpu, "warm cpu": math.nan, "sent": sent_kb(at)})
    # The Token inspector on the run's longest completion, then moving its window (each window a new query).
    at.query_params["step"], at.query_params["rollout"] = token_step, rollout
    at.switch_page("app_pages/token_inspector.py").run()
    rows.append({"page": f"tokens, {length} tok", **time_reruns(at, repeat)})
    if at.select_slider:
        moves = []
        for start in at.select_slider(key="window").options[1:repeat + 1]:
            started = time.perf_counter()
            at.select_slider(key="window").set_value(int(start.split("–")[0])).run()
            moves.append(time.perf_counter() - started)
            assert not at.exception, [e.message for e in at.exception]
        rows.append({"page": "tokens, move window", "new reader": math.nan, "cold": statistics.median(moves),
                     "warm": math.nan, "cold cpu": math.nan, "warm cpu": math.nan, "sent": sent_kb(at)})
    return rows


def time_functions(logs_dir: Path, run: str, repeat: int) -> list[tuple[str, float, float]]:
    """Query + chart functions on their own (no Streamlit script run), caches bypassed via __wrapped__; medians of
    wall time and of CPU time (every thread's, DuckDB's included: the cost on a machine busy with other work)."""
    from dashboard import charts, queries, recompute
    from dashboard.common import latest_steps_within
    from dashboard.tokens import CHANNELS, token_spans
    from engine.objectives import ALGORITHMS

    logs = str(logs_dir)
    reader = queries.get_reader(logs)
    last = int(reader.sql("SELECT max(step) AS s FROM steps WHERE run = ?", [run])["s"][0])
    middle = last // 2
    version = (run, last)
    out = []

    def timed(name, function, *args):
        times, cpu = [], []
        for _ in range(repeat):
            started, cpu_started = time.perf_counter(), time.process_time()
            value = getattr(function, "__wrapped__", function)(*args)
            times.append(time.perf_counter() - started)
            cpu.append(time.process_time() - cpu_started)
        out.append((name, statistics.median(times), statistics.median(cpu)))
        return value

    timed("runs_table", queries.runs_table, logs)
    steps = timed("run_steps", queries.run_steps, logs, (run,), version)
    timed("metric_curves figure", charts.metric_curves, steps)
    rollouts = timed("step_rollouts (middle step)", queries.step_rollouts, logs, run, middle, None)
    timed("group_summary", queries.group_summary, logs, run, middle)
    rollout = int(rollouts["rollout_id"].iloc[len(rollouts) // 2])
    tokens = timed("rollout_tokens (1 rollout)", queries.rollout_tokens, logs, run, middle, (rollout,), 1)
    timed("weighed_tokens (1 rollout)", queries.weighed_tokens, logs, run, middle, (rollout,))
    timed("weighed_passes (1 rollout)", queries.weighed_passes, logs, run, middle, (rollout,), -1)
    timed("token_spans", token_spans, tokens, "ratio")
    timed("token_channel_heatmap figure", charts.token_channel_heatmap, tokens, list(CHANNELS))
    # The Token inspector on the run's longest completion: what it draws (bins, a window) against the whole.
    at, longest, length = longest_rollout(logs_dir, run)
    size = f"{length} tokens"
    whole = timed(f"rollout_tokens (whole, {size})", queries.rollout_tokens, logs, run, at, (longest,), 1)
    timed(f"token_spans (whole, {size})", token_spans, whole, "ratio")
    bins = timed("rollout_token_bins (1000 bins)", queries.rollout_token_bins, logs, run, at, longest, 1, 1000)
    window = timed("rollout_tokens (window of 512)", queries.rollout_tokens, logs, run, at, (longest,), 1,
                   (4096, 4607))
    timed("token_spans (window of 512)", token_spans, window, "ratio")
    timed("token_overview_strip figure", charts.token_overview_strip, bins, "ratio", (4096, 4607), 512)
    timed("token_channel_bins figure", charts.token_channel_bins, bins, list(CHANNELS))
    group = tuple(int(r) for r in rollouts[rollouts["group_id"] == rollouts["group_id"].iloc[0]]["rollout_id"])
    group_tokens = timed("rollout_tokens (1 group)", queries.rollout_tokens, logs, run, middle, group, 1)
    timed("prm_steps (1 group)", queries.prm_steps, logs, run, middle, group)
    timed("step_pass_summary", queries.step_pass_summary, logs, run, middle)
    timed("rollout_total_weights", queries.rollout_total_weights, logs, run, middle)
    timed("eval_prompts", queries.eval_prompts, logs, run, version)
    timed("eval_prompt_history", queries.eval_prompt_history, logs, run, 0, version)
    # The Token statistics page opens on the whole run when its token summary covers every step, else on the
    # latest steps within a budget of tokens read row by row (a whole 100M-token run without a summary: 44 s).
    all_steps = sorted(int(s) for s in steps["step"])
    first = all_steps[0]
    if gaps := timed("unsummarised_steps", queries.unsummarised_steps, logs, run, version):
        per_step = timed("train_tokens_per_step", queries.train_tokens_per_step, logs, run, version)
        unsummarised = {s: n for s, n in per_step.items() if any(a <= s <= b for a, b in gaps)}
        first = latest_steps_within(all_steps, unsummarised, queries.STATS_DEFAULT_TOKENS)
    span = f"steps {first}-{last}"
    stats = timed(f"token_stats ({span})", queries.token_stats, logs, run, first, last, 0, version)
    timed(f"token_stats ({span}, by 8 positions)", queries.token_stats, logs, run, first, last, 8, version)
    timed(f"rollouts_with_token ({span})", queries.rollouts_with_token, logs, run, first, last,
          str(stats["token_text"].iloc[0]), 0, None)
    bins = timed(f"entropy_bins ({span})", queries.entropy_bins, logs, (run,), first, last, 10, version)
    timed(f"covariance_drivers ({span})", queries.covariance_drivers, logs, run, first, last, 0, version)
    timed(f"covariance_drivers ({span}, by 8 positions)", queries.covariance_drivers, logs, run, first, last, 8,
          version)
    timed(f"covariance_per_step ({span})", queries.covariance_per_step, logs, run, first, last, version)
    timed("entropy_bin_bars figure", charts.entropy_bin_bars, bins, 10, queries.ASPO_ENTROPY_QUANTILE)
    timed("mismatch_curves", queries.mismatch_curves, logs, (run,), version)
    view = timed("step_mismatch (middle step)", queries.step_mismatch, logs, run, middle)
    timed("mismatch figures", lambda: [charts.mismatch_histogram(view.histogram, (0.9, 1.1)),
                                       charts.probability_scatter(view.probabilities, view.grid_cells),
                                       charts.mismatch_buckets(view.buckets), charts.sequence_mismatch(view.sequences)])
    timed("correction_table (middle step)", queries.correction_table, logs, run, middle)
    timed("correction_weights (1 group)", queries.correction_weights, logs, run, middle, group, 333)
    batch = timed("batch_from_tokens (1 group)", recompute.batch_from_tokens, group_tokens)
    for algo in ALGORITHMS:
        timed(f"policy_loss {algo} (1 group)", recompute.weigh, batch, algo, {})
    return out


def many_runs(logs_dir: Path, count: int, repeat: int) -> None:
    """`policylens runs` (a new process) and a no-change refresh over `count` small runs of 40 steps each."""
    from engine.runlog import RunReader, RunWriter

    folder = logs_dir.parent / f"{logs_dir.name}-many-{count}"  # a logs folder of its own
    if len(list(folder.glob("*/run.json"))) != count:
        shutil.rmtree(folder, ignore_errors=True)
        import numpy as np

        started = time.perf_counter()
        for i in range(count):
            rng = np.random.default_rng(i)
            with RunWriter.create(folder, f"run-{i:04d}", algorithm="grpo", task="linear_equation") as writer:
                writer.log_many(range(40), lambda step, rng=rng: synthetic_step(step, short_shape(2, 4, 32), 2, rng))
        print(f"wrote {count} runs in {time.perf_counter() - started:.0f} s")
    command = [sys.executable, "-m", "engine.cli", "runs", "--logs-dir", str(folder)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
        times.append(time.perf_counter() - started)
    shown = sum(1 for line in done.stdout.splitlines() if line.startswith("run-"))
    print(f"`policylens runs` over {count} runs ({shown} listed): {statistics.median(times):.2f} s "
          f"(median of {repeat}, whole command)")
    reader = RunReader(folder)
    times = []
    for _ in range(max(repeat, 5)):
        started = time.perf_counter()
        changed = reader.refresh()
        times.append(time.perf_counter() - started)
        assert not changed
    print(f"reader.refresh() with nothing new over {count} runs: {statistics.median(times) * 1000:.1f} ms")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kilobytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logs-dir", default=str(ROOT / "bench_logs"))
    parser.add_argument("--shape", choices=["short", "long"], default="short",
                        help="short: --groups x --group-size completions of up to --length tokens; long: a reasoning "
                        "run's (256 rollouts a step in groups of 8 and 16, log-normal lengths around 2k up to 16k)")
    parser.add_argument("--steps", type=int, default=None, help="default 400 (short: 100M token rows), 15 (long: "
                        "10M)")
    parser.add_argument("--vocabulary", choices=["small", "zipf"], default="small",
                        help="small: VOCAB's 19 equation pieces; zipf: a real vocabulary's size and frequencies "
                        "(REAL_VOCABULARY)")
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--length", type=int, default=650, help="longest completion; lengths from half of it")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--runs", type=int, default=0, help="also time `policylens runs` over this many runs")
    parser.add_argument("--build-only", action="store_true", help="write the run (if missing) and stop")
    parser.add_argument("--skip-pages", action="store_true", help="functions only, no AppTest page renders")
    parser.add_argument("--pages", default=",".join(PAGES), help="the pages to render, comma separated")
    parser.add_argument("--skip-functions", action="store_true", help="pages only")
    args = parser.parse_args(argv)
    logs_dir = Path(args.logs_dir).resolve()
    shape = LONG_SHAPE if args.shape == "long" else short_shape(args.groups, args.group_size, args.length)
    if args.vocabulary == "zipf":
        shape = replace(shape, name=f"{shape.name}-zipf", zipf_vocabulary=REAL_VOCABULARY)
    args.steps = args.steps or (15 if args.shape == "long" else 400)
    run = ensure_run(logs_dir, args.steps, shape)
    describe(logs_dir, run)
    if args.build_only:
        return 0
    if args.runs:
        many_runs(logs_dir, args.runs, args.repeat)
    import streamlit.logger
    import torch

    streamlit.logger.set_log_level("error")  # AppTest's "no runtime" warnings, one per cached function
    torch.set_num_threads(1)
    run_dir_logs = logs_dir  # the dashboard sees every run of this folder, as a user's would
    if not args.skip_functions:
        print(f"\nquery and figure functions (uncached, median of {args.repeat}):")
        print(f"  {'':<40} {'wall':>11} {'cpu':>11}")
        for name, seconds, cpu in time_functions(run_dir_logs, run, args.repeat):
            print(f"  {name:<40} {seconds * 1000:8.1f} ms {cpu * 1000:8.1f} ms")
    if not args.skip_pages:
        print(f"\npage render at step {(args.steps - 1) // 2}, server time (AppTest, median of {args.repeat}):")
        print(f"  {'page':<26} {'new reader':>10} {'cold (s)':>9} {'warm (s)':>9} {'cold cpu':>9} {'warm cpu':>9} "
              f"{'sent (kB)':>9}")
        step = (args.steps - 1) // 2
        for row in time_pages(run_dir_logs, run, step, args.repeat, args.pages.split(",")):
            print(f"  {row['page']:<26} {row['new reader']:10.3f} {row['cold']:9.3f} {row['warm']:9.3f} "
                  f"{row['cold cpu']:9.3f} {row['warm cpu']:9.3f} {row['sent']:9.0f}")
    print(f"\npeak resident memory of this process (the dashboard server): {peak_rss_mb():.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
