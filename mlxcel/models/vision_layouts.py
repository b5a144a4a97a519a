"""How each vision-language family lays one image out in the prompt, and which families there are.

A chat template renders an image part as the family's placeholder; one token of it (`marker`)
is then replaced by the image's run, built here from the image processor's output for that
image: the image-feature tokens (one per embedding row the vision tower and projector give) and
whatever framing the family's own processor puts around them (Gemma 3's begin/end-of-image and
blank lines, Idefics 3's tile tags, Pixtral's row breaks). The runs follow each family's
processor in transformers; they are written from its documented layout, not taken from it.

Per family, the table also says what the language model needs beyond spliced embeddings:
multimodal RoPE (Qwen2/2.5-VL), image tokens that attend to each other both ways (Gemma 3), a
prompt prefix attended both ways and positions counted from 1 (PaliGemma), and which image
processor setting an image-token budget moves (`budget`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# what a budget (--image-min-tokens / --image-max-tokens) moves in the processor:
PIXELS = "pixels"  # min/max pixels between which the image is resized (Qwen's smart resize)
LONGEST_EDGE = "longest_edge"  # only an upper bound on the long side (Pixtral): max only
TILES = "tiles"  # the long side, cut into fixed tiles plus a global view (Idefics 3): max only
FIXED = None  # a fixed geometry: nothing to move


@dataclass(frozen=True)
class LayoutContext:
    """What a run builder reads besides the processor output: the tokenizer's ids and the config."""

    token_id: Callable[[str], int]
    encode: Callable[[str], list[int]]
    config: dict
    processor: Any


# one image's processor output (tensors for a batch of one) -> its run of token ids
RunBuilder = Callable[[LayoutContext, dict], list[int]]


@dataclass(frozen=True)
class VisionFamily:
    model_type: str
    placeholder: str  # what one image part renders as in the prompt text
    marker: str  # the placeholder's token that the image's run replaces
    image_token: str  # the token whose embeddings are the image features (config's image_token id first)
    run: RunBuilder
    budget: str | None = FIXED
    mrope: bool = False  # Qwen's 3-D (t, h, w) positions, from the model's get_rope_index
    bidirectional: str = ""  # "image": an image's tokens see each other; "prefix": the whole prompt does
    position_offset: int = 0  # PaliGemma counts positions from 1
    row_col_info: bool = False  # the processor reports its tiling only when asked (Idefics 3)


def qwen_run(ctx: LayoutContext, out: dict) -> list[int]:
    merge = int(getattr(ctx.processor, "merge_size", 2))
    n = int(out["image_grid_thw"][0].prod()) // (merge * merge)
    return [ctx.token_id("<|image_pad|>")] * n


def _config_tokens(ctx: LayoutContext, key: str, default: int) -> int:
    return int(ctx.config.get(key) or default)


def llava_run(ctx: LayoutContext, out: dict) -> list[int]:
    vision = ctx.config.get("vision_config") or {}
    h, w = out["pixel_values"].shape[-2:]
    patch = int(vision.get("patch_size") or 14)
    n = (h // patch) * (w // patch)  # the CLS feature is dropped under the default strategy
    if ctx.config.get("vision_feature_select_strategy", "default") == "full":
        n += 1
    return [_image_id(ctx, "<image>")] * n


def gemma3_run(ctx: LayoutContext, out: dict) -> list[int]:
    n = _config_tokens(ctx, "mm_tokens_per_image", 256)
    gap = ctx.encode("\n\n")
    return [*gap, ctx.token_id("<start_of_image>"), *[_image_id(ctx, "<image_soft_token>")] * n,
            ctx.token_id("<end_of_image>"), *gap]


def paligemma_run(ctx: LayoutContext, out: dict) -> list[int]:
    n = int(getattr(ctx.processor, "image_seq_length", 0) or ctx.config.get("text_config", {}).get(
        "num_image_tokens") or 256)
    return [_image_id(ctx, "<image>")] * n


def idefics3_seq_len(config: dict) -> int:
    vision = config.get("vision_config") or {}
    side = int(vision.get("image_size") or 224) // int(vision.get("patch_size") or 32)
    return side * side // (int(config.get("scale_factor") or 2) ** 2)


def idefics3_run(ctx: LayoutContext, out: dict) -> list[int]:
    """Tiles row by row, each `<fake><row_r_col_c>` then its image tokens, a newline after each
    row, then a blank line and the global view `<fake><global-img>` image tokens `<fake>`."""
    rows, cols = int(out["rows"][0][0]), int(out["cols"][0][0])
    fake, image = ctx.token_id("<fake_token_around_image>"), _image_id(ctx, "<image>")
    tokens = [image] * idefics3_seq_len(ctx.config)
    run: list[int] = []
    for r in range(rows):
        for c in range(cols):
            run += [fake, *ctx.encode(f"<row_{r + 1}_col_{c + 1}>"), *tokens]
        run += ctx.encode("\n")
    if rows or cols:
        run += ctx.encode("\n")
    return run + [fake, *ctx.encode("<global-img>"), *tokens, fake]


def pixtral_run(ctx: LayoutContext, out: dict) -> list[int]:
    """One `[IMG]` per merged patch, each row of them closed by `[IMG_BREAK]`, the last by `[IMG_END]`."""
    vision = ctx.config.get("vision_config") or {}
    step = int(vision.get("patch_size") or 16) * int(ctx.config.get("spatial_merge_size") or 1)
    h, w = (int(x) for x in out["image_sizes"][0])
    image, brk, end = _image_id(ctx, "[IMG]"), ctx.token_id("[IMG_BREAK]"), ctx.token_id("[IMG_END]")
    rows = [[image] * (w // step) + [brk] for _ in range(h // step)]
    if rows:
        rows[-1][-1] = end
    return [t for row in rows for t in row]


def _image_id(ctx: LayoutContext, default: str) -> int:
    for key in ("image_token_id", "image_token_index"):
        if ctx.config.get(key) is not None:
            return int(ctx.config[key])
    return ctx.token_id(default)


_QWEN = "<|vision_start|><|image_pad|><|vision_end|>"

VISION_FAMILIES: dict[str, VisionFamily] = {
    f.model_type: f
    for f in (
        VisionFamily("qwen2_vl", _QWEN, "<|image_pad|>", "<|image_pad|>", qwen_run, PIXELS, mrope=True),
        VisionFamily("qwen2_5_vl", _QWEN, "<|image_pad|>", "<|image_pad|>", qwen_run, PIXELS, mrope=True),
        VisionFamily("gemma3", "<start_of_image>", "<start_of_image>", "<image_soft_token>", gemma3_run,
                     bidirectional="image"),
        VisionFamily("llava", "<image>", "<image>", "<image>", llava_run),
        VisionFamily("idefics3", "<image>", "<image>", "<image>", idefics3_run, TILES, row_col_info=True),
        VisionFamily("paligemma", "<image>", "<image>", "<image>", paligemma_run, bidirectional="prefix",
                     position_offset=1),
        VisionFamily("mistral3", "[IMG]", "[IMG]", "[IMG]", pixtral_run, LONGEST_EDGE),
    )
}
