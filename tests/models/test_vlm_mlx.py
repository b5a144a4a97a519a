"""Vision-language families on the MLX backend (backends/mlx/vlm.py), one row per family it serves.

Per family, fp32 on the CPU: the language logits of an image prompt, prefilled in two chunks
split inside the image's token run, equal transformers' forward of the whole prompt (its vision
tower, projector and M-RoPE) within 1e-4; Gemma 3's image tokens see each other both ways, as
transformers' do given token_type_ids. Through the real engine (qwen2_vl): an image row
and text-only rows share forwards and each answers as it does alone; a repeated image skips
the vision tower (feature cache); the prefix cache resumes a repeated image prompt and stops at
the image when only the picture differs.
"""

from __future__ import annotations

import asyncio

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from mlxcel.engine.engine import Engine
from mlxcel.engine.sampling_params import SamplingParams
from mlxcel.engine.types import GenerationRequest
from mlxcel.models.vision_mlx import MLX_VLM_MODULES
from tests.conftest import fixture_path
from tests.fixtures import VLM_TINY

ATOL = 1e-4
FAMILIES = sorted(MLX_VLM_MODULES)
pytestmark = pytest.mark.timeout(120)


def picture(seed: int, h: int = 60, w: int = 90) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


class Loaded:
    def __init__(self, family: str) -> None:
        from mlxcel.backends.mlx.vlm import MLXVLMBackend, media_for
        from mlxcel.engine.tokenizer import Tokenizer
        from mlxcel.models.vision import VisionInput

        mx.set_default_device(mx.cpu)
        self.path = path = fixture_path(VLM_TINY[family])
        self.backend = MLXVLMBackend(path, dtype="float32")
        self.tok = Tokenizer(path)
        self.vision = VisionInput(path, self.backend.info.config, self.tok.hf,
                                  media=media_for(self.backend.image_token_id), tensors="np")

    def prompt(self, image: Image.Image | None, question: str = "What is in this picture?"):
        """(expanded prompt ids, encoded images, media payload); text only without an image."""
        user = (self.vision.placeholder if image is not None else "") + question
        text = self.tok.hf.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                               tokenize=False)
        ids = self.tok.hf.encode(text, add_special_tokens=False)
        if image is None:
            return ids, None, None
        enc = self.vision.encode([image])
        full = self.vision.expand(ids, enc)
        return full, enc, self.vision.media(full, enc)


@pytest.fixture(scope="module")
def models():
    return {}  # family -> Loaded, shared by the tests of this module


@pytest.fixture(params=FAMILIES)
def loaded(request, models):
    if request.param not in models:
        models[request.param] = Loaded(request.param)
    return models[request.param]


@pytest.fixture
def qwen2_vl(models):
    if "qwen2_vl" not in models:
        models["qwen2_vl"] = Loaded("qwen2_vl")
    return models["qwen2_vl"]


def reference_logits(loaded: Loaded, full: list[int], media) -> np.ndarray:
    """transformers' own forward of the whole prompt with the same processor output, fp32."""
    import torch
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(loaded.path), dtype=torch.float32).eval()
    ids = torch.tensor([full])
    kw = {k: torch.from_numpy(v) for k, v in media.images[0].items()}
    is_image = (ids == loaded.backend.image_token_id).int()
    if loaded.backend.rotates_by_position_ids:  # Qwen's M-RoPE reads which tokens are images
        kw["mm_token_type_ids"] = is_image
    if loaded.vision.family.bidirectional == "image":  # Gemma 3: an image's tokens see each other
        kw["token_type_ids"] = is_image.long()
    with torch.no_grad():
        return model(input_ids=ids, **kw).logits[0].float().numpy()


def test_image_prompt_logits_match_transformers(loaded):
    b = loaded.backend
    full, enc, media = loaded.prompt(picture(0))
    a, z = int(media.spots[0][0]), int(media.spots[0][-1]) + 1
    seq = b.new_sequence()
    seq.media = media
    # inside the image's run: the splice (and an M-RoPE table) cross chunks; where an image's
    # tokens attend both ways, the image comes whole in the second chunk
    split = a if b.kind.bidirectional else (a + z) // 2
    ours = np.concatenate([b.forward_all(full[:split], seq), b.forward_all(full[split:], seq)])
    assert np.abs(ours - reference_logits(loaded, full, media)).max() <= ATOL
    # decode continues at the prompt's M-RoPE delta (the shifted position); the pixels are let go
    assert seq.shift == media.delta and seq.media is None
    # and the image matters: another picture moves the logits far beyond the tolerance
    _, _, other = loaded.prompt(picture(1))
    seq2 = b.new_sequence()
    seq2.media = other
    assert np.abs(b.forward_all(full, seq2) - ours).max() > 100 * ATOL


def engine_of(loaded: Loaded, **kw) -> Engine:
    kw = {"n_ctx": 512, "parallel": 3, "batch_size": 512, "cache_budget_bytes": None, **kw}
    engine = Engine(loaded.backend, loaded.tok, **kw)
    engine.start()
    return engine


def greedy(prompt, media=None, max_tokens=6, cache_prompt=False) -> GenerationRequest:
    req = GenerationRequest(prompt=list(prompt), params=SamplingParams(temperature=0.0), max_tokens=max_tokens,
                            ignore_eos=True, cache_prompt=cache_prompt)
    if media is not None:
        req.media, req.cache_tokens = media, list(media.cache_tokens)
    return req


async def answer(engine: Engine, req: GenerationRequest):
    events = [ev async for ev in engine.submit(req)]
    assert events[-1].error is None, events[-1].error
    return [ev.token for ev in events if ev.token is not None], events[-1].timings


def test_an_image_row_and_text_rows_share_forwards_and_answer_as_alone(qwen2_vl):
    full, _, media = qwen2_vl.prompt(picture(2))
    texts = [qwen2_vl.prompt(None, q)[0] for q in ("Tell me a story.", "Count to five please, slowly.")]
    b = qwen2_vl.backend
    steps: list[list[tuple[bool, int]]] = []
    run = b._run

    def recorded(rows, fn=None, ids=None):  # what each forward carried: (has media, tokens) per row
        steps.append([(getattr(r.cache, "media", None) is not None, len(r.tokens)) for r in rows])
        return run(rows, fn, ids)

    b._run = recorded
    engine = engine_of(qwen2_vl)
    try:
        async def scenario():
            alone = [await answer(engine, greedy(p, m)) for p, m in ((full, media), (texts[0], None),
                                                                       (texts[1], None))]
            steps.clear()
            together = await asyncio.gather(answer(engine, greedy(full, media)),
                                            *(answer(engine, greedy(t)) for t in texts))
            return alone, together

        alone, together = asyncio.run(scenario())
    finally:
        engine.shutdown()
        del b._run
    assert [t for t, _ in together] == [t for t, _ in alone]
    assert any(any(m for m, _ in s) and sum(1 for m, _ in s if not m) == 2 for s in steps)


def test_a_repeated_image_skips_the_tower_and_the_prefix_cache_keys_the_image(qwen2_vl):
    b = qwen2_vl.backend
    full, _, media = qwen2_vl.prompt(picture(3))
    _, _, again = qwen2_vl.prompt(picture(3))
    other_full, _, other = qwen2_vl.prompt(picture(4))
    assert other_full == full and other.cache_tokens != media.cache_tokens
    engine = engine_of(qwen2_vl)
    try:
        async def scenario():
            solo_other = await answer(engine, greedy(other_full, other))
            hits, misses = b.features.hits, b.features.misses
            cold = await answer(engine, greedy(full, media, cache_prompt=True))
            assert (b.features.hits, b.features.misses) == (hits, misses + 1)
            warm = await answer(engine, greedy(full, again, cache_prompt=True))
            # the whole image was in the cached prefix: no tower forward, not even a cache read
            assert (b.features.hits, b.features.misses) == (hits, misses + 1)
            moved = await answer(engine, greedy(other_full, other, cache_prompt=True))
            return solo_other, cold, warm, moved

        solo_other, cold, warm, moved = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert cold[1].cache_n == 0 and warm[1].cache_n == len(full) - 1 and warm[0] == cold[0]
    # a different picture after the same text: the cache stops where the image starts
    assert moved[1].cache_n == media.spots[0][0] and moved[0] == solo_other[0]
    # the features of an image seen before come from the feature cache, with no prefix to help
    hits = b.features.hits
    tail, _, late = qwen2_vl.prompt(picture(3), "Describe it in other words.")
    seq = b.new_sequence()
    seq.media = late
    b.forward_all(tail, seq)
    assert b.features.hits == hits + 1


def test_the_feature_cache_keeps_a_byte_budget_least_recently_used_out_first():
    from mlxcel.backends.mlx.vlm import ImageFeatureCache

    cache = ImageFeatureCache(capacity=3 * 4096)
    for key in "abc":
        cache.put(key, mx.zeros((1024,), mx.float32))  # 4 KiB each
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("d", mx.zeros((1024,), mx.float32))
    assert cache.get("b") is None and all(cache.get(k) is not None for k in "acd")
    assert cache.nbytes == 3 * 4096
    cache.put("huge", mx.zeros((8192,), mx.float32))  # alone over the budget: kept, everything else out
    assert cache.get("huge") is not None and cache.get("a") is None and cache.nbytes == 8192 * 4
