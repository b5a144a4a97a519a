"""GET /props (always mounted, b10621's key set) and POST /props (gated by --props).

`default_generation_settings` is upstream's {params, n_ctx} shape with the metrics-only
task_params subset, from the server defaults; keys for features this server lacks are
omitted rather than invented. One key is mlxcel's own: `backend` (name, device, why it was
chosen, compute dtype), since the same server may run on MLX or torch. POST /props acknowledges and changes
nothing, exactly as upstream's handler does.
"""

from __future__ import annotations

from litestar import Request, Response, get, post

from mlxcel import __version__
from mlxcel.api.errors import ApiError
from mlxcel.api.llamacpp.render import generation_settings
from mlxcel.api.openai.generation import served_model
from mlxcel.api.state import AppState
from mlxcel.chat.chat_template import TemplateError, render_chat
from mlxcel.engine.types import GenerationRequest
from mlxcel.runtime.served import ServedModel

MEDIA_MARKER = "<__media__>"
_FTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def model_ftype(model: ServedModel) -> str:
    info = model.info
    return f"MLX {info.quantization}" if info.quantization else _FTYPES.get(info.checkpoint_dtype, info.checkpoint_dtype)


def kv_mode(app_state: AppState, model: ServedModel) -> dict:
    """The KV storage mode as --cache-type-k / -v set it, and the dtype unquantized KV is kept in
    (the compute dtype: `f16` names "unquantized", as b10621's default does)."""
    kv = app_state.settings.kv
    return {"type_k": kv.cache_type_k, "type_v": kv.cache_type_v, "dtype": model.info.dtype}


def weight_bytes(model: ServedModel) -> int | None:
    """The loaded parameters' bytes (None while the engine sleeps without its backend)."""
    backend = model.engine.backend
    return getattr(backend, "weight_nbytes", None) if backend is not None else None


def chat_template_caps(template: str | None) -> dict[str, bool]:
    """What the template can express, probed the way its text and a render show it."""
    if not template:
        return {"supports_system_role": False, "supports_tools": False, "supports_tool_calls": False}
    marker = "mlxcel-system-probe"
    try:
        rendered = render_chat(template, [{"role": "system", "content": marker}, {"role": "user", "content": "hi"}])
        system = marker in rendered
    except TemplateError:
        system = False
    return {"supports_system_role": system, "supports_tools": "tools" in template,
            "supports_tool_calls": "tool_calls" in template}


def props_json(app_state: AppState, model: ServedModel) -> dict:
    s = app_state.settings
    tok = model.tokenizer
    defaults = GenerationRequest(prompt=[], params=model.defaults, max_tokens=model.n_predict,
                                 ignore_eos=model.ignore_eos)
    return {
        "default_generation_settings": {
            "params": generation_settings(defaults, stream=False, timings_per_token=False, metrics_only=True),
            "n_ctx": model.n_ctx,
        },
        "total_slots": model.engine.parallel,
        "model_alias": model.id,
        "model_ftype": model_ftype(model),
        "model_path": str(model.info.path),
        "modalities": {"vision": model.vision is not None and s.media.mmproj, "video": False, "audio": False},
        "media_marker": MEDIA_MARKER,
        "endpoint_slots": s.server.slots,
        "endpoint_props": s.server.props,
        "endpoint_metrics": s.server.metrics,
        "ui": s.server.webui or bool(s.server.static_path),
        "ui_settings": {},
        "chat_template": tok.chat_template or "",
        "chat_template_caps": chat_template_caps(tok.chat_template),
        "bos_token": tok.bos_token or "",
        "eos_token": tok.eos_token or "",
        "build_info": f"mlxcel-{__version__}",
        "is_sleeping": model.engine.is_sleeping,
        "cors_proxy_enabled": False,
        # mlxcel's own resolved configuration (extensions; b10621 has no such keys)
        "backend": {"name": model.info.backend, "device": model.info.device, "reason": model.backend_reason,
                    "dtype": model.info.dtype, "compute_dtype": model.info.dtype, "checkpoint_dtype": model.info.checkpoint_dtype,
                    "quantization": model.info.quantization, "weight_bytes": weight_bytes(model)},
        "geometry": {"n_ctx": model.engine.n_ctx, "n_ctx_slot": model.n_ctx, "n_parallel": model.engine.parallel,
                     "n_batch": model.engine.batch_size, "n_ubatch": s.engine.ubatch_size},
        # the pool's occupancy, then whether the prefix cache and the context shift are on and why not
        # and its mode and bytes: capacity, in use (live sequences and the prefix cache), allocated so far
        "kv_cache": {**model.engine.kv_usage(), **model.engine.kv_policy(), **kv_mode(app_state, model),
                     **model.engine.kv_bytes()},
        # the resolved speculative decoding (--spec-type / -md): null when off
        "speculative": spec.config.props() if (spec := model.engine.speculator) is not None else None,
        # the distributed group serving the model (--tp-size / --pp-size): null on one process
        "distributed": model.group.describe() if model.group is not None else None,
    }


@get("/props")
async def get_props(app_state: AppState) -> dict:
    from mlxcel.api.llamacpp.capabilities import capabilities, mode_props

    if app_state.plan is not None and app_state.plan.restricted_by:
        return mode_props(app_state)  # no chat model under --embeddings / --reranking
    return {**props_json(app_state, served_model(app_state, None)), "capabilities": capabilities(app_state)}


@post("/props", status_code=200)
async def post_props(request: Request, app_state: AppState) -> Response:
    if not app_state.settings.server.props:
        raise ApiError(501, "This server does not support changing global properties. Start it with `--props`",
                       code="not_supported", type="not_supported_error")
    return Response({"success": True})
