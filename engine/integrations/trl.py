"""TRL's GRPOTrainer, logged token by token into a PolicyLens run (`pip install 'policylens[trl]'`).

    from engine.integrations.trl import PolicyLensGRPOTrainer

    trainer = PolicyLensGRPOTrainer(model=model, reward_funcs=[accuracy, fmt], args=GRPOConfig(...),
                                    train_dataset=dataset, processing_class=tokenizer,
                                    logs_dir="logs", run_name="my-trl-run", log_groups=8)
    trainer.train()          # then: policylens dashboard --logs-dir logs

One PolicyLens step is one TRL generation batch (`steps_per_generation` mini-batches, `num_iterations` passes over
them). What lands in the run log, in the engine's schema (engine/runlog.py):

- `rollouts`: every completion of the step (prompt, completion, group, `reward` = TRL's weighted total,
  `reward_components` = each reward function's own value, advantage, length, truncated, `rank`);
- `tokens`: token id and text, old_logp (TRL's, or the first training forward's when TRL reuses it as the old
  policy), ref_logp (when beta != 0), entropy (from the first training forward over the token), advantage, and
  sampler_logp when TRL has the sampler's log-probs (`sampling_per_token_logps`, its vLLM path; NaN where vLLM
  could not score a token, as TRL keeps it);
- `token_passes`: one row per token per `_compute_loss` call (a mini-batch of one pass, `pass` counts them within
  the step): new_logp, ratio (the ratio TRL's loss used: the sequence ratio on every token at
  `importance_sampling_level="sequence"`; vespo: its sequence weight w), clip code by TRL's own rule and
  token_loss by TRL's formula, both computed with the engine's surrogates (`trl_surrogate`: every loss type of TRL
  1.16, top_entropy_quantile's mask included; TRL's documented differences are named options, TRL_CISPO_* and
  TRL_BIAS_CORRECTED_KL), grad_weight and k3 KL; with TRL's vLLM IS correction, is_weight = its
  `importance_sampling_ratio`; with its IS correction or `off_policy_mask_threshold`, rejected = why its loss
  multiplied the token by 0 (REJECT_OFF_POLICY, REJECT_IS_ZERO of engine.correction_settings);
- `steps` (rank 0): TRL's logged metrics of the optimizer steps of this generation, averaged, mapped onto the
  contract columns (`METRIC_COLUMNS`); every other metric in `extra` (with `logging_steps=1`, as in the examples,
  the row covers exactly its generation's optimizer steps; with more, whatever TRL logged during it), and with
  sampler log-probs the `mismatch_*` metrics of engine.corrections.offpolicy_metrics over rank 0's rows;
- `run.json`: the GRPOConfig as config, the algorithm named from loss_type / importance_sampling_level
  (`algorithm_name`).

grad_weight is exact: a tensor hook on the log-probs of TRL's training forward receives d(loss)/d(logp) during
TRL's own backward, and -1 times it is logged. It is the gradient of the loss TRL backpropagates, so with
`gradient_accumulation_steps > 1` it includes TRL's 1/accumulation scaling, and under several processes it is
this process's share before the gradient all-reduce. It also includes TRL's KL gradient as configured: with
TRL's default `use_bias_correction_kl=True` the KL term is multiplied by the ratio (DeepSeek-V3.2), which the
engine's objectives do not do; `kl` is the plain k3 value either way.

`log_groups=K` keeps the tokens and token passes of only the first K groups of each step (the rollouts and the
`steps` aggregates always cover the whole batch): a real run with thousands of long completions stays cheap.

Cost: the per-token values of each mini-batch stay on the training device (no host sync inside TRL's loss;
with `log_groups`, one small one per mini-batch to drop the rows not logged) and are selected and copied to the
host once per table when the step is written; token texts are decoded once per distinct token id (cached across
steps); the Parquet encoding runs on the run log's writer thread. On the tiny model, where logging weighs most,
this adds about 1-2% to TRL's CPU time per step (benchmarks/bench_trl.py).

Several processes (`accelerate launch --multi_gpu --num_processes N`, also on CPU): each process writes the
rollouts it sampled into the same run with its rank (`rollouts.rank`); rollout ids are global row numbers of the
generation batch (unique across ranks), groups are TRL's (consecutive `num_generations` rows of that order, which
may span ranks). Rank 0 writes run.json and the `steps` row, whose TRL metrics are already global.

How the hooks work (trl 1.16): `_generate_and_score_completions` is wrapped to read its output and to add a row
index tensor, which TRL's shuffle and split carry into every mini-batch; `_compute_loss` is wrapped, and for the
duration of one call `_get_per_token_logps_and_entropies` is replaced by a wrapper that keeps its log-probs and
entropies and registers the gradient hook. Callbacks never see per-token tensors, hence a subclass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

try:
    from trl import GRPOTrainer
except ImportError as err:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        "engine.integrations.trl needs TRL: install the extra with  pip install 'policylens[trl]'"
    ) from err

from engine.clip_codes import CLIP_CAP, CLIP_HIGH, CLIP_LOW, CLIP_NONE, fraction_column
from engine.correction_settings import REJECT_IS_ZERO, REJECT_OFF_POLICY
from engine.corrections import off_policy_mask, offpolicy_metrics
from engine.importers import as_text, components_json, run_name_from_folder
from engine.logrows import MISMATCH_PREFIX
from engine.objectives import SurrogateOutput, defaults, k3_kl, surrogate, top_entropy_mask, vespo_log_weight
from engine.rollout import TokenText
from engine.runlog import RunLogError, RunWriter, validate_run_name

__all__ = [
    "METRIC_COLUMNS",
    "ROW_KEY",
    "TRL_SURROGATES",
    "PolicyLensGRPOTrainer",
    "algorithm_name",
    "clip_codes",
    "token_losses",
    "trl_surrogate",
]

ROW_KEY = "policylens_row"
"""Key of the (B,) row-index tensor added to TRL's generation batch; it survives TRL's shuffle and split."""

METRIC_COLUMNS = {
    "reward": "reward_mean",
    "reward_std": "reward_std",
    "entropy": "entropy",
    "kl": "kl",
    "clip_ratio/low_mean": fraction_column(CLIP_LOW),
    "clip_ratio/high_mean": fraction_column(CLIP_HIGH),
    "cispo_clip_ratio": fraction_column(CLIP_CAP),
    "completions/mean_length": "response_len_mean",
    "completions/max_length": "response_len_max",
    "completions/clipped_ratio": "truncated_frac",
    "loss": "loss",
    "grad_norm": "grad_norm",
    "learning_rate": "lr",
}
"""TRL metric name -> `steps` column. Every other numeric metric goes into `extra` under its TRL name."""

TRL_SURROGATES = {"grpo": "ppo-clip", "bnpo": "ppo-clip", "dr_grpo": "ppo-clip", "dapo": "ppo-clip",
                  "luspo": "ppo-clip", "cispo": "cispo", "sapo": "sapo", "vespo": "vespo"}
"""TRL loss_type -> the engine surrogate (engine.objectives.surrogate) that computes it; TRL's documented
differences are the named options below, not a second copy of the math."""

TRL_CISPO_BOUND_IS_ABSOLUTE = True
"""TRL's CISPO caps the IS weight at `epsilon_high` itself (clamp(r, max=epsilon_high)) and has no lower bound; the
engine's cispo caps at 1 + eps_high above 1 - eps_low: TRL's is the engine's with eps_low = 1, eps_high =
epsilon_high - 1."""

TRL_CISPO_COUNTS_POSITIVE_ONLY = True
"""TRL's cispo_clip_ratio counts the capped tokens with A > 0 only; the engine also marks A < 0 tokens above the cap
(their weight is capped too). The adapter's clip codes follow TRL so that they add up to its logged metric."""

TRL_BIAS_CORRECTED_KL = "use_bias_correction_kl"
"""GRPOConfig option (default True): TRL multiplies the k3 KL term by the ratio (DeepSeek-V3.2); the engine does not.
The adapter's token_loss follows the run's setting; `kl` is the plain k3 value either way."""


# ---------------------------------------------------------------- pure functions


def algorithm_name(loss_type: str, importance_sampling_level: str = "token") -> str:
    """The PolicyLens name of a TRL loss: grpo, dapo, dr_grpo, gspo, cispo, sapo, luspo, vespo, or TRL's own name.

    TRL's `grpo` loss at the sequence level is GSPO (arXiv 2507.18071); `bnpo` averages over the tokens of the
    local batch like DAPO's token-mean, so it is named dapo; luspo and vespo are registry algorithms of the same
    name. Other losses at the sequence level get a `-sequence` suffix.
    """
    if importance_sampling_level == "sequence":
        return "gspo" if loss_type == "grpo" else loss_type if loss_type == "luspo" else f"{loss_type}-sequence"
    return {"bnpo": "dapo"}.get(loss_type, loss_type)


def trl_surrogate(loss_type: str, coef_1: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float,
                  sapo_temperatures: tuple[float, float] | None = None,
                  vespo_gamma: tuple[float, float, float, float] | None = None) -> SurrogateOutput | None:
    """TRL's per-token loss for `loss_type` computed by the engine's surrogate, or None for a loss the engine lacks.

    coef_1: (B, T) token ratios or (B, 1) sequence ratios (for vespo: its sequence weight w); advantages (B, 1) or
    (B, T). eps_low / eps_high: TRL's epsilon_low / epsilon_high. sapo_temperatures (tau_pos, tau_neg) and
    vespo_gamma (k_pos, lambda_pos, k_neg, lambda_neg): the run's; None takes the registry's published values (TRL's
    defaults are the same). Values in the engine's convention (engine.objectives departure 1); detached.
    """
    kind = TRL_SURROGATES.get(loss_type)
    if kind is None:
        return None
    r, adv = coef_1.detach(), advantages.detach()
    if kind == "cispo" and TRL_CISPO_BOUND_IS_ABSOLUTE:
        eps_low, eps_high = 1.0, eps_high - 1.0
    params = {**defaults("sapo"), **defaults("vespo")}  # the knobs of both soft rules, as published
    if sapo_temperatures is not None:
        params |= dict(zip(("tau_pos", "tau_neg"), sapo_temperatures, strict=True))
    if vespo_gamma is not None:
        params |= dict(zip(("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"), vespo_gamma,
                           strict=True))
    out = surrogate(kind, torch.log(r), adv, eps_low, eps_high, **params)
    clip = out.clip
    if kind == "cispo" and TRL_CISPO_COUNTS_POSITIVE_ONLY:
        clip = torch.where(adv > 0, clip, torch.zeros_like(clip))
    return SurrogateOutput(loss=out.loss.detach(), weight=out.weight, clip=clip)


def clip_codes(
    loss_type: str,
    coef_1: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
    sapo_temperatures: tuple[float, float] | None = None,
) -> torch.Tensor:
    """Clip code (engine.clip_codes) per token by TRL's own rule for `loss_type`; (B, T) or (B, 1) int8.

    The PPO-clip losses flag exactly what TRL counts in clip_ratio/low_mean and high_mean (1 when r < 1 - eps_low
    and A < 0, 2 when r > 1 + eps_high and A > 0); CISPO 3 as TRL's cispo_clip_ratio; SAPO (nothing logged by TRL)
    and VESPO the engine's soft-cap rule. All computed by `trl_surrogate`; 0 for a loss the engine lacks.
    """
    out = trl_surrogate(loss_type, coef_1, advantages, eps_low, eps_high, sapo_temperatures)
    if out is None:
        shape = torch.broadcast_shapes(coef_1.shape, advantages.shape)
        return torch.full(shape, CLIP_NONE, dtype=torch.int8, device=coef_1.device)
    return out.clip.to(torch.int8)


def token_losses(
    loss_type: str,
    coef_1: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
    kl_term: torch.Tensor | None = None,
    beta: float = 0.0,
    sapo_temperatures: tuple[float, float] | None = None,
    keep: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Per-token loss value of TRL's formula (before aggregation), or None where the engine has no such loss.

    The policy term of `trl_surrogate` (CISPO's and VESPO's in the engine's -w A convention), times `keep` (TRL's
    top_entropy_quantile mask) when given, plus beta * kl_term (the k3 KL, times the ratio under TRL's
    use_bias_correction_kl). (B, T) or (B, 1), detached.
    """
    out = trl_surrogate(loss_type, coef_1, advantages, eps_low, eps_high, sapo_temperatures)
    return None if out is None else _with_kl(out.loss, keep, kl_term, beta)


def _with_kl(policy: torch.Tensor, keep: torch.Tensor | None, kl_term: torch.Tensor | None, beta: float):
    """TRL's token loss: the policy term (masked by top_entropy_quantile's `keep`), plus beta * the KL term."""
    loss = policy if keep is None else policy * keep
    return loss if kl_term is None or not beta else loss + beta * kl_term.detach()


# ---------------------------------------------------------------- the buffers of one step


# Everything per token stays on the training device until the step is written: one device -> host copy per
# table and step (`_policylens_token_tables`) instead of a few per mini-batch, and no sync inside TRL's loss.


@dataclass
class _Generation:
    """What one generation batch produced on this process (local rows, in TRL's order before the shuffle)."""

    first_row: int  # global row number of local row 0
    rows: dict[str, Any]  # the rollouts columns
    completion_ids: torch.Tensor  # (B, T) on the device
    mask: torch.Tensor  # (B, T) bool on the device: the loss mask
    old_logp: torch.Tensor | None  # (B, T) TRL's old_per_token_logps, None when TRL reuses the training forward's
    ref_logp: torch.Tensor | None  # (B, T)
    advantages: torch.Tensor  # (B,) or (B, T)
    keep: torch.Tensor  # (B,) bool on the device: rows whose tokens are logged (log_groups)
    sampler_logp: torch.Tensor | None = None  # (B, T) TRL's sampling_per_token_logps (vLLM's), NaN where unscored
    is_ratio: torch.Tensor | None = None  # (B, T) or (B, 1) TRL's importance_sampling_ratio (vLLM IS correction)
    passes: list[_Pass] = field(default_factory=list)


_PASS_VALUES = ("new_logp", "old_logp", "ratio", "token_loss", "kl", "entropy")
"""The rows of `_Pass.values`; a quantity TRL's loss does not have (token_loss of vespo, kl at beta 0) is NaN."""


@dataclass
class _Pass:
    """One `_compute_loss` call: the mini-batch's rows and what TRL's loss saw. `grad` arrives in the backward."""

    rows: torch.Tensor  # (b,) local row indices
    mask: torch.Tensor  # (b, T) bool
    values: torch.Tensor  # (len(_PASS_VALUES), b, T) float32: the old_logp is the one TRL's ratio used
    clip: torch.Tensor  # (b, T) int8
    hooked: dict  # the tensor hook puts dLoss/dlogp (b, T) under "grad" during TRL's backward, after the call
    rejected: torch.Tensor | None = None  # (b, T) int8 reason codes (engine.correction_settings), None: no correction


def _detached(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach()


# ---------------------------------------------------------------- the trainer


class PolicyLensGRPOTrainer(GRPOTrainer):
    """TRL's GRPOTrainer that also writes a PolicyLens run (see the module docstring).

    Arguments: those of `trl.GRPOTrainer`, plus `logs_dir` (the PolicyLens logs folder), `run_name` (default:
    from `args.output_dir`) and `log_groups` (keep tokens of only the first N groups of each step; None: all).
    """

    def __init__(self, *args: Any, logs_dir: str | Path = "logs", run_name: str | None = None,
                 log_groups: int | None = None, **kwargs: Any):
        if log_groups is not None and (not isinstance(log_groups, int) or isinstance(log_groups, bool)
                                       or log_groups < 1):
            raise ValueError(f"log_groups = {log_groups!r} is invalid; accepted: None (every group) or an int >= 1")
        super().__init__(*args, **kwargs)
        self.policylens_logs_dir = Path(logs_dir)
        self.policylens_run_name = validate_run_name(
            run_name if run_name is not None else run_name_from_folder(self.args.output_dir),
            self.policylens_logs_dir)
        if self.accelerator.is_main_process and (self.policylens_logs_dir / self.policylens_run_name).exists():
            raise RunLogError(f"run {self.policylens_run_name!r} already exists in {self.policylens_logs_dir}; "
                              "pass another run_name (an existing run is never overwritten)")
        self.policylens_log_groups = log_groups
        self.policylens_writer: RunWriter | None = None
        self.policylens_step = 0
        self._policylens_generation: _Generation | None = None
        self._policylens_rewards: torch.Tensor | None = None
        self._policylens_texts: tuple[list, list] = ([], [])
        self._policylens_logs: list[dict[str, float]] = []
        self._policylens_token_text = TokenText(self.processing_class)

    # ---- opening and closing the run

    @property
    def policylens_algorithm(self) -> str:
        return algorithm_name(self.loss_type, self.importance_sampling_level)

    def _policylens_open(self) -> RunWriter:
        if self.policylens_writer is None:
            rank = self.accelerator.process_index
            config = self.args.to_dict()
            config["policylens"] = {
                "source": "trl", "trl_loss_type": self.loss_type,
                "importance_sampling_level": self.importance_sampling_level,
                "reward_funcs": list(self.reward_func_names), "reward_weights": self.reward_weights.tolist(),
                "world_size": self.accelerator.num_processes, "log_groups": self.policylens_log_groups,
            }
            model = self.accelerator.unwrap_model(self.model)
            description = f"{type(model).__name__} {getattr(model, 'name_or_path', '')}".strip()
            self.policylens_writer = RunWriter.create(
                self.policylens_logs_dir, self.policylens_run_name, algorithm=self.policylens_algorithm,
                task="", config=config, model=description, rank=rank)  # TRL knows datasets, not tasks
        return self.policylens_writer

    def train(self, *args: Any, **kwargs: Any):
        status = "crashed"
        try:
            result = super().train(*args, **kwargs)
            status = "finished"
            return result
        except KeyboardInterrupt:
            status = "stopped"
            raise
        finally:
            if self.policylens_writer is not None:
                try:
                    if status == "finished":
                        self._policylens_flush()
                finally:
                    self.policylens_writer.close(status=status)
                    self.policylens_writer = None

    # ---- generation: rollouts and tokens

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._policylens_rewards = rewards.detach()  # (N_global, F): every process's rows, TRL's global order
        self._policylens_texts = (prompts, completions)  # this process's, as TRL decoded them (no second decode)
        return rewards

    def _generate_and_score_completions(self, inputs):
        if not self.model.training:
            return super()._generate_and_score_completions(inputs)
        self._policylens_flush()  # the previous generation's passes are all done
        self._policylens_open()
        output = super()._generate_and_score_completions(inputs)
        ids, mask = output["completion_ids"], output["completion_mask"]
        if "tool_mask" in output:
            mask = mask * output["tool_mask"]
        n = ids.shape[0]
        output[ROW_KEY] = torch.arange(n, device=ids.device)
        self._policylens_generation = self._policylens_rollouts(output, mask)
        return output

    def _policylens_rollouts(self, output, mask) -> _Generation:
        ids = output["completion_ids"]
        n = ids.shape[0]
        rank = self.accelerator.process_index
        first = rank * n
        group_size = self.num_generations
        global_rows = np.arange(first, first + n)
        rewards = self._policylens_rewards[first:first + n].float().cpu()  # (n, F)
        total = (rewards * self.reward_weights.unsqueeze(0)).nansum(dim=1)
        total[torch.isnan(rewards).all(dim=1)] = float("nan")  # unscorable, as TRL logs it
        lengths = output["completion_mask"].sum(-1).long()  # (n,)
        last = ids.gather(1, (lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1)  # (n,) last token kept
        eos = torch.tensor(list(self.eos_token_ids), device=ids.device, dtype=ids.dtype)
        truncated = (lengths == 0) | ~torch.isin(last, eos)
        adv = output["advantages"].detach().float()
        adv = adv if adv.dim() == 1 else adv.mean(-1)
        lengths, truncated, adv = lengths.cpu(), truncated.cpu(), adv.cpu()
        names = list(self.reward_func_names)
        rows = {
            "rollout_id": global_rows, "group_id": global_rows // group_size,
            "index_in_group": global_rows % group_size, "kind": ["train"] * n,
            "prompt": [as_text(p) for p in self._policylens_texts[0]],
            "completion": [as_text(c) for c in self._policylens_texts[1]],
            "reward": total.numpy().astype(np.float64),
            "reward_components": [components_json(dict(zip(names, row, strict=True))) for row in rewards.tolist()],
            "advantage": adv.numpy().astype(np.float64),
            "length": lengths.numpy().astype(np.int64), "truncated": truncated.numpy(), "rank": [rank] * n,
        }
        keep = torch.ones(n, dtype=torch.bool, device=ids.device)
        if self.policylens_log_groups is not None:
            keep = torch.from_numpy(rows["group_id"] < self.policylens_log_groups).to(ids.device)
        return _Generation(
            first_row=first, rows=rows, completion_ids=ids, mask=mask.detach() > 0,
            old_logp=output.get("old_per_token_logps"), ref_logp=output.get("ref_per_token_logps"),
            advantages=output["advantages"].detach(), keep=keep,
            sampler_logp=_detached(output.get("sampling_per_token_logps")),
            is_ratio=_detached(output.get("importance_sampling_ratio")))

    # ---- optimisation: token passes

    def _compute_loss(self, model, inputs):
        gen = self._policylens_generation
        if not self.model.training or gen is None or ROW_KEY not in inputs:
            return super()._compute_loss(model, inputs)
        seen: dict[str, torch.Tensor | None] = {}
        original = self._get_per_token_logps_and_entropies

        def keep_grad(grad: torch.Tensor) -> None:  # (b, T) dLoss/dlogp, during TRL's backward
            picked = seen.get("picked")
            seen["grad"] = grad.detach() if picked is None else grad.detach()[picked]

        def forward_with_hook(*args, **kwargs):
            logps, entropies, aux = original(*args, **kwargs)
            if "logp" not in seen:  # the training forward is the first (and only) call inside _compute_loss
                seen["logp"], seen["entropy"] = logps, entropies
                if logps.requires_grad:
                    logps.register_hook(keep_grad)
            return logps, entropies, aux

        self._get_per_token_logps_and_entropies = forward_with_hook  # an instance attribute shadows the method
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            del self._get_per_token_logps_and_entropies
        if "logp" in seen:
            gen.passes.append(self._policylens_pass(gen, inputs, seen))
            del seen["logp"], seen["entropy"]  # keep only what the hook will add, not the forward's graph
        return loss

    def _policylens_pass(self, gen: _Generation, inputs, seen: dict) -> _Pass:
        new = seen["logp"].detach()
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        old = inputs.get("old_per_token_logps")
        old = new if old is None else old.detach()
        adv = inputs["advantages"].detach()
        adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
        log_ratio = new - old
        if self.importance_sampling_level == "sequence":
            log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)  # (b, 1)
        coef_1 = torch.exp(log_ratio)  # TRL's ratio (the one its bias-corrected KL uses)
        kl = None
        if self.beta != 0.0 and inputs.get("ref_per_token_logps") is not None:
            kl = k3_kl(new, inputs["ref_per_token_logps"].detach())
        kl_term = kl * coef_1 if kl is not None and getattr(self.args, TRL_BIAS_CORRECTED_KL) else kl
        if self.loss_type == "vespo":  # its weight reads the sequence ratio w = exp(sum of log ratios)
            coef_1 = torch.exp(vespo_log_weight(new - old, mask))  # (b, 1)
        args = self.args
        rule = trl_surrogate(self.loss_type, coef_1, adv, self.epsilon_low, self.epsilon_high,
                             (args.sapo_temperature_pos, args.sapo_temperature_neg),
                             (args.vespo_k_pos, args.vespo_lambda_pos, args.vespo_k_neg, args.vespo_lambda_neg))
        entropy = seen["entropy"]
        keep = None
        if self.top_entropy_quantile < 1.0 and entropy is not None:  # this process's tokens (TRL gathers all)
            keep = top_entropy_mask(entropy.detach(), mask, self.top_entropy_quantile).to(new.dtype)
        loss = None if rule is None else _with_kl(rule.loss, keep, kl_term, self.beta)
        shape = new.shape
        missing = torch.full(shape, math.nan, device=new.device)
        values = {"new_logp": new, "old_logp": old, "ratio": coef_1.expand(shape), "token_loss": loss, "kl": kl,
                  "entropy": None if entropy is None else entropy.detach()}
        record = _Pass(
            rows=inputs[ROW_KEY].detach(), mask=mask.detach() > 0,
            values=torch.stack([missing if values[k] is None else values[k].expand(shape).float()
                                for k in _PASS_VALUES]),
            clip=(rule.clip if rule is not None else torch.zeros(shape, dtype=torch.int8, device=new.device)
                  ).to(torch.int8).expand(shape),
            hooked=seen, rejected=self._policylens_rejected(inputs, new, old, adv, mask))
        if self.policylens_log_groups is None:
            return record
        # keep only the rows of logged groups until the step is written (the hook then keeps only their
        # gradients): device memory in proportion to what is logged, for one sync per mini-batch in this mode
        picked = seen["picked"] = gen.keep[record.rows].nonzero().squeeze(1)
        return _Pass(rows=record.rows[picked], mask=record.mask[picked], values=record.values[:, picked],
                     clip=record.clip[picked], hooked=seen,
                     rejected=None if record.rejected is None else record.rejected[picked])

    def _policylens_rejected(self, inputs, new: torch.Tensor, old: torch.Tensor, adv: torch.Tensor,
                             mask: torch.Tensor) -> torch.Tensor | None:
        """(b, T) int8: why TRL's loss multiplied a token by 0 in this pass, REJECT_OFF_POLICY when its
        off-policy mask dropped the row (recomputed here with engine.corrections.off_policy_mask, equal to TRL's
        get_off_policy_mask, on the same inputs TRL's loss took), else REJECT_IS_ZERO when its IS ratio is 0
        (the `*_mask` modes); None when TRL applies neither."""
        threshold = self.off_policy_mask_threshold
        ratio = inputs.get("importance_sampling_ratio") if self.loss_type != "vespo" else None
        if threshold is None and ratio is None:
            return None
        codes = torch.zeros(new.shape, dtype=torch.int8, device=new.device)
        if ratio is not None:
            codes[(ratio.detach() == 0).expand_as(new)] = REJECT_IS_ZERO
        if threshold is not None:  # TRL: the sampler's log-probs when it has them, else the old ones
            sampler = inputs.get("sampling_per_token_logps", old)
            kept = off_policy_mask(new - sampler.detach(), mask, adv, threshold)
            codes[kept == 0] = REJECT_OFF_POLICY
        return codes

    # ---- metrics

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        super().log(logs, start_time)  # fills `logs` with TRL's averaged metrics first
        if self.model.training and "train_runtime" not in logs and self.accelerator.is_main_process:
            self._policylens_logs.append({k: v for k, v in logs.items() if isinstance(v, (int, float))})

    # ---- writing one step

    def _policylens_flush(self) -> None:
        gen, self._policylens_generation = self._policylens_generation, None
        if gen is None or self.policylens_writer is None:
            return
        self.policylens_step += 1
        metrics = None
        tokens, passes, old = self._policylens_token_tables(gen)
        if self.accelerator.is_main_process:
            metrics = self._policylens_metrics()
            if gen.sampler_logp is not None:  # this process's rows (TRL's own sampling/* metrics are global)
                sampler = gen.sampler_logp.float()
                scored = gen.mask & torch.isfinite(sampler) & torch.isfinite(old)  # vLLM leaves some tokens NaN
                values = offpolicy_metrics(old, sampler, scored)
                metrics.update({MISMATCH_PREFIX + name: value for name, value in values.items()})
        self.policylens_writer.log_step(self.policylens_step, metrics=metrics, rollouts=gen.rows, tokens=tokens,
                                        token_passes=passes)

    def _policylens_metrics(self) -> dict[str, Any]:
        logs, self._policylens_logs = self._policylens_logs, []
        keys = {k for entry in logs for k in entry}
        metrics: dict[str, Any] = {"trl_global_step": int(self.state.global_step)}
        for key in sorted(keys):
            values = [float(e[key]) for e in logs if key in e and e[key] is not None and not math.isnan(e[key])]
            if values:
                metrics[METRIC_COLUMNS.get(key, key)] = sum(values) / len(values)
        return metrics

    def _policylens_token_tables(self, gen: _Generation) -> tuple[dict | None, dict | None, torch.Tensor]:
        """The step's `tokens` and `token_passes` columns (selected on the device, copied to the host once each)
        and the (B, T) old log-probs of every row."""
        mask = gen.mask & gen.keep[:, None]  # (B, T) logged tokens
        B, T = mask.shape
        device = mask.device
        nan = torch.full((B, T), math.nan, device=device)
        # old_logp / entropy per token: TRL's old log-probs, else the first training forward over the row; the
        # passes are applied last to first so that the first pass over a row is the one kept (rows are unique
        # within a pass)
        old = gen.old_logp.detach().float().clone() if gen.old_logp is not None else nan.clone()
        entropy = nan.clone()
        pass_floats, pass_keys, pass_clips, pass_corrections = [], [], [], []
        for p in range(len(gen.passes) - 1, -1, -1):
            rec = gen.passes[p]
            if gen.old_logp is None:
                old[rec.rows] = rec.values[_PASS_VALUES.index("old_logp")]
            entropy[rec.rows] = rec.values[_PASS_VALUES.index("entropy")]
        for p, rec in enumerate(gen.passes):
            sel = mask[rec.rows] & rec.mask  # (b, T)
            r_idx, pos = sel.nonzero(as_tuple=True)
            grad = rec.hooked.get("grad")
            weight = -grad[sel].float() if grad is not None else torch.full_like(r_idx, math.nan, dtype=torch.float)
            values = rec.values[:, sel]  # (V, n)
            pass_floats.append(torch.cat([values[[_PASS_VALUES.index(k) for k in ("new_logp", "ratio")]],
                                          weight[None], values[[_PASS_VALUES.index(k) for k in ("token_loss", "kl")]]]))
            pass_keys.append(torch.stack([torch.full_like(r_idx, p), rec.rows[r_idx], pos]))
            pass_clips.append(rec.clip[sel])
            is_weight = nan[rec.rows] if gen.is_ratio is None else gen.is_ratio[rec.rows].float().expand_as(sel)
            rejected = torch.zeros_like(sel, dtype=torch.int8) if rec.rejected is None else rec.rejected
            pass_corrections.append((is_weight[sel], rejected[sel]))
        r_idx, pos = mask.nonzero(as_tuple=True)
        if len(r_idx) == 0:
            return None, None, old
        adv = gen.advantages.detach().float()
        adv = adv[:, None].expand(B, T) if adv.dim() == 1 else adv
        ref = gen.ref_logp.detach().float() if gen.ref_logp is not None else nan
        token_floats = torch.stack([old, ref, entropy, adv])[:, mask].cpu().numpy().astype(np.float64)  # (4, N)
        token_keys = torch.stack([r_idx, pos, gen.completion_ids[mask]]).cpu().numpy().astype(np.int64)  # (3, N)
        tokens = {
            "rollout_id": token_keys[0] + gen.first_row, "position": token_keys[1], "token_id": token_keys[2],
            "token_text": self._policylens_texts_of(token_keys[2]),
            "old_logp": token_floats[0], "entropy": token_floats[2], "advantage": token_floats[3],
        }
        if gen.ref_logp is not None:
            tokens["ref_logp"] = token_floats[1]
        if gen.sampler_logp is not None:
            tokens["sampler_logp"] = gen.sampler_logp.float()[mask].cpu().numpy().astype(np.float64)
        passes = None
        if gen.passes:
            floats = torch.cat(pass_floats, dim=1).cpu().numpy().astype(np.float64)  # (5, M)
            keys = torch.cat(pass_keys, dim=1).cpu().numpy().astype(np.int64)  # (3, M)
            passes = {"pass": keys[0], "rollout_id": keys[1] + gen.first_row, "position": keys[2],
                      "new_logp": floats[0], "ratio": floats[1], "clip": torch.cat(pass_clips).cpu().numpy(),
                      "grad_weight": floats[2], "token_loss": floats[3], "kl": floats[4]}
            if gen.is_ratio is not None:
                passes["is_weight"] = torch.cat([w for w, _ in pass_corrections]).cpu().numpy().astype(np.float64)
            if any(rec.rejected is not None for rec in gen.passes):
                passes["rejected"] = torch.cat([r for _, r in pass_corrections]).cpu().numpy()
        return tokens, passes, old

    def _policylens_texts_of(self, token_ids: np.ndarray) -> pa.Array:
        """(N,) token ids -> their texts (engine.rollout.TokenText, cached per id) as an Arrow string array: one
        Python call per distinct token of the step, not per token."""
        distinct, index = np.unique(token_ids, return_inverse=True)
        texts = pa.array([self._policylens_token_text.token(int(t)) for t in distinct], pa.string())
        return texts.take(pa.array(index.reshape(-1)))
