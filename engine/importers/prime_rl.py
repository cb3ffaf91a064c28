"""prime-rl's trainer token exports (`enable_token_export`) as PolicyLens steps.

Format, read from PrimeIntellect-ai/prime-rl `src/prime_rl/trainer/rl/token_export.py` (`TokenExporter`):

- `<output_dir>/token_exports/step_<N>/rank_<R>.jsonl`, one JSON line per sample (since commit badd2b0f, May
  2026); a `STABLE` file marks a step folder every rank has finished (since 941019f2, June 2026). The first
  version (e971d905) wrote one `token_exports/rank_<R>.jsonl` for all steps, each line naming its `step`: read too.
- Each line: schema_version, step, rank, micro_step, micro_sequence_idx, export_sequence_idx, env_name and per-token
  lists over the WHOLE sequence (prompt + completion): token_ids, position_ids, loss_mask, advantages,
  inference_logprobs (the sampler's), trainer_logprobs, entropy, mismatch_kl, log_importance_ratio,
  importance_ratio, prob_delta, is_masked, is_masked_high, is_masked_low (the DPPO masks). Versions differ: up to
  941019f2 a per-token `rewards` list and `training_mode`; from 0be5ac45 (June 2026) to 289562d2 (August 2026)
  loss-component weights `rl_weights`, `ce_weights`, `ref_kl_weights`; in 004274ec a per-token `losses` record
  ({loss name: {advantage, mask}}), `rewards` again and `run_id` / `export_step`. Every key is optional here.
- No prompt id, no group id: groups are rebuilt from identical prompt tokens within a step (see token_dumps).

Columns: inference_logprobs -> tokens.sampler_logp, trainer_logprobs -> tokens.old_logp, entropy, advantages ->
tokens.advantage; the reward is the first non-null value of `rewards` where a version has it. Kept in
`tokens.dump` under their names: loss_mask, is_masked, is_masked_high, is_masked_low (DPPO masks), rl_weights,
ce_weights, ref_kl_weights (loss-component weights), losses. Not stored, because prime-rl computes them from the
two stored log-probs (`src/prime_rl/trainer/rl/loss.py` `compute_importance_ratio_and_mismatch_kl` and
token_export.py `_compute_export_tensors`, commit 289562d2), so a view derives them exactly:
log_importance_ratio = old_logp - sampler_logp, importance_ratio = exp(old_logp - sampler_logp),
mismatch_kl = importance_ratio - log_importance_ratio - 1, prob_delta = exp(old_logp) - exp(sampler_logp).
position_ids are not kept either (positions follow from the token order).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa

from engine.importers.base import SETTLE_SECONDS, ReadContext, Step, newest_change, numbered_files
from engine.importers.jsonl_dump import list_fields_problem, read_samples
from engine.importers.token_dumps import TokenVocabulary, step_tables
from engine.runlog import RunLogError

_STEP_DIR = re.compile(r"^step_(\d+)$")
_RANK_FILE = re.compile(r"^rank_(\d+)\.jsonl$")
_FLOAT_LISTS = ("advantages", "rewards", "inference_logprobs", "trainer_logprobs", "entropy", "rl_weights",
                "ce_weights", "ref_kl_weights")
"""The float lists read (mismatch_kl, importance_ratio and the others a view derives are neither read nor checked)."""
_BOOL_LISTS = ("loss_mask", "is_masked", "is_masked_high", "is_masked_low")
JSON_COLUMNS = {"step": "BIGINT", "rank": "BIGINT", "token_ids": "BIGINT[]",
                **{k: "DOUBLE[]" for k in _FLOAT_LISTS}, **{k: "BOOLEAN[]" for k in _BOOL_LISTS},
                "losses": "JSON[]", "env_name": "VARCHAR"}
EXPRESSIONS = {
    "rank": "rank", "token_ids": "token_ids", "loss_mask": "loss_mask", "sampler_logp": "inference_logprobs",
    "old_logp": "trainer_logprobs", "entropy": "entropy", "advantage": "advantages",
    "reward": "list_filter(rewards, lambda x: x IS NOT NULL)[1]",
    **{f"x_{k}": k for k in ("is_masked", "is_masked_high", "is_masked_low", "rl_weights", "ce_weights",
                             "ref_kl_weights", "losses")},
}
SOURCE = "PrimeIntellect-ai/prime-rl src/prime_rl/trainer/rl/token_export.py @ 289562d2 (and earlier, see module)"


def _line_problem(entry: dict) -> str | None:
    kinds = {**{k: "float" for k in _FLOAT_LISTS}, **{k: "bool" for k in _BOOL_LISTS}}
    problem = list_fields_problem(entry, kinds, "token_ids")
    if problem is None and entry.get("loss_mask") is None:
        return "no loss_mask"
    if problem is None and entry.get("losses") is not None and not isinstance(entry["losses"], list):
        return "losses is not a list"
    return problem


def exports_root(folder: Path) -> Path:
    """The token_exports folder: `folder` itself or its token_exports/ (a clear error when neither holds one)."""
    for root in (folder, folder / "token_exports"):
        if root.is_dir() and any(_STEP_DIR.match(n) or _RANK_FILE.match(n) for n in _names(root)):
            return root
    raise RunLogError(f"{folder} holds no prime-rl token export: expected token_exports/step_<N>/rank_<R>.jsonl "
                      "(a prime-rl output_dir trained with enable_token_export), or that token_exports folder")


def _names(folder: Path) -> list[str]:
    try:
        return [p.name for p in folder.iterdir()]
    except OSError:
        return []


def prime_rl_steps(folder: Path, ctx: ReadContext) -> Iterator[Step]:
    if ctx.settle:
        try:
            root = exports_root(folder)
        except RunLogError:
            return  # follow: wait for the trainer's first export
    else:
        root = exports_root(folder)
    vocabulary = TokenVocabulary(ctx.token_text)
    step_dirs = numbered_files(root, _STEP_DIR, settle=False)
    uses_stable = any((d / "STABLE").exists() for _, d in step_dirs)
    for step, step_dir in step_dirs:
        if ctx.after is not None and step <= ctx.after:
            continue
        if ctx.settle and not _complete(step_dir, uses_stable):
            break  # later steps wait for this one
        parts = [read_samples(path, f"{step_dir.name}/{path.name}", JSON_COLUMNS, EXPRESSIONS, _line_problem, ctx)
                 for _, path in numbered_files(step_dir, _RANK_FILE, settle=False)]
        parts = [p for p in parts if p is not None]
        if parts:
            yield step_tables(step, pa.concat_tables(parts), ctx, vocabulary,
                              {"source": SOURCE, "source_folder": step_dir.name})
    yield from _single_file_steps(root, ctx, vocabulary)


def _complete(step_dir: Path, uses_stable: bool) -> bool:
    import time

    if uses_stable:
        return (step_dir / "STABLE").exists()
    return time.time() - newest_change(step_dir) >= SETTLE_SECONDS


def _single_file_steps(root: Path, ctx: ReadContext, vocabulary: TokenVocabulary) -> Iterator[Step]:
    """The first format (e971d905): token_exports/rank_<R>.jsonl holding every step; split by the lines' step."""
    files = numbered_files(root, _RANK_FILE, ctx.settle)
    if not files:
        return
    expressions = {**EXPRESSIONS, "x_step": "step"}
    parts = [read_samples(path, path.name, JSON_COLUMNS, expressions, _line_problem, ctx) for _, path in files]
    table = pa.concat_tables([p for p in parts if p is not None]) if any(p is not None for p in parts) else None
    if table is None:
        return
    steps = sorted(s for s in set(table["x_step"].to_pylist()) if s is not None)
    for step in steps:
        if ctx.after is not None and step <= ctx.after:
            continue
        import pyarrow.compute as pc

        part = table.filter(pc.equal(table["x_step"], step)).drop_columns(["x_step"])
        yield step_tables(step, part, ctx, vocabulary, {"source": SOURCE, "source_folder": root.name})
