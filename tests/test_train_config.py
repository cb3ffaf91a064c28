"""TrainConfig: presets from the papers, validation messages, file and CLI loading (no training here)."""

from __future__ import annotations

import json
import re

import pytest

from engine.config import ConfigError, TrainConfig, field_docs, knob_fields
from engine.objectives import ALGORITHMS, defaults


def test_every_field_has_a_docstring_and_a_flag():
    from engine.cli import build_parser

    docs = field_docs()
    names = [f.name for f in knob_fields()]
    assert [n for n in names if not docs.get(n)] == []
    help_text = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    for name in names:
        assert "--" + name.replace("_", "-") in help_text


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_presets_take_the_objective_defaults(algo):
    cfg = TrainConfig(algo=algo)
    for key, value in defaults(algo).items():
        if key == "max_len":
            assert cfg.max_len == cfg.max_new_tokens
        else:
            assert getattr(cfg, key) == value, key
    assert cfg.epochs * cfg.minibatches >= 2, "one pass per batch would never clip"


def test_paper_loop_settings():
    assert TrainConfig(algo="dapo").dynamic_sampling and TrainConfig(algo="dapo").overlong_shaping
    assert not TrainConfig(algo="grpo").dynamic_sampling
    assert TrainConfig(algo="gspo").minibatches == 4
    assert TrainConfig(algo="aspo").epochs == 3
    assert TrainConfig(algo="dr_grpo").scale_adv_by_std is False
    assert (TrainConfig(algo="dapo").eps_low, TrainConfig(algo="dapo").eps_high) == (0.2, 0.28)
    cfg = TrainConfig(task="linear")
    assert cfg.overlong_max_len == cfg.max_new_tokens and cfg.overlong_cache_len == cfg.max_new_tokens // 5


def test_overrides_win_over_presets():
    cfg = TrainConfig(algo="dapo", eps_high=0.3, dynamic_sampling=False, minibatches=3)
    assert (cfg.eps_high, cfg.dynamic_sampling, cfg.minibatches) == (0.3, False, 3)
    assert cfg.objective_overrides()["eps_high"] == 0.3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(group_size=1), "group_size must be >= 2"),
        (dict(batch_size=30, group_size=8), r"multiple of group_size.*--batch-size 24"),
        (dict(eps_low=1.5), r"eps_low = 1.5 for 'grpo' is invalid; accepted: a number in \(0, 1\]"),
        (dict(eps_high=0.0), r"eps_high = 0.0 for 'grpo' is invalid; accepted: a finite number > 0"),
        (dict(algo="gmpo", eps_low=1.5, eps_high=0.0), "eps_high = 0.0 for 'gmpo'"),  # log space: 1.5 is fine
        (dict(algo="aspo", dual_clip=1.0), r"dual_clip = 1.0 is invalid; accepted: a finite number > 1"),
        (dict(algo="dapo", aggregation="sum"), "unknown aggregation 'sum'; accepted: seq-mean-token-mean"),
        (dict(algo="ppo2"), "unknown algo 'ppo2'; choose one of: grpo, dapo"),
        (dict(task="sudoku"), "unknown task 'sudoku'; choose one of: linear"),
        (dict(overlong_max_len=20, overlong_cache_len=25), r"overlong_cache_len \(L_cache = 25\)"),
        (dict(supervision="reward-model"), "supervision must be one of"),
        (dict(algo="grpo", tau_pos=1.0), "'tau_pos': not a hyper-parameter of 'grpo'; accepted: eps_low"),
        (dict(temperature=0.0), "temperature"),
        (dict(top_p=1.5), "top_p"),
        (dict(minibatches=100, batch_size=64), "minibatches must be in"),
        (dict(max_gen_batches=0), "max_gen_batches"),
        (dict(lr=-1.0), "lr must be > 0"),
        (dict(beta=-0.1), "beta"),
        (dict(max_len=5, max_new_tokens=30), r"max_len \(5\) must be >= max_new_tokens"),
        (dict(device="tpu"), "device must be one of"),
    ],
)
def test_validation_errors_are_actionable(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**kwargs)


def test_saved_config_round_trips_and_file_loading(tmp_path):
    cfg = TrainConfig(algo="gspo", steps=7)
    again = TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"algo": "dapo", "lr": 1e-3}))
    loaded = TrainConfig.from_file(path, lr=5e-4)
    assert (loaded.algo, loaded.lr, loaded.eps_high) == ("dapo", 5e-4, 0.28)
    path.write_text(json.dumps({"algo": "dapo", "learning_rate": 1e-3}))
    with pytest.raises(ConfigError, match=r"unknown config field.*learning_rate"):
        TrainConfig.from_file(path)
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        TrainConfig.from_file(path)


def test_cli_flags_build_the_config(tmp_path, capsys):
    from engine.cli import main

    path = tmp_path / "c.json"
    path.write_text(json.dumps({"algo": "grpo", "lr": 1e-3, "eps_high": 0.25}))
    assert main(["train", "--config", str(path), "--eps-high", "0.3", "--no-scale-adv-by-std", "--print-config"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["algo"], out["lr"], out["eps_high"], out["scale_adv_by_std"]) == ("grpo", 1e-3, 0.3, False)
    assert main(["train", "--algo", "dapo", "--group-size", "1", "--print-config"]) == 2
    assert "group_size must be >= 2" in capsys.readouterr().err
    assert main(["train", "--resume", "nope", "--logs-dir", str(tmp_path)]) == 2
    assert "no run 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("task", ["linear", "chain"])
def test_sft_steps_default_to_the_tasks_own_and_are_saved_concrete(task):
    from engine.tasks import get_task

    cfg = TrainConfig(task=task)
    assert cfg.sft_steps == get_task(task, seed=0).sft_steps
    assert cfg.to_dict()["sft_steps"] == cfg.sft_steps  # the saved config names the number, not "task default"
    assert TrainConfig(task=task, sft_steps=7).sft_steps == 7
    assert TrainConfig.from_dict(cfg.to_dict()).sft_steps == cfg.sft_steps


# ---------------------------------------------------------------- everything derives from engine.objectives


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_every_registry_algorithm_is_a_train_choice_with_its_papers_loop_settings(algo, capsys):
    from engine.cli import build_parser, main
    from engine.config import LOOP_DEFAULTS
    from engine.objectives import OBJECTIVES

    assert main(["train", "--algo", algo, "--print-config"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["algo"] == algo
    # Loop settings: the registry entry's own, the common defaults for the rest; nothing else decides them.
    preset = {**LOOP_DEFAULTS, **dict(OBJECTIVES[algo].loop)}
    assert {k: out[k] for k in preset} == preset
    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["train"].format_help().split())
    assert f"Choices: {', '.join(ALGORITHMS)}." in help_text


def test_objective_fields_are_every_knob_of_the_registry_and_config_fields():
    from engine.config import OBJECTIVE_FIELDS
    from engine.objectives import OBJECTIVES

    knobs = {name for o in OBJECTIVES.values() for name in o.defaults()}
    assert set(OBJECTIVE_FIELDS) == knobs
    assert knobs <= {f.name for f in knob_fields()}
    for o in OBJECTIVES.values():  # a paper's loop setting names a real field
        assert {k for k, _ in o.loop} <= {f.name for f in knob_fields()}


# ----------------------------------------------------------------------------- bad arguments fail before the warm start


def _tiny_flags(steps: int = 1) -> list[str]:
    from conftest import TINY

    flags = ["--steps", str(steps), "--eval-every", "0", "--no-progress"]
    for key, value in TINY.items():
        if key != "eval_every":
            flags += ["--" + key.replace("_", "-"), str(value)]
    return flags


@pytest.mark.parametrize(("args", "message"), [
    (["--run-name", "bad name"], r"invalid run name 'bad name': a run name is 1 to 100 characters"),
    (["--run-name", ""], r"invalid run name '': a run name is"),
    (["--resume", ""], r"invalid run name '': a run name is"),
    (["--resume", "../outside"], r"invalid run name '\.\./outside'"),
    (["--run-name", "taken"], r"run 'taken' already exists in .*; pick another name or resume it"),
    (["--resume", "taken", "--run-name", "other"], r"--run-name 'other' with --resume 'taken': a resumed run keeps"),
    (["--resume", "damaged"], r"cannot resume 'damaged': .*run.json is unreadable"),
    (["--run-name", "ok", "--threads", "-1"], r"--threads must be >= 0 \(0: automatic\), got -1"),
    (["--run-name", "ok", "--warm-start-threads", "-2"], r"--warm-start-threads must be >= 0"),
    (["--run-name", "ok", "--warm-start-progress", "{tmp}/missing/p.json"], r"give a file in an existing folder"),
    (["--run-name", "ok", "--cache-dir", "{tmp}/a-file"], r"--cache-dir .*a-file is a file, not a folder"),
    (["--run-name", "ok", "--logs-dir", "{tmp}/a-file"], r"--logs-dir .*a-file is a file, not a folder"),
], ids=["bad-name", "empty-name", "empty-resume", "resume-outside", "existing-name", "renamed-resume",
        "damaged-resume", "threads", "warm-threads", "progress-folder", "cache-file", "logs-file"])
def test_train_rejects_bad_arguments_before_the_warm_start(tmp_path, monkeypatch, capsys, args, message):
    """Each of these used to be noticed only after the warm start (minutes on the default model), silently ignored
    ('' as no name), or read a run outside the logs folder. Now: exit code 2, one clear line, nothing trained,
    nothing created, nothing read outside the logs folder."""
    from engine.cli import main
    from engine.config import TrainConfig
    from engine.runlog import RunWriter

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)  # the CLI sets it for its process
    logs, cache = tmp_path / "logs", tmp_path / "cache"
    RunWriter.create(logs, "taken", config={}).close()
    (logs / "damaged").mkdir()
    (logs / "damaged" / "run.json").write_text('{"config": ')  # cut short
    (tmp_path / "a-file").write_text("not a folder")
    # a run folder outside the logs folder, which `--resume ../outside` must not read
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "run.json").write_text(json.dumps({"config": TrainConfig(steps=1).to_dict()}))
    args = [a.format(tmp=tmp_path) for a in args]
    before = sorted(p.name for p in logs.iterdir())

    code = main(["train", "--logs-dir", str(logs), "--cache-dir", str(cache), *_tiny_flags(), *args])

    assert code == 2
    assert re.search(message, capsys.readouterr().err.splitlines()[-1])
    assert not cache.exists()  # no warm start was built
    assert sorted(p.name for p in logs.iterdir()) == before  # no run was created


@pytest.mark.parametrize(("args", "message"), [
    (["--threads", "-1"], r"--threads must be >= 0"),
    (["--progress-file", "{tmp}/missing/p.json"], r"--progress-file .*: give a file in an existing folder"),
])
def test_warmstart_rejects_bad_arguments_before_training(tmp_path, monkeypatch, capsys, args, message):
    from engine.cli import main

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    cache = tmp_path / "cache"
    flags = [f for f in _tiny_flags() if f != "--no-progress"]
    code = main(["warmstart", "--cache-dir", str(cache), *flags, *[a.format(tmp=tmp_path) for a in args]])
    assert code == 2
    assert re.search(message, capsys.readouterr().err.splitlines()[-1])
    assert not cache.exists()


@pytest.mark.parametrize("command", ["train", "warmstart"])
def test_train_and_warmstart_threads_wait_passively(command):
    """OpenMP reads its wait policy once, when torch loads it: the CLI must set it before building its parser
    (which imports torch through engine.config), or the threads spin and a busy core slows training tenfold.
    GNU OpenMP (torch's on Linux) prints its settings with OMP_DISPLAY_ENV."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | {"OMP_DISPLAY_ENV": "VERBOSE"}
    done = subprocess.run([sys.executable, "-m", "engine.cli", command, "--help"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "GOMP_SPINCOUNT = '0'" in done.stderr, done.stderr[-3000:]
