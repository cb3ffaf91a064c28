"""engine.importers.restricted_pickle: untrusted torch.save files loaded by the C unpickler with an allow-list,
compared with `torch.load(weights_only=True)`, and the files it must refuse without running anything."""

from __future__ import annotations

import os
import pickle
from collections import OrderedDict

import pytest
import torch
from token_dump_fixtures import make_samples, train_tokenizer, write_slime

from engine.importers import import_run, restricted_pickle, slime
from engine.importers.restricted_pickle import Unpickler, leading_items, load_dump


def _same(a, b) -> bool:
    """Equal values, types, dtypes, shapes and strides, recursively."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.shape, a.stride(), a.requires_grad) == (b.dtype, b.shape, b.stride(), b.requires_grad) \
            and torch.equal(a, b)
    return a == b or (a != a and b != b)  # NaN


@pytest.fixture
def loads(monkeypatch):
    """Every torch.load call's weights_only, in order."""
    calls, real = [], torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    return calls


def _plain_dump():
    base = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    return {"rollout_id": 7, "samples": [
        {"tokens": list(range(5)), "rollout_log_probs": [-0.5, float("nan"), -1e-30], "prompt": "deux × trois",
         "reward": {"acc": 1.0}, "status": None, "remove_sample": True, "big": 2**70, "neg": -3},
        {"tokens": torch.tensor([3, -1, 50_000]), "mask": torch.tensor([True, False]),
         "half": torch.tensor([0.5, -2.0], dtype=torch.float16), "bf16": torch.tensor([1.5], dtype=torch.bfloat16),
         "view": base.t()[1:], "shared": base, "column": base[:, 2], "scalar": torch.tensor(2.5),
         "trainable": torch.ones(2, requires_grad=True),
         "ordered": OrderedDict(b=1, a=2), "tuple": (1, "x")}]}


def test_a_dump_of_plain_data_loads_as_the_weights_only_loader_loads_it_on_the_fast_path(tmp_path, loads):
    path = tmp_path / "d.pt"
    torch.save(_plain_dump(), path)
    expected = torch.load(path, map_location="cpu", weights_only=True)
    loads.clear()
    got = load_dump(path)
    assert loads == [False]  # the fast path alone
    assert _same(got, expected)
    view, shared = got["samples"][1]["view"], got["samples"][1]["shared"]
    assert view.untyped_storage().data_ptr() == shared.untyped_storage().data_ptr()  # one storage, as saved


def test_what_the_fast_path_does_not_build_goes_to_the_weights_only_loader(tmp_path, loads):
    path = tmp_path / "d.pt"
    torch.save({"rollout_id": 1, "raw": b"\x00\xff bytes", "dtype": torch.float32}, path)  # _codecs.encode, dtype
    got = load_dump(path)
    assert loads == [False, True]
    assert _same(got, torch.load(path, weights_only=True))


class _MakesFolder:
    def __init__(self, folder):
        self.folder = str(folder)

    def __reduce__(self):
        return (os.makedirs, (self.folder,))


@pytest.mark.parametrize("archive", [True, False], ids=["torch.save", "plain pickle"])
def test_a_dump_that_would_run_code_is_refused_and_nothing_runs(tmp_path, loads, archive):
    folder, path = tmp_path / "made-by-the-dump", tmp_path / "d.pt"
    dump = {"rollout_id": 1, "samples": [_MakesFolder(folder)]}
    torch.save(dump, path) if archive else path.write_bytes(pickle.dumps(dump, protocol=2))
    with pytest.raises(pickle.UnpicklingError, match="weights_only"):
        load_dump(path)
    assert loads == [False, True] and not folder.exists()
    with pytest.raises(restricted_pickle.RefusedGlobal, match=r"(os|posix)\.makedirs"):
        torch.load(path, weights_only=False, pickle_module=restricted_pickle)


def test_the_unpickler_builds_only_its_two_globals():
    for module, name in [("builtins", "eval"), ("builtins", "getattr"), ("torch", "load"), ("torch._utils",
                          "_rebuild_parameter"), ("_codecs", "encode"), ("collections", "Counter")]:
        payload = pickle.PROTO + b"\x02" + b"c" + f"{module}\n{name}\n".encode() + pickle.STOP
        with pytest.raises(restricted_pickle.RefusedGlobal):
            Unpickler(__import__("io").BytesIO(payload)).load()


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
def test_a_torchscript_archive_never_reaches_torch_jit_load(tmp_path, monkeypatch, loads):
    path = tmp_path / "script.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), str(path))
    monkeypatch.setattr(torch.jit, "load", lambda *a, **k: pytest.fail("torch.jit.load was called"))
    with pytest.raises(pickle.UnpicklingError, match="TorchScript"):
        load_dump(path)
    assert loads == []


def test_leading_items_read_the_first_keys_up_to_the_first_container(tmp_path):
    cases = {
        "rollout": ({"rollout_id": 3, "samples": [{"a": 1}], "later": 1}, {"rollout_id": 3, "samples": list}),
        "train-v1": ({"rollout_id": -2, "rank": 1, "rollout_data": {"x": [1]}},
                     {"rollout_id": -2, "rank": 1, "rollout_data": dict}),
        "train-v2": ({"format_version": 2, "rollout_id": 2**40, "rank": 0, "note": "é", "ok": True, "f": 0.25,
                      "none": None, "samples": []},
                     {"format_version": 2, "rollout_id": 2**40, "rank": 0, "note": "é", "ok": True, "f": 0.25,
                      "none": None, "samples": list}),
        "container first": ({"samples": [], "rollout_id": 1}, {"samples": list}),
        "one key": ({"samples": [1, 2]}, {"samples": list}),
    }
    for name, (dump, items) in cases.items():
        torch.save(dump, tmp_path / f"{name}.pt")
        assert leading_items(tmp_path / f"{name}.pt") == items, name


@pytest.mark.parametrize("content", ["no container", "not a dict", "plain pickle", "damaged", "a tensor value"])
def test_leading_items_are_none_where_the_opcodes_do_not_say(tmp_path, content):
    path = tmp_path / "d.pt"
    if content == "no container":
        torch.save({"rollout_id": 1, "rank": 0}, path)
    elif content == "not a dict":
        torch.save([{"rollout_id": 1}], path)
    elif content == "plain pickle":
        path.write_bytes(pickle.dumps({"rollout_id": 1, "samples": []}, protocol=2))
    elif content == "damaged":
        torch.save({"rollout_id": 1, "samples": []}, path)
        path.write_bytes(path.read_bytes()[:60])
    else:
        torch.save({"rollout_id": torch.tensor(1), "samples": []}, path)
    assert leading_items(path) is None


def test_a_slime_import_loads_each_dump_once(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    train_tokenizer(tmp_path / "tok")
    folder = tmp_path / "slime"
    folder.mkdir()
    write_slime(folder, make_samples(AutoTokenizer.from_pretrained(str(tmp_path / "tok"), local_files_only=True)))
    loaded = []
    monkeypatch.setattr(slime, "load_dump", lambda path: loaded.append(path.name) or load_dump(path))
    report = import_run("slime", folder, tmp_path / "logs", "run")
    assert report.imported == [1, 2]
    # the damaged file is loaded once (to be reported); the evaluation dump never (its first keys suffice)
    assert sorted(loaded) == ["rollout_1.pt", "rollout_2.pt", "train_1_0.pt", "train_1_1.pt", "train_2_0.pt",
                              "train_3_0.pt"]


def test_first_keys_that_lie_about_the_dump_are_overruled_by_the_full_load(tmp_path):
    # a tuple of three before the samples reads, opcode by opcode, as more keys: a per-rank train dump
    folder = tmp_path / "slime"
    folder.mkdir()
    sample = {"group_index": 0, "index": 0, "tokens": [5, 6, 7], "response_length": 2, "reward": 1.0,
              "rollout_log_probs": [-0.25, -0.5]}
    torch.save({"rollout_id": 1, "meta": ("a", "rollout_data", {}), "samples": [sample]}, folder / "rollout_1.pt")
    assert leading_items(folder / "rollout_1.pt") == {"rollout_id": 1, "meta": "a", "rollout_data": dict}
    report = import_run("slime", folder, tmp_path / "logs", "run")
    assert report.imported == [1] and report.problems == []  # read as the rollout dump it is
