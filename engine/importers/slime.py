"""slime's debug dumps (`--save-debug-rollout-data`, `--save-debug-train-data`) as PolicyLens steps.

Formats, read from THUDM/slime:

- Rollout dump (`slime/observability/rollout_data_utils.py` `save_debug_rollout_data`, commit 4c4adbbf):
  `torch.save({"rollout_id": N, "samples": [Sample.to_dict(), ...]})` at the path template with `{rollout_id}`;
  evaluation dumps use the rollout id `eval_<N>` in the path: they are not training data and are never imported.
  A sample (`slime/utils/types.py` `Sample`, commit 0d234f3e): group_index, index, prompt (text or messages),
  tokens (prompt + response ids), response (text), response_length, label, reward (a number, or a dict of them),
  loss_mask and rollout_log_probs (over the response), status ("truncated", ...), remove_sample, metadata.
- Train dump, two formats. Before mid-2026 (`slime/backends/megatron_utils/data.py` and its successors,
  `save_debug_train_data`): one file per rank, `{"rollout_id", "rank", "rollout_data": {field: [one value per
  sample of that rank]}}` with tokens, response_lengths, total_lengths, loss_masks, rewards (normalised),
  raw_reward, truncated, sample_indices, rollout_log_probs, log_probs, ref_log_probs, advantages, returns, values,
  kl, entropy (per-token fields over the response). After (`slime/observability/train_data_utils.py`
  `_build_dump_payload`, commit d92cb5de): one file, `{"format_version": 2, "rollout_id", "rank", "samples":
  [{data_parallel_rank, rollout_position, sample_index, field: value, ...}], "dp_shards", "raw_reward"}`.
  A train sample is joined to its rollout sample by `rollout_position` (its index in the rollout dump), else by
  `sample_index` = the rollout sample's `index`; a sample several ranks wrote is taken once.

The path templates are the user's, so every `*.pt` file of the folder (and of its sub-folders, one level) is
told apart by its first keys (`restricted_pickle.leading_items`, read without loading it), then loaded once. A
dump is untrusted input: it loads to what `torch.load(weights_only=True)` would return (no pickle code runs;
`restricted_pickle.load_dump`, Python's C unpickler for plain data); a file that cannot be loaded that way, or of
unknown shape, is reported and skipped, and a sample whose per-token lists do not match its response length is
reported (file, sample) and skipped.

Columns: rollout_log_probs -> tokens.sampler_logp, log_probs -> old_logp, ref_log_probs -> ref_logp, entropy,
advantages, values -> value, returns -> return; `kl` (slime's per-token KL estimate) and `teacher_log_probs` go
to tokens.dump (`dump.kl`, `dump.teacher_logp`). Reward: the rollout sample's raw reward (else `raw_reward`);
slime's normalised `rewards` stay in rollouts.reward_components as "normalised_reward". Groups: the rollout
sample's group_index.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from engine.importers.base import SETTLE_SECONDS, ReadContext, Step, as_text, finite, is_number
from engine.importers.restricted_pickle import leading_items, load_dump
from engine.importers.token_dumps import TokenVocabulary, json_or_none, samples_from_rows, step_tables
from engine.runlog import RunLogError

SOURCE = ("THUDM/slime slime/observability/rollout_data_utils.py @ 4c4adbbf, train_data_utils.py @ d92cb5de "
          "(format_version 2) and the per-rank train dump before it")
_PER_TOKEN = {"rollout_log_probs": "sampler_logp", "log_probs": "old_logp", "ref_log_probs": "ref_logp",
              "entropy": "entropy", "advantages": "advantage", "values": "value", "returns": "return",
              "kl": "x_kl", "teacher_log_probs": "x_teacher_logp"}


def _load(path: Path, ctx: ReadContext) -> dict | None:
    try:
        data = load_dump(path)
    except Exception as err:  # untrusted bytes (UnpicklingError for code, RuntimeError for a bad zip...): skipped
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        ctx.report.problems.append(f"{path.name}: not a dump torch.load(weights_only=True) can read ({first}); "
                                   "skipped")
        return None
    if not isinstance(data, dict) or "rollout_id" not in data:
        ctx.report.problems.append(f"{path.name}: not a slime debug dump (no rollout_id); skipped")
        return None
    return data


def _kind(path: Path, data: dict) -> str | None:
    """Which dump `data` is: a loaded dump, or its `leading_items` (containers given as `list` / `dict`)."""
    def holds(key: str, container: type) -> bool:
        return data.get(key) is container or isinstance(data.get(key), container)

    if holds("rollout_data", dict):
        return "train-v1"
    if data.get("format_version") == 2 and holds("samples", list):
        return "train-v2"
    if holds("samples", list):
        return "eval" if "eval_" in path.name else "rollout"
    return None


def _dump_files(folder: Path, settle: bool) -> list[Path]:
    paths = sorted([*folder.glob("*.pt"), *folder.glob("*/*.pt")])
    if settle:
        paths = [p for p in paths if time.time() - p.stat().st_mtime >= SETTLE_SECONDS]
    return paths


def slime_steps(folder: Path, ctx: ReadContext) -> Iterator[Step]:
    paths = _dump_files(folder, ctx.settle)
    if not paths and not ctx.settle:
        raise RunLogError(f"{folder} holds no *.pt file; accepted: the folder of slime's --save-debug-rollout-data "
                          "and/or --save-debug-train-data dumps (torch.save files)")
    by_step: dict[int, list[Path]] = {}
    for path in paths:  # first look: which dump and which rollout each file is, from its first keys if it can
        data = leading_items(path)
        if data is None or "rollout_id" not in data:
            data = _load(path, ctx)
        if data is None:
            continue
        kind = _kind(path, data)
        if kind is None:
            ctx.report.problems.append(f"{path.name}: a dump of unknown shape (keys {sorted(data)[:8]}); skipped")
        elif kind != "eval" and isinstance(data.get("rollout_id"), int):
            by_step.setdefault(data["rollout_id"], []).append(path)
    vocabulary = TokenVocabulary(ctx.token_text)
    for step in sorted(by_step):
        if ctx.after is not None and step <= ctx.after:
            continue
        rows = _step_rows(step, by_step[step], ctx)
        if rows:
            names = sorted(p.name for p in by_step[step])
            yield step_tables(step, samples_from_rows(rows), ctx, vocabulary,
                              {"source": SOURCE, "source_files": names})


def _step_rows(step: int, files: list[Path], ctx: ReadContext) -> list[dict]:
    rollout, train, raw_reward, shown = [], {}, None, {}
    for path in files:
        data = _load(path, ctx)
        if data is None:  # reported
            continue
        kind = _kind(path, data)
        if kind in (None, "eval") or data["rollout_id"] != step:  # not what its first keys announced
            ctx.report.problems.append(f"{path.name}: not the dump its first keys announced; skipped")
            continue
        if kind == "rollout":
            rollout = [s for s in data["samples"] if isinstance(s, dict)]
            shown["rollout"] = path.name
            continue
        samples = _train_samples(data, kind)
        raw_reward = raw_reward if raw_reward is not None else data.get("raw_reward",
                                                                       data.get("rollout_data", {}).get("raw_reward"))
        for s in samples:
            key = s.get("rollout_position", s.get("sample_index"))
            train.setdefault(("position", key) if "rollout_position" in s else ("index", key), (s, path.name))
    rows = []
    if rollout:
        for position, sample in enumerate(rollout):
            match = train.pop(("position", position), None) or train.pop(("index", sample.get("index")), None)
            rows.append(_row(sample, match, position, raw_reward, shown.get("rollout"), ctx))
    for s, name in train.values():  # train samples without a rollout dump (or not found in it)
        rows.append(_row({}, (s, name), s.get("rollout_position"), raw_reward, None, ctx))
    return [r for r in rows if r is not None]


def _train_samples(data: dict, kind: str) -> list[dict]:
    if kind == "train-v2":
        return [s for s in data.get("samples", []) if isinstance(s, dict)]
    columns = data["rollout_data"]
    n = len(columns.get("response_lengths", []))
    samples = []
    for i in range(n):
        s = {k: v[i] for k, v in columns.items() if isinstance(v, (list, tuple)) and len(v) == n}
        if "sample_indices" in s:
            s["sample_index"] = s.pop("sample_indices")
        samples.append(s)
    return samples


def _array(value: Any, dtype: type) -> np.ndarray | None:
    """A per-token list or tensor as a numpy array of `dtype`; for floats, what is not a finite number -> NaN."""
    if value is None:
        return None
    if hasattr(value, "numpy"):  # a tensor (bfloat16 has no numpy type: widened first)
        value = value.detach().cpu().double().numpy() if dtype is np.float64 else value.detach().cpu().numpy()
    if not isinstance(value, (list, tuple, np.ndarray)):
        return None
    try:
        array = np.asarray(value, dtype=dtype)
    except (TypeError, ValueError):  # None, text... among numbers: each value on its own
        if dtype is not np.float64:
            raise
        array = np.array([np.nan if (number := finite(v)) is None else number for v in value], dtype=np.float64)
    if array.ndim != 1:
        raise ValueError(f"{array.ndim}-dimensional")
    if dtype is np.float64:
        array[~np.isfinite(array)] = np.nan
    return array


def _row(sample: dict, match, position, raw_reward, rollout_name, ctx: ReadContext) -> dict | None:
    """One samples-table row from a rollout sample and its train sample (either may be missing)."""
    train, train_name = match if match is not None else ({}, None)
    where = f"{train_name or rollout_name}: sample {position}"
    try:
        tokens = _array(train.get("tokens"), np.int64)
        tokens = tokens if tokens is not None and len(tokens) else _array(sample.get("tokens"), np.int64)
        mask = _array(train.get("loss_masks"), np.int64)
        mask = mask if mask is not None and len(mask) else _array(sample.get("loss_mask"), np.int64)
        values = {key: _array(train[key] if train.get(key) is not None else sample.get(key), np.float64)
                  for key in _PER_TOKEN}
    except (TypeError, ValueError, OverflowError) as err:
        ctx.report.problems.append(f"{where}: a per-token list that is not one list of numbers ({err}); "
                                   "sample skipped")
        return None
    length = train.get("response_lengths", sample.get("response_length"))
    length = length.item() if hasattr(length, "item") and getattr(length, "ndim", 0) == 0 else length
    if tokens is None or not len(tokens) or not is_number(length) or not 0 < int(length) <= len(tokens):
        ctx.report.problems.append(f"{where}: no tokens or response length; sample skipped")
        return None
    length = int(length)
    pad = len(tokens) - length
    mask = np.ones(length, dtype=np.int64) if mask is None or not len(mask) else mask
    row: dict[str, Any] = {"token_ids": tokens, "loss_mask": np.concatenate([np.zeros(pad, bool), mask != 0])}
    for key, column in _PER_TOKEN.items():
        if values[key] is None:
            continue
        if len(values[key]) != length:
            ctx.report.problems.append(f"{where}: {key} has {len(values[key])} values for {length} response "
                                       "tokens; sample skipped")
            return None
        row[column] = np.concatenate([np.full(pad, np.nan), values[key]])
    if len(mask) != length:
        ctx.report.problems.append(f"{where}: loss mask has {len(mask)} values for {length} response tokens; "
                                   "sample skipped")
        return None
    reward, components = sample.get("reward"), {}
    if isinstance(reward, dict):
        components = {k: v for k, v in reward.items() if is_number(v)}
        reward = None
    if reward is None and raw_reward is not None and isinstance(position, int) and position < len(raw_reward):
        reward = raw_reward[position]
    if train.get("rewards") is not None:
        normalised = train["rewards"]
        components["normalised_reward"] = finite(normalised.item() if hasattr(normalised, "item") else normalised)
    status = str(sample.get("status", ""))
    row.update(group_index=sample.get("group_index"), reward=finite(reward),
               reward_components=json_or_none(components) if components else None,
               prompt_text=as_text(sample["prompt"]) if sample.get("prompt") is not None else None,
               completion_text=sample.get("response") if isinstance(sample.get("response"), str) else None,
               truncated=status == "truncated" or bool(train.get("truncated", 0)),
               filtered=bool(sample.get("remove_sample", False)),
               filter_reason="remove_sample" if sample.get("remove_sample") else None)
    return row
