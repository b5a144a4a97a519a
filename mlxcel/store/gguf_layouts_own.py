"""The GGUF architectures whose HF checkpoint has a layout of its own: fused projections in a
family's own grouping (InternLM 2, GPT-NeoX, DBRX), multi-head latent attention (DeepSeek V2 and
V3), state-space blocks (Mamba 2), and weight names the hub's remote code chose (EXAONE 3).

Each `Layout` (store/gguf_layouts.py) says where the family keeps its blocks and how to undo what
llama.cpp's converter did to its tensors; the rest of the reading is store/gguf_source.py's.
"""

from __future__ import annotations

import numpy as np

from mlxcel.models.checkpoint_config import layer_period
from mlxcel.store.gguf_layouts import (
    ATTN,
    GATED_FFN,
    LLAMA,
    MIXTRAL_EXPERTS,
    QK_NORM,
    ROPE_FREQS,
    GGUFUnsupported,
    Layout,
    Meta,
    geometry,
    ident,
    phi3_long_rope,
    rope_scaling,
)


def _hunyuan_dense(m: Meta) -> dict:
    # llama.cpp folds HunYuan's NTK-alpha RoPE into the base it stores, so the base is plain
    return {**ident("HunYuanDenseV1ForCausalLM", "hunyuan_v1_dense"), **geometry(m),
            "rms_norm_eps": m.eps("layer_norm_rms_epsilon"), "hidden_act": "silu", "attention_bias": False,
            "mlp_bias": False, "use_qk_norm": m.has_layer_tensor("attn_q_norm.weight")}


def _exaone(m: Meta) -> dict:
    c = geometry(m)
    rotary = m.get("rope.dimension_count")
    if rotary is not None and int(rotary) != c["head_dim"]:
        raise GGUFUnsupported(f"GGUF {m.arch}.rope.dimension_count {rotary} rotates part of each head; EXAONE's "
                              f"modules rotate all {c['head_dim']} dimensions")
    # EXAONE 3 is Llama's decoder; its weights keep the hub's remote-code names (below)
    return {**ident("LlamaForCausalLM", "exaone"), **c, "rms_norm_eps": m.eps("layer_norm_rms_epsilon"),
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, **rope_scaling(m)}


def _exaone4(m: Meta) -> dict:
    c = geometry(m)
    window = m.get("attention.sliding_window")
    sliding = m.get("attention.sliding_window_pattern") if window else None
    if window and sliding is None:  # EXAONE 4's own default: every 4th layer global
        sliding = [(i + 1) % 4 != 0 for i in range(c["num_hidden_layers"])]
    types = ["sliding_attention" if s else "full_attention" for s in (sliding or [False] * c["num_hidden_layers"])]
    period = layer_period(types) if window else None
    return {**ident("Exaone4ForCausalLM", "exaone4"), **c, "rms_norm_eps": m.eps("layer_norm_rms_epsilon"),
            "hidden_act": "silu", "sliding_window": int(window) if window else None, "layer_types": types,
            **({"sliding_window_pattern": period} if period else {}), **rope_scaling(m)}


def _phimoe(m: Meta) -> dict:
    c = geometry(m)
    # llama.cpp builds Phi-3.5-MoE without its sliding window, so the conversion has none either
    return {**ident("PhimoeForCausalLM", "phimoe"), **c, "rms_norm_eps": m.eps("layer_norm_rms_epsilon"),
            "hidden_act": "silu", "sliding_window": None, "num_local_experts": int(m.need("expert_count")),
            "num_experts_per_tok": int(m.need("expert_used_count")),
            "attention_bias": m.has_layer_tensor("attn_q.bias"), "lm_head_bias": "output.bias" in m.tensor_names,
            **phi3_long_rope(m, c)}


def _internlm2(m: Meta) -> dict:
    return {**ident("InternLM2ForCausalLM", "internlm2"), **geometry(m),
            "rms_norm_eps": m.eps("layer_norm_rms_epsilon"), "bias": m.has_layer_tensor("attn_q.bias"),
            **rope_scaling(m)}


def _internlm2_wqkv(tensors: dict, config: dict) -> None:
    """InternLM 2's fused projection, grouped per KV head (its queries, then its key and value),
    from the q, k and v llama.cpp writes apart."""
    heads, kv, dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    for name in [k for k in tensors if k.endswith(".attention.wq.weight") or k.endswith(".attention.wq.bias")]:
        prefix, kind = name.rsplit(".wq.", 1)
        q, k, v = (tensors.pop(f"{prefix}.{p}.{kind}") for p in ("wq", "wk", "wv"))
        rest = q.shape[1:]
        groups = [q.reshape(kv, heads // kv, dim, *rest), k.reshape(kv, 1, dim, *rest), v.reshape(kv, 1, dim, *rest)]
        tensors[f"{prefix}.wqkv.{kind}"] = np.concatenate(groups, axis=1).reshape(-1, *rest)


def _gptneox(m: Meta) -> dict:
    c = geometry(m)
    return {**ident("GPTNeoXForCausalLM", "gpt_neox"), **c, "layer_norm_eps": m.eps("layer_norm_epsilon"),
            "partial_rotary_factor": int(m.need("rope.dimension_count")) / c["head_dim"], "hidden_act": "gelu",
            "use_parallel_residual": bool(m.get("use_parallel_residual", True)),
            "attention_bias": m.has_layer_tensor("attn_qkv.bias")}


def _gptneox_fix(stem: str, kind: str, w: np.ndarray, config: dict) -> np.ndarray:
    # llama.cpp writes GPT-NeoX's q/k/v one after another; transformers interleaves them per head
    if stem != "attn_qkv":
        return w
    heads = config["num_attention_heads"]
    return w.reshape(3, heads, -1, *w.shape[1:]).swapaxes(0, 1).reshape(w.shape)


def _dbrx(m: Meta) -> dict:
    c = geometry(m)
    clip = m.get("attention.clamp_kqv")
    # DBRX names its shape itself and nests attention and MLP settings; llama.cpp routes it with
    # the top-k weights renormalised, as moe_normalize_expert_weights 1 does
    return {**ident("DbrxForCausalLM", "dbrx"), "d_model": c["hidden_size"], "n_heads": c["num_attention_heads"],
            "n_layers": c["num_hidden_layers"], "max_seq_len": c["max_position_embeddings"],
            "tie_word_embeddings": c["tie_word_embeddings"],
            "attn_config": {"kv_n_heads": c["num_key_value_heads"], "rope_theta": c["rope_theta"],
                            "clip_qkv": float(clip) if clip else None},
            "ffn_config": {"ffn_hidden_size": c["intermediate_size"], "moe_num_experts": int(m.need("expert_count")),
                           "moe_top_k": int(m.need("expert_used_count")), "moe_normalize_expert_weights": 1.0,
                           "ffn_act_fn": {"name": "silu"}}}


def _dbrx_fix(stem: str, kind: str, w: np.ndarray, config: dict) -> np.ndarray:
    # DBRX keeps each expert projection as one [experts * ffn, d_model] matrix, the down one
    # transposed per expert; llama.cpp stacks them [experts, rows, inputs]
    if stem == "ffn_down_exps":
        w = w.swapaxes(1, 2)
    return w.reshape(-1, w.shape[-1]) if stem.endswith("_exps") else w


def _deepseek2(m: Meta) -> dict:
    c = geometry(m)
    heads, rope = c["num_attention_heads"], int(m.need("rope.dimension_count"))
    qk = int(m.get("attention.key_length_mla") or m.need("attention.key_length"))
    v3 = m.get("expert_gating_func") == 2  # sigmoid routing (llama.cpp's gating type 2) is V3's
    q_rank = m.get("attention.q_lora_rank")
    groups = m.get("expert_group_count")
    scaling = rope_scaling(m)
    if "rope_scaling" in scaling and m.get("rope.scaling.yarn_log_multiplier") is not None:
        # llama.cpp stores 0.1 * mscale_all_dim and assumes mscale equal to it
        mscale = float(f"{float(m.get('rope.scaling.yarn_log_multiplier')) / 0.1:.6g}")
        scaling["rope_scaling"].update(mscale=mscale, mscale_all_dim=mscale)
    out = {**ident(*(("DeepseekV3ForCausalLM", "deepseek_v3") if v3 else ("DeepseekV2ForCausalLM", "deepseek_v2"))),
           **c, "num_key_value_heads": heads, "head_dim": rope, "rms_norm_eps": m.eps("layer_norm_rms_epsilon"),
           "hidden_act": "silu", "attention_bias": False, "kv_lora_rank": int(m.need("attention.kv_lora_rank")),
           "q_lora_rank": int(q_rank) if q_rank else None, "qk_rope_head_dim": rope, "qk_nope_head_dim": qk - rope,
           "qk_head_dim": qk,
           "v_head_dim": int(m.get("attention.value_length_mla") or m.need("attention.value_length")),
           "first_k_dense_replace": int(m.get("leading_dense_block_count", 0)),
           "moe_intermediate_size": int(m.need("expert_feed_forward_length")),
           "n_routed_experts": int(m.need("expert_count")), "num_experts_per_tok": int(m.need("expert_used_count")),
           "n_shared_experts": int(m.get("expert_shared_count", 0)),
           "routed_scaling_factor": float(m.get("expert_weights_scale", 1.0)),
           "norm_topk_prob": bool(m.get("expert_weights_norm", False)),
           "n_group": int(groups) if groups else (1 if v3 else None),
           "topk_group": int(m.get("expert_group_used_count") or 1) if groups or v3 else None, **scaling}
    if v3:
        return {**out, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "rope_interleave": True}
    return {**out, "topk_method": "group_limited_greedy" if groups else "greedy"}


def _deepseek2_kv_b(tensors: dict, config: dict) -> None:
    """DeepSeek's kv_b_proj from the per-head key and value halves llama.cpp writes apart (the
    key half transposed, so its attention can absorb it)."""
    heads = config["num_attention_heads"]
    for name in [k for k in tensors if k.endswith(".self_attn.k_b.weight")]:
        prefix = name.removesuffix(".k_b.weight")
        k_b, v_b = tensors.pop(name), tensors.pop(f"{prefix}.v_b.weight")
        k_b = k_b.reshape(heads, -1, k_b.shape[-1]).swapaxes(1, 2)  # [heads, nope, kv_lora_rank]
        v_b = v_b.reshape(heads, -1, v_b.shape[-1])
        tensors[f"{prefix}.kv_b_proj.weight"] = np.concatenate([k_b, v_b], axis=1).reshape(-1, k_b.shape[-1])


def _mamba2(m: Meta) -> dict:
    hidden, inner = int(m.need("embedding_length")), int(m.need("ssm.inner_size"))
    heads = int(m.need("ssm.time_step_rank"))  # llama.cpp's name for Mamba 2's head count
    return {**ident("Mamba2ForCausalLM", "mamba2"), "hidden_size": hidden, "intermediate_size": inner,
            "expand": inner // hidden, "num_heads": heads, "head_dim": inner // heads,
            "state_size": int(m.need("ssm.state_size")), "n_groups": int(m.get("ssm.group_count", 1)),
            "conv_kernel": int(m.need("ssm.conv_kernel")), "num_hidden_layers": int(m.need("block_count")),
            "layer_norm_epsilon": m.eps("layer_norm_rms_epsilon"),
            "max_position_embeddings": int(m.need("context_length")),
            "use_bias": m.has_layer_tensor("ssm_in.bias"), "use_conv_bias": m.has_layer_tensor("ssm_conv1d.bias"),
            # the dt projection's rank: unused by both modules, and not in the file
            "hidden_act": "silu", "residual_in_fp32": True, "time_step_rank": "auto",
            # llama.cpp's scan does not clip the time step: transformers' default, unclipped
            "time_step_limit": [0.0, float("inf")], "tie_word_embeddings": m.tied}


def _mamba2_fix(stem: str, kind: str, w: np.ndarray, config: dict) -> np.ndarray:
    if stem == "ssm_a":  # llama.cpp stores A = -exp(A_log)
        return np.log(-w.reshape(-1))
    if stem in ("ssm_d", "ssm_norm"):  # a column per head; a row per group
        return w.reshape(-1)
    if stem == "ssm_conv1d" and kind == "weight":
        return w[:, None, :]  # the depthwise kernel's channel axis, which llama.cpp drops
    return w


_MLA = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
        "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
        "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa", "attn_kv_a_norm": "self_attn.kv_a_layernorm",
        "attn_kv_b": "self_attn.kv_b_proj", "attn_k_b": "self_attn.k_b", "attn_v_b": "self_attn.v_b",
        "attn_output": "self_attn.o_proj", **GATED_FFN, "ffn_gate_inp": "mlp.gate",
        "exp_probs_b": "mlp.gate.e_score_correction_bias", "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
        "ffn_up_exps": "mlp.experts.{e}.up_proj", "ffn_down_exps": "mlp.experts.{e}.down_proj",
        "ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
        "ffn_down_shexp": "mlp.shared_experts.down_proj"}
_DBRX_BLOCK = "norm_attn_norm"

LAYOUTS_OWN: dict[str, Layout] = {
    "hunyuan-dense": Layout(_hunyuan_dense, {**LLAMA, "attn_q_norm": "self_attn.query_layernorm",
                                             "attn_k_norm": "self_attn.key_layernorm"}),
    # EXAONE 3 under the hub's remote-code names, which both backends read (transformers renames them)
    "exaone": Layout(_exaone, {"attn_norm": "ln_1", "ffn_norm": "ln_2", "attn_q": "attn.attention.q_proj",
                               "attn_k": "attn.attention.k_proj", "attn_v": "attn.attention.v_proj",
                               "attn_output": "attn.attention.out_proj", "ffn_gate": "mlp.c_fc_0",
                               "ffn_up": "mlp.c_fc_1", "ffn_down": "mlp.c_proj"},
                     final_norm="transformer.ln_f", block="transformer.h", embed="transformer.wte",
                     config_tensors=ROPE_FREQS),
    "exaone4": Layout(_exaone4, {**ATTN, **QK_NORM, **GATED_FFN, "post_attention_norm": "post_attention_layernorm",
                                 "post_ffw_norm": "post_feedforward_layernorm"}, config_tensors=ROPE_FREQS),
    "phimoe": Layout(_phimoe, {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", **ATTN,
                               **MIXTRAL_EXPERTS},
                     config_tensors=("rope_factors_long.weight", "rope_factors_short.weight")),
    # q and k are read apart (un-permuted from llama.cpp's rotary order), then fused again
    "internlm2": Layout(_internlm2, {"attn_norm": "attention_norm", "ffn_norm": "ffn_norm", "attn_q": "attention.wq",
                                     "attn_k": "attention.wk", "attn_v": "attention.wv", "attn_output": "attention.wo",
                                     "ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3",
                                     "ffn_down": "feed_forward.w2"},
                        rotary_interleaved=True, embed="model.tok_embeddings", head="output",
                        config_tensors=ROPE_FREQS, dense=("attn_q", "attn_k", "attn_v"), assemble=_internlm2_wqkv),
    "gptneox": Layout(_gptneox, {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                                 "attn_qkv": "attention.query_key_value", "attn_output": "attention.dense",
                                 "ffn_up": "mlp.dense_h_to_4h", "ffn_down": "mlp.dense_4h_to_h"},
                      final_norm="gpt_neox.final_layer_norm", block="gpt_neox.layers", embed="gpt_neox.embed_in",
                      head="embed_out", fix=_gptneox_fix, dense=("attn_qkv",)),
    "dbrx": Layout(_dbrx, {"attn_norm": f"{_DBRX_BLOCK}.norm_1", "attn_output_norm": f"{_DBRX_BLOCK}.norm_2",
                           "attn_qkv": f"{_DBRX_BLOCK}.attn.Wqkv", "attn_output": f"{_DBRX_BLOCK}.attn.out_proj",
                           "ffn_gate_inp": "ffn.router.layer", "ffn_gate_exps": "ffn.experts.mlp.w1",
                           "ffn_up_exps": "ffn.experts.mlp.v1", "ffn_down_exps": "ffn.experts.mlp.w2"},
                   final_norm="transformer.norm_f", block="transformer.blocks", embed="transformer.wte",
                   bare=("ffn.experts.mlp.w1", "ffn.experts.mlp.v1", "ffn.experts.mlp.w2"), fix=_dbrx_fix,
                   dense=("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")),
    # DeepSeek V2 and V3 (llama.cpp's deepseek2): V3 is the file that routes by sigmoid
    "deepseek2": Layout(_deepseek2, _MLA, config_tensors=ROPE_FREQS, bare=("mlp.gate.e_score_correction_bias",),
                        dense=("attn_k_b", "attn_v_b"), assemble=_deepseek2_kv_b),
    "mamba2": Layout(_mamba2, {"attn_norm": "norm", "ssm_in": "mixer.in_proj", "ssm_conv1d": "mixer.conv1d",
                               "ssm_dt": "mixer.dt_bias", "ssm_a": "mixer.A_log", "ssm_d": "mixer.D",
                               "ssm_norm": "mixer.norm", "ssm_out": "mixer.out_proj"},
                     final_norm="backbone.norm_f", block="backbone.layers", embed="backbone.embeddings",
                     bare=("mixer.dt_bias", "mixer.A_log", "mixer.D"), fix=_mamba2_fix,
                     dense=("ssm_a", "ssm_d", "ssm_norm", "ssm_conv1d")),
}
