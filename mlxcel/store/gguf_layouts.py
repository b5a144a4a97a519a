"""How each llama.cpp GGUF architecture maps onto transformers' layout: the config.json its
metadata describes, the HF name of every tensor, and what llama.cpp's converter changed in them.

One `Layout` per `general.architecture` that models/gguf_archs.py lists (and no other): here
those in transformers' common Llama-like layout, in store/gguf_layouts_own.py those with their
own (latent attention, fused grouped projections, state-space blocks, remote-code names). A
metadata key an architecture always has is required; one llama.cpp does not write is the
architecture's constant, as llama.cpp's own graph for it assumes (Gemma 2's query scale, Qwen 3
MoE's normalised routing weights), so the converted model computes what llama.cpp would.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


class GGUFUnsupported(ValueError):
    """The GGUF file describes something this converter has no table for."""


class Meta:
    """A GGUF's metadata under its architecture's prefix, and which tensors it holds."""

    def __init__(self, reader, arch: str) -> None:
        self.reader, self.arch = reader, arch
        self.tensor_names = {t.name for t in reader.tensors}

    def get(self, key: str, default=None):
        f = self.reader.fields.get(f"{self.arch}.{key}")
        return default if f is None else f.contents()

    def need(self, key: str):
        value = self.get(key)
        if value is None:
            raise GGUFUnsupported(f"GGUF metadata {self.arch}.{key} is missing")
        return value

    def eps(self, key: str) -> float:
        # stored as float32: the shortest decimal that rounds to it (1e-06, not 9.99999997e-07)
        return float(str(np.float32(self.need(f"attention.{key}"))))

    def tensor(self, name: str) -> np.ndarray | None:
        """A whole-model tensor that is configuration rather than weights (Phi-3's RoPE factors)."""
        import gguf

        t = next((t for t in self.reader.tensors if t.name == name), None)
        return None if t is None else np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)

    def has_layer_tensor(self, stem: str) -> bool:
        """Whether some block holds `stem` ("attn_q.bias", "ffn_norm.weight")."""
        return any(n.startswith("blk.") and n.split(".", 2)[2] == stem for n in self.tensor_names)

    @property
    def tied(self) -> bool:
        return "output.weight" not in self.tensor_names


@dataclass(frozen=True)
class Layout:
    config: Callable[[Meta], dict]
    # GGUF stem under blk.N. -> HF stem under model.layers.N.; "{e}" in it: a stacked expert
    # tensor, written one HF tensor per expert
    layers: dict[str, str]
    final_norm: str = "model.norm"
    rotary_interleaved: bool = False  # llama.cpp permuted q/k rows into its rotary order
    norm_plus_one: bool = False  # Gemma: llama.cpp stores the (1 + w) scale, HF stores w
    # GGUF stem -> the HF stems a fused tensor splits into, in equal row blocks
    splits: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # the names that are joined after reading (experts transformers keeps fused): HF name ->
    # (the read names concatenated along axis 1, in order)
    joins: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # whole-model tensors that hold settings (RoPE factors), read into the config, not weights
    config_tensors: tuple[str, ...] = ()
    # whole-model tensors beyond the embedding, final norm and output: GGUF stem -> HF name
    top: dict[str, str] = field(default_factory=dict)
    # HF stems that name a bare parameter, written without a .weight / .bias suffix
    bare: tuple[str, ...] = ()
    # where the HF checkpoint keeps its blocks, embedding and output (a family's own names)
    block: str = "model.layers"
    embed: str = "model.embed_tokens"
    head: str = "lm_head"
    # the architecture's own undoing of llama.cpp's changes to one block tensor: (GGUF stem,
    # kind, tensor, config) -> tensor; the stems it changes are read dense (value by value)
    fix: Callable[[str, str, np.ndarray, dict], np.ndarray] | None = None
    dense: tuple[str, ...] = ()
    # HF tensors built from several read ones (a fused projection llama.cpp writes apart):
    # (tensors, config) -> None, in place
    assemble: Callable[[dict, dict], None] | None = None


def geometry(m: Meta, *, rope_is_head: bool = False) -> dict:
    hidden, heads = int(m.need("embedding_length")), int(m.need("attention.head_count"))
    head_dim = m.get("attention.key_length") or (m.get("rope.dimension_count") if rope_is_head else None)
    ff = m.get("feed_forward_length")
    return {
        "hidden_size": hidden,
        **({"intermediate_size": int(ff)} if ff is not None else {}),
        "num_hidden_layers": int(m.need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(m.get("attention.head_count_kv", heads)),
        "head_dim": int(head_dim or hidden // heads),
        "max_position_embeddings": int(m.need("context_length")),
        "rope_theta": float(m.get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": m.tied,
    }


def rope_scaling(m: Meta) -> dict:
    freqs = m.tensor("rope_freqs.weight")
    if freqs is not None:
        return _llama3_scaling(m, freqs)
    kind = m.get("rope.scaling.type")
    if kind in (None, "none"):
        return {}
    factor = float(m.need("rope.scaling.factor"))
    if kind == "linear":
        return {"rope_scaling": {"rope_type": "linear", "type": "linear", "factor": factor}}
    if kind == "yarn":
        block = {"rope_type": "yarn", "type": "yarn", "factor": factor,
                 "original_max_position_embeddings": int(m.need("rope.scaling.original_context_length"))}
        for key in ("beta_fast", "beta_slow"):
            if m.get(f"rope.scaling.yarn_{key}") is not None:
                block[key] = float(m.get(f"rope.scaling.yarn_{key}"))
        return {"rope_scaling": block}
    raise GGUFUnsupported(f"GGUF rope scaling {kind!r} ({m.arch}.rope.scaling.type) cannot be converted; "
                          f"supported: linear, yarn, and Llama 3's as rope_freqs")


def _llama3_factors(theta: float, dims: int, factor: float, original: int, low: float, high: float) -> np.ndarray:
    """The per-frequency divisors llama.cpp stores for Llama 3's RoPE scaling."""
    wavelen = 2 * np.pi * theta ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    smooth = (original / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, mid))


def _llama3_original(freqs: np.ndarray, theta: float, factor: float) -> int:
    """The original context a Llama 3 curve was computed for, where the file does not say
    (EXAONE 4's converter writes none): 8192 if the curve fits it, else what a frequency between
    the two plateaus gives (any other on the plateaus gives the same factors)."""
    dims = 2 * len(freqs)
    if np.allclose(freqs, _llama3_factors(theta, dims, factor, 8192, 1.0, 4.0), rtol=1e-5):
        return 8192
    wavelen = 2 * np.pi * theta ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    between = [(w, f) for w, f in zip(wavelen, freqs.astype(np.float64)) if 1.0 < f < factor]
    if not between:
        return 8192
    w, f = between[0]
    smooth = (1 / f - 1 / factor) / (1 - 1 / factor)
    return int(round(w * (3 * smooth + 1)))  # smooth = (original / w - low) / (high - low)


def _llama3_scaling(m: Meta, freqs: np.ndarray) -> dict:
    """Llama 3.1+'s RoPE scaling, which llama.cpp bakes into a rope_freqs tensor: recovered with
    Llama 3's own constants (low / high frequency factors 1 and 4, the original context the
    file gives or the curve implies), and refused when the tensor is not that curve."""
    factor = float(str(np.float32(freqs.max())))
    if factor == 1.0 and np.all(freqs == 1.0):
        return {}
    theta = float(m.get("rope.freq_base", 10000.0))
    original = m.get("rope.scaling.original_context_length")
    original = int(original) if original is not None else _llama3_original(freqs, theta, factor)
    if not np.allclose(freqs, _llama3_factors(theta, 2 * len(freqs), factor, original, 1.0, 4.0), rtol=1e-5):
        raise GGUFUnsupported(f"GGUF rope_freqs.weight is not Llama 3's RoPE scaling (factor {factor}, frequency "
                              f"factors 1 and 4, original context {original}); it cannot be converted")
    return {"rope_scaling": {"rope_type": "llama3", "type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": original}}


def ident(cls: str, model_type: str) -> dict:
    return {"architectures": [cls], "model_type": model_type}


ATTN = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj"}
GATED_FFN = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
LLAMA = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", **ATTN, **GATED_FFN}
QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
EXPERTS = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
            "ffn_up_exps": "mlp.experts.{e}.up_proj", "ffn_down_exps": "mlp.experts.{e}.down_proj"}
MIXTRAL_EXPERTS = {"ffn_gate_inp": "block_sparse_moe.gate", "ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
                    "ffn_down_exps": "block_sparse_moe.experts.{e}.w2",
                    "ffn_up_exps": "block_sparse_moe.experts.{e}.w3"}
_GEMMA2 = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
           "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
           **ATTN, **GATED_FFN}


def _llama(m: Meta) -> dict:
    c = {**geometry(m, rope_is_head=True), "rms_norm_eps": m.eps("layer_norm_rms_epsilon"), "hidden_act": "silu",
         "attention_bias": False, "mlp_bias": False, **rope_scaling(m)}
    if not m.get("expert_count"):
        return {**ident("LlamaForCausalLM", "llama"), **c}
    return {**ident("MixtralForCausalLM", "mixtral"), **c, "num_local_experts": int(m.need("expert_count")),
            "num_experts_per_tok": int(m.need("expert_used_count")), "sliding_window": None}


def _qwen2(m: Meta) -> dict:
    # Qwen 2's q/k/v biases are part of the architecture, not a config switch
    return {**ident("Qwen2ForCausalLM", "qwen2"), **geometry(m), "rms_norm_eps": m.eps("layer_norm_rms_epsilon"),
            "hidden_act": "silu", **rope_scaling(m)}


def _qwen3(m: Meta) -> dict:
    return {**ident("Qwen3ForCausalLM", "qwen3"), **geometry(m), "rms_norm_eps": m.eps("layer_norm_rms_epsilon"),
            "hidden_act": "silu", "attention_bias": False, **rope_scaling(m)}


def _moe(m: Meta) -> dict:
    """Qwen's MoE keys: every layer sparse, as llama.cpp builds them."""
    return {"num_experts": int(m.need("expert_count")), "num_experts_per_tok": int(m.need("expert_used_count")),
            "moe_intermediate_size": int(m.need("expert_feed_forward_length")), "decoder_sparse_step": 1,
            "mlp_only_layers": []}


def _qwen2moe(m: Meta) -> dict:
    shared = int(m.need("expert_shared_feed_forward_length"))
    # llama.cpp routes Qwen 2 MoE with the softmax weights as they are (no renormalising)
    return {**ident("Qwen2MoeForCausalLM", "qwen2_moe"), "intermediate_size": shared, **geometry(m),
            "rms_norm_eps": m.eps("layer_norm_rms_epsilon"), "hidden_act": "silu", **_moe(m),
            "shared_expert_intermediate_size": shared, "norm_topk_prob": False, **rope_scaling(m)}


def _qwen3moe(m: Meta) -> dict:
    # llama.cpp renormalises Qwen 3 MoE's top-k weights unless the file says otherwise
    return {**ident("Qwen3MoeForCausalLM", "qwen3_moe"), **geometry(m),
            "rms_norm_eps": m.eps("layer_norm_rms_epsilon"), "hidden_act": "silu", "attention_bias": False,
            **_moe(m), "norm_topk_prob": bool(m.get("expert_weights_norm", True)), **rope_scaling(m)}


def _gemma(m: Meta) -> dict:
    return {**ident("GemmaForCausalLM", "gemma"), **geometry(m), "rms_norm_eps": m.eps("layer_norm_rms_epsilon"),
            "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False}


def _gemma2(m: Meta) -> dict:
    c = geometry(m)
    layers = c["num_hidden_layers"]
    # GGUF has no query scale: llama.cpp scales by 1/sqrt(head_dim), except for the 27B model (its
    # 46 layers are how llama.cpp tells it) whose query_pre_attn_scalar is hidden / heads
    scalar = c["hidden_size"] // c["num_attention_heads"] if layers == 46 else c["head_dim"]
    return {**ident("Gemma2ForCausalLM", "gemma2"), **c, "rms_norm_eps": m.eps("layer_norm_rms_epsilon"),
            "hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": scalar, "sliding_window": int(m.need("attention.sliding_window")),
            # every other layer local, the first one included, as llama.cpp and transformers build them
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
            "attn_logit_softcapping": m.get("attn_logit_softcapping"),
            "final_logit_softcapping": m.get("final_logit_softcapping"), "attention_bias": False}


def _gemma3(m: Meta) -> dict:
    c = geometry(m)
    layers = c["num_hidden_layers"]
    # GGUF does not record the local/global layout, the local rope base or the query scale;
    # these are the Gemma 3 architecture constants (every 6th layer global, local base 1e4).
    pattern = 6
    return {**ident("Gemma3ForCausalLM", "gemma3_text"), **c, "rms_norm_eps": m.eps("layer_norm_rms_epsilon"),
            "rope_local_base_freq": 10000.0, "sliding_window": int(m.need("attention.sliding_window")),
            "sliding_window_pattern": pattern,
            "layer_types": ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)],
            "query_pre_attn_scalar": c["head_dim"], "hidden_activation": "gelu_pytorch_tanh",
            "attn_logit_softcapping": None, "final_logit_softcapping": None, "attention_bias": False}


def _phi2(m: Meta) -> dict:
    c = geometry(m)
    rotary = int(m.need("rope.dimension_count"))
    return {**ident("PhiForCausalLM", "phi"), **c, "layer_norm_eps": m.eps("layer_norm_epsilon"),
            "partial_rotary_factor": rotary / c["head_dim"], "hidden_act": "gelu_new", "qk_layernorm": False}


def _phi3(m: Meta) -> dict:
    c = geometry(m)
    window, rotary = m.get("attention.sliding_window"), m.get("rope.dimension_count")
    return {**ident("Phi3ForCausalLM", "phi3"), **c, "rms_norm_eps": m.eps("layer_norm_rms_epsilon"),
            "hidden_act": "silu", "sliding_window": int(window) if window else None,
            **({"partial_rotary_factor": int(rotary) / c["head_dim"]} if rotary else {}),
            **phi3_long_rope(m, c)}


def phi3_long_rope(m: Meta, c: dict) -> dict:
    """A long-context Phi-3's RoPE: llama.cpp stores its per-frequency factors as tensors and
    the attention factor it derives from the context lengths, which transformers derives again."""
    long, short = m.tensor("rope_factors_long.weight"), m.tensor("rope_factors_short.weight")
    if long is None:
        return {}
    original = int(m.need("rope.scaling.original_context_length"))
    scale = c["max_position_embeddings"] / original
    derived = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
    if not math.isclose(float(m.get("rope.scaling.attn_factor", derived)), derived, rel_tol=1e-5):
        raise GGUFUnsupported(f"GGUF {m.arch}.rope.scaling.attn_factor is not the one the context lengths give "
                              f"({derived:.6f}); transformers' long RoPE has no setting for another")

    def factors(w: np.ndarray) -> list[float]:
        return [float(str(x)) for x in w.astype(np.float32)]

    block = {"rope_type": "longrope", "type": "longrope", "long_factor": factors(long),
             "short_factor": factors(long if short is None else short)}
    return {"rope_scaling": block, "original_max_position_embeddings": original}


def _starcoder2(m: Meta) -> dict:
    window = m.get("attention.sliding_window")
    return {**ident("Starcoder2ForCausalLM", "starcoder2"), **geometry(m), "norm_epsilon": m.eps("layer_norm_epsilon"),
            "use_bias": m.has_layer_tensor("attn_q.bias"), "hidden_act": "gelu_pytorch_tanh",
            "sliding_window": int(window) if window else None}


def _stablelm(m: Meta) -> dict:
    c = geometry(m)
    return {**ident("StableLmForCausalLM", "stablelm"), **c, "layer_norm_eps": m.eps("layer_norm_epsilon"),
            "partial_rotary_factor": int(m.need("rope.dimension_count")) / c["head_dim"], "hidden_act": "silu",
            "use_qkv_bias": m.has_layer_tensor("attn_q.bias"),
            # a parallel-residual block has one norm, so no ffn_norm
            "use_parallel_residual": not m.has_layer_tensor("ffn_norm.weight"), "qk_layernorm": False}


def _command_r(m: Meta) -> dict:
    return {**ident("CohereForCausalLM", "cohere"), **geometry(m), "layer_norm_eps": m.eps("layer_norm_epsilon"),
            "logit_scale": float(m.need("logit_scale")), "use_qk_norm": m.has_layer_tensor("attn_q_norm.weight"),
            "hidden_act": "silu", "attention_bias": False}


def _cohere2(m: Meta) -> dict:
    c = geometry(m)
    rotary = m.get("rope.dimension_count")
    if rotary is not None and int(rotary) != c["head_dim"]:
        raise GGUFUnsupported(f"GGUF {m.arch}.rope.dimension_count {rotary} rotates part of each head; the "
                              f"family's modules rotate all {c['head_dim']} dimensions")
    # llama.cpp builds Cohere 2 with every 4th layer global (and without RoPE), as transformers does
    pattern = 4
    return {**ident("Cohere2ForCausalLM", "cohere2"), **c, "layer_norm_eps": m.eps("layer_norm_epsilon"),
            "logit_scale": float(m.need("logit_scale")), "sliding_window": int(m.need("attention.sliding_window")),
            "sliding_window_pattern": pattern,
            "layer_types": ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                            for i in range(c["num_hidden_layers"])],
            "hidden_act": "silu", "attention_bias": False}


def _olmo2(m: Meta) -> dict:
    c = {**geometry(m), "rms_norm_eps": m.eps("layer_norm_rms_epsilon"), "hidden_act": "silu",
         "attention_bias": False, **rope_scaling(m)}
    window = m.get("attention.sliding_window")
    if not window:
        return {**ident("Olmo2ForCausalLM", "olmo2"), **c}
    # OLMo 3 is llama.cpp's olmo2 with a window, its layout stored per layer (true: sliding)
    sliding = m.get("attention.sliding_window_pattern")
    if sliding is None:  # OLMo 3's own default: every 4th layer global
        sliding = [(i + 1) % 4 != 0 for i in range(c["num_hidden_layers"])]
    return {**ident("Olmo3ForCausalLM", "olmo3"), **c, "sliding_window": int(window),
            "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding]}


def _granite_scales(m: Meta) -> dict:
    return {"attention_multiplier": float(m.need("attention.scale")),
            "embedding_multiplier": float(m.need("embedding_scale")),
            "residual_multiplier": float(m.need("residual_scale")), "logits_scaling": float(m.need("logit_scale"))}


def _granite(m: Meta) -> dict:
    return {**ident("GraniteForCausalLM", "granite"), **geometry(m, rope_is_head=True),
            "rms_norm_eps": m.eps("layer_norm_rms_epsilon"), "hidden_act": "silu", "attention_bias": False,
            "mlp_bias": False, **_granite_scales(m), **rope_scaling(m)}


def _granitemoe(m: Meta) -> dict:
    c = geometry(m, rope_is_head=True)
    ff = m.get("expert_feed_forward_length", c.get("intermediate_size"))
    return {**ident("GraniteMoeForCausalLM", "granitemoe"), **c, "intermediate_size": int(ff),
            "rms_norm_eps": m.eps("layer_norm_rms_epsilon"), "hidden_act": "silu", "attention_bias": False,
            "num_local_experts": int(m.need("expert_count")), "num_experts_per_tok": int(m.need("expert_used_count")),
            **_granite_scales(m), **rope_scaling(m)}


def _olmoe(m: Meta) -> dict:
    clip = m.get("attention.clamp_kqv")
    # llama.cpp routes OLMoE with the softmax weights as they are (no renormalising)
    return {**ident("OlmoeForCausalLM", "olmoe"), **geometry(m), "rms_norm_eps": m.eps("layer_norm_rms_epsilon"),
            "hidden_act": "silu", "attention_bias": False, "num_experts": int(m.need("expert_count")),
            "num_experts_per_tok": int(m.need("expert_used_count")), "norm_topk_prob": False,
            "clip_qkv": float(clip) if clip else None}


def _glm4(m: Meta) -> dict:
    c = geometry(m)
    return {**ident("Glm4ForCausalLM", "glm4"), **c, "rms_norm_eps": m.eps("layer_norm_rms_epsilon"),
            "partial_rotary_factor": int(m.need("rope.dimension_count")) / c["head_dim"], "hidden_act": "silu",
            "attention_bias": m.has_layer_tensor("attn_q.bias")}


def _seed_oss(m: Meta) -> dict:
    return {**ident("SeedOssForCausalLM", "seed_oss"), **geometry(m), "rms_norm_eps": m.eps("layer_norm_rms_epsilon"),
            "hidden_act": "silu", "attention_bias": m.has_layer_tensor("attn_q.bias"),
            "attention_out_bias": m.has_layer_tensor("attn_output.bias"), "mlp_bias": False, **rope_scaling(m)}


def _nemotron(m: Meta) -> dict:
    c = geometry(m)
    return {**ident("NemotronForCausalLM", "nemotron"), **c, "norm_eps": m.eps("layer_norm_epsilon"),
            "partial_rotary_factor": int(m.need("rope.dimension_count")) / c["head_dim"], "hidden_act": "relu2",
            "attention_bias": False, "mlp_bias": False, **rope_scaling(m)}


def _smollm3(m: Meta) -> dict:
    c = geometry(m, rope_is_head=True)
    # GGUF has no NoPE layout: llama.cpp builds SmolLM3 with every 4th layer without RoPE
    interval = 4
    return {**ident("SmolLM3ForCausalLM", "smollm3"), **c, "rms_norm_eps": m.eps("layer_norm_rms_epsilon"),
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "no_rope_layer_interval": interval,
            "no_rope_layers": [int((i + 1) % interval != 0) for i in range(c["num_hidden_layers"])],
            **rope_scaling(m)}


def _ernie4_5(m: Meta) -> dict:
    return {**ident("Ernie4_5ForCausalLM", "ernie4_5"), **geometry(m), "rms_norm_eps": m.eps("layer_norm_rms_epsilon"),
            "hidden_act": "silu", "use_bias": m.has_layer_tensor("attn_q.bias"), **rope_scaling(m)}


def _lfm2(m: Meta) -> dict:
    # the KV head count per layer: 0 marks a short-convolution layer
    kv = [int(n) for n in m.need("attention.head_count_kv")]
    ff = int(m.need("feed_forward_length"))  # the MLP's size as built, so no adjusting again
    hidden = int(m.need("embedding_length"))
    return {**ident("Lfm2ForCausalLM", "lfm2"), "hidden_size": hidden, "num_hidden_layers": len(kv),
            "num_attention_heads": int(m.need("attention.head_count")), "num_key_value_heads": max(kv),
            "max_position_embeddings": int(m.need("context_length")), "rope_theta": float(m.need("rope.freq_base")),
            "norm_eps": m.eps("layer_norm_rms_epsilon"), "conv_L_cache": int(m.need("shortconv.l_cache")),
            "conv_bias": m.has_layer_tensor("shortconv.in_proj.bias"), "block_dim": hidden,
            "intermediate_size": ff, "block_ff_dim": ff, "block_auto_adjust_ff_dim": False, "block_multiple_of": 256,
            "block_ffn_dim_multiplier": 1.0, "layer_types": ["full_attention" if n else "conv" for n in kv],
            "full_attn_idxs": [i for i, n in enumerate(kv) if n], "tie_word_embeddings": m.tied}


def _gpt_oss(m: Meta) -> dict:
    c = geometry(m)
    scaling = rope_scaling(m)
    if "rope_scaling" in scaling:  # gpt-oss's YaRN keeps its correction range unrounded
        scaling["rope_scaling"]["truncate"] = False
    # every other layer local, the first one included, as llama.cpp and transformers build them
    types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(c["num_hidden_layers"])]
    return {**ident("GptOssForCausalLM", "gpt_oss"), **c, "intermediate_size": int(m.need("expert_feed_forward_length")),
            "rms_norm_eps": m.eps("layer_norm_rms_epsilon"), "hidden_act": "silu", "attention_bias": True,
            "num_local_experts": int(m.need("expert_count")), "num_experts_per_tok": int(m.need("expert_used_count")),
            "sliding_window": int(m.need("attention.sliding_window")), "layer_types": types, **scaling}


_GRANITE_MOE_IN = "block_sparse_moe.input_linear"
ROPE_FREQS = ("rope_freqs.weight",)  # the layouts whose config reads rope_scaling

LAYOUTS: dict[str, Layout] = {
    "llama": Layout(_llama, {**LLAMA, **MIXTRAL_EXPERTS}, rotary_interleaved=True, config_tensors=ROPE_FREQS),
    "qwen2": Layout(_qwen2, LLAMA, config_tensors=ROPE_FREQS),
    "qwen3": Layout(_qwen3, {**LLAMA, **QK_NORM}, config_tensors=ROPE_FREQS),
    "qwen2moe": Layout(_qwen2moe, {**LLAMA, **EXPERTS, "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
                                   "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                                   "ffn_up_shexp": "mlp.shared_expert.up_proj",
                                   "ffn_down_shexp": "mlp.shared_expert.down_proj"}, config_tensors=ROPE_FREQS),
    "qwen3moe": Layout(_qwen3moe, {**LLAMA, **QK_NORM, **EXPERTS}, config_tensors=ROPE_FREQS),
    "gemma": Layout(_gemma, LLAMA, norm_plus_one=True),
    "gemma2": Layout(_gemma2, _GEMMA2, norm_plus_one=True),
    "gemma3": Layout(_gemma3, {**_GEMMA2, **QK_NORM}, norm_plus_one=True),
    # Phi-2: llama.cpp writes the q/k/v of transformers' layout apart, the original release's fused
    "phi2": Layout(_phi2, {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                           "attn_v": "self_attn.v_proj", "attn_output": "self_attn.dense", "ffn_up": "mlp.fc1",
                           "ffn_down": "mlp.fc2"},
                   final_norm="model.final_layernorm",
                   splits={"attn_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")}),
    # Phi-3 keeps transformers' fused projections: q/k/v in one tensor, gate and up in another
    "phi3": Layout(_phi3, {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                           "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
                           "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"},
                   config_tensors=("rope_factors_long.weight", "rope_factors_short.weight")),
    "starcoder2": Layout(_starcoder2, {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                                       **ATTN, "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}),
    "stablelm": Layout(_stablelm, LLAMA),
    # Cohere's rotary is interleaved in transformers too, so llama.cpp leaves q/k as they are
    "command-r": Layout(_command_r, {"attn_norm": "input_layernorm", **ATTN, **GATED_FFN, **QK_NORM}),
    "cohere2": Layout(_cohere2, {"attn_norm": "input_layernorm", **ATTN, **GATED_FFN}),
    "olmo2": Layout(_olmo2, {**ATTN, **QK_NORM, "post_attention_norm": "post_attention_layernorm",
                             "post_ffw_norm": "post_feedforward_layernorm", **GATED_FFN}, config_tensors=ROPE_FREQS),
    "granite": Layout(_granite, LLAMA, rotary_interleaved=True, config_tensors=ROPE_FREQS),
    "smollm3": Layout(_smollm3, LLAMA, rotary_interleaved=True, config_tensors=ROPE_FREQS),
    "olmoe": Layout(_olmoe, {**LLAMA, **QK_NORM, **EXPERTS}),
    # GLM-4 keeps gate and up fused (like Phi-3) and norms after attention and the MLP too
    "glm4": Layout(_glm4, {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", **ATTN,
                           "post_attention_norm": "post_self_attn_layernorm", "post_ffw_norm": "post_mlp_layernorm",
                           "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"}),
    # Seed-OSS: its pre-MLP norm is what llama.cpp calls post_attention_norm
    "seed_oss": Layout(_seed_oss, {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                                   **ATTN, **GATED_FFN}, config_tensors=ROPE_FREQS),
    # Nemotron's LayerNorm1P scales by (1 + w), which llama.cpp stores; a plain MLP (relu squared)
    # ERNIE 4.5's rotary is interleaved in transformers too, so llama.cpp leaves q/k as they are
    "ernie4_5": Layout(_ernie4_5, LLAMA, config_tensors=ROPE_FREQS),
    # gpt-oss: the experts stay stacked, split into gate and up as llama.cpp stores them (mlx-lm's
    # own layout for them); attention sinks are a bare parameter
    "gpt-oss": Layout(_gpt_oss, {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                                 **ATTN, "attn_sinks": "self_attn.sinks", "ffn_gate_inp": "mlp.router",
                                 "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
                                 "ffn_down_exps": "mlp.experts.down_proj"}, bare=("self_attn.sinks",)),
    # LFM2: attention and short-convolution layers; its embedding norm is the final one
    "lfm2": Layout(_lfm2, {"attn_norm": "operator_norm", "ffn_norm": "ffn_norm", "attn_q": "self_attn.q_proj",
                           "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                           "attn_output": "self_attn.out_proj", "attn_q_norm": "self_attn.q_layernorm",
                           "attn_k_norm": "self_attn.k_layernorm", "shortconv.conv": "conv.conv",
                           "shortconv.in_proj": "conv.in_proj", "shortconv.out_proj": "conv.out_proj",
                           "ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2"},
                   top={"token_embd_norm": "model.embedding_norm"}),
    "nemotron": Layout(_nemotron, {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", **ATTN,
                                   "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}, norm_plus_one=True,
                       config_tensors=ROPE_FREQS),
    # transformers keeps Granite MoE's expert gate and up projections fused, gate first
    "granitemoe": Layout(_granitemoe, {**LLAMA, "ffn_gate_inp": "block_sparse_moe.router.layer",
                                       "ffn_gate_exps": f"{_GRANITE_MOE_IN}.gate",
                                       "ffn_up_exps": f"{_GRANITE_MOE_IN}.up",
                                       "ffn_down_exps": "block_sparse_moe.output_linear"},
                         rotary_interleaved=True, config_tensors=ROPE_FREQS,
                         joins={f"{_GRANITE_MOE_IN}.weight": (f"{_GRANITE_MOE_IN}.gate.weight",
                                                              f"{_GRANITE_MOE_IN}.up.weight")}),
}
