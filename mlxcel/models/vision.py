"""Vision-language checkpoints: which families take images, and how an image becomes tokens.

One explicit table (`VISION_FAMILIES`) says, per `model_type`, how the chat prompt marks an
image (`placeholder`, expanded to one image-pad token per merged patch) and which processor
class reads the checkpoint's preprocessor_config.json. Capability is decided from config.json
alone (`is_vision`), so routes and backend selection never load weights to ask.

The image-token budget (--image-min-tokens / --image-max-tokens) follows b10621's
arithmetic: a token covers `patch_size^2 * merge_size^2` pixels, so a token bound times that
patch area is a pixel bound, which a dynamic-resolution processor takes as its min_pixels /
max_pixels. A positive value is a bound; 0 or a negative value keeps the checkpoint's own.
Every processor that consumes a bound counts it (`ImageBudget.applications`); a budget
requested of a checkpoint whose processor resizes to a fixed geometry is refused at load.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class VisionFamily:
    model_type: str
    placeholder: str  # what one image renders as in the prompt text (pad token expanded later)
    image_token: str  # the pad token, repeated once per merged patch
    processor: str  # module:class of the image processor (PIL-backed: no torchvision needed)


VISION_FAMILIES: dict[str, VisionFamily] = {
    f.model_type: f
    for f in (
        VisionFamily("qwen2_vl", "<|vision_start|><|image_pad|><|vision_end|>", "<|image_pad|>",
                     "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl:Qwen2VLImageProcessorPil"),
        VisionFamily("qwen2_5_vl", "<|vision_start|><|image_pad|><|vision_end|>", "<|image_pad|>",
                     "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl:Qwen2VLImageProcessorPil"),
    )
}


class BudgetRefused(ValueError):
    """An image-token budget this checkpoint cannot honour (said why)."""


def is_vision(config: dict) -> bool:
    return config.get("model_type") in VISION_FAMILIES


def is_vision_checkpoint(path: Path) -> bool:
    try:
        return is_vision(json.loads((Path(path) / "config.json").read_text()))
    except (OSError, ValueError):
        return False


def budget_pixels(tokens: int | None, patch_size: int, merge_size: int) -> int | None:
    """b10621's set_limit_image_tokens: tokens * patch_size^2 * merge_size^2 (None: from the model)."""
    if tokens is None or tokens <= 0:
        return None
    return tokens * patch_size * patch_size * merge_size * merge_size


@dataclass
class ImageBudget:
    """--image-min-tokens / --image-max-tokens as given (None or <= 0: the checkpoint's own)."""

    min_tokens: int | None = None
    max_tokens: int | None = None
    applications: int = field(default=0, compare=False)  # processors that took a requested bound

    @property
    def requested(self) -> bool:
        return any(v is not None and v > 0 for v in (self.min_tokens, self.max_tokens))

    def apply(self, processor: Any) -> None:
        """Set a dynamic-resolution processor's pixel bounds; count the application."""
        size = getattr(processor, "size", None)
        # a dict or transformers' SizeDict: both bounds present means smart resize between them
        dynamic = size is not None and all(size.get(k) is not None for k in ("shortest_edge", "longest_edge"))
        if not self.requested or not dynamic:
            return
        patch, merge = int(processor.patch_size), int(processor.merge_size)
        lo = budget_pixels(self.min_tokens, patch, merge) or size["shortest_edge"]
        hi = budget_pixels(self.max_tokens, patch, merge) or size["longest_edge"]
        if hi < lo:
            raise BudgetRefused(f"the image budget leaves a maximum of {hi} pixels below the minimum of {lo} "
                                f"(--image-min-tokens {self.min_tokens}, --image-max-tokens {self.max_tokens})")
        size = copy.copy(size)
        size["shortest_edge"], size["longest_edge"] = lo, hi
        processor.size = size
        self.applications += 1


def _import(spec: str):
    import importlib

    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass
class EncodedImages:
    """The processor's output for one request's images, in prompt order."""

    pixel_values: Any  # torch tensor [patches, channels * t * p * p]
    grid_thw: Any  # torch int64 [n_images, 3]
    tokens: list[int]  # image-pad tokens each image expands to


# Builds the engine request's image payload from the expanded prompt and the encoded images;
# the backend that runs the images owns that type, and the composition root supplies it.
MediaFactory = Callable[[list[int], EncodedImages], Any]


class VisionInput:
    """A checkpoint's image side, as the routes need it: the processor (with the budget
    applied), the prompt placeholder, the pad token id, the expansion of a prompt, and the
    backend's image payload for a request (`media`)."""

    def __init__(self, path: Path, config: dict, tokenizer_hf: Any, budget: ImageBudget | None = None, *,
                 media: MediaFactory | None = None) -> None:
        self._media = media
        self.family = VISION_FAMILIES[config["model_type"]]
        self.processor = _import(self.family.processor).from_pretrained(str(path), local_files_only=True)
        budget = budget or ImageBudget()
        budget.apply(self.processor)
        if budget.requested and budget.applications == 0:
            flag = "--image-min-tokens" if (budget.min_tokens or 0) > 0 else "--image-max-tokens"
            raise BudgetRefused(f"{path.name}: its image processor resizes to a fixed geometry, so {flag} has no "
                                f"bound to move; drop {flag}")
        self.merge = int(getattr(self.processor, "merge_size", 1))
        self.image_token_id = int(config.get("image_token_id") or tokenizer_hf.convert_tokens_to_ids(
            self.family.image_token))
        self.placeholder = self.family.placeholder

    def encode(self, images: list[Any]) -> EncodedImages:
        """PIL images -> pixel patches and grids (CPU work: call it off the event loop)."""
        out = self.processor(images=[im.convert("RGB") for im in images], return_tensors="pt")
        grid = out["image_grid_thw"]
        return EncodedImages(out["pixel_values"], grid, [int(g.prod()) // (self.merge ** 2) for g in grid])

    def media(self, prompt: list[int], encoded: EncodedImages) -> Any:
        """The engine request's image payload for the expanded `prompt` (GenerationRequest.media)."""
        if self._media is None:
            raise RuntimeError("no backend supplied the image payload for this checkpoint")
        return self._media(prompt, encoded)

    def expand(self, prompt: list[int], encoded: EncodedImages) -> list[int]:
        """Each image-pad token of the rendered prompt becomes that image's run of pad tokens."""
        found = sum(1 for t in prompt if t == self.image_token_id)
        if found != len(encoded.tokens):
            raise ValueError(f"the prompt marks {found} image(s) for {len(encoded.tokens)} image part(s); the "
                             f"text may not spell the image placeholder {self.family.image_token} itself")
        runs = iter(encoded.tokens)
        out: list[int] = []
        for t in prompt:
            out.extend([t] * next(runs) if t == self.image_token_id else [t])
        return out
