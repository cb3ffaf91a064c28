"""Token ids stored once per run and text (engine.runlog.derived.TokenVocabulary): rank 0's writer leaves out the id
of a token row whose id is its text's, writes the step's (text, id) pairs to `token_vocab`, and the `tokens` view
gives every id back; merges keep each text once, resuming and truncating keep the pairs consistent, other ranks
store their ids, and a damaged vocabulary file costs only its folder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from engine.runlog import RunReader, RunWriter, data_dir_of
from engine.runlog.derived import ID_FROM_VOCABULARY, TOKEN_ROWS
from engine.runlog.layout import scan_segments

# (token_id, token_text) of one rollout per step. "é" decodes from two ids (pieces of one character, as byte-level
# tokenizers give): the smaller id logged first becomes the run's, the other keeps its id in the row. A token
# without an id, one without a text and a negative id are stored as given.
STEPS = {
    0: [(7, "a"), (3, "é"), (9, "é"), (7, "a"), (None, "b"), (4, None)],
    1: [(9, "é"), (7, "a"), (5, "c"), (-2, "d"), (3, "é")],
    2: [(5, "c"), (8, "a"), (11, "e"), (7, "a")],
}
# each text's id: its smallest id in the first step that logged it
RUN_IDS = {"a": 7, "é": 3, "c": 5, "e": 11}


def _tokens(pairs) -> dict:
    return {"rollout_id": [0] * len(pairs), "position": list(range(len(pairs))),
            "token_id": [i for i, _ in pairs], "token_text": [t for _, t in pairs]}


def _log(writer: RunWriter, steps) -> None:
    for step in steps:
        writer.log_step(step, tokens=_tokens(STEPS[step]))


def _read_ids(reader: RunReader, table: str = "tokens") -> dict[int, list]:
    _, rows = reader.rows(f"SELECT step, token_id FROM {table} ORDER BY step, rollout_id, position")
    by_step: dict[int, list] = {}
    for step, token_id in rows:
        by_step.setdefault(step, []).append(token_id)
    return by_step


def _given(step: int) -> list:
    return [i for i, _ in STEPS[step]]


def test_ids_are_stored_once_per_text_and_read_back(tmp_path):
    with RunWriter.create(tmp_path, "v", compact_every=0) as writer:
        _log(writer, [0, 1, 2])
    reader = RunReader(tmp_path)
    assert _read_ids(reader) == {s: _given(s) for s in STEPS}
    for segment in sorted(scan_segments(data_dir_of(tmp_path / "v")), key=lambda s: s.first):
        step = segment.first
        stored = pq.read_table(f"{segment.path}/tokens.parquet").to_pydict()
        left_out = [t is not None and i is not None and RUN_IDS.get(t) == i for i, t in STEPS[step]]
        ids = [i for i, _ in STEPS[step]]
        assert [i is None for i in stored["token_id"]] == [lo or i is None for lo, i in zip(left_out, ids, strict=True)]
        assert [(e & ID_FROM_VOCABULARY) != 0 for e in stored["elided"]] == left_out
        pairs = pq.read_table(f"{segment.path}/token_vocab.parquet").to_pydict()
        used = sorted({(RUN_IDS[t], t) for (i, t), lo in zip(STEPS[step], left_out, strict=True) if lo})
        assert list(zip(pairs["token_id"], pairs["token_text"], strict=True)) == used  # sorted by id
    # the rows without the join: the ids left out are NULL, every other column as in the view
    rows = _read_ids(reader, TOKEN_ROWS)
    assert rows == {s: [None if RUN_IDS.get(t) == i and i is not None else i for i, t in STEPS[s]] for s in STEPS}


def test_a_merged_chunk_keeps_each_text_once_and_every_id(tmp_path):
    with RunWriter.create(tmp_path, "v", compact_every=3) as writer:
        _log(writer, [0, 1, 2])
    (chunk,) = scan_segments(data_dir_of(tmp_path / "v"))
    pairs = pq.read_table(f"{chunk.path}/token_vocab.parquet").to_pydict()
    assert sorted(pairs["token_text"]) == sorted(RUN_IDS)  # each text once, with the step that first had it
    assert dict(zip(pairs["token_text"], pairs["step"], strict=True)) == {"a": 0, "é": 0, "c": 1, "e": 2}
    assert _read_ids(RunReader(tmp_path)) == {s: _given(s) for s in STEPS}


def test_resuming_keeps_the_run_s_ids_and_truncating_forgets_the_deleted_steps_ids(tmp_path):
    with RunWriter.create(tmp_path, "v", compact_every=0) as writer:
        _log(writer, [0, 1])
    with RunWriter.resume(tmp_path, "v", compact_every=0) as writer:
        _log(writer, [2])  # "a" with id 8 is not the run's "a": stored; "e" is new
    reader = RunReader(tmp_path)
    assert _read_ids(reader) == {s: _given(s) for s in STEPS}
    step2 = next(s for s in scan_segments(data_dir_of(tmp_path / "v")) if s.first == 2)
    assert pq.read_table(f"{step2.path}/tokens.parquet")["token_id"].to_pylist() == [None, 8, None, None]
    # From a checkpoint at step 0: step 1 (where "c" first came, id 5) is deleted, and "c" logged again with
    # another id becomes the run's with that id (left out of the row, like "a").
    with RunWriter.resume(tmp_path, "v", truncate_after=0, compact_every=0) as writer:
        writer.log_step(1, tokens=_tokens([(6, "c"), (7, "a")]))
    assert _read_ids(RunReader(tmp_path)) == {0: _given(0), 1: [6, 7]}
    step1 = next(s for s in scan_segments(data_dir_of(tmp_path / "v")) if s.first == 1)
    assert pq.read_table(f"{step1.path}/tokens.parquet")["token_id"].to_pylist() == [None, None]


def test_other_ranks_store_their_ids(tmp_path):
    with RunWriter.create(tmp_path, "v", compact_every=0) as rank0:
        rank1 = RunWriter.create(tmp_path, "v", rank=1, compact_every=0)
        rank0.log_step(0, tokens=_tokens(STEPS[0]))
        rank1.log_step(0, tokens={**_tokens(STEPS[1]), "rollout_id": [1] * len(STEPS[1])})
        rank1.close()
    ranks = {s.rank: s for s in scan_segments(data_dir_of(tmp_path / "v"))}
    assert pq.read_table(f"{ranks[1].path}/tokens.parquet")["token_id"].to_pylist() == _given(1)
    assert not Path(ranks[1].path, "token_vocab.parquet").exists()
    assert _read_ids(RunReader(tmp_path)) == {0: _given(0) + _given(1)}


def test_a_damaged_vocabulary_file_costs_only_its_folder(tmp_path):
    with RunWriter.create(tmp_path, "v", compact_every=0) as writer:
        writer.log_step(0, tokens=_tokens([(7, "a"), (5, "c")]))
        writer.log_step(1, tokens=_tokens([(7, "a"), (11, "e")]))
    step0 = next(s for s in scan_segments(data_dir_of(tmp_path / "v")) if s.first == 0)
    Path(step0.path, "token_vocab.parquet").write_bytes(b"not parquet")
    reader = RunReader(tmp_path)
    assert any("token_vocab.parquet" in p for p in reader.problems)
    ids = _read_ids(reader)
    assert ids[1] == [7, 11]  # step 1's folder holds its own pairs
    assert ids[0] == [7, None]  # "a" is in step 1's pairs too; "c" only in the damaged file
    # and the writer resumed over it goes on
    with RunWriter.resume(tmp_path, "v", compact_every=0) as writer:
        writer.log_step(2, tokens=_tokens([(5, "c"), (7, "a")]))
    assert _read_ids(RunReader(tmp_path))[2] == [5, 7]


def test_the_vocabulary_is_what_makes_the_ids_cheap(tmp_path):
    """A run of one real-sized step: 200k token rows over 5,000 texts store each id once, not once a row."""
    rng = np.random.default_rng(0)
    ids = rng.zipf(1.3, 200_000) % 5_000
    texts = [f"t{i}" for i in ids]
    with RunWriter.create(tmp_path, "v", compact_every=0) as writer:
        writer.log_step(0, tokens={"rollout_id": np.arange(200_000) // 1000, "position": np.arange(200_000) % 1000,
                                   "token_id": ids, "token_text": texts})
    (segment,) = scan_segments(data_dir_of(tmp_path / "v"))
    stored = pq.read_table(f"{segment.path}/tokens.parquet")
    assert stored["token_id"].null_count == 200_000
    assert pq.read_table(f"{segment.path}/token_vocab.parquet").num_rows == len(set(ids.tolist()))
    back = RunReader(tmp_path).sql("SELECT token_id FROM tokens ORDER BY rollout_id, position").token_id
    np.testing.assert_array_equal(back.to_numpy(), ids)
