"""Vision-language checkpoints on the MLX backend: mlx-vlm's family modules over mlxcel's paged KV.

mlx-vlm's family module (models/vision_mlx.py names it per model_type) supplies the vision
tower, the projector and the language tower; mlxcel drives them as it drives an mlx-lm text
family, and what differs per family (config forms, one image's features, the language step)
sits in vlm_families.py.
Every step runs the language tower's decoder stack over the step's paged or packed views
(backends/mlx/paged.py, packed.py) with input embeddings and position ids built here:

- a row's text tokens embed through the tower's table; a prefill chunk of a row with images
  (`MLXMedia`, riding on its sequence from GenerationRequest.media) has the image tokens it
  covers replaced by that image's features. The vision tower runs once per image, only for
  images whose tokens the chunk covers (a prefix the cache supplied needs none), and its output
  is kept by the image's content hash (`ImageFeatureCache`), so a repeated image skips it;
- positions: a text-RoPE family rotates by the views' offsets as a text family does; Qwen2-VL's
  multimodal RoPE takes three position ids per token (time, height, width). A row with images reads them from the family's own `get_rope_index` over the whole
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
from mlxcel.backends.mlx.paged import PagedBatchView
from mlxcel.backends.mlx.vlm_families import FAMILY_KINDS, embed_tokens
from mlxcel.backends.rows import RowLayout
from mlxcel.config.rope import RopeOverrides
from mlxcel.engine.backend import ForwardRow
from mlxcel.models.registry import DOCS_PAGE, UnsupportedModelType
from mlxcel.models.rope_overrides import config_overrides
from mlxcel.models.vision_mlx import MLX_VLM_MODULES

# image features kept by content hash, by bytes: a large image on a large model is ~100 MB of them
FEATURE_CACHE_BYTES = 256 << 20


def image_key(inputs: dict[str, np.ndarray]) -> str:
    """One image's identity for the feature cache: its processed pixels and their geometry."""
    h = hashlib.sha256()
    for name in sorted(inputs):
        x = np.ascontiguousarray(inputs[name])
        h.update(f"{name}{x.dtype}{x.shape}".encode())
        h.update(x.tobytes())
    return h.hexdigest()


class ImageFeatureCache:
    """Vision-tower outputs by image key within `capacity` bytes, least recently used out first
    (the newest entry stays even when it alone is larger)."""

    def __init__(self, capacity: int = FEATURE_CACHE_BYTES) -> None:
        self.capacity, self.nbytes = capacity, 0
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
        old = self._items.pop(key, None)
        self.nbytes += feats.nbytes - (old.nbytes if old is not None else 0)
        self._items[key] = feats
        while self.nbytes > self.capacity and len(self._items) > 1:
            self.nbytes -= self._items.popitem(last=False)[1].nbytes


@dataclass
class MLXMedia:
    """One request's images, attached to each of its rows' sequences."""

    prompt: list[int]  # the expanded prompt (one pad token per image token)
    images: list[dict[str, np.ndarray]]  # per image, the processor's model inputs
    keys: list[str]  # per image, its feature-cache key
    spots: list[np.ndarray]  # per image, where its tokens sit in the prompt (several runs for a tiled image)
    cache_tokens: list[int] = field(default_factory=list)  # the prefix cache's key (engine.types.PrefixKeyed)
    # filled on the row's first prefill chunk
    positions: np.ndarray | None = field(default=None, repr=False)  # [3, len(prompt)]: M-RoPE families
    delta: int = 0
    feats: dict[int, mx.array] = field(default_factory=dict, repr=False)  # image index -> [tokens, hidden]

    @property
    def grids(self) -> np.ndarray:
        """[n_images, 3] (t, h, w) patch grids, which an M-RoPE family's positions read."""
        return np.concatenate([x["image_grid_thw"].reshape(-1, 3) for x in self.images])


def image_spots(prompt: list[int], image_token_id: int, counts: list[int]) -> list[np.ndarray]:
    """Each image's token positions in the expanded prompt, in order: image k takes the next
    counts[k] image tokens (a tiled image's tiles sit in runs apart, between their markers)."""
    at = np.flatnonzero(np.asarray(prompt) == image_token_id)
    if len(at) != sum(counts):
        raise ValueError(f"the prompt holds {len(at)} image tokens for images of {sum(counts)}")
    bounds = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    return [at[bounds[k]:bounds[k + 1]] for k in range(len(counts))]


def per_image(encoded) -> list[dict[str, np.ndarray]]:
    """Each image's model inputs of models/vision.EncodedImages, as numpy."""
    return [{k: np.asarray(v) for k, v in x.items()} for x in encoded.inputs]


def media_for(image_token_id: int):
    """The media factory (models/vision.MediaFactory) for a checkpoint with this image token."""

    def make(prompt: list[int], encoded) -> MLXMedia:
        images = per_image(encoded)
        keys = [image_key(x) for x in images]
        spots = image_spots(prompt, image_token_id, list(encoded.tokens))
        return MLXMedia(prompt=list(prompt), images=images, keys=keys, spots=spots,
                        cache_tokens=keyed_prompt(prompt, spots, keys))

    return make


def keyed_prompt(prompt: list[int], spots: list[np.ndarray], keys: list[str]) -> list[int]:
    """The prompt with each image's tokens replaced by an id drawn from the image's key: negative,
    so never a vocabulary id, and equal only for the same image (GenerationRequest.cache_tokens)."""
    out = list(prompt)
    for at, key in zip(spots, keys):
        for i in at:
            out[i] = -1 - int(key[:15], 16)
    return out


def load_vlm(path: Path, raw: dict):
    """mlx-vlm's Model for the checkpoint at `path` with its weights, and the config it was built from."""
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import load_model_weights, sanitize_weights, update_module_configs

    if raw.get("model_type") not in MLX_VLM_MODULES:
        raise UnsupportedModelType(f"{raw['model_type']}: the MLX backend does not serve this vision-language family; "
                                   f"use --backend torch (see {DOCS_PAGE})")
    module = importlib.import_module(MLX_VLM_MODULES[raw["model_type"]])
    kind = FAMILY_KINDS[raw["model_type"]]
    cfg = kind.config(raw)
    model_config = module.ModelConfig.from_dict(dict(cfg))
    # a flat config (Qwen's) is its own text tower's
    towers = cfg if "text_config" in cfg else {**cfg, "text_config": {k: v for k, v in cfg.items()
                                                                     if k != "vision_config"}}
    model_config = update_module_configs(model_config, module, towers, ["text", "vision"])
    model = module.Model(model_config)
    weights: dict[str, mx.array] = {}
    for f in sorted(glob.glob(str(path / "*.safetensors"))):
        weights.update(mx.load(f))
    weights = sanitize_weights(model, weights)
    weights = sanitize_weights(module.VisionModel, weights, model_config.vision_config)
    weights = sanitize_weights(module.LanguageModel, weights, model_config.text_config)
    weights = kind.weights(weights, {k for k, _ in tree_flatten(model.parameters())})
    model = load_model_weights(model, cfg, weights, path)
    # arrays a module keeps in a plain object (Pixtral's rotary table): left lazy, they would first be
    # evaluated on the engine's thread, which lacks the loading thread's stream
    mx.eval([a for _, m in model.named_modules() for v in vars(m).values()
             if hasattr(v, "__dict__") and not isinstance(v, type) for a in vars(v).values() if isinstance(a, mx.array)])
    return model, cfg


class MLXVLMBackend(MLXBackend):
    """MLXBackend for a vision-language family: same KV, packing, hooks and steering seams."""

    def _load_model(self, path: Path, raw: dict, config: dict, rope: RopeOverrides | None):
        if rope is not None and config_overrides(config, rope):
            raise UnsupportedModelType("--rope-* / --yarn-* overrides are not applied to a vision-language "
                                       "checkpoint's RoPE on MLX; drop them (or serve it with --backend torch)")
        model, cfg = load_vlm(path, raw)
        self.kind = FAMILY_KINDS[raw["model_type"]]
        self.rotates_by_position_ids = self.kind.rotates_by_position_ids
        self.image_token_id = self.kind.image_token_id(cfg)
        self.features = ImageFeatureCache()
        # the text tower's geometry at the top, where the engine reads it (ModelInfo.config)
        text = {k: v for k, v in (cfg.get("text_config") or {}).items() if k != "model_type"}
        return model, {**text, **cfg}

    # -- one step --------------------------------------------------------------------------

    def _call(self, fn, ids: mx.array, views: list, rows: list[ForwardRow], layout: RowLayout):
        if fn is not None:
            return fn(ids, cache=views)
        b, width = ids.shape
        embeds = embed_tokens(self.model)(ids)
        starts = np.cumsum([0] + [len(r.tokens) for r in rows])
        spots = [(0, int(starts[i])) if layout.packed else (i, 0) for i in range(len(rows))]
        dst, src = [], []  # flat embedding rows to replace, and the features that replace them
        for r, (row, col) in zip(rows, spots):
            media = getattr(r.cache, "media", None)
            if isinstance(media, MLXMedia):
                self._splice(media, r.cache, row * width + col, len(r.tokens), dst, src)
        if dst:
            flat = embeds.reshape(b * width, -1)
            flat[mx.array(np.asarray(dst, dtype=np.int32))] = mx.concatenate(src).astype(flat.dtype)
            embeds = flat.reshape(b, width, -1)
        positions = self._positions(rows, spots, layout, (b, width)) if self.rotates_by_position_ids else None
        if self.kind.bidirectional and not layout.packed:
            self._open_spans(rows, {id(v.plan): v.plan for v in views if isinstance(v, PagedBatchView)}.values())
        for r in rows:
            media = getattr(r.cache, "media", None)
            if isinstance(media, MLXMedia) and r.cache.length + len(r.tokens) >= len(media.prompt):
                r.cache.media = None  # the prompt is in the KV; the pixels are no longer needed
        return self.kind.logits(self.model, ids, embeds, views, positions)

    def _positions(self, rows: list[ForwardRow], spots, layout: RowLayout, shape) -> mx.array:
        """[3, B, width] position ids: a text token's logical position on every axis, a media
        row's prompt tokens from its multimodal table; a media row's sequence takes the prompt's
        delta as its shift, so decode (and a context shift) continues at the shifted position."""
        pos3 = np.zeros((3, *shape), dtype=np.int64)
        for r, (row, col) in zip(rows, spots):
            n, seq = len(r.tokens), r.cache
            media = getattr(seq, "media", None)
            text = seq.position + np.arange(n)
            pos3[:, row, col:col + n] = text
            if isinstance(media, MLXMedia):
                start = seq.length
                stop = min(start + n, len(media.prompt))
                pos3[:, row, col:col + stop - start] = media.positions[:, start:stop]
                seq.shift = media.delta
            if not layout.packed:
                pos3[:, row, col + n:] = pos3[:, row, col + n - 1:col + n]  # padded queries repeat the last
        return mx.array(pos3.astype(np.int32))

    def _may_pack(self, rows: list[ForwardRow]) -> bool:
        # an image prompt of a family whose image tokens attend both ways needs an opened mask,
        # which the padded step's masks carry
        return not (self.kind.bidirectional and any(isinstance(getattr(r.cache, "media", None), MLXMedia)
                                                    for r in rows))

    def _open_spans(self, rows: list[ForwardRow], plans) -> None:
        """Let each image's tokens in this chunk see that image's tokens already in the KV or in
        the chunk, whatever their order (Gemma 3); an image split across chunks is seen causally
        across the split, as the torch backend does."""
        for i, r in enumerate(rows):
            m = getattr(r.cache, "media", None)
            if not isinstance(m, MLXMedia):
                continue
            start = r.cache.length
            known = min(start + len(r.tokens), len(m.prompt))
            span = np.full(len(m.prompt), -1)
            for k, at in enumerate(m.spots):
                span[at] = k
            q, keys = span[start:known], span[:known]
            both = (q[:, None] == keys[None, :]) & (q[:, None] >= 0)
            if both.any():
                for plan in plans:
                    plan.opened.append((i, both))

    def _prepare(self, m: MLXMedia) -> None:
        if m.positions is None and self.rotates_by_position_ids:
            m.positions, m.delta = self.kind.positions(self.model, m.prompt, m.grids)

    def _features(self, m: MLXMedia, k: int) -> mx.array:
        """Image k's features: from the cache by its key, else one vision-tower forward."""
        if k not in m.feats:
            feats = self.features.get(m.keys[k])
            if feats is None:
                feats = self.kind.features(self.model, m.images[k], len(m.spots[k]), self.image_token_id)
                mx.eval(feats)
                self.features.put(m.keys[k], feats)
            m.feats[k] = feats
        return m.feats[k]

    def _splice(self, m: MLXMedia, seq, at: int, n: int, dst: list, src: list) -> None:
        """Queue the image features this chunk's prompt range covers (flat rows from `at`)."""
        self._prepare(m)
        start = seq.length
        stop = min(start + n, len(m.prompt))
        for k, spots in enumerate(m.spots):
            inside = np.flatnonzero((spots >= start) & (spots < stop))
            if len(inside):
                dst.extend((at + spots[inside] - start).tolist())
                src.append(self._features(m, k)[mx.array(inside.astype(np.int32))])
