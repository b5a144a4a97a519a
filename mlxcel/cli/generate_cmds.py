"""`mlxcel generate`, `mlxcel chat` and `mlxcel run`: the engine from a terminal.

All three load the model exactly as the server does (mlxcel.runtime.load) and stream the engine's
token events to stdout, so what a user sees here is what a client of the server gets. `run NAME`
is `chat` (or, with a prompt, one chat turn) after resolving NAME and downloading it when the
store lacks it. A bare name is `<default org>/<name>` as the server reads -m, or else the one
store entry of that name under any owner. `generate` renders the prompt with the checkpoint's
chat template when it has one (--no-chat sends it as raw text) and ends with a line of
statistics on standard error: tokens per second and peak memory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

from mlxcel.chat.chat_template import render_chat, render_plain, thinking_by_default
from mlxcel.cli.memory_plan import apply_wired_limit, wired_limit_from
from mlxcel.cli.store_cmds import default_org
from mlxcel.config.settings import BackendSection, EngineSection, SamplingSection, ServerSettings, SourceSection
from mlxcel.engine.types import GenerationRequest, TokenEvent
from mlxcel.store.paths import store_root
from mlxcel.store.resolve import ModelNotAvailable, ModelSourceRefused, prefer_local, resolve_model



def _common(p: argparse.ArgumentParser, positional: bool = False) -> None:
    if positional:
        p.add_argument("model", metavar="NAME", help="checkpoint directory, owner/name, or bare name")
    else:
        p.add_argument("-m", "--model", required=True, help="checkpoint directory, owner/name, or bare name")
    p.add_argument("--models-dir", "--model-store-root", dest="store", type=Path, help="model store root")
    p.add_argument("--offline", action="store_true", help="never download")
    p.add_argument("-n", "--max-tokens", type=int, default=256)
    p.add_argument("--temp", type=float, default=None, help="temperature (0 = greedy)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=-1)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--backend", default="auto", choices=("auto", "mlx", "torch"))
    p.add_argument("--device", default=os.environ.get("MLXCEL_DEVICE", "auto"),
                   help="auto, cpu, cuda[:N], mps, metal (env: MLXCEL_DEVICE)")
    p.add_argument("-t", "--threads", type=int, default=-1,
                   help="CPU threads (torch: its thread count; MLX CPU: threads per large product; -1 = default)")


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate a completion for a prompt")
    _common(g)
    g.add_argument("-p", "--prompt", required=True)
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap the prompt as one user turn of the chat template (default: when the checkpoint "
                        "has one; --no-chat sends the prompt as raw text)")
    g.add_argument("--system", default=None, help="a system message (with the chat template)")
    g.set_defaults(func=run_generate)
    c = sub.add_parser("chat", help="an interactive chat in the terminal")
    _common(c)
    c.add_argument("--system", default=None, help="a system message")
    c.set_defaults(func=run_chat)
    r = sub.add_parser("run", help="chat with a model, downloading it first when the store lacks it")
    _common(r, positional=True)
    r.add_argument("prompt", nargs="?", help="answer this one message and exit instead of chatting")
    r.add_argument("--system", default=None, help="a system message")
    r.set_defaults(func=run_run)


def resolve_cli(ref: str, root: Path, offline: bool) -> Path:
    """-m as the server reads it, a bare name also finding a store entry under another owner
    (store.resolve.prefer_local); downloaded when missing unless offline."""
    org = default_org()
    try:
        return resolve_model(prefer_local(ref, root, org), root=root, default_org=org, offline=offline,
                             hf_token=os.environ.get("HF_TOKEN") or None)
    except (ModelSourceRefused, ModelNotAvailable) as e:
        raise SystemExit(f"error: {e}") from None


def _load(args):
    from mlxcel.cli.server import enable_fast_blas, prepare_cpu_runtime, refuse_unsupported
    from mlxcel.config.refusal import StartupRefusal

    try:
        path = resolve_cli(args.model, store_root(args.store, os.environ), args.offline)
        refuse_unsupported(json.loads((path / "config.json").read_text()))  # before any backend or weight
        enable_fast_blas()  # before mlx.core is imported by the runtime
        from mlxcel.runtime.load import load_served_model

        prepare_cpu_runtime(os.environ)
        settings = ServerSettings(source=SourceSection(model=args.model),
                                  engine=EngineSection(parallel=1, warmup=False),
                                  backend=BackendSection(name=args.backend, device=args.device, dtype=args.dtype,
                                                         threads=args.threads),
                                  sampling=SamplingSection(temperature=args.temp, top_k=args.top_k, top_p=args.top_p,
                                                           min_p=args.min_p, seed=args.seed))
        settings.backend.wired_limit_bytes = wired_limit_from(os.environ)
        if settings.backend.wired_limit_bytes is not None:  # applied on Metal, refused elsewhere, as the server does
            from mlxcel.runtime.load import select_backend

            apply_wired_limit(settings, select_backend(settings, path))
        return load_served_model(settings, path)
    except StartupRefusal as e:  # already "error: <one line>"
        raise SystemExit(str(e)) from None


async def stream_tokens(model, prompt: list[int], max_tokens: int, out=sys.stdout,
                        handles: list | None = None) -> tuple[str, TokenEvent | None]:
    """Write the answer as it comes; (its text, the last event). `handles` receives the engine
    handle, so a caller can cancel it."""
    handle = model.engine.submit(GenerationRequest(prompt=prompt, params=model.defaults, max_tokens=max_tokens))
    if handles is not None:
        handles.append(handle)
    parts, final = [], None
    try:
        async for ev in handle:
            if ev.error:
                raise SystemExit(f"error: {ev.error}")
            out.write(ev.text)
            out.flush()
            parts.append(ev.text)
            if ev.done:
                final = ev
    finally:
        handle.cancel()  # a no-op once finished; stops the row when the turn is interrupted
    return "".join(parts), final


def chat_prompt(model, messages) -> list[int]:
    tok = model.tokenizer
    if not tok.chat_template:
        return tok.encode(render_plain(messages), add_special_tokens=False)
    # the server's --reasoning auto: thinking on where the template has a thinking mode
    thinking = thinking_by_default(tok.chat_template, tok.bos_token, tok.eos_token)
    text = render_chat(tok.chat_template, messages, bos_token=tok.bos_token, eos_token=tok.eos_token,
                       extra={"enable_thinking": thinking})
    return tok.encode(text, add_special_tokens=False)


def stats_line(final: TokenEvent | None, seconds: float) -> str:
    from mlxcel.runtime.memory import peak_memory_text

    if final is None:
        return f"stopped after {seconds:.2f} s; peak memory {peak_memory_text()}"
    t = final.timings
    gen_ms = t.predicted_ms if t is not None and t.predicted_ms > 0 else seconds * 1000
    prompt = f"prompt {final.prompt_tokens} tokens"
    if t is not None and t.prompt_ms > 0 and t.prompt_n:
        prompt += f" ({t.prompt_n / t.prompt_ms * 1000:.1f} tokens/s)"
    rate = final.completion_tokens / gen_ms * 1000 if gen_ms > 0 else 0.0
    return (f"{final.completion_tokens} tokens in {gen_ms / 1000:.2f} s ({rate:.1f} tokens/s), {prompt}; "
            f"peak memory {peak_memory_text()}")


def run_generate(args) -> int:
    model = _load(args)
    use_chat = args.chat if args.chat is not None else bool(model.tokenizer.chat_template)
    if use_chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        prompt = chat_prompt(model, [*messages, {"role": "user", "content": args.prompt}])
    else:
        if args.system:
            raise SystemExit("error: --system needs the chat template (drop --no-chat)")
        prompt = model.tokenizer.encode(args.prompt)
    start, final, code = time.perf_counter(), None, 0
    try:
        _, final = asyncio.run(stream_tokens(model, prompt, args.max_tokens))
    except KeyboardInterrupt:  # the row is cancelled; what was written stays, and the line below says so
        code = 130
    finally:
        model.engine.shutdown()
    print()
    print(stats_line(final, time.perf_counter() - start), file=sys.stderr)
    _exit(code)


def run_chat(args) -> int:
    from mlxcel.cli.chat_repl import ChatSession

    model = _load(args)
    try:
        ChatSession(model, args.max_tokens, args.system, name=args.model).loop()
    finally:
        model.engine.shutdown()
    _exit(0)


def run_run(args) -> int:
    if args.prompt is None:
        return run_chat(args)
    model = _load(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    try:
        asyncio.run(stream_tokens(model, chat_prompt(model, [*messages, {"role": "user", "content": args.prompt}]),
                                  args.max_tokens))
    finally:
        model.engine.shutdown()
    print()
    _exit(0)


def _exit(code: int) -> None:
    """Leave without interpreter teardown: MLX's native threads can abort the process while
    static destructors run (seen as 'terminate called without an active exception')."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
