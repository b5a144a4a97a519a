"""The torch VLM path (backends/torch/vlm.py) against transformers' own Qwen2-VL generate.

Same fixture, same image, same prompt, fp32 on both sides: our paged prefill (split inside the
image's token run, so the splice and the M-RoPE table are read across chunks) and eight greedy
decode steps (positions shifted by the prompt's M-RoPE delta) must give transformers' tokens,
with every step's logits within 1e-4. A text row batched with an image row in one forward
must decode exactly as it does alone.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from mlxcel.engine.backend import ForwardRow
from tests.conftest import fixture_path
from tests.fixtures import QWEN2_VL_TINY

ATOL = 1e-4
STEPS = 8


def picture(seed: int, h: int = 60, w: int = 90) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def vlm():
    from mlxcel.backends.torch.vlm import TorchVLMBackend
    from mlxcel.engine.tokenizer import Tokenizer
    from mlxcel.models.vision import VisionInput

    path = fixture_path(QWEN2_VL_TINY)
    backend = TorchVLMBackend(path, dtype="float32")
    tok = Tokenizer(path)
    return backend, tok, VisionInput(path, backend.info.config, tok.hf)


@pytest.fixture(scope="module")
def reference():
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration.from_pretrained(str(fixture_path(QWEN2_VL_TINY)),
                                                           dtype=torch.float32).eval()


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


def test_image_prompt_matches_transformers_generate(vlm, reference):
    backend, tok, vision = vlm
    full, enc, media = image_prompt(tok, vision, picture(0))
    start = full.index(vision.image_token_id)
    cut = start + 2  # inside the image's run: the splice and the positions continue across chunks
    seq = backend.new_sequence()
    seq.media = media
    [(tokens, logits)] = greedy(backend, [([full[:cut], full[cut:]], seq)])
    ids = torch.tensor([full])
    with torch.no_grad():
        ref = reference.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=enc.pixel_values,
                                 image_grid_thw=enc.grid_thw, mm_token_type_ids=(ids == vision.image_token_id).int(),
                                 max_new_tokens=STEPS, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
    assert tokens == ref.sequences[0, len(full):].tolist()
    for ours, theirs in zip(logits, ref.logits):
        np.testing.assert_allclose(ours, theirs[0].numpy(), atol=ATOL, rtol=0)
    assert seq.shift < 0  # text after the image runs at a shifted (compressed) position
    seq.release()


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


def test_image_token_budget_moves_the_token_count(vlm):
    from mlxcel.models.vision import ImageBudget, VisionInput

    backend, tok, _ = vlm
    path = fixture_path(QWEN2_VL_TINY)
    big = picture(3, 300, 400)
    counts = {}
    for lo, hi in ((None, None), (None, 8), (40, 48)):
        vision = VisionInput(path, backend.info.config, tok.hf, ImageBudget(lo, hi))
        counts[(lo, hi)] = vision.encode([big]).tokens[0]
    assert 48 < counts[(None, None)] <= 64  # the checkpoint's own max_pixels: 64 merged patches
    assert counts[(None, 8)] <= 8
    assert 40 <= counts[(40, 48)] <= 48
