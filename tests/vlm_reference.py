"""transformers' own answer for a VLM fixture, image and prompt: what the torch VLM path
(tests/models/test_vlm_torch.py) and the served routes (tests/e2e/test_vlm_images.py) are held to."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def picture(seed: int, h: int = 60, w: int = 90) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


def png(seed: int) -> bytes:
    buf = io.BytesIO()
    picture(seed).save(buf, "PNG")
    return buf.getvalue()


def reference_model(path):
    import json

    import torch
    import transformers

    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    return getattr(transformers, arch).from_pretrained(str(path), dtype=torch.float32).eval()


def reference_inputs(vision, full: list[int], enc) -> dict:
    """What transformers' forward takes beside the ids: the image tensors, and the token types
    that switch on its multimodal RoPE or its bidirectional mask."""
    import torch

    ids = torch.tensor([full])
    extra = dict(enc.inputs[0])
    is_image = (ids == vision.image_token_id).int()
    if vision.family.mrope:
        extra["mm_token_type_ids"] = is_image
    if vision.family.bidirectional == "image":
        extra["token_type_ids"] = is_image.long()
    elif vision.family.bidirectional == "prefix":
        extra["token_type_ids"] = torch.zeros_like(ids)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), **extra}


def expected_chat_answer(path, image, question: str, max_tokens: int) -> tuple[str, int]:
    """(transformers' greedy answer, prompt tokens) for one user turn of image then question,
    rendered by the checkpoint's chat template as the server renders it."""
    import torch

    from mlxcel.engine.tokenizer import Tokenizer
    from mlxcel.models.vision import VisionInput

    import json

    model = reference_model(path)
    tok = Tokenizer(path)
    vision = VisionInput(path, json.loads((path / "config.json").read_text()), tok.hf)
    text = tok.hf.apply_chat_template([{"role": "user", "content": vision.placeholder + question}],
                                      tokenize=False, add_generation_prompt=True)
    enc = vision.encode([image])
    full = vision.expand(tok.hf.encode(text, add_special_tokens=False), enc)
    with torch.no_grad():
        out = model.generate(**reference_inputs(vision, full, enc), max_new_tokens=max_tokens, do_sample=False)
    return tok.hf.decode(out[0, len(full):], skip_special_tokens=True), len(full)
