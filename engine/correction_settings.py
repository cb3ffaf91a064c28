"""Settings of the rollout/trainer mismatch corrections (engine.corrections), without torch.

The corrections' config (`CorrectionConfig`), the parsing and validation of their flags and threshold strings, and the
per-token rejection reason codes. Apart from `engine.corrections` (which needs torch) so that the command line, the
config file and the dashboard pages that only label logged codes can use them without importing torch.

Flags (`parse_flag` turns each command-line string into the field's value, with a clear error):

    --rollout-is {token,sequence,token_truncate,token_mask,sequence_truncate,sequence_mask}
    --rollout-is-threshold 2.0 | 0.5_5.0      (verl: TIS upper bound / IcePop lower_upper; TRL: C_max / C_min_C_max)
    --rollout-is-batch-normalize              (verl: rescale the weights to mean 1 over the batch)
    --rollout-rs token_k1,seq_mean_k3         (verl's rejection options, chained by comma)
    --rollout-rs-threshold 0.5_2.0,0.01       (one per option, or one shared; k1 options take lower_upper)
    --off-policy-mask 0.5                     (TRL / DeepSeek-V3.2 off-policy sequence mask, threshold delta)

Rejection reason codes (the `rejected` token column, named like the clip codes of engine.clip_codes), why a token of
the loss got no gradient from the corrections; when several reasons hold, the first in this order is logged:
- REJECT_NONE (0): kept (its IS weight, if any, may still be truncated);
- REJECT_TOKEN (1): a token-level rejection option (verl `token_k1/k2/k3`) rejected the token itself;
- REJECT_SEQUENCE (2): a sequence-level rejection option (verl `seq_sum_*`, `seq_mean_*`, `seq_max_*`) rejected its
  whole sequence;
- REJECT_OFF_POLICY (3): the off-policy sequence mask (TRL `off_policy_mask_threshold`, DeepSeek-V3.2) dropped its
  sequence: negative advantage and mean (sampler - trainer) log-prob above the threshold;
- REJECT_IS_ZERO (4): its IS weight is 0 because the ratio fell outside the bounds of a masking IS mode (verl
  IcePop "lower_upper" thresholds, TRL `token_mask` / `sequence_mask`).
Codes 1 and 2 take the token out of the loss mask (verl modifies `response_mask`, so the loss normaliser shrinks);
codes 3 and 4 multiply its loss by 0 (as TRL and verl do for them: the normaliser keeps the token). In every case the
token stays in the batch and in the log.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from numbers import Real
from typing import Any

REJECT_NONE, REJECT_TOKEN, REJECT_SEQUENCE, REJECT_OFF_POLICY, REJECT_IS_ZERO = 0, 1, 2, 3, 4
REJECT_EVENTS = (REJECT_TOKEN, REJECT_SEQUENCE, REJECT_OFF_POLICY, REJECT_IS_ZERO)  # every code but "none"
REJECT_NAMES = {
    REJECT_NONE: "none",
    REJECT_TOKEN: "token",
    REJECT_SEQUENCE: "sequence",
    REJECT_OFF_POLICY: "off-policy mask",
    REJECT_IS_ZERO: "IS weight 0",
}

# verl 0.9.1 `rollout_is` levels (verl/trainer/ppo/rollout_corr_helper.py, compute_rollout_correction_weights)
VERL_IS_LEVELS = ("token", "sequence")
# TRL 1.16 `vllm_importance_sampling_mode` (trl/trainer/grpo_config.py)
TRL_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
ROLLOUT_IS_CHOICES = VERL_IS_LEVELS + TRL_IS_MODES
# verl 0.9.1 SUPPORTED_ROLLOUT_RS_OPTIONS, in a readable order
RS_OPTIONS = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)
TOKEN_RS_OPTIONS = ("token_k1", "token_k2", "token_k3")

RATIO_BAND = (0.9, 1.1)  # the band of TRL issue 6789's figure: a token is "off" when its ratio leaves it

VERL_IS_THRESHOLD = 2.0  # verl RolloutCorrectionConfig.rollout_is_threshold default (TIS, Yao et al. 2025: C = 2)
TRL_IS_CLIP_MAX = 3.0  # TRL GRPOConfig.vllm_importance_sampling_clip_max default
# verl 0.9.1's presets (RolloutCorrectionConfig.decoupled_seq_is_rs, decoupled_geo_rs, decoupled_k3_rs): the
# thresholds used when --rollout-rs names one of these options without --rollout-rs-threshold
RS_PRESET_THRESHOLDS = {"seq_sum_k1": "0.5_2.0", "seq_mean_k1": "0.999_1.001", "seq_mean_k3": "0.01"}


class CorrectionError(ValueError):
    """A correction setting that cannot be used; the message names the setting, the value and what is accepted."""


def _positive_number(text: str, what: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise CorrectionError(f"{what}: {text!r} is not a number; accepted: a number > 0") from None
    if math.isnan(value) or value <= 0:
        raise CorrectionError(f"{what}: {text!r} is invalid; accepted: a number > 0")
    return value


def _spec_text(spec: Any, what: str) -> str:
    if isinstance(spec, bool) or not isinstance(spec, (str, Real)):
        raise CorrectionError(
            f"{what} = {spec!r} ({type(spec).__name__}) is invalid; accepted: a number or a string such as "
            "'2.0' or '0.5_5.0'"
        )
    text = str(spec).strip()
    if not text:
        raise CorrectionError(f"{what} is empty; accepted: a number or a string such as '2.0' or '0.5_5.0'")
    return text


def parse_bounds(spec: Any, what: str = "--rollout-is-threshold") -> tuple[float | None, float]:
    """(lower, upper) of a threshold: a number or "u" gives (None, u); "l_u" gives (l, u), l <= u, both > 0.

    verl's `_parse_rollout_is_threshold` (rollout_corr_helper.py, verl 0.9.1), stricter on NaN (rejected here).
    """
    text = _spec_text(spec, what)
    if "_" in text:
        low_text, high_text = text.split("_", 1)
        lower, upper = _positive_number(low_text, what + " (lower)"), _positive_number(high_text, what + " (upper)")
        if lower > upper:
            raise CorrectionError(f"{what} = {text!r}: the lower bound {lower} is above the upper bound {upper}; "
                                  "accepted: lower_upper with lower <= upper")
        return lower, upper
    return None, _positive_number(text, what)


def parse_rs_options(spec: Any) -> tuple[str, ...]:
    """The rejection options of a comma-separated string, in order, each once (verl counts a repeated option once)."""
    if not isinstance(spec, str) or not spec.strip():
        raise CorrectionError(f"--rollout-rs = {spec!r} is invalid; accepted: one or more of {', '.join(RS_OPTIONS)}"
                              ", separated by commas")
    options = [part.strip() for part in spec.split(",") if part.strip()]
    unknown = [opt for opt in options if opt not in RS_OPTIONS]
    if unknown or not options:
        raise CorrectionError(f"--rollout-rs: unknown option {', '.join(map(repr, unknown)) or repr(spec)}; "
                              f"accepted: {', '.join(RS_OPTIONS)} (several separated by commas)")
    return tuple(dict.fromkeys(options))


def parse_rs_thresholds(options: tuple[str, ...], spec: Any) -> dict[str, tuple[float | None, float]]:
    """option -> (lower, upper) for each rejection option (verl 0.9.1 `_parse_rollout_rs_thresholds`).

    `spec`: one threshold shared by all options, or one per option (after duplicates are dropped), comma separated.
    k1 options bound a ratio pi_sampler / pi_trainer: "l_u" gives [l, u], a single u gives [1/u, u]; every other
    option takes one upper bound on its divergence.
    """
    if spec is None:
        missing = [opt for opt in options if opt not in RS_PRESET_THRESHOLDS]
        if missing:
            raise CorrectionError(
                f"--rollout-rs-threshold is required for {', '.join(missing)} (verl has no default for it); "
                f"presets exist only for {', '.join(RS_PRESET_THRESHOLDS)}"
            )
        parts = [RS_PRESET_THRESHOLDS[opt] for opt in options]
    else:
        text = _spec_text(spec, "--rollout-rs-threshold")
        parts = [part.strip() for part in text.split(",") if part.strip()]
        if len(parts) not in (1, len(options)):
            raise CorrectionError(
                f"--rollout-rs-threshold = {text!r} has {len(parts)} values for {len(options)} distinct options "
                f"({', '.join(options)}); accepted: one value shared by all or exactly one per option"
            )
        parts = parts * len(options) if len(parts) == 1 else parts
    bounds: dict[str, tuple[float | None, float]] = {}
    for option, part in zip(options, parts, strict=True):
        what = f"--rollout-rs-threshold for {option}"
        lower, upper = parse_bounds(part, what)
        if option.endswith("k1"):
            lower = 1.0 / upper if lower is None else lower
            if lower > upper:
                raise CorrectionError(f"{what} = {part!r} gives the ratio band [{lower:g}, {upper:g}], which is empty;"
                                      " accepted: a single u > 1 (band [1/u, u]) or lower_upper with lower <= upper")
        elif lower is not None:
            raise CorrectionError(f"{what} = {part!r}: a lower_upper pair is only for k1 options; accepted: one upper "
                                  "bound > 0 on the divergence")
        bounds[option] = (lower, upper)
    return bounds


def is_bounds(mode: str, spec: Any) -> tuple[float | None, float | None]:
    """(lower, upper) of the IS weight for `mode` (a ROLLOUT_IS_CHOICES value) and its threshold spec or None.

    verl levels: None means 2.0 (TIS); "l_u" is IcePop's band. TRL modes: None means (C_min, C_max) = (None, 3.0);
    "l_u" sets both; an upper bound "inf" leaves the ratio unbounded above (TRL's clip_max=None).
    """
    if mode not in ROLLOUT_IS_CHOICES:
        raise CorrectionError(f"--rollout-is = {mode!r} is invalid; accepted: {', '.join(ROLLOUT_IS_CHOICES)}")
    if spec is None:
        return None, VERL_IS_THRESHOLD if mode in VERL_IS_LEVELS else TRL_IS_CLIP_MAX
    lower, upper = parse_bounds(spec)
    return lower, (None if mode in TRL_IS_MODES and math.isinf(upper) else upper)


@dataclass(frozen=True)
class CorrectionConfig:
    """How the loss corrects for the gap between the sampler's and the trainer's log-probs. All off by default."""

    rollout_is: str | None = None
    """Importance-sampling weight pi_trainer / pi_sampler on each token's loss (detached), or None (off).
    "token" / "sequence": verl 0.9.1's `rollout_is` (verl/trainer/ppo/rollout_corr_helper.py), a per-token ratio or
    the product over the sequence, truncated (TIS: Yao et al. 2025, "Your efficient RL framework secretly brings you
    off-policy RL training") or zeroed outside a band (IcePop: Ling Team 2025, "Every step evolves", Ring-1T).
    "token_truncate", "token_mask", "sequence_truncate", "sequence_mask": TRL 1.16's `vllm_importance_sampling_mode`
    (masked IS, MIS: Liu, Li et al. 2025, "When speed kills stability")."""

    rollout_is_threshold: float | str | None = None
    """Bounds of the IS weight. verl levels: a number u truncates at u (TIS; default 2.0, verl's default), "l_u"
    zeroes weights outside [l, u] (IcePop; verl's IcePop preset is "0.5_5.0"). TRL modes: u is C_max, "l_u" is
    (C_min, C_max), applied by clamping (`*_truncate`) or zeroing (`*_mask`); default C_max = 3.0 (TRL's)."""

    rollout_is_batch_normalize: bool = False
    """Rescale the verl IS weights to mean 1 over the batch (verl `rollout_is_batch_normalize`, default False)."""

    rollout_rs: str | None = None
    """Rejection options, comma separated, all must pass (verl 0.9.1 `compute_rollout_rejection_mask`): token_k1/k2/k3,
    seq_sum_k1/k2/k3, seq_mean_k1/k2/k3, seq_max_k2/k3, with k1 = log(pi_sampler / pi_trainer), k2 = k1^2 / 2,
    k3 = r - 1 - log r (r = pi_trainer / pi_sampler). A rejected token leaves the loss mask. None: off."""

    rollout_rs_threshold: float | str | None = None
    """One threshold per rejection option, or one shared (comma separated). k1: "l_u" or u (band [1/u, u]); others: an
    upper bound. None: verl's preset values (seq_sum_k1 "0.5_2.0", seq_mean_k1 "0.999_1.001", seq_mean_k3 0.01)."""

    off_policy_mask: float | None = None
    """Drop from the loss every sequence with a negative advantage whose mean (sampler - trainer) log-prob exceeds
    this delta (DeepSeek-AI 2025, DeepSeek-V3.2, Eq. 9; TRL 1.16 `off_policy_mask_threshold`, e.g. 0.5). None: off."""

    def __post_init__(self):
        if self.rollout_is is not None:
            is_bounds(self.rollout_is, self.rollout_is_threshold)
        elif self.rollout_is_threshold is not None:
            raise CorrectionError("--rollout-is-threshold is set but --rollout-is is not; accepted: set --rollout-is "
                                  f"to one of {', '.join(ROLLOUT_IS_CHOICES)} too")
        if not isinstance(self.rollout_is_batch_normalize, bool):
            raise CorrectionError(f"rollout_is_batch_normalize = {self.rollout_is_batch_normalize!r}; accepted: "
                                  "true or false")
        if self.rollout_is_batch_normalize and self.rollout_is not in VERL_IS_LEVELS:
            raise CorrectionError("--rollout-is-batch-normalize is verl's and needs --rollout-is token or sequence; "
                                  f"got --rollout-is {self.rollout_is!r}")
        if self.rollout_rs is not None:
            parse_rs_thresholds(parse_rs_options(self.rollout_rs), self.rollout_rs_threshold)
        elif self.rollout_rs_threshold is not None:
            raise CorrectionError("--rollout-rs-threshold is set but --rollout-rs is not; accepted: set --rollout-rs "
                                  "too (e.g. seq_mean_k3)")
        if self.off_policy_mask is not None:
            value = self.off_policy_mask
            if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or value < 0:
                raise CorrectionError(f"--off-policy-mask = {value!r} is invalid; accepted: a number >= 0 (the mean "
                                      "log-prob gap delta, e.g. 0.5), or unset")

    @property
    def enabled(self) -> bool:
        return self.rollout_is is not None or self.rollout_rs is not None or self.off_policy_mask is not None

    @classmethod
    def of(cls, source: Any) -> CorrectionConfig:
        """The corrections of any object holding these fields as attributes (e.g. a training config), validated."""
        return cls(**{name: getattr(source, name) for name in CORRECTION_FIELDS})


CORRECTION_FIELDS = tuple(f.name for f in fields(CorrectionConfig))


# ---- command-line flags: flag -> (field, parser of the flag's string)


def _optional_text(value: str) -> str | None:
    text = value.strip()
    return None if text.lower() in ("", "none", "off") else text


def _parse_rollout_is(value: str) -> str | None:
    mode = _optional_text(value)
    if mode is not None and mode not in ROLLOUT_IS_CHOICES:
        raise CorrectionError(f"--rollout-is {value!r} is invalid; accepted: {', '.join(ROLLOUT_IS_CHOICES)} or none")
    return mode


def _parse_threshold(flag: str):
    def parse(value: str) -> str | None:
        text = _optional_text(value)
        if text is not None:
            for part in text.split(","):
                parse_bounds(part, flag)
        return text
    return parse


def _parse_rollout_rs(value: str) -> str | None:
    text = _optional_text(value)
    return None if text is None else ",".join(parse_rs_options(text))


def _parse_off_policy_mask(value: str) -> float | None:
    text = _optional_text(value)
    if text is None:
        return None
    try:
        delta = float(text)
    except ValueError:
        raise CorrectionError(f"--off-policy-mask {value!r} is not a number; accepted: a number >= 0 (e.g. 0.5) "
                              "or none") from None
    if not math.isfinite(delta) or delta < 0:
        raise CorrectionError(f"--off-policy-mask {value!r} is invalid; accepted: a number >= 0 (e.g. 0.5) or none")
    return delta


def _parse_bool(value: str) -> bool:
    text = value.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise CorrectionError(f"--rollout-is-batch-normalize {value!r} is invalid; accepted: true or false")


FLAGS = {
    "--rollout-is": ("rollout_is", _parse_rollout_is),
    "--rollout-is-threshold": ("rollout_is_threshold", _parse_threshold("--rollout-is-threshold")),
    "--rollout-is-batch-normalize": ("rollout_is_batch_normalize", _parse_bool),
    "--rollout-rs": ("rollout_rs", _parse_rollout_rs),
    "--rollout-rs-threshold": ("rollout_rs_threshold", _parse_threshold("--rollout-rs-threshold")),
    "--off-policy-mask": ("off_policy_mask", _parse_off_policy_mask),
}


def parse_flag(flag: str, value: str) -> tuple[str, Any]:
    """(field name, value) of one command-line flag's string; "none" / "off" / "" unset it. Raises CorrectionError."""
    if flag not in FLAGS:
        raise CorrectionError(f"unknown correction flag {flag!r}; accepted: {', '.join(FLAGS)}")
    name, parse = FLAGS[flag]
    return name, parse(value)


def config_from_flags(flags: dict[str, str], base: CorrectionConfig | None = None) -> CorrectionConfig:
    """The CorrectionConfig of `base` (default: all off) with the given {flag: string} applied, validated whole."""
    fields = dict(vars(base or CorrectionConfig()))
    for flag, value in flags.items():
        name, parsed = parse_flag(flag, value)
        fields[name] = parsed
    return CorrectionConfig(**fields)
