"""One training configuration: every knob of a PolicyLens run, with the published defaults of each algorithm.

    from engine.config import TrainConfig
    cfg = TrainConfig(algo="dapo", task="linear", steps=200)     # presets filled in, then validated
    cfg = TrainConfig.from_file("my.json", algo="gspo")         # file values, then keyword overrides
    cfg.to_dict()                                               # the fully resolved config saved with the run

A field left at `None` is filled from the algorithm preset when the config is built (`__post_init__`), so the saved
config always holds concrete numbers. Every number a paper prescribes lives in the registry `engine.algorithms`: the
objective's hyper-parameters (clip ranges, KL weight, aggregation ...: `defaults(algo)`, checked by `resolve`) and the
loop settings (passes per batch, dynamic sampling, overlong shaping: `loop_defaults(algo)`); this file adds the
common loop defaults (LOOP_DEFAULTS) and everything that is not an algorithm's. No field's docstring types a preset.

Every field has a docstring right under it; `field_docs()` reads them and appends each algorithm's preset from the
registry, so that `policylens train --help` shows the same text and every field is a command-line flag
(`--eps-high 0.28`, `--no-dynamic-sampling`, ...).

Departures from the papers, on purpose (the papers train 7B-32B models on thousands of GPUs; we train a ~1M-parameter
model on two CPU cores):
1. Group size, batch size and response length are small (G = 8, not 16-64; tens of tokens, not 20k).
2. DAPO's overlong buffer is scaled with the response budget: L_cache = L_max / 5 (paper: 4096 of 20480).
3. The learning rate is far higher than the papers' 1e-6 because the model is tiny and the run is minutes long.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import json
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPERVISIONS = ("outcome", "process")
DEVICES = ("auto", "cpu", "cuda", "mps")


def resolve_device(name: str = "auto"):
    """The torch.device of a `TrainConfig.device` value: `auto` is CUDA when available, else the CPU."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


SAMPLER_DTYPES = ("float32", "bfloat16", "float16")  # engine.sampler: the sampler copy's precision


class ConfigError(ValueError):
    """A configuration that cannot train; the message says which field and what to do about it."""


# Loop settings of an algorithm whose paper prescribes none (each algorithm's own are `Objective.loop` in
# engine.algorithms, with the paper they come from). Two epochs x two mini-batches, so that from the second pass on
# the ratio leaves 1 and the clip really acts: on the first pass the policy still is pi_old (GRPO, arXiv 2402.03300,
# Algorithm 1, also takes several gradient steps per sampled batch).
LOOP_DEFAULTS: dict[str, Any] = {
    "epochs": 2,
    "minibatches": 2,
    "dynamic_sampling": False,
    "overlong_shaping": False,
    "scale_adv_by_std": True,
}


# TrainConfig fields only algorithms with a critic use (engine.critic); None for every other algorithm.
CRITIC_FIELDS = ("kl_coef", "gae_gamma", "gae_lambda", "whiten_advantages", "value_clip", "value_coef", "critic_lr")


def _objective_fields() -> tuple[str, ...]:
    from engine.algorithms import OBJECTIVES

    return tuple(dict.fromkeys(name for o in OBJECTIVES.values() for name in o.defaults()))


# TrainConfig fields that are hyper-parameters of engine.objectives.policy_loss (passed as overrides): every knob of
# every algorithm in the registry.
OBJECTIVE_FIELDS = _objective_fields()


@dataclass
class TrainConfig:
    # ------------------------------------------------------------------ what to train
    algo: str = "grpo"
    """Algorithm preset, one of engine.algorithms.ALGORITHMS (listed under Choices): sets the objective and the loop
    settings its paper prescribes; any field given explicitly overrides the preset."""
    task: str = "linear"
    """Task with an exact verifier (see engine.tasks): `linear` (solve a x + b = c, as in 2x + 3 = 7) or the
    variable-length task."""
    supervision: str = "outcome"
    """`outcome`: one reward per completion, every token gets the group-normalised advantage (GRPO sec. 4.1.2).
    `process`: the task's step verifier scores each step; token advantages sum the normalised step rewards of
    the steps ending at or after the token (GRPO sec. 4.1.3)."""
    model: str | None = None
    """Directory of a local transformers causal LM and its tokenizer to train instead of the built-in tiny model
    (loaded with from_pretrained; nothing is downloaded). It is also pi_ref. None: the built-in warm-started model."""
    seed: int = 0
    """Seeds the RL run (prompt order, sampling, mini-batch shuffling): two CPU runs with the same config log the
    same numbers."""
    task_seed: int = 0
    """Seeds the task's train/held-out split and the warm start, kept apart from `seed` so that runs with different
    seeds share the same held-out prompts (comparable by prompt_id) and the same cached warm start."""
    device: str = "auto"
    """`auto` (CUDA when available, else CPU), `cpu`, `cuda` or `mps`."""
    steps: int = 100
    """Number of training steps (one sampled batch each, then `epochs x minibatches` optimizer steps)."""
    time_limit_minutes: float = 0.0
    """Stop after the first step that ends this many minutes after training started (warm start and the step-0
    evaluation not counted); that step is evaluated and the run finishes. 0: no limit."""

    # ------------------------------------------------------------------ built-in model and warm start
    sft_steps: int | None = None
    """Supervised warm-start steps for the built-in model. None: the task's own default (`linear` 1000, `chain`
    1500; see engine.tasks). The warm start is cached, so only the first run pays for it (about 2 CPU minutes on
    `linear`)."""
    model_size: str = "default"
    """Built-in model size: `default` (well under 5M parameters) or `tiny` (for tests and smoke runs)."""

    # ------------------------------------------------------------------ sampling
    batch_size: int = 256
    """Completions per training step (= prompts per step x group_size). 32 prompts x 8: with fewer prompts per
    optimizer step the update is mostly noise, and noise alone lowers greedy accuracy (it flips near-tied digits)."""
    group_size: int = 8
    """G, completions sampled per prompt; the advantage baseline is the group mean (GRPO; the paper uses 64,
    DAPO 16). Must be at least 2."""
    temperature: float = 1.0
    """Sampling temperature for training rollouts (DAPO and GSPO sample at 1.0). Log-probs are computed at the same
    temperature so that the sampled policy is the policy being optimised."""
    top_p: float = 1.0
    """Nucleus sampling threshold for training rollouts (1.0 = off, as in DAPO)."""
    top_k: int = 0
    """Top-k truncation of the sampling distribution (0 = off). The sampler reports the log-prob of the truncated,
    renormalised distribution as `sampler_logp`, as vLLM does, so top-k / top-p open a gap to the trainer's
    old_logp (docs/mismatch.md)."""
    sampler_dtype: str = "float32"
    """Precision of the sampler, the policy copy that generates rollouts (engine.sampler). `bfloat16` reproduces a
    bf16 rollout engine next to an fp32 trainer (the mismatch of TRL issues 3867 and 6789, verl 2953); `float32`:
    the sampler is the policy itself (no copy)."""
    sampler_lag: int = 0
    """The sampler holds the trainer's weights of this many updates ago (the staleness of asynchronous RL, e.g.
    AReaL, Fu et al. 2025; verl's one-step off-policy mode is lag 1). 0: synced after every update."""
    max_new_tokens: int | None = None
    """Response budget in tokens; a completion without EOS within it is `truncated`. None: the task's budget (its
    longest reference solution + EOS + 8 tokens of slack: 30 for linear, 102 for chain)."""

    # ------------------------------------------------------------------ rewards and filtering
    overlong_shaping: bool | None = None
    """DAPO soft overlong punishment (arXiv 2503.14476 eq. 13) added to the correctness reward."""
    overlong_max_len: int | None = None
    """L_max of the overlong shaping, in tokens. None: max_new_tokens (the paper's 20480 is its generation budget)."""
    overlong_cache_len: int | None = None
    """L_cache, the soft-punishment buffer below L_max. None: overlong_max_len // 5 (paper 4096 of 20480)."""
    overlong_filter: bool = False
    """Overlong filtering (DAPO sec. 3.4; TRL mask_truncated_completions): truncated completions get mask 0 in the
    loss, their rewards still enter the group statistics."""
    dynamic_sampling: bool | None = None
    """DAPO dynamic sampling (sec. 3.2): drop groups whose rewards are all equal and sample further batches until
    the batch is full of mixed groups."""
    max_gen_batches: int = 10
    """Dynamic sampling gives up with an error after this many generation batches in one step (verl default 10)."""

    # ------------------------------------------------------------------ advantages
    scale_adv_by_std: bool | None = None
    """Divide the group-centred reward by the group std (GRPO; Dr. GRPO, arXiv 2503.20783, does not)."""

    # ------------------------------------------------------------------ critic and GAE (algorithms with a critic: ppo)
    kl_coef: float | None = None
    """PPO: weight of the KL to pi_ref inside the per-token reward, r_t = score_t - kl_coef * (log pi_old - log
    pi_ref) on every token (Ziegler et al. 2019, arXiv 1909.08593). None for algorithms without a critic."""
    gae_gamma: float | None = None
    """PPO: GAE discount gamma (Schulman et al., arXiv 1506.02438); 1 = no discount within a completion."""
    gae_lambda: float | None = None
    """PPO: GAE lambda, the bias/variance trade-off between TD(0) (0) and the Monte Carlo return (1)."""
    whiten_advantages: bool | None = None
    """PPO: whiten the GAE advantages over the batch's loss tokens ((A - mean) / std) before the loss, as
    the usual implementations do (Ziegler et al. 2019; TRL)."""
    value_clip: float | None = None
    """PPO: the new value may leave the value it had at sampling time by at most this much before its squared error
    stops counting (clipped value loss, max of the clipped and unclipped errors)."""
    value_coef: float | None = None
    """PPO: coefficient of the value loss (vf_coef). The critic is a separate model with its own AdamW, so this
    mostly sets how much of its gradient the norm clip lets through."""
    critic_lr: float | None = None
    """PPO: the critic's AdamW learning rate. None: 10 x lr. Higher than the policy's because the value head starts
    at zero and must learn the reward's scale within the minutes a run lasts (papers share one lr at 1e-6..1e-5)."""

    # ------------------------------------------------------------------ objective (None: engine.algorithms.defaults)
    eps_low: float | None = None
    """Lower clip range: ratio < 1 - eps_low with A < 0 is clipped (GSPO, LUSPO: the sequence ratio; GMPO: in log
    space). DPPO: how far p may fall below p_old (TV) or the binary KL bound, for A <= 0."""
    eps_high: float | None = None
    """Upper clip range: ratio > 1 + eps_high with A > 0 is clipped (DAPO's clip-higher raises it). DPPO: how far p may
    rise above p_old (TV) or the binary KL bound, for A > 0."""
    beta: float | None = None
    """Weight of the k3 KL penalty to pi_ref in the loss (GRPO eq. 3)."""
    aggregation: str | None = None
    """How token losses become one number (one of engine.algorithms.AGGREGATIONS: per-response token mean, batch
    token mean, Dr. GRPO's constant normaliser, per sequence, LUSPO's per-sequence token sum)."""
    dual_clip: float | None = None
    """Cap c on the weight, gradient kept (ASPO's soft dual clip; DPPO's truncated ratio, verl's clip_ratio_c)."""
    tau_pos: float | None = None
    """SAPO gate temperature for A > 0 tokens (arXiv 2511.20347)."""
    tau_neg: float | None = None
    """SAPO gate temperature for A < 0 tokens (arXiv 2511.20347)."""
    entropy_quantile: float | None = None
    """ASPO: tokens above this entropy quantile of their response use eps_high_entropy (Archer2.0)."""
    eps_high_entropy: float | None = None
    """ASPO: clip range for high-entropy tokens (Archer2.0)."""
    top_entropy_quantile: float | None = None
    """Share of each mini-batch's tokens, highest entropy first, whose policy term is kept; the KL term and the
    normalisers are unchanged ('80/20', arXiv 2506.01939, keeps 0.2; TRL's top_entropy_quantile). Any algorithm."""
    dro_beta: float | None = None
    """DRO: coefficient of its penalty dro_beta/2 (log pi/pi_old)^2 (verl's policy_loss.dro_beta; not beta)."""
    clip_cov_ratio: float | None = None
    """Clip-Cov: share of the tokens whose gradient is zeroed, drawn among those in the covariance band (arXiv
    2505.22617)."""
    clip_cov_lb: float | None = None
    """Clip-Cov: lower end of the covariance band (exclusive)."""
    clip_cov_ub: float | None = None
    """Clip-Cov: upper end of the covariance band (exclusive)."""
    kl_cov_ratio: float | None = None
    """KL-Cov: share of the tokens, highest covariance first, given the |log r| penalty (arXiv 2505.22617)."""
    kl_cov_coef: float | None = None
    """KL-Cov: coefficient of the |log r| penalty (verl's policy_loss.ppo_kl_coef)."""
    vespo_k_pos: float | None = None
    """VESPO: power k of the gamma weight for A >= 0 (arXiv 2602.10693; TRL's vespo_k_pos)."""
    vespo_lambda_pos: float | None = None
    """VESPO: decay lambda of the gamma weight for A >= 0."""
    vespo_k_neg: float | None = None
    """VESPO: power k of the gamma weight for A < 0."""
    vespo_lambda_neg: float | None = None
    """VESPO: decay lambda of the gamma weight for A < 0."""
    max_len: int | None = None
    """Constant normaliser L_max of Dr. GRPO's seq-mean-token-sum-norm aggregation. None: max_new_tokens (so the
    loss scale does not depend on the longest completion of a mini-batch)."""

    # ------------------------------------------------------------------ optimisation
    epochs: int | None = None
    """Passes over each sampled batch. More than one pass makes ratios leave 1 so clipping acts."""
    minibatches: int | None = None
    """Mini-batches per epoch (one optimizer step each)."""
    lr: float = 5e-5
    """AdamW learning rate, constant (the papers use 1e-6 on 7B+ models). Measured on `linear` with the default warm
    start and batch: GRPO and DAPO gain about 20 points of held-out greedy accuracy within 10 CPU minutes
    (docs/benchmarks.md). On an earlier warm start, 1e-4 and above at batch 64 lowered greedy accuracy by 5-10
    points within 10-30 steps."""
    weight_decay: float = 0.0
    """AdamW weight decay (verl and TRL default to 0 or 0.01 for RL; 0 keeps pi close to the warm start)."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.99
    """AdamW beta2 (0.99 as in DAPO/verl's RL recipes, rather than 0.999)."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm (verl, TRL default 1.0). 0 disables it."""

    # ------------------------------------------------------------------ evaluation, checkpoints, logging
    eval_every: int = 10
    """Held-out evaluation every N steps (and at step 0 and the last step). 0 disables evaluation."""
    eval_size: int = 200
    """Number of held-out prompts; the same prompts at every evaluation, so each can be followed across steps.
    200 (the whole held-out split of the built-in tasks) keeps the standard error of an accuracy near 3 points."""
    eval_temperature: float | None = None
    """Temperature of the sampled held-out accuracy. None: the training temperature."""
    checkpoint_every: int = 1
    """Save model, optimizer and RNG state into the run folder every N steps (and when stopping), so that a killed
    run resumes after its last logged step (a few percent of a step's time for the built-in model; see
    docs/benchmarks.md). 0: only when stopping or finishing (a killed run then resumes from the warm start)."""
    # ------------------------------------------------------------------ sampler/trainer mismatch corrections
    # (engine.corrections; validated by engine.correction_settings.CorrectionConfig; all off by default)
    rollout_is: str | None = None
    """Importance weight pi_trainer / pi_sampler (detached) on each token's loss. `token` / `sequence`: verl 0.9.1
    `rollout_is` (TIS, Yao et al. 2025; IcePop with a lower_upper threshold, Ling Team 2025); `token_truncate`,
    `token_mask`, `sequence_truncate`, `sequence_mask`: TRL 1.16 `vllm_importance_sampling_mode` (Liu, Li et al.
    2025). None: off."""
    rollout_is_threshold: str | None = None
    """IS bound: `u` truncates at u (verl default 2.0; TRL C_max default 3.0), `l_u` zeroes (verl IcePop, TRL
    `*_mask`) or clamps (TRL `*_truncate`) outside [l, u]. None: the reference's default."""
    rollout_is_batch_normalize: bool = False
    """Rescale verl IS weights to mean 1 over the batch (verl `rollout_is_batch_normalize`, default off)."""
    rollout_rs: str | None = None
    """Rejection options of verl 0.9.1 `compute_rollout_rejection_mask`, comma separated (token_k1/k2/k3,
    seq_sum_k*, seq_mean_k*, seq_max_k2/k3): a rejected token or sequence leaves the loss mask. None: off."""
    rollout_rs_threshold: str | None = None
    """One threshold per rejection option or one shared (k1: `l_u` or u for [1/u, u]). None: verl's presets
    (seq_sum_k1 0.5_2.0, seq_mean_k1 0.999_1.001, seq_mean_k3 0.01)."""
    off_policy_mask: float | None = None
    """Drop sequences with negative advantage whose mean (sampler - trainer) log-prob exceeds this delta
    (DeepSeek-V3.2, Eq. 9; TRL 1.16 `off_policy_mask_threshold`). None: off."""

    log_tokens: bool = True
    """Log per-token rows (tokens, token_passes, prm_steps, ref_tokens). Off: only steps and rollouts (for
    benchmarking)."""

    # ------------------------------------------------------------------ construction

    def __post_init__(self) -> None:
        # Idempotent: a resolved config (e.g. loaded from a run) has no None left to fill.
        from engine import objectives, tasks

        if self.task not in tasks.TASKS:
            raise ConfigError(f"unknown task {self.task!r}; choose one of: {', '.join(tasks.TASKS)}")
        if self.max_new_tokens is None or self.sft_steps is None:
            task = tasks.get_task(self.task, seed=self.task_seed)
            self.max_new_tokens = task.max_new_tokens if self.max_new_tokens is None else self.max_new_tokens
            self.sft_steps = task.sft_steps if self.sft_steps is None else self.sft_steps
        if self.algo not in objectives.ALGORITHMS:
            raise ConfigError(
                f"unknown algo {self.algo!r}; choose one of: {', '.join(objectives.ALGORITHMS)}"
            )
        preset = {**LOOP_DEFAULTS, **objectives.loop_defaults(self.algo)}
        for name, value in preset.items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        obj_defaults = objectives.defaults(self.algo)
        for name in OBJECTIVE_FIELDS:
            if getattr(self, name) is None and name in obj_defaults:
                setattr(self, name, obj_defaults[name])
        if self.max_len is None:
            self.max_len = self.max_new_tokens
        if self.overlong_max_len is None:
            self.overlong_max_len = self.max_new_tokens
        if self.overlong_cache_len is None:
            self.overlong_cache_len = max(1, self.overlong_max_len // 5)
        if self.eval_temperature is None:
            self.eval_temperature = self.temperature
        if self.critic_lr is None and objectives.uses_critic(self.algo):
            self.critic_lr = 10 * self.lr
        self.validate()

    def validate(self) -> None:
        """Refuse configurations that cannot train, with a message that says what to change."""
        from engine import objectives, tasks

        def bad(msg: str) -> None:
            raise ConfigError(msg)

        if self.algo not in objectives.ALGORITHMS:
            bad(f"unknown algo {self.algo!r}; choose one of: {', '.join(objectives.ALGORITHMS)}")
        if self.task not in tasks.TASKS:
            bad(f"unknown task {self.task!r}; choose one of: {', '.join(tasks.TASKS)}")
        if self.supervision not in SUPERVISIONS:
            bad(f"supervision must be one of {SUPERVISIONS}, got {self.supervision!r}")
        if self.device not in DEVICES:
            bad(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.steps < 1:
            bad(f"steps must be >= 1, got {self.steps}")
        if self.time_limit_minutes < 0:
            bad(f"time_limit_minutes must be >= 0 (0: no limit), got {self.time_limit_minutes}")
        if self.group_size < 2:
            bad(
                f"group_size must be >= 2 (got {self.group_size}): the advantage is the reward minus the group "
                "mean, so a group of one has no signal"
            )
        if self.batch_size < self.group_size or self.batch_size % self.group_size:
            bad(
                f"batch_size ({self.batch_size}) must be a positive multiple of group_size ({self.group_size}); "
                f"e.g. --batch-size {max(1, self.batch_size // self.group_size) * self.group_size}"
            )
        if not 0.0 < self.temperature <= 10.0:
            bad(f"temperature must be in (0, 10], got {self.temperature}")
        if self.eval_temperature is not None and not 0.0 < self.eval_temperature <= 10.0:
            bad(f"eval_temperature must be in (0, 10], got {self.eval_temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        self._validate_sampler(bad)
        if self.max_new_tokens < 1:
            bad(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        try:  # the objective's own hyper-parameters are checked where they are defined
            objectives.resolve(self.algo, **self.objective_overrides())
        except ValueError as error:
            bad(str(error))
        if self.max_len is not None and self.max_len < self.max_new_tokens:
            bad(
                f"max_len ({self.max_len}) must be >= max_new_tokens ({self.max_new_tokens}): it normalises "
                "token sums by the longest possible completion"
            )
        assert self.overlong_max_len is not None and self.overlong_cache_len is not None
        if self.overlong_max_len < 1:
            bad(f"overlong_max_len (L_max) must be >= 1, got {self.overlong_max_len}")
        if not 0 < self.overlong_cache_len <= self.overlong_max_len:
            bad(
                f"overlong_cache_len (L_cache = {self.overlong_cache_len}) must be in [1, overlong_max_len = "
                f"{self.overlong_max_len}]: the soft punishment ramps over the last L_cache tokens before L_max"
            )
        self._validate_update(bad)
        for name in ("eval_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                bad(f"{name} must be >= 0 (0 disables it), got {getattr(self, name)}")
        self._validate_critic(bad)
        if self.eval_size < 1:
            bad(f"eval_size must be >= 1, got {self.eval_size}")
        if self.model_size not in ("default", "tiny"):
            bad(f"model_size must be 'default' or 'tiny', got {self.model_size!r}")
        if self.sft_steps is not None and self.sft_steps < 0:
            bad(f"sft_steps must be >= 0, got {self.sft_steps}")

    def _validate_update(self, bad) -> None:
        """The generation rounds, the passes over the batch and the optimiser."""
        if self.max_gen_batches < 1:
            bad(f"max_gen_batches must be >= 1, got {self.max_gen_batches}")
        assert self.epochs is not None and self.minibatches is not None
        if self.epochs < 1:
            bad(f"epochs must be >= 1, got {self.epochs}")
        if self.minibatches < 1 or self.minibatches > self.batch_size:
            bad(f"minibatches must be in [1, batch_size = {self.batch_size}], got {self.minibatches}")
        if self.lr <= 0:
            bad(f"lr must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            bad(f"weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                bad(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.max_grad_norm < 0:
            bad(f"max_grad_norm must be >= 0 (0 disables clipping), got {self.max_grad_norm}")

    def _validate_sampler(self, bad) -> None:
        from engine.correction_settings import CorrectionConfig, CorrectionError

        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            bad(f"top_k must be an integer >= 0 (0: off), got {self.top_k!r}")
        if self.sampler_dtype not in SAMPLER_DTYPES:
            bad(f"sampler_dtype must be one of {', '.join(SAMPLER_DTYPES)}, got {self.sampler_dtype!r}")
        if isinstance(self.sampler_lag, bool) or not isinstance(self.sampler_lag, int) or self.sampler_lag < 0:
            bad(f"sampler_lag must be an integer >= 0 (updates the sampler's weights lag behind), got "
                f"{self.sampler_lag!r}")
        try:
            corrections = CorrectionConfig.of(self)
        except CorrectionError as error:
            bad(str(error))
        from engine.objectives import OBJECTIVES

        weighs = corrections.rollout_is is not None or corrections.off_policy_mask is not None
        if weighs and not OBJECTIVES[self.algo].loss_scales_with_advantage:  # said now, not after the warm start
            accepted = ", ".join(name for name, entry in OBJECTIVES.items() if entry.loss_scales_with_advantage)
            bad(f"--rollout-is and --off-policy-mask weigh a token's loss through its advantage, and {self.algo}'s "
                f"loss is not proportional to the advantage; --rollout-rs works with every algorithm, weights with: "
                f"{accepted}")

    def _validate_critic(self, bad) -> None:
        from engine import objectives

        given = [name for name in CRITIC_FIELDS if getattr(self, name) is not None]
        if not objectives.uses_critic(self.algo):
            if given:
                critics = objectives.CRITIC_ALGORITHMS
                bad(f"{', '.join(given)} only apply to algorithms with a critic ({', '.join(critics)}), not to "
                    f"{self.algo!r}; drop them or use --algo {critics[0]}")
            return
        if self.kl_coef < 0:
            bad(f"kl_coef must be >= 0, got {self.kl_coef}")
        for name in ("gae_gamma", "gae_lambda"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                bad(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.value_clip <= 0:
            bad(f"value_clip must be > 0, got {self.value_clip}")
        if self.value_coef <= 0:
            bad(f"value_coef must be > 0, got {self.value_coef}")
        if self.critic_lr <= 0:
            bad(f"critic_lr must be > 0, got {self.critic_lr}")

    # ------------------------------------------------------------------ derived values

    @property
    def prompts_per_step(self) -> int:
        """Groups (distinct prompts) per training step."""
        return self.batch_size // self.group_size

    def objective_overrides(self) -> dict[str, Any]:
        """The keyword overrides passed to engine.objectives.policy_loss (only the algorithm's own knobs)."""
        return {name: getattr(self, name) for name in OBJECTIVE_FIELDS if getattr(self, name) is not None}

    # ------------------------------------------------------------------ (de)serialisation

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as plain JSON values (saved in the run's run.json)."""
        return {f.name: getattr(self, f.name) for f in knob_fields()}

    @classmethod
    def from_dict(cls, values: dict[str, Any], **overrides: Any) -> TrainConfig:
        """Build from a dict (e.g. a saved run config), then apply keyword overrides. Unknown keys are errors."""
        merged = {**values, **{k: v for k, v in overrides.items() if v is not None}}
        names = {f.name for f in knob_fields()}
        unknown = sorted(set(merged) - names)
        if unknown:
            raise ConfigError(f"unknown config field(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        return cls(**merged)

    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> TrainConfig:
        """Load a JSON config file (TOML too when the Python has tomllib, 3.11+), then apply overrides."""
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
        if path.suffix == ".toml":
            try:
                import tomllib
            except ImportError as exc:  # Python 3.10
                raise ConfigError(f"{path}: TOML needs Python 3.11+; write the config as JSON") from exc
            values = tomllib.loads(text)
        else:
            try:
                values = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
        if not isinstance(values, dict):
            raise ConfigError(f"{path} must hold a JSON object of field: value pairs")
        return cls.from_dict(values, **overrides)


def knob_fields() -> list[dataclasses.Field]:
    """The user-facing fields of TrainConfig, in declaration order."""
    return [f for f in dataclasses.fields(TrainConfig) if not f.name.startswith("_")]


def field_docs() -> dict[str, str]:
    """Field name -> the docstring written under it in TrainConfig (parsed from the source), followed by the
    presets of the algorithms that set it (engine.algorithms, `preset_text`)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(TrainConfig)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return {name: f"{text} {preset_text(name)}".rstrip() for name, text in docs.items()}


def preset_text(name: str) -> str:
    """The presets of field `name` as the registry holds them: the most common value, then the exceptions by
    algorithm ("Preset: 0.2; dapo 0.28, ..."); '' for a field no algorithm presets."""
    from engine.algorithms import COMMON_KNOBS, presets

    if COMMON_KNOBS.get(name) is not None:
        return f"Default: {_show(COMMON_KNOBS[name])}."
    values = presets(name, LOOP_DEFAULTS if name in LOOP_DEFAULTS else None)
    if not values:
        return ""
    counts: dict[str, int] = {}
    for value in values.values():
        counts[_show(value)] = counts.get(_show(value), 0) + 1
    common = max(counts, key=counts.get)
    if len(values) == 1:
        (algo, value), = values.items()
        return f"Preset: {algo} {_show(value)}."
    rest = [f"{algo} {_show(value)}" for algo, value in values.items() if _show(value) != common]
    if counts[common] <= 4:  # a value few algorithms share: name them
        common += f" ({', '.join(algo for algo, value in values.items() if _show(value) == common)})"
    return f"Preset: {common}" + (f"; {', '.join(rest)}." if rest else ".")


def _show(value: Any) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else f"{value:g}" if isinstance(value, float) \
        else str(value)


def add_config_arguments(parser) -> None:
    """Add one `--field-name` flag per TrainConfig field, default None (= config file, then preset)."""
    import argparse

    from engine.objectives import ALGORITHMS

    docs = field_docs()
    from engine.correction_settings import ROLLOUT_IS_CHOICES

    choices = {"algo": ALGORITHMS, "supervision": SUPERVISIONS, "device": DEVICES, "sampler_dtype": SAMPLER_DTYPES,
               "rollout_is": ROLLOUT_IS_CHOICES}
    group = parser.add_argument_group("config fields (default: the config file, then the algorithm preset)")
    for f in knob_fields():
        flag = "--" + f.name.replace("_", "-")
        kind = _base_type(f)
        help_text = docs.get(f.name, "")
        if f.name in choices:  # listed from the registry, never typed again in a docstring
            help_text += f" Choices: {', '.join(choices[f.name])}."
        help_text = help_text.replace("%", "%%")  # argparse %-formats help strings
        if kind is bool:
            group.add_argument(flag, dest=f.name, default=None, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            group.add_argument(flag, dest=f.name, default=None, type=kind, help=help_text)


def config_from_args(args) -> TrainConfig:
    """Build the config from parsed CLI args: `--config FILE` first, then every flag given explicitly."""
    overrides = {f.name: getattr(args, f.name, None) for f in knob_fields()}
    if getattr(args, "config", None):
        return TrainConfig.from_file(args.config, **overrides)
    return TrainConfig.from_dict({}, **overrides)


def _base_type(f: dataclasses.Field) -> type:
    # Annotations are strings under `from __future__ import annotations`: "int | None" -> int.
    annotation = str(f.type).replace(" ", "")
    for name, kind in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if annotation.split("|")[0] == name:
            return kind
    raise TypeError(f"unsupported config field type {f.type!r} for {f.name}")
