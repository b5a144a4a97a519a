"""Vision-language checkpoints: which families take images, and how an image becomes tokens.

One explicit table (`VISION_FAMILIES`, models/vision_layouts.py) says, per `model_type`, how
the chat prompt marks an image (`placeholder`) and how its marker token expands to the image's
run of tokens. The image processor is the checkpoint's own (preprocessor_config.json, read by
transformers' AutoImageProcessor, which picks the PIL-backed class: no torchvision needed).
Capability is decided from config.json alone (`is_vision`), so routes and backend selection
never load weights to ask.

The image-token budget (--image-min-tokens / --image-max-tokens) follows b10621's
arithmetic where the processor resizes between a pixel minimum and maximum (Qwen): a token
covers `patch_size^2 * merge_size^2` pixels, so a token bound times that patch area is a pixel
bound. Where the processor bounds only the long side (Pixtral, Idefics 3), a maximum becomes the
longest side whose square image stays within it, and a minimum is refused. A positive value is
a bound; 0 or a negative value keeps the checkpoint's own. Every processor that consumes a bound
counts it (`ImageBudget.applications`); a budget requested of a checkpoint whose processor
resizes to a fixed geometry is refused at load.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxcel.models.vision_layouts import LONGEST_EDGE, PIXELS, TILES, VISION_FAMILIES, LayoutContext, VisionFamily

__all__ = ["VISION_FAMILIES", "VisionFamily", "VisionInput", "ImageBudget", "BudgetRefused", "EncodedImages",
           "is_vision", "is_vision_checkpoint", "budget_pixels", "text_on_mlx"]

PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def text_on_mlx(config: dict) -> bool:
    """A vision family whose text tower the MLX backend serves (for text only): Gemma 3's."""
    from mlxcel.models.registry import FAMILIES

    fam = FAMILIES.get(config.get("model_type"))
    return fam is not None and fam.mlx_module is not None


class BudgetRefused(ValueError):
    """An image-token budget this checkpoint cannot honour (said why)."""


def is_vision(config: dict) -> bool:
    return config.get("model_type") in VISION_FAMILIES


def is_vision_checkpoint(path: Path) -> bool:
    """A vision family's checkpoint that ships its image processor: one whose images can be
    served (Gemma 3 without one is served for text, as its text tower alone)."""
    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return is_vision(config) and any((path / f).is_file() for f in PROCESSOR_FILES)


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

    def apply(self, processor: Any, kind: str | None = PIXELS, config: dict | None = None) -> None:
        """Move the processor's bound that `kind` names; count the application."""
        if not self.requested:
            return
        if kind in (LONGEST_EDGE, TILES):
            self._apply_longest_edge(processor, config or {}, kind == TILES)
            return
        size = getattr(processor, "size", None)
        # a dict or transformers' SizeDict: both bounds present means smart resize between them
        dynamic = size is not None and all(size.get(k) is not None for k in ("shortest_edge", "longest_edge"))
        if kind != PIXELS or not dynamic:
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

    def _apply_longest_edge(self, processor: Any, config: dict, tiles: bool) -> None:
        if self.min_tokens is not None and self.min_tokens > 0:
            raise BudgetRefused("--image-min-tokens: this checkpoint's image processor bounds only the long side of "
                                "an image, so there is no minimum to set; drop --image-min-tokens (--image-max-tokens "
                                "is honoured)")
        longest = longest_edge_for(self.max_tokens, processor, config, tiles)
        size = copy.copy(processor.size)
        size["longest_edge"] = longest
        processor.size = size
        self.applications += 1


def longest_edge_for(max_tokens: int, processor: Any, config: dict, tiles: bool) -> int:
    """The longest side (px) whose square image costs at most `max_tokens` image tokens."""
    if tiles:  # Idefics 3: within one tile, one view; past it k*k tiles plus the global view
        from mlxcel.models.vision_layouts import idefics3_seq_len

        tile, seq = int(processor.max_image_size["longest_edge"]), idefics3_seq_len(config)
        if max_tokens < seq:
            raise BudgetRefused(f"--image-max-tokens {max_tokens}: this checkpoint spends {seq} tokens on an image "
                                f"of at most {tile} px; give at least {seq}")
        k = 1
        while ((k + 1) ** 2 + 1) * seq <= max_tokens:
            k += 1
        return k * tile
    vision = config.get("vision_config") or {}
    step = int(vision.get("patch_size") or 16) * int(config.get("spatial_merge_size") or 1)
    return max(1, int(max_tokens ** 0.5)) * step  # one merged patch per `step` px each way


@dataclass
class EncodedImages:
    """The processor's output for one request's images, in prompt order."""

    inputs: list[dict[str, Any]]  # per image: the tensors the family's get_image_features takes
    runs: list[list[int]]  # per image: the token run its marker expands to
    tokens: list[int]  # per image: image-feature tokens in its run

    @property
    def grid_thw(self) -> Any:
        """Qwen's [n_images, 3] (t, h, w) grids, which its multimodal RoPE reads; None elsewhere."""
        import torch

        grids = [x["image_grid_thw"] for x in self.inputs if "image_grid_thw" in x]
        return torch.cat(grids) if grids else None


# Builds the engine request's image payload from the expanded prompt and the encoded images;
# the backend that runs the images owns that type, and the composition root supplies it.
MediaFactory = Callable[[list[int], EncodedImages], Any]
# what the processor returns that the model does not take (Idefics 3's tiling, Gemma 3's crop count)
_NOT_MODEL_INPUTS = ("rows", "cols", "num_crops")


class VisionInput:
    """A checkpoint's image side, as the routes need it: the processor (with the budget
    applied), the prompt placeholder, the marker and image token ids, the expansion of a
    prompt, and the backend's image payload for a request (`media`)."""

    def __init__(self, path: Path, config: dict, tokenizer_hf: Any, budget: ImageBudget | None = None, *,
                 media: MediaFactory | None = None, tensors: str = "pt") -> None:
        """`tensors`: the processor's output type, "pt" (torch's backend) or "np" (MLX's, without torch)."""
        from transformers import AutoImageProcessor

        self._media = media
        self._tensors = tensors
        self.family = VISION_FAMILIES[config["model_type"]]
        self.processor = AutoImageProcessor.from_pretrained(str(path), local_files_only=True)
        budget = budget or ImageBudget()
        budget.apply(self.processor, self.family.budget, config)
        if budget.requested and budget.applications == 0:
            flag = "--image-min-tokens" if (budget.min_tokens or 0) > 0 else "--image-max-tokens"
            raise BudgetRefused(f"{path.name}: its image processor resizes to a fixed geometry, so {flag} has no "
                                f"bound to move; drop {flag}")
        tok = tokenizer_hf
        self._layout = LayoutContext(token_id=tok.convert_tokens_to_ids,
                                     encode=lambda text: tok.encode(text, add_special_tokens=False),
                                     config=config, processor=self.processor)
        self.marker_id = int(tok.convert_tokens_to_ids(self.family.marker))
        ids = [config.get(k) for k in ("image_token_id", "image_token_index")]
        self.image_token_id = int(next((i for i in ids if i is not None), None)
                                  or tok.convert_tokens_to_ids(self.family.image_token))
        self.placeholder = self.family.placeholder

    def encode(self, images: list[Any]) -> EncodedImages:
        """PIL images -> per-image model inputs and token runs (CPU work: call it off the event loop)."""
        extra = {"return_row_col_info": True} if self.family.row_col_info else {}
        inputs, runs, counts = [], [], []
        for im in images:  # one call per image: families differ in how they batch sizes
            out = dict(self.processor(images=[im.convert("RGB")], return_tensors=self._tensors, **extra))
            run = self.family.run(self._layout, out)
            inputs.append({k: v for k, v in out.items() if k not in _NOT_MODEL_INPUTS})
            runs.append(run)
            counts.append(sum(1 for t in run if t == self.image_token_id))
        return EncodedImages(inputs, runs, counts)

    def media(self, prompt: list[int], encoded: EncodedImages) -> Any:
        """The engine request's image payload for the expanded `prompt` (GenerationRequest.media)."""
        if self._media is None:
            raise RuntimeError("no backend supplied the image payload for this checkpoint")
        return self._media(prompt, encoded)

    def expand(self, prompt: list[int], encoded: EncodedImages) -> list[int]:
        """Each marker token of the rendered prompt becomes that image's run."""
        found = sum(1 for t in prompt if t == self.marker_id)
        if found != len(encoded.runs) or (self.marker_id != self.image_token_id and self.image_token_id in prompt):
            raise ValueError(f"the prompt marks {found} image(s) for {len(encoded.runs)} image part(s); the "
                             f"text may not spell the image placeholder {self.family.marker} itself")
        runs = iter(encoded.runs)
        out: list[int] = []
        for t in prompt:
            out.extend(next(runs) if t == self.marker_id else [t])
        return out
