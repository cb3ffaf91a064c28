"""TRL's completions Parquet files (GRPOConfig(log_completions=True)) as PolicyLens steps.

`<output_dir>/completions/completions_<step:05d>.parquet` with columns step, prompt, completion, one float column
per reward function, the columns reward functions added through `log_extra`, and advantage. TRL writes the rows
of its last generation batch again at every logging step until the next generation: a file equal to the one
before it is that generation again and is skipped. The PolicyLens step is the TRL step of a generation's first
file. A group is a block of `G` consecutive rows with the same prompt, G the shortest such run in the file (TRL's
num_generations). Reward columns are the float columns; `reward` is their sum (TRL's reward_weights are not in the
file: weights 1). The logged advantage is TRL's. A row whose prompt or completion is not text (or a conversation)
or whose advantage is not a number is reported by row and left out; the file's other rows are imported.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path

from engine.importers.base import ReadContext, Step, as_text, components_json, finite, numbered_files
from engine.runlog import RunLogError

_TRL_FILE = re.compile(r"^completions_(\d+)\.parquet$")


def trl_steps(output_dir: Path, ctx: ReadContext) -> Iterator[Step]:
    import pyarrow.parquet as pq

    folder = output_dir / "completions"
    if not folder.is_dir():
        raise RunLogError(f"{output_dir} has no completions/ folder; accepted: a TRL output_dir of a run with "
                          "GRPOConfig(log_completions=True) (completions/completions_<step>.parquet)")
    found = numbered_files(folder, _TRL_FILE, ctx.settle)
    if not found and not ctx.settle:
        raise RunLogError(f"{folder} holds no completions_<step>.parquet file; accepted: a TRL output_dir of a "
                          "run with GRPOConfig(log_completions=True)")
    previous = None
    for step, path in found:
        try:
            table = pq.read_table(path).to_pydict()
        except Exception as err:  # pyarrow raises several types for a damaged file
            ctx.report.problems.append(f"{path}: not a readable Parquet file ({type(err).__name__}: {err}); skipped")
            continue
        missing = {"prompt", "completion", "advantage"} - set(table)
        if missing:
            ctx.report.problems.append(f"{path}: missing column(s) {sorted(missing)}; accepted: TRL's completions "
                                       "files (step, prompt, completion, reward columns, advantage); skipped")
            continue
        rows = {k: v for k, v in table.items() if k != "step"}
        if rows == previous:  # the same generation batch, written again at a later logging step
            continue
        previous = rows
        table = _good_rows(table, path, ctx)
        if table["prompt"]:
            yield _trl_rollouts(step, table, path)


def _good_rows(table: dict[str, list], path: Path, ctx: ReadContext) -> dict[str, list]:
    """The rows whose prompt and completion are text or conversations and whose advantage is a number or null;
    each other row is reported (file and row) and left out."""
    bad = set()
    for i, (p, c, a) in enumerate(zip(table["prompt"], table["completion"], table["advantage"], strict=True)):
        if p is None or c is None or (a is not None and finite(a) is None and not _is_nan(a)):
            ctx.report.problems.append(f"{path}: row {i + 1}: prompt/completion missing or advantage not a number; "
                                       "row skipped")
            bad.add(i)
    if not bad:
        return table
    return {k: [v for i, v in enumerate(values) if i not in bad] for k, values in table.items()}


def _is_nan(value) -> bool:
    return isinstance(value, float) and math.isnan(value)


def _is_float_column(values: list) -> bool:
    return bool(values) and all(v is None or (isinstance(v, float)) for v in values)


def _trl_rollouts(step: int, table: dict[str, list], path: Path) -> Step:
    n = len(table["prompt"])
    prompts = [as_text(p) for p in table["prompt"]]
    completions = [as_text(c) for c in table["completion"]]
    reward_names = [k for k, v in table.items() if k not in ("step", "prompt", "completion", "advantage")
                    and _is_float_column(v)]
    components = [{k: finite(table[k][i]) for k in reward_names} for i in range(n)]
    totals = [math.fsum(v for v in c.values() if v is not None) if any(v is not None for v in c.values())
              else None for c in components]
    group_ids, index_in_group = _consecutive_groups(prompts)
    ignored = sorted(set(table) - {"step", "prompt", "completion", "advantage", *reward_names})
    rollouts = {
        "rollout_id": list(range(n)), "group_id": group_ids, "index_in_group": index_in_group,
        "kind": ["train"] * n, "prompt": prompts, "completion": completions, "reward": totals,
        "reward_components": [components_json(c) for c in components],
        "advantage": [finite(a) for a in table["advantage"]],
    }
    return Step(step, rollouts, {"source_file": path.name, "reward_funcs": reward_names,
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
