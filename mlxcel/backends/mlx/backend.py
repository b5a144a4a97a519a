"""The MLX backend: mlx-lm family modules under mlxcel's registry, cache and hook seams.

On a CPU device the compute dtype defaults to fp32: MLX's Linux CPU kernels for bf16 and
4-bit matmuls are 5-30x slower than fp32 there. On Metal the checkpoint's dtype is used.
"""

from __future__ import annotations

import json
import os
from contextlib import nullcontext
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.utils import load_model

from mlxcel.config.rope import RopeOverrides
from mlxcel.engine.backend import ForwardRow, KVCacheTypes, KVSpec, ModelInfo, latent_width, layer_windows
from mlxcel.backends.rows import RowLayout, RowSteering
from mlxcel.backends.mlx import cpu_ops, hf_layout, latent, packed, recurrent, sharding, split_products
from mlxcel.backends.mlx.distributed import MLXGroup
from mlxcel.backends.mlx.packed import PackedBatchView, PackedPlan
from mlxcel.backends.mlx.paged import PagedBatchView, PagedStorage, StepPlan
from mlxcel.engine.kv_block_pool import BlockAllocator, SequenceKV, StateSlots, group_rows, layer_groups
from mlxcel.models.checkpoint_config import mlx_overrides, normalize_config
from mlxcel.models.hooks import install_hooks
from mlxcel.models.registry import DOCS_PAGE, UnsupportedModelType, decoder_stack, family_for, mlx_module
from mlxcel.models.rope_overrides import config_overrides
from mlxcel.models.rope_overrides import verify as verify_rope

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def _get_classes(config: dict):
    module = mlx_module(config)
    return hf_layout.with_transformers_layout(module.Model, config.get("model_type")), module.ModelArgs


def on_cpu() -> bool:
    return mx.default_device() == mx.cpu


def resolve_dtype(requested: str, checkpoint_dtype: str) -> str:
    if requested != "auto":
        if requested not in _DTYPES:
            raise ValueError(f"unsupported dtype {requested!r}; use one of auto, {', '.join(_DTYPES)}")
        return requested
    if on_cpu():
        return "float32"
    return checkpoint_dtype if checkpoint_dtype in _DTYPES else "float16"


def context_length(config: dict) -> int:
    for key in ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length"):
        if isinstance(config.get(key), int) and config[key] > 0:
            return config[key]
    return 4096


def product_threads(requested: int) -> int:
    """How many CPU threads a large product uses (--threads; -1: two where the machine has
    them, the count measured in docs/benchmarks.md). 1 on Metal, where the GPU runs it."""
    if not on_cpu():
        return 1
    return requested if requested > 0 else min(2, os.cpu_count() or 1)


def quantization_label(config: dict) -> str | None:
    q = config.get("quantization")
    if not q:
        return None
    return f"{q.get('bits')}bit-g{q.get('group_size')}"


class MLXBackend(RowSteering):
    name = "mlx"
    # the step hands the family every token's position itself (a multimodal RoPE: backends/mlx/vlm.py)
    rotates_by_position_ids = False

    def __init__(self, path: str | Path, dtype: str = "auto", rope: RopeOverrides | None = None,
                 threads: int = -1, kv_cache: KVCacheTypes | None = None, group: MLXGroup | None = None) -> None:
        """`kv_cache`: how the KV pool stores keys and values (--cache-type-k / -v; default f16).
        `group`: this rank's share of a tensor- or pipeline-parallel group (sharding.py); its
        weights are read lazily, so a rank materializes only its own shard."""
        path = Path(path)
        self.kv_types = kv_cache or KVCacheTypes()
        raw = json.loads((path / "config.json").read_text())
        config = normalize_config(raw)
        family = family_for(config)  # refuse an unknown model_type before reading weights
        self._lazy = group is not None  # a rank of a group reads only its shard's weights
        model, config = self._load_model(path, raw, config, rope)
        self.shard = sharding.apply(model, family, group) if group is not None else None
        self.watchdog = group.watchdog if group is not None else None  # a follower's bound on its waits
        # a follower rank's output never reaches a sampler: its steps stop before the LM head
        self.head = self.shard is None or self.shard.rank == 0
        ckpt_dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
        compute = resolve_dtype(dtype, ckpt_dtype)
        model.set_dtype(_DTYPES[compute])
        # and the arrays modules keep out of their parameters (a YaRN RoPE's `_freqs`): left lazy,
        # they would first be evaluated on the engine's thread, which lacks this thread's stream
        mx.eval(model.parameters(),
                [v for _, m in model.named_modules() for v in m.values() if isinstance(v, mx.array)])
        self.model = model
        # recurrent layers (layer -> state entries, bytes per sequence), probed before any seam is installed
        self.recurrent = recurrent.layer_states(model) if "recurrent" in family.attention else {}
        self.states: recurrent.RecurrentStorage | None = None
        self.hooks = install_hooks(model)
        self.threads = product_threads(threads)
        self.split_modules = 0
        if on_cpu():
            # large products use more than MLX's one stream thread (split_products.py), and
            # RoPE / RMSNorm build smaller graphs than their CPU fallbacks (cpu_ops.py)
            self.split_modules = split_products.install(model, self.threads)
            cpu_ops.install(model)
        # rows of different lengths share one forward where the family takes the packed seams; a
        # recurrent family's steps stay padded (a packed step would run its rows as one sequence)
        self.packs_rows = not self.recurrent and packed.install(model, self.rotates_by_position_ids)
        # multi-head latent attention keeps its latent in the pool (latent.py), which kv_spec sizes
        mla_layers = latent.install(model)
        self._init_steering()  # per-step SAE deltas and residual reads (backends/rows.RowSteering)
        self.lora = None  # MLXLoraTerms once adapters are attached
        self.info = ModelInfo(
            path=path,
            model_type=config["model_type"],
            num_layers=len(model.layers),
            vocab_size=int(config.get("vocab_size") or model.args.vocab_size),
            context_length=context_length(config),
            dtype=compute,
            checkpoint_dtype=ckpt_dtype,
            quantization=quantization_label(config),
            backend="mlx",
            device="cpu" if on_cpu() else "metal",
            config={**config.get("text_config", {}), **config},  # a multimodal checkpoint's geometry is its text tower's
        )
        if latent_width(config) and mla_layers != self.info.num_layers:
            raise UnsupportedModelType(f"{config['model_type']} declares multi-head latent attention, but mlxcel's "
                                       f"latent forward fits {mla_layers} of its {self.info.num_layers} attention "
                                       f"modules; see {DOCS_PAGE}")
        self.windows = layer_windows(self.info.config, self.info.num_layers)
        if any(self.windows) and not self.packs_rows:
            raise UnsupportedModelType(f"{config['model_type']} declares sliding-window attention, which mlxcel applies "
                                       f"at the attention seam this family's module does not expose; see {DOCS_PAGE}")
        if self.recurrent:
            self.kv_types.refuse_quantized("this model's recurrent layers keep one state per sequence")
        self.kv_spec  # noqa: B018 - refuses a quantized KV mode the layers cannot hold, before any step
        # a pool of one context for direct drivers (tests, benchmarks); the engine binds its own
        self.bind_kv(BlockAllocator((self.info.context_length // 16) + 8, 16))

    def _load_model(self, path: Path, raw: dict, config: dict, rope: RopeOverrides | None):
        """The family's module with the checkpoint's weights, and its config as mlx-lm read it."""
        # --rope-* / --yarn-*: rewrite the rotation's config before the model is built
        rope_config = config_overrides(config, rope) if rope is not None else {}
        # mlx-lm reads config.json itself: the keys normalisation added go in with the overrides
        model_config = {**mlx_overrides(raw), **rope_config}
        model, config = load_model(path, lazy=self._lazy, get_model_classes=_get_classes,
                                   model_config=model_config or None)
        verify_rope(model, rope_config, config["model_type"])
        return model, config

    def attach_lora(self, adapters) -> None:
        """Serve these adapters unfused (models/lora.py); raises LoraError if one does not fit."""
        from mlxcel.backends.mlx.lora import MLXLoraTerms

        self.lora = MLXLoraTerms(self.model, adapters, _DTYPES[self.info.dtype])

    def bind_kv(self, allocator: BlockAllocator) -> None:
        """(Re)build KV storage for the pool `allocator` hands out; only while no sequence is live."""
        self.allocator = allocator
        self.kv_groups = layer_groups(allocator, self.windows)  # sliding layers may keep their own blocks
        self.storage = PagedStorage(self.allocator, self.info.num_layers, _DTYPES[self.info.dtype], self.kv_groups,
                                    self.kv_types)
        if self.recurrent:
            if allocator.states is None:  # a direct driver's pool: a state slot for every sequence it makes
                allocator.states = StateSlots()
            self.states = recurrent.RecurrentStorage(allocator.states, self.recurrent)

    @property
    def kv_spec(self) -> KVSpec:
        """Per token, what this rank's pool holds (its KV heads or its layers, in a group)."""
        if self.recurrent:
            return recurrent.kv_spec(self.info, _DTYPES[self.info.dtype].size, self.windows, self.recurrent)
        return sharding.local_kv_spec(KVSpec.uniform(self.info, _DTYPES[self.info.dtype].size, self.kv_types),
                                      self.shard)

    @property
    def kv_nbytes(self) -> int:
        """Bytes the KV storage (and any recurrent states) has allocated so far."""
        return sum(a.nbytes for a in self._arrays())

    @property
    def kv_slots(self) -> int:
        """Token slots the KV storage has allocated so far (each attention layer holds as many)."""
        return max((k.shape[0] for k in self.storage.keys if k is not None), default=0)

    @property
    def weight_nbytes(self) -> int:
        """Bytes of the model's parameters as loaded (what the memory estimate predicts)."""
        from mlx.utils import tree_flatten

        return sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))

    def _arrays(self) -> list[mx.array]:
        """Everything a step writes: the paged keys/values and any recurrent states."""
        return self.storage.arrays() + (self.states.arrays() if self.states is not None else [])

    def new_sequence(self) -> SequenceKV:
        """A sequence over the bound pool, for callers that drive the backend directly."""
        return SequenceKV(self.allocator)

    def copy_slots(self, src: np.ndarray, dst: np.ndarray, group: int = 0) -> None:
        self.storage.copy_slots(src, dst, group)

    def _run(self, rows: list[ForwardRow], fn=None, ids: mx.array | None = None) -> tuple[mx.array, RowLayout]:
        """One forward of `fn` (default: the whole model, giving logits) over the rows, packed
        when their lengths differ (base.RowLayout); `ids` ([B] on the device) replaces the rows'
        tokens in a one-token decode step."""
        for r in rows:
            r.cache.reserve(len(r.tokens))
        layout = RowLayout.of([len(r.tokens) for r in rows])
        kv = [(r.cache, len(r.tokens)) for r in rows]
        if layout.packed and self.packs_rows and self._may_pack(rows):
            plans = [PackedPlan(group_rows(kv, g), layout) for g in range(self.allocator.groups)]
            ids = mx.array(np.concatenate([r.tokens for r in rows]).astype(np.int32))[None]
            views = [PackedBatchView(self.storage, li, plans[g], w)
                     for li, (w, g) in enumerate(zip(self.windows, self.kv_groups))]
        else:
            layout = RowLayout(layout.n, False)
            plans = [StepPlan(group_rows(kv, g)) for g in range(self.allocator.groups)]
            plan = plans[0]
            if ids is None:
                host = np.zeros((plan.batch, plan.nmax), dtype=np.int32)
                for i, r in enumerate(rows):
                    host[i, : len(r.tokens)] = r.tokens
                ids = mx.array(host)
            else:
                ids = ids.reshape(plan.batch, 1)
            views = [PagedBatchView(self.storage, li, plans[g], w)
                     for li, (w, g) in enumerate(zip(self.windows, self.kv_groups))]
        states = recurrent.StateStep(kv) if self.recurrent else None
        if states is not None:
            views = [recurrent.RecurrentBatchView(self.states, li, states) if li in self.recurrent else v
                     for li, v in enumerate(views)]
        self._prepare_step(rows, layout)
        if self.lora is not None:
            self.lora.begin([r.lora for r in rows], layout)
        try:
            out = self._call(fn, ids, views, rows, layout)
        finally:
            self._deltas = {}
            if self.lora is not None:
                self.lora.end()
        if states is not None:
            states.commit(views)
        for r in rows:
            r.cache.tokens.extend(r.tokens)
        return out, layout

    def _may_pack(self, rows: list[ForwardRow]) -> bool:
        """Whether this step's rows may run packed (a step whose masks a model opens runs padded)."""
        return True

    def _call(self, fn, ids: mx.array, views: list, rows: list[ForwardRow], layout: RowLayout):
        """The step's forward of `fn` (default: the whole model) over the rows' views; a
        vision-language model builds its input embeddings from the rows here (backends/mlx/vlm.py)."""
        return (fn or self.model)(ids, cache=views)

    def forward(self, rows: list[ForwardRow]) -> np.ndarray:
        if not self.head:
            return self._follow(rows)
        logits, layout = self._run(rows)
        b, t = layout.last()
        last = logits[mx.array(b), mx.array(t)].astype(mx.float32)
        mx.eval(last, *self._arrays(), *(a for pair in self._reads.values() for a in pair))
        if self._reads:
            self._deliver_reads(rows, layout)
        return np.array(last, copy=False)

    def _follow(self, rows: list[ForwardRow]) -> np.ndarray:
        """A follower rank's share of a step: its layers' all-reduces or sends and KV writes,
        without the LM head; [rows, 0] logits (rank 0 has the real ones)."""
        with self.watchdog.guard("a forward step", 2.0) if self.watchdog is not None else nullcontext():
            hidden, _ = self._run(rows, decoder_stack(self.model))
            mx.eval(hidden, *self._arrays())
        return np.zeros((len(rows), 0), dtype=np.float32)

    def decode_greedy(self, rows: list[ForwardRow], ids: mx.array | None = None,
                      bias: list | None = None) -> mx.array:
        """Queue one decode step (one token per row, from the rows or from `ids`, a previous
        step's result) and return each row's argmax next token, [B] uint32, evaluating
        asynchronously: the caller builds the next step before reading this one
        (engine/decode_pipeline.py). `bias`: per row, {token id: added logit} (-inf bans).
        Rows that read residuals never come here."""
        logits, _ = self._run(rows, ids=ids)
        last = logits[:, -1, :]
        if bias is not None:
            dense = np.zeros((len(rows), last.shape[-1]), dtype=np.float32)
            for i, b in enumerate(bias):
                for tok, value in b.items():
                    if 0 <= tok < dense.shape[1]:
                        dense[i, tok] += value
            last = last.astype(mx.float32) + mx.array(dense)
        nxt = mx.argmax(last, axis=-1)
        mx.async_eval(nxt, *self._arrays())
        return nxt

    def _as_delta(self, block: np.ndarray) -> mx.array:
        return mx.array(block).astype(_DTYPES[self.info.dtype])

    def _as_numpy(self, x: mx.array) -> np.ndarray:
        return np.array(x.astype(mx.float32))

    def forward_all(self, tokens: list[int], cache: SequenceKV,
                    lora: tuple[float, ...] | None = None) -> np.ndarray:
        if not self.head:
            return self._follow([ForwardRow(tokens, cache, lora=lora)])
        logits, _ = self._run([ForwardRow(tokens, cache, lora=lora)])
        out = logits[0].astype(mx.float32)
        mx.eval(out, *self._arrays())
        return np.array(out, copy=False)

    def hidden_states(self, tokens: list[int], cache: SequenceKV) -> np.ndarray:
        """The final hidden states of every position, [n, hidden] fp32: after the model's final
        norm (transformers' last_hidden_state), since that is the representation the LM head
        reads and the one a transformers feature-extraction reference returns; the pre-norm
        residual carries a few huge-magnitude channels that would dominate any cosine."""
        if not self.head:
            return self._follow([ForwardRow(tokens, cache)])
        hidden, _ = self._run([ForwardRow(tokens, cache)], decoder_stack(self.model))
        out = hidden[0].astype(mx.float32)
        mx.eval(out, *self._arrays())
        return np.array(out)
