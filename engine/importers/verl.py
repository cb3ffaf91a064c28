"""verl's rollout dumps (trainer.rollout_data_dir) as PolicyLens steps.

`<dir>/<step>.jsonl`, one JSON object per response with input, output, gts, score, step, every extra reward key of
the reward function, and request_id / uid when the rollout has them (verl, `RayPPOTrainer._dump_generations`).
verl reorders responses (batch balancing), so a group is the responses of one step with the same uid (when
present) or the same input, never a run of lines. Advantages are recomputed as GRPO outcome advantages
(engine.advantages.group_advantages on score) and marked as recomputed (`steps.extra.advantage_source`).
Each line is decoded and parsed on its own: a line that is not UTF-8, not JSON, without input/output text or
with a score that is not a number is reported as `file:line` and skipped; the file's other lines are imported.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from engine.importers.base import (
    ReadContext,
    Step,
    as_text,
    components_json,
    finite,
    is_number,
    jsonl_lines,
    numbered_files,
)
from engine.runlog import RunLogError

_VERL_FILE = re.compile(r"^(\d+)\.jsonl$")
_VERL_FIELDS = {"input", "output", "gts", "score", "step", "uid", "request_id", "data_source"}


def verl_steps(rollout_dir: Path, ctx: ReadContext) -> Iterator[Step]:
    if not rollout_dir.is_dir():
        raise RunLogError(f"{rollout_dir} is not a folder; accepted: verl's trainer.rollout_data_dir "
                          "(files <step>.jsonl)")
    found = numbered_files(rollout_dir, _VERL_FILE, ctx.settle)
    if not found and not ctx.settle:
        raise RunLogError(f"{rollout_dir} holds no <step>.jsonl file; accepted: verl's trainer.rollout_data_dir")
    for step, path in found:
        lines = []
        for number, entry in jsonl_lines(path, ctx.report):
            if not isinstance(entry.get("output"), str) or "input" not in entry:
                ctx.report.problems.append(f"{path}:{number}: not a verl rollout line (needs input and output "
                                           "text); line skipped")
            elif entry.get("score") is not None and not is_number(entry["score"]):
                ctx.report.problems.append(f"{path}:{number}: score {entry['score']!r} is not a number; line skipped")
            else:
                lines.append(entry)
        if lines:
            yield _verl_rollouts(step, lines, path)


def _verl_rollouts(step: int, lines: list[dict], path: Path) -> Step:
    import torch

    from engine.advantages import group_advantages

    keys = [str(e.get("uid")) if e.get("uid") is not None else as_text(e["input"]) for e in lines]
    group_of: dict[str, int] = {}
    group_ids, index_in_group, counts = [], [], {}
    scores = [finite(e.get("score")) for e in lines]
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
    extra_names = sorted({k for e in lines for k, v in e.items() if k not in _VERL_FIELDS and is_number(v)})
    rollouts = {
        "rollout_id": list(range(len(lines))), "group_id": group_ids, "index_in_group": index_in_group,
        "kind": ["train"] * len(lines), "prompt": [as_text(e["input"]) for e in lines],
        "completion": [e["output"] for e in lines],
        "answer": [None if e.get("gts") is None else as_text(e["gts"]) for e in lines], "reward": scores,
        "reward_components": [components_json({k: e.get(k) for k in extra_names}) for e in lines],
        "advantage": advantages,
    }
    return Step(step, rollouts, {"source_file": path.name, "reward_keys": extra_names,
                                 "advantage_source": "recomputed: GRPO outcome advantage of score per group"})
