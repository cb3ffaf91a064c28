"""Loading an untrusted `torch.save` file at the speed of Python's C unpickler, building nothing but data.

`torch.load(weights_only=True)` is safe but unpickles in pure Python: on slime's debug dumps, whose per-token values
are pickled Python lists, it runs about ten times slower than the C unpickler. `load_dump` first tries the C
unpickler with a smaller allow-list than torch's weights-only one, and falls back to `torch.load(weights_only=True)`
for anything outside it, so every file that loads, loads to what the weights-only loader would have returned, and
every file it refuses is refused with torch's own message.

Why the fast path runs no code of the file:
- A pickle can call or instantiate only what `find_class` returns: here `collections.OrderedDict` and a checked
  `torch._utils._rebuild_tensor_v2` (a tensor over a storage of the archive, no backward hooks). Storage types are
  resolved by `torch.load` itself before `find_class`, as in its weights-only path. Both names are on torch's
  weights-only allow-list; anything else (`builtins.eval`, `os.system`, `_codecs.encode` for bytes, ...) raises
  `RefusedGlobal`, and the file goes to the weights-only loader, which refuses or handles it.
- A TorchScript archive would make `torch.load(weights_only=False)` hand the file to `torch.jit.load`: such a file
  is refused before any loading, as the weights-only loader refuses it.
- `load_dump` reads from an open file object, never a path, so torch.load's by-name dispatch (`.safetensors`) never
  applies, and `mmap=False`.

`leading_items` reads a dump's first top-level keys without loading it: the opcodes, not the objects.
"""

from __future__ import annotations

import pickle
import pickletools
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any


class RefusedGlobal(pickle.UnpicklingError):
    """The pickle names a global the fast path does not build."""


def _rebuild_tensor(storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata=None):
    """`torch._utils._rebuild_tensor_v2` for a tensor without hooks or metadata, as a dump's are: the view over the
    storage (whose bounds torch checks), without v2's fake-tensor restoring (a tenth of a dump's load)."""
    from torch._utils import _rebuild_tensor

    if backward_hooks or metadata:  # hooks are callables: a dump has none; metadata goes to the careful loader
        raise RefusedGlobal("a tensor with backward hooks or metadata")
    tensor = _rebuild_tensor(storage, storage_offset, size, stride)
    tensor.requires_grad = requires_grad
    return tensor


_ALLOWED = {("collections", "OrderedDict"): OrderedDict, ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor}


class Unpickler(pickle.Unpickler):
    """The C unpickler; `find_class` returns only what `_ALLOWED` holds."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[module, name]
        except KeyError:
            raise RefusedGlobal(f"global {module}.{name} is not built by the fast loader") from None


def load(file, **kwargs) -> Any:
    """`pickle.load` with the restricted `Unpickler` (torch.load calls it for the legacy, non-zip format)."""
    return Unpickler(file, **kwargs).load()


def _is_torchscript(file) -> bool:
    import torch

    if not torch.serialization._is_zipfile(file):
        return False
    # torch.load's own test (serialization._is_torchscript_zip), with its own zip reader, so both agree on the file
    return "constants.pkl" in torch._C.PyTorchFileReader(file).get_all_records()


def load_dump(path: Path) -> Any:
    """What `torch.load(path, map_location="cpu", weights_only=True)` returns, and raises, faster on plain data."""
    import sys

    import torch

    with open(path, "rb") as file:
        if _is_torchscript(file):  # a program, not data: torch.load(weights_only=True) refuses it too
            raise pickle.UnpicklingError("a TorchScript archive (a program), which weights_only loading refuses")
        file.seek(0)
        try:  # weights_only=False only with this module as the unpickler: see the module's docstring
            return torch.load(file, map_location="cpu", weights_only=False, mmap=False,
                              pickle_module=sys.modules[__name__])
        except Exception:  # outside the fast path (or damaged): the weights-only loader decides and reports
            pass
    return torch.load(path, map_location="cpu", weights_only=True)


_STRINGS = {"BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8"}
_SCALARS = {"BININT", "BININT1", "BININT2", "LONG1", "NONE", "NEWTRUE", "NEWFALSE", "BINFLOAT", *_STRINGS}
_CONSTANTS = {"NEWTRUE": True, "NEWFALSE": False}  # opcodes whose value is the opcode itself
_CONTAINERS = {"EMPTY_LIST": list, "EMPTY_DICT": dict}
_MEMO = {"BINPUT", "LONG_BINPUT", "MEMOIZE"}


def leading_items(path: Path, most: int = 64) -> dict[str, Any] | None:
    """The items of the dict a `torch.save` archive holds, up to and including its first container value (given
    as `list` or `dict`, its contents unread), read from the opcodes of the archive's pickle; None when the file
    is not an archive of a dict starting that way within `most` items. Only the archive's directory and the first
    opcodes are read, nothing is built: a first look at which dump a file is, at the same cost for a 10 MB and a
    10 GB dump. It can be fooled (a tuple of strings before the first list); the full load has the last word."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if n.count("/") == 1 and n.endswith("/data.pkl")]
            if len(names) != 1:
                return None
            with archive.open(names[0]) as stream:
                ops = ((op.name, arg) for op, arg, _ in pickletools.genops(stream) if op.name not in _MEMO)
                if next(ops, (None,))[0] != "PROTO" or next(ops, (None,))[0] != "EMPTY_DICT":
                    return None
                items: dict[str, Any] = {}
                for _ in range(most):
                    name, key = next(ops, (None, None))
                    if name == "MARK":
                        name, key = next(ops, (None, None))
                    value_op, value = next(ops, (None, None))
                    if name not in _STRINGS or value_op not in _SCALARS | _CONTAINERS.keys():
                        return None
                    items[key] = _CONTAINERS.get(value_op, _CONSTANTS.get(value_op, value))
                    if value_op in _CONTAINERS:
                        return items
                return None
    except Exception:  # anything unreadable: the full load decides and reports
        return None
