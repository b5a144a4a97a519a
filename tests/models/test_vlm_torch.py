"""The torch VLM path (backends/torch/vlm.py) against transformers' own generate, per family.

Same fixture, same image, same prompt, fp32 on both sides, for every family in
models/vision_layouts.VISION_FAMILIES: our paged prefill (split inside the image's token run
where the family attends causally, so the splice and the position table are read across chunks;
after it where image tokens attend both ways; whole for PaliGemma's bidirectional prompt) and
four greedy decode steps (Qwen's positions shifted by the prompt's M-RoPE delta, PaliGemma's
counted from 1) must give transformers' tokens, with every step's logits within 1e-4; so must
the logits after two images between text. A text row batched with an image row in one forward
must decode exactly as it does alone.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from mlxcel.engine.backend import ForwardRow
from tests.conftest import fixture_path
from tests.fixtures import QWEN2_VL_TINY, VLM_TINY
from tests.vlm_reference import picture, reference_inputs, reference_model

ATOL = 1e-4
STEPS = 4


@functools.cache
def tokenizer(family: str):
    """One tokenizer per family for the module (the Qwen vocabulary takes seconds to load)."""
    from mlxcel.engine.tokenizer import Tokenizer

    return Tokenizer(fixture_path(VLM_TINY[family]))


@pytest.fixture(scope="module", params=sorted(VLM_TINY))
def vlm(request):
    from mlxcel.backends.torch.vlm import TorchVLMBackend
    from mlxcel.models.vision import VisionInput

    path = fixture_path(VLM_TINY[request.param])
    backend = TorchVLMBackend(path, dtype="float32")
    tok = tokenizer(request.param)
    return backend, tok, VisionInput(path, backend.info.config, tok.hf)


def image_prompt(tok, vision, image, question="What is in this picture?"):
    from mlxcel.backends.torch.vlm import media_for

    text = f"<|im_start|>user\n{vision.placeholder}{question}<|im_end|>\n<|im_start|>assistant\n"
    enc = vision.encode([image])
    full = vision.expand(tok.hf.encode(text, add_special_tokens=False), enc)
    return full, enc, media_for(full, enc)


def greedy(backend, rows):
    """Greedy-decode every (prompt chunks, seq) row together; per row: tokens and logits."""
    out = [([], []) for _ in rows]
    pending = [list(chunks) for chunks, _ in rows]
    while any(pending):  # prefill chunk by chunk, each row in its own forward
        for i, (_, seq) in enumerate(rows):
            if pending[i]:
                logits = backend.forward([ForwardRow(pending[i].pop(0), seq)])
                if not pending[i]:
                    out[i][0].append(int(logits[0].argmax()))
                    out[i][1].append(logits[0])
    for _ in range(STEPS - 1):
        logits = backend.forward([ForwardRow([toks[-1]], seq) for (toks, _), (_, seq) in zip(out, rows)])
        for i, row in enumerate(logits):
            out[i][0].append(int(row.argmax()))
            out[i][1].append(row)
    return out


def test_image_prompt_matches_transformers_generate(vlm):
    backend, tok, vision = vlm
    full, enc, media = image_prompt(tok, vision, picture(0))
    start = full.index(vision.image_token_id)
    # inside the image's run where attention is causal, after it where the image attends both
    # ways; PaliGemma's whole prompt attends both ways, so it is prefilled in one chunk
    cut = {"": start + 2, "image": len(full) - 3, "prefix": len(full)}[vision.family.bidirectional]
    seq = backend.new_sequence()
    seq.media = media
    [(tokens, logits)] = greedy(backend, [([c for c in (full[:cut], full[cut:]) if c], seq)])
    with torch.no_grad():
        ref = reference_model(backend.info.path).generate(**reference_inputs(vision, full, enc), max_new_tokens=STEPS,
                                          do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert tokens == ref.sequences[0, len(full):].tolist()
    for ours, theirs in zip(logits, ref.logits):
        np.testing.assert_allclose(ours, theirs[0].numpy(), atol=ATOL, rtol=0)
    if vision.family.mrope:
        assert seq.shift < 0  # text after the image runs at a shifted (compressed) position
    seq.release()


def _batched(family: str, inputs: list[dict]) -> dict:
    """Per-image processor outputs as transformers' forward takes several images: stacked, Idefics
    3's tiles along the image axis, Pixtral's pictures zero-padded to the largest."""
    if family == "idefics3":
        return {k: torch.cat([x[k] for x in inputs], dim=1) for k in inputs[0]}
    if family == "mistral3":
        h, w = (max(x["pixel_values"].shape[d] for x in inputs) for d in (-2, -1))
        pad = [torch.nn.functional.pad(x["pixel_values"], (0, w - x["pixel_values"].shape[-1], 0,
                                                           h - x["pixel_values"].shape[-2])) for x in inputs]
        return {"pixel_values": torch.cat(pad), "image_sizes": torch.cat([x["image_sizes"] for x in inputs])}
    return {k: torch.cat([x[k] for x in inputs]) for k in inputs[0]}


def test_two_images_between_text_match_transformers_forward(vlm):
    from mlxcel.backends.torch.vlm import media_for

    backend, tok, vision = vlm
    text = (f"<|im_start|>user\n{vision.placeholder}beside{vision.placeholder}What differs?<|im_end|>\n"
            "<|im_start|>assistant\n")
    enc = vision.encode([picture(0), picture(1, 80, 50)])
    full = vision.expand(tok.hf.encode(text, add_special_tokens=False), enc)
    seq = backend.new_sequence()
    seq.media = media_for(full, enc)
    ours = backend.forward([ForwardRow(full, seq)])[0]
    seq.release()
    inputs = reference_inputs(vision, full, enc)
    inputs.update(_batched(backend.info.model_type, enc.inputs))
    with torch.no_grad():
        theirs = reference_model(backend.info.path)(**inputs).logits[0, -1].numpy()
    np.testing.assert_allclose(ours, theirs, atol=ATOL, rtol=0)


def test_the_image_reaches_the_model(vlm):
    backend, tok, vision = vlm
    firsts = []
    for seed in (0, 1):
        full, _, media = image_prompt(tok, vision, picture(seed))
        seq = backend.new_sequence()
        seq.media = media
        firsts.append(backend.forward([ForwardRow(full, seq)])[0])
        seq.release()
    assert float(np.abs(firsts[0] - firsts[1]).max()) > 1e-2


def test_text_row_batches_with_an_image_row(vlm):
    backend, tok, vision = vlm
    text = tok.hf.encode("<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n",
                         add_special_tokens=False)
    full, _, media = image_prompt(tok, vision, picture(2))

    def fresh(m=None):
        seq = backend.new_sequence()
        seq.media = m
        return seq

    alone_text = greedy(backend, [([text], fresh())])[0]
    alone_image = greedy(backend, [([full], fresh(media))])[0]
    _, _, media2 = image_prompt(tok, vision, picture(2))
    both = greedy(backend, [([text], fresh()), ([full], fresh(media2))])
    assert both[0][0] == alone_text[0] and both[1][0] == alone_image[0]
    for a, b in zip(both[0][1] + both[1][1], alone_text[1] + alone_image[1]):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)


def _counts(family: str, budgets, image) -> dict:
    """Image tokens of `image` under each (min, max) budget, from the family's processor."""
    import json

    from mlxcel.models.vision import ImageBudget, VisionInput

    path = fixture_path(VLM_TINY[family])
    config, tok = json.loads((path / "config.json").read_text()), tokenizer(family)
    return {b: VisionInput(path, config, tok.hf, ImageBudget(*b)).encode([image]).tokens[0] for b in budgets}


def test_image_token_budget_moves_the_token_count_between_pixel_bounds():
    counts = _counts("qwen2_vl", [(None, None), (None, 8), (40, 48)], picture(3, 300, 400))
    assert 48 < counts[(None, None)] <= 64  # the checkpoint's own max_pixels: 64 merged patches
    assert counts[(None, 8)] <= 8
    assert 40 <= counts[(40, 48)] <= 48


@pytest.mark.parametrize("family, most", [("mistral3", 1), ("idefics3", 10)])
def test_a_maximum_bounds_a_longest_edge_processor(family, most):
    counts = _counts(family, [(None, None), (None, most)], picture(4, 300, 400))
    assert counts[(None, most)] <= most < counts[(None, None)]


@pytest.mark.parametrize("family, budget, refusal", [
    ("llava", (None, 8), "fixed geometry, so --image-max-tokens"),
    ("gemma3", (16, None), "fixed geometry, so --image-min-tokens"),
    ("mistral3", (16, None), "bounds only the long side"),
    ("idefics3", (None, 3), "at least 4"),
])
def test_a_budget_the_processor_cannot_take_is_refused_naming_the_flag(family, budget, refusal):
    from mlxcel.models.vision import BudgetRefused

    with pytest.raises(BudgetRefused, match=refusal):
        _counts(family, [budget], picture(5))


def test_qwen2_vl_is_one_of_the_families():
    assert VLM_TINY["qwen2_vl"] == QWEN2_VL_TINY
