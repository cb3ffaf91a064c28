"""NeMo-RL's GRPO train-data dumps (`train_data_step<N>.jsonl`) as PolicyLens steps.

Format, read from NVIDIA-NeMo/RL at commit 7ea279ab (August 2026): `nemo_rl/algorithms/grpo.py` builds `log_data`
after each step and `nemo_rl/utils/logger.py` `Logger.log_batched_dict_as_jsonl` writes it to
`<log_dir>/train_data_step<N>.jsonl` (N = the step, from 1): one line per sample, each value the sample's slice of
a batch of one (`make_microbatch_iterator(1)`), so per-token values are nested one level, `[[...]]`, and scalars
are one-element lists. Keys: content ([[message texts]]), rewards ([r]; with dynamic sampling the unfiltered
total reward, and `filtered_rewards` beside it), input_lengths ([L]: the sequence's true length; token lists are
right-padded to the batch's longest), token_ids, token_loss_mask, advantages, generation_logprobs (the sampler's),
prev_logprobs (the trainer's), all over the whole sequence (prompt + every turn), sample_loss_mask ([m]: 0 leaves
the sample out of the loss), agent_ref (NeMo-Gym) and idx (the line's index). `token_ids` and `token_loss_mask`
are logged since commit f11f99c7 (February 2026); older files hold no token ids and are reported and skipped.
`val_data_step<N>.jsonl` files beside them are validation, not training data: never imported.

Columns: generation_logprobs -> tokens.sampler_logp, prev_logprobs -> tokens.old_logp, advantages ->
tokens.advantage, rewards -> rollouts.reward, sample_loss_mask 0 -> rollouts.filtered; token_loss_mask ->
tokens.dump.loss_mask. No group index: groups are rebuilt from identical prompt tokens (see token_dumps).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from engine.importers.base import ReadContext, Step, is_number, numbered_files
from engine.importers.jsonl_dump import list_fields_problem, read_samples
from engine.importers.token_dumps import TokenVocabulary, step_tables
from engine.runlog import RunLogError

_TRAIN_FILE = re.compile(r"^train_data_step(\d+)\.jsonl$")
_VAL_FILE = re.compile(r"^val_data_step(\d+)\.jsonl$")
JSON_COLUMNS = {
    "content": "JSON", "rewards": "DOUBLE[]", "input_lengths": "BIGINT[]", "token_ids": "BIGINT[][]",
    "token_loss_mask": "DOUBLE[][]", "sample_loss_mask": "DOUBLE[]", "advantages": "DOUBLE[][]",
    "generation_logprobs": "DOUBLE[][]", "prev_logprobs": "DOUBLE[][]",
}
_L = "coalesce(input_lengths[1], len(token_ids[1]))"
EXPRESSIONS = {
    "token_ids": f"token_ids[1][1:{_L}]",
    "loss_mask": f"list_transform(token_loss_mask[1][1:{_L}], lambda x: x > 0)",
    "sampler_logp": f"generation_logprobs[1][1:{_L}]", "old_logp": f"prev_logprobs[1][1:{_L}]",
    "advantage": f"advantages[1][1:{_L}]", "reward": "rewards[1]",
    "filtered": "sample_loss_mask[1] = 0",
    "filter_reason": "CASE WHEN sample_loss_mask[1] = 0 THEN 'sample_loss_mask 0 (left out of the loss)' END",
    "prompt_text": "json_extract_string(content, '$[0][0]')",
}
SOURCE = "NVIDIA-NeMo/RL nemo_rl/algorithms/grpo.py + nemo_rl/utils/logger.py @ 7ea279ab"


def _line_problem(entry: dict) -> str | None:
    if entry.get("token_ids") is None:
        return "no token_ids (NeMo-RL logs them since commit f11f99c7, February 2026)"
    kinds = {"token_loss_mask": "float", "advantages": "float", "generation_logprobs": "float",
             "prev_logprobs": "float"}
    problem = list_fields_problem(entry, kinds, "token_ids", depth=2)
    if problem is not None:
        return problem
    if entry.get("token_loss_mask") is None:
        return "no token_loss_mask"
    for key in ("rewards", "input_lengths", "sample_loss_mask"):
        value = entry.get(key)
        if value is not None and not (isinstance(value, list) and all(is_number(v) for v in value)):
            return f"{key} is not a list of numbers"
    return None


def nemo_rl_steps(folder: Path, ctx: ReadContext) -> Iterator[Step]:
    files = numbered_files(folder, _TRAIN_FILE, ctx.settle)
    if not files and not ctx.settle and not numbered_files(folder, _TRAIN_FILE, False):
        validation = " (only val_data_step<N>.jsonl files, which are validation, not training data)" \
            if numbered_files(folder, _VAL_FILE, False) else ""
        raise RunLogError(f"{folder} holds no train_data_step<N>.jsonl file{validation}; accepted: the log_dir "
                          "of a NeMo-RL GRPO run (logger.log_dir, e.g. logs/exp_001)")
    vocabulary = TokenVocabulary(ctx.token_text)
    for step, path in files:
        if ctx.after is not None and step <= ctx.after:
            continue
        samples = read_samples(path, path.name, JSON_COLUMNS, EXPRESSIONS, _line_problem, ctx)
        if samples is not None:
            yield step_tables(step, samples, ctx, vocabulary, {"source": SOURCE, "source_file": path.name})
