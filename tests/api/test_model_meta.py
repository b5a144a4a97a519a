"""The /v1/models meta block's checkpoint facts (api/openai/model_meta.py) and --tags parsing."""

from __future__ import annotations

import json
import struct

from mlxcel.api.openai.model_meta import VOCAB_BPE, VOCAB_SPM, VOCAB_UGM, VOCAB_WPM, checkpoint_meta, vocab_type
from mlxcel.cli.flags import parse_server_args

_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "U32": 4}


def write_safetensors(path, tensors: dict[str, tuple[str, list[int]]]) -> int:
    """A real safetensors file of zeros; returns its payload size in bytes."""
    header, offset = {"__metadata__": {"format": "mlx"}}, 0
    for name, (dtype, shape) in tensors.items():
        n = _BYTES[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
    return offset


def test_quantized_weights_unpack_by_their_declared_bits(tmp_path):
    # a 4-bit default with one 8-bit module: 64 x 128 logical weights each, scales/biases not counted
    config = {"vocab_size": 64, "hidden_size": 128, "max_position_embeddings": 512,
              "quantization": {"group_size": 64, "bits": 4, "model.head": {"group_size": 64, "bits": 8}}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    size = write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {
        "model.embed.weight": ("U32", [64, 16]), "model.embed.scales": ("BF16", [64, 2]),
        "model.embed.biases": ("BF16", [64, 2]), "model.norm.weight": ("BF16", [128])})
    size += write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {
        "model.head.weight": ("U32", [64, 32]), "model.head.scales": ("BF16", [64, 2]),
        "model.head.biases": ("BF16", [64, 2]), "model.head.bias": ("F32", [64])})
    meta = checkpoint_meta(tmp_path)
    assert meta["n_params"] == 64 * 128 + 128 + 64 * 128 + 64
    assert meta["size"] == size  # every payload byte, quantization data included
    assert (meta["n_vocab"], meta["n_embd"], meta["n_ctx_train"]) == (64, 128, 512)


def test_packed_weight_without_declared_bits_is_null_not_guessed(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    size = write_safetensors(tmp_path / "model.safetensors", {
        "w.weight": ("U32", [8, 1]), "w.scales": ("BF16", [8, 1])})
    meta = checkpoint_meta(tmp_path)
    assert meta["n_params"] is None and meta["size"] == size and meta["vocab_type"] is None


def test_text_config_and_missing_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 10, "hidden_size": 4}}))
    meta = checkpoint_meta(tmp_path)
    assert (meta["n_vocab"], meta["n_embd"], meta["n_params"], meta["size"]) == (10, 4, None, None)


def test_shape_keys_are_read_from_the_normalised_config(tmp_path):
    """DBRX names its context length max_seq_len; the meta block reads it as the backends load it."""
    config = {"model_type": "dbrx", "vocab_size": 10, "d_model": 4, "max_seq_len": 2048}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert (checkpoint_meta(tmp_path)["n_ctx_train"], checkpoint_meta(tmp_path)["n_embd"]) == (2048, 4)


def test_vocab_type_follows_the_tokenizer_algorithm(tmp_path):
    cases = {"bpe": ({"type": "BPE", "byte_fallback": False}, VOCAB_BPE),
             "spm": ({"type": "BPE", "byte_fallback": True}, VOCAB_SPM),
             "wpm": ({"type": "WordPiece"}, VOCAB_WPM), "ugm": ({"type": "Unigram"}, VOCAB_UGM),
             # not in tokenizers' own key order: the head scan misses it and the full parse answers
             "reordered": ({"byte_fallback": True, "vocab": {}, "type": "BPE"}, VOCAB_SPM)}
    for name, (model, want) in cases.items():
        d = tmp_path / name
        d.mkdir()
        (d / "tokenizer.json").write_text(json.dumps({"model": model}))
        assert vocab_type(d) == want, name
    sp = tmp_path / "sentencepiece"
    sp.mkdir()
    (sp / "tokenizer.model").write_bytes(b"\x00")
    assert vocab_type(sp) == VOCAB_SPM


def test_tags_are_a_sorted_set_from_flag_or_env():
    s = parse_server_args(["-m", "x", "--tags", "prod, b,,a", "--tags", "a,c"], {})
    assert s.source.tags == ["a", "b", "c", "prod"]  # b10621 inserts into a std::set
    assert parse_server_args(["-m", "x"], {"LLAMA_ARG_TAGS": "x,y"}).source.tags == ["x", "y"]
    assert parse_server_args(["-m", "x"], {}).source.tags == []


def test_unreadable_weights_are_reported_as_unknown(tmp_path):
    """A directory whose safetensors file is not one lists with null facts instead of failing."""
    from mlxcel.api.openai.model_meta import checkpoint_meta

    (tmp_path / "config.json").write_text('{"vocab_size": 10, "hidden_size": 4}')
    for body in (b"short", b"\xff" * 8 + b"{}", b"\x02\x00\x00\x00\x00\x00\x00\x00[]"):
        (tmp_path / "model.safetensors").write_bytes(body)
        meta = checkpoint_meta(tmp_path)
        assert meta["n_params"] is None and meta["size"] is None and meta["n_vocab"] == 10
