"""Slot save files: b10621's filename rules, confinement under the save directory, the
format round trip and the model-identity binding."""

from __future__ import annotations

import os

import pytest

from mlxcel.api.llamacpp.slot_files import (
    MAGIC, SlotFileError, confined_path, fingerprint, read_slot, valid_filename, write_slot,
)


@pytest.mark.parametrize("name", ["slot1.bin", "a b.c", "état.bin", "x" * 255, ".hidden"])
def test_valid_names(name):
    assert valid_filename(name)


@pytest.mark.parametrize("name", [
    "", "x" * 256, "é" * 128, "a/b", "a\\b", "../x", "a..b", ".", "x.", " x", "x ", "a:b", "a*b", "a?b", 'a"b',
    "a<b", "a>b", "a|b", "a\x01b", "a\x7fb", "a\x85b", "a\uff0eb", "a\u2215b", "a\u2216b", "a\ufffdb", "a\ufeffb",
    "a\ud800b",
])
def test_invalid_names(name):
    assert not valid_filename(name)


def test_confinement_refuses_symlink_escapes(tmp_path):
    root = tmp_path / "slots"
    root.mkdir()
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"x")
    os.symlink(outside, root / "escape.bin")
    os.symlink(root / "inner.bin", root / "alias.bin")
    with pytest.raises(SlotFileError, match="Invalid filename"):
        confined_path(root, "escape.bin")
    with pytest.raises(SlotFileError, match="Invalid filename"):
        confined_path(root, "../outside.bin")
    assert confined_path(root, "alias.bin") == (root / "inner.bin").resolve()  # a link that stays inside resolves


def test_round_trip_is_atomic_and_bound_to_the_model(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    fp = fingerprint(tmp_path / "ckpt")
    path = tmp_path / "s.bin"
    n = write_slot(path, [1, 2, 70000], fingerprint=fp, model="m")
    assert path.read_bytes().startswith(MAGIC) and n == path.stat().st_size
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".slot-")] == []  # no temp file left
    assert read_slot(path, fingerprint=fp, n_vocab=100000) == ([1, 2, 70000], n)
    (tmp_path / "ckpt" / "tokenizer.json").write_text("{}")  # another tokenizer: another identity
    with pytest.raises(SlotFileError, match="another model or tokenizer"):
        read_slot(path, fingerprint=fingerprint(tmp_path / "ckpt"), n_vocab=100000)
    with pytest.raises(SlotFileError, match="outside the model's vocabulary"):
        read_slot(path, fingerprint=fp, n_vocab=1000)
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(SlotFileError, match="truncated"):
        read_slot(path, fingerprint=fp, n_vocab=100000)
    with pytest.raises(SlotFileError, match="cannot read"):
        read_slot(tmp_path / "missing.bin", fingerprint=fp, n_vocab=10)
