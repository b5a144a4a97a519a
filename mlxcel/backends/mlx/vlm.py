"""Vision-language checkpoints on the MLX backend: mlx-vlm's family modules over mlxcel's paged KV.

mlx-vlm's family module (models/vision.py names it per model_type) supplies the vision tower,
the projector and the language tower; mlxcel drives them as it drives an mlx-lm text family.
Every step runs the language tower's decoder stack over the step's paged or packed views
(backends/mlx/paged.py, packed.py) with input embeddings and position ids built here:

- a row's text tokens embed through the tower's table; a prefill chunk of a row with images
  (`MLXMedia`, riding on its sequence from GenerationRequest.media) has the image tokens it
  covers replaced by that image's features. The vision tower runs once per image, only for
  images whose tokens the chunk covers (a prefix the cache supplied needs none), and its output
  is kept by the image's content hash (`ImageFeatureCache`), so a repeated image skips it;
- positions: Qwen2-VL's multimodal RoPE takes three position ids per token (time, height,
  width). A row with images reads them from the family's own `get_rope_index` over the whole
  prompt; text rows (and decode steps) take their logical position on all three axes, which
  is a text model's RoPE. The prompt's position delta becomes the sequence's `shift`, so decode
  steps, and a context shift, continue at the shifted position like any row.

Rows with and without images share one forward, packed or padded as text rows are: the
family's attention reaches mlxcel's attention seam through its module's
`scaled_dot_product_attention` name, and the positions come from here, not from the cache's
offset (`rotates_by_position_ids`).
"""

from __future__ import annotations

import glob
import hashlib
import importlib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxcel.backends.mlx.backend import MLXBackend
from mlxcel.backends.rows import RowLayout
from mlxcel.config.rope import RopeOverrides
from mlxcel.engine.backend import ForwardRow
from mlxcel.models.registry import DOCS_PAGE, UnsupportedModelType
from mlxcel.models.rope_overrides import config_overrides
from mlxcel.models.vision_mlx import MLX_VLM_MODULES

# image features kept by content hash (a few hundred KB each for real towers)
FEATURE_CACHE_ENTRIES = 64


def image_key(pixel_values: np.ndarray, grid: np.ndarray) -> str:
    """One image's identity for the feature cache: its processed pixels and grid."""
    h = hashlib.sha256(np.ascontiguousarray(grid, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(pixel_values, dtype=np.float32).tobytes())
    return h.hexdigest()


class ImageFeatureCache:
    """Vision-tower outputs by image key, least recently used out first."""

    def __init__(self, capacity: int = FEATURE_CACHE_ENTRIES) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, mx.array] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, key: str) -> mx.array | None:
        feats = self._items.get(key)
        if feats is None:
            self.misses += 1
            return None
        self.hits += 1
        self._items.move_to_end(key)
        return feats

    def put(self, key: str, feats: mx.array) -> None:
        self._items[key] = feats
        self._items.move_to_end(key)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)


@dataclass
class MLXMedia:
    """One request's images, attached to each of its rows' sequences."""

    prompt: list[int]  # the expanded prompt (one pad token per image token)
    pixel_values: list[np.ndarray]  # per image, the processor's patches
    grids: np.ndarray  # [n_images, 3] int64
    keys: list[str]  # per image, its feature-cache key
    runs: list[tuple[int, int]]  # per image, its tokens' [start, stop) in the prompt
    cache_tokens: list[int] = field(default_factory=list)  # the prefix cache's key (engine.types.PrefixKeyed)
    # filled on the row's first prefill chunk
    positions: np.ndarray | None = field(default=None, repr=False)  # [3, len(prompt)]
    delta: int = 0
    feats: dict[int, mx.array] = field(default_factory=dict, repr=False)  # image index -> [tokens, hidden]


def image_runs(prompt: list[int], image_token_id: int, counts: list[int]) -> list[tuple[int, int]]:
    """Each image's run of pad tokens in the expanded prompt, in order."""
    runs, i, n = [], 0, len(prompt)
    while i < n:
        if prompt[i] == image_token_id:
            j = i
            while j < n and prompt[j] == image_token_id:
                j += 1
            runs.append((i, j))
            i = j
        else:
            i += 1
    # adjacent images would merge into one run: split by the processor's counts
    out, k = [], 0
    for a, b in runs:
        while a < b and k < len(counts):
            out.append((a, a + counts[k]))
            a += counts[k]
            k += 1
    if [b - a for a, b in out] != list(counts):
        raise ValueError(f"the prompt's image tokens do not match the images' token counts {counts}")
    return out


def per_image(encoded) -> list[tuple[np.ndarray, np.ndarray]]:
    """(patches, [1, 3] grid) of each image of models/vision.EncodedImages, as numpy: from its
    per-image inputs where it keeps them, else split from the batch by each grid's patch count."""
    inputs = getattr(encoded, "inputs", None)
    if inputs is not None:
        return [(np.asarray(x["pixel_values"], dtype=np.float32),
                 np.asarray(x["image_grid_thw"], dtype=np.int64).reshape(-1, 3)) for x in inputs]
    grids = np.asarray(encoded.grid_thw, dtype=np.int64).reshape(-1, 3)
    pv = np.asarray(encoded.pixel_values, dtype=np.float32)
    bounds = np.concatenate([[0], np.cumsum(grids.prod(axis=1))])
    return [(pv[bounds[k]:bounds[k + 1]], grids[k:k + 1]) for k in range(len(grids))]


def media_for(image_token_id: int):
    """The media factory (models/vision.MediaFactory) for a checkpoint with this pad token."""

    def make(prompt: list[int], encoded) -> MLXMedia:
        images = per_image(encoded)
        keys = [image_key(p, g) for p, g in images]
        runs = image_runs(prompt, image_token_id, list(encoded.tokens))
        return MLXMedia(prompt=list(prompt), pixel_values=[p for p, _ in images],
                        grids=np.concatenate([g for _, g in images]), keys=keys, runs=runs,
                        cache_tokens=keyed_prompt(prompt, runs, keys))

    return make


def keyed_prompt(prompt: list[int], runs: list[tuple[int, int]], keys: list[str]) -> list[int]:
    """The prompt with each image's tokens replaced by an id drawn from the image's key: negative,
    so never a vocabulary id, and equal only for the same image (GenerationRequest.cache_tokens)."""
    out = list(prompt)
    for (a, b), key in zip(runs, keys):
        out[a:b] = [-1 - int(key[:15], 16)] * (b - a)
    return out


def mlx_vlm_config(raw: dict) -> dict:
    """config.json as mlx-vlm's Qwen2-VL config reads it, where transformers 5 writes another form:
    the text tower's keys at the top level (transformers 5 nests them in text_config), the M-RoPE
    section as `rope_scaling`, and the vision tower named by the family (not `<family>_vision`)."""
    cfg = {**(raw.get("text_config") or {}), **{k: v for k, v in raw.items() if k != "text_config"}}
    vision = dict(cfg.get("vision_config") or {})
    if vision.get("model_type") == f"{raw['model_type']}_vision":
        cfg["vision_config"] = {**vision, "model_type": raw["model_type"]}
    rope = cfg.get("rope_parameters") or {}
    if "mrope_section" in rope and not cfg.get("rope_scaling"):
        cfg["rope_scaling"] = {"type": "mrope", "mrope_section": list(rope["mrope_section"])}
    if "rope_theta" in rope:
        cfg.setdefault("rope_theta", rope["rope_theta"])
    return cfg


def load_vlm(path: Path, raw: dict):
    """mlx-vlm's Model for the checkpoint at `path` with its weights, and the config it was built from."""
    from mlx_vlm.utils import load_model_weights, sanitize_weights, update_module_configs

    if raw.get("model_type") not in MLX_VLM_MODULES:
        raise UnsupportedModelType(f"{raw['model_type']}: the MLX backend does not serve this vision-language family; "
                                   f"use --backend torch (see {DOCS_PAGE})")
    module = importlib.import_module(MLX_VLM_MODULES[raw["model_type"]])
    cfg = mlx_vlm_config(raw)
    model_config = module.ModelConfig.from_dict(dict(cfg))
    towers = {**cfg, "text_config": {k: v for k, v in cfg.items() if k != "vision_config"}}
    model_config = update_module_configs(model_config, module, towers, ["text", "vision"])
    model = module.Model(model_config)
    weights: dict[str, mx.array] = {}
    for f in sorted(glob.glob(str(path / "*.safetensors"))):
        weights.update(mx.load(f))
    weights = sanitize_weights(model, weights)
    weights = sanitize_weights(module.VisionModel, weights, model_config.vision_config)
    weights = sanitize_weights(module.LanguageModel, weights, model_config.text_config)
    model = load_model_weights(model, cfg, weights, path)
    return model, cfg


class MLXVLMBackend(MLXBackend):
    """MLXBackend for a vision-language family: same KV, packing, hooks and steering seams."""

    rotates_by_position_ids = True

    def _load_model(self, path: Path, raw: dict, config: dict, rope: RopeOverrides | None):
        if rope is not None and config_overrides(config, rope):
            raise UnsupportedModelType("--rope-* / --yarn-* overrides are not applied to a multimodal RoPE; drop "
                                       "them to serve this vision-language checkpoint")
        model, cfg = load_vlm(path, raw)
        self.image_token_id = int(cfg["image_token_id"])
        self.features = ImageFeatureCache()
        return model, cfg

    # -- one step --------------------------------------------------------------------------

    def _call(self, fn, ids: mx.array, views: list, rows: list[ForwardRow], layout: RowLayout, plan):
        if fn is not None:
            return fn(ids, cache=views)
        lm = self.model.language_model
        b, width = ids.shape
        embeds = lm.model.embed_tokens(ids)
        positions = np.zeros((b, width), dtype=np.int64)
        starts = np.cumsum([0] + [len(r.tokens) for r in rows])
        dst, src = [], []  # flat embedding rows to replace, and the features that replace them
        for i, r in enumerate(rows):
            n, seq = len(r.tokens), r.cache
            row, col = (0, int(starts[i])) if layout.packed else (i, 0)
            text = seq.position + np.arange(n)
            positions[row, col:col + n] = text
            if not layout.packed:
                positions[row, n:] = text[-1]  # padded queries repeat the last position
            media = getattr(seq, "media", None)
            if isinstance(media, MLXMedia):
                self._splice(media, seq, row * width + col, n, dst, src)
        pos3 = np.repeat(positions[None], 3, axis=0)
        for i, r in enumerate(rows):  # the multimodal table overrides a media row's prompt positions
            media = getattr(r.cache, "media", None)
            if isinstance(media, MLXMedia):
                self._place_positions(media, r, i, starts, layout, pos3)
        if dst:
            flat = embeds.reshape(b * width, -1)
            flat[mx.array(np.asarray(dst, dtype=np.int32))] = mx.concatenate(src).astype(flat.dtype)
            embeds = flat.reshape(b, width, -1)
        h = lm.model(ids, inputs_embeds=embeds, cache=views, position_ids=mx.array(pos3.astype(np.int32)))
        if lm.args.tie_word_embeddings:
            return lm.model.embed_tokens.as_linear(h)
        return lm.lm_head(h)

    def _prepare(self, m: MLXMedia) -> None:
        if m.positions is not None:
            return
        lm = self.model.language_model
        pos, delta = lm.get_rope_index(mx.array([m.prompt]), mx.array(m.grids))
        m.positions = np.array(pos[:, 0], dtype=np.int64)
        m.delta = int(np.array(delta).reshape(-1)[0])

    def _features(self, m: MLXMedia, k: int) -> mx.array:
        """Image k's features: from the cache by its key, else one vision-tower forward."""
        if k not in m.feats:
            feats = self.features.get(m.keys[k])
            if feats is None:
                tower = self.model.vision_tower
                dtype = tower.patch_embed.proj.weight.dtype
                feats = tower(mx.array(m.pixel_values[k]).astype(dtype), mx.array(m.grids[k:k + 1]),
                              output_hidden_states=False)
                mx.eval(feats)
                self.features.put(m.keys[k], feats)
            m.feats[k] = feats
        return m.feats[k]

    def _splice(self, m: MLXMedia, seq, at: int, n: int, dst: list, src: list) -> None:
        """Queue the image features this chunk's prompt range covers (flat rows from `at`)."""
        self._prepare(m)
        start = seq.length
        stop = min(start + n, len(m.prompt))
        for k, (a, b) in enumerate(m.runs):
            lo, hi = max(a, start), min(b, stop)
            if lo < hi:
                dst.extend(range(at + lo - start, at + hi - start))
                src.append(self._features(m, k)[lo - a:hi - a])

    def _place_positions(self, m: MLXMedia, r: ForwardRow, i: int, starts, layout: RowLayout, pos3) -> None:
        seq = r.cache
        start = seq.length
        stop = min(start + len(r.tokens), len(m.prompt))
        row, col = (0, int(starts[i])) if layout.packed else (i, 0)
        if start < stop:
            pos3[:, row, col:col + stop - start] = m.positions[:, start:stop]
            if not layout.packed:
                pos3[:, row, col + stop - start:] = m.positions[:, stop - 1:stop]
        # decode (and a context shift) continue at the prompt's shifted position
        seq.shift = m.delta
        if start + len(r.tokens) >= len(m.prompt):
            seq.media = None  # the prompt is in the KV; the pixels are no longer needed
