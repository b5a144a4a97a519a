"""What differs between mlx-vlm's vision-language families, as the MLX backend drives them.

One `VLMFamily` per kind of family: how config.json becomes the config mlx-vlm's module reads
(transformers 5 writes some keys in another form), how one image's processor output becomes its
token features (vision tower and projector, at the language tower's input scale), how the
language tower runs one step over input embeddings, and whether the step supplies position ids
itself (a multimodal RoPE) or the family rotates by the cache's offset like a text family.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxcel.models.checkpoint_config import mlx_overrides


def embed_tokens(model):
    """The language tower's token embedding (at `.model.embed_tokens`, or Idefics 3's `.embed_tokens`)."""
    lm = model.language_model
    inner = getattr(lm, "model", None)
    return (inner if inner is not None else lm).embed_tokens


class VLMFamily:
    """The language-tower side every family shares; subclasses supply the vision side."""

    rotates_by_position_ids = False  # the step passes every token's 3-D position (M-RoPE)
    bidirectional = False  # an image's tokens attend each other both ways (Gemma 3)

    def config(self, raw: dict) -> dict:
        """config.json as mlx-vlm's module reads it: the text tower normalised as for mlx-lm, and
        tied embeddings as the checkpoint's top level says (transformers ties the composite
        model's head by its own key; the text tower's keeps its default)."""
        cfg = {**raw, **mlx_overrides(raw)}
        if isinstance(cfg.get("text_config"), dict) and "tie_word_embeddings" in raw:
            cfg["text_config"] = {**cfg["text_config"], "tie_word_embeddings": raw["tie_word_embeddings"]}
        return cfg

    def weights(self, weights: dict, expected: set[str]) -> dict:
        """Sanitized weights under the names the module expects: transformers 5 saves a vision
        tower's encoder without the `vision_model.` level mlx-vlm's towers keep; a checkpoint with
        tied embeddings stores no head, which a module that always builds one (Idefics 3's) reads
        from the embedding table."""
        out = {}
        for k, v in weights.items():
            nested = "vision_tower.vision_model." + k[len("vision_tower."):]
            out[nested if k not in expected and k.startswith("vision_tower.") and nested in expected else k] = v
        head = "language_model.lm_head.weight"
        tables = [k for k in ("language_model.model.embed_tokens.weight", "language_model.embed_tokens.weight")
                  if k in out]
        if head in expected and head not in out and tables:
            out[head] = out[tables[0]]
        return out

    def image_token_id(self, cfg: dict) -> int:
        return int(cfg.get("image_token_id", cfg.get("image_token_index")))

    def features(self, model, inputs: dict[str, np.ndarray], n: int, image_token_id: int) -> mx.array:
        """One image's `n` features, [n, hidden], as the language tower's input takes them: the
        family's own merge (get_input_embeddings) over a prompt of just that image's tokens."""
        ids = mx.full((1, n), image_token_id, mx.int32)
        extra = {k: mx.array(v) for k, v in inputs.items() if k != "pixel_values"}
        dtype = embed_tokens(model).weight.dtype
        out = model.get_input_embeddings(ids, mx.array(inputs["pixel_values"]).astype(dtype), **extra)
        return out.inputs_embeds[0]

    def positions(self, model, prompt: list[int], grids: np.ndarray) -> tuple[np.ndarray, int] | None:
        """A prompt's [3, len] position ids and the delta decode continues at, for an M-RoPE family."""
        return None

    def logits(self, model, ids: mx.array, embeds: mx.array, views: list, positions: mx.array | None) -> mx.array:
        return model.language_model(ids, inputs_embeds=embeds, cache=views).logits


class Qwen2VL(VLMFamily):
    """Qwen2-VL and Qwen2.5-VL: a dynamic-resolution vision tower whose merger emits one feature
    per 2x2 patches, and multimodal RoPE."""

    rotates_by_position_ids = True

    def config(self, raw: dict) -> dict:
        """mlx-vlm's Qwen config reads the text tower's keys at the top level (transformers 5
        nests them in text_config), the M-RoPE section as `rope_scaling`, and the vision tower
        named by the family (transformers 5: `<family>_vision`)."""
        cfg = {**(raw.get("text_config") or {}), **{k: v for k, v in raw.items() if k != "text_config"}}
        rope = cfg.get("rope_parameters") or {}
        if "mrope_section" in rope and not cfg.get("rope_scaling"):
            cfg["rope_scaling"] = {"type": "mrope", "mrope_section": list(rope["mrope_section"])}
        if "rope_theta" in rope:
            cfg.setdefault("rope_theta", rope["rope_theta"])
        vision = dict(cfg.get("vision_config") or {})
        if vision.get("model_type") == f"{raw['model_type']}_vision":
            cfg["vision_config"] = {**vision, "model_type": raw["model_type"]}
        return cfg

    def features(self, model, inputs, n, image_token_id):
        tower = model.vision_tower
        dtype = tower.patch_embed.proj.weight.dtype
        return tower(mx.array(inputs["pixel_values"]).astype(dtype), mx.array(inputs["image_grid_thw"]),
                     output_hidden_states=False)

    def positions(self, model, prompt, grids):
        pos, delta = model.language_model.get_rope_index(mx.array([prompt]), mx.array(grids))
        return np.array(pos[:, 0], dtype=np.int64), int(np.array(delta).reshape(-1)[0])

    def logits(self, model, ids, embeds, views, positions):
        lm = model.language_model
        h = lm.model(ids, inputs_embeds=embeds, cache=views, position_ids=positions)
        return lm.model.embed_tokens.as_linear(h) if lm.args.tie_word_embeddings else lm.lm_head(h)


class Gemma3(VLMFamily):
    """Gemma 3: a SigLIP tower at a fixed size, pooled to `mm_tokens_per_image` features and
    projected; mlx-vlm's text tower scales every input embedding by sqrt(hidden), so the features
    go in divided by it. An image's tokens see each other both ways, as in transformers (mlx-vlm's
    own generate masks them causally)."""

    bidirectional = True

    def config(self, raw: dict) -> dict:
        cfg = super().config(raw)
        text = dict(cfg.get("text_config") or {})
        text.setdefault("rope_global_base_freq", text.get("rope_theta", 1_000_000.0))
        if "mm_tokens_per_image" in raw:
            text.setdefault("mm_tokens_per_image", raw["mm_tokens_per_image"])
        return {**cfg, "text_config": text}

    def weights(self, weights, expected):
        # SigLIP's pooling head, which transformers keeps and Gemma 3 never reads (its projector
        # pools the last hidden state itself)
        return super().weights({k: v for k, v in weights.items() if not k.startswith("vision_tower.head.")}, expected)

    def features(self, model, inputs, n, image_token_id):
        tower = model.vision_tower
        x = mx.array(inputs["pixel_values"]).transpose(0, 2, 3, 1).astype(embed_tokens(model).weight.dtype)
        hidden, _, _ = tower(x, output_hidden_states=True)
        feats = model.multi_modal_projector(hidden)[0]
        # divided by the very factor the text tower multiplies by (rounded to bf16 there), so the
        # features reach the first layer as the projector gave them, as in transformers
        return feats / mx.array(model.config.text_config.hidden_size ** 0.5, mx.bfloat16).astype(feats.dtype)


class Mistral3(VLMFamily):
    """Mistral 3: a Pixtral tower, whose MLP mlx-vlm builds with SiLU only."""

    def config(self, raw: dict) -> dict:
        act = (raw.get("vision_config") or {}).get("hidden_act", "silu")
        if act != "silu":
            from mlxcel.models.registry import DOCS_PAGE, UnsupportedModelType

            raise UnsupportedModelType(f"mistral3: the vision tower's activation is {act}; mlx-vlm's Pixtral tower "
                                       f"runs SiLU only, so serve this checkpoint with --backend torch (see {DOCS_PAGE})")
        return super().config(raw)


FAMILY_KINDS: dict[str, VLMFamily] = {"qwen2_vl": Qwen2VL(), "qwen2_5_vl": Qwen2VL(), "gemma3": Gemma3(),
                                      "llava": VLMFamily(), "idefics3": VLMFamily(), "mistral3": Mistral3()}
