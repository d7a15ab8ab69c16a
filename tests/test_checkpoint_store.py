"""LocalCheckpointStore and the checkpoint byte encoding (DESIGN.md invariant 4)."""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from gpu_worker.checkpoint import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointMissing,
    CheckpointRef,
    CheckpointStore,
    LocalCheckpointStore,
    decode_state,
    encode_state,
)


class Opaque:
    """A class that ``torch.load(weights_only=True)`` refuses to rebuild."""


def all_files(root: Path) -> list[Path]:
    return sorted(path for path in root.rglob("*") if path.is_file())


def test_put_get_round_trip(tmp_path: Path) -> None:
    store = LocalCheckpointStore(tmp_path)
    assert isinstance(store, CheckpointStore)
    data = os.urandom(100_000)
    ref = store.put(data)
    assert ref == CheckpointRef(ref=hashlib.sha256(data).hexdigest(), size=100_000)
    assert store.exists(ref.ref)
    assert store.get(ref.ref) == data
    assert store.path(ref.ref) == tmp_path / ref.ref[:2] / ref.ref
    empty = store.put(b"")
    assert empty.size == 0 and store.get(empty.ref) == b""


def test_writes_leave_no_temporary_files(tmp_path: Path) -> None:
    store = LocalCheckpointStore(tmp_path)
    refs = [store.put(f"checkpoint {i}".encode()) for i in range(20)]
    assert all_files(tmp_path) == sorted(store.path(ref.ref) for ref in refs)


def test_failed_write_leaves_no_object_and_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalCheckpointStore(tmp_path)
    data = b"never stored"

    def refuse(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="disk full"):
        store.put(data)
    monkeypatch.undo()
    assert all_files(tmp_path) == []
    assert not store.exists(hashlib.sha256(data).hexdigest())


def test_same_bytes_same_ref_and_a_second_put_is_a_no_op(tmp_path: Path) -> None:
    store = LocalCheckpointStore(tmp_path)
    first = store.put(b"same bytes")
    before = store.path(first.ref).stat()
    second = store.put(b"same bytes")
    assert second == first
    after = store.path(first.ref).stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert store.put(b"other bytes").ref != first.ref


def test_corrupted_object_raises_on_get_and_put_repairs_it(tmp_path: Path) -> None:
    store = LocalCheckpointStore(tmp_path)
    data = encode_state({"weights": torch.arange(1000, dtype=torch.float32)})
    ref = store.put(data).ref
    path = store.path(ref)
    flipped = bytearray(path.read_bytes())
    flipped[len(flipped) // 2] ^= 0x01
    path.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointCorrupt) as caught:
        store.get(ref)
    assert caught.value.ref == ref
    assert caught.value.actual == hashlib.sha256(flipped).hexdigest()
    assert isinstance(caught.value, CheckpointError)
    assert store.put(data).ref == ref
    assert store.get(ref) == data


def test_missing_object_raises_and_delete_is_idempotent(tmp_path: Path) -> None:
    store = LocalCheckpointStore(tmp_path)
    ref = store.put(b"to be deleted").ref
    store.delete(ref)
    assert not store.exists(ref)
    with pytest.raises(CheckpointMissing) as caught:
        store.get(ref)
    assert caught.value.ref == ref
    store.delete(ref)
    with pytest.raises(CheckpointMissing):
        LocalCheckpointStore(tmp_path / "absent").get(ref)


@pytest.mark.parametrize("bad", ["", "abc", "A" * 64, "g" * 64, "../" + "a" * 61])
def test_malformed_ref_is_rejected(tmp_path: Path, bad: str) -> None:
    store = LocalCheckpointStore(tmp_path)
    for call in (store.get, store.exists, store.delete):
        with pytest.raises(ValueError, match="ref must be a sha256 hex digest"):
            call(bad)


def test_encode_decode_round_trip() -> None:
    model = torch.nn.Linear(4, 3)
    state = {
        "format": 1,
        "model": model.state_dict(),
        "generator": torch.Generator().manual_seed(3).get_state(),
        "values": [1, 2.5, None, True, "text", (1, 2)],
    }
    decoded = decode_state(encode_state(state))
    assert decoded["format"] == 1
    assert decoded["values"] == [1, 2.5, None, True, "text", (1, 2)]
    assert torch.equal(decoded["generator"], state["generator"])
    assert isinstance(decoded["model"], OrderedDict)
    assert decoded["model"]._metadata == state["model"]._metadata
    for name, tensor in state["model"].items():
        assert torch.equal(decoded["model"][name], tensor)
    assert encode_state(decoded) == encode_state(state)


def test_equal_states_encode_to_equal_bytes_whatever_objects_they_share() -> None:
    key = "".join(["l", "r"])  # equal to "lr", but a distinct object
    shared = {"lr": 0.1, "groups": [{"lr": 0.1}], "pair": (1, 2)}
    distinct = {key: 0.1, "groups": [{"".join(["l", "r"]): 0.1}], "pair": (1, 2)}
    pair = (1, 2)
    aliased = {"lr": 0.1, "groups": [{"lr": 0.1}], "pair": pair, "again": pair}
    fresh = {"lr": 0.1, "groups": [{"lr": 0.1}], "pair": (1, 2), "again": (1, 2)}
    assert encode_state(shared) == encode_state(distinct)
    assert encode_state(aliased) == encode_state(fresh)


def test_decoding_garbage_raises_checkpoint_error() -> None:
    with pytest.raises(CheckpointError, match="cannot decode"):
        decode_state(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot decode"):
        decode_state(encode_state({"object": Opaque()}))
