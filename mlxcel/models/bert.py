"""A BERT encoder in MLX: the forward pass behind the embedding and reranking workers.

Covers the two checkpoint shapes those workers load: `BertModel` (sentence embedders such as
all-MiniLM-L6-v2; the worker pools the hidden states) and `BertForSequenceClassification`
(cross-encoders; the pooler's tanh over [CLS] feeds a linear head whose logits are the scores).
HF weight names are mapped onto this module's own attribute names by one explicit table, and
loading is strict: a missing or unexpected tensor is an error, never a silently random weight.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from mlxcel.models.registry import ENCODER_TYPES

# HF name fragment -> ours; applied in order to each weight name.
_RENAMES = (
    (re.compile(r"^bert\."), ""),
    (re.compile(r"^encoder\.layer\.(\d+)\."), r"layers.\1."),
    (re.compile(r"attention\.self\.(query|key|value)"), r"\1"),
    (re.compile(r"attention\.output\.dense"), "attn_out"),
    (re.compile(r"attention\.output\.LayerNorm"), "attn_norm"),
    (re.compile(r"intermediate\.dense"), "inter"),
    (re.compile(r"(layers\.\d+\.)output\.dense"), r"\1out"),
    (re.compile(r"(layers\.\d+\.)output\.LayerNorm"), r"\1out_norm"),
    (re.compile(r"^embeddings\.word_embeddings"), "word"),
    (re.compile(r"^embeddings\.position_embeddings"), "position"),
    (re.compile(r"^embeddings\.token_type_embeddings"), "token_type"),
    (re.compile(r"^embeddings\.LayerNorm"), "emb_norm"),
    (re.compile(r"^pooler\.dense"), "pooler"),
    (re.compile(r"\.gamma$"), ".weight"),
    (re.compile(r"\.beta$"), ".bias"),
)
_SKIPPED = re.compile(r"(^|\.)position_ids$")


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    num_labels: int  # 0 for a plain encoder

    @classmethod
    def from_dict(cls, cfg: dict) -> "BertConfig":
        if cfg.get("model_type") not in ENCODER_TYPES:
            raise ValueError(f"not a BERT checkpoint (model_type {cfg.get('model_type')!r})")
        if cfg.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"unsupported BERT activation {cfg.get('hidden_act')!r} (only gelu)")
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("only absolute position embeddings are supported")
        archs = cfg.get("architectures") or []
        classifier = any(a.endswith("ForSequenceClassification") for a in archs)
        labels = len(cfg.get("id2label") or {}) or cfg.get("num_labels") or 2
        return cls(cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
                   cfg["intermediate_size"], cfg["max_position_embeddings"], cfg.get("type_vocab_size", 2),
                   cfg.get("layer_norm_eps", 1e-12), labels if classifier else 0)


class _Layer(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        h = c.hidden_size
        self.heads = c.num_attention_heads
        self.query, self.key, self.value = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=c.layer_norm_eps)
        self.inter = nn.Linear(h, c.intermediate_size)
        self.out = nn.Linear(c.intermediate_size, h)
        self.out_norm = nn.LayerNorm(h, eps=c.layer_norm_eps)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        b, t, h = x.shape
        d = h // self.heads

        def split(y):
            return y.reshape(b, t, self.heads, d).transpose(0, 2, 1, 3)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        a = mx.fast.scaled_dot_product_attention(q, k, v, scale=d ** -0.5, mask=mask)
        x = self.attn_norm(x + self.attn_out(a.transpose(0, 2, 1, 3).reshape(b, t, h)))
        return self.out_norm(x + self.out(nn.gelu(self.inter(x))))


class Bert(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.config = c
        self.word = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.emb_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.layers = [_Layer(c) for _ in range(c.num_hidden_layers)]
        if c.num_labels:
            self.pooler = nn.Linear(c.hidden_size, c.hidden_size)
            self.classifier = nn.Linear(c.hidden_size, c.num_labels)

    def __call__(self, input_ids: mx.array, token_type_ids: mx.array, attention_mask: mx.array) -> mx.array:
        """Last hidden states [B, T, H]; padded positions are masked out of attention."""
        t = input_ids.shape[1]
        x = self.word(input_ids) + self.position(mx.arange(t)[None, :]) + self.token_type(token_type_ids)
        x = self.emb_norm(x)
        # additive key mask, broadcast over heads and query positions
        mask = ((1.0 - attention_mask.astype(x.dtype)) * -1e9)[:, None, None, :].astype(x.dtype)
        for layer in self.layers:
            x = layer(x, mask)
        return x

    def classify(self, input_ids: mx.array, token_type_ids: mx.array, attention_mask: mx.array) -> mx.array:
        """Sequence-classification logits [B, num_labels] (tanh pooler over [CLS], then the head)."""
        if not self.config.num_labels:
            raise ValueError("this checkpoint has no classification head")
        hidden = self(input_ids, token_type_ids, attention_mask)
        return self.classifier(mx.tanh(self.pooler(hidden[:, 0])))


def our_name(hf_name: str) -> str:
    for pattern, repl in _RENAMES:
        hf_name = pattern.sub(repl, hf_name)
    return hf_name


def load_bert(path: Path, dtype: mx.Dtype = mx.float32) -> Bert:
    config = BertConfig.from_dict(json.loads((path / "config.json").read_text()))
    model = Bert(config)
    weights: dict[str, mx.array] = {}
    for file in sorted(path.glob("*.safetensors")):
        for name, tensor in mx.load(str(file)).items():
            if _SKIPPED.search(name):
                continue
            ours = our_name(name)
            if ours in weights:
                raise ValueError(f"{path}: two tensors map to {ours}")
            weights[ours] = tensor.astype(dtype)
    if not config.num_labels:  # a plain encoder may ship a pooler it never uses
        weights.pop("pooler.weight", None), weights.pop("pooler.bias", None)
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    mx.eval(model.parameters())
    return model
