"""Import modules of verl 0.9.1 (installed with --no-deps by scripts/install.sh) to compare against their functions.

verl's packages import Ray, OmegaConf, TensorDict and its own workers at import time; the functions the tests call
(the policy losses of `verl/trainer/ppo/core_algos.py`, the helpers of `rollout_corr_helper.py`) use none of that.
`import_verl(name)` loads the module's own file with stand-ins for what it imports and does not use: verl's package
`__init__` files are skipped (each package becomes a namespace over its real folder) and the names listed in
STUBS are empty placeholders. A placeholder that is called raises, so a test cannot silently run on one.

    core = import_verl("verl.trainer.ppo.core_algos")
    loss, metrics = core.compute_policy_loss_gpg(old, logp, adv, mask, "token-mean", config)
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import pytest

VERL_VERSION = "0.9.1"

# module -> names it must offer (classes are empty placeholders, functions raise when called)
STUBS: dict[str, dict[str, str]] = {
    "verl": {},
    "verl.trainer": {},
    "verl.trainer.ppo": {},
    "verl.trainer.config": {"AlgoConfig": "class"},
    "verl.trainer.config.algorithm": {"RolloutCorrectionConfig": "class"},
    "verl.workers": {},
    "verl.workers.config": {"ActorConfig": "class"},
    "verl.workers.config.actor": {"PolicyLossConfig": "class", "ActorConfig": "class"},
    "verl.protocol": {"DataProto": "class"},
    "verl.utils": {"as_torch_index": "function", "group_mean_std": "function"},
    "verl.utils.device": {"get_device_name": "function", "get_torch_device": "function"},
    "tensordict": {"TensorDict": "class"},
    "omegaconf": {"DictConfig": "class", "OmegaConf": "class"},
}
"""Placeholders: modules verl's policy-loss code imports and does not use. Real modules win where installed
(omegaconf, tensordict); verl's own packages are namespaces over the real folders, so their real submodules load."""


def _placeholder_function(name: str):
    def call(*args: Any, **kwargs: Any):
        raise NotImplementedError(f"{name} is a test placeholder: the compared verl code should not call it")

    return call


def _install_stubs(root: Path) -> None:
    for module_name, names in STUBS.items():
        if module_name in sys.modules:
            continue
        if not module_name.startswith("verl") and importlib.util.find_spec(module_name) is not None:
            continue  # the real library is installed: use it
        module = types.ModuleType(module_name)
        folder = root.joinpath(*module_name.split(".")[1:]) if module_name.startswith("verl") else None
        if folder is not None and folder.is_dir():
            module.__path__ = [str(folder)]  # a namespace over the real folder, its __init__ not run
        for name, kind in names.items():
            setattr(module, name, type(name, (), {}) if kind == "class" else _placeholder_function(name))
        sys.modules[module_name] = module


def verl_root() -> Path | None:
    """The installed verl package folder, or None."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def import_verl(module_name: str):
    """The verl module `module_name` (e.g. "verl.trainer.ppo.core_algos"), loaded from its own file.

    Skips the calling test when verl is not installed (scripts/install.sh installs it; the comparison is the
    requirement, so CI runs it)."""
    if module_name in sys.modules and getattr(sys.modules[module_name], "__file__", None):
        return sys.modules[module_name]
    root = verl_root() if "verl" not in sys.modules else Path(sys.modules["verl"].__path__[0])
    if root is None:
        pytest.skip(f"verl=={VERL_VERSION} is not installed (scripts/install.sh installs it with --no-deps)")
    _install_stubs(root)
    return importlib.import_module(module_name)


class ActorSettings(dict):
    """The part of verl's ActorConfig its policy losses read: attributes, `.get` and `policy_loss.<knob>`."""

    def __init__(self, **values: Any):
        loss_knobs = values.pop("policy_loss", {})
        super().__init__(values)
        self.__dict__.update(values)
        self.policy_loss = types.SimpleNamespace(**loss_knobs)
        # one process: agg_loss's defaults (dp_size 1, the local token / sequence counts)
        self.global_batch_info = {}
