"""GET /slots: the engine's live slot registry in b10621's slot-object shape.

Gated by --slots (on by default; --no-slots answers upstream's 501). With
`?fail_on_no_slot=1` the route answers 503 "no slot available" when every slot is busy.
`prompt` and `generated` stay empty: upstream fills them only under its slots debug gate.
POST /slots/{id_slot}?action=save|restore|erase needs --slot-save-path (501 without): upstream's
response shapes and wordings; what a slot keeps is its token stream (engine/slot_actions.py), in
files under the save directory (slot_files.py).
"""

from __future__ import annotations

import asyncio
import functools
import re
import time

from litestar import Request, get, post

from mlxcel.api.body import read_json_object
from mlxcel.api.errors import ApiError
from mlxcel.api.llamacpp.slot_files import SlotFileError, confined_path, fingerprint, read_slot, write_slot
from mlxcel.api.llamacpp.render import generation_settings
from mlxcel.api.openai.generation import served_model
from mlxcel.api.state import AppState
from mlxcel.engine.slot_actions import ACTIONS, RESTORE_FAILED
from mlxcel.engine.types import EngineError, GenerationRequest, SlotInfo


def slot_json(info: SlotInfo, defaults: GenerationRequest, speculative: bool = False) -> dict:
    req = info.request or defaults
    return {
        "id": info.id, "n_ctx": info.n_ctx, "speculative": speculative, "is_processing": info.is_processing,
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
    if not app_state.settings.server.slots:
        raise ApiError(501, "This server does not support slots endpoint. Start it with `--slots`",
                       code="not_supported", type="not_supported_error")
    model = served_model(app_state, None)
    infos = model.engine.slots()
    flag = request.query_params.get("fail_on_no_slot", "")
    if flag not in ("", "0", "false") and not any(not s.is_processing for s in infos):
        raise ApiError(503, "no slot available", code="unavailable", type="unavailable_error")
    defaults = GenerationRequest(prompt=[], params=model.defaults, max_tokens=model.n_predict,
                                 ignore_eos=model.ignore_eos)
    spec = model.engine.speculator is not None  # every slot speculates when the server does
    return [slot_json(s, defaults, spec) for s in infos]


_STOI = re.compile(r"[ \t\n\v\f\r]*[+-]?[0-9]+")  # std::stoi: a leading integer, the rest ignored


def _bad(message: str) -> ApiError:
    return ApiError(400, message, code="invalid_request")


async def _run(engine, action: str, slot: int, tokens: list[int] | None = None):
    try:
        return await asyncio.wrap_future(engine.submit_slot_action(action, slot, tokens))
    except EngineError as e:
        raise ApiError(e.status, e.message, code=e.code) from None


@post("/slots/{id_slot:str}", status_code=200)
async def slot_action(request: Request, app_state: AppState, id_slot: str) -> dict:
    """b10621's save / restore / erase of one slot's state (here: its token stream)."""
    root = app_state.settings.server.slot_save_path
    if root is None:
        raise ApiError(501, "This server does not support slots action. Start it with `--slot-save-path`",
                       code="not_supported", type="not_supported_error")
    m = _STOI.match(id_slot)
    if m is None or not -(2**31) <= int(m.group()) < 2**31:
        raise _bad("Invalid slot ID")
    slot = int(m.group())
    action = request.query_params.get("action", "")
    if action not in ACTIONS:
        raise _bad("Invalid action")
    model = served_model(app_state, None)
    if action == "erase":
        return {"id_slot": slot, "n_erased": await _run(model.engine, "erase", slot)}
    body = await read_json_object(request)
    filename = body.get("filename")
    if not isinstance(filename, str):
        raise _bad("\"filename\" is required and must be a string")
    try:
        path = confined_path(root, filename)
    except SlotFileError as e:
        raise _bad(str(e)) from None
    identity = _fingerprint(model.info.path)
    t0 = time.perf_counter()
    if action == "save":
        tokens = await _run(model.engine, "save", slot)
        n_written = await asyncio.to_thread(write_slot, path, tokens, fingerprint=identity, model=model.id)
        return {"id_slot": slot, "filename": filename, "n_saved": len(tokens), "n_written": n_written,
                "timings": {"save_ms": (time.perf_counter() - t0) * 1e3}}
    try:
        tokens, n_read = await asyncio.to_thread(read_slot, path, fingerprint=identity,
                                                 n_vocab=model.info.vocab_size)
    except SlotFileError as e:
        raise _bad(f"{RESTORE_FAILED} ({e})") from None
    n_restored = await _run(model.engine, "restore", slot, tokens)
    return {"id_slot": slot, "filename": filename, "n_restored": n_restored, "n_read": n_read,
            "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3}}


@functools.lru_cache(maxsize=8)
def _fingerprint(path) -> str:
    return fingerprint(path)
