"""GET /slots: the engine's live slot registry in b10621's slot-object shape.

Gated by --slots (on by default; --no-slots answers upstream's 501). With
`?fail_on_no_slot=1` the route answers 503 "no slot available" when every slot is busy.
`prompt` and `generated` stay empty: upstream fills them only under its slots debug gate.
POST /slots/{id_slot} (save/restore/erase) needs --slot-save-path, and is not offered yet.
"""

from __future__ import annotations

from litestar import Request, get, post

from mlxcel.api.errors import ApiError
from mlxcel.api.llamacpp.render import generation_settings
from mlxcel.api.openai.generation import served_model
from mlxcel.api.state import AppState
from mlxcel.engine.types import GenerationRequest, SlotInfo


def slot_json(info: SlotInfo, defaults: GenerationRequest) -> dict:
    req = info.request or defaults
    return {
        "id": info.id, "n_ctx": info.n_ctx, "speculative": False, "is_processing": info.is_processing,
        "id_task": info.id_task, "n_prompt_tokens": info.n_prompt_tokens,
        "n_prompt_tokens_processed": info.n_prompt_tokens_processed,
        "n_prompt_tokens_cache": info.n_prompt_tokens_cache,
        "params": generation_settings(req, stream=False, timings_per_token=False, metrics_only=True),
        "next_token": [{"has_next_token": info.has_next_token, "has_new_line": info.has_new_line,
                        "n_remain": info.n_remain, "n_decoded": info.n_decoded}],
        "prompt": "", "generated": "",
    }


@get("/slots")
async def get_slots(request: Request, app_state: AppState) -> list:
    if not app_state.settings.slots:
        raise ApiError(501, "This server does not support slots endpoint. Start it with `--slots`",
                       code="not_supported", type="not_supported_error")
    model = served_model(app_state, None)
    infos = model.engine.slots()
    flag = request.query_params.get("fail_on_no_slot", "")
    if flag not in ("", "0", "false") and not any(not s.is_processing for s in infos):
        raise ApiError(503, "no slot available", code="unavailable", type="unavailable_error")
    defaults = GenerationRequest(prompt=[], params=model.defaults, max_tokens=model.n_predict,
                                 ignore_eos=model.ignore_eos)
    return [slot_json(s, defaults) for s in infos]


@post("/slots/{id_slot:str}", status_code=200)
async def slot_action(app_state: AppState, id_slot: str) -> dict:
    if app_state.settings.slot_save_path is None:
        raise ApiError(501, "This server does not support slots action. Start it with `--slot-save-path`",
                       code="not_supported", type="not_supported_error")
    raise ApiError(501, "slot save, restore and erase are not implemented by this server yet",
                   code="not_supported", type="not_supported_error")
