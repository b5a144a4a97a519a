"""POST /v1/chat/completions/control: end the thinking of a running completion.

A chat request with `reasoning_control: true` is armed under its completion id (the `id`
of its response or chunks). `{"id": ..., "action": "reasoning_end"}` trips the request's
`ReasoningControl`: each of its rows still thinking has the budget message and the close
tag forced on its next steps, exactly as a spent `--reasoning-budget` closes it. Upstream's
answers: 400 for a missing id or an unknown action; 200 `{"success": false, "message"}`
for an id that is unknown, finished or not armed; 200 `{"success": true}` once set.
"""

from __future__ import annotations

from typing import Any

from litestar import Request, post

from mlxcel.api.body import read_json_object
from mlxcel.api.errors import ApiError
from mlxcel.api.state import AppState
from mlxcel.config.limits import echo
from mlxcel.engine.reasoning_budget import ReasoningControl

ACTIONS = ("reasoning_end",)
MAX_ARMED = 1024  # finished entries are pruned first; this bounds a flood of armed requests


def _live(entry: tuple[ReasoningControl, list[Any]]) -> bool:
    return any(not h.finished and not h.cancelled for h in entry[1])


def arm(state: AppState, completion_id: str, control: ReasoningControl, handles: list[Any]) -> None:
    armed = state.reasoning_controls
    for key in [k for k, v in armed.items() if not _live(v)]:
        del armed[key]
    while len(armed) >= MAX_ARMED:
        del armed[next(iter(armed))]
    armed[completion_id] = (control, list(handles))


@post("/v1/chat/completions/control", status_code=200)
async def control(request: Request, app_state: AppState) -> dict[str, Any]:
    body = await read_json_object(request)
    cid, action = body.get("id"), body.get("action")
    if not isinstance(cid, str) or not cid:
        raise ApiError(400, "'id' is required", code="invalid_parameter", param="id")
    if action not in ACTIONS:
        raise ApiError(400, f"unknown action {echo(action)!r} (expected one of: {', '.join(ACTIONS)})",
                       code="invalid_parameter", param="action")
    entry = app_state.reasoning_controls.get(cid)
    if entry is None or not _live(entry):
        app_state.reasoning_controls.pop(cid, None)
        return {"success": False, "message": f"no running completion '{cid}' armed with reasoning_control"}
    entry[0].end()
    return {"success": True}
