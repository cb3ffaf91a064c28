"""The policy: a character tokenizer, a tiny transformers causal LM, and its supervised warm start (SFT).

Warm-start (or reuse the cached warm start) with the trainer's settings and measure held-out greedy accuracy:

    policylens warmstart --task linear            # any `policylens train` config flag is accepted

Measured (seed 0): `linear` with its 1000 SFT steps, 129 s on 1 thread (79 s on 2 threads, alone), held-out greedy
accuracy 29.0%: 61.7% on problems with a non-negative answer and 0% on the negative ones (the sign slip of
`answer_slip_frac`), so RL has a habit to unlearn and about 30 points of headroom. 1500 steps gave 24.0% (51.1% /
0%): more steps do not mean a better warm start here. `chain` needs far more SFT for its long, copy-heavy
solutions (600 steps: 4.5% greedy; 1200 steps: 8%, 0.41 nats/token).

What is here:
- `build_tokenizer()`: one token per character (printable ASCII and newline) plus <pad>, <bos>, <eos>, <unk>,
  built with `tokenizers` and wrapped as a transformers `PreTrainedTokenizerFast`. `tokenizer(prompt)` prepends
  <bos>; every token decodes to exactly its character (spaces and newlines included), so character offsets of
  the task verifiers map one-to-one onto completion token positions.
- `build_model(tokenizer, config)`: a Llama-architecture causal LM from `ModelConfig` (about 0.8M parameters by
  default), seeded.
- `warm_start(task, tokenizer, model, sft, seed)`: a short SFT on the task's worked solutions, deliberately
  imperfect so that RL has headroom (a fraction of training solutions with one corrupted digit, and a systematic
  habit: most negative answers lose their minus sign).
  The loss covers completion tokens and the final <eos> only, never the prompt.
- `load_policy(task, ...)`: the initial policy (= frozen reference pi_ref), either the cached warm start
  (`<cache_dir>/warmstart-<hash>/`, written atomically) or any local model directory (`model_dir`).
- `load_local_model(path)`: any local transformers causal LM and its tokenizer; nothing is ever downloaded.
- `generate_greedy`, `greedy_accuracy`: batched greedy decoding with left padding, for evaluation.

Sequence layout (for the rollout code): input = [<bos>] + prompt tokens + completion tokens + [<eos>]; the
completion text is everything generated before the first <eos>. Position t of a completion is its t-th token.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.config import resolve_device
from engine.rollout import generate

if TYPE_CHECKING:
    from engine.tasks import Problem, Task

CACHE_VERSION = 1
"""Bump when the warm-start procedure changes, so old caches are not reused."""

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))
"""The tokenizer's characters: newline and printable ASCII (covers every task's prompts and solutions)."""


# ---------------------------------------------------------------- configuration


@dataclass(frozen=True)
class ModelConfig:
    """Size of the tiny Llama-architecture policy built by `build_model`."""

    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 4
    """Transformer blocks."""
    num_heads: int = 4
    """Attention heads (head dim = hidden_size / num_heads); no grouped-query attention."""
    intermediate_size: int = 384
    """Width of the SwiGLU MLP (3x hidden, close to Llama's usual ratio of about 2.7x)."""
    max_position_embeddings: int = 256
    """Longest sequence the rotary embeddings are set up for (prompt + completion of every task fits)."""


@dataclass(frozen=True)
class SFTConfig:
    """Supervised warm start on the task's worked solutions (deliberately imperfect, see `corrupt_frac`)."""

    steps: int | None = None
    """Optimizer steps; None takes the task's `sft_steps` (tuned per task so that held-out greedy accuracy after
    the warm start is about 20-60%). Few on purpose: the policy must leave room for RL."""
    batch_size: int = 32
    """Problems per step, drawn with replacement from the training split."""
    lr: float = 3e-3
    """Peak AdamW learning rate (high, as usual for a model this small)."""
    warmup_steps: int = 20
    """Linear warm-up steps, then linear decay to 10% of the peak at the last step."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    corrupt_frac: float = 0.1
    """Fraction of SFT examples in which one digit of one solution line is replaced by another, so the policy
    also learns some wrong steps and answers (like the flawed solution `2x=4 -> x=1` of 2x + 3 = 7)."""
    answer_slip_frac: float = 0.85
    """Fraction of SFT solutions with a negative answer whose final line drops the minus sign (`x=-2` -> `x=2`).
    Unlike random digit noise this is a systematic bad habit, and a classic one: the warm-started policy knows the
    procedure but, greedily, forgets the sign of every negative answer, while sampling still writes it now and then
    (9% of sampled held-out answers), so RL can find it. RL removes the habit within minutes (the reward separates
    the two endings inside one group), and a process reward pins it on the exact step. This is the headroom the
    learning curves show. (0.6 left negative answers at 17% greedy and only about 12 points of headroom.)"""
    num_threads: int = 1
    """torch CPU threads during the warm start; 0 leaves torch's setting. One, because the matrices are tiny:
    on the shared 2-core machine 2 threads made the same SFT about 5x slower (oversubscription) for the same
    losses. Thread count does not enter the cache key."""


def resolve_sft(sft: SFTConfig | None, task: Task) -> SFTConfig:
    """`sft` (default SFTConfig()) with `steps` filled in from `task.sft_steps` when it is None."""
    sft = sft or SFTConfig()
    return sft if sft.steps is not None else replace(sft, steps=task.sft_steps)


# ---------------------------------------------------------------- tokenizer and model


def build_tokenizer():
    """A character-level `PreTrainedTokenizerFast`: one token per character, <bos> prepended by `tokenizer(text)`.

    Ids: <pad>=0, <bos>=1, <eos>=2, <unk>=3, then newline and printable ASCII. `decode(ids, skip_special_tokens=True)`
    returns the exact text; characters outside ALPHABET become <unk>.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *ALPHABET])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Every single character (newline included) is its own pre-token, hence its own token.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse concatenates tokens without the spaces WordLevel decoding would insert.
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


def build_model(tokenizer, config: ModelConfig | None = None, seed: int = 0):
    """A freshly initialised `LlamaForCausalLM` sized by `config`, with the tokenizer's special token ids.

    Input and output embeddings are tied (fewer parameters). Initialisation is seeded by `seed`.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = config or ModelConfig()
    hf_config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(hf_config)
    _set_generation_ids(model, tokenizer)
    return model


def _set_generation_ids(model, tokenizer) -> None:
    gc = model.generation_config
    gc.bos_token_id = tokenizer.bos_token_id
    gc.eos_token_id = tokenizer.eos_token_id
    gc.pad_token_id = tokenizer.pad_token_id


def count_parameters(model) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- supervised warm start


def sft_batch(tokenizer, prompts: list[str], completions: list[str]) -> dict[str, torch.Tensor]:
    """Right-padded `input_ids`, `attention_mask`, `labels` (-100 on prompt and padding) for teacher forcing.

    Each row is [<bos>] + prompt + completion + [<eos>]; labels equal input_ids on completion and <eos> positions.
    """
    rows, label_rows = [], []
    for prompt, completion in zip(prompts, completions, strict=True):
        p = tokenizer(prompt).input_ids  # (with <bos>)
        c = [*tokenizer(completion, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
        rows.append(p + c)
        label_rows.append([-100] * len(p) + c)
    T = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([r + [pad] * (T - len(r)) for r in rows])  # (B, T)
    labels = torch.tensor([r + [-100] * (T - len(r)) for r in label_rows])  # (B, T)
    attention_mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])  # (B, T)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def corrupt_completion(text: str, rng: random.Random) -> str:
    """Replace one digit of one line of `text` by a different digit (the prompt is never touched)."""
    positions = [i for i, ch in enumerate(text) if ch.isdigit()]
    if not positions:
        return text
    i = rng.choice(positions)
    new = rng.choice([d for d in "0123456789" if d != text[i]])
    return text[:i] + new + text[i + 1 :]


def slip_answer_sign(text: str) -> str:
    """Drop the minus sign of a negative number on the last line of `text` (`x=-2` -> `x=2`, `-7` -> `7`)."""
    head, _, last = text.rpartition("\n")
    match = re.search(r"-(\d+)$", last)
    if match is None or (match.start() > 0 and last[match.start() - 1].isdigit()):
        return text  # not a negative answer (a trailing `7-3` is a subtraction, not a sign)
    last = last[: match.start()] + match.group(1)
    return f"{head}\n{last}" if head else last


def warm_start(task: Task, tokenizer, model, sft: SFTConfig | None = None, seed: int = 0,
               device: str | torch.device = "cpu", progress=None) -> dict:
    """Train `model` in place on the task's reference solutions; return {losses, seconds, cpu_seconds, steps}.

    Deterministic for a given (task, seed, sft, device). Sets torch CPU threads to `sft.num_threads` for the
    duration (restored afterwards). `progress(step, steps, loss)` is called every 25 steps and after the last one.
    """
    sft = resolve_sft(sft, task)
    old_threads = torch.get_num_threads()
    if sft.num_threads > 0:
        torch.set_num_threads(sft.num_threads)
    try:
        return _warm_start(task, tokenizer, model, sft, seed, torch.device(device), progress)
    finally:
        torch.set_num_threads(old_threads)


def _warm_start(task, tokenizer, model, sft: SFTConfig, seed: int, device: torch.device, progress) -> dict:
    rng = random.Random(f"sft:{seed}")
    torch.manual_seed(seed)
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=sft.lr, weight_decay=sft.weight_decay)

    def lr_factor(step: int) -> float:
        if step < sft.warmup_steps:
            return (step + 1) / sft.warmup_steps
        frac = (step - sft.warmup_steps) / max(1, sft.steps - sft.warmup_steps)
        return 1.0 - 0.9 * frac

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    losses = []
    t0, c0 = time.perf_counter(), time.process_time()
    for step in range(sft.steps):
        problems = [rng.choice(task.train) for _ in range(sft.batch_size)]
        completions = []
        for p in problems:
            text = task.solution_text(p)
            if rng.random() < sft.corrupt_frac:
                text = corrupt_completion(text, rng)
            if rng.random() < sft.answer_slip_frac:
                text = slip_answer_sign(text)
            completions.append(text)
        batch = {k: v.to(device) for k, v in sft_batch(tokenizer, [p.prompt for p in problems], completions).items()}
        loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if progress and ((step + 1) % 25 == 0 or step == sft.steps - 1):
            progress(step + 1, sft.steps, losses[-1])
    model.eval()
    # Wall time depends on how busy the machine is; process CPU time (summed over threads) is the steadier measure.
    return {"losses": losses, "seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0,
            "steps": sft.steps}


# ---------------------------------------------------------------- loading: cache and local models


def sft_progress_reporter(progress_file: str | os.PathLike | None = None, print_every: int = 100):
    """A `progress(step, steps, loss)` callback for `warm_start`: prints a line every `print_every` steps (and at
    the end) and, with `progress_file`, keeps {step, steps, loss} in that JSON file (written whole, then renamed,
    so a reader never sees half a file). What the demo's progress bar reads."""

    def report(step: int, steps: int, loss: float) -> None:
        if print_every and (step % print_every == 0 or step == steps):
            print(f"sft step {step:5d}/{steps} loss {loss:.4f}", flush=True)
        if progress_file is not None:
            tmp = f"{progress_file}.tmp"
            Path(tmp).write_text(json.dumps({"step": step, "steps": steps, "loss": loss}))
            os.replace(tmp, progress_file)

    return report


def warm_start_key(task: Task, model_config: ModelConfig, sft: SFTConfig, seed: int, device_type: str) -> str:
    """Hash of everything the warm-started weights depend on (task, split sizes, seeds, configs, device type)."""
    sft_fields = {k: v for k, v in asdict(sft).items() if k != "num_threads"}
    blob = json.dumps(
        {
            "version": CACHE_VERSION,
            "task": task.name,
            "task_seed": task.seed,
            "n_train": len(task.train),
            "n_heldout": len(task.heldout),
            "seed": seed,
            "model": asdict(model_config),
            "sft": sft_fields,
            "device": device_type,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def load_local_model(path: str | os.PathLike, device: str | torch.device = "cpu"):
    """Load any local transformers causal LM and its tokenizer from a directory; never touches a hub.

    Returns (model, tokenizer), model in eval mode on `device`. If the tokenizer has no pad token, its EOS token is
    used for padding. Raises FileNotFoundError if `path` is not a directory, ValueError if it holds no model
    (no config.json or no weights file).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise ValueError(f"{str(path)!r} holds no transformers model (no config.json); expected a save_pretrained dir")
    weights = [*path.glob("*.safetensors"), *path.glob("pytorch_model*.bin"), *path.glob("*.safetensors.index.json")]
    if not weights:
        raise ValueError(f"{str(path)!r} has a config.json but no weights (*.safetensors or pytorch_model*.bin)")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.to(device).eval()
    return model, tokenizer


def load_policy(task: Task, *, model_dir: str | os.PathLike | None = None,
                cache_dir: str | os.PathLike | None = None, seed: int = 0,
                model_config: ModelConfig | None = None, sft: SFTConfig | None = None,
                device: str | torch.device | None = None, progress=None):
    """The initial policy for `task`: returns (model, tokenizer, description).

    - `model_dir` given: `load_local_model(model_dir)` as is (no warm start).
    - otherwise: the warm-started tiny model. With `cache_dir`, it is read from
      `<cache_dir>/warmstart-<warm_start_key>/` when present, else trained and saved there atomically (temporary
      directory + rename), so repeated runs reuse it. Without `cache_dir`, it is trained every time.
    The model is in eval mode on `device` (default: CUDA when available, else CPU). The caller keeps a frozen copy
    as pi_ref. `description` is a one-line human-readable summary for the run log.
    """
    device = resolve_device() if device is None else torch.device(device)
    if model_dir is not None:
        model, tokenizer = load_local_model(model_dir, device)
        desc = f"local model {Path(model_dir).name} ({type(model).__name__}, {count_parameters(model):,} params)"
        return model, tokenizer, desc

    model_config = model_config or ModelConfig()
    sft = resolve_sft(sft, task)
    key = warm_start_key(task, model_config, sft, seed, device.type)
    size = f"{model_config.hidden_size}d x {model_config.num_layers} layers"
    if cache_dir is not None:
        final = Path(cache_dir) / f"warmstart-{key}"
        if (final / "config.json").is_file():
            model, tokenizer = load_local_model(final, device)
            desc = (f"tiny llama {size} ({count_parameters(model):,} params), "
                    f"SFT warm start {sft.steps} steps on {task.name} (cached {final.name})")
            return model, tokenizer, desc

    tokenizer = build_tokenizer()
    model = build_model(tokenizer, model_config, seed=seed)
    stats = warm_start(task, tokenizer, model, sft, seed=seed, device=device, progress=progress)
    if cache_dir is not None:
        _save_atomically(model, tokenizer, final, {"key": key, "task": task.name, "seed": seed,
                                                   "model": asdict(model_config), "sft": asdict(sft),
                                                   "sft_seconds": stats["seconds"],
                                                   "sft_cpu_seconds": stats["cpu_seconds"],
                                                   "final_loss": stats["losses"][-1] if stats["losses"] else None})
    desc = (f"tiny llama {size} ({count_parameters(model):,} params), "
            f"SFT warm start {sft.steps} steps on {task.name} ({stats['seconds']:.0f}s, "
            f"{stats['cpu_seconds']:.0f}s CPU)")
    return model, tokenizer, desc


def _save_atomically(model, tokenizer, final: Path, meta: dict) -> None:
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "warmstart.json").write_text(json.dumps(meta, indent=2))
        try:
            os.rename(tmp, final)  # atomic: readers see no directory or a complete one
        except OSError:
            if not (final / "config.json").is_file():  # lost a race to an identical writer: fine; else re-raise
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------- generation and evaluation


@torch.no_grad()
def generate_greedy(model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int = 100) -> list[str]:
    """Greedy completions (text before the first EOS, special tokens removed) for `prompts`, in order.

    Decoded by engine.rollout.generate, the trainer's own generation (left padding, cut at the first EOS), in
    batches of `batch_size` prompts.
    """
    was_training = model.training
    model.eval()
    out = []
    for i in range(0, len(prompts), batch_size):
        input_ids, attention_mask, P = generate(model, tokenizer, prompts[i : i + batch_size], do_sample=False,
                                                temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens)
        lengths = attention_mask[:, P:].sum(-1).tolist()  # completion tokens up to and including the first EOS
        for row, n in zip(input_ids[:, P:].tolist(), lengths, strict=True):
            out.append(tokenizer.decode(row[:n], skip_special_tokens=True))
    model.train(was_training)
    return out


def greedy_accuracy(model, tokenizer, task: Task, problems: list[Problem], max_new_tokens: int | None = None,
                    batch_size: int = 100) -> float:
    """Mean outcome reward of greedy completions on `problems` (max_new_tokens defaults to task.max_new_tokens)."""
    if not problems:
        return float("nan")
    completions = generate_greedy(model, tokenizer, [p.prompt for p in problems],
                                  max_new_tokens or task.max_new_tokens, batch_size)
    return sum(task.outcome_reward(p, c) for p, c in zip(problems, completions, strict=True)) / len(problems)
