"""The torch backend: transformers' family modules under mlxcel's registry, paged KV and hooks.

transformers' model classes are the maintained reference implementations, so the forward
pass is theirs; mlxcel owns what surrounds it: the KV memory (paged.py), per-row positions
and masks, the last-position logits handed to the shared sampler, and the per-layer hook
point. Checkpoints load from a local directory only (never a hub). An MLX-quantized checkpoint
(affine, 2-8 bits) keeps its weights packed: quantized_load.py builds the model around them and
quantized.py runs its products; other quantization formats are refused.

Compute dtype on the CPU: bf16 by default where the CPU has AMX-BF16 tiles, fp32 otherwise.
In bf16, a prompt row's bits must not depend on the chunk it runs in, or a prompt-cache hit
answers differently from a cold prefill; mlxcel's AMX tile kernel gives that, torch's own bf16
linears do not (they block the work by the call's shape), so a CPU with AVX512-BF16 but no
AMX serves fp32 unless --dtype bfloat16 asks. On CUDA the checkpoint's dtype (fp16 when it is
fp32), on MPS fp16.

On CUDA the engine loop's work is one stream: every op goes on the device's default stream, in
the engine thread's order, and host-to-device copies leave pinned memory without blocking
(paged.py). Tensors other threads put on the device (adapters, SAEs, the weights at load) are on
that same stream, so the engine needs no events to wait for them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from mlxcel.config.rope import RopeOverrides
from mlxcel.engine.backend import ForwardRow, KVCacheTypes, KVSpec, ModelInfo, layer_windows
from mlxcel.backends.rows import RowLayout, RowSteering
from mlxcel.backends.torch import fused_ops, packed, quantized, recurrent
from mlxcel.backends.torch.cpu_kernels import cpu_flags
from mlxcel.backends.torch.packed import GroupPlans, PackedPlan, step_plan
from mlxcel.backends.torch.quantized_load import QuantizedLoadRefused, is_mlx_quantized, load_quantized
from mlxcel.backends.torch.paged import WINDOW_ATTR, PagedStepCache, PagedStorage, StepPlan, expands_cache
from mlxcel.backends.torch.row_gemv import (ALL, RowKernel, RowRouting, install_row_gemv, load_row_kernel, prompt_linears,
                                            prompt_tiles)
from mlxcel.engine.kv_block_pool import BlockAllocator, SequenceKV, StateSlots, group_rows, layer_groups
from mlxcel.models.checkpoint_config import read_config
from mlxcel.models.hooks import LayerHooks
from mlxcel.models.registry import UnsupportedModelType, family_for, mlx_only
from mlxcel.models.rope_overrides import RopeRefused, config_overrides, hf_rope_parameters
from mlxcel.native_build import BuildUnavailable

log = logging.getLogger("mlxcel.backend.torch")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class CheckpointRefused(ValueError):
    """The checkpoint cannot be served by this backend (said why, with what to do)."""


def cpu_has_amx_bf16() -> bool:
    """AMX-BF16 tiles on this CPU: where mlxcel's prompt kernel makes bf16 exact across chunks."""
    return "amx_bf16" in cpu_flags()


def resolve_dtype(requested: str, checkpoint_dtype: str, device: torch.device) -> str:
    if requested != "auto":
        if requested not in DTYPES:
            raise ValueError(f"unsupported dtype {requested!r}; use one of auto, {', '.join(DTYPES)}")
        return requested
    if device.type == "cpu":
        return "bfloat16" if cpu_has_amx_bf16() else "float32"
    if device.type == "mps":
        return "float16"
    return checkpoint_dtype if checkpoint_dtype in ("float16", "bfloat16") else "float16"


def context_length(config: dict) -> int:
    for key in ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length"):
        if isinstance(config.get(key), int) and config[key] > 0:
            return config[key]
    return 4096


def refuse_quantized(path: Path, config: dict) -> None:
    """Refuse a quantization the torch backend cannot run: anything but MLX's affine one."""
    q = config.get("quantization") or config.get("quantization_config")
    if q and not is_mlx_quantized(config):
        label = (q.get("mode") or q.get("quant_method") or "unknown") if isinstance(q, dict) else str(q)
        raise CheckpointRefused(
            f"{path} is quantized as {label}; the torch backend runs MLX's affine quantization and unquantized "
            f"SafeTensors only: serve it with --backend mlx, or point -m at the unquantized checkpoint")


class TorchLayerHooks(LayerHooks):
    """The registry whose first hook on a layer installs that layer's torch forward hook: a
    module with no forward hook takes torch's fast call path, so unhooked layers cost nothing."""

    def __init__(self, layers) -> None:
        super().__init__(len(layers))
        self._layers = layers
        self._installed: set[int] = set()

    def add(self, layer: int, hook):
        remove = super().add(layer, hook)
        if layer not in self._installed:
            self._layers[layer].register_forward_hook(self._runner(layer))
            self._installed.add(layer)
        return remove

    def _runner(self, i: int):
        def run(module, args, output):
            hooks = self.get(i)
            if not hooks:
                return None
            hidden = output[0] if isinstance(output, tuple) else output
            for hook in hooks:
                hidden = hook(i, hidden)
            return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

        return run


def _decode_flags(rows: list[ForwardRow]) -> list[bool]:
    """Which rows are one generated token each: they take the kernels' decode paths."""
    return [r.decode and len(r.tokens) == 1 for r in rows]


def install_torch_hooks(layers) -> LayerHooks:
    """Every decoder layer is a hook point; its torch hook is installed on first use."""
    return TorchLayerHooks(layers)


class TorchBackend(RowSteering):
    name = "torch"
    can_pack = True  # a text family's steps may pack rows (backends/torch/packed.py)

    def __init__(self, path: str | Path, dtype: str = "auto", device: str = "cpu", threads: int = -1,
                 rope: RopeOverrides | None = None, compile: bool = False,
                 build_env: Mapping[str, str] | None = None, kv_cache: KVCacheTypes | None = None) -> None:
        """`kv_cache`: how the KV pool stores keys and values (--cache-type-k / -v; default f16)."""
        path = Path(path)
        self.kv_types = kv_cache or KVCacheTypes()
        # normalised for mlxcel's own reads (RoPE overrides, geometry); transformers reads the file
        config = read_config(path)
        family = family_for(config)  # refuse an unknown model_type before reading weights
        if mlx_only(config):  # a family transformers has no class for, refused by name
            raise UnsupportedModelType(f"{mlx_only(config)}; serve it with --backend mlx")
        refuse_quantized(path, config)
        self._quantized = is_mlx_quantized(config)
        self.device = torch.device(device)
        if self.device.type == "cpu" and threads > 0:
            torch.set_num_threads(threads)
        ckpt_dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
        compute = resolve_dtype(dtype, ckpt_dtype, self.device)
        model = self._load_with_rope(path, config, DTYPES[compute], rope)
        self.model = model.to(self.device).eval()
        self.base = self._decoder_stack(model)
        # recurrent layers (layer -> state entries' shapes), probed before any kernel or hook is installed
        self.recurrent = recurrent.layer_states(model, self.device) if "recurrent" in family.attention else {}
        self.states: recurrent.RecurrentStorage | None = None
        # rows of different lengths share a padded forward, except where a scan's state would
        # run on through the padding (backends/torch/recurrent.py); else one forward per group
        self.pads_rows = bool(self.recurrent) and not any(recurrent.SCAN in e for e in self.recurrent.values())
        self.lm_head = model.get_output_embeddings()
        self.row_kernel = "torch"  # what runs decode rows' linears (the startup log says)
        self.prompt_linears = "torch"  # and prompt rows'
        self._prompt_tiles = False  # whether those are the AMX tiles (set_row_linears)
        self.fused_ops = "none"  # which per-layer ops run fused (the startup log says)
        self._routing = RowRouting(None)
        self._fused_attention = "off"  # which steps' queries attend through the kernels
        kernel = None
        if self.device.type == "cpu" and compute in ("bfloat16", "float32"):
            # decode rows' linears through mlxcel's kernel (not under --torch-compile: the graph
            # would trace it), else torch.mv for one row: less time per token in bf16, and in
            # fp32 two threads where torch's one-row product took one (docs/benchmarks.md)
            kernel = None if compile else self._row_kernel(build_env)
            self.set_row_linears(kernel)
        # --torch-compile: one dynamic-shape graph set for the decoder stack, compiled on first use
        self._base_forward = torch.compile(self.base, dynamic=True) if compile else self.base
        # rows of different lengths share one forward where the family takes the packed
        # attention (not under compile: its per-step plan lives outside the graph)
        # a recurrent family's steps never pack (a packed step would run its rows as one sequence)
        self.packs_rows = self.can_pack and not compile and not self.recurrent and packed.install(self.model)
        if kernel is not None:
            self.set_fused_ops(True)
        text_config = model.config.get_text_config()
        quantization_label = quantized.label(list(self.model.modules()))
        # transforms the causal-LM classes apply after the head: Gemma 2's soft-cap, Cohere's
        # logit_scale (a product) and Granite's logits_scaling (a quotient)
        self.softcap = getattr(text_config, "final_logit_softcapping", None)
        self.logit_scale = getattr(text_config, "logit_scale", None)
        self.logits_divisor = getattr(text_config, "logits_scaling", None)
        self._layer_types = getattr(text_config, "layer_types", None)
        self._window = getattr(text_config, "sliding_window", None)
        # DBRX keeps its decoder layers as `blocks`, every other family as `layers`
        layers = self.base.layers if hasattr(self.base, "layers") else self.base.blocks
        self.hooks = install_torch_hooks(layers)
        self._init_steering()  # per-step SAE deltas and residual reads (backends/rows.RowSteering)
        self.lora = None  # TorchLoraTerms once adapters are attached
        self.info = ModelInfo(
            path=path,
            model_type=config["model_type"],
            num_layers=len(layers),
            vocab_size=int(config.get("vocab_size") or text_config.vocab_size),
            context_length=context_length({**config.get("text_config", {}), **config}),
            dtype=compute,
            checkpoint_dtype=ckpt_dtype,
            quantization=quantization_label,
            backend="torch",
            device=str(self.device),
            config={**config.get("text_config", {}), **config},  # a VLM keeps its geometry in text_config
        )
        self._set_windows(layers)
        if self.recurrent:
            self.kv_types.refuse_quantized("this model's recurrent layers keep one state per sequence")
        self.kv_spec  # noqa: B018 - refuses a quantized KV mode the layers cannot hold, before any step
        # a pool of one context for direct drivers (tests, benchmarks); the engine binds its own
        self.bind_kv(BlockAllocator((self.info.context_length // 16) + 8, 16))

    def _load_with_rope(self, path: Path, config: dict, dtype: torch.dtype, rope: RopeOverrides | None):
        """The model, with --rope-* / --yarn-* applied: transformers builds its rotation from
        config.rope_parameters, so the overrides go in there, and a family that ignored them is refused."""
        import transformers

        rope_config = config_overrides(config, rope) if rope is not None else {}
        if not rope_config:
            return self._load_model(path, dtype, {})
        hf_config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
        want = hf_rope_parameters(hf_config.rope_parameters, rope_config)
        hf_config.rope_parameters = want
        model = self._load_model(path, dtype, {"config": hf_config})
        if model.config.get_text_config().rope_parameters != want:
            raise RopeRefused(f"the {config['model_type']} family did not take the requested RoPE override "
                              f"({want}); it cannot be honoured here")
        return model

    def _set_windows(self, layers) -> None:
        """Each attention module carries its layer's declared window (engine.backend.layer_windows)
        as `WINDOW_ATTR`, which the kernels and the packed groups read; a padded step's mask is one
        per layer type, or one for all layers when the config names no types (Mistral's window on
        every layer). The family's own `sliding_window` stays as transformers set it: EXAONE 4
        reads it to decide which layers rotate."""
        self.windows = layer_windows(self.info.config, len(layers))
        for layer, window in zip(layers, self.windows):
            attn = getattr(layer, "self_attn", None)
            if attn is not None:
                setattr(attn, WINDOW_ATTR, window)
        if not self._layer_types and len(set(self.windows)) > 1:
            raise CheckpointRefused(f"{self.info.model_type}: the config gives layers different sliding windows "
                                    "without layer_types, which this backend cannot mask per layer")

    def _row_kernel(self, build_env: Mapping[str, str] | None) -> RowKernel | None:
        if build_env is None:
            return None
        try:
            return load_row_kernel(build_env)
        except BuildUnavailable as e:
            log.warning("decode rows' linears use torch's kernels, slower: %s", e)
            return None

    def set_row_linears(self, kernel: RowKernel | None) -> None:
        """Decode rows' linears through mlxcel's kernel, or torch.mv for one row when None
        (benchmarks switch); the language model's linears only (a vision tower's stay torch's)."""
        self._routing = install_row_gemv(kernel, self.base, self.lm_head)
        packed = quantized.install_kernel(kernel, self.base, self.lm_head)
        self.row_kernel = (f"mlxcel row kernel ({kernel.path.name}, {kernel.threads} threads)"
                           if kernel is not None else "torch.mv")
        self._prompt_tiles = prompt_tiles(kernel, self.model.dtype) is not None
        self.prompt_linears = prompt_linears(kernel, self.model.dtype)
        if quantized.quantized_linears(self.base, self.lm_head):  # the startup log names their path too
            how = (f"; MLX-quantized linears ({packed}): mlxcel's quantized kernel, every row" if packed
                   else "; MLX-quantized linears: dequantized a chunk at a time, torch's products")
            self.row_kernel += how
            self.prompt_linears += how

    def set_fused_ops(self, on: bool, attention: bool = True) -> None:
        """The kernels' fused norms, RoPE and (with `attention`) row-by-row attention
        (fused_ops.py: decode rows', and prompt tokens' where the AMX tiles run), or the
        family's own ops and SDPA (benchmarks switch); needs the kernels loaded
        (set_row_linears, called first: the attention follows its prompt linears)."""
        fused_ops.remove_norms(self.model)
        fused_ops.remove_rope(self.model)
        self._fused_attention = "off"
        self.fused_ops = "none"
        if not on:
            return
        norms = fused_ops.install_norms(self.model)
        rope = fused_ops.install_rope(self.model)
        # decode rows attend through the kernel in every step (their bits then do not depend on
        # what shares it); prompt tokens too only where the AMX tiles run the prompt linears:
        # only there does the kernel buy chunk-independent bits, and elsewhere prompt tokens one
        # by one cost 2.8x SDPA's prefill at 2048 tokens (fp32 on an AVX2 CPU)
        tiles = self._prompt_tiles
        # the kernels read the pool as per-head keys and values, which MLA's latent is not
        latent = any(expands_cache(m) for m in self.model.modules())
        attention = attention and self.packs_rows and not latent
        self._fused_attention = "off" if not attention else "all" if tiles else "decode rows"
        self.fused_ops = (f"{norms} RMSNorms, RoPE in {len(rope)} family modules, "
                          f"row-by-row attention: {self._fused_attention}")

    def _load_model(self, path: Path, dtype: torch.dtype, extra: dict):
        import transformers

        # the load's own progress (runtime/load.py) covers this step; transformers' bar would
        # redraw over it on a terminal and fill a log file with carriage returns
        transformers.utils.logging.disable_progress_bar()

        def load(implementation: str):
            if self._quantized:
                try:
                    return load_quantized(path, read_config(path), dtype, implementation, extra.get("config")), {}
                except QuantizedLoadRefused as e:
                    raise CheckpointRefused(str(e)) from None
            return transformers.AutoModelForCausalLM.from_pretrained(
                str(path), dtype=dtype, local_files_only=True, attn_implementation=implementation,
                output_loading_info=True, **extra)

        try:
            model, loading = load("sdpa")
        except ValueError as e:
            if "scaled_dot_product_attention" not in str(e):
                raise
            # a family whose attention SDPA cannot compute (Gemma 2's soft-capping): loaded eager,
            # then packed.install moves it to mlxcel's attention, which computes it (scores.py)
            model, loading = load("eager")
        missing = sorted(loading.get("missing_keys") or ())
        if missing:
            # transformers would fill them with random values; an MLX conversion's stacked MoE
            # experts (switch_mlp) are the usual cause
            raise CheckpointRefused(f"{path}: the checkpoint lacks {len(missing)} weights the {model.config.model_type} "
                                    f"class needs (first: {missing[0]}); the torch backend reads transformers' layout, "
                                    "so serve an MLX conversion with --backend mlx")
        return model

    def _decoder_stack(self, model):
        """The module mapping token ids to final hidden states (embeddings, layers, norm); in a
        multimodal checkpoint served for text (Gemma 3's), its language model's."""
        base = getattr(model, model.base_model_prefix)
        return getattr(base, "language_model", base)

    def attach_lora(self, adapters) -> None:
        """Serve these adapters unfused (models/lora.py); raises LoraError if one does not fit."""
        from mlxcel.backends.torch.lora import TorchLoraTerms

        self.lora = TorchLoraTerms(self.model, adapters, DTYPES[self.info.dtype], self.device)

    def bind_kv(self, allocator: BlockAllocator) -> None:
        """(Re)build KV storage for the pool `allocator` hands out; only while no sequence is live."""
        self.allocator = allocator
        self.kv_groups = layer_groups(allocator, self.windows)  # sliding layers may keep their own blocks
        self.storage = PagedStorage(self.allocator, self.info.num_layers, DTYPES[self.info.dtype], self.device,
                                    self.kv_groups, self.kv_types)
        if self.recurrent:
            if allocator.states is None:  # a direct driver's pool: a state slot for every sequence it makes
                allocator.states = StateSlots()
            self.states = recurrent.RecurrentStorage(allocator.states, self.recurrent, self.device)

    @property
    def kv_spec(self) -> KVSpec:
        if self.recurrent:
            return recurrent.kv_spec(self.info, DTYPES[self.info.dtype].itemsize, self.windows, self.recurrent)
        return KVSpec.uniform(self.info, DTYPES[self.info.dtype].itemsize, self.kv_types)

    @property
    def kv_nbytes(self) -> int:
        """Bytes the KV storage (and any recurrent states) has allocated so far."""
        return self.storage.nbytes + (self.states.nbytes if self.states is not None else 0)

    @property
    def kv_slots(self) -> int:
        """Token slots the KV storage has allocated so far (each attention layer holds as many)."""
        return max((k.shape[0] for k in self.storage.keys if k is not None), default=0)

    @property
    def weight_nbytes(self) -> int:
        """Bytes of the model's parameters and buffers as loaded, each storage once (tied
        embeddings share one): what the memory estimate predicts."""
        seen, total = set(), 0
        for t in [*self.model.parameters(), *self.model.buffers()]:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    def new_sequence(self) -> SequenceKV:
        """A sequence over the bound pool, for callers that drive the backend directly."""
        return SequenceKV(self.allocator)

    @torch.inference_mode()  # the pool's tensors are made in a forward: inference tensors
    def copy_slots(self, src: np.ndarray, dst: np.ndarray, group: int = 0) -> None:
        self.storage.copy_slots(src, dst, group)

    def _masks(self, plan: StepPlan):
        """A 4-D mask for uniform families; one per layer type where the config names them."""
        dtype = DTYPES[self.info.dtype]
        if not self._layer_types:
            return plan.mask(self.windows[0] if self.windows else None, dtype)
        kinds = set(self._layer_types)
        stateful = {self._layer_types[li] for li in self.recurrent}  # their padding is handled by the cache
        return {k: None if k in stateful else plan.mask(self._window if k == "sliding_attention" else None, dtype)
                for k in kinds}

    def _run(self, rows: list[ForwardRow]) -> tuple[torch.Tensor, RowLayout]:
        """One forward over the rows, packed when their lengths differ (base.RowLayout)."""
        for r in rows:
            r.cache.reserve(len(r.tokens))
        layout = RowLayout.of([len(r.tokens) for r in rows])
        if not self.packs_rows:
            layout = RowLayout(layout.n, False)
        kv = [(r.cache, len(r.tokens)) for r in rows]
        decoding = _decode_flags(rows)
        # decode rows attend through the kernel (fused_ops.py), chosen by what a row is
        decode = decoding if self._fused_attention != "off" else None
        prompts = self._fused_attention == "all"  # prompt tokens too, else SDPA
        groups = range(self.allocator.groups)  # each block group's rows (kv_block_pool.group_rows)
        if layout.packed:
            plans = [PackedPlan(group_rows(kv, g), layout, self.storage, self.device, decode, prompts) for g in groups]
            ids = np.concatenate([r.tokens for r in rows]).astype(np.int64)[None]
        else:
            plans = [StepPlan(group_rows(kv, g), self.device, self.storage, decode, prompts) for g in groups]
            if self._base_forward is not self.base:
                for plan in plans:  # compiled: one KV read path, so block order cannot force a recompile
                    plan.read_start = None
            ids = np.zeros((plans[0].batch, plans[0].nmax), dtype=np.int64)
            for i, r in enumerate(rows):
                ids[i, : len(r.tokens)] = r.tokens
        plan = plans[0] if len(plans) == 1 else GroupPlans(plans, self.kv_groups)
        self._prepare_step(rows, layout)
        if self.lora is not None:
            self.lora.begin([r.lora for r in rows], layout)
        try:
            with step_plan(plan), self._routing.decode_rows(self._decode_rows(decoding, layout)):
                out = self._forward_stack(torch.from_numpy(ids).to(self.device), plan, rows)
        finally:
            self._deltas = {}
            if self.lora is not None:
                self.lora.end()
        for r in rows:
            r.cache.tokens.extend(r.tokens)
        return out.last_hidden_state, layout

    def _decode_rows(self, decoding: list[bool], layout: RowLayout | None = None) -> torch.Tensor | str | None:
        """The step's decode rows (`_decode_flags`) as row_gemv.RowRouting reads them: positions
        in the flattened [batch * tokens] input when `layout` is given, else row numbers (the LM
        head's input)."""
        dec = [i for i, d in enumerate(decoding) if d]
        if not dec:
            return None
        if len(dec) == len(decoding) and (layout is None or max(layout.n) == 1):
            return ALL
        if layout is None:
            at = dec
        elif layout.packed:
            starts = layout.starts
            at = [starts[i] for i in dec]
        else:
            at = [i * max(layout.n) for i in dec]
        return torch.tensor(at, dtype=torch.long, device=self.device)

    def _forward_stack(self, ids: torch.Tensor, plan: StepPlan, rows: list[ForwardRow]):
        if self.states is None:
            return self._base_forward(input_ids=ids, attention_mask=self._masks(plan), position_ids=plan.position_ids,
                                      cache=PagedStepCache(self.storage, plan), use_cache=True)
        step = recurrent.StateRows([(r.cache, len(r.tokens)) for r in rows], self.device)
        cache = recurrent.RecurrentStepCache(self.storage, plan, self.states, step)
        extra = {}
        if len(self.recurrent) < self.info.num_layers:  # attention layers read positions and masks
            extra = {"attention_mask": self._masks(plan), "position_ids": plan.position_ids}
        out = self._base_forward(input_ids=ids, cache=cache, use_cache=True, **extra)
        cache.commit()
        return out

    def _as_delta(self, block: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(block).to(self.device, DTYPES[self.info.dtype])

    def _as_numpy(self, x: torch.Tensor) -> np.ndarray:
        return x.float().cpu().numpy()

    def _logits(self, hidden: torch.Tensor) -> np.ndarray:
        logits = self.lm_head(hidden)
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.logits_divisor is not None:
            logits = logits / self.logits_divisor
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float().cpu().numpy()

    @torch.inference_mode()
    def forward(self, rows: list[ForwardRow]) -> np.ndarray:
        wanted = RowLayout.of([len(r.tokens) for r in rows])
        if wanted.packed and not self.packs_rows and not self.pads_rows:
            # a family that cannot pack: the step's rows as padded forwards, logits in row order
            got: dict[int, np.ndarray] = {}
            for g in wanted.padded_groups():
                got.update(zip(g, self.forward([rows[i] for i in g])))
            return np.stack([got[i] for i in range(len(rows))])
        hidden, layout = self._run(rows)
        b, t = layout.last()
        with self._routing.decode_rows(self._decode_rows(_decode_flags(rows))):
            logits = self._logits(hidden[torch.tensor(b, device=self.device), torch.tensor(t, device=self.device)])
        if self._reads:
            self._deliver_reads(rows, layout)
        return logits

    @torch.inference_mode()
    def forward_all(self, tokens: list[int], cache: SequenceKV,
                    lora: tuple[float, ...] | None = None) -> np.ndarray:
        hidden, _ = self._run([ForwardRow(tokens, cache, lora=lora)])
        self._reads = {}
        return self._logits(hidden[0])

    @torch.inference_mode()
    def hidden_states(self, tokens: list[int], cache: SequenceKV) -> np.ndarray:
        """[n, hidden] fp32 after the final norm (last_hidden_state), as on the MLX backend."""
        hidden, _ = self._run([ForwardRow(tokens, cache)])
        return hidden[0].float().cpu().numpy()
