"""Writes prime-rl, NeMo-RL and slime per-token dumps of the same samples, in each writer's format at a named
commit, with real token ids of a tokenizer trained here (byte-level BPE, `tokenizers`, nothing downloaded).

Each fixture folder gets a SOURCE.md naming the writer's repository, file and commit. Every dump holds: two steps
of two prompts x three samples, a multi-turn sample (assistant turn, a tool output the loss mask leaves out,
another assistant turn), a damaged line or file, and the files that are not training data (prime-rl: STABLE
markers; NeMo-RL: val_data_step<N>.jsonl; slime: an evaluation dump). `expected()` gives what the import must
store, token by token, computed from the generated samples and the documented prompt/completion split.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

PROMPTS = ["<|user|>solve 2x+3=7<|assistant|>", "<|user|>solve 5x-1=9<|assistant|>"]
TOOL_PROMPT = "<|user|>use the calculator for 17*3<|assistant|>"
SPECIALS = ["<|user|>", "<|assistant|>", "<|tool|>", "<eos>"]


def train_tokenizer(folder: Path):
    """A byte-level BPE tokenizer trained on a few task lines, saved with save_pretrained to `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [p + f"{a}x={b} so x={c}" for p in PROMPTS for a in range(1, 9) for b in range(3) for c in range(5)]
    corpus += ["calc(17*3) = 51, the answer is 51", "the tool says 51 so the answer is 51"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", additional_special_tokens=SPECIALS[:3])
    fast.save_pretrained(folder)
    return fast


@dataclass
class Sample:
    """One generated sample: the whole sequence and per-token values over it (prompt positions included)."""

    step: int
    group: int
    token_ids: list[int]
    loss_mask: list[bool]
    sampler_logp: list[float]
    old_logp: list[float]
    entropy: list[float]
    advantage: list[float]
    ref_logp: list[float]
    value: list[float]
    returns: list[float]
    reward: float
    prompt_len: int
    extra: dict[str, list] = field(default_factory=dict)


def make_samples(tokenizer, seed: int = 0) -> list[Sample]:
    """Two steps: each 2 prompts x 3 completions; step 2 also holds the multi-turn tool sample (masked tool
    tokens inside its completion)."""
    rng = random.Random(seed)
    samples = []
    for step in (1, 2):
        for g, prompt in enumerate(PROMPTS):
            for k in range(3):
                completion = f"{k + 1}x={k} so x={rng.randint(0, 4)}<eos>"
                samples.append(_sample(tokenizer, rng, step, g, prompt, [(completion, True)], reward=float(k == 1)))
    turns = [("calc(17*3)", True), ("<|tool|>51", False), ("<|assistant|>the answer is 51<eos>", True)]
    samples.append(_sample(tokenizer, rng, 2, 2, TOOL_PROMPT, turns, reward=1.0))
    return samples


def _sample(tokenizer, rng, step, group, prompt, turns, reward) -> Sample:
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    mask = [False] * len(ids)
    for text, trained in turns:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [trained] * len(piece)
    n = len(ids)

    def floats(low, high):
        return [round(rng.uniform(low, high), 6) for _ in range(n)]

    adv = round(rng.uniform(-1, 1), 4)
    s = Sample(step, group, ids, mask, floats(-3, 0), floats(-3, 0), floats(0, 2), [adv] * n, floats(-3, 0),
               floats(-1, 1), floats(-1, 1), reward, mask.index(True))
    s.extra = {"is_masked": [rng.random() < 0.2 for _ in range(n)], "kl": floats(0, 0.1),
               "importance_ratio": [math.exp(o - i) for o, i in zip(s.old_logp, s.sampler_logp, strict=True)]}
    return s


def _source(folder: Path, text: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "SOURCE.md").write_text(text)


# ---------------------------------------------------------------- prime-rl


def write_prime_rl(folder: Path, samples: list[Sample]) -> Path:
    """`<output_dir>/token_exports/step_<N>/rank_<R>.jsonl` as TokenExporter writes it (samples alternate over
    two ranks); step 2's rank 1 file has a truncated line; STABLE markers; a checkpoint folder beside."""
    _source(folder, "Written in the format of PrimeIntellect-ai/prime-rl src/prime_rl/trainer/rl/token_export.py "
                    "at commit 289562d2 (TokenExporter, per-step folders, STABLE markers, loss-component "
                    "weights) by tests/token_dump_fixtures.py.\n")
    (folder / "checkpoints" / "step_1").mkdir(parents=True)
    (folder / "checkpoints" / "step_1" / "notes.jsonl").write_text('{"not": "training data"}\n')
    for step in (1, 2):
        step_dir = folder / "token_exports" / f"step_{step}"
        step_dir.mkdir(parents=True)
        lines: dict[int, list[str]] = {0: [], 1: []}
        for i, s in enumerate(x for x in samples if x.step == step):
            rank = i % 2
            record = {"schema_version": 1, "step": step, "rank": rank, "micro_step": 0, "micro_sequence_idx": i,
                      "export_sequence_idx": len(lines[rank]), "env_name": "math", "token_ids": s.token_ids,
                      "position_ids": list(range(len(s.token_ids))), "loss_mask": s.loss_mask,
                      "advantages": s.advantage, "inference_logprobs": s.sampler_logp,
                      "trainer_logprobs": s.old_logp, "entropy": s.entropy,
                      # as prime-rl's loss.py compute_importance_ratio_and_mismatch_kl computes them
                      "log_importance_ratio": [o - i for o, i in zip(s.old_logp, s.sampler_logp, strict=True)],
                      "importance_ratio": s.extra["importance_ratio"],
                      "mismatch_kl": [r - (o - i) - 1 for r, o, i in zip(s.extra["importance_ratio"], s.old_logp,
                                                                          s.sampler_logp, strict=True)],
                      "prob_delta": [math.exp(o) - math.exp(i) for o, i in zip(s.old_logp, s.sampler_logp,
                                                                                strict=True)],
                      "is_masked": s.extra["is_masked"], "is_masked_high": None,
                      "is_masked_low": None, "rl_weights": [1.0] * len(s.token_ids), "ce_weights": None,
                      "ref_kl_weights": None}
            lines[rank].append(json.dumps(record, separators=(",", ":")))
        if step == 2:
            lines[1].insert(1, lines[1][0][: len(lines[1][0]) // 2])  # a line cut short by a killed writer
        for rank, text in lines.items():
            (step_dir / f"rank_{rank}.jsonl").write_text("\n".join(text) + "\n")
        (step_dir / "STABLE").touch()
    return folder


# ---------------------------------------------------------------- NeMo-RL


def write_nemo_rl(folder: Path, samples: list[Sample]) -> Path:
    """`train_data_step<N>.jsonl` as Logger.log_batched_dict_as_jsonl writes grpo.py's log_data: values nested in
    a batch of one, token lists right-padded to the step's longest; step 1 has a line with a byte that is not
    UTF-8; val_data_step<N>.jsonl beside (validation)."""
    _source(folder, "Written in the format of NVIDIA-NeMo/RL nemo_rl/algorithms/grpo.py (log_data -> "
                    "train_data_step{N}.jsonl) and nemo_rl/utils/logger.py (log_batched_dict_as_jsonl) at commit "
                    "7ea279ab by tests/token_dump_fixtures.py.\n")
    for step in (1, 2):
        rows = [s for s in samples if s.step == step]
        width = max(len(s.token_ids) for s in rows)
        lines = []
        for i, s in enumerate(rows):
            pad = width - len(s.token_ids)
            record = {"content": [["prompt text", "completion text"]], "rewards": [s.reward],
                      "input_lengths": [len(s.token_ids)], "token_ids": [s.token_ids + [0] * pad],
                      "token_loss_mask": [[int(m) for m in s.loss_mask] + [0] * pad], "sample_loss_mask": [1.0],
                      "advantages": [s.advantage + [0.0] * pad], "generation_logprobs": [s.sampler_logp + [0.0] * pad],
                      "prev_logprobs": [s.old_logp + [0.0] * pad], "idx": i}
            lines.append(json.dumps(record).encode())
        if step == 1:
            lines.insert(2, b'{"content": [["caf\xe9"]], "rewards": [1.0]}')  # latin-1 byte: not UTF-8
        (folder / f"train_data_step{step}.jsonl").write_bytes(b"\n".join(lines) + b"\n")
        (folder / f"val_data_step{step}.jsonl").write_text(json.dumps({"content": [["held out"]], "rewards": [0.0],
                                                                       "idx": 0}) + "\n")
    return folder


# ---------------------------------------------------------------- slime


def write_slime(folder: Path, samples: list[Sample]) -> Path:
    """Rollout dumps (Sample.to_dict()) for both steps; step 1's train dump in the per-rank format (two ranks),
    step 2's in format_version 2; an evaluation dump; a file that is not a torch dump."""
    import torch

    _source(folder, "Written in the formats of THUDM/slime slime/observability/rollout_data_utils.py "
                    "(save_debug_rollout_data, commit 4c4adbbf), slime/utils/types.py (Sample.to_dict, commit "
                    "0d234f3e), the per-rank save_debug_train_data before mid-2026 and "
                    "slime/observability/train_data_utils.py (format_version 2, commit d92cb5de) by "
                    "tests/token_dump_fixtures.py.\n")
    for step in (1, 2):
        rows = [s for s in samples if s.step == step]
        dicts = [_rollout_sample(s, i) for i, s in enumerate(rows)]
        torch.save({"rollout_id": step, "samples": dicts}, folder / f"rollout_{step}.pt")
        train = [_train_sample(s, i) for i, s in enumerate(rows)]
        raw = [s.reward for s in rows]
        if step == 1:
            for rank in (0, 1):
                mine = [t for i, t in enumerate(train) if i % 2 == rank]
                columns = {k: [t[k] for t in mine] for k in mine[0]}
                columns["sample_indices"] = columns.pop("sample_index")
                columns["raw_reward"] = raw
                torch.save({"rollout_id": step, "rank": rank, "rollout_data": columns},
                           folder / f"train_{step}_{rank}.pt")
        else:
            for i, t in enumerate(train):
                t["rollout_position"], t["data_parallel_rank"] = i, i % 2
            torch.save({"format_version": 2, "rollout_id": step, "rank": 0, "samples": train, "dp_shards": [],
                        "raw_reward": raw}, folder / f"train_{step}_0.pt")
    torch.save({"rollout_id": 1, "samples": [_rollout_sample(samples[0], 0)]}, folder / "rollout_eval_1.pt")
    (folder / "train_3_0.pt").write_bytes(b"PK\x03\x04 not a whole torch file")
    return folder


def _rollout_sample(s: Sample, index: int) -> dict:
    r = len(s.token_ids) - s.prompt_len
    return {"group_index": s.group, "index": index, "prompt": "prompt text", "tokens": s.token_ids,
            "response": "response text", "response_length": r, "label": "2", "reward": s.reward,
            "loss_mask": [int(m) for m in s.loss_mask[s.prompt_len:]], "weight_versions": [],
            "rollout_log_probs": s.sampler_logp[s.prompt_len:], "status": "completed", "metadata": {},
            "remove_sample": False}


def _train_sample(s: Sample, index: int) -> dict:
    import torch

    p = s.prompt_len
    return {"sample_index": index, "tokens": torch.tensor(s.token_ids), "response_lengths": len(s.token_ids) - p,
            "total_lengths": len(s.token_ids), "loss_masks": torch.tensor([int(m) for m in s.loss_mask[p:]]),
            "rewards": s.reward - 0.5, "truncated": 0,
            "rollout_log_probs": torch.tensor(s.sampler_logp[p:], dtype=torch.float64),
            "log_probs": torch.tensor(s.old_logp[p:], dtype=torch.float64),
            "ref_log_probs": torch.tensor(s.ref_logp[p:], dtype=torch.float64),
            "entropy": torch.tensor(s.entropy[p:], dtype=torch.float64),
            "advantages": torch.tensor(s.advantage[p:], dtype=torch.float64),
            "values": torch.tensor(s.value[p:], dtype=torch.float64),
            "returns": torch.tensor(s.returns[p:], dtype=torch.float64),
            "kl": torch.tensor(s.extra["kl"][p:], dtype=torch.float64)}


# ---------------------------------------------------------------- what the import must store


def expected(samples: list[Sample], step: int, order: list[int] | None = None) -> list[dict]:
    """One dict per completion token of the step's samples (rollout ids in `order`, default dump order)."""
    rows = [s for s in samples if s.step == step]
    order = order or list(range(len(rows)))
    out = []
    for rid, i in enumerate(order):
        s = rows[i]
        for pos in range(s.prompt_len, len(s.token_ids)):
            out.append({"rollout_id": rid, "position": pos - s.prompt_len, "token_id": s.token_ids[pos],
                        "loss_mask": s.loss_mask[pos], "sampler_logp": s.sampler_logp[pos],
                        "old_logp": s.old_logp[pos], "entropy": s.entropy[pos], "advantage": s.advantage[pos],
                        "ref_logp": s.ref_logp[pos], "value": s.value[pos], "return": s.returns[pos],
                        "is_masked": s.extra["is_masked"][pos], "importance_ratio": s.extra["importance_ratio"][pos],
                        "kl": s.extra["kl"][pos]})
    return out
