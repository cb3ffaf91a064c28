"""engine.correction_settings: the correction config, its flags and threshold strings (parsed as verl 0.9.1 parses
them, compared with verl's own parsers), the clear errors on bad values, and the rejection reason codes."""

from __future__ import annotations

import dataclasses
import inspect
import math
import subprocess
import sys

import pytest

from engine.correction_settings import (
    CORRECTION_FIELDS,
    FLAGS,
    REJECT_EVENTS,
    REJECT_NAMES,
    REJECT_NONE,
    RS_OPTIONS,
    CorrectionConfig,
    CorrectionError,
    config_from_flags,
    is_bounds,
    parse_bounds,
    parse_flag,
    parse_rs_options,
    parse_rs_thresholds,
)


@pytest.fixture(scope="module")
def verl_helper():
    from verl_reference import import_verl

    return import_verl("verl.trainer.ppo.rollout_corr_helper")


def test_the_settings_module_imports_without_torch():
    code = "import sys, engine.correction_settings; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_reason_codes_are_distinct_and_named():
    codes = (REJECT_NONE, *REJECT_EVENTS)
    assert len(set(codes)) == len(codes) == len(REJECT_NAMES) and set(REJECT_NAMES) == set(codes)
    assert all(-128 <= code <= 127 for code in codes)  # logged as int8, like the clip codes


@pytest.mark.parametrize("spec", [2.0, 1, "2.0", " 3 ", "0.5_5.0", "1_1", "0.5_inf"])
def test_is_threshold_parses_as_verl(verl_helper, spec):
    upper, lower = verl_helper._parse_rollout_is_threshold(spec)
    assert parse_bounds(spec) == (lower, upper)


@pytest.mark.parametrize("spec", [True, "", "abc", "0", "-1", "2_1", "0_2", "a_2", None, [2.0]])
def test_bad_is_thresholds_are_refused_as_by_verl(verl_helper, spec):
    with pytest.raises((TypeError, ValueError)):
        verl_helper._parse_rollout_is_threshold(spec)
    with pytest.raises(CorrectionError, match="accepted"):
        parse_bounds(spec)


def test_nan_threshold_is_refused_where_verl_accepts_it(verl_helper):
    assert math.isnan(verl_helper._parse_rollout_is_threshold("nan")[0])
    with pytest.raises(CorrectionError, match="a number > 0"):
        parse_bounds("nan")


RS_SPECS = [
    (("token_k1",), "2.0"), (("token_k1",), 2), (("seq_mean_k1",), "0.999_1.001"), (("token_k3",), 0.1),
    (("token_k1", "seq_mean_k3"), "0.5_2.0,0.02"), (("seq_sum_k2", "seq_max_k3", "token_k1"), "1.5"),
    (("token_k1",), "1"),
]


@pytest.mark.parametrize(("options", "spec"), RS_SPECS)
def test_rs_thresholds_parse_as_verl(verl_helper, options, spec):
    theirs = verl_helper._parse_rollout_rs_thresholds(list(options), spec)
    ours = parse_rs_thresholds(options, spec)
    assert {name: (v["lower"], v["upper"]) for name, v in theirs.items()} == ours


BAD_RS_SPECS = [
    (("token_k1",), "0.5", "empty"),  # k1 single u < 1: [2, 0.5]
    (("token_k2",), "0.1_0.5", "only for k1"),
    (("token_k1", "token_k2"), "1,2,3", "3 values for 2 distinct options"),
    (("token_k3",), "-1", "number > 0"),
    (("token_k3",), "x", "not a number"),
]


@pytest.mark.parametrize(("options", "spec", "message"), BAD_RS_SPECS)
def test_bad_rs_thresholds_are_refused_as_by_verl(verl_helper, options, spec, message):
    with pytest.raises(ValueError):
        verl_helper._parse_rollout_rs_thresholds(list(options), spec)
    with pytest.raises(CorrectionError, match=message):
        parse_rs_thresholds(options, spec)


def test_rs_options_every_verl_option_each_once(verl_helper):
    assert set(RS_OPTIONS) == verl_helper.SUPPORTED_ROLLOUT_RS_OPTIONS
    assert parse_rs_options(" token_k1, seq_mean_k3 ,token_k1,") == ("token_k1", "seq_mean_k3")
    for bad in ("", "token_k4", "seq_max_k1", "token_k1;seq_mean_k3", None):
        with pytest.raises(CorrectionError, match="accepted"):
            parse_rs_options(bad)


def test_rs_threshold_defaults_are_verl_presets_and_required_otherwise():
    assert parse_rs_thresholds(("seq_mean_k3", "seq_sum_k1"), None) == {"seq_mean_k3": (None, 0.01),
                                                                        "seq_sum_k1": (0.5, 2.0)}
    with pytest.raises(CorrectionError, match="required for token_k2"):
        parse_rs_thresholds(("seq_mean_k3", "token_k2"), None)


@pytest.mark.parametrize(("mode", "spec", "expected"), [
    ("token", None, (None, 2.0)), ("sequence", "0.5_5.0", (0.5, 5.0)), ("token_truncate", None, (None, 3.0)),
    ("sequence_mask", "0.5_2", (0.5, 2.0)), ("token_mask", "0.5_inf", (0.5, None)), ("token", "0.5_inf",
                                                                                     (0.5, math.inf)),
])
def test_is_bounds_defaults_per_reference(mode, spec, expected):
    assert is_bounds(mode, spec) == expected


def test_a_config_holding_the_fields_gives_its_corrections():
    from types import SimpleNamespace

    holder = SimpleNamespace(algo="grpo", rollout_is="sequence", rollout_is_threshold=None,
                             rollout_is_batch_normalize=False, rollout_rs="seq_mean_k3", rollout_rs_threshold=None,
                             off_policy_mask=None)
    assert CorrectionConfig.of(holder) == CorrectionConfig(rollout_is="sequence", rollout_rs="seq_mean_k3")
    assert set(CORRECTION_FIELDS) == {name for name, _ in FLAGS.values()}  # every field has its flag
    holder.rollout_rs = "seq_mean_k4"
    with pytest.raises(CorrectionError, match="unknown option 'seq_mean_k4'"):
        CorrectionConfig.of(holder)


def test_config_defaults_are_all_off_and_every_field_is_documented():
    config = CorrectionConfig()
    assert not config.enabled
    source = inspect.getsource(CorrectionConfig)
    for field in dataclasses.fields(CorrectionConfig):
        head = source.split(f"    {field.name}: ", 1)[1]
        assert head.split("\n", 1)[1].lstrip().startswith('"""'), f"{field.name} has no docstring"


@pytest.mark.parametrize(("fields", "message"), [
    ({"rollout_is": "tokens"}, "accepted: token, sequence, token_truncate"),
    ({"rollout_is_threshold": 2.0}, "--rollout-is is not"),
    ({"rollout_is": "token_mask", "rollout_is_batch_normalize": True}, "needs --rollout-is token or sequence"),
    ({"rollout_is": "token", "rollout_is_batch_normalize": "yes"}, "true or false"),
    ({"rollout_rs": "seq_mean_k3,token_k2"}, "required for token_k2"),
    ({"rollout_rs_threshold": "0.1"}, "--rollout-rs is not"),
    ({"rollout_rs": "token_k1", "rollout_rs_threshold": "0.5"}, "empty"),
    ({"off_policy_mask": -0.1}, "a number >= 0"),
    ({"off_policy_mask": True}, "a number >= 0"),
    ({"off_policy_mask": math.inf}, "a number >= 0"),
])
def test_bad_configs_say_what_is_wrong(fields, message):
    with pytest.raises(CorrectionError, match=message):
        CorrectionConfig(**fields)


def test_flags_set_the_fields():
    config = config_from_flags({"--rollout-is": "token", "--rollout-is-threshold": "0.5_5.0",
                                "--rollout-rs": "seq_mean_k3,token_k1,seq_mean_k3", "--rollout-rs-threshold": "0.01,2",
                                "--off-policy-mask": "0.5"})
    assert config == CorrectionConfig(rollout_is="token", rollout_is_threshold="0.5_5.0",
                                      rollout_rs="seq_mean_k3,token_k1", rollout_rs_threshold="0.01,2",
                                      off_policy_mask=0.5)
    assert config.enabled
    assert config_from_flags({"--rollout-is": "none", "--rollout-is-threshold": "off"}, base=config).rollout_is is None
    assert parse_flag("--rollout-is-batch-normalize", "true") == ("rollout_is_batch_normalize", True)
    assert set(FLAGS) >= {"--rollout-is", "--rollout-is-threshold", "--rollout-rs", "--rollout-rs-threshold",
                          "--off-policy-mask"}


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--rollout-is", "tok", "accepted: token, sequence"),
    ("--rollout-is-threshold", "two", "not a number"),
    ("--rollout-is-threshold", "2_1", "lower bound 2.0 is above the upper bound 1.0"),
    ("--rollout-rs", "token_k9", "unknown option 'token_k9'"),
    ("--rollout-rs-threshold", "0.1,-2", "number > 0"),
    ("--off-policy-mask", "half", "not a number"),
    ("--off-policy-mask", "-1", "a number >= 0"),
    ("--rollout-is-batch-normalize", "maybe", "true or false"),
    ("--rollout-isx", "token", "unknown correction flag"),
])
def test_bad_flags_say_what_is_wrong(flag, value, message):
    with pytest.raises(CorrectionError, match=message):
        parse_flag(flag, value)
