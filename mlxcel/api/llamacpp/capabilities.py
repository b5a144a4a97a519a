"""What the server resolved it can do: /props' `capabilities` block, the props answer of a
server in --embeddings / --reranking mode (which has no chat model to describe), and the
per-model `capabilities` array /v1/models carries.

Everything here reports what is in force (the pooling the checkpoint or flag settled on, the
normalization default actually applied), not what was passed.
"""

from __future__ import annotations

from mlxcel import __version__
from mlxcel.api.state import AppState


def side_models(state: AppState) -> list[dict]:
    out = []
    if state.embedder is not None:
        e = state.embedder
        out.append({"id": e.id, "kind": "embedding", "pooling": e.pooling, "embd_normalize": e.normalize,
                    "n_ctx": e.n_ctx, "model_path": str(e.path)})
    if state.reranker is not None:
        r = state.reranker
        out.append({"id": r.id, "kind": "rerank", "pooling": "rank", "embd_normalize": None,
                    "n_ctx": r.n_ctx, "model_path": str(r.path)})
    if state.transcriber is not None:
        w = state.transcriber
        out.append({"id": w.id, "kind": "transcription", "pooling": None, "embd_normalize": None,
                    "n_ctx": w.n_ctx, "model_path": str(w.path)})
    if state.speaker is not None:
        w = state.speaker
        out.append({"id": w.id, "kind": "speech", "pooling": None, "embd_normalize": None,
                    "n_ctx": w.n_ctx, "model_path": str(w.path), "voices": list(w.voices),
                    "sample_rate": w.sample_rate})
    return out


def capabilities(state: AppState) -> dict:
    flag = state.plan.restricted_by if state.plan is not None else None
    return {"generation": flag is None, "restricted_by": flag, "side_models": side_models(state)}


def mode_props(state: AppState) -> dict:
    """GET /props under a mode flag: the server-level keys plus capabilities."""
    s = state.settings
    sides = side_models(state)
    first = sides[0] if sides else {}
    return {
        "total_slots": 1,
        "model_alias": first.get("id", ""),
        "model_path": first.get("model_path", ""),
        "modalities": {"vision": False, "video": False, "audio": state.transcriber is not None},
        "endpoint_slots": s.server.slots,
        "endpoint_props": s.server.props,
        "endpoint_metrics": s.server.metrics,
        "ui": s.server.webui or bool(s.server.static_path),
        "build_info": f"mlxcel-{__version__}",
        "is_sleeping": False,
        "cors_proxy_enabled": False,
        "capabilities": capabilities(state),
    }


def model_capabilities(state: AppState, kind: str) -> list[str]:
    """The /v1/models label for one entry: empty (omitted) on a plain generation server."""
    if kind == "chat":
        return ["completion"] if state.plan is not None else []
    return [kind]
