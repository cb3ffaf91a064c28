"""Import the rollouts other trainers dump into a PolicyLens run: `policylens import trl|verl DIR`.

    policylens import trl  runs/qwen-grpo --run-name qwen-grpo                 # TRL's completions Parquet files
    policylens import verl rollouts/      --run-name verl-gsm8k --tokenizer ~/models/qwen   # verl's JSONL dumps

What each tool writes, and how it becomes rollouts:

- TRL (GRPOConfig(log_completions=True)): `<output_dir>/completions/completions_<step:05d>.parquet` with columns
  step, prompt, completion, one float column per reward function, the columns reward functions added through
  `log_extra`, and advantage. TRL writes the rows of its last generation batch again at every logging step until
  the next generation: a file equal to the one before it is that generation again and is skipped. The PolicyLens
  step is the TRL step of a generation's first file. A group is a block of `G` consecutive rows with the same
  prompt, G the shortest such run in the file (TRL's num_generations). Reward columns are the float columns;
  `reward` is their sum (TRL's reward_weights are not in the file: weights 1). The logged advantage is TRL's.
- verl (trainer.rollout_data_dir): `<dir>/<step>.jsonl`, one JSON object per response with input, output, gts,
  score, step, every extra reward key of the reward function, and request_id / uid when the rollout has them.
  verl reorders responses (batch balancing), so a group is the responses of one step with the same uid (when
  present) or the same input, never a run of lines. Advantages are recomputed as GRPO outcome advantages
  (engine.advantages.group_advantages on score) and marked as recomputed (`steps.extra.advantage_source`).

`--tokenizer DIR` (a local tokenizer folder) fills `tokens` with each completion's token ids and texts and sets
`length` in tokens; no log-probs exist in these dumps, so pages that need them say so.

Importing is idempotent: a run made by importing the same folder is continued after its last step (a second
import of an unchanged folder adds nothing); any other existing run of that name is refused. A file or line that
cannot be read is reported (file and line) and skipped; the steps already imported stay. `--follow` keeps
importing new files of a run still being written (the newest file is only taken once it has stopped growing).
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.runlog import RunLogError, RunWriter, validate_run_name

__all__ = ["SOURCES", "ImportReport", "follow", "import_run", "import_trl", "import_verl", "run_name_from_folder"]

SETTLE_SECONDS = 2.0
"""In follow mode the newest file is imported only once it is this old (the trainer may still be writing it)."""

_TRL_FILE = re.compile(r"^completions_(\d+)\.parquet$")
_VERL_FILE = re.compile(r"^(\d+)\.jsonl$")
_VERL_FIELDS = {"input", "output", "gts", "score", "step", "uid", "request_id", "data_source"}


@dataclass
class ImportReport:
    """What one import pass did: steps written, steps already in the run, problems (file and line)."""

    run: str
    imported: list[int] = field(default_factory=list)
    already_there: int = 0
    problems: list[str] = field(default_factory=list)


@dataclass
class _Step:
    step: int
    rollouts: dict[str, list]
    extra: dict[str, Any]


def run_name_from_folder(folder: str | os.PathLike) -> str:
    """A valid run name from a folder's name (characters outside the run-name rule become '-')."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(str(folder)).resolve().name).strip(".-_") or "imported-run"
    return re.sub(r"\.{2,}", ".", name)[:100].rstrip(".")


# ---------------------------------------------------------------- reading TRL


def _files(folder: Path, pattern: re.Pattern, settle: bool) -> list[tuple[int, Path]]:
    """(step, path) of the matching files, by step; with `settle`, without a newest file still being written."""
    found = sorted((int(m[1]), folder / name) for name in os.listdir(folder) if (m := pattern.match(name)))
    if settle and found and time.time() - found[-1][1].stat().st_mtime < SETTLE_SECONDS:
        found = found[:-1]
    return found


def _trl_steps(output_dir: Path, report: ImportReport, settle: bool) -> Iterator[_Step]:
    import pyarrow.parquet as pq

    folder = output_dir / "completions"
    if not folder.is_dir():
        raise RunLogError(f"{output_dir} has no completions/ folder; accepted: a TRL output_dir of a run with "
                          "GRPOConfig(log_completions=True)")
    previous = None
    for step, path in _files(folder, _TRL_FILE, settle):
        try:
            table = pq.read_table(path).to_pydict()
        except Exception as err:  # pyarrow raises several types for a damaged file
            report.problems.append(f"{path}: not a readable Parquet file ({type(err).__name__}: {err}); skipped")
            continue
        missing = {"prompt", "completion", "advantage"} - set(table)
        if missing:
            report.problems.append(f"{path}: missing column(s) {sorted(missing)}; accepted: TRL's completions "
                                   "files (step, prompt, completion, reward columns, advantage); skipped")
            continue
        rows = {k: v for k, v in table.items() if k != "step"}
        if rows == previous:  # the same generation batch, written again at a later logging step
            continue
        previous = rows
        yield _trl_rollouts(step, table, path, report)


def _is_float_column(values: list) -> bool:
    return bool(values) and all(v is None or (isinstance(v, float)) for v in values)


def _trl_rollouts(step: int, table: dict[str, list], path: Path, report: ImportReport) -> _Step:
    n = len(table["prompt"])
    prompts = [as_text(p) for p in table["prompt"]]
    completions = [as_text(c) for c in table["completion"]]
    reward_names = [k for k, v in table.items() if k not in ("step", "prompt", "completion", "advantage")
                    and _is_float_column(v)]
    components = [{k: _finite(table[k][i]) for k in reward_names} for i in range(n)]
    totals = [math.fsum(v for v in c.values() if v is not None) if any(v is not None for v in c.values())
              else None for c in components]
    group_ids, index_in_group = _consecutive_groups(prompts)
    ignored = sorted(set(table) - {"step", "prompt", "completion", "advantage", *reward_names})
    rollouts = {
        "rollout_id": list(range(n)), "group_id": group_ids, "index_in_group": index_in_group,
        "kind": ["train"] * n, "prompt": prompts, "completion": completions, "reward": totals,
        "reward_components": [components_json(c) for c in components], "advantage": table["advantage"],
    }
    return _Step(step, rollouts, {"source_file": path.name, "reward_funcs": reward_names,
                                  "columns_not_imported": ignored, "advantage_source": "trl"})


def _consecutive_groups(prompts: list[str]) -> tuple[list[int], list[int]]:
    """Group ids and positions of rows in blocks of G consecutive equal prompts, G the shortest run of them."""
    runs: list[int] = []
    for i, p in enumerate(prompts):
        if i and p == prompts[i - 1]:
            runs[-1] += 1
        else:
            runs.append(1)
    size = min(runs) if runs else 1
    group_ids = [i // size for i in range(len(prompts))]
    return group_ids, [i % size for i in range(len(prompts))]


def _finite(value: Any) -> float | None:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


# ---------------------------------------------------------------- reading verl


def _verl_steps(rollout_dir: Path, report: ImportReport, settle: bool) -> Iterator[_Step]:
    if not rollout_dir.is_dir():
        raise RunLogError(f"{rollout_dir} is not a folder; accepted: verl's trainer.rollout_data_dir "
                          "(files <step>.jsonl)")
    for step, path in _files(rollout_dir, _VERL_FILE, settle):
        lines = []
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            report.problems.append(f"{path}: unreadable ({err}); skipped")
            continue
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except ValueError as err:
                report.problems.append(f"{path}:{number}: not a JSON object ({err}); line skipped")
                continue
            if not isinstance(entry, dict) or not isinstance(entry.get("output"), str) or "input" not in entry:
                report.problems.append(f"{path}:{number}: not a verl rollout line (needs input and output text); "
                                       "line skipped")
                continue
            lines.append(entry)
        if lines:
            yield _verl_rollouts(step, lines, path)


def _verl_rollouts(step: int, lines: list[dict], path: Path) -> _Step:
    import torch

    from engine.advantages import group_advantages

    keys = [str(e.get("uid")) if e.get("uid") is not None else as_text(e["input"]) for e in lines]
    group_of: dict[str, int] = {}
    group_ids, index_in_group, counts = [], [], {}
    scores = [_finite(e.get("score")) for e in lines]
    scored: dict[int, list[int]] = {}  # group -> its lines that have a score
    for i, k in enumerate(keys):
        g = group_of.setdefault(k, len(group_of))
        group_ids.append(g)
        index_in_group.append(counts.get(g, 0))
        counts[g] = counts.get(g, 0) + 1
        if scores[i] is not None:
            scored.setdefault(g, []).append(i)
    advantages: list[float | None] = [None] * len(lines)
    for members in scored.values():
        adv = group_advantages(torch.tensor([scores[i] for i in members], dtype=torch.float64), len(members))
        for i, a in zip(members, adv.tolist(), strict=True):
            advantages[i] = a
    extra_names = sorted({k for e in lines for k, v in e.items() if k not in _VERL_FIELDS
                          and isinstance(v, (int, float)) and not isinstance(v, bool)})
    rollouts = {
        "rollout_id": list(range(len(lines))), "group_id": group_ids, "index_in_group": index_in_group,
        "kind": ["train"] * len(lines), "prompt": [as_text(e["input"]) for e in lines],
        "completion": [e["output"] for e in lines],
        "answer": [None if e.get("gts") is None else as_text(e["gts"]) for e in lines], "reward": scores,
        "reward_components": [components_json({k: e.get(k) for k in extra_names}) for e in lines],
        "advantage": advantages,
    }
    return _Step(step, rollouts, {"source_file": path.name, "reward_keys": extra_names,
                                  "advantage_source": "recomputed: GRPO outcome advantage of score per group"})


def as_text(value: Any) -> str:
    """A prompt or completion as text: plain strings as they are, conversations (lists of messages) as JSON."""
    return value if isinstance(value, str) else json.dumps(value, default=str, ensure_ascii=False)


def components_json(components: dict[str, Any]) -> str:
    """`rollouts.reward_components`: reward function name -> value, a missing or non-finite value as null."""
    return json.dumps({name: _finite(value) for name, value in components.items()})


# ---------------------------------------------------------------- writing


SOURCES: dict[str, Callable[[Path, ImportReport, bool], Iterator[_Step]]] = {"trl": _trl_steps, "verl": _verl_steps}


def _open_run(logs_dir: Path, run: str, source: str, folder: Path) -> RunWriter:
    """A writer for the run: created, or resumed when it is an earlier import of the same folder."""
    origin = {"source": source, "path": str(folder.resolve())}
    run_json = logs_dir / run / "run.json"
    if run_json.exists():
        try:
            config = json.loads(run_json.read_text()).get("config") or {}
        except (OSError, ValueError) as err:
            raise RunLogError(f"{run_json} is unreadable ({err}); pick another --run-name") from None
        if config.get("import") != origin:
            raise RunLogError(f"run {run!r} already exists in {logs_dir} and is not an import of {folder} from "
                              f"{source}; pick another --run-name")
        return RunWriter.resume(logs_dir, run)
    return RunWriter.create(logs_dir, run, algorithm="grpo" if source == "verl" else "trl", task="",
                            config={"import": origin}, model=f"imported from {source}")


def _token_rows(tokenizer, completions: list[str], token_text) -> tuple[dict, list[int]]:
    ids_per_row = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in completions]
    rows: dict[str, list] = {"rollout_id": [], "position": [], "token_id": [], "token_text": []}
    for rid, ids in enumerate(ids_per_row):
        rows["rollout_id"] += [rid] * len(ids)
        rows["position"] += list(range(len(ids)))
        rows["token_id"] += ids
        rows["token_text"] += [token_text.token(t) for t in ids]
    return rows, [len(ids) for ids in ids_per_row]


def import_run(source: str, folder: str | os.PathLike, logs_dir: str | os.PathLike, run: str,
               tokenizer_dir: str | os.PathLike | None = None, settle: bool = False) -> ImportReport:
    """Import every step of `folder` (a TRL output_dir or a verl rollout_data_dir) not yet in run `run`."""
    if source not in SOURCES:
        raise RunLogError(f"unknown source {source!r}; accepted: {', '.join(SOURCES)}")
    folder, logs_dir = Path(folder), Path(logs_dir)
    validate_run_name(run, logs_dir)
    tokenizer = token_text = None
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer

        from engine.rollout import TokenText

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
        except (OSError, ValueError) as err:
            raise RunLogError(f"--tokenizer {tokenizer_dir}: no tokenizer there ({err}); accepted: a local "
                              "folder written by save_pretrained") from None
        token_text = TokenText(tokenizer)
    report = ImportReport(run)
    steps = list(SOURCES[source](folder, report, settle))  # read (and check) before touching the run
    writer = _open_run(logs_dir, run, source, folder)
    try:
        for item in steps:
            if writer.last_step is not None and item.step <= writer.last_step:
                report.already_there += 1
                continue
            tokens = None
            if tokenizer is not None:
                tokens, lengths = _token_rows(tokenizer, item.rollouts["completion"], token_text)
                item.rollouts["length"] = lengths
            writer.log_step(item.step, metrics=_metrics(item), rollouts=item.rollouts, tokens=tokens)
            report.imported.append(item.step)
    finally:
        writer.close("finished")
    return report


def _metrics(item: _Step) -> dict[str, Any]:
    rewards = [r for r in item.rollouts["reward"] if r is not None]
    mean = sum(rewards) / len(rewards) if rewards else None
    std = (math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1))
           if mean is not None and len(rewards) > 1 else None)
    lengths = item.rollouts.get("length")
    return {"reward_mean": mean, "reward_std": std, **item.extra,
            "response_len_mean": sum(lengths) / len(lengths) if lengths else None,
            "response_len_max": max(lengths) if lengths else None}


def import_trl(output_dir, logs_dir, run, tokenizer_dir=None) -> ImportReport:
    """`import_run("trl", ...)`: a TRL output_dir with completions/completions_<step>.parquet."""
    return import_run("trl", output_dir, logs_dir, run, tokenizer_dir)


def import_verl(rollout_dir, logs_dir, run, tokenizer_dir=None) -> ImportReport:
    """`import_run("verl", ...)`: a verl trainer.rollout_data_dir with <step>.jsonl files."""
    return import_run("verl", rollout_dir, logs_dir, run, tokenizer_dir)


def follow(source: str, folder, logs_dir, run, tokenizer_dir=None, interval: float = 5.0,
           on_report: Callable[[ImportReport], None] = print, stop: Callable[[], bool] = lambda: False) -> None:
    """Import again every `interval` seconds (new files of a run still being written) until `stop()` is true."""
    reported: set[str] = set()
    while True:
        report = import_run(source, folder, logs_dir, run, tokenizer_dir, settle=True)
        report.problems = [p for p in report.problems if p not in reported]  # each problem once
        reported.update(report.problems)
        on_report(report)
        deadline = time.monotonic() + interval
        while time.monotonic() < deadline:
            if stop():
                return
            time.sleep(min(0.2, interval))
