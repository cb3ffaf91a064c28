"""docs/adding-an-algorithm.md, done once: a registry entry made of existing switches is an algorithm everywhere."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from engine import algorithms, objectives
from engine.config import TrainConfig, field_docs

DOC = Path(__file__).resolve().parents[1] / "docs" / "adding-an-algorithm.md"


def test_one_registry_entry_is_a_trainable_algorithm(monkeypatch, capsys):
    from engine.cli import main

    entry = algorithms.Objective(
        name="grpo_higher", doc="GRPO with DAPO's clip-higher and no KL (a test entry).", ratio_level="token",
        surrogate="ppo-clip", aggregation="seq-mean-token-mean", eps_low=0.2, eps_high=0.28, beta=0.0,
        loop=(("epochs", 3),))
    monkeypatch.setitem(algorithms.OBJECTIVES, entry.name, entry)
    for module in (algorithms, objectives):  # ALGORITHMS = tuple(OBJECTIVES), as the registry builds it
        monkeypatch.setattr(module, "ALGORITHMS", (*algorithms.ALGORITHMS, entry.name))

    cfg = TrainConfig(algo="grpo_higher")
    assert (cfg.eps_low, cfg.eps_high, cfg.beta, cfg.epochs, cfg.minibatches) == (0.2, 0.28, 0.0, 3, 2)
    assert main(["train", "--algo", "grpo_higher", "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["eps_high"] == 0.28
    assert "grpo_higher 0.28" in field_docs()["eps_high"]  # --help lists its preset

    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 6, generator=g, dtype=torch.float64) - 0.1
    logp = old + 0.3 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    adv, mask = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64), torch.ones(4, 6, dtype=torch.float64)
    new = objectives.policy_loss("grpo_higher", logp, old, adv, mask)
    same = objectives.policy_loss("grpo", logp, old, adv, mask, eps_high=0.28, beta=0.0)
    torch.testing.assert_close(new.loss, same.loss)
    torch.testing.assert_close(new.grad_weight, same.grad_weight)
    assert bool((new.clip == 2).any())  # r > 1.28 with A > 0 happens in this batch: the entry's range acted


def test_the_how_to_names_files_that_exist():
    root = DOC.parents[1]
    paths = set(re.findall(r"`((?:engine|tests|docs)/[\w/.-]+\.(?:py|md))`", DOC.read_text()))
    assert {"engine/algorithms.py", "engine/objectives.py", "engine/config.py"} <= paths
    assert [p for p in sorted(paths) if not (root / p).exists()] == []


def test_the_registry_imports_without_torch():
    import subprocess
    import sys

    code = ("import sys, engine.algorithms, engine.clip_codes; from engine.config import field_docs; field_docs(); "
            "sys.exit('torch' in sys.modules)")
    root = Path(__file__).resolve().parents[1]
    assert subprocess.run([sys.executable, "-c", code], cwd=root, env={"PYTHONPATH": str(root)}).returncode == 0
