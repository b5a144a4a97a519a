"""Vision-language checkpoints on the torch backend: image embeddings spliced over paged KV.

transformers' family class (its `hf_architecture`: Qwen2-VL, Qwen2.5-VL, Gemma 3, LLaVA,
Idefics 3, PaliGemma, Mistral 3) supplies the vision tower, the projector and the language
model; the language model runs through the same paged step as a text checkpoint. What a
request with images adds rides on its sequence (`SequenceKV.media`, set at admission from
`GenerationRequest.media`):

- its expanded prompt and each image's processor output (`Media`);
- on the row's first prefill chunk, one vision-tower and projector forward per image
  (`get_image_features`), and the positions the family needs over the whole prompt: Qwen's
  multimodal RoPE (`get_rope_index`: image tokens take (t, h, w) positions, text continues
  after an image at a shifted position) or plain positions, counted from 1 for PaliGemma;
- each prefill chunk splices the image embeddings at the image tokens and reads its positions
  from that table; the prompt's position delta becomes the sequence's `shift`, so decode steps
  continue at the shifted position like any row;
- where the family lets image tokens attend both ways (Gemma 3: within an image; PaliGemma: the
  whole prompt), the step's causal mask is opened for those pairs. A query sees only keys
  already in the KV, so that holds exactly when a bidirectional span is prefilled in one chunk
  (an image's run in one chunk, which --ubatch-size bounds); a span split across chunks is
  attended causally across the split.

Rows without images batch with image rows in the same forward: their three position axes
are equal, which is exactly a text model's RoPE. A request with images skips the prompt cache
(the route clears cache_prompt): image tokens are the same ids for every picture, so a
token-keyed prefix cannot tell two images apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mlxcel.backends.torch.backend import TorchBackend
from mlxcel.backends.torch.paged import PagedStepCache, StepPlan
from mlxcel.engine.backend import ForwardRow
from mlxcel.models.registry import family_for
from mlxcel.models.vision import VISION_FAMILIES, VisionFamily


@dataclass
class Media:
    """One request's images, attached to each of its rows' sequences."""

    prompt: list[int]  # the expanded prompt
    inputs: list[dict[str, Any]]  # per image: get_image_features' tensors
    # filled on the first prefill chunk (shared by rows of the same request: identical prompts)
    embeds: torch.Tensor | None = field(default=None, repr=False)  # [n_image_tokens, hidden]
    positions: torch.Tensor | None = field(default=None, repr=False)  # [3, len(prompt)] (M-RoPE) or None
    slot: torch.Tensor | None = field(default=None, repr=False)  # [len(prompt)]: embed row, -1 for text
    blocks: torch.Tensor | None = field(default=None, repr=False)  # [len(prompt)]: span id, -1 causal only
    delta: int = 0


def _rows(features: Any) -> torch.Tensor:
    """get_image_features' output (its pooled features: a tensor, or one per image) as [tokens, hidden]."""
    out = features.pooler_output
    if isinstance(out, (list, tuple)):
        return torch.cat([o.reshape(-1, o.shape[-1]) for o in out])
    return out.reshape(-1, out.shape[-1])


def _spans(is_image: torch.Tensor, kind: str) -> torch.Tensor | None:
    """Per prompt position, the bidirectional span it belongs to (-1: none)."""
    if kind == "prefix":
        return torch.zeros_like(is_image, dtype=torch.long)
    if kind == "image":
        starts = is_image & ~torch.nn.functional.pad(is_image, (1, 0))[:-1]
        return torch.where(is_image, torch.cumsum(starts.long(), 0) - 1, -1)
    return None


class TorchVLMBackend(TorchBackend):
    """TorchBackend for a vision-language family: same KV, hooks and steering seam."""

    can_pack = False  # image rows carry their own positions and masks; mixed steps run padded forwards

    def _load_model(self, path: Path, dtype: torch.dtype, extra: dict):
        import json

        import transformers

        config = json.loads((path / "config.json").read_text())
        self.vision_family: VisionFamily = VISION_FAMILIES[config["model_type"]]
        cls = getattr(transformers, family_for(config).hf_architecture)
        transformers.utils.logging.disable_progress_bar()  # as the text backend: the load's own progress covers it
        return cls.from_pretrained(str(path), dtype=dtype, local_files_only=True, attn_implementation="sdpa",
                                   **extra)

    def _decoder_stack(self, model):
        inner = model.model
        return inner.language_model if hasattr(inner, "language_model") else inner.text_model  # Idefics 3's name

    @property
    def image_token_id(self) -> int:
        config = self.model.config
        return int(getattr(config, "image_token_id", None) or config.image_token_index)

    def _prepare_media(self, m: Media) -> None:
        if m.embeds is not None:
            return
        vlm = self.model.model
        dtype = self.lm_head.weight.dtype
        feats = []
        for inputs in m.inputs:
            moved = {k: v.to(self.device, dtype) if v.is_floating_point() else v.to(self.device)
                     for k, v in inputs.items()}
            feats.append(_rows(vlm.get_image_features(**moved)))
        m.embeds = torch.cat(feats).to(dtype)
        ids = torch.tensor([m.prompt], dtype=torch.long, device=self.device)
        is_image = ids == self.image_token_id
        if int(is_image.sum()) != m.embeds.shape[0]:
            raise ValueError(f"{int(is_image.sum())} image tokens for {m.embeds.shape[0]} image embeddings")
        if self.vision_family.mrope:
            grid = torch.cat([x["image_grid_thw"] for x in m.inputs]).to(self.device)
            positions, delta = vlm.get_rope_index(ids, mm_token_type_ids=is_image.int(), image_grid_thw=grid)
            m.positions, m.delta = positions[:, 0], int(delta.reshape(-1)[0])
        m.slot = torch.where(is_image[0], torch.cumsum(is_image[0].long(), 0) - 1, -1)
        m.blocks = _spans(is_image[0], self.vision_family.bidirectional)

    def _open_spans(self, masks, plan: StepPlan, media: list[tuple[int, Media]]):
        """The step's masks with each image row's bidirectional spans opened (queries and keys in
        the same span may attend whatever their order)."""
        spans = [(i, m) for i, m in media if m.blocks is not None]
        if not spans:
            return masks

        def opened(mask: torch.Tensor | None) -> torch.Tensor | None:
            if mask is None:
                return None
            mask = mask.expand(plan.batch, -1, -1, -1).clone()
            for i, m in spans:
                start, n = plan.offsets[i], plan.n[i]
                known = min(plan.lengths[i], len(m.prompt))
                if start >= len(m.prompt):
                    continue
                q = m.blocks[start:min(start + n, len(m.prompt))]
                k = m.blocks[:known]
                both = (q[:, None] == k[None, :]) & (q[:, None] >= 0)
                mask[i, 0, : q.shape[0], :known].masked_fill_(both, 0)
            return mask

        return {k: opened(v) for k, v in masks.items()} if isinstance(masks, dict) else opened(masks)

    def _forward_stack(self, ids: torch.Tensor, plan: StepPlan, rows: list[ForwardRow]):
        media = [(i, r.cache.media) for i, r in enumerate(rows) if getattr(r.cache, "media", None) is not None]
        offset = self.vision_family.position_offset
        if not media and not offset:
            return super()._forward_stack(ids, plan, rows)
        embeds = self.base.embed_tokens(ids)
        positions = plan.position_ids + offset
        if self.vision_family.mrope:
            positions = positions[None].expand(3, -1, -1).clone()
        for i, m in media:
            self._prepare_media(m)
            self._splice(embeds, positions, plan, rows[i], m, i)
        masks = self._open_spans(self._masks(plan), plan, media)
        for i, m in media:
            if plan.offsets[i] + plan.n[i] >= len(m.prompt):
                rows[i].cache.media = None  # the prompt is in the KV; the pixels are no longer needed
        return self.base(inputs_embeds=embeds, attention_mask=masks, position_ids=positions,
                         cache=PagedStepCache(self.storage, plan), use_cache=True)

    def _splice(self, embeds: torch.Tensor, positions: torch.Tensor, plan: StepPlan, row: ForwardRow, m: Media,
                i: int) -> None:
        """Row `i`'s image embeddings (and M-RoPE positions) for the part of its prompt in this step."""
        seq, start = row.cache, plan.offsets[i]
        if start == 0 and m.positions is not None:  # decode continues at the prompt's shifted position
            seq.shift = m.delta
        stop = min(start + plan.n[i], len(m.prompt))
        if start >= stop:
            return
        if m.positions is not None:
            positions[:, i, : stop - start] = m.positions[:, start:stop]
        slot = m.slot[start:stop]
        at = slot >= 0
        if bool(at.any()):
            embeds[i, : stop - start][at] = m.embeds[slot[at]]


def media_for(prompt: list[int], encoded: Any) -> Media:
    """The Media of a request from models.vision.EncodedImages and its expanded prompt."""
    return Media(prompt=list(prompt), inputs=list(encoded.inputs))
