"""Import modules of verl 0.9.1 (the reference implementation some tests compare against) without verl's dependencies.

verl is installed in the test environment with `pip install --no-deps verl==0.9.1` (scripts/install.sh): its pure
tensor functions need only torch, but importing them pulls in ray, tensordict, omegaconf and verl's own config and
data-protocol modules. `import_verl(name)` imports the real module `name` and, in place of what it imports but the
compared functions never use, puts stubs:

- the top-level `verl` package is created empty (its `__init__` imports `verl.protocol`, hence ray, and loads plugins);
  every other verl package and module runs its real code;
- a third-party package of `THIRD_PARTY_STUBS` that is not installed becomes a stub module;
- each verl module or package of `STUBBED_VERL_MODULES` (plus `extra_stubs`), with everything under it, is a stub.

A stub module hands out a placeholder class for any attribute, so `from tensordict import TensorDict` and
`isinstance(x, AlgoConfig)` work; instantiating a placeholder raises, so a compared function that does use a stubbed
dependency fails loudly instead of computing something else.

    helper = import_verl("verl.trainer.ppo.rollout_corr_helper")
    core_algos = import_verl("verl.trainer.ppo.core_algos")
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
import types
from typing import Any

VERL_VERSION = "0.9.1"

# verl's hard dependencies that its tensor math does not use; stubbed only when absent from the environment
THIRD_PARTY_STUBS = ("ray", "tensordict", "omegaconf", "hydra", "codetiming", "pylatexenc", "wandb")

# verl modules imported at module level by the helpers we compare against, used only by functions we do not call
# (DataProto wrappers, config dataclasses built from OmegaConf): verl.protocol needs ray and tensordict, the config
# packages import omegaconf and each other's dataclasses
STUBBED_VERL_MODULES = ("verl.protocol", "verl.trainer.config", "verl.workers.config")


class _Placeholder:
    """A stubbed name: fine to import, subclass or isinstance-check; an error to instantiate."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError(
            f"{type(self).__module__}.{type(self).__name__} is a stub (tests/verl_reference.py): the verl code "
            "under test uses a dependency the test environment does not provide"
        )


class _StubModule(types.ModuleType):
    __all__ = ()  # `from stub import *` imports nothing

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        placeholder = type(name, (_Placeholder,), {"__module__": self.__name__})
        setattr(self, name, placeholder)
        return placeholder


class _VerlFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the empty top-level `verl` package and the stub modules; everything else is left to the normal path."""

    def __init__(self, verl_path: list[str], stubs: set[str]):
        self.verl_path = verl_path
        self.stubs = stubs

    def _stubbed(self, name: str) -> bool:
        if any(name == s or name.startswith(s + ".") for s in self.stubs):
            return True
        top = name.split(".")[0]
        return top in THIRD_PARTY_STUBS and importlib.machinery.PathFinder.find_spec(top) is None

    def find_spec(self, name, path, target=None):
        if name == "verl":
            return importlib.machinery.ModuleSpec(name, self, is_package=True, origin="verl-without-init")
        if self._stubbed(name):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        if spec.origin == "verl-without-init":
            return types.ModuleType(spec.name)
        return _StubModule(spec.name)

    def exec_module(self, module):
        if module.__spec__.origin == "verl-without-init":
            module.__path__ = list(self.verl_path)


_finder: _VerlFinder | None = None


def _install_finder(extra_stubs: tuple[str, ...]) -> None:
    global _finder
    try:
        installed = importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    if installed != VERL_VERSION:
        raise RuntimeError(
            f"the tests compare against verl {VERL_VERSION}, found {installed or 'no verl'}: install it with "
            f"`python -m pip install --no-deps verl=={VERL_VERSION}` (scripts/install.sh does)"
        )
    stray = sorted({f.parts[0] for f in importlib.metadata.distribution("verl").files or ()} & {"tests", "scripts"})
    if stray:
        raise RuntimeError(
            f"verl's wheel installed top-level {' and '.join(stray)} packages, which shadow this project's folders of "
            "the same name: run scripts/install.sh, which removes them"
        )
    if _finder is None:
        spec = importlib.util.find_spec("verl")
        if "verl" in sys.modules and not isinstance(getattr(sys.modules["verl"], "__path__", None), list):
            raise RuntimeError("a module named verl was imported before tests/verl_reference.py could set it up")
        _finder = _VerlFinder(list(spec.submodule_search_locations), set(STUBBED_VERL_MODULES))
        sys.meta_path.insert(0, _finder)
    new = set(extra_stubs) - _finder.stubs
    already = sorted(name for name in new if name in sys.modules)
    if already:
        raise RuntimeError(f"cannot stub {', '.join(already)}: already imported for real")
    _finder.stubs |= new


def import_verl(module_name: str, extra_stubs: tuple[str, ...] = ()) -> types.ModuleType:
    """The real verl module `module_name` (e.g. "verl.trainer.ppo.rollout_corr_helper"), imported with stubs for
    the dependencies its compared functions do not use; `extra_stubs`: more verl modules to stub."""
    if not (module_name == "verl" or module_name.startswith("verl.")):
        raise ValueError(f"{module_name!r} is not a verl module; accepted: 'verl.<package>.<module>'")
    _install_finder(tuple(extra_stubs))
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
