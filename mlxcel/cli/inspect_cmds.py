"""`mlxcel show NAME` (what a checkpoint is, read from its files) and `mlxcel ps` (what a
running server serves, asked over HTTP).

`show` resolves NAME as the server resolves -m (a directory, owner/name, or a bare name under
MLXCEL_DEFAULT_ORG) but never downloads, and reads no weight: the parameter count comes from the
safetensors headers (mlxcel.store.describe). `ps` asks the server's /health, /models, /props and
/slots (with --api-key, else LLAMA_API_KEY, as a bearer token) and prints one row per model.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

from mlxcel.cli.store_cmds import _common, default_org, _fail, _human, _root


def summary_rows(s) -> list[tuple[str, str]]:
    """What `show` and `inspect` both print first about a checkpoint (store.describe's summary)."""
    return [
        ("path", str(s.path)),
        ("architecture", f"{s.model_type or '?'}" + (f" ({', '.join(s.architectures)})" if s.architectures else "")),
        ("parameters", f"{_count(s.parameters)} ({s.parameters:,})" if s.parameters is not None else "?"),
        ("quantization", s.quantization or "none"),
        ("dtype", s.dtype or "?"),
    ]


def _count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.1f}{unit}" if n < 100 * size else f"{n / size:.0f}{unit}"
    return str(n)


def cmd_show(args) -> int:
    from mlxcel.store.describe import describe
    from mlxcel.store.resolve import (AmbiguousName, ModelNotAvailable, ModelSourceRefused, prefer_local,
                                      resolve_model)

    root = _root(args)
    try:
        ref = prefer_local(args.name, root, default_org())
        path = resolve_model(ref, root=root, default_org=default_org(), offline=True, flag="show")
    except (ModelSourceRefused, AmbiguousName) as e:
        return _fail("show", str(e))
    except ModelNotAvailable:
        return _fail("show", f"{args.name} is not in the model store {root} (`mlxcel pull NAME` fetches a model)")
    s = describe(path)
    template = s.chat_template
    first = next((ln.strip() for ln in (template or "").splitlines() if ln.strip()), "")
    rows = [
        *summary_rows(s),
        ("context length", str(s.context_length) if s.context_length else "?"),
        ("size on disk", _human(s.size_bytes)),
        ("chat template", f"yes, {len(template)} characters" if template else "none (prompts are sent as plain text)"),
    ]
    if template:
        rows.append(("template starts", first if len(first) <= 100 else first[:97] + "..."))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    if args.template and template:
        print()
        print(template)
    return 0


def _get(base: str, route: str, key: str | None, timeout: float) -> tuple[int, dict | None]:
    req = urllib.request.Request(base + route, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"null")
        except ValueError:
            return e.code, None


def server_rows(base: str, key: str | None, timeout: float = 10) -> tuple[str, list[dict]]:
    """(the server's state, one dict per served model) from its HTTP routes."""
    status, health = _get(base, "/health", key, timeout)
    state = "ready" if status == 200 else ((health or {}).get("error") or {}).get("message") or f"HTTP {status}"
    status, listing = _get(base, "/models", key, timeout)
    if status == 401:
        raise PermissionError("the server wants an API key: pass --api-key (or set LLAMA_API_KEY)")
    models = [m for m in (listing or {}).get("data", []) if isinstance(m, dict)]
    _, props = _get(base, "/props", key, timeout)
    props = props if isinstance(props, dict) else {}
    slot_status, slots = _get(base, "/slots", key, timeout)
    busy = sum(1 for s in slots if s.get("is_processing")) if slot_status == 200 and isinstance(slots, list) else None
    backend = props.get("backend") or {}
    rows = []
    for m in models:
        meta = m.get("meta") or {}
        mine = props.get("model_alias") in (m.get("id"), None)
        rows.append({
            "model": m.get("id", "?"),
            "backend": f"{backend.get('name', '?')}/{backend.get('device', '?')}" if mine and backend else "-",
            "dtype": backend.get("dtype", "-") if mine else "-",
            "context": str(meta.get("n_ctx") or (props.get("default_generation_settings") or {}).get("n_ctx") or "-"),
            "slots": (f"{busy}/{props.get('total_slots')} busy" if busy is not None else str(props.get("total_slots", "-")))
            if mine else "-",
            "size": _human(meta["size"]) if isinstance(meta.get("size"), int) else "-",
        })
    return state, rows


def cmd_ps(args) -> int:
    base = args.url or f"http://{args.host}:{args.port}"
    key = args.api_key or os.environ.get("LLAMA_API_KEY") or None
    try:
        state, rows = server_rows(base.rstrip("/"), key)
    except PermissionError as e:
        return _fail("ps", str(e))
    except (urllib.error.URLError, OSError) as e:
        return _fail("ps", f"no server answers at {base} ({getattr(e, 'reason', e)})")
    print(f"server {base}: {state}")
    if not rows:
        print("no model loaded")
        return 0
    cols = ("model", "backend", "dtype", "context", "slots", "size")
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
    print("  ".join(c.upper().ljust(widths[c]) for c in cols).rstrip())
    for r in rows:
        print("  ".join(r[c].ljust(widths[c]) for c in cols).rstrip())
    return 0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("show", help="describe a checkpoint in the store (no weight is loaded)")
    p.add_argument("name", help="checkpoint directory, owner/name, or bare name")
    p.add_argument("--template", action="store_true", help="print the whole chat template too")
    _common(p)
    p.set_defaults(func=cmd_show)

    p = subparsers.add_parser("ps", help="what a running server serves")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--url", help="the server's base URL (instead of --host/--port)")
    p.add_argument("--api-key", help="the server's API key (default: LLAMA_API_KEY)")
    p.set_defaults(func=cmd_ps)
