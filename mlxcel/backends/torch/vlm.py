"""Vision-language checkpoints on the torch backend: image embeddings and M-RoPE over paged KV.

transformers' family class (Qwen2VLForConditionalGeneration) supplies the vision tower and
the language model; the language model runs through the same paged step as a text
checkpoint. What a request with images adds rides on its sequence (`SequenceKV.media`, set
at admission from `GenerationRequest.media`):

- its expanded prompt, pixel patches and image grids (`Media`);
- on the row's first prefill chunk, one vision-tower forward for all its images, and the
  checkpoint's own multimodal position scheme over the whole prompt (`get_rope_index`):
  image tokens take (t, h, w) positions, text continues after an image at a shifted
  position;
- each prefill chunk splices the image embeddings at the image-pad tokens and reads its
  positions from that table; the prompt's position delta becomes the sequence's `shift`, so
  decode steps (and a context shift) continue at the shifted position like any row.

Rows without images batch with image rows in the same forward: their three position axes
are equal, which is exactly a text model's RoPE. A request with images skips the prompt cache
(the route clears cache_prompt): image-pad tokens are the same ids for every picture, so a
token-keyed prefix cannot tell two images apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mlxcel.engine.backend import ForwardRow
from mlxcel.backends.torch.backend import TorchBackend
from mlxcel.backends.torch.paged import PagedStepCache, StepPlan
from mlxcel.models.registry import family_for


@dataclass
class Media:
    """One request's images, attached to each of its rows' sequences."""

    prompt: list[int]  # the expanded prompt (one pad token per merged patch)
    pixel_values: torch.Tensor
    grid_thw: torch.Tensor  # [n_images, 3] int64
    # filled on the first prefill chunk (shared by rows of the same request: identical prompts)
    embeds: torch.Tensor | None = field(default=None, repr=False)  # [n_image_tokens, hidden]
    positions: torch.Tensor | None = field(default=None, repr=False)  # [3, len(prompt)]
    slot: torch.Tensor | None = field(default=None, repr=False)  # [len(prompt)]: embed row, -1 for text
    delta: int = 0


class TorchVLMBackend(TorchBackend):
    """TorchBackend for a vision-language family: same KV, hooks and steering seam."""

    can_pack = False  # image rows carry 3-axis positions per row; mixed steps run padded forwards

    def _load_model(self, path: Path, dtype: torch.dtype, extra: dict):
        import json

        import transformers

        config = json.loads((path / "config.json").read_text())
        cls = getattr(transformers, family_for(config).hf_architecture)
        self.image_token_id = int(config["image_token_id"])
        transformers.utils.logging.disable_progress_bar()  # as the text backend: the load's own progress covers it
        return cls.from_pretrained(str(path), dtype=dtype, local_files_only=True, attn_implementation="sdpa",
                                   **extra)

    def _decoder_stack(self, model):
        return model.model.language_model

    def _prepare_media(self, m: Media) -> None:
        if m.embeds is not None:
            return
        vlm = self.model.model
        dtype = self.lm_head.weight.dtype
        feats = vlm.get_image_features(m.pixel_values.to(self.device, dtype), m.grid_thw.to(self.device))
        m.embeds = torch.cat(list(feats.pooler_output), dim=0).to(dtype)
        ids = torch.tensor([m.prompt], dtype=torch.long, device=self.device)
        is_image = ids == self.image_token_id
        if int(is_image.sum()) != m.embeds.shape[0]:
            raise ValueError(f"{int(is_image.sum())} image tokens for {m.embeds.shape[0]} image embeddings")
        positions, delta = vlm.get_rope_index(ids, mm_token_type_ids=is_image.int(),
                                              image_grid_thw=m.grid_thw.to(self.device))
        m.positions, m.delta = positions[:, 0], int(delta.reshape(-1)[0])
        m.slot = torch.where(is_image[0], torch.cumsum(is_image[0].long(), 0) - 1, -1)

    def _forward_stack(self, ids: torch.Tensor, plan: StepPlan, rows: list[ForwardRow]):
        media = [(i, r.cache.media) for i, r in enumerate(rows) if getattr(r.cache, "media", None) is not None]
        if not media:
            return super()._forward_stack(ids, plan, rows)
        embeds = self.base.embed_tokens(ids)
        positions = plan.position_ids[None].expand(3, -1, -1).clone()
        for i, m in media:
            self._prepare_media(m)
            seq, start = rows[i].cache, plan.offsets[i]
            if start == 0:  # decode continues at the prompt's shifted position (after a context shift too)
                seq.shift = m.delta
            stop = min(start + plan.n[i], len(m.prompt))
            if start < stop:
                positions[:, i, : stop - start] = m.positions[:, start:stop]
                slot = m.slot[start:stop]
                at = slot >= 0
                if bool(at.any()):
                    embeds[i, : stop - start][at] = m.embeds[slot[at]]
            if start + plan.n[i] >= len(m.prompt):
                seq.media = None  # the prompt is in the KV; the pixels are no longer needed
        return self.base(inputs_embeds=embeds, attention_mask=self._masks(plan), position_ids=positions,
                         cache=PagedStepCache(self.storage, plan), use_cache=True)


def media_for(prompt: list[int], encoded: Any) -> Media:
    """The Media of a request from models.vision.EncodedImages and its expanded prompt."""
    return Media(prompt=list(prompt), pixel_values=encoded.pixel_values, grid_thw=encoded.grid_thw)
